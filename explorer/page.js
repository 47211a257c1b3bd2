// The explorer page: fills the tables from the node's JSON (broker/explorer.py) and
// checks an inclusion proof in the browser (verify.js). Everything shown is set with
// textContent: group ids and record bytes are the world's, never markup.
const b4a = require('b4a')
const { verifyProof, archiveKeyFromCatalog } = require('./verify.js')
const { decodeBatch } = require('./records.js')

const $ = (id) => document.getElementById(id)
const short = (hex) => (hex ? hex.slice(0, 16) + '…' : '—')

function cell (tr, text, title) {
  const td = document.createElement('td')
  td.textContent = text === null || text === undefined ? '—' : String(text)
  if (title) td.title = title
  tr.appendChild(td)
  return td
}

function fill (id, rows) {
  const body = $(id)
  body.replaceChildren()
  for (const row of rows) {
    const tr = document.createElement('tr')
    for (const c of row) cell(tr, ...(Array.isArray(c) ? c : [c]))
    body.appendChild(tr)
  }
  if (!rows.length) {
    const tr = document.createElement('tr')
    cell(tr, 'none').colSpan = 20
    body.appendChild(tr)
  }
}

async function json (url) {
  const r = await fetch(url, { cache: 'no-store' })
  const doc = await r.json()
  if (!r.ok) throw new Error(doc.error || r.statusText)
  return doc
}

async function refresh () {
  const [topics, groups, mirrors] = await Promise.all(
    ['/v1/topics', '/v1/groups', '/v1/mirrors'].map(json))
  $('node-key').textContent = topics.node_key
  const rows = []
  for (const t of topics.topics) {
    for (const p of t.partitions) {
      rows.push([t.topic + (t.mirrored ? ' (mirrored)' : ''), p.partition, p.log_start_offset,
        p.high_watermark, p.length, [short(p.tree_hash), p.tree_hash], [short(p.signature), p.signature],
        [short(p.archive_key), p.archive_key]])
    }
  }
  fill('topics', rows)
  fill('mirrors', mirrors.mirrors.flatMap((m) => m.archives.map((a) =>
    [[short(m.mirror), m.mirror], a.archive, a.verified, a.signed, a.lag])))
  fill('groups', groups.groups.flatMap((g) => (g.offsets.length ? g.offsets : [{}]).map((o) =>
    [g.group, g.state, o.topic, o.partition, o.committed, o.high_watermark, o.lag])))
}

function text (bytes) {
  if (bytes === null) return 'null'
  const s = b4a.toString(bytes, 'utf8')
  return s.length > 200 ? s.slice(0, 200) + '…' : s
}

async function verify (event) {
  if (event) event.preventDefault()
  const topic = $('v-topic').value.trim()
  const partition = $('v-partition').value.trim()
  const offset = $('v-offset').value.trim()
  const out = $('verdict')
  out.className = ''
  out.textContent = 'fetching the proof…'
  $('records').replaceChildren()
  try {
    const catalog = await json(`/v1/catalog?topic=${encodeURIComponent(topic)}`)
    let nodeKey = $('v-key').value.trim()
    let pinned = true
    if (!nodeKey) { nodeKey = catalog.node_key; pinned = false }
    const chain = archiveKeyFromCatalog(catalog, nodeKey, topic, Number(partition))
    const proof = await json(`/v1/partitions/${encodeURIComponent(topic)}/${encodeURIComponent(partition)}/proof?offset=${encodeURIComponent(offset)}`)
    const result = chain.ok ? verifyProof(proof, chain.archiveKey) : chain
    if (result.ok) {
      out.className = 'ok'
      out.textContent = `VERIFIED: offset ${offset} is in block ${proof.block_index} of ${topic}-${partition}, ` +
        `under a head of length ${result.length} signed by its writer, whose archive key ${short(chain.archiveKey)} ` +
        `the catalog signed by node key ${short(nodeKey)} lists` +
        (pinned ? '' : ' (node key taken from this node: pin the writer\'s, from `hyperkafka keys`, to trust no one)')
    } else {
      out.className = 'failed'
      out.textContent = `FAILED: ${result.reason}`
    }
    const batch = decodeBatch(b4a.from(proof.batch, 'base64'))
    const rows = batch.records.map((r) => [r.offset, text(r.key), text(r.value)])
    if (batch.codec !== 'none') rows.push(['', `${batch.count} records`, `(${batch.codec}-compressed)`])
    fill('records', rows)
  } catch (err) {
    out.className = 'failed'
    out.textContent = `FAILED: ${err.message}`
  }
}

function start () {
  $('verify-form').addEventListener('submit', verify)
  const q = new URLSearchParams(location.search)
  for (const f of ['topic', 'partition', 'offset', 'key']) if (q.has(f)) $('v-' + f).value = q.get(f)
  const tick = () => refresh().then(() => { $('status').textContent = 'updated ' + new Date().toLocaleTimeString() },
    (err) => { $('status').textContent = 'cannot read the node: ' + err.message })
  tick()
  setInterval(tick, 5000)
  if (q.has('offset')) verify()
}

module.exports = { start, verifyProof, archiveKeyFromCatalog, decodeBatch }

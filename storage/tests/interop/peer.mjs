// Node side of storage/tests/test_replication_interop.py: the stock npm hypercore
// (11.39.5) replicating over a loopback TCP socket with our Python implementation.
//
//   node peer.mjs fetch <port> <keyHex> <length> <sha256Hex>
//     Dial 127.0.0.1:<port> as the initiator, replicate core <keyHex>, download every
//     block (hypercore verifies each proof and the signed head), then check that the
//     length and the SHA-256 of all blocks concatenated are as given. Exit 0 if so.
//   node peer.mjs fetch-some <port> <keyHex> <length> <held> <sha256Hex> <removed>
//     As fetch, for an archive whose writer's cleaner removed some blocks: start a download
//     of the whole range (in parallel, not awaited), get each block
//     of <held> (comma-separated indexes), check the SHA-256 of them concatenated, then
//     ask for block <removed> with a 3 s timeout: it must not arrive. Prints {ok, removed}
//     (the error code hypercore gave for it).
//   node peer.mjs serve <blocks> <blockSize>
//     Write a core of <blocks> deterministic blocks with a fixed key pair, listen on
//     127.0.0.1 (free port) and print one JSON line {port, key, length, sha256,
//     publicKey}; serve every connection as the responder until stdin closes.
//   node peer.mjs serve-multisig <blocks> <blockSize> <seedBase> <signers> <signWith>
//     The same, for a core whose manifest names <signers> key pairs (seed i = byte
//     seedBase+i, x32) with Hypercore's default quorum; every append is signed by the
//     signers listed in <signWith> (comma-separated indexes, in that order) through
//     verifier.sign + lib/multisig.js assemble. Prints also {manifest, quorum}.
import Hypercore from 'hypercore'
import { createRequire } from 'node:module'
import hcrypto from 'hypercore-crypto'
import net from 'node:net'
import os from 'node:os'
import fs from 'node:fs'
import path from 'node:path'
import { createHash } from 'node:crypto'

const [mode, ...args] = process.argv.slice(2)
const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'hk-interop-'))
const cleanup = () => fs.rmSync(dir, { recursive: true, force: true })

function fail(msg) {
  console.error('peer: ' + msg)
  cleanup()
  process.exit(1)
}

async function fetch(port, keyHex, length, sha) {
  const core = new Hypercore(dir, Buffer.from(keyHex, 'hex'))
  await core.ready()
  const socket = net.connect(Number(port), '127.0.0.1')
  const stream = core.replicate(true, { keepAlive: false })
  socket.pipe(stream).pipe(socket)
  stream.on('error', (e) => console.error('peer: stream error', e.message))
  socket.on('error', (e) => console.error('peer: socket error', e.message))
  const t0 = process.hrtime.bigint()
  await core.update({ wait: true })
  if (core.length !== Number(length)) fail(`length ${core.length}, expected ${length}`)
  await core.download({ start: 0, end: core.length }).done()
  const h = createHash('sha256')
  let bytes = 0
  for (let i = 0; i < core.length; i++) {
    const b = await core.get(i, { wait: false })
    if (b === null) fail(`block ${i} missing after download`)
    h.update(b)
    bytes += b.byteLength
  }
  const secs = Number(process.hrtime.bigint() - t0) / 1e9
  const got = h.digest('hex')
  if (got !== sha) fail(`sha256 ${got}, expected ${sha}`)
  console.log(JSON.stringify({ ok: true, length: core.length, bytes, seconds: secs }))
  socket.destroy()
  await core.close()
  cleanup()
  process.exit(0)
}

async function fetchSome(port, keyHex, length, held, sha, removed) {
  const core = new Hypercore(dir, Buffer.from(keyHex, 'hex'))
  await core.ready()
  const socket = net.connect(Number(port), '127.0.0.1')
  const stream = core.replicate(true, { keepAlive: false })
  socket.pipe(stream).pipe(socket)
  stream.on('error', (e) => console.error('peer: stream error', e.message))
  socket.on('error', (e) => console.error('peer: socket error', e.message))
  await core.update({ wait: true })
  if (core.length !== Number(length)) fail(`length ${core.length}, expected ${length}`)
  core.download({ start: 0, end: core.length }) // everything it can, in parallel
  const h = createHash('sha256')
  for (const i of held.split(',').map(Number)) h.update(await core.get(i, { timeout: 10000 }))
  const got = h.digest('hex')
  if (got !== sha) fail(`sha256 ${got}, expected ${sha}`)
  let code = null
  try {
    const b = await core.get(Number(removed), { timeout: 3000 })
    fail(`got ${b === null ? 'null' : b.byteLength + ' bytes'} for removed block ${removed}`)
  } catch (e) {
    code = e.code || e.message
  }
  console.log(JSON.stringify({ ok: true, removed: code }))
  socket.destroy()
  await core.close()
  cleanup()
  process.exit(0)
}

function block(i, size) {
  // Deterministic, not trivially compressible: SHA-256 chain of the index.
  const out = Buffer.alloc(size)
  let h = createHash('sha256').update('block ' + i).digest()
  for (let o = 0; o < size; o += 32) {
    h.copy(out, o)
    h = createHash('sha256').update(h).digest()
  }
  return out
}

async function serve(blocks, size, seedBase, signers, signWith) {
  const multi = seedBase !== undefined
  const keyPair = hcrypto.keyPair(Buffer.alloc(32, 0x42))
  let core = null
  let append = null
  if (multi) {
    const require = createRequire(import.meta.url)
    const { assemble } = require('hypercore/lib/multisig.js')
    const kps = []
    for (let i = 0; i < Number(signers); i++) kps.push(hcrypto.keyPair(Buffer.alloc(32, Number(seedBase) + i)))
    core = new Hypercore(dir, { manifest: { signers: kps.map((kp) => ({ publicKey: kp.publicKey })) } })
    await core.ready()
    append = async (values) => {
      const tb = core.state.createTreeBatch()
      for (const v of values) tb.append(v)
      const inputs = signWith.split(',').map((i) => ({
        signer: Number(i), signature: core.core.verifier.sign(tb, kps[Number(i)]), patch: 0, nodes: null
      }))
      await core.append(values, { signature: assemble(inputs) })
    }
  } else {
    core = new Hypercore(dir, { keyPair })
    await core.ready()
    append = (values) => core.append(values)
  }
  const h = createHash('sha256')
  const batch = []
  for (let i = 0; i < Number(blocks); i++) {
    const b = block(i, Number(size))
    h.update(b)
    batch.push(b)
    if (batch.length === 256) await append(batch.splice(0))
  }
  if (batch.length) await append(batch)
  const server = net.createServer((socket) => {
    const stream = core.replicate(false, { keepAlive: false })
    socket.pipe(stream).pipe(socket)
    stream.on('error', () => {})
    socket.on('error', () => {})
  })
  server.listen(0, '127.0.0.1', () => {
    console.log(JSON.stringify({
      port: server.address().port,
      key: core.key.toString('hex'),
      publicKey: keyPair.publicKey.toString('hex'),
      manifest: core.getManifest({ raw: true }).toString('hex'),
      quorum: core.manifest.quorum,
      length: core.length,
      sha256: h.digest('hex')
    }))
  })
  process.stdin.resume()
  process.stdin.on('end', async () => {
    server.close()
    await core.close()
    cleanup()
    process.exit(0)
  })
}

if (mode === 'fetch') fetch(...args).catch((e) => fail(e.stack))
else if (mode === 'fetch-some') fetchSome(...args).catch((e) => fail(e.stack))
else if (mode === 'serve') serve(...args.slice(0, 2)).catch((e) => fail(e.stack))
else if (mode === 'serve-multisig') serve(...args).catch((e) => fail(e.stack))
else fail('usage: peer.mjs fetch|serve|serve-multisig ...')

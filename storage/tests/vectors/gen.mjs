// Golden vectors from the real npm `hypercore` (pinned in package.json) for
// storage/tests/test_hypercore_vectors.py. Deterministic: fixed seeds, fixed block
// contents, ed25519 signatures are deterministic. No timestamps, no random bytes.
//
//   node gen.mjs [out.json]      (default: hypercore_vectors.json next to this file)
//
// Block j of a "rule" core has rule.sizes[j] bytes, byte k = (salt + 7*j + k) % 256.

import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const Hypercore = require('hypercore')
const crypto = require('hypercore-crypto')
const c = require('compact-encoding')
const messages = require('hypercore/lib/messages.js')
const { MerkleTree } = require('hypercore/lib/merkle-tree.js')

const here = path.dirname(fileURLToPath(import.meta.url))
const out = process.argv[2] || path.join(here, 'hypercore_vectors.json')

const hex = (b) => (b === null || b === undefined ? null : Buffer.from(b).toString('hex'))
const node = (n) => ({ index: n.index, size: n.size, hash: hex(n.hash) })

function ruleBlock(salt, j, size) {
  const b = Buffer.alloc(size)
  for (let k = 0; k < size; k++) b[k] = (salt + 7 * j + k) % 256
  return b
}

function cycleSizes(n, salt) {
  const sizes = []
  for (let j = 0; j < n; j++) sizes.push(((j * 13 + salt) % 61) + 1)
  return sizes
}

function jsonProof(p) {
  return {
    fork: p.fork,
    block: p.block
      ? { index: p.block.index, value: hex(p.block.value), nodes: p.block.nodes.map(node) }
      : null,
    hash: p.hash ? { index: p.hash.index, nodes: p.hash.nodes.map(node) } : null,
    upgrade: p.upgrade
      ? {
          start: p.upgrade.start,
          length: p.upgrade.length,
          nodes: p.upgrade.nodes.map(node),
          additionalNodes: p.upgrade.additionalNodes.map(node),
          signature: hex(p.upgrade.signature)
        }
      : null
  }
}

async function head(core) {
  const s = core.state
  const roots = await MerkleTree.getRoots(s, s.length)
  return {
    length: s.length,
    fork: s.fork,
    byteLength: s.byteLength,
    roots: roots.map(node),
    treeHash: hex(crypto.tree(roots)),
    signature: hex(s.signature)
  }
}

function pickBlocks(n) {
  if (n <= 13) return [...Array(n).keys()]
  const s = new Set([0, 1, 2, 3, 7, 8, Math.floor(n / 2), n - 3, n - 2, n - 1])
  return [...s].filter((i) => i >= 0 && i < n).sort((a, b) => a - b)
}

function pickStarts(n) {
  if (n <= 13) return [...Array(n).keys()]
  const s = new Set([0, 1, 2, 3, 4, 5, 8, 16, 31, 32, 33, Math.floor(n / 2), n - 2, n - 1])
  return [...s].filter((i) => i >= 0 && i < n).sort((a, b) => a - b)
}

async function proofs(core, maxValue) {
  const n = core.length
  const list = []
  let id = 1
  const add = async (request) => {
    const p = await core.proof(request)
    if (p.block && p.block.value && p.block.value.byteLength > maxValue) return
    const wire = c.encode(messages.wire.data, { request: id, ...p, manifest: null })
    list.push({ request, proof: jsonProof(p), wireRequestId: id, wire: hex(wire) })
    id++
  }

  for (const i of pickBlocks(n)) {
    const max = MerkleTree.maxMissingNodes(2 * i, n)
    // Plain inclusion proofs: `nodes` = how many levels of siblings the requester lacks.
    for (const k of new Set([0, 1, max])) {
      if (k <= max) await add({ block: { index: i, nodes: k } })
    }
    // Block + upgrade from scratch: the path is folded into the upgrade.
    await add({ block: { index: i, nodes: 0 }, upgrade: { start: 0, length: n } })
    // Block + upgrade from a requester at length m.
    for (const m of [i, i + 1, Math.floor((i + n) / 2)]) {
      if (m <= 0 || m >= n) continue
      const nodes = m > i ? MerkleTree.maxMissingNodes(2 * i, m) : 0
      await add({ block: { index: i, nodes }, upgrade: { start: m, length: n - m } })
    }
  }

  for (const m of pickStarts(n)) {
    // Consistency proof from length m to the head.
    await add({ upgrade: { start: m, length: n - m } })
    // Upgrade to an intermediate length: additionalNodes carry the rest to the head.
    const k = Math.max(1, Math.floor((n - m) / 2))
    if (m + k < n) await add({ upgrade: { start: m, length: k } })
  }

  // Hash (node) proofs for some interior nodes.
  for (const root of (await MerkleTree.getRoots(core.state, n))) {
    if ((root.index & 1) === 0) continue
    const leftChild = root.index - ((root.index + 1) & -(root.index + 1)) / 2
    const max = MerkleTree.maxMissingNodes(leftChild, n)
    await add({ hash: { index: leftChild, nodes: max } })
  }

  return list
}

async function makeCore(dir, spec) {
  const keyPair = crypto.keyPair(Buffer.from(spec.seed, 'hex'))
  const core = new Hypercore(path.join(dir, spec.name), { keyPair })
  await core.ready()

  const blocks = spec.blocks.hex
    ? spec.blocks.hex.map((h) => Buffer.from(h, 'hex'))
    : spec.blocks.rule.sizes.map((size, j) => ruleBlock(spec.blocks.rule.salt, j, size))

  const heads = []
  const ops = spec.ops || [{ append: blocks.length }]
  let next = 0
  for (const op of ops) {
    if (op.append !== undefined) {
      for (let j = 0; j < op.append; j++) {
        await core.append(blocks[next++])
        heads.push(await head(core))
      }
    } else if (op.truncate !== undefined) {
      await core.truncate(op.truncate)
      heads.push(await head(core))
      next = op.truncate
    }
  }

  const result = {
    name: spec.name,
    seed: spec.seed,
    publicKey: hex(keyPair.publicKey),
    key: hex(core.key),
    discoveryKey: hex(core.discoveryKey),
    manifest: hex(core.getManifest({ raw: true })),
    blocks: spec.blocks,
    ops,
    heads,
    proofs: await proofs(core, spec.maxProofValue || 4096)
  }
  await core.close()
  return result
}

const specs = [
  {
    name: 'golden-5',
    seed: '07'.repeat(32),
    blocks: { hex: ['a', 'bb', 'ccc', 'dddd', 'eeeee'].map((s) => Buffer.from(s).toString('hex')) }
  }
]
for (const [i, n] of [1, 2, 3, 5, 8, 13, 100, 131].entries()) {
  specs.push({
    name: 'count-' + n,
    seed: (0x10 + i).toString(16).padStart(2, '0').repeat(32),
    blocks: { rule: { salt: i * 31, sizes: cycleSizes(n, i) } }
  })
}
specs.push({
  name: 'large-blocks',
  seed: '21'.repeat(32),
  // 70000 > 0xffff exercises the 0xfe varint; 1000 the 0xfd one.
  blocks: { rule: { salt: 5, sizes: [1000, 70000, 300, 5, 253, 254] } }
})
specs.push({
  name: 'forked',
  seed: '22'.repeat(32),
  blocks: { rule: { salt: 9, sizes: cycleSizes(11, 3) } },
  // truncate bumps the fork to 1; the heads after it sign fork 1.
  ops: [{ append: 9 }, { truncate: 6 }, { append: 5 }]
})

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'hk-vectors-'))
try {
  const cores = []
  for (const spec of specs) cores.push(await makeCore(tmp, spec))
  const pkg = (name) => require(name + '/package.json').version
  const doc = {
    comment:
      'Generated by gen.mjs from the npm packages below; do not edit. ' +
      'Rule blocks: block j has sizes[j] bytes, byte k = (salt + 7*j + k) % 256.',
    generator: {
      hypercore: pkg('hypercore'),
      'hypercore-crypto': pkg('hypercore-crypto'),
      'flat-tree': pkg('flat-tree'),
      'compact-encoding': pkg('compact-encoding')
    },
    cores
  }
  fs.writeFileSync(out, JSON.stringify(doc, null, 1) + '\n')
} finally {
  fs.rmSync(tmp, { recursive: true, force: true })
}

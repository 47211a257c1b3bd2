// Golden multisig vectors from the real npm `hypercore` (pinned in package.json) for
// storage/tests/test_hypercore_multisig.py. Deterministic: fixed seeds, fixed blocks,
// ed25519 is deterministic.
//
//   node gen_multisig.mjs [out.json]   (default: multisig_vectors.json next to this file)
//
// Each core: a v1 manifest of N signers (seed i = byte (base+i) x 32) with Hypercore's
// default quorum; blocks are appended in groups, and each head is signed by a quorum of
// signers through Hypercore's own verifier.sign + lib/multisig.js assemble, then
// accepted by core.append({ signature }) (so Hypercore verified it). Block j has
// sizes[j] bytes, byte k = (salt + 7*j + k) % 256.

import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const require = createRequire(import.meta.url)
const Hypercore = require('hypercore')
const crypto = require('hypercore-crypto')
const { assemble, inflate } = require('hypercore/lib/multisig.js')
const { MerkleTree } = require('hypercore/lib/merkle-tree.js')

const here = path.dirname(fileURLToPath(import.meta.url))
const out = process.argv[2] || path.join(here, 'multisig_vectors.json')
const hex = (b) => (b === null || b === undefined ? null : Buffer.from(b).toString('hex'))

function ruleBlock(salt, j, size) {
  const b = Buffer.alloc(size)
  for (let k = 0; k < size; k++) b[k] = (salt + 7 * j + k) % 256
  return b
}

function keyPairs(base, n) {
  const kps = []
  for (let i = 0; i < n; i++) kps.push(crypto.keyPair(Buffer.alloc(32, base + i)))
  return kps
}

async function makeCore(dir, spec) {
  const kps = keyPairs(spec.seedBase, spec.signers)
  const manifest = {
    allowPatch: !!spec.allowPatch,
    signers: kps.map((kp) => ({ publicKey: kp.publicKey }))
  }
  if (spec.quorum !== undefined) manifest.quorum = spec.quorum
  if (spec.userData !== undefined) manifest.userData = Buffer.from(spec.userData, 'hex')
  const core = new Hypercore(path.join(dir, spec.name), { manifest })
  await core.ready()
  const blocks = spec.sizes.map((size, j) => ruleBlock(spec.salt, j, size))
  const heads = []
  let next = 0
  for (const count of spec.groups) {
    const values = blocks.slice(next, next + count)
    next += count
    const batch = core.state.createTreeBatch()
    for (const v of values) batch.append(v)
    const partials = []
    for (let i = 0; i < kps.length; i++) {
      const sig = core.core.verifier.sign(batch, kps[i])
      // a one-signer manifest gets the assembled wrapper back; keep the bare signature
      partials.push(sig.byteLength === 64 ? sig : inflate(sig).proofs[0].signature)
    }
    // Hypercore checks the first `quorum` proofs: the signer order under test.
    const inputs = []
    for (const i of spec.signWith) {
      // what partialSignature(batchSession, i, from = to, ...) returns: no patch
      inputs.push({ signer: i, signature: partials[i], patch: 0, nodes: null })
    }
    const signature = assemble(inputs)
    await core.append(values, { signature })
    const roots = await MerkleTree.getRoots(core.state, core.state.length)
    heads.push({
      length: core.length,
      fork: core.fork,
      treeHash: hex(crypto.tree(roots)),
      signable: hex(batch.signable(core.key)),
      partials: partials.map(hex),
      signWith: spec.signWith,
      signature: hex(core.state.signature)
    })
  }
  const result = {
    name: spec.name,
    seedBase: spec.seedBase,
    publicKeys: kps.map((kp) => hex(kp.publicKey)),
    quorum: core.manifest.quorum,
    version: core.manifest.version,
    userData: spec.userData === undefined ? null : spec.userData,
    allowPatch: !!spec.allowPatch,
    manifest: hex(core.getManifest({ raw: true })),
    key: hex(core.key),
    discoveryKey: hex(core.discoveryKey),
    salt: spec.salt,
    sizes: spec.sizes,
    groups: spec.groups,
    heads
  }
  await core.close()
  return result
}

const specs = [
  { name: 'three-of-majority', seedBase: 0x31, signers: 3, salt: 3, sizes: [1, 2, 3, 40, 5, 600, 7], groups: [1, 2, 4], signWith: [0, 1] },
  { name: 'three-signed-by-2-0', seedBase: 0x31, signers: 3, salt: 4, sizes: [9, 8, 7], groups: [3], signWith: [2, 0] },
  { name: 'five-quorum-3', seedBase: 0x41, signers: 5, salt: 5, sizes: [10, 20, 30, 40], groups: [2, 2], signWith: [4, 1, 3] },
  { name: 'two-quorum-1-patchable', seedBase: 0x51, signers: 2, quorum: 1, allowPatch: true, salt: 6, sizes: [1, 1], groups: [1, 1], signWith: [1] },
  // a cluster partition's manifest: v2, userData naming the partition (the archive key
  // must differ per partition even when the replica set is the same)
  { name: 'three-v2-user-data', seedBase: 0x31, signers: 3, userData: Buffer.from('hyperkafka/partition/0123456789abcdef/7').toString('hex'), salt: 8, sizes: [33, 44], groups: [1, 1], signWith: [1, 2] },
  { name: 'single-multisig-form', seedBase: 0x61, signers: 1, salt: 7, sizes: [5], groups: [1], signWith: [0] }
]

const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'hk-msvectors-'))
try {
  const cores = []
  for (const spec of specs) cores.push(await makeCore(tmp, spec))
  const pkg = (name) => require(name + '/package.json').version
  const doc = {
    comment: 'Generated by gen_multisig.mjs from the npm packages below; do not edit.',
    generator: { hypercore: pkg('hypercore'), 'hypercore-crypto': pkg('hypercore-crypto') },
    cores
  }
  fs.writeFileSync(out, JSON.stringify(doc, null, 1) + '\n')
} finally {
  fs.rmSync(tmp, { recursive: true, force: true })
}

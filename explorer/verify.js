// The explorer's proof check, run in the browser: is this batch, at this block index, in
// the archive whose key the user trusts, under a head its writer signed? And which
// archive key is that: the one the node's signed catalog lists for the partition, the
// node key being the only thing the user has to trust. Only the stock
// `hypercore-crypto` (hashes, signatures: libsodium in JS) and `flat-tree` do the work;
// this file only arranges Hypercore 11's rules around them (storage/FORMAT.md):
//   leaf hash = crypto.data(batch); parent = crypto.parent(a, b); tree = crypto.tree(roots)
//   archive key = BLAKE2b(MANIFEST_NS || default single-signer manifest of the writer key)
//   signature: ed25519 over TREE_NS || archive key || tree hash || u64le length || u64le fork
// The leaf's path to its root is rebuilt from the batch itself, so a proof can never
// substitute an ancestor of the leaf; the other roots come from the proof's nodes.
const crypto = require('hypercore-crypto')
const flat = require('flat-tree')
const b4a = require('b4a')
const msgpack = require('@msgpack/msgpack')
const { decodeBatch } = require('./records.js')

const [TREE_NS, , , MANIFEST_NS, DEFAULT_NS] = crypto.namespace('hypercore', 6)

function fromHex (s) {
  if (typeof s !== 'string' || !/^([0-9a-f]{2})*$/.test(s)) throw new Error('not hex: ' + s)
  return b4a.from(s, 'hex')
}

function u64le (n) {
  const out = b4a.alloc(8)
  let v = BigInt(n)
  for (let i = 0; i < 8; i++) { out[i] = Number(v & 0xffn); v >>= 8n }
  return out
}

// Hypercore 11's key for a core made with one ed25519 key pair (Verifier.defaultSignerManifest):
// version 1, no flags, blake2b, quorum 1, one signer (ed25519, default namespace, key).
function archiveKey (publicKey) {
  const manifest = b4a.concat([b4a.from([1, 0, 0, 1, 1, 0]), DEFAULT_NS, publicKey])
  return crypto.hash([MANIFEST_NS, manifest])
}

// Hypercore 11 stores a v1 core's signature as a multiSignature (lib/messages.js) even
// for one signer: [1 proof][signer 0][ed25519, 64 bytes][patch 0][0 patch nodes]. That
// shape only (a multisig quorum is not checked here); anything else verifies nothing.
function signatureOf (stored) {
  const ok = stored.byteLength === 68 && stored[0] === 1 && stored[1] === 0 &&
    stored[66] === 0 && stored[67] === 0
  return ok ? stored.subarray(2, 66) : b4a.alloc(64)
}

function nodeOf (n) {
  return { index: n.index, size: n.size, hash: fromHex(n.hash) }
}

// `proof`: the JSON of GET /v1/partitions/T/P/proof?offset=O; `trustedKey`: the archive
// key (hex) the user trusts, e.g. from `hyperkafka keys` on the writer. Returns
// {ok: true, ...} or {ok: false, reason}.
function verifyProof (proof, trustedKey) {
  try {
    const key = fromHex(trustedKey)
    const publicKey = fromHex(proof.writer_public_key)
    if (!b4a.equals(archiveKey(publicKey), key)) {
      return { ok: false, reason: 'the writer key is not the trusted archive key\'s signer' }
    }
    const length = proof.length
    const batch = b4a.from(proof.batch, 'base64')
    if (!(proof.block_index >= 0 && proof.block_index < length)) {
      return { ok: false, reason: 'the block is not under the signed head' }
    }
    const known = new Map()
    for (const n of [...proof.block_nodes, ...proof.upgrade_nodes, ...proof.additional_nodes]) {
      known.set(n.index, nodeOf(n))
    }
    const roots = flat.fullRoots(2 * length)
    // the leaf up to its root, from the batch's own bytes
    let node = { index: 2 * proof.block_index, size: batch.byteLength, hash: null }
    node.hash = crypto.data(batch)
    while (!roots.includes(node.index)) {
      const sib = known.get(flat.sibling(node.index))
      if (!sib) return { ok: false, reason: 'the proof lacks node ' + flat.sibling(node.index) }
      node = { index: flat.parent(node.index), size: node.size + sib.size, hash: crypto.parent(node, sib) }
    }
    const leafRoot = node
    const resolve = (index) => {
      if (index === leafRoot.index) return leafRoot
      if (known.has(index)) return known.get(index)
      if (index % 2 === 0) throw new Error('the proof lacks node ' + index)
      const [l, r] = flat.children(index)
      const a = resolve(l)
      const b = resolve(r)
      return { index, size: a.size + b.size, hash: crypto.parent(a, b) }
    }
    const treeHash = crypto.tree(roots.map(resolve))
    if (proof.tree_hash && proof.tree_hash !== b4a.toString(treeHash, 'hex')) {
      return { ok: false, reason: 'the nodes do not make the signed tree hash' }
    }
    const signable = b4a.concat([TREE_NS, key, treeHash, u64le(length), u64le(proof.fork)])
    if (!crypto.verify(signable, signatureOf(fromHex(proof.signature || '')), publicKey)) {
      return { ok: false, reason: 'the signature does not verify' }
    }
    return { ok: true, treeHash: b4a.toString(treeHash, 'hex'), length }
  } catch (err) {
    return { ok: false, reason: String(err && err.message ? err.message : err) }
  }
}

// The signed catalog of a node (GET /v1/catalog?topic=T): every block from 0 to the head,
// each a batch of msgpack changes (storage/catalog.py). Checked against the node key the
// user trusts, then replayed: the archive key of `topic`'s partition `partition`.
// Returns {ok: true, archiveKey} or {ok: false, reason}.
function archiveKeyFromCatalog (catalog, trustedNodeKey, topic, partition) {
  try {
    const nodeKey = fromHex(trustedNodeKey)
    const key = archiveKey(nodeKey)
    const length = catalog.length
    if (!(length > 0) || catalog.blocks.length !== length) {
      return { ok: false, reason: 'the catalog is not whole' }
    }
    const blocks = catalog.blocks.map((b) => b4a.from(b, 'base64'))
    const resolve = (index) => {
      if (index % 2 === 0) {
        const value = blocks[index / 2]
        return { index, size: value.byteLength, hash: crypto.data(value) }
      }
      const [l, r] = flat.children(index)
      const a = resolve(l)
      const b = resolve(r)
      return { index, size: a.size + b.size, hash: crypto.parent(a, b) }
    }
    const treeHash = crypto.tree(flat.fullRoots(2 * length).map(resolve))
    const signable = b4a.concat([TREE_NS, key, treeHash, u64le(length), u64le(catalog.fork)])
    if (!crypto.verify(signable, signatureOf(fromHex(catalog.signature || '')), nodeKey)) {
      return { ok: false, reason: 'the catalog is not signed by the trusted node key' }
    }
    let keys = null // the topic's archive keys as the catalog's changes leave them
    for (const block of blocks) {
      for (const record of decodeBatch(block, Infinity).records) {
        const change = msgpack.decode(record.value)
        if (change.name !== topic) continue
        if (change.op === 'create' || change.op === 'partitions') keys = change.keys
        else if (change.op === 'delete') keys = null
      }
    }
    if (!keys) return { ok: false, reason: `the node's catalog has no topic ${topic}` }
    if (!(partition >= 0 && partition < keys.length)) {
      return { ok: false, reason: `the node's catalog has no partition ${topic}-${partition}` }
    }
    return { ok: true, archiveKey: b4a.toString(keys[partition], 'hex') }
  } catch (err) {
    return { ok: false, reason: String(err && err.message ? err.message : err) }
  }
}

module.exports = { verifyProof, archiveKeyFromCatalog, archiveKey: (hex) => b4a.toString(archiveKey(fromHex(hex)), 'hex') }

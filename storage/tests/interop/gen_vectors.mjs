// Known-answer vectors for storage/tests/test_replication_wire.py, generated with the
// pinned npm packages (noise-handshake, noise-curve-ed, sodium-secretstream,
// @hyperswarm/secret-stream's stream-id rule, hypercore's caps.replicate and wire
// messages, protomux framing). Deterministic: every key comes from a fixed seed.
// Run: npm ci && node gen_vectors.mjs > replication_vectors.json
import Noise from 'noise-handshake'
import curve from 'noise-curve-ed'
import sodium from 'sodium-universal'
import crypto from 'hypercore-crypto'
import c from 'compact-encoding'
import b4a from 'b4a'
import { createRequire } from 'node:module'

const require = createRequire(import.meta.url)
const messages = require('hypercore/lib/messages.js')
const caps = require('hypercore/lib/caps.js')
const { Push, Pull } = require('sodium-secretstream')

const hex = (b) => b4a.toString(b, 'hex')
const seed = (n) => b4a.alloc(32, n)

function kp(s) {
  return curve.generateKeyPair(b4a.concat([s, b4a.alloc(32)]))
}

function handshake(iSeed, rSeed, ieSeed, reSeed) {
  const initiator = new Noise('XX', true, kp(iSeed), { curve })
  const responder = new Noise('XX', false, kp(rSeed), { curve })
  initiator.initialise(b4a.alloc(0))
  responder.initialise(b4a.alloc(0))
  initiator.e = kp(ieSeed)
  responder.e = kp(reSeed)
  // hex at once: recv() keeps subarrays of the message and zeroes them when it finishes
  const m1 = hex(initiator.send())
  responder.recv(b4a.from(m1, 'hex'))
  const m2 = hex(responder.send())
  initiator.recv(b4a.from(m2, 'hex'))
  const m3 = hex(initiator.send())
  responder.recv(b4a.from(m3, 'hex'))
  const [NS_INITIATOR, NS_RESPONDER] = crypto.namespace('hyperswarm/secret-stream', 3)
  const sid = (ns) => {
    const out = b4a.alloc(32)
    sodium.crypto_generichash(out, ns, initiator.hash)
    return out
  }
  const key = b4a.from('04dc2c70d9b3954c86f4d0ffeae59b601b9739d285d5bb1849a9f93f45d95c18', 'hex')
  return {
    initiator_seed: hex(iSeed),
    responder_seed: hex(rSeed),
    initiator_ephemeral_seed: hex(ieSeed),
    responder_ephemeral_seed: hex(reSeed),
    messages: [m1, m2, m3],
    handshake_hash: hex(initiator.hash),
    responder_hash: hex(responder.hash),
    initiator_tx: hex(initiator.tx),
    initiator_rx: hex(initiator.rx),
    responder_tx: hex(responder.tx),
    responder_rx: hex(responder.rx),
    initiator_remote_static: hex(initiator.rs),
    responder_remote_static: hex(responder.rs),
    stream_id_initiator: hex(sid(NS_INITIATOR)),
    stream_id_responder: hex(sid(NS_RESPONDER)),
    core_key: hex(key),
    capability_initiator: hex(caps.replicate(true, key, initiator.hash)),
    capability_responder: hex(caps.replicate(false, key, initiator.hash))
  }
}

// secretstream: we cannot pin libsodium's random header from Python, so the vector is
// (key, header, ciphertexts) produced here, which Python must pull back to plaintexts.
function secretstream() {
  const key = b4a.alloc(32, 9)
  const push = new Push(key)
  const plaintexts = ['', 'a', 'hello hypercore', 'x'.repeat(1000)].map((s) => b4a.from(s))
  const cts = plaintexts.map((p) => push.next(p))
  // and one the other way is checked live by the interop test
  return { key: hex(key), header: hex(push.header), plaintexts: plaintexts.map(hex), ciphertexts: cts.map(hex) }
}

function enc(encoding, m) {
  return hex(c.encode(encoding, m))
}

function wire() {
  const w = messages.wire
  const buf = (s) => b4a.from(s, 'hex')
  const node = (index, size, fill) => ({ index, size, hash: b4a.alloc(32, fill) })
  return [
    ['handshake', enc(w.handshake, { seeks: true, capability: b4a.alloc(32, 1) })],
    ['handshake', enc(w.handshake, { seeks: false, capability: b4a.alloc(32, 2) })],
    ['sync', enc(w.sync, { fork: 0, length: 5, remoteLength: 0, canUpgrade: true, uploading: true, downloading: false, hasManifest: true, allowPush: false })],
    ['sync', enc(w.sync, { fork: 3, length: 70000, remoteLength: 300, canUpgrade: false, uploading: true, downloading: true, hasManifest: false, allowPush: true })],
    ['request', enc(w.request, { id: 1, fork: 0, block: { index: 3, nodes: 2 }, hash: null, seek: null, upgrade: null, manifest: false, priority: 0 })],
    ['request', enc(w.request, { id: 300, fork: 1, block: null, hash: null, seek: null, upgrade: { start: 0, length: 5 }, manifest: true, priority: 0 })],
    ['request', enc(w.request, { id: 2, fork: 0, block: { index: 1, nodes: 0 }, hash: { index: 5, nodes: 1 }, seek: { bytes: 10, padding: 0 }, upgrade: { start: 2, length: 3 }, manifest: false, priority: 4 })],
    ['cancel', enc(w.cancel, { request: 77 })],
    ['data', enc(w.data, { request: 1, fork: 0, block: { index: 0, value: b4a.from('a'), nodes: [node(2, 2, 3)] }, hash: null, seek: null, upgrade: { start: 0, length: 5, nodes: [node(1, 3, 4), node(8, 5, 5)], additionalNodes: [], signature: b4a.alloc(68, 6) }, manifest: null })],
    ['data', enc(w.data, { request: 9, fork: 2, block: null, hash: { index: 3, nodes: [node(11, 9, 7)] }, seek: null, upgrade: null, manifest: null })],
    ['noData', enc(w.noData, { request: 4, reason: 0 })],
    ['noData', enc(w.noData, { request: 4, reason: 2 })],
    ['want', enc(w.want, { start: 0, length: 2097152, any: false })],
    ['want', enc(w.want, { start: 10, length: 1, any: true })],
    ['unwant', enc(w.unwant, { start: 0, length: 2097152, any: false })],
    ['bitfield', enc(w.bitfield, { start: 32768, bitfield: new Uint32Array([1, 0xffffffff, 0x80000000]) })],
    ['range', enc(w.range, { drop: false, start: 0, length: 5 })],
    ['range', enc(w.range, { drop: true, start: 7, length: 1 })],
    ['extension', enc(w.extension, { name: 'ext', message: b4a.from('payload') })],
    ['manifest', enc(messages.manifest, { version: 1, hash: 'blake2b', allowPatch: false, quorum: 1, signers: [{ signature: 'ed25519', namespace: caps.DEFAULT_NAMESPACE, publicKey: b4a.alloc(32, 8) }], prologue: null, linked: null, userData: null })]
  ]
}

console.log(JSON.stringify({
  generator: 'storage/tests/interop/gen_vectors.mjs',
  packages: { hypercore: '11.39.5', 'noise-handshake': '4.2.0', 'noise-curve-ed': '2.1.0', 'sodium-secretstream': '1.2.0', 'compact-encoding': '3.5.2' },
  handshakes: [
    handshake(seed(1), seed(2), seed(3), seed(4)),
    handshake(seed(0xa0), seed(0x5b), seed(0x77), seed(0xee))
  ],
  secretstream: secretstream(),
  wire: wire()
}, null, 2))

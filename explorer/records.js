// The records of one stored Kafka v2 record batch, for display only (the proof check is
// over the batch's bytes, never over this decoding). Compressed batches are named, not
// inflated: the page stays small.
const CODECS = ['none', 'gzip', 'snappy', 'lz4', 'zstd']

function varint (buf, pos) {
  let shift = 0n
  let v = 0n
  for (;;) {
    if (pos.i >= buf.length) throw new Error('truncated batch')
    const b = buf[pos.i++]
    v |= BigInt(b & 0x7f) << shift
    if (!(b & 0x80)) break
    shift += 7n
    if (shift > 63n) throw new Error('bad varint')
  }
  return Number((v >> 1n) ^ -(v & 1n)) // zigzag
}

function bytes (buf, pos) {
  const n = varint(buf, pos)
  if (n < 0) return null
  if (pos.i + n > buf.length) throw new Error('truncated batch')
  const out = buf.subarray(pos.i, pos.i + n)
  pos.i += n
  return out
}

// {baseOffset, codec, count, records: [{offset, key, value}]} (key/value: Uint8Array or
// null), the first `max` records
function decodeBatch (buf, max = 100) {
  if (buf.length < 61) throw new Error('not a record batch')
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength)
  const baseOffset = Number(view.getBigInt64(0))
  const codec = CODECS[view.getInt16(21) & 7] || 'unknown'
  const count = view.getInt32(57)
  const out = { baseOffset, codec, count, records: [] }
  if (codec !== 'none') return out
  const pos = { i: 61 }
  for (let r = 0; r < count && r < max; r++) {
    varint(buf, pos) // record length
    pos.i += 1 // attributes
    varint(buf, pos) // timestamp delta
    const delta = varint(buf, pos)
    const key = bytes(buf, pos)
    const value = bytes(buf, pos)
    const headers = varint(buf, pos)
    for (let h = 0; h < headers; h++) { bytes(buf, pos); bytes(buf, pos) }
    out.records.push({ offset: baseOffset + delta, key, value })
  }
  return out
}

module.exports = { decodeBatch }

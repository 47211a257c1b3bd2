"""Kafka record batch v2 as bytes: header field offsets, and a tiny batch builder.

Storage treats a batch as opaque bytes except for the 61-byte header (it writes
baseOffset and partitionLeaderEpoch, and reads lastOffsetDelta and maxTimestamp).
`build_batch` encodes uncompressed records; the catalog uses it for its own entries, tests
and the benchmark use it for realistic input. Imports only the standard library and crc32c.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c

HEADER_SIZE = 61
MAGIC = 2
# byte offsets inside the header (big-endian fields)
BASE_OFFSET = 0  # i64
BATCH_LENGTH = 8  # i32, bytes after this field
LEADER_EPOCH = 12  # i32
MAGIC_AT = 16  # i8
CRC_AT = 17  # u32, CRC-32C of bytes 21..end
ATTRIBUTES = 21
LAST_OFFSET_DELTA = 23  # i32
BASE_TIMESTAMP = 27  # i64
MAX_TIMESTAMP = 35  # i64
RECORDS_COUNT = 57

_HEAD = struct.Struct(">qiiBI")  # baseOffset, batchLength, leaderEpoch, magic, crc
_BODY = struct.Struct(">hiqqqhii")


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)  # zigzag
    out = bytearray()
    while True:
        b = z & 0x7F
        z >>= 7
        if z:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def build_batch(
    values: Sequence[bytes | None],
    *,
    timestamp_ms: int = 0,
    base_offset: int = 0,
    keys: Sequence[bytes | None] | None = None,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    timestamps: Sequence[int] | None = None,
) -> bytearray:
    """An uncompressed v2 batch with one record per value (None: a null value, a
    tombstone), timestamps all `timestamp_ms` (or one per record, `timestamps`), with a
    valid CRC-32C. Returned as a bytearray, ready for `PartitionLog.append`."""
    if not values:
        raise ValueError("a batch holds at least one record")
    if timestamps is not None:
        timestamp_ms = min(timestamps)
    records = bytearray()
    for i, value in enumerate(values):
        key = keys[i] if keys is not None else None
        body = bytearray(b"\x00")  # record attributes
        body += _varint(timestamps[i] - timestamp_ms if timestamps is not None else 0)  # timestamp delta
        body += _varint(i)  # offset delta
        if key is None:
            body += _varint(-1)
        else:
            body += _varint(len(key)) + key
        body += _varint(-1) if value is None else _varint(len(value)) + value
        body += _varint(0)  # headers
        records += _varint(len(body)) + body
    after_crc = (
        _BODY.pack(
            0,
            len(values) - 1,
            timestamp_ms,
            max(timestamps) if timestamps is not None else timestamp_ms,
            producer_id,
            producer_epoch,
            base_sequence,
            len(values),
        )
        + records
    )
    batch_length = 4 + 1 + 4 + len(after_crc)  # leader epoch, magic, crc, rest
    out = bytearray(_HEAD.pack(base_offset, batch_length, -1, MAGIC, crc32c.crc32c(after_crc)))
    out += after_crc
    return out


def batch_crc_ok(batch: bytes | bytearray | memoryview) -> bool:
    """True when the stored CRC-32C matches bytes 21..end (what a Kafka client checks)."""
    (crc,) = struct.unpack_from(">I", batch, CRC_AT)
    return bool(crc32c.crc32c(memoryview(batch)[ATTRIBUTES:]) == crc)


def record_values(batch: bytes | bytearray | memoryview) -> list[bytes]:
    """Decode the values of an uncompressed batch (for the catalog; not a hot path)."""
    data = bytes(batch)
    (count,) = struct.unpack_from(">i", data, RECORDS_COUNT)
    pos = HEADER_SIZE

    def varint() -> int:
        nonlocal pos
        shift = z = 0
        while True:
            b = data[pos]
            pos += 1
            z |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return (z >> 1) ^ -(z & 1)

    out = []
    for _ in range(count):
        length = varint()
        end = pos + length
        pos += 1  # attributes
        varint()  # timestamp delta
        varint()  # offset delta
        klen = varint()
        if klen > 0:
            pos += klen
        vlen = varint()
        out.append(data[pos : pos + vlen] if vlen >= 0 else b"")
        pos = end
    return out

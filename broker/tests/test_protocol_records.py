"""Record batch v2: header view, CRC-32C, patching, splitting, decoding, codecs.

Batches are built by kafka-python's producer code (an independent implementation), and
re-compressed by hand for snappy's two framings.
"""

from __future__ import annotations

import gzip
import struct
import zlib

import crc32c
import lz4.frame
import pytest
import snappy
import zstandard
from kafka.codec import snappy_encode
from kafka.record.default_records import DefaultRecordBatchBuilder

from broker.protocol import records as R
from broker.protocol.errors import (
    CorruptRecordBatch,
    InvalidRecordBatch,
    RecordBatchTooLarge,
    UnsupportedCompression,
    UnsupportedMagic,
)

RECORDS = [
    (i, 1_000 + 10 * i, None if i == 2 else f"k{i}".encode(), b"v" * (40 * i) or None,
     [("h", b"x"), ("empty", b"")] if i % 2 else [])
    for i in range(8)
]  # fmt: skip


def build(codec: int = 0, **kw: int) -> bytes:
    b = DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=False,
        producer_id=kw.get("pid", -1), producer_epoch=kw.get("epoch", -1),
        base_sequence=kw.get("seq", -1), batch_size=1 << 20,
    )  # fmt: skip
    for off, ts, key, value, headers in RECORDS:
        b.append(off, timestamp=ts, key=key, value=value, headers=headers)
    return bytes(b.build())


def recompress(batch: bytes, codec: int, compress: object) -> bytes:
    """Replace the records section with `compress(section)` and fix codec bits and CRC."""
    section = batch[R.BATCH_HEADER_SIZE :]
    body = compress(section)  # type: ignore[operator]
    out = bytearray(batch[: R.BATCH_HEADER_SIZE] + body)
    struct.pack_into(">i", out, 8, len(out) - 12)
    (attrs,) = struct.unpack_from(">h", out, 21)
    struct.pack_into(">h", out, 21, (attrs & ~7) | codec)
    struct.pack_into(">I", out, 17, crc32c.crc32c(bytes(out[21:])))
    return bytes(out)


def check_records(batch: bytes) -> None:
    got = R.decode_records(batch)
    assert [(r.offset, r.timestamp, r.key, r.value) for r in got] == [
        (off, ts, key, value) for off, ts, key, value, _ in RECORDS
    ]
    assert [list(r.headers) for r in got] == [h for *_, h in RECORDS]


def test_header_fields() -> None:
    batch = build(pid=42, epoch=3, seq=17)
    h = R.parse_batch_header(batch)
    assert (h.base_offset, h.magic, h.records_count, h.last_offset_delta) == (0, 2, 8, 7)
    assert (h.base_timestamp, h.max_timestamp) == (1000, 1070)
    assert (h.producer_id, h.producer_epoch, h.base_sequence) == (42, 3, 17)
    assert h.size == len(batch) and h.compression == R.Compression.NONE
    assert h.is_idempotent and not (h.is_control or h.is_transactional or h.is_log_append_time)
    assert h.crc == crc32c.crc32c(batch[21:])
    R.verify_crc(batch)
    assert R.validate_batch(batch) == h


def test_header_key_not_utf8_reads_with_replacement() -> None:
    """Kafka's reader decodes a header key with replacement characters; ours must read back
    any batch Kafka (and our Produce) accepts, not fail on it."""
    body = b"\x00" + b"\x00" + b"\x00" + b"\x02k" + b"\x02v" + b"\x02" + b"\x04\xff\xfe" + b"\x02h"
    records = bytes([len(body) * 2]) + body  # zig-zag varint length
    head = struct.pack(">hiqqqhii", 0, 0, 1000, 1000, -1, -1, -1, 1)
    rest = struct.pack(">ibI", 0, 2, crc32c.crc32c(head + records)) + head + records
    batch = struct.pack(">qi", 0, len(rest)) + rest
    (record,) = R.decode_records(batch)
    assert record.headers == (("\ufffd\ufffd", b"h"),)
    R.validate_batch(batch)


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_codecs_via_kafka_python(codec: int) -> None:
    batch = build(codec)
    assert R.parse_batch_header(batch).compression == codec
    R.validate_batch(batch)
    check_records(batch)


@pytest.mark.parametrize(
    ("codec", "compress"),
    [
        (1, gzip.compress),
        (1, zlib.compress),  # some clients wrote zlib streams; auto-detected
        (2, snappy.compress),  # raw snappy: librdkafka
        (2, lambda d: snappy_encode(d, xerial_compatible=True, xerial_blocksize=64)),  # Java
        (3, lz4.frame.compress),
        (4, zstandard.ZstdCompressor().compress),
        (4, zstandard.ZstdCompressor(write_content_size=False).compress),
    ],
)
def test_each_framing(codec: int, compress: object) -> None:
    batch = recompress(build(), codec, compress)
    R.validate_batch(batch)
    check_records(batch)


def test_decompression_limit() -> None:
    batch = recompress(build(), 4, zstandard.ZstdCompressor().compress)
    with pytest.raises(RecordBatchTooLarge):
        R.decode_records(batch, max_decompressed=100)
    for codec, fn in [(1, gzip.compress), (2, snappy.compress), (3, lz4.frame.compress)]:
        with pytest.raises(RecordBatchTooLarge):
            R.decompress(codec, fn(b"x" * 10_000), max_size=1000)


def test_unknown_codec_and_garbage() -> None:
    with pytest.raises(UnsupportedCompression):
        R.decompress(6, b"abc")
    for codec in (1, 2, 3, 4):
        with pytest.raises(CorruptRecordBatch):
            R.decompress(codec, b"definitely not compressed")
    with pytest.raises(CorruptRecordBatch):
        R.decompress(1, gzip.compress(b"x" * 1000)[:-12])  # truncated


def test_crc_mismatch() -> None:
    batch = bytearray(build())
    batch[-1] ^= 1
    with pytest.raises(CorruptRecordBatch):
        R.verify_crc(batch)
    with pytest.raises(CorruptRecordBatch):
        R.validate_batch(batch)


def test_offset_and_epoch_do_not_touch_crc() -> None:
    batch = bytearray(build())
    R.set_base_offset(batch, 1234)
    R.set_partition_leader_epoch(batch, 7)
    R.verify_crc(batch)
    h = R.parse_batch_header(batch)
    assert (h.base_offset, h.partition_leader_epoch, h.last_offset) == (1234, 7, 1241)
    assert R.decode_records(batch)[3].offset == 1237
    with pytest.raises(TypeError):
        R.set_base_offset(memoryview(bytes(batch)), 1)  # read-only


def test_log_append_time() -> None:
    batch = bytearray(recompress(build(), 3, lz4.frame.compress))
    R.set_log_append_time(batch, 99_999)
    R.verify_crc(batch)
    h = R.parse_batch_header(batch)
    assert h.is_log_append_time and h.max_timestamp == 99_999 and h.compression == 3
    assert {r.timestamp for r in R.decode_records(batch)} == {99_999}
    assert R.find_offset_for_timestamp(batch, 5_000) == (0, 99_999)
    assert R.find_offset_for_timestamp(batch, 100_000) is None


def test_find_offset_for_timestamp_across_batches() -> None:
    a = bytearray(build(1))
    b = bytearray(build(4))
    R.set_base_offset(b, 8)
    blob = bytes(a + b)
    assert R.find_offset_for_timestamp(blob, 0) == (0, 1000)
    assert R.find_offset_for_timestamp(blob, 1031) == (4, 1040)
    assert R.find_offset_for_timestamp(blob, 1070) == (7, 1070)
    assert R.find_offset_for_timestamp(blob, 1071) is None
    # A truncated last batch (a Fetch cut at max_bytes) is ignored.
    assert R.find_offset_for_timestamp(blob[:-5], 0) == (0, 1000)


def test_split_batches() -> None:
    a, b = build(), build(2)
    views = R.split_batches(a + b)
    assert [bytes(v) for v in views] == [a, b]
    assert R.split_batches(b"") == []
    with pytest.raises(CorruptRecordBatch):
        R.split_batches(a + b[:-1])
    assert [bytes(v) for v in R.split_batches(a + b[:-1], allow_partial_tail=True)] == [a]
    with pytest.raises(CorruptRecordBatch):
        R.split_batches(a + b"\x00" * 5)


def test_old_magic_rejected() -> None:
    batch = bytearray(build())
    batch[16] = 1
    with pytest.raises(UnsupportedMagic):
        R.split_batches(batch)
    with pytest.raises(UnsupportedMagic):
        R.parse_batch_header(batch)


def test_count_mismatch_is_invalid_record() -> None:
    batch = bytearray(build())
    struct.pack_into(">i", batch, 23, 9)  # lastOffsetDelta 9 with 8 records
    struct.pack_into(">I", batch, 17, crc32c.crc32c(bytes(batch[21:])))
    with pytest.raises(InvalidRecordBatch):
        R.validate_batch(batch)
    batch = bytearray(build())
    struct.pack_into(">i", batch, 57, 9)  # recordsCount 9 but only 8 records present
    struct.pack_into(">i", batch, 23, 8)
    struct.pack_into(">I", batch, 17, crc32c.crc32c(bytes(batch[21:])))
    with pytest.raises(CorruptRecordBatch):
        R.validate_batch(batch)


def test_attribute_bits() -> None:
    batch = bytearray(build())
    struct.pack_into(">h", batch, 21, 0x10 | 0x20 | 0x40)
    h = R.parse_batch_header(batch)
    assert h.is_transactional and h.is_control and h.has_delete_horizon

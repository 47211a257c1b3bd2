"""Record batches (message format v2, magic 2): header view, CRC, splitting, decoding.

Owns the byte layout of Kafka's DefaultRecordBatch. The broker treats batches as opaque
bytes and reads only the 61-byte header; record-level decoding (with decompression of
gzip, snappy raw and xerial-framed, lz4 frame and zstd) is here for the few places that
need it: ListOffsets by timestamp and validating what a producer sent.

    offset  size  field
    0       8     baseOffset            (written by the broker on append)
    8       4     batchLength           (bytes after this field)
    12      4     partitionLeaderEpoch  (written by the broker; not under the CRC)
    16      1     magic = 2
    17      4     crc                   (CRC-32C of bytes 21..end)
    21      2     attributes            (bits 0-2 codec, 3 LogAppendTime, 4 transactional,
                                         5 control, 6 delete horizon)
    23      4     lastOffsetDelta
    27      8     baseTimestamp
    35      8     maxTimestamp
    43      8     producerId
    51      2     producerEpoch
    53      4     baseSequence
    57      4     recordsCount
    61            records (compressed as a whole when the codec is not 0)

Errors are `RecordBatchError` subclasses carrying the Kafka error code for the partition
(see `.errors`); nothing else escapes. Imports crc32c, the codec libraries (lazily, on
first use of a compressed batch) and the standard library; no I/O.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import crc32c as _crc32c

from ._wire import Buf, _Bad, _Short, read_varint
from .errors import (
    CorruptRecordBatch,
    InvalidRecordBatch,
    RecordBatchTooLarge,
    UnsupportedCompression,
    UnsupportedMagic,
)

__all__ = [
    "BATCH_HEADER_SIZE",
    "BatchHeader",
    "Compression",
    "Record",
    "compute_crc",
    "decode_records",
    "decompress",
    "find_offset_for_timestamp",
    "iter_records",
    "parse_batch_header",
    "set_base_offset",
    "set_log_append_time",
    "set_max_timestamp",
    "set_partition_leader_epoch",
    "split_batches",
    "validate_batch",
    "verify_crc",
]

BATCH_HEADER_SIZE: Final = 61
LOG_OVERHEAD: Final = 12  # baseOffset + batchLength: bytes not counted in batchLength
CRC_OFFSET: Final = 17
CRC_START: Final = 21
ATTRIBUTES_OFFSET: Final = 21
MAX_TIMESTAMP_OFFSET: Final = 35
PARTITION_LEADER_EPOCH_OFFSET: Final = 12

_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
_I16: Final = struct.Struct(">h")
_I32: Final = struct.Struct(">i")
_I64: Final = struct.Struct(">q")
_U32: Final = struct.Struct(">I")

ATTR_CODEC_MASK: Final = 0x07
ATTR_LOG_APPEND_TIME: Final = 0x08
ATTR_TRANSACTIONAL: Final = 0x10
ATTR_CONTROL: Final = 0x20
ATTR_DELETE_HORIZON: Final = 0x40

DEFAULT_MAX_DECOMPRESSED = 64 * 1024 * 1024
_XERIAL_MAGIC: Final = b"\x82SNAPPY\x00"


class Compression(enum.IntEnum):
    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


@dataclass(frozen=True, slots=True)
class BatchHeader:
    """The 61-byte v2 batch header, decoded. `size` is the whole batch's byte length."""

    base_offset: int
    batch_length: int
    partition_leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records_count: int

    @property
    def size(self) -> int:
        return LOG_OVERHEAD + self.batch_length

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def compression(self) -> int:
        """The codec id (bits 0-2); compare with `Compression`. May be an unknown 5-7."""
        return self.attributes & ATTR_CODEC_MASK

    @property
    def is_log_append_time(self) -> bool:
        return bool(self.attributes & ATTR_LOG_APPEND_TIME)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)

    @property
    def has_delete_horizon(self) -> bool:
        return bool(self.attributes & ATTR_DELETE_HORIZON)

    @property
    def is_idempotent(self) -> bool:
        return self.producer_id >= 0


def parse_batch_header(buf: Buf, offset: int = 0) -> BatchHeader:
    """Decode the v2 header at `offset`. Checks magic and that the batch fits in `buf`.

    Raises `UnsupportedMagic` for magic 0/1 (whose header is shorter: checked first),
    `CorruptRecordBatch` if the bytes are too short or the length is impossible.
    """
    if len(buf) - offset < 17:
        raise CorruptRecordBatch("record batch header cut short")
    magic = buf[offset + 16]
    if magic != 2:
        raise UnsupportedMagic(f"message format magic {magic} is not supported")
    if len(buf) - offset < BATCH_HEADER_SIZE:
        raise CorruptRecordBatch("record batch header cut short")
    h = BatchHeader(*_HEADER.unpack_from(buf, offset))
    if h.batch_length < BATCH_HEADER_SIZE - LOG_OVERHEAD:
        raise CorruptRecordBatch(f"batch length {h.batch_length} is below the header size")
    if offset + h.size > len(buf):
        raise CorruptRecordBatch(
            f"batch of {h.size} bytes runs past the {len(buf) - offset} available"
        )
    return h


def compute_crc(batch: Buf) -> int:
    """CRC-32C of bytes 21..end of one batch (its attributes up to the last record)."""
    return int(_crc32c.crc32c(memoryview(batch)[CRC_START:]))


def verify_crc(batch: Buf, crc: Callable[[Buf], int] | None = None) -> None:
    """Raise `CorruptRecordBatch` unless the stored CRC matches. `batch` is one whole batch;
    `crc` computes CRC-32C (the crc32c package's unless given)."""
    if len(batch) < BATCH_HEADER_SIZE:
        raise CorruptRecordBatch("record batch header cut short")
    stored = _U32.unpack_from(batch, CRC_OFFSET)[0]
    actual = compute_crc(batch) if crc is None else crc(memoryview(batch)[CRC_START:])
    if stored != actual:
        raise CorruptRecordBatch(f"CRC mismatch: stored {stored:#010x}, computed {actual:#010x}")


def split_batches(records: Buf, *, allow_partial_tail: bool = False) -> list[memoryview]:
    """Split a `records` blob into one memoryview per batch (no copies, no CRC check).

    Produce data must be whole batches, so a trailing partial batch is an error unless
    `allow_partial_tail` (Fetch responses may end with a truncated batch, which is then
    dropped, as clients do).
    """
    view = memoryview(records)
    out: list[memoryview] = []
    pos = 0
    end = len(view)
    while pos < end:
        if end - pos < LOG_OVERHEAD + 5:
            if allow_partial_tail:
                break
            raise CorruptRecordBatch(f"{end - pos} trailing bytes are not a record batch")
        (length,) = _I32.unpack_from(view, pos + 8)
        if length < BATCH_HEADER_SIZE - LOG_OVERHEAD:
            if length >= 5 and view[pos + 16] != 2:
                raise UnsupportedMagic(f"message format magic {view[pos + 16]} is not supported")
            raise CorruptRecordBatch(f"batch length {length} is below the header size")
        size = LOG_OVERHEAD + length
        if pos + size > end:
            if allow_partial_tail:
                break
            raise CorruptRecordBatch(f"batch of {size} bytes runs past the end of the records")
        if view[pos + 16] != 2:
            raise UnsupportedMagic(f"message format magic {view[pos + 16]} is not supported")
        out.append(view[pos : pos + size])
        pos += size
    return out


# ----------------------------------------------------------------- broker-side patching


def _writable(batch: bytearray | memoryview) -> memoryview:
    view = memoryview(batch)
    if view.readonly:
        raise TypeError("batch must be writable (a bytearray or a writable memoryview)")
    if len(view) < BATCH_HEADER_SIZE:
        raise CorruptRecordBatch("record batch header cut short")
    return view


def set_base_offset(batch: bytearray | memoryview, base_offset: int) -> None:
    """Write baseOffset in place. Outside the CRC: no recomputation needed."""
    _I64.pack_into(_writable(batch), 0, base_offset)


def set_partition_leader_epoch(batch: bytearray | memoryview, epoch: int) -> None:
    """Write partitionLeaderEpoch in place. Outside the CRC: no recomputation needed."""
    _I32.pack_into(_writable(batch), PARTITION_LEADER_EPOCH_OFFSET, epoch)


def set_log_append_time(batch: bytearray | memoryview, timestamp_ms: int) -> None:
    """Mark the batch LogAppendTime with maxTimestamp = `timestamp_ms`; recompute the CRC.

    What Kafka's LogValidator does for topics with message.timestamp.type=LogAppendTime:
    record timestamps are then ignored by readers in favour of maxTimestamp.
    """
    view = _writable(batch)
    (attributes,) = _I16.unpack_from(view, ATTRIBUTES_OFFSET)
    _I16.pack_into(view, ATTRIBUTES_OFFSET, attributes | ATTR_LOG_APPEND_TIME)
    _I64.pack_into(view, MAX_TIMESTAMP_OFFSET, timestamp_ms)
    _U32.pack_into(view, CRC_OFFSET, compute_crc(view))


def set_max_timestamp(batch: bytearray | memoryview, timestamp_ms: int) -> None:
    """Write a CreateTime batch's maxTimestamp (the largest of its records'); recompute
    the CRC. Kafka's LogValidator does so whatever the producer wrote."""
    view = _writable(batch)
    _I64.pack_into(view, MAX_TIMESTAMP_OFFSET, timestamp_ms)
    _U32.pack_into(view, CRC_OFFSET, compute_crc(view))


# ----------------------------------------------------------------- decompression


def decompress(codec: int, data: Buf, max_size: int = DEFAULT_MAX_DECOMPRESSED) -> bytes:
    """Decompress a batch's records section. Raises `UnsupportedCompression` for an
    unknown codec, `CorruptRecordBatch` for bad data, `RecordBatchTooLarge` past `max_size`.

    Inflates as a stream and stops at `max_size` + 2 bytes, so a bomb costs at most that.
    One payload is one or more whole frames (gzip members, lz4 or zstd frames) and
    nothing else: empty, truncated, or followed by bytes that are no frame is corrupt.
    """
    if codec == Compression.NONE:
        return bytes(data)
    raw = bytes(data)
    if not raw:
        if 0 < codec <= Compression.ZSTD:
            raise CorruptRecordBatch(f"empty {Compression(codec).name} payload")
        raise UnsupportedCompression(f"unknown compression codec {codec}")
    try:
        if codec == Compression.GZIP:
            # 32+15: each member gzip or zlib, auto-detected (some clients wrote zlib)
            out = _frames(raw, max_size, lambda: zlib.decompressobj(wbits=47), "gzip")
        elif codec == Compression.SNAPPY:
            out = _snappy(raw, max_size)
        elif codec == Compression.LZ4:
            import lz4.frame  # type: ignore[import-untyped]

            out = _frames(raw, max_size, lz4.frame.LZ4FrameDecompressor, "lz4")
        elif codec == Compression.ZSTD:
            out = _zstd(raw, max_size)
        else:
            raise UnsupportedCompression(f"unknown compression codec {codec}")
    except (UnsupportedCompression, RecordBatchTooLarge, CorruptRecordBatch):
        raise
    except Exception as exc:  # zlib.error, lz4/zstd/snappy errors, cramjam errors
        raise CorruptRecordBatch(f"cannot decompress ({Compression(codec).name}): {exc}") from None
    if len(out) > max_size:
        raise RecordBatchTooLarge(f"decompressed records exceed {max_size} bytes")
    return out


def _frames(raw: bytes, max_size: int, new: Any, name: str) -> bytes:
    """Inflate consecutive gzip members or lz4 frames, at most `max_size` + 2 bytes (the
    native core reads as far, so both see a decoder error just past the cap alike)."""
    out = bytearray()
    rest = raw
    while rest:
        d = new()
        if name == "gzip":
            out += d.decompress(rest, max_size + 2 - len(out))
        else:
            out += d.decompress(rest, max_length=max_size + 2 - len(out))
        if len(out) > max_size:
            raise RecordBatchTooLarge(f"decompressed records exceed {max_size} bytes")
        if not d.eof:
            raise CorruptRecordBatch(f"{name} data is truncated")
        rest = d.unused_data
    return bytes(out)


def _zstd(raw: bytes, max_size: int) -> bytes:
    """Inflate consecutive zstd frames, at most `max_size` + 2 bytes, then make sure the
    payload was whole frames (the stream reader takes a truncated frame silently)."""
    import zstandard

    chunks = []
    total = 0
    with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
        while total <= max_size:
            chunk = reader.read(min(1 << 20, max_size + 2 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > max_size:
        raise RecordBatchTooLarge(f"decompressed records exceed {max_size} bytes")
    rest = raw
    while rest:  # inflates at most what was just read, known to be under the cap
        d = zstandard.ZstdDecompressor().decompressobj()
        d.decompress(rest)
        if not d.eof:
            raise CorruptRecordBatch("zstd data is truncated")
        rest = d.unused_data
    return b"".join(chunks)


def _snappy(data: bytes, max_size: int) -> bytes:
    import snappy  # type: ignore[import-untyped]

    if not data.startswith(_XERIAL_MAGIC):
        # Raw snappy (librdkafka): one block. Its header states the size: check it first.
        return bytes(_checked_snappy(snappy, data, max_size))
    # Xerial framing (Java): 8-byte magic, int32 version, int32 compatible version, then
    # blocks of int32 length + raw snappy.
    pos = 16
    out = bytearray()
    while pos < len(data):
        if pos + 4 > len(data):
            raise CorruptRecordBatch("xerial snappy block length cut short")
        (n,) = _I32.unpack_from(data, pos)
        pos += 4
        if n < 0 or pos + n > len(data):
            raise CorruptRecordBatch("xerial snappy block runs past the data")
        out += _checked_snappy(snappy, data[pos : pos + n], max_size - len(out))
        pos += n
    return bytes(out)


def _checked_snappy(snappy: Any, block: bytes, max_size: int) -> bytes:
    try:
        size, _ = _uvarint_plain(block)
    except (_Short, _Bad):
        raise CorruptRecordBatch("snappy block has no valid length header") from None
    if size > max_size:
        raise RecordBatchTooLarge(f"decompressed records exceed the limit of {max_size} bytes")
    return bytes(snappy.uncompress(block))


def _uvarint_plain(buf: bytes) -> tuple[int, int]:
    result = shift = pos = 0
    while True:
        if pos >= len(buf):
            raise _Short("varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 35:
            raise _Bad("varint too long")


# ----------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class Record:
    """One record. `timestamp` already accounts for LogAppendTime batches."""

    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    attributes: int = 0


def _records_section(batch: Buf, header: BatchHeader, max_size: int) -> bytes | memoryview:
    body = memoryview(batch)[BATCH_HEADER_SIZE : header.size]
    if header.compression == Compression.NONE:
        return body
    return decompress(header.compression, body, max_size)


def iter_records(
    batch: Buf, *, max_decompressed: int = DEFAULT_MAX_DECOMPRESSED
) -> Iterator[Record]:
    """Decode every record of one batch (decompressing if needed). Does not check the CRC.

    Raises `CorruptRecordBatch` for records that do not parse or a count that does not
    match, `UnsupportedCompression`, `RecordBatchTooLarge`.
    """
    header = parse_batch_header(batch)
    data = _records_section(batch, header, max_decompressed)
    log_append = header.is_log_append_time
    pos = 0
    end = len(data)
    try:
        for _ in range(header.records_count):
            length, pos = read_varint(data, pos)
            if length < 0 or pos + length > end:
                raise CorruptRecordBatch("record length runs past the batch")
            stop = pos + length
            rec = data[pos:stop]
            attributes = rec[0]
            p = 1
            ts_delta, p = read_varint(rec, p, 10)
            off_delta, p = read_varint(rec, p)
            key, p = _read_varbytes(rec, p)
            value, p = _read_varbytes(rec, p)
            n_headers, p = read_varint(rec, p)
            if n_headers < 0:
                raise CorruptRecordBatch("negative header count")
            headers = []
            for _ in range(n_headers):
                hkey, p = _read_varbytes(rec, p)
                if hkey is None:
                    raise CorruptRecordBatch("null header key")
                hval, p = _read_varbytes(rec, p)
                # As Kafka's DefaultRecord (Utils.utf8): a key that is not UTF-8 is read
                # with replacement characters, not refused, so what Produce stores reads back.
                headers.append((bytes(hkey).decode("utf-8", "replace"), hval))
            if p != length:
                raise CorruptRecordBatch("record has trailing bytes")
            pos = stop
            yield Record(
                offset=header.base_offset + off_delta,
                timestamp=header.max_timestamp if log_append else header.base_timestamp + ts_delta,
                key=key,
                value=value,
                headers=tuple(headers),
                attributes=attributes,
            )
    except (_Short, IndexError, struct.error):
        raise CorruptRecordBatch("record cut short") from None
    except (_Bad, UnicodeDecodeError) as exc:
        raise CorruptRecordBatch(f"bad record: {exc}") from None
    if pos != end:
        raise CorruptRecordBatch(
            f"{end - pos} bytes after the last of {header.records_count} records"
        )


def _read_varbytes(buf: Buf, pos: int) -> tuple[bytes | None, int]:
    n, pos = read_varint(buf, pos)
    if n == -1:
        return None, pos
    if n < 0:
        raise _Bad(f"negative length {n}")
    if pos + n > len(buf):
        raise _Short("bytes")
    return bytes(buf[pos : pos + n]), pos + n


def decode_records(batch: Buf, *, max_decompressed: int = DEFAULT_MAX_DECOMPRESSED) -> list[Record]:
    """`list(iter_records(batch))`."""
    return list(iter_records(batch, max_decompressed=max_decompressed))


def validate_batch(
    batch: Buf,
    *,
    check_crc: bool = True,
    decode: bool = True,
    max_decompressed: int = DEFAULT_MAX_DECOMPRESSED,
    crc: Callable[[Buf], int] | None = None,
) -> BatchHeader:
    """The batch-level checks of one whole batch; returns its header.

    Magic 2, length, CRC-32C (`CorruptRecordBatch`), lastOffsetDelta + 1 == recordsCount
    and, with `decode`, that every record parses and offset deltas run 0..count-1
    (`InvalidRecordBatch`). Produce uses `decode=False` and then checks every record by
    Kafka's LogValidator rules in `broker/validation.py` (natively where built); `decode`
    is the looser walk of `iter_records`. Control batches and codec/version rules are the
    handler's business (it knows the request version).
    """
    header = parse_batch_header(batch)
    if header.size != len(batch):
        raise CorruptRecordBatch(f"batch is {len(batch)} bytes but its header says {header.size}")
    if check_crc:
        verify_crc(batch, crc)
    if header.records_count <= 0 or header.last_offset_delta + 1 != header.records_count:
        raise InvalidRecordBatch(
            f"lastOffsetDelta {header.last_offset_delta} does not match "
            f"{header.records_count} records"
        )
    if decode:
        for expected, record in enumerate(iter_records(batch, max_decompressed=max_decompressed)):
            if record.offset - header.base_offset != expected:
                raise InvalidRecordBatch(
                    f"record offset delta {record.offset - header.base_offset}, expected {expected}"
                )
    return header


def find_offset_for_timestamp(
    batches: Buf,
    timestamp: int,
    *,
    min_offset: int = 0,
    max_decompressed: int = DEFAULT_MAX_DECOMPRESSED,
) -> tuple[int, int] | None:
    """First (offset, timestamp) in `batches` whose timestamp is >= `timestamp` and whose
    offset is >= `min_offset` (the log start), or None.

    `batches` is a run of whole stored batches in offset order. Batches whose
    maxTimestamp is below the target are skipped without decoding (Kafka's
    LogSegment.findOffsetByTimestamp). LogAppendTime batches answer with their first
    offset at or above `min_offset` and maxTimestamp.
    """
    for view in split_batches(batches, allow_partial_tail=True):
        header = parse_batch_header(view)
        if header.max_timestamp < timestamp or header.last_offset < min_offset:
            continue
        if header.is_log_append_time:
            return max(header.base_offset, min_offset), header.max_timestamp
        for record in iter_records(view, max_decompressed=max_decompressed):
            if record.timestamp >= timestamp and record.offset >= min_offset:
                return record.offset, record.timestamp
    return None

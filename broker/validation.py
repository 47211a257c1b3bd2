"""Record-level validation of a produced batch, as Kafka's LogValidator (and stricter).

Owns the rules every record of a v2 batch must pass before the broker stores and signs
it, the cap on inflated payloads, and the choice between the native core
(`storage._native`, Rust) and this module's pure-Python twin, which give the same
verdicts (a property test holds them to it). The batch header, CRC-32C and
lastOffsetDelta + 1 == recordsCount are `records.validate_batch`'s; this module walks
the records:

* each record's length varint, then inside that length: attributes, timestamp delta
  (varlong), offset delta, key and value lengths and bytes (-1 is null, below -1 is
  refused: Kafka reads any negative as null, stock consumers do not all agree), header
  count (>= 0), each header's key (non-null) and value. A field that runs past its record,
  a record that runs past the batch, bytes left over in a record or after the last
  record, a varint longer than 5 (varlong 10) bytes or wider than 32 (64) bits: all
  INVALID_RECORD, naming the first bad record (Produce v8+ record_errors.batch_index).
* offset deltas are exactly 0..n-1 and there are exactly recordsCount records
  (INVALID_RECORD). Kafka rewrites a compressed batch whose inner offsets are wrong; we
  store batches byte for byte as signed, so we refuse it instead.
* CreateTime topics: each record's timestamp (baseTimestamp + delta; maxTimestamp in a
  LogAppendTime-flagged batch; -1 means none) lies within [now -
  message.timestamp.before.max.ms, now + message.timestamp.after.max.ms], else
  INVALID_TIMESTAMP with the first such record. As in Kafka a structural error anywhere in
  the batch wins over a timestamp error.
* compressed batches are inflated as a stream and refused (INVALID_RECORD) once the
  inflated records pass `INFLATE_LIMIT_FACTOR` (64) times the topic's max.message.bytes
  (64 MiB at the default 1 MiB): far above what a producer builds (librdkafka and the
  Java producer bound a batch before or near its compressed size, 16 KiB to 1 MiB), far
  below what a bomb of a few KiB reaches (GiBs). Data that does not inflate cleanly (bad
  stream, truncated, trailing bytes after the stream) is CORRUPT_MESSAGE and wins over
  record errors. A v2 batch inflates to records, never to batches: a batch nested inside
  fails as records do (its first bytes do not parse as one), so no wrapper can smuggle a
  second layer past the checks.

`check_batch` is what Produce calls: the batch checks of `records.validate_batch` (header,
length, CRC-32C, count), in that order, with the CRC-32C and the records' walk done by
one native call over the batch (the GIL released for all of it); the records' verdict is
handed back for the caller to raise after its own header-only checks (control,
transactional, codec), which win over it as in Kafka.

The native path releases the GIL and never holds more than a small window of inflated
bytes; the Python path holds at most the cap. Imports `records`, `errors` and, if it was
built, `storage._native`; no I/O. It lives outside `broker.protocol`, which imports no
storage: the native core is built once for both sides (leaf hashes are storage's).
"""

from __future__ import annotations

import os
from typing import Final, NamedTuple

import crc32c as _crc32c

from broker.protocol._wire import Buf
from broker.protocol.errors import (
    CorruptRecordBatch,
    InvalidRecordBatch,
    InvalidRecordTimestamp,
    RecordBatchError,
    RecordBatchTooLarge,
    UnsupportedCompression,
)
from broker.protocol.records import (
    BATCH_HEADER_SIZE,
    BatchHeader,
    Compression,
    decompress,
    validate_batch,
)

try:
    from storage import _native
except ImportError:  # no Rust toolchain at install time: the Python twin serves
    _native = None  # type: ignore[assignment]

__all__ = [
    "INFLATE_LIMIT_FACTOR",
    "NATIVE",
    "CheckedBatch",
    "TimestampRange",
    "check_batch",
    "check_batch_native",
    "check_batch_python",
    "crc32c",
    "inflate_limit",
    "validate_records",
    "validate_records_native",
    "validate_records_python",
]

INFLATE_LIMIT_FACTOR: Final = 64
NATIVE: Final = _native is not None and os.environ.get("HYPERKAFKA_NO_NATIVE") != "1"

_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_NO_TIMESTAMP: Final = -1

# Verdict codes shared with the native core (storage/native/src/lib.rs).
_OK: Final = 0
_CORRUPT: Final = 2
_INVALID_TIMESTAMP: Final = 32
_INVALID_RECORD: Final = 87
_UNSUPPORTED_COMPRESSION: Final = 76
_CLASSES: Final[dict[int, type[RecordBatchError]]] = {
    _CORRUPT: CorruptRecordBatch,
    _INVALID_TIMESTAMP: InvalidRecordTimestamp,
    _INVALID_RECORD: InvalidRecordBatch,
    _UNSUPPORTED_COMPRESSION: UnsupportedCompression,
}


class TimestampRange(NamedTuple):
    """Inclusive bounds for CreateTime record timestamps, clamped to int64."""

    low: int
    high: int

    @classmethod
    def around(cls, now_ms: int, before_max_ms: int, after_max_ms: int) -> TimestampRange:
        return cls(max(now_ms - before_max_ms, _I64_MIN), min(now_ms + after_max_ms, _I64_MAX))


def crc32c(data: Buf) -> int:
    """CRC-32C, natively where built (as fast as the crc32c package here; one less
    dependency of the hot path on a separate C extension)."""
    if NATIVE:
        return int(_native.crc32c(data))
    return int(_crc32c.crc32c(data))


def inflate_limit(max_message_bytes: int) -> int:
    """The most inflated record bytes a compressed batch of this topic may hold."""
    return INFLATE_LIMIT_FACTOR * max(max_message_bytes, 1)


def validate_records(
    batch: Buf, header: BatchHeader, *, max_inflated: int, timestamps: TimestampRange | None
) -> int:
    """Check every record of one whole batch whose header passed `validate_batch`.

    Returns the largest record timestamp (-1 if none has one). Raises `InvalidRecordBatch`,
    `InvalidRecordTimestamp` or `CorruptRecordBatch`, with `record_index` where a record is
    to blame. `timestamps` is None for LogAppendTime topics (no per-record check).
    Native where built (set HYPERKAFKA_NO_NATIVE=1 to use the Python twin).
    """
    if NATIVE:
        return validate_records_native(
            batch, header, max_inflated=max_inflated, timestamps=timestamps
        )
    return validate_records_python(batch, header, max_inflated=max_inflated, timestamps=timestamps)


class CheckedBatch:
    """A batch whose header, length, CRC-32C and count passed, and its records' verdict."""

    __slots__ = ("_max_timestamp", "_refusal", "header")

    def __init__(
        self, header: BatchHeader, max_timestamp: int, refusal: RecordBatchError | None
    ) -> None:
        self.header = header
        self._max_timestamp = max_timestamp
        self._refusal = refusal

    def records(self) -> int:
        """The largest record timestamp (-1: none has one), or raise the records' verdict
        (as `validate_records` does)."""
        if self._refusal is not None:
            raise self._refusal
        return self._max_timestamp

    def verdict(self) -> tuple[int, int | None, str] | None:
        """(error code, record index, message) of the refusal, None if the records pass."""
        r = self._refusal
        return None if r is None else (r.error_code, r.record_index, str(r))


def check_batch(
    batch: Buf, *, max_inflated: int, timestamps: TimestampRange | None
) -> CheckedBatch:
    """Produce's per-byte checks of one whole batch. Raises what `records.validate_batch`
    raises (header, length, CRC-32C, count: in its order); the records' verdict is in the
    result (`CheckedBatch.records`). Native where built: one call, one pass."""
    if NATIVE:
        return check_batch_native(batch, max_inflated=max_inflated, timestamps=timestamps)
    return check_batch_python(batch, max_inflated=max_inflated, timestamps=timestamps)


def check_batch_native(
    batch: Buf, *, max_inflated: int, timestamps: TimestampRange | None
) -> CheckedBatch:
    """`check_batch` by the native core: CRC-32C and the records' walk in one call, then
    the batch checks in `validate_batch`'s order with that CRC."""
    if _native is None:
        raise RuntimeError("the native core (storage._native) was not built")
    low, high = timestamps if timestamps is not None else (_I64_MIN, _I64_MAX)
    crc, code, index, message, max_ts = _native.check_batch(
        batch, max_inflated, timestamps is not None, low, high
    )
    header = validate_batch(batch, decode=False, crc=lambda _: crc)
    if code == _OK:
        return CheckedBatch(header, int(max_ts), None)
    refusal = _CLASSES[code](message or f"refused with code {code}", None if index < 0 else index)
    return CheckedBatch(header, _NO_TIMESTAMP, refusal)


def check_batch_python(
    batch: Buf, *, max_inflated: int, timestamps: TimestampRange | None
) -> CheckedBatch:
    """`check_batch` in Python: the reference the native core is held to."""
    header = validate_batch(batch, decode=False, crc=_crc32c.crc32c)
    try:
        max_ts = validate_records_python(
            batch, header, max_inflated=max_inflated, timestamps=timestamps
        )
    except RecordBatchError as exc:
        return CheckedBatch(header, _NO_TIMESTAMP, exc)
    return CheckedBatch(header, max_ts, None)


def validate_records_native(
    batch: Buf, header: BatchHeader, *, max_inflated: int, timestamps: TimestampRange | None
) -> int:
    """`validate_records` by the native core (which reads the header from the bytes)."""
    if _native is None:
        raise RuntimeError("the native core (storage._native) was not built")
    del header
    low, high = timestamps if timestamps is not None else (_I64_MIN, _I64_MAX)
    code, index, message, max_ts = _native.validate_records(
        batch, max_inflated, timestamps is not None, low, high
    )
    if code == _OK:
        return int(max_ts)
    raise _CLASSES[code](message or f"refused with code {code}", None if index < 0 else index)


# ----------------------------------------------------------------- the Python twin


class _Bad(Exception):
    """A record does not parse; the message names the field."""


def _varint(buf: memoryview, pos: int, end: int, what: str, max_bytes: int) -> tuple[int, int]:
    """Zig-zag varint (max_bytes 5) or varlong (10) within buf[pos:end], no wider than
    32 or 64 bits (Kafka drops the excess bits silently; no encoder writes them)."""
    bits = 32 if max_bytes == 5 else 64
    raw = shift = 0
    for _ in range(max_bytes):
        if pos >= end:
            raise _Bad(f"{what} runs past the record")
        b = buf[pos]
        pos += 1
        raw |= (b & 0x7F) << shift
        if not b & 0x80:
            if raw >> bits:
                raise _Bad(f"{what} varint is wider than {bits} bits")
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7
    raise _Bad(f"{what} varint is longer than {max_bytes} bytes")


def _skip(pos: int, n: int, end: int, what: str) -> int:
    if n > end - pos:
        raise _Bad(f"{what} of {n} bytes runs past the record")
    return pos + n


def _wrap64(value: int) -> int:
    return ((value - _I64_MIN) & 0xFFFF_FFFF_FFFF_FFFF) + _I64_MIN


def validate_records_python(
    batch: Buf, header: BatchHeader, *, max_inflated: int, timestamps: TimestampRange | None
) -> int:
    """`validate_records` in Python: the reference the native core is held to."""
    body = memoryview(batch)[BATCH_HEADER_SIZE : header.size]
    if header.compression == Compression.NONE:
        data = body
    else:
        try:
            data = memoryview(decompress(header.compression, body, max_inflated))
        except RecordBatchTooLarge:
            raise InvalidRecordBatch(
                f"records inflate past {max_inflated} bytes "
                f"({INFLATE_LIMIT_FACTOR} x max.message.bytes)"
            ) from None
    count = header.records_count
    fixed_ts = header.max_timestamp if header.is_log_append_time else None
    end = len(data)
    pos = 0
    max_ts = _NO_TIMESTAMP
    late: tuple[int, int] | None = None  # first record out of the timestamp range
    for i in range(count):
        if pos >= end:
            raise InvalidRecordBatch(
                f"record {i} is missing: the batch declares {count} records", i
            )
        try:
            length, pos = _varint(data, pos, end, "length", 5)
        except _Bad as exc:
            raise InvalidRecordBatch(f"record {i}: {exc}", i) from None
        if length < 0 or length > end - pos:
            raise InvalidRecordBatch(
                f"record {i}: length {length} runs past the {end - pos} bytes left", i
            )
        stop = pos + length
        try:
            if pos >= stop:
                raise _Bad("attributes runs past the record")
            pos += 1
            ts_delta, pos = _varint(data, pos, stop, "timestamp delta", 10)
            offset_delta, pos = _varint(data, pos, stop, "offset delta", 5)
            for what in ("key", "value"):
                n, pos = _varint(data, pos, stop, f"{what} length", 5)
                if n < -1:
                    raise _Bad(f"{what} length {n} is negative")
                if n > 0:
                    pos = _skip(pos, n, stop, what)
            n_headers, pos = _varint(data, pos, stop, "header count", 5)
            if n_headers < 0:
                raise _Bad(f"header count {n_headers} is negative")
            for _ in range(n_headers):
                n, pos = _varint(data, pos, stop, "header key length", 5)
                if n < 0:
                    raise _Bad(f"header key length {n}: a header key may not be null")
                pos = _skip(pos, n, stop, "header key")
                n, pos = _varint(data, pos, stop, "header value length", 5)
                if n < -1:
                    raise _Bad(f"header value length {n} is negative")
                if n > 0:
                    pos = _skip(pos, n, stop, "header value")
            if pos != stop:
                raise _Bad(f"{stop - pos} bytes left over after the record's fields")
            if offset_delta != i:
                raise _Bad(f"offset delta {offset_delta}, expected {i}")
        except _Bad as exc:
            raise InvalidRecordBatch(f"record {i}: {exc}", i) from None
        ts = fixed_ts if fixed_ts is not None else _wrap64(header.base_timestamp + ts_delta)
        if ts > max_ts:
            max_ts = ts
        if (
            timestamps is not None
            and late is None
            and ts != _NO_TIMESTAMP
            and not timestamps.low <= ts <= timestamps.high
        ):
            late = (i, ts)
    if pos != end:
        raise InvalidRecordBatch(f"{end - pos} bytes after the last of the {count} records")
    if late is not None:
        i, ts = late
        assert timestamps is not None
        raise InvalidRecordTimestamp(
            f"record {i}: timestamp {ts} is out of range [{timestamps.low}, {timestamps.high}]",
            i,
        )
    return max_ts

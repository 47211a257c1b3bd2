"""Record batches (message format v2) that lie, and compression bombs.

Our own writer of DefaultRecordBatch bytes, independent of the broker's reader, so every
field can be made to lie: counts, record lengths and varints, offset deltas, header keys,
timestamps, attributes, nested batches, a CRC-32C made valid over garbage, and payloads that
inflate far past max.message.bytes. `ATTACKS` maps an attack class to its named batches; a
broker must refuse every one (a Kafka error for the partition, nothing stored).

Imports crc32c, the codec libraries the broker also depends on, and the standard library.
"""

from __future__ import annotations

import functools
import random
import struct
import time
import zlib
from collections.abc import Callable, Sequence

import crc32c

CODEC = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
ATTR_CONTROL = 0x20


def zigzag(n: int) -> bytes:
    """A signed varint (Kafka's ByteUtils.writeVarlong), any width."""
    z = (n << 1) ^ (n >> 63)
    z &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = z & 0x7F
        z >>= 7
        if z:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def varbytes(data: bytes | None) -> bytes:
    return zigzag(-1) if data is None else zigzag(len(data)) + data


def record_body(
    offset_delta: int,
    *,
    ts_delta: int = 0,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    headers: Sequence[tuple[bytes | None, bytes | None]] = (),
    attributes: int = 0,
) -> bytes:
    out = bytes([attributes]) + zigzag(ts_delta) + zigzag(offset_delta)
    out += varbytes(key) + varbytes(value) + zigzag(len(headers))
    for hk, hv in headers:
        out += varbytes(hk) + varbytes(hv)
    return out


def record(offset_delta: int, **kw: object) -> bytes:
    body = record_body(offset_delta, **kw)  # type: ignore[arg-type]
    return zigzag(len(body)) + body


def records(n: int, value: bytes = b"v") -> bytes:
    return b"".join(record(i, key=b"k%d" % i, value=value) for i in range(n))


def batch(
    payload: bytes,
    count: int,
    *,
    last_offset_delta: int | None = None,
    codec: int = 0,
    attributes: int = 0,
    base_ts: int | None = None,
    max_ts: int | None = None,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    magic: int = 2,
    crc: int | None = None,
    length_delta: int = 0,
) -> bytes:
    """One batch around `payload` (the records section, already compressed if `codec`)."""
    now = int(time.time() * 1000) if base_ts is None else base_ts
    lod = count - 1 if last_offset_delta is None else last_offset_delta
    after_crc = struct.pack(
        ">hiqqqhii",
        (attributes | codec) & 0xFFFF,
        lod,
        now,
        now if max_ts is None else max_ts,
        producer_id,
        producer_epoch,
        base_sequence,
        count,
    ) + payload  # fmt: skip
    c = crc32c.crc32c(after_crc) if crc is None else crc
    rest = struct.pack(">ibI", 0, magic, c) + after_crc  # leader epoch, magic, crc
    return struct.pack(">qi", 0, len(rest) + length_delta) + rest


def good(n: int = 3) -> bytes:
    return batch(records(n), n)


# ---------------------------------------------------------------- compression


def gzip(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def compress(codec: str, data: bytes) -> bytes:
    if codec == "gzip":
        return gzip(data)
    if codec == "snappy":
        import snappy  # type: ignore[import-untyped]

        return bytes(snappy.compress(data))
    if codec == "lz4":
        import lz4.frame  # type: ignore[import-untyped]

        return bytes(lz4.frame.compress(data))
    if codec == "zstd":
        import zstandard

        return bytes(zstandard.ZstdCompressor().compress(data))
    return data


def _zero_stream(size: int, step: int = 1 << 24) -> list[int]:
    return [min(step, size - i) for i in range(0, size, step)]


@functools.cache
def bomb(codec: str, inflated: int, lead: bytes = b"") -> bytes:
    """`lead` followed by zeros up to `inflated` bytes, compressed whole by `codec` into a
    stream a few hundred KiB long (built chunk by chunk: never `inflated` bytes at once)."""
    chunk = bytes(1 << 24)
    if codec == "gzip":
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        out = [c.compress(lead)]
        out += [c.compress(chunk[:n]) for n in _zero_stream(inflated - len(lead))]
        return b"".join([*out, c.flush()])
    if codec == "zstd":
        import zstandard

        co = zstandard.ZstdCompressor(level=1).compressobj()
        out = [co.compress(lead)]
        out += [co.compress(chunk[:n]) for n in _zero_stream(inflated - len(lead))]
        return b"".join([*out, co.flush()])
    if codec == "lz4":
        import lz4.frame

        lc = lz4.frame.LZ4FrameCompressor(compression_level=0)
        out = [lc.begin(), lc.compress(lead)]
        out += [lc.compress(chunk[:n]) for n in _zero_stream(inflated - len(lead))]
        return b"".join([*out, lc.flush()])
    if codec == "snappy":
        import snappy

        # Raw snappy peaks near 21:1; the real bomb is the block header's stated length,
        # which a decoder that trusts it allocates before it reads a byte.
        return bytes(snappy.compress(lead + bytes(max(0, inflated - len(lead)))))
    raise ValueError(codec)


def snappy_lying_length(stated: int) -> bytes:
    """A raw snappy block whose header claims `stated` bytes but holds a 4-byte literal."""
    out = bytearray()
    z = stated
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out) + bytes([3 << 2]) + b"abcd"


def xerial(blocks: Sequence[bytes]) -> bytes:
    """Java's xerial snappy framing around raw snappy blocks."""
    out = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    for b in blocks:
        out += struct.pack(">i", len(b)) + b
    return out


def huge_value_record(size: int) -> bytes:
    """The start of one record whose value is `size` zero bytes (the zeros are not here)."""
    body_head = bytes([0]) + zigzag(0) + zigzag(0) + zigzag(-1) + zigzag(size)
    return zigzag(len(body_head) + size + 1) + body_head  # + value + zigzag(0) headers


# ---------------------------------------------------------------- the attack catalog

Builder = Callable[[], bytes]


def _count_lies() -> dict[str, Builder]:
    one = record(0)
    return {
        "count-2^31-1": lambda: batch(one, 2**31 - 1),
        "count-2^31-1-lod-0": lambda: batch(one, 2**31 - 1, last_offset_delta=0),
        "count-0": lambda: batch(b"", 0, last_offset_delta=0),
        "count-negative": lambda: batch(one, -1, last_offset_delta=0),
        "count-5-has-3": lambda: batch(records(3), 5),
        "count-2-has-3": lambda: batch(records(3), 2),
        "count-lies-gzip": lambda: batch(gzip(records(3)), 2**31 - 1, codec=1),
        "lod-lies": lambda: batch(records(3), 3, last_offset_delta=2**31 - 1),
    }


def _length_lies() -> dict[str, Builder]:
    body = record_body(0)
    return {
        "record-length-past-end": lambda: batch(zigzag(len(body) + 50) + body, 1),
        "record-length-huge": lambda: batch(zigzag(2**31 - 1) + body, 1),
        "record-length-negative": lambda: batch(zigzag(-7) + body, 1),
        "record-length-short": lambda: batch(zigzag(len(body) - 2) + body, 1),
        "record-length-zero": lambda: batch(zigzag(0), 1),
        "varint-overlong": lambda: batch(b"\xff" * 11 + body, 1),
        "key-length-past-end": lambda: batch(
            _with_body(bytes([0]) + zigzag(0) + zigzag(0) + zigzag(1000) + b"abc"), 1
        ),
        "value-length-2^31": lambda: batch(
            _with_body(bytes([0]) + zigzag(0) + zigzag(0) + zigzag(-1) + zigzag(2**31 - 1)), 1
        ),
        "key-length-below-minus-1": lambda: batch(
            _with_body(bytes([0]) + zigzag(0) + zigzag(0) + zigzag(-5) + zigzag(-1) + zigzag(0)), 1
        ),
        "trailing-bytes": lambda: batch(records(2) + b"\x00garbage", 2),
        "batch-length-short": lambda: batch(records(2), 2, length_delta=-3),
    }


def _with_body(body: bytes) -> bytes:
    return zigzag(len(body)) + body


def _offset_deltas() -> dict[str, Builder]:
    def deltas(ds: Sequence[int], lod: int | None = None) -> bytes:
        return batch(b"".join(record(d) for d in ds), len(ds), last_offset_delta=lod)

    return {
        "repeat-0-0-1": lambda: deltas([0, 0, 1], 2),
        "backwards-2-1-0": lambda: deltas([2, 1, 0], 2),
        "start-at-1": lambda: deltas([1, 2, 3], 2),
        "gaps-0-2-4": lambda: deltas([0, 2, 4], 2),
        "negative": lambda: deltas([0, -1, 1], 2),
        "huge-delta": lambda: deltas([0, 1, 2**31 - 1], 2),
        "compressed-repeat": lambda: batch(
            gzip(b"".join(record(d) for d in (0, 0, 0))), 3, codec=1
        ),
    }


def _nested() -> dict[str, Builder]:
    inner = good(2)
    return {
        "batch-as-records": lambda: batch(inner, 2),
        "batch-as-gzip-payload": lambda: batch(gzip(inner), 2, codec=1),
        "batch-as-zstd-payload": lambda: batch(compress("zstd", inner), 2, codec=4),
        "good-then-lying": lambda: good(2) + batch(record(0), 2**31 - 1),
        "good-then-partial": lambda: good(2) + good(2)[:30],
        "magic-1-inner-gzip": lambda: batch(gzip(_legacy_message_set()), 1, codec=1),
        "double-gzip": lambda: batch(gzip(gzip(records(2))), 2, codec=1),
    }


def _legacy_message_set() -> bytes:
    """One magic-1 message (an old-format message set), what old brokers nested."""
    body = struct.pack(">bbq", 1, 0, 0) + struct.pack(">i", -1) + struct.pack(">i", 1) + b"v"
    msg = struct.pack(">I", zlib.crc32(body)) + body
    return struct.pack(">qi", 0, len(msg)) + msg


def _kv_then(tail: bytes) -> bytes:
    """One record (key "k", value "v") whose header section is `tail`, as raw bytes."""
    return _with_body(bytes([0]) + zigzag(0) + zigzag(0) + varbytes(b"k") + varbytes(b"v") + tail)


def _headers() -> dict[str, Builder]:
    return {
        "null-header-key": lambda: batch(record(0, headers=[(None, b"v")]), 1),
        "bad-utf8-header-key": lambda: batch(record(0, headers=[(b"\xff\xfe", b"v")]), 1),
        "header-count-negative": lambda: batch(_kv_then(zigzag(-3)), 1),
        "header-count-huge": lambda: batch(_kv_then(zigzag(2**31 - 1)), 1),
        "header-value-past-end": lambda: batch(
            _kv_then(zigzag(1) + varbytes(b"h") + zigzag(500) + b"x"), 1
        ),
        "header-key-length-huge": lambda: batch(_kv_then(zigzag(1) + zigzag(2**31 - 1)), 1),
    }


def _fields() -> dict[str, Builder]:
    now = int(time.time() * 1000)
    return {
        "codec-7": lambda: batch(records(1), 1, codec=7),
        "codec-5": lambda: batch(records(1), 1, codec=5),
        "control-batch": lambda: batch(records(1), 1, attributes=ATTR_CONTROL),
        "magic-1": lambda: batch(records(1), 1, magic=1),
        "magic-3": lambda: batch(records(1), 1, magic=3),
        "timestamp-a-day-ahead": lambda: batch(records(1), 1, base_ts=now + 86_400_000),
        "record-timestamp-a-day-ahead": lambda: batch(record(0, ts_delta=86_400_000), 1),
        "crc-wrong": lambda: batch(records(1), 1, crc=0xDEADBEEF),
    }


def _garbage() -> dict[str, Builder]:
    rng = random.Random(15)
    return {
        f"random-{i}-count-{n}": (lambda i=i, n=n: batch(rng.randbytes(40 + 37 * i), n))
        for i, n in enumerate((1, 3, 10, 1000))
    } | {
        "random-gzip-payload": lambda: batch(gzip(random.Random(3).randbytes(300)), 5, codec=1),
        "valid-gzip-of-garbage": lambda: batch(gzip(b"\x01" * 400), 5, codec=1),
        "truncated-gzip": lambda: batch(gzip(records(50))[:-20], 50, codec=1),
        "truncated-zstd": lambda: batch(compress("zstd", records(50))[:-5], 50, codec=4),
        "truncated-lz4": lambda: batch(compress("lz4", records(50))[:-5], 50, codec=3),
        "truncated-snappy": lambda: batch(compress("snappy", records(50))[:-5], 50, codec=2),
    }


GIB = 1 << 30
MIB = 1 << 20


def _bombs(codec: str) -> dict[str, Builder]:
    c = CODEC[codec]
    size = {"gzip": 512 * MIB, "zstd": 4 * GIB, "lz4": 200 * MIB, "snappy": 20 * MIB}[codec]
    out: dict[str, Builder] = {
        # Zeros from the first byte: a validator that streams stops at once.
        f"{codec}-zeros-{size // MIB}MiB": lambda: batch(bomb(codec, size), 1, codec=c),
        # One record whose value is all the zeros: only a cap on the inflated size stops it.
        f"{codec}-one-record-{size // MIB}MiB": lambda: batch(
            bomb(codec, size, huge_value_record(size - 16)), 1, codec=c
        ),
    }
    if codec == "snappy":
        out["snappy-states-4GiB"] = lambda: batch(snappy_lying_length(4 * GIB - 1), 1, codec=c)
        out["xerial-states-4GiB"] = lambda: batch(
            xerial([snappy_lying_length(4 * GIB - 1)] * 8), 1, codec=c
        )
        out["xerial-many-blocks"] = lambda: batch(
            xerial([bomb("snappy", 1 * MIB)] * 20), 1, codec=c
        )
    if codec == "zstd":
        # Many concatenated frames, each inflating 256 MiB.
        out["zstd-frames-4GiB"] = lambda: batch(bomb("zstd", 256 * MIB) * 16, 1, codec=c)
    return out


ATTACKS: dict[str, Callable[[], dict[str, Builder]]] = {
    "count-lies": _count_lies,
    "length-lies": _length_lies,
    "offset-deltas": _offset_deltas,
    "nested-batches": _nested,
    "bad-record-headers": _headers,
    "bad-batch-fields": _fields,
    "valid-crc-garbage": _garbage,
    **{
        f"bomb-{codec}": functools.partial(_bombs, codec)
        for codec in ("gzip", "zstd", "lz4", "snappy")
    },
}

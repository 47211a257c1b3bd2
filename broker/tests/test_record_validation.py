"""Record-level validation of produced batches: named hostile cases, and the native core
held to the Python twin's verdicts over random and hostile batches (hypothesis).

Batches are built here field by field (so that any field can lie) and cross-checked with
kafka-python's builder for well-formed ones.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Callable

import crc32c
import lz4.frame
import pytest
import snappy
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.codec import snappy_encode
from kafka.record.default_records import DefaultRecordBatchBuilder

from broker import validation as RV
from broker.protocol import records as R
from broker.protocol.errors import (
    CORRUPT_MESSAGE,
    INVALID_RECORD,
    INVALID_TIMESTAMP,
    RecordBatchError,
)

NATIVE = RV._native is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="storage._native was not built")
PATHS = [RV.validate_records_python] + ([RV.validate_records_native] if NATIVE else [])
CAP = 1 << 20
NOW = 1_700_000_000_000
WIDE = RV.TimestampRange(-(2**63), 2**63 - 1)


def zz(n: int) -> bytes:
    """Zig-zag varint (any width: tests use it to write over-long ones too)."""
    u = (n << 1) ^ (n >> 63) if -(2**63) <= n < 2**63 else n
    u &= (1 << 70) - 1
    out = bytearray()
    while u > 0x7F:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def record(
    offset_delta: int,
    ts_delta: int = 0,
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    headers: list[tuple[bytes | None, bytes | None]] | None = None,
    attributes: int = 0,
    extra: bytes = b"",
) -> bytes:
    def varbytes(b: bytes | None) -> bytes:
        return zz(-1) if b is None else zz(len(b)) + b

    body = bytes([attributes]) + zz(ts_delta) + zz(offset_delta) + varbytes(key) + varbytes(value)
    hs = headers or []
    body += zz(len(hs)) + b"".join(varbytes(k) + varbytes(v) for k, v in hs) + extra
    return zz(len(body)) + body


def batch(
    section: bytes,
    count: int,
    *,
    codec: int = 0,
    last_offset_delta: int | None = None,
    base_ts: int = NOW,
    max_ts: int | None = None,
    attributes: int = 0,
) -> bytes:
    """A v2 batch around `section` (already compressed if `codec`), with a good CRC."""
    lod = count - 1 if last_offset_delta is None else last_offset_delta
    head = struct.pack(
        ">hiqqqhii",
        attributes | codec,
        lod,
        base_ts,
        NOW if max_ts is None else max_ts,
        -1,
        -1,
        -1,
        count,
    )
    body = head + section
    crc = crc32c.crc32c(body)
    return struct.pack(">qiibI", 0, len(body) + 9, 0, 2, crc) + body


def good(n: int = 3, codec: int = 0, compress: Callable[[bytes], bytes] | None = None) -> bytes:
    section = b"".join(
        record(i, ts_delta=i, headers=[(b"h", b"x")] if i % 2 else None) for i in range(n)
    )
    if compress is not None:
        section = compress(section)
    return batch(section, n, codec=codec, max_ts=NOW + n - 1)


def verdict(
    fn: Callable[..., int], data: bytes, cap: int = CAP, ts: RV.TimestampRange | None = WIDE
) -> tuple[object, ...]:
    header = R.parse_batch_header(data)
    try:
        return ("ok", fn(data, header, max_inflated=cap, timestamps=ts))
    except RecordBatchError as exc:
        return (exc.error_code, exc.record_index)


# A damaged compressed stream whose output reaches the cap just where the damage is: one
# decoder notices the damage before it stops at the cap (zlib checks a gzip trailer that
# needs no output space, flate2 on the next read), the other does not. Both refuse the
# batch, without a record to blame; only the code differs. Nowhere else may they differ.
_AT_THE_CAP = {(CORRUPT_MESSAGE, None), (INVALID_RECORD, None)}


def every_path(
    data: bytes, cap: int = CAP, ts: RV.TimestampRange | None = WIDE
) -> tuple[object, ...]:
    """The verdict, after checking that both paths agree on it."""
    verdicts = {verdict(fn, data, cap, ts) for fn in PATHS}
    if verdicts == _AT_THE_CAP and R.parse_batch_header(data).compression:
        body = data[R.BATCH_HEADER_SIZE :]
        with pytest.raises(RecordBatchError):  # it does pass the cap, and it is damaged
            R.decompress(R.parse_batch_header(data).compression, body, max_size=cap)
        return (INVALID_RECORD, None)
    assert len(verdicts) == 1, verdicts
    return verdicts.pop()


CODECS: list[tuple[int, Callable[[bytes], bytes]]] = [
    (1, gzip.compress),
    (1, zlib.compress),
    (2, snappy.compress),
    (2, lambda d: snappy_encode(d, xerial_compatible=True, xerial_blocksize=64)),
    (3, lz4.frame.compress),
    (4, zstandard.ZstdCompressor().compress),
    (4, zstandard.ZstdCompressor(write_content_size=False).compress),
]


# ----------------------------------------------------------------- well-formed batches


def test_ci_builds_the_native_core() -> None:
    """Under CI the install must have compiled storage._native (the Rust core)."""
    if os.environ.get("CI") == "true":
        assert NATIVE, "storage._native is missing: the Rust extension was not built"
        assert RV.NATIVE


def test_good_batches_pass_with_their_max_timestamp() -> None:
    assert every_path(good(5)) == ("ok", NOW + 4)


@pytest.mark.parametrize(("codec", "compress"), CODECS)
def test_good_compressed_batches_pass(codec: int, compress: Callable[[bytes], bytes]) -> None:
    assert every_path(good(40, codec, compress)) == ("ok", NOW + 39)


@pytest.mark.parametrize("codec", [0, 1, 2, 3, 4])
def test_kafka_python_batches_pass(codec: int) -> None:
    b = DefaultRecordBatchBuilder(
        magic=2, compression_type=codec, is_transactional=False, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20,
    )  # fmt: skip
    for i in range(20):
        b.append(
            i,
            timestamp=NOW + i,
            key=None if i % 3 else b"k",
            value=b"v" * i,
            headers=[("h", b"1")] * (i % 2),
        )
    assert every_path(bytes(b.build())) == ("ok", NOW + 19)


# ----------------------------------------------------------------- named hostile cases


def test_count_larger_than_records_present() -> None:
    """The 70-byte batch that claimed 2^31-1 records and moved the high watermark."""
    section = record(0)
    assert every_path(batch(section, 2**31 - 1)) == (INVALID_RECORD, 1)


def test_count_smaller_than_records_present() -> None:
    section = record(0) + record(1) + record(2)
    assert every_path(batch(section, 2)) == (INVALID_RECORD, None)


@pytest.mark.parametrize("deltas", [[0, 0, 1], [0, 2, 1], [1, 2, 3], [0, 1, 1], [-1, 0, 1]])
def test_offset_deltas_must_run_0_to_n_minus_1(deltas: list[int]) -> None:
    first_bad = next(i for i, d in enumerate(deltas) if d != i)
    section = b"".join(record(d) for d in deltas)
    assert every_path(batch(section, 3)) == (INVALID_RECORD, first_bad)


@pytest.mark.parametrize(
    "bad",
    [
        zz(500) + b"\x00" * 10,  # length past the batch
        zz(-3) + b"\x00" * 10,  # negative length
        b"\xff\xff\xff\xff\xff\xff",  # length varint too long
        b"\xff\xff\xff\xff\x7f",  # length varint wider than 32 bits
        zz(3) + b"\x00\x00\x02",  # fields run past the record's length
        record(1, key=None)[:-1],  # record cut short at the end of the batch
        record(1, extra=b"\x00"),  # a byte left over inside the record
        record(1, headers=[(None, b"x")]),  # null header key
        record(1, key=b"")[:1] + b"\x00" + zz(2) + zz(1) + zz(-5) + zz(-1) + zz(0),  # key length -5
        record(1)[:1] + b"\x00\x00" + zz(1) + zz(-1) + zz(-1) + zz(-1),  # negative header count
        record(1)[:1]
        + b"\x00\x00"
        + zz(1)
        + zz(100)
        + b"x"
        + zz(-1)
        + zz(0),  # key past the record
        b"\x0c\x00" + b"\xff" * 10 + b"\x00",  # timestamp delta longer than a varlong
    ],
)
def test_broken_second_record(bad: bytes) -> None:
    data = batch(record(0) + bad, 2)
    assert every_path(data) == (INVALID_RECORD, 1)


def test_trailing_bytes_after_the_last_record() -> None:
    assert every_path(batch(record(0) + record(1) + b"\x00", 2)) == (INVALID_RECORD, None)


def test_a_batch_nested_in_a_compressed_wrapper_is_refused() -> None:
    inner = good(3)
    for codec, compress in CODECS:
        assert every_path(batch(compress(inner), 3, codec=codec)) == (INVALID_RECORD, 0), codec


def test_a_batch_nested_uncompressed_is_refused() -> None:
    assert every_path(batch(good(2), 2))[0] == INVALID_RECORD


@pytest.mark.parametrize(("codec", "compress"), CODECS)
def test_compression_bomb_stops_at_the_cap(codec: int, compress: Callable[[bytes], bytes]) -> None:
    section = b"".join(record(i, value=b"\x00" * 4000) for i in range(300))  # ~1.2 MB inflated
    data = batch(compress(section), 300, codec=codec)
    assert len(data) < len(section) // 5
    assert every_path(data, cap=1_000_000) == (INVALID_RECORD, None)
    assert every_path(data, cap=2_000_000) == ("ok", NOW)


@needs_native
def test_a_gigabyte_bomb_costs_the_native_path_no_memory() -> None:
    """1 GiB of zeros inflating under a 64 MiB cap: refused in well under a second,
    through a window of 64 KiB (the Python twin would hold up to the cap)."""
    import resource

    zeros = zstandard.ZstdCompressor(level=3).compress(b"\x00" * (1 << 30))
    data = batch(zeros, 1, codec=4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert verdict(RV.validate_records_native, data, cap=64 << 20)[0] == INVALID_RECORD
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 32 * 1024  # KiB


@pytest.mark.parametrize(("codec", "compress"), CODECS)
def test_truncated_and_padded_compressed_data_is_corrupt(
    codec: int, compress: Callable[[bytes], bytes]
) -> None:
    section = compress(b"".join(record(i) for i in range(50)))
    assert every_path(batch(section[:-3], 50, codec=codec))[0] in (CORRUPT_MESSAGE, INVALID_RECORD)
    assert every_path(batch(section + b"\x07garbage", 50, codec=codec))[0] in (
        CORRUPT_MESSAGE,
        INVALID_RECORD,
    )
    assert every_path(batch(b"", 50, codec=codec)) == (CORRUPT_MESSAGE, None)


def test_timestamps_out_of_range_name_the_first_record() -> None:
    section = record(0) + record(1, ts_delta=10_000) + record(2, ts_delta=20_000)
    bounds = RV.TimestampRange.around(NOW, 1000, 5000)
    assert every_path(batch(section, 3), ts=bounds) == (INVALID_TIMESTAMP, 1)
    assert every_path(batch(section, 3), ts=None) == ("ok", NOW + 20_000)  # LogAppendTime topic
    # A structural error anywhere wins over a timestamp, as in Kafka.
    assert every_path(batch(section + b"\x00", 3), ts=bounds) == (INVALID_RECORD, None)


def test_no_timestamp_is_not_out_of_range() -> None:
    section = record(0, ts_delta=-1 - NOW)
    assert every_path(batch(section, 1), ts=RV.TimestampRange.around(NOW, 10, 10)) == ("ok", -1)


def test_timestamps_wrap_as_java_longs() -> None:
    """base + delta wraps to -2^63 + 9 (Kafka adds longs): within [-2^63, NOW]."""
    section = record(0, ts_delta=2**63 - 1)
    assert every_path(batch(section, 1, base_ts=10), ts=RV.TimestampRange(-(2**63), NOW)) == (
        "ok",
        -1,
    )


def test_unknown_codec_is_unsupported_compression() -> None:
    assert every_path(batch(b"\x00" * 10, 1, codec=6)) == (76, None)


def test_inflate_limit_is_64_times_max_message_bytes() -> None:
    assert RV.INFLATE_LIMIT_FACTOR == 64
    assert RV.inflate_limit(1048588) == 64 * 1048588


@needs_native
def test_native_crc32c_and_leaf_hashes() -> None:
    import hashlib

    from storage import _native
    from storage.hypercore.tree import leaf_hash, leaf_hashes

    def reference(b: bytes) -> bytes:  # hypercore-crypto data(): 0x00, u64le length, block
        return hashlib.blake2b(b"\x00" + len(b).to_bytes(8, "little") + b, digest_size=32).digest()

    assert _native.crc32c(b"123456789") == 0xE3069283
    blocks = [b"", b"a", b"x" * 127, b"y" * 128, bytes(range(256)) * 50, b"z" * 70_000] * 3
    want = [reference(b) for b in blocks]
    assert _native.leaf_hashes(blocks) == want
    assert leaf_hashes(blocks) == want
    assert [leaf_hash(memoryview(b)) for b in blocks] == want


# ----------------------------------------------------------------- both paths agree

_FIELDS = st.tuples(
    st.integers(-3, 5),  # offset delta
    st.one_of(st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1)),  # timestamp delta
    st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.binary(max_size=40)),
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.binary(max_size=4)), st.one_of(st.none(), st.binary(max_size=4))
        ),
        max_size=2,
    ),
    st.binary(max_size=2),  # bytes left over inside the record
)


@st.composite
def hostile_batches(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 6))
    recs = [
        record(i, ts_delta=i, key=b"k", value=b"v")
        if draw(st.integers(0, 3))
        else record(d, t, k, v, h, extra=x)
        for i, (d, t, k, v, h, x) in enumerate(draw(st.lists(_FIELDS, min_size=n, max_size=n)))
    ]
    section = bytearray(b"".join(recs))
    for _ in range(draw(st.integers(0, 3))):  # byte flips, cuts and insertions
        if not section:
            break
        at = draw(st.integers(0, len(section) - 1))
        op = draw(st.integers(0, 2))
        if op == 0:
            section[at] = draw(st.integers(0, 255))
        elif op == 1:
            del section[at:]
        else:
            section[at:at] = draw(st.binary(min_size=1, max_size=6))
    count = n + draw(st.sampled_from([0, 0, 0, -1, 1, 2**31 - 1 - n]))
    count = max(count, 1)
    codec, compress = draw(st.sampled_from([(0, bytes), (0, bytes), *CODECS]))
    body = compress(bytes(section))
    if codec and draw(st.integers(0, 4)) == 0:  # damage the compressed bytes too
        body = bytearray(body)
        at = draw(st.integers(0, max(len(body) - 1, 0)))
        if body:
            body[at] ^= draw(st.integers(1, 255))
        body = bytes(body)
    if draw(st.integers(0, 9)) == 0:
        body = draw(st.binary(max_size=80))
    attrs = draw(st.sampled_from([0, 0, 0, 0x08]))
    return batch(body, count, codec=codec, attributes=attrs, max_ts=NOW + 7)


@needs_native
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hostile_batches(),
    st.sampled_from([64, 300, CAP]),
    st.one_of(st.none(), st.just(WIDE), st.just(RV.TimestampRange.around(NOW, 3, 3))),
)
def test_native_and_python_give_the_same_verdicts(
    data: bytes, cap: int, ts: RV.TimestampRange | None
) -> None:
    every_path(data, cap, ts)


# ----------------------------------------------------------------- one pass per batch


def check_verdict(
    fn: Callable[..., RV.CheckedBatch], data: bytes, cap: int, ts: RV.TimestampRange | None
) -> tuple[object, ...]:
    """What Produce learns from `check_batch`: a batch error, or the header and the
    records' verdict (code, record index) or max timestamp."""
    try:
        checked = fn(data, max_inflated=cap, timestamps=ts)
    except RecordBatchError as exc:
        return ("batch", exc.error_code, str(exc))
    try:
        return ("records", checked.header, checked.records())
    except RecordBatchError as exc:
        return ("records", checked.header, exc.error_code, exc.record_index)


@st.composite
def damaged_batches(draw: st.DrawFn) -> bytes:
    """`hostile_batches`, and then the batch header lies too: CRC, count, length, cut."""
    data = bytearray(draw(hostile_batches()))
    what = draw(st.integers(0, 6))
    if what == 1:  # a stale CRC
        data[17 + draw(st.integers(0, 3))] ^= draw(st.integers(1, 255))
    elif what == 2:  # lastOffsetDelta and recordsCount disagree (and the CRC holds)
        struct.pack_into(">i", data, 23, draw(st.integers(-2, 8)))
        struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
    elif what == 3:  # both lie
        struct.pack_into(">i", data, 23, draw(st.integers(-2, 8)))
    elif what == 4:  # cut anywhere, or grown
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=3))
    elif what == 5:  # a batch length that is not its size
        struct.pack_into(">i", data, 8, draw(st.integers(-5, len(data) + 5)))
    return bytes(data)


@needs_native
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    damaged_batches(),
    st.sampled_from([64, 300, CAP]),
    st.one_of(st.none(), st.just(WIDE), st.just(RV.TimestampRange.around(NOW, 3, 3))),
)
def test_check_batch_native_and_python_agree(
    data: bytes, cap: int, ts: RV.TimestampRange | None
) -> None:
    native = check_verdict(RV.check_batch_native, data, cap, ts)
    python = check_verdict(RV.check_batch_python, data, cap, ts)
    if native != python:  # only the damaged stream right at the cap may differ (above)
        assert native[:2] == python[:2] and native[0] == "records"
        assert {native[2:], python[2:]} == _AT_THE_CAP
    # and the whole verdict is validate_batch's, then validate_records'
    try:
        header = R.validate_batch(data, decode=False)
    except RecordBatchError as exc:
        assert python == ("batch", exc.error_code, str(exc))
    else:
        assert python[:2] == ("records", header)
        v = verdict(RV.validate_records_python, data, cap, ts)
        assert python[2:] == ((v[1],) if v[0] == "ok" else v)


def test_check_batch_refuses_a_stale_crc_before_the_records() -> None:
    bad_records = bytearray(batch(record(0) + record(5), 2))
    bad_records[20] ^= 1  # the CRC's last byte
    for fn in [RV.check_batch_python] + ([RV.check_batch_native] if NATIVE else []):
        with pytest.raises(RecordBatchError, match="CRC mismatch") as exc:
            fn(bytes(bad_records), max_inflated=CAP, timestamps=WIDE)
        assert exc.value.error_code == CORRUPT_MESSAGE


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=40), st.integers(0, 3))
def test_native_leaf_hashes_are_hypercores(blocks: list[bytes], grow: int) -> None:
    """Many at once (lanes of unequal lengths), byte-identical to hashlib one by one."""
    import hashlib

    from storage import _native

    blocks = [b * (1 + grow * (i % 3)) for i, b in enumerate(blocks)]
    want = [
        hashlib.blake2b(b"\x00" + len(b).to_bytes(8, "little") + b, digest_size=32).digest()
        for b in blocks
    ]
    assert _native.leaf_hashes([memoryview(b) for b in blocks]) == want


def _runs_beside(call: Callable[[], object]) -> int:
    """How often another Python thread got to run during `call()` (away from its ends)."""
    import threading
    import time

    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=spin)
    t.start()
    try:
        while not stamps:
            time.sleep(0.001)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
    finally:
        stop.set()
        t.join()
    margin = (t1 - t0) / 4
    assert t1 - t0 > 0.01, "the call was too short to tell"
    return sum(1 for s in stamps if t0 + margin < s < t1 - margin)


@needs_native
def test_native_calls_release_the_gil_for_all_their_work() -> None:
    """A thread that only runs Python runs in the middle of long native calls. (Were the
    GIL held, it could not run at all between the call's start and end.)"""
    from storage import _native

    big = [bytes(64 << 20)] * 4  # 256 MiB of leaves
    assert _runs_beside(lambda: _native.leaf_hashes(big)) > 0
    # a zstd stream of 256 MiB of zeros: record 0 is bad at once, the stream is then
    # inflated to its end (a stream error would win) under the GIL-free walk
    bomb = batch(zstandard.ZstdCompressor().compress(bytes(256 << 20)), 1, codec=4)
    code = _native.check_batch(bomb, 1 << 30, False, 0, 0)[1]
    assert code == INVALID_RECORD
    assert _runs_beside(lambda: _native.check_batch(bomb, 1 << 30, False, 0, 0)) > 0

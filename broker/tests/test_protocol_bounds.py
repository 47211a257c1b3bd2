"""Decoding cannot abort or over-allocate: the bounds walk in front of kio's reader.

Every (api, version) the broker accepts is exercised from valid requests built with kio:
valid ones decode (the walk refuses nothing Kafka accepts), truncated, bit-flipped and
lying ones raise only `ProtocolError`, non-nullable fields sent as null are refused, and
frames that once aborted the process (a 5-byte varint array count) are refused in a
subprocess, so an abort shows as a failed test instead of a dead pytest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import uuid
from functools import cache
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader

import broker.handlers  # noqa: F401  (fills the registry)
from broker.api import REGISTRY
from broker.protocol import MalformedRequest, ProtocolError, RequestHeader, bounds
from broker.protocol._wire import read_uvarint, skip_tagged_fields, write_uvarint
from broker.protocol.bounds import MAX_ELEMENTS, check_request_body, min_size, walker
from broker.protocol.codec import decode_request, decode_response, encode_request, request_schema
from broker.protocol.fastpath import (
    ProducePartitionResult,
    decode_produce_request,
    encode_produce_response,
)
from broker.protocol.header import (
    MAX_CLIENT_ID_BYTES,
    is_flexible_request,
    parse_request_header,
    request_header_version,
)

ACCEPTED = {a.key: (a.first_accepted, a.max_version) for a in REGISTRY.values()}
PAIRS = [(key, v) for key, (lo, hi) in sorted(ACCEPTED.items()) for v in range(lo, hi + 1)]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

# The frames the attacker sent: a compact array count of 0xF0000000 as a 5-byte varint.
HUGE = write_uvarint(0xF0000000)
METADATA_V12_ABORT = struct.pack(">hhih", 3, 12, 7, 0) + b"\x00" + HUGE + b"\x01\x00\x00"
PRODUCE_V11_ABORT = (
    struct.pack(">hhih", 0, 11, 7, 0)
    + b"\x00"
    + b"\x00"
    + struct.pack(">hi", -1, 30000)
    + HUGE
    + b"\x00"
)


# ------------------------------------------------------------------ valid requests, from kio


def _unwrap(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (UnionType, Union):
        return next(a for a in get_args(tp) if a is not NoneType), True
    return tp, False


_INTS = {
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "uint32": (0, 2**32 - 1),
    "uint64": (0, 2**64 - 1),
}
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _value(kind: str) -> st.SearchStrategy[Any]:
    if kind in _INTS:
        return st.integers(*_INTS[kind])
    return {
        "bool": st.booleans(),
        "float64": st.floats(allow_nan=False),
        "error_code": st.sampled_from(list(ErrorCode)),
        "timedelta_i32": st.integers(0, 2**31 - 1).map(
            lambda ms: datetime.timedelta(milliseconds=ms)
        ),
        "timedelta_i64": st.integers(0, 2**40).map(lambda ms: datetime.timedelta(milliseconds=ms)),
        "datetime_i64": st.integers(0, 2**40).map(
            lambda ms: _EPOCH + datetime.timedelta(milliseconds=ms)
        ),
        "uuid": st.uuids(),
        "string": st.text(max_size=12),
        "bytes": st.binary(max_size=12),
        "records": st.binary(max_size=12),
    }[kind]


@cache
def entity(cls: Any) -> st.SearchStrategy[Any]:
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, nullable = _unwrap(f.type)
        is_array = get_origin(tp) is tuple
        if is_array:
            tp, _ = _unwrap(get_args(tp)[0])
        one = (
            st.deferred(lambda tp=tp: entity(tp))
            if dataclasses.is_dataclass(tp)
            else _value(f.metadata["kafka_type"])
        )
        value = st.lists(one, max_size=3).map(tuple) if is_array else one
        kwargs[f.name] = st.one_of(st.none(), value) if nullable else value
    return st.builds(cls, **kwargs)


@st.composite
def valid_request(draw: st.DrawFn, pairs: list[tuple[int, int]] = PAIRS) -> tuple[int, int, bytes]:
    key, version = draw(st.sampled_from(pairs))
    request = draw(entity(request_schema(key, version)))
    client_id = draw(st.one_of(st.none(), st.text(max_size=8)))
    frame = encode_request(
        RequestHeader(key, version, draw(st.integers(0, 2**31 - 1)), client_id), request
    )
    return key, version, frame[4:]


def _lie(data: bytearray, i: int, how: int) -> None:
    """Write a lying length/count at `i`: the shapes that once reached kio's allocator."""
    lie = [
        HUGE,
        b"\xff\xff\xff\x0f",
        b"\x7f\xff\xff\xff",
        b"\xf0\x00\x00\x00",
        b"\x7f\xff",
        b"\xff\xff",
    ][how]
    data[i : i + len(lie)] = lie


@st.composite
def hostile_request(draw: st.DrawFn) -> bytes:
    _key, _version, payload = draw(valid_request())
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["cut", "flip", "lie", "insert"]))
        i = draw(st.integers(8, max(len(data) - 1, 8)))
        if op == "cut":
            del data[i:]
        elif op == "flip" and i < len(data):
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "lie":
            _lie(data, i, draw(st.integers(0, 5)))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


# ------------------------------------------------------------------------------------ tests


def test_every_accepted_pair_has_a_walk() -> None:
    assert len(PAIRS) > 100
    for key, version in PAIRS:
        assert callable(walker(request_schema(key, version)))
        assert min_size(request_schema(key, version)) >= 0


@FUZZ
@given(valid_request())
def test_valid_requests_pass_the_walk_and_decode(request: tuple[int, int, bytes]) -> None:
    key, version, payload = request
    header, body = decode_request(payload, supported=ACCEPTED, fast=False)
    assert (header.api_key, header.api_version) == (key, version)
    assert body is not None


@FUZZ
@given(hostile_request(), st.booleans())
def test_hostile_requests_raise_only_protocol_errors_within_a_small_multiple(
    payload: bytes, fast: bool
) -> None:
    tracemalloc.start()
    try:
        with contextlib.suppress(ProtocolError):
            decode_request(payload, supported=ACCEPTED, fast=fast)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Python objects for what the frame holds (at most one element per byte), never a
    # reservation sized by a count the frame cannot back.
    assert peak < 64 * 1024 + 400 * len(payload)


@pytest.mark.parametrize(("key", "version"), PAIRS)
def test_every_truncation_is_refused_or_decodes(key: int, version: int) -> None:
    payload = encode_request(RequestHeader(key, version, 1, "c"), _example(key, version))[4:]
    for cut in range(len(payload)):
        try:
            decode_request(payload[:cut], supported=ACCEPTED, fast=False)
        except ProtocolError:
            continue


_EXAMPLE_VALUES = {
    "bool": True,
    "float64": 1.5,
    "error_code": ErrorCode.none,
    "timedelta_i32": datetime.timedelta(milliseconds=1000),
    "timedelta_i64": datetime.timedelta(milliseconds=1000),
    "datetime_i64": _EPOCH + datetime.timedelta(milliseconds=1000),
    "uuid": uuid.UUID(int=7),
    "string": "ab",
    "bytes": b"xy",
    "records": b"xy",
}


def _build(cls: Any) -> Any:
    """A deterministic instance with every field set and two elements in every array."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, _nullable = _unwrap(f.type)
        is_array = get_origin(tp) is tuple
        if is_array:
            tp, _ = _unwrap(get_args(tp)[0])
        if dataclasses.is_dataclass(tp):
            one: Any = _build(tp)
        else:
            kind = f.metadata["kafka_type"]
            one = 1 if kind in _INTS else _EXAMPLE_VALUES[kind]
        kwargs[f.name] = (one, one) if is_array else one
    return cls(**kwargs)


def _example(key: int, version: int) -> Any:
    return _build(request_schema(key, version))


@pytest.mark.parametrize(
    "payload", [METADATA_V12_ABORT, PRODUCE_V11_ABORT], ids=["metadata_v12", "produce_v11"]
)
def test_huge_varint_count_is_refused_in_a_subprocess(payload: bytes) -> None:
    # In a child, so that if kio's reader is ever reached it aborts the child, not pytest.
    script = textwrap.dedent(
        f"""
        from broker.protocol import MalformedRequest
        from broker.protocol.codec import decode_request
        for fast in (False, True):
            try:
                decode_request({payload!r}, fast=fast)
            except MalformedRequest as exc:
                print("refused:", exc)
            else:
                print("decoded")
        """
    )
    assert len(payload) <= 24  # the attacker's frames: 23 and 28 bytes with the size prefix
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("refused:") == 2, out.stdout


def test_lying_counts_never_allocate_in_a_subprocess() -> None:
    """A lying count at every position of a request of every accepted (api, version),
    decoded in a child whose address space is capped: a reservation sized by the lie
    fails there (an abort, a MemoryError) and fails this test."""
    script = textwrap.dedent(
        """
        import resource, random, sys
        import broker.handlers
        from broker.api import REGISTRY
        from broker.protocol import ProtocolError, RequestHeader
        from broker.protocol._wire import write_uvarint
        from broker.protocol.codec import decode_request, encode_request, request_schema
        from broker.tests.test_protocol_bounds import PAIRS, ACCEPTED, _example
        frames = [encode_request(RequestHeader(k, v, 1, "c"), _example(k, v))[4:] for k, v in PAIRS]
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))
        lies = [write_uvarint(0xF0000000), b"\\x7f\\xff\\xff\\xff", b"\\xf0\\x00\\x00\\x00", b"\\x7f\\xff"]
        n = 0
        for payload in frames:
            for i in range(8, len(payload)):
                for lie in lies:
                    data = bytearray(payload)
                    data[i : i + len(lie)] = lie
                    for fast in (False, True):
                        n += 1
                        try:
                            decode_request(bytes(data), supported=ACCEPTED, fast=fast)
                        except ProtocolError:
                            pass
        print("frames", n)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 10_000


# -------------------------------------------------------------------------------- nulls


def _non_nullable_arrays(cls: Any) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp, nullable = _unwrap(f.type)
        if get_origin(tp) is tuple and not nullable and "tag" not in f.metadata:
            out.append(f.name)
    return out


NULL_CASES = [
    (key, version, name)
    for key, version in PAIRS
    for name in _non_nullable_arrays(request_schema(key, version))
]


@pytest.mark.parametrize(("key", "version", "field"), NULL_CASES)
def test_null_for_a_non_nullable_top_level_array_is_refused(
    key: int, version: int, field: str
) -> None:
    request = dataclasses.replace(_example(key, version), **{field: None})
    payload = encode_request(RequestHeader(key, version, 1, "c"), request)[4:]
    with pytest.raises(MalformedRequest, match="null"):
        decode_request(payload, supported=ACCEPTED, fast=False)


def _join_group_v5(group_id: bytes) -> bytes:
    body = group_id + struct.pack(">ii", 10000, 10000) + b"\x00\x00" + b"\xff\xff"
    body += b"\x00\x08consumer" + struct.pack(">i", 0)
    return struct.pack(">hhih", 11, 5, 1, 1) + b"c" + body


def test_null_for_a_non_nullable_string_is_refused() -> None:
    decode_request(_join_group_v5(b"\x00\x01g"), supported=ACCEPTED)  # the same, well-formed
    with pytest.raises(MalformedRequest, match=r"non-nullable JoinGroupRequest\.group_id"):
        decode_request(_join_group_v5(b"\xff\xff"), supported=ACCEPTED)


def test_null_for_a_non_nullable_nested_array_is_refused() -> None:
    # Fetch v12, one topic whose partitions array is null (compact 0).
    body = struct.pack(">iiiibii", -1, 500, 1, 1024, 0, 0, -1)  # ... session epoch
    body += b"\x02" + b"\x02t" + b"\x00" + b"\x00"  # topics: 1, name "t", partitions: null, tags
    body += b"\x01" + b"\x01" + b"\x00"  # forgotten: [], rack_id: "", tags
    payload = struct.pack(">hhih", 1, 12, 1, 1) + b"c" + b"\x00" + body
    with pytest.raises(MalformedRequest, match=r"FetchTopic\.partitions"):
        decode_request(payload, supported=ACCEPTED)


def test_null_non_nullable_nested_struct_marker_is_refused_only_where_not_nullable() -> None:
    # DescribeTopicPartitions v0: cursor is a nullable struct (marker 0xff = null).
    ok = (
        struct.pack(">hhih", 75, 0, 1, 1)
        + b"c"
        + b"\x00"
        + b"\x01"
        + struct.pack(">i", 10)
        + b"\xff"
        + b"\x00"
    )
    decode_request(ok, supported={75: (0, 0)} | ACCEPTED)


# ---------------------------------------------------------------------- strings and tags


def test_strings_longer_than_kafka_allows_are_refused() -> None:
    # A compact string of 0x8000 bytes (as Kafka's "string field had invalid length").
    group = b"g" * 0x8000
    body = write_uvarint(len(group) + 1) + group + b"\x00"  # FindCoordinator v3: key, type, tags
    payload = struct.pack(">hhih", 10, 3, 1, 1) + b"c" + b"\x00" + body[:-1] + b"\x00" + b"\x00"
    with pytest.raises(MalformedRequest, match="string"):
        decode_request(payload, supported=ACCEPTED)
    fine = write_uvarint(0x7FFF + 1) + b"g" * 0x7FFF + b"\x00" + b"\x00"
    decode_request(struct.pack(">hhih", 10, 3, 1, 1) + b"c" + b"\x00" + fine, supported=ACCEPTED)


def test_client_id_a_member_id_could_not_hold_is_refused_at_the_door() -> None:
    def metadata(client_id: bytes) -> bytes:
        return struct.pack(">hhih", 3, 1, 1, len(client_id)) + client_id + struct.pack(">i", -1)

    decode_request(metadata(b"c" * MAX_CLIENT_ID_BYTES), supported=ACCEPTED)
    with pytest.raises(MalformedRequest, match="client id"):
        decode_request(metadata(b"c" * 0x7FFF), supported=ACCEPTED)
    assert request_header_version(3, 1) == 1


def test_tagged_fields_are_bounded() -> None:
    schema = request_schema(3, 12)
    body = b"\x01" + b"\x00\x00"  # topics: [], two bools
    check_request_body(body + b"\x00", 0, schema)
    check_request_body(body + b"\x01\x05\x02ab", 0, schema)  # an unknown tag, in bounds
    for tags in (b"\x01\x05\x09ab", HUGE, b"\x01\x05" + HUGE, b"\x7f"):
        with pytest.raises(MalformedRequest):
            check_request_body(body + tags, 0, schema)


def test_known_tag_must_fill_its_size() -> None:
    # Fetch v12's tagged cluster_id (tag 0, a compact nullable string).
    head = struct.pack(">iiiibii", -1, 500, 1, 1024, 0, 0, -1) + b"\x01" + b"\x01" + b"\x01"
    schema = request_schema(1, 12)
    check_request_body(head + b"\x01\x00\x03\x03ab", 0, schema)
    with pytest.raises(MalformedRequest, match="fill"):
        check_request_body(head + b"\x01\x00\x04\x03abc", 0, schema)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\x00" + struct.pack(">hi", -1, 30000) + HUGE + b"\x00", "array"),
        (b"\x00" + struct.pack(">hi", -1, 30000) + b"\x00" + b"\x00", "null array"),
        (b"\x00" + struct.pack(">hi", -1, 30000) + b"\x02" + b"\x00", "null topic"),
        (b"\x00" + struct.pack(">hi", -1, 30000) + b"\x02\x02t" + HUGE, "array"),
        (
            b"\x00" + struct.pack(">hi", -1, 30000) + b"\x02\x02t\x02" + b"\x00\x00\x00\x00" + HUGE,
            "records",
        ),
        (b"\x81\x80\x02" + b"x" * 0x8000 + struct.pack(">hi", -1, 30000) + b"\x01\x00", "string"),
    ],
)
def test_produce_fast_path_is_bounds_safe(body: bytes, match: str) -> None:
    with pytest.raises(MalformedRequest, match=match):
        decode_produce_request(b"\x00" * 8 + body, 8, 11)


def test_too_many_elements_are_refused() -> None:
    # Fetch v12 with forgotten partitions (int32 each): MAX_ELEMENTS decode, one more does not.
    def fetch(n: int) -> bytes:
        body = struct.pack(">iiiibii", -1, 500, 1, 1024, 0, 0, -1) + b"\x01"  # ..., topics: []
        body += b"\x02" + b"\x02t" + write_uvarint(n + 1) + struct.pack(">i", 7) * n + b"\x00"
        return struct.pack(">hhih", 1, 12, 1, 1) + b"c" + b"\x00" + body + b"\x01" + b"\x00"

    decode_request(fetch(MAX_ELEMENTS - 1), supported=ACCEPTED)
    with pytest.raises(MalformedRequest, match="array elements"):
        decode_request(fetch(MAX_ELEMENTS), supported=ACCEPTED)


@pytest.mark.parametrize("version", [8, 11])
def test_produce_answer_with_a_message_quoting_a_long_name_stays_encodable(version: int) -> None:
    message = "no such topic " + "é" * 0x7FFF
    part = ProducePartitionResult(0, 3, -1, -1, -1, message)
    frame = encode_produce_response(5, version, [("t", [part])])
    _cid, answer = decode_response(frame[4:], 0, version)
    got = answer.responses[0].partition_responses[0].error_message
    assert got.startswith("no such topic é") and len(got.encode()) <= 0x7FFF


@given(st.integers(0x80, 2**35 - 1), st.binary(max_size=3))
def test_unrolled_uvarint_reads_what_the_plain_reader_reads(value: int, tail: bytes) -> None:
    raw = bytearray()
    v = value
    while v > 0x7F:
        raw.append((v & 0x7F) | 0x80)
        v >>= 7
    raw.append(v)
    data = bytes(raw) + tail
    if len(raw) <= 5:
        assert bounds._uv(data, 0) == read_uvarint(data, 0) == (value, len(raw))
    for cut in range(1, len(raw)):
        with pytest.raises(IndexError):
            bounds._uv(bytes(raw[:cut]), 0)


def test_response_with_a_huge_count_is_refused_in_a_subprocess() -> None:
    # A mirror decodes its peers' Metadata answers: a lying peer must not abort it.
    frame = struct.pack(">i", 7) + b"\x00" + struct.pack(">i", 0) + HUGE + b"\x00" * 8
    script = textwrap.dedent(
        f"""
        from broker.protocol import MalformedRequest
        from broker.protocol.codec import decode_response
        try:
            decode_response({frame!r}, 3, 12)
        except MalformedRequest as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout, out.stdout


@FUZZ
@given(st.one_of(valid_request().map(lambda r: r[2]), hostile_request()))
def test_the_walk_and_kio_agree_on_where_a_body_ends(payload: bytes) -> None:
    """Where the walk accepts a body, kio reads exactly the same bytes: the bounds the walk
    checks are the ones kio's reader then relies on."""
    try:
        header, pos = parse_request_header(payload, header_version=1)
        if is_flexible_request(header.api_key, header.api_version) is None:
            return
        if (header.api_key, header.api_version) not in set(PAIRS):
            return
        if is_flexible_request(header.api_key, header.api_version):
            pos = skip_tagged_fields(payload, pos)
        schema = request_schema(header.api_key, header.api_version)
        stop = walker(schema)(payload, pos, len(payload))
    except Exception:
        return  # refused: nothing reaches kio
    if stop > len(payload):
        return
    try:
        _entity, size = entity_reader(schema)(payload, pos)
    except KeyError:
        return  # an unknown tag: decode_request strips it and parses again
    except Exception:
        return  # e.g. invalid UTF-8, which only kio checks
    assert pos + size == stop

"""Round trips of every version the broker may advertise, plus header and ApiVersions rules.

Entities are built field by field from kio's schemas with non-default values everywhere
(tagged fields included, so tag encoding is exercised) and, in a second variant, with
every nullable field null and every tagged field at its default.
"""

from __future__ import annotations

import datetime
import struct
import uuid
from dataclasses import MISSING, fields
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveTupleField,
    classify_field,
    get_field_tag,
    get_schema_field_type,
    is_optional,
)

from broker.protocol import (
    RECOMMENDED_RANGES,
    RequestHeader,
    UnknownApiKey,
    UnsupportedVersion,
    decode_request,
    decode_response,
    encode_api_versions_fallback,
    encode_request,
    encode_response,
    parse_request_header,
    request_schema,
    response_schema,
)
from broker.protocol.fastpath import decode_produce_request

# A real v2 batch (one record), so "records" fields hold something plausible.
BATCH = bytes.fromhex(
    "0000000000000000000000440000000002c1f6a8a20000000000000000018f0000000000000000"
    "018f000000000000ffffffffffffffffffffffffffff00000001240000000c6b65790a76616c7565"
    "00"
)


def _primitive(kafka_type: str, salt: int) -> Any:
    match kafka_type:
        case "int8":
            return 7 + salt
        case "int16":
            return 300 + salt
        case "int32":
            return 70000 + salt
        case "int64":
            return 2**40 + salt
        case "uint16":
            return 65000 + salt
        case "uint32":
            return 2**31 + salt
        case "uint64":
            return 2**40 + salt
        case "float64":
            return 1.5 + salt
        case "string":
            return f"näme-{salt}"
        case "bytes":
            return bytes([salt & 0xFF, 1, 2])
        case "records":
            return BATCH
        case "uuid":
            return uuid.UUID(int=0x1234_5678 + salt + 1)
        case "bool":
            return True
        case "error_code":
            return ErrorCode.unknown_topic_or_partition
        case "timedelta_i32" | "timedelta_i64":
            return datetime.timedelta(milliseconds=1234 + salt)
        case "datetime_i64":
            return datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
    raise AssertionError(f"no sample for {kafka_type}")


def sample(cls: type[Any], nulls: bool, depth: int = 0) -> Any:
    kwargs: dict[str, Any] = {}
    for salt, f in enumerate(fields(cls)):
        tagged = get_field_tag(f) is not None
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if nulls and tagged and has_default:
            continue  # leave the tag at its default: it must then not be written
        if nulls and not tagged and is_optional(f):
            kwargs[f.name] = None
            continue
        kind = classify_field(f)
        if isinstance(kind, EntityTupleField):
            kwargs[f.name] = tuple(sample(kind.type_, nulls, depth + 1) for _ in range(2))
        elif isinstance(kind, EntityField):
            kwargs[f.name] = sample(kind.type_, nulls, depth + 1)
        elif isinstance(kind, PrimitiveTupleField):
            t = get_schema_field_type(f)
            kwargs[f.name] = (_primitive(t, salt), _primitive(t, salt + 1))
        else:
            kwargs[f.name] = _primitive(get_schema_field_type(f), salt)
    return cls(**kwargs)


def all_versions() -> list[tuple[int, int]]:
    out = []
    for key, (lo, hi) in RECOMMENDED_RANGES.items():
        for v in range(lo, hi + 1):
            if key == 0 and v < 3:
                continue  # Produce 0-2 are advertised but refused (see below)
            out.append((key, v))
    return out


@pytest.mark.parametrize("nulls", [False, True], ids=["full", "nulls"])
@pytest.mark.parametrize(("key", "version"), all_versions())
def test_request_round_trip(key: int, version: int, nulls: bool) -> None:
    req = sample(request_schema(key, version), nulls)
    header = RequestHeader(key, version, 0x01020304, None if nulls else "client-ü")
    wire = encode_request(header, req)
    assert struct.unpack_from(">i", wire)[0] == len(wire) - 4
    got_header, got = decode_request(wire[4:], supported=RECOMMENDED_RANGES)
    assert got_header == header
    assert got == req
    assert encode_request(got_header, got) == wire
    # The kio path and the fast path (Produce) agree.
    _, slow = decode_request(wire[4:], fast=False)
    assert slow == got
    if key == 0:
        assert decode_produce_request(wire[4:], parse_request_header(wire[4:])[1], version) == req


@pytest.mark.parametrize("nulls", [False, True], ids=["full", "nulls"])
@pytest.mark.parametrize(("key", "version"), all_versions())
def test_response_round_trip(key: int, version: int, nulls: bool) -> None:
    resp = sample(response_schema(key, version), nulls)
    header = RequestHeader(key, version, 77, "c")
    wire = encode_response(header, resp)
    assert struct.unpack_from(">i", wire)[0] == len(wire) - 4
    corr, got = decode_response(wire[4:], key, version)
    assert corr == 77
    assert got == resp
    assert encode_response(header, got) == wire


def test_header_v2_client_id_stays_int16_length() -> None:
    req = sample(request_schema(3, 12), nulls=True)
    wire = encode_request(RequestHeader(3, 12, 5, "abc"), req)
    # size, key, version, correlation id, then int16 length 3, "abc", then 0 tagged fields
    assert wire[4:18] == struct.pack(">hhih", 3, 12, 5, 3) + b"abc" + b"\x00"
    header, body_at = parse_request_header(wire[4:])
    assert header == RequestHeader(3, 12, 5, "abc") and body_at == 14


def test_header_v2_tagged_fields_are_skipped() -> None:
    req = sample(request_schema(3, 12), nulls=True)
    wire = bytearray(encode_request(RequestHeader(3, 12, 5, "abc"), req))
    # Replace the empty tag section with one unknown tag (tag 9, 2 bytes).
    wire[17:18] = b"\x01\x09\x02zz"
    header, got = decode_request(bytes(wire[4:]))
    assert header.client_id == "abc" and got == req


def test_header_v1_for_non_flexible() -> None:
    req = sample(request_schema(3, 8), nulls=True)
    wire = encode_request(RequestHeader(3, 8, 5, None), req)
    assert wire[4:14] == struct.pack(">hhih", 3, 8, 5, -1)


def test_flexible_response_uses_header_v1_but_api_versions_v0() -> None:
    md = encode_response(RequestHeader(3, 12, 9, None), sample(response_schema(3, 12), True))
    assert md[4:9] == struct.pack(">i", 9) + b"\x00"
    av = sample(response_schema(18, 3), nulls=True)
    wire = encode_response(RequestHeader(18, 3, 9, None), av)
    # v0 header: the error code follows the correlation id directly
    assert wire[4:10] == struct.pack(">ih", 9, int(av.error_code))


def test_api_versions_v3_emits_no_default_tagged_fields() -> None:
    # librdkafka 2.0.x (Debian's kcat) fails on unexpected ApiVersions tags.
    cls = response_schema(18, 3)
    mod = __import__(cls.__module__, fromlist=["ApiVersion"])
    resp = cls(
        error_code=ErrorCode.none,
        api_keys=(mod.ApiVersion(api_key=18, min_version=0, max_version=4),),
        throttle_time=datetime.timedelta(0),
    )
    wire = encode_response(RequestHeader(18, 3, 1, None), resp)
    assert wire[4:] == struct.pack(">ih", 1, 0) + b"\x02" + struct.pack(">hhh", 18, 0, 4) + (
        b"\x00" + b"\x00\x00\x00\x00" + b"\x00"
    )


def test_unsupported_api_versions_is_reported_with_header_not_parsed() -> None:
    # ApiVersions v9 from a future client; its body is garbage we must not touch.
    payload = struct.pack(">hhih", 18, 9, 42, 3) + b"cli" + b"\xff\xfe\xfd"
    with pytest.raises(UnsupportedVersion) as info:
        decode_request(payload, supported=RECOMMENDED_RANGES)
    assert info.value.header == RequestHeader(18, 9, 42, "cli")
    assert (info.value.api_key, info.value.api_version) == (18, 9)


def test_unsupported_version_inside_kio_but_outside_supported() -> None:
    req = sample(request_schema(1, 13), nulls=True)
    wire = encode_request(RequestHeader(1, 13, 1, None), req)
    with pytest.raises(UnsupportedVersion):
        decode_request(wire[4:], supported=RECOMMENDED_RANGES)
    decode_request(wire[4:])  # without a table, whatever kio knows is accepted


def test_produce_v0_is_unsupported() -> None:
    with pytest.raises(UnsupportedVersion):
        decode_request(struct.pack(">hhih", 0, 0, 1, -1) + b"\x00\x01")


def test_unknown_api_key() -> None:
    payload = struct.pack(">hhih", 999, 0, 1, -1)
    with pytest.raises(UnknownApiKey):
        decode_request(payload)
    with pytest.raises(UnknownApiKey):
        decode_request(struct.pack(">hhih", 5, 0, 1, -1), supported=RECOMMENDED_RANGES)


def test_trailing_bytes_after_body_are_ignored_as_kafka_does() -> None:
    wire = encode_request(RequestHeader(3, 1, 1, None), sample(request_schema(3, 1), True))
    assert decode_request(wire[4:] + b"\x00\x01")[1] == decode_request(wire[4:])[1]
    # What librdkafka 2.16 (kcat -L) really sends: Metadata v12 with 3 bytes past the body.
    librdkafka = bytes.fromhex("0003000c00000003000772646b61666b610000000000010000")
    header, request = decode_request(librdkafka)
    assert (header.api_key, header.api_version, request.topics) == (3, 12, None)


def test_fallback_body() -> None:
    wire = encode_api_versions_fallback(7, {18: (0, 4), 3: (0, 12)})
    assert wire == struct.pack(">iihi", 4 + 2 + 4 + 12, 7, 35, 2) + struct.pack(
        ">hhhhhh", 3, 0, 12, 18, 0, 4
    )
    corr, resp = decode_response(wire[4:], 18, 0)
    assert corr == 7 and resp.error_code == ErrorCode.unsupported_version
    assert [(k.api_key, k.min_version, k.max_version) for k in resp.api_keys] == [
        (3, 0, 12),
        (18, 0, 4),
    ]


def test_response_must_match_request() -> None:
    resp = sample(response_schema(3, 12), True)
    with pytest.raises(ValueError):
        encode_response(RequestHeader(3, 11, 1, None), resp)

"""Unknown tagged fields (KIP-482) are skipped, not refused.

kio's reader raises on a tag it does not know; `decode_request` then strips the unknown
tags with `broker.protocol.tags` and parses again. These tests check that the walk
understands every flexible request schema we serve (it must reproduce a body exactly when
nothing is unknown) and that unknown tags at the top level and inside nested structs are
dropped while known ones survive.
"""

from __future__ import annotations

import io
import struct
import uuid

import pytest
from kio.schema.metadata.v12.request import MetadataRequest, MetadataRequestTopic
from kio.serial import entity_writer

from broker.protocol import (
    RECOMMENDED_RANGES,
    MalformedRequest,
    RequestHeader,
    decode_request,
    encode_request,
    request_schema,
)
from broker.protocol._wire import write_uvarint
from broker.protocol.tags import strip_unknown_tags
from broker.tests.test_protocol_codec import all_versions, sample

UNKNOWN = write_uvarint(1) + write_uvarint(1000) + write_uvarint(3) + b"new"


def _flexible_versions() -> list[tuple[int, int]]:
    return [(k, v) for k, v in all_versions() if request_schema(k, v).__flexible__]


def _header_len(wire: bytes) -> int:
    # size(4) key(2) version(2) correlation(4) client_id(2+n) header tags(1)
    (n,) = struct.unpack_from(">h", wire, 12)
    return 14 + max(n, 0) + 1


@pytest.mark.parametrize("nulls", [False, True], ids=["full", "nulls"])
@pytest.mark.parametrize(("key", "version"), _flexible_versions())
def test_walk_reproduces_every_flexible_request(key: int, version: int, nulls: bool) -> None:
    req = sample(request_schema(key, version), nulls)
    wire = encode_request(RequestHeader(key, version, 7, "c"), req)
    start = _header_len(wire)
    body, dropped = strip_unknown_tags(wire, start, request_schema(key, version))
    assert dropped == []
    assert body == wire[start:]


@pytest.mark.parametrize(("key", "version"), _flexible_versions())
def test_unknown_top_level_tag_is_ignored(key: int, version: int) -> None:
    req = sample(request_schema(key, version), nulls=True)  # no tags written at the top
    wire = encode_request(RequestHeader(key, version, 7, "c"), req)
    assert wire.endswith(b"\x00")
    tampered = bytearray(wire[:-1] + UNKNOWN)
    struct.pack_into(">i", tampered, 0, len(tampered) - 4)
    _, got = decode_request(bytes(tampered[4:]), supported=RECOMMENDED_RANGES)
    assert got == req


def _metadata_v12_body(topic_tags: bytes, top_tags: bytes) -> bytes:
    topic = MetadataRequestTopic(topic_id=uuid.UUID(int=5), name="t")
    out = io.BytesIO()
    entity_writer(MetadataRequestTopic)(out, topic)
    encoded = out.getvalue()
    assert encoded.endswith(b"\x00")
    nested = encoded[:-1] + topic_tags
    return write_uvarint(2) + nested + b"\x01" + b"\x00" + top_tags


def test_unknown_nested_tag_is_ignored_and_known_ones_kept() -> None:
    header = struct.pack(">hhih", 3, 12, 9, 1) + b"c" + b"\x00"
    body = _metadata_v12_body(UNKNOWN, UNKNOWN)
    got_header, got = decode_request(header + body, supported=RECOMMENDED_RANGES)
    assert got_header.correlation_id == 9
    assert got == MetadataRequest(
        topics=(MetadataRequestTopic(topic_id=uuid.UUID(int=5), name="t"),),
        allow_auto_topic_creation=True,
        include_topic_authorized_operations=False,
    )
    stripped, dropped = strip_unknown_tags(body, 0, MetadataRequest)
    assert dropped == [1000, 1000]
    assert stripped == _metadata_v12_body(b"\x00", b"\x00")


def test_truncated_unknown_tag_is_malformed() -> None:
    header = struct.pack(">hhih", 3, 12, 9, 1) + b"c" + b"\x00"
    body = _metadata_v12_body(
        b"\x00", write_uvarint(1) + write_uvarint(1000) + write_uvarint(30) + b"x"
    )
    with pytest.raises(MalformedRequest):
        decode_request(header + body, supported=RECOMMENDED_RANGES)

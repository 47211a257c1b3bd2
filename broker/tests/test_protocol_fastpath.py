"""The Produce decoder and Fetch encoder fast paths equal kio on every version (property test),
keep records zero-copy, and pass non-buffer records objects through for sendfile."""

from __future__ import annotations

import datetime
import io
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.serial import entity_writer
from kio.static.primitive import Records

from broker.protocol import (
    RequestHeader,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    encode_response_parts,
    parse_request_header,
    request_schema,
    response_schema,
)
from broker.protocol.fastpath import (
    FETCH_VERSIONS,
    PRODUCE_VERSIONS,
    ProducePartitionResult,
    decode_produce_request,
    encode_fetch_description,
    encode_produce_response,
)
from broker.shape import shape

st.register_type_strategy(Records, st.binary(max_size=600))
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


@PROPS
@given(st.data())
def test_produce_fast_equals_kio(data: st.DataObject) -> None:
    version = data.draw(st.sampled_from(PRODUCE_VERSIONS))
    req = data.draw(st.from_type(request_schema(0, version)))
    wire = encode_request(RequestHeader(0, version, 1, "c"), req)
    _, fast = decode_request(wire[4:], fast=True)
    _, slow = decode_request(wire[4:], fast=False)
    direct = decode_produce_request(wire[4:], parse_request_header(wire[4:])[1], version)
    assert fast == slow == direct == req
    assert encode_request(RequestHeader(0, version, 1, "c"), fast) == wire


@PROPS
@given(st.data())
def test_fetch_fast_equals_kio(data: st.DataObject) -> None:
    version = data.draw(st.sampled_from(FETCH_VERSIONS))
    resp = data.draw(st.from_type(response_schema(1, version)))
    header = RequestHeader(1, version, 3, None)
    fast = b"".join(bytes(p) for p in encode_response_parts(header, resp))
    body = io.BytesIO()
    entity_writer(type(resp))(body, resp)
    head = b"\x00\x00\x00\x03" + (b"\x00" if version >= 12 else b"")
    assert fast[4:] == head + body.getvalue()
    assert decode_response(fast[4:], 1, version) == (3, resp)


_I32 = st.integers(-(2**31), 2**31 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)
_PART = st.builds(
    ProducePartitionResult,
    _I32,
    st.sampled_from([e.value for e in ErrorCode]),
    _I64,
    st.one_of(st.just(-1), st.integers(0, 2**45)),
    _I64,
    st.one_of(st.none(), st.text(max_size=40)),
    st.lists(st.tuples(_I32, st.one_of(st.none(), st.text(max_size=20))), max_size=3).map(tuple),
)


@PROPS
@given(st.data())
def test_produce_response_fast_equals_kio(data: st.DataObject) -> None:
    topics = data.draw(st.lists(st.tuples(st.text(min_size=1, max_size=20), st.lists(_PART, min_size=1, max_size=4)), max_size=3))
    throttle = data.draw(st.integers(0, 2**31 - 1))
    description = {
        "responses": [
            {"name": name, "partition_responses": [{
                        **p._asdict(),
                        "index": p.partition,
                        "record_errors": [{"batch_index": i, "batch_index_error_message": m} for i, m in p.record_errors],
                    } for p in parts]}
            for name, parts in topics
        ],
        "throttle_time": throttle,
    }
    for version in PRODUCE_VERSIONS:
        kio = encode_response(RequestHeader(0, version, 77, None), shape(response_schema(0, version), description))
        assert encode_produce_response(77, version, topics, throttle) == kio, version


_FETCH_PART = st.fixed_dictionaries(
    {
        "partition_index": _I32,
        "error_code": st.sampled_from([e.value for e in ErrorCode]),
        "high_watermark": _I64,
        "records": st.one_of(st.none(), st.binary(max_size=1200)),
    },
    optional={
        "last_stable_offset": _I64,
        "log_start_offset": _I64,
        "preferred_read_replica": _I32,
        "aborted_transactions": st.just([]),
    },
)


@PROPS
@given(st.data())
def test_fetch_description_fast_equals_shaped(data: st.DataObject) -> None:
    """The handler's Fetch description encodes as it would through shape() and kio."""
    topics = data.draw(st.lists(st.tuples(st.text(min_size=1, max_size=20), st.lists(_FETCH_PART, max_size=4)), max_size=3))
    description: dict[str, Any] = {
        "responses": [{"topic": name, "partitions": parts} for name, parts in topics],
        "throttle_time": data.draw(st.integers(0, 2**31 - 1)),
    }
    if data.draw(st.booleans()):
        description["error_code"] = data.draw(st.sampled_from([0, 1, 70]))
        description["session_id"] = data.draw(_I32)
    for version in FETCH_VERSIONS:
        header = RequestHeader(1, version, 5, None)
        fast = encode_fetch_description(5, version, description)
        assert fast is not None
        shaped = encode_response(header, shape(response_schema(1, version), description))
        assert b"".join(bytes(p) for p in fast) == shaped, version


def test_fetch_description_refuses_what_it_does_not_write() -> None:
    part = {"partition_index": 0, "error_code": 0, "high_watermark": 1, "records": b""}
    tagged = {"responses": [{"topic": "t", "partitions": [{**part, "current_leader": {"leader_id": 1}}]}]}
    assert encode_fetch_description(1, 12, tagged) is None
    aborted = {"responses": [{"topic": "t", "partitions": [{**part, "aborted_transactions": [{"producer_id": 1, "first_offset": 0}]}]}]}
    assert encode_fetch_description(1, 12, aborted) is None
    assert encode_fetch_description(1, 13, {"responses": []}) is None


def test_produce_records_are_views_into_the_frame() -> None:
    mod = __import__(request_schema(0, 9).__module__, fromlist=["x"])
    req = mod.ProduceRequest(
        acks=-1,
        timeout=datetime.timedelta(seconds=1),
        topic_data=(
            mod.TopicProduceData(
                name="t", partition_data=(mod.PartitionProduceData(index=0, records=b"R" * 600_000),)
            ),
        ),
    )
    frame = bytearray(encode_request(RequestHeader(0, 9, 1, None), req)[4:])
    _, got = decode_request(memoryview(frame))
    records = got.topic_data[0].partition_data[0].records
    assert isinstance(records, memoryview) and not records.readonly
    records[0:1] = b"X"  # patching in place (base offset) writes into the frame
    assert b"XRRR" in frame


class FileRange:
    """What a server might pass for sendfile: only its length matters to the encoder."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _fetch(version: int, records: Any) -> Any:
    mod = __import__(response_schema(1, version).__module__, fromlist=["x"])
    part = mod.PartitionData(
        partition_index=0,
        error_code=ErrorCode.none,
        high_watermark=5,
        aborted_transactions=None,
        records=records,
    )
    kw: dict[str, Any] = {"error_code": ErrorCode.none} if version >= 7 else {}
    return mod.FetchResponse(
        throttle_time=datetime.timedelta(0),
        responses=(mod.FetchableTopicResponse(topic="t", partitions=(part,)),),
        **kw,
    )


def test_fetch_records_pass_through_for_sendfile() -> None:
    for version in FETCH_VERSIONS:
        header = RequestHeader(1, version, 9, None)
        data = b"B" * 4096
        parts = encode_response_parts(header, _fetch(version, FileRange(len(data))))
        assert len(parts) == 3 and isinstance(parts[1], FileRange)
        joined = bytes(parts[0]) + data + bytes(parts[2])
        assert joined == encode_response(header, _fetch(version, data))
        view = memoryview(data)
        parts = encode_response_parts(header, _fetch(version, view))
        assert parts[1] is view  # no copy

"""Frames whose counts, lengths or nulls lie, against a real broker process.

One 24-byte frame (a compact array count of 0xF0000000) once made kio's native reader
reserve 32 GiB, and the allocator aborted the broker. Each frame below must close the
attacking connection (Kafka closes on a request it cannot parse) while the broker
process lives on and still serves: ApiVersions, Metadata, and a produce read back.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import time

import pytest
from kio.schema.fetch.v12.request import FetchPartition, FetchRequest, FetchTopic
from kio.schema.metadata.v1.request import MetadataRequest
from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData

from broker.protocol.codec import decode_response, encode_request
from broker.protocol.header import RequestHeader
from compat_tests import harness
from compat_tests.harness import Broker, recv_exact
from storage.batch import build_batch

HUGE = bytes([0x81, 0x80, 0x80, 0x80, 0x0F])  # uvarint 0xF0000001: a count of 0xF0000000


def _head(key: int, version: int, client_id: bytes = b"hk-bounds", flexible: bool = True) -> bytes:
    h = struct.pack(">hhih", key, version, 7, len(client_id)) + client_id
    return h + b"\x00" if flexible else h


FRAMES = {
    "metadata-v12-huge-count": _head(3, 12, b"") + HUGE + b"\x01\x00\x00",
    "produce-v11-huge-count": _head(0, 11, b"")
    + b"\x00"
    + struct.pack(">hi", -1, 30000)
    + HUGE
    + b"\x00",
    "fetch-v12-huge-partitions": _head(1, 12)
    + struct.pack(">iiiibii", -1, 500, 1, 1024, 0, 0, -1)
    + b"\x02\x02t"
    + HUGE,
    "create-topics-v4-int32-count": _head(19, 4, flexible=False) + struct.pack(">i", 0x7FFFFFFF),
    "create-topics-v7-null-topics": _head(19, 7) + b"\x00" + struct.pack(">i", 1000) + b"\x00\x00",
    "join-group-v5-null-protocols": _head(11, 5, flexible=False)
    + b"\x00\x01g"
    + struct.pack(">ii", 10000, 10000)
    + b"\x00\x00\xff\xff\x00\x08consumer"
    + struct.pack(">i", -1),
    "find-coordinator-v3-long-string": _head(10, 3) + b"\x81\x80\x02" + b"g" * 0x8000 + b"\x00\x00",
    "metadata-v1-client-id-32767": _head(3, 1, b"c" * 0x7FFF, flexible=False)
    + struct.pack(">i", -1),
    "metadata-v12-huge-tag-count": _head(3, 12) + b"\x01\x01\x00" + HUGE,
}


def _send(s: socket.socket, payload: bytes) -> None:
    s.sendall(struct.pack(">i", len(payload)) + payload)


def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _call(broker: Broker, header: RequestHeader, request: object) -> object:
    with harness.raw_connection(broker) as s:
        s.sendall(encode_request(header, request))
        (size,) = struct.unpack(">i", recv_exact(s, 4))
        correlation_id, response = decode_response(
            recv_exact(s, size), header.api_key, header.api_version
        )
        assert correlation_id == header.correlation_id
        return response


@pytest.mark.timeout(120)
@pytest.mark.matrix("decode-bounds-{frame}", client="raw-socket")
@pytest.mark.parametrize("frame", list(FRAMES))
def test_lying_frame_closes_the_connection_and_the_broker_lives(broker: Broker, frame: str) -> None:
    with harness.raw_connection(broker) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            _send(s, FRAMES[frame])
        assert _closed(s), f"{frame}: the broker neither closed nor stayed silent-free"
    if broker.proc is not None:
        time.sleep(0.2)
        assert broker.proc.poll() is None, (
            f"broker died: {broker.proc.returncode}\n{broker.log_tail()}"
        )
    assert harness.api_versions_v0_probe(broker.host, broker.port, timeout=5.0)


@pytest.mark.timeout(120)
@pytest.mark.matrix("decode-bounds-still-serves", client="raw-socket")
def test_broker_still_serves_after_every_lying_frame(broker: Broker) -> None:
    for payload in FRAMES.values():
        with harness.raw_connection(broker) as s:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                _send(s, payload)
            _closed(s)
    topic = f"bounds-{time.time_ns()}"
    md = _call(broker, RequestHeader(3, 1, 1, "hk-bounds"), MetadataRequest(topics=()))
    assert md.brokers  # type: ignore[attr-defined]
    batch = bytes(build_batch([b"after the attack"], timestamp_ms=int(time.time() * 1000)))
    produce = ProduceRequest(
        transactional_id=None,
        acks=-1,
        timeout=datetime.timedelta(seconds=10),
        topic_data=(
            TopicProduceData(
                name=topic, partition_data=(PartitionProduceData(index=0, records=batch),)
            ),
        ),
    )
    # The first produce may auto-create the topic; retry until it is there.
    deadline = time.monotonic() + 20
    while True:
        r = _call(broker, RequestHeader(0, 9, 2, "hk-bounds"), produce)
        part = r.responses[0].partition_responses[0]  # type: ignore[attr-defined]
        if part.error_code == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert part.error_code == 0, part
    fetch = FetchRequest(
        replica_id=-1,
        max_wait=datetime.timedelta(milliseconds=100),
        min_bytes=1,
        max_bytes=1 << 20,
        isolation_level=0,
        session_id=0,
        session_epoch=-1,
        topics=(
            FetchTopic(
                topic=topic,
                partitions=(
                    FetchPartition(
                        partition=0,
                        current_leader_epoch=-1,
                        fetch_offset=0,
                        last_fetched_epoch=-1,
                        log_start_offset=-1,
                        partition_max_bytes=1 << 20,
                    ),
                ),
            ),
        ),
        forgotten_topics_data=(),
        rack_id="",
    )
    f = _call(broker, RequestHeader(1, 12, 3, "hk-bounds"), fetch)
    records = f.responses[0].partitions[0].records  # type: ignore[attr-defined]
    assert records is not None and b"after the attack" in bytes(records)

"""The request memory pool (queued.max.request.bytes) and the unsent-answer bound, on a
server built as `broker.server.run` builds it, so its pool can be watched."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from broker.compose import open_node, run_node
from broker.config import BrokerConfig
from broker.memory import ConnectionBudget, RequestPool
from broker.server import Server
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_server import batch, create, fetch_body, produce

POOL = 512 * 1024
FRAME_MAX = 1024 * 1024  # larger than the pool: such a frame must still be served


class Served:
    def __init__(self, server: Server, broker: Broker) -> None:
        self.server = server
        self.broker = broker


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    config = BrokerConfig(
        data_dir=tmp_path / "data",
        listen_port=0,
        shutdown_grace_s=1,
        queued_max_request_bytes=POOL,
        socket_request_max_bytes=FRAME_MAX,
        max_unsent_bytes_per_connection=64 * 1024,
    )
    config.security_props["hyperkafka.request.timeout.ms"] = "3000"
    node = await trio.to_thread.run_sync(open_node, config)
    try:
        server = Server(node)
        async with trio.open_nursery() as nursery:
            await nursery.start(run_node, node)
            listeners = await nursery.start(server.serve)
            yield Served(server, Broker(config, listeners[0].socket.getsockname()[1]))
            nursery.cancel_scope.cancel()
    finally:
        node.close()


async def settle() -> None:
    await trio.sleep(0.2)


async def test_size_prefixes_alone_hold_nothing_and_others_are_served(served: Served) -> None:
    with trio.fail_after(20):
        liars = []
        for _ in range(200):
            c = await served.broker.connect()
            await c.stream.send_all(struct.pack(">i", FRAME_MAX) + b"abcd")  # and nothing more
            liars.append(c)
        await settle()
        stats = served.server.statistics()
        assert stats["connections"] >= 200
        assert stats["request_bytes"] <= 200 * 8  # the bytes sent, not the frames announced
        await create(served.broker, "ok")
        c = await served.broker.connect()
        data = batch([b"fine"])
        assert (await produce(c, "ok", data)).error_code == 0
        r = await c.call("fetch", 12, fetch_body("ok", 0))
        records = bytes(r.responses[0].partitions[0].records)
        assert len(records) == len(data) and records.endswith(b"fine\x00")


async def test_the_pool_bounds_what_half_sent_frames_hold(served: Served) -> None:
    """Six connections each send all but one byte of a 400 KiB frame: together they may
    hold the pool plus one frame (the lane), never 2.4 MiB; then they finish, and the
    broker goes on serving."""
    size = 400 * 1024
    with trio.fail_after(30):
        senders: list[RawClient] = [await served.broker.connect() for _ in range(6)]

        async def almost(c: RawClient) -> None:
            await c.stream.send_all(struct.pack(">i", size) + b"x" * (size - 1))

        async with trio.open_nursery() as nursery:
            for c in senders:
                nursery.start_soon(almost, c)
            await trio.sleep(1.0)
            held = served.server.statistics()["request_bytes"]
            assert held <= POOL + size + 4, held
            nursery.cancel_scope.cancel()  # (the kernel holds what the broker did not read)
        for c in senders:
            await c.stream.aclose()  # closed inside a frame: every byte goes back
        await settle()
        assert served.server.statistics()["request_bytes"] == 0
        c = await served.broker.connect()
        assert (await c.call("api_versions", 0, {})).error_code == 0


async def test_a_frame_larger_than_the_pool_is_served(served: Served) -> None:
    await create(served.broker, "huge", configs={"max.message.bytes": str(FRAME_MAX)})
    c = await served.broker.connect()
    data = batch([bytes(range(256)) * 3000])  # 768 KiB: more than the whole pool
    assert len(data) > POOL
    with trio.fail_after(20):
        assert (await produce(c, "huge", data)).error_code == 0
        r = await c.call(
            "fetch", 12, fetch_body("huge", 0, max_bytes=FRAME_MAX, partition_max=FRAME_MAX)
        )
    records = bytes(r.responses[0].partitions[0].records)
    assert (
        len(records) == len(data) and records[61:] == data[61:]
    )  # (offsets and epoch are stamped)
    await settle()
    assert served.server.statistics()["request_bytes"] == 0


async def test_a_client_that_never_reads_is_not_answered_unboundedly(served: Served) -> None:
    """Pipelined fetches whose answers (30 partitions of 8 KiB, read into memory) are never
    read: the broker stops reading the connection once its unsent answers pass the bound."""
    await create(served.broker, "pile", partitions=30)
    c = await served.broker.connect()
    for p in range(30):
        await produce(c, "pile", batch([b"p" * 8000]), partition=p)
    body = fetch_body("pile", 0)
    body["topics"] = [
        {
            "topic": "pile",
            "partitions": [
                {
                    "partition": p,
                    "fetch_offset": 0,
                    "partition_max_bytes": 1 << 20,
                    "log_start_offset": -1,
                }
                for p in range(30)
            ],
        }
    ]
    hog = await served.broker.connect()
    one = await _encoded_fetch(body)
    sent = 0
    peak = 0
    with trio.move_on_after(3):
        while True:
            await hog.stream.send_all(one)
            sent += 1
            peak = max(peak, served.server.statistics()["max_unsent_bytes"])
    answer = 30 * 8100
    assert sent < 2000  # the broker stopped reading: the client's sends block
    assert peak <= 64 * 1024 + 2 * answer, peak  # the bound, plus the answer that crossed it
    good = await served.broker.connect()
    assert (await good.call("api_versions", 0, {})).error_code == 0


async def _encoded_fetch(body: dict[str, object]) -> bytes:
    from broker.protocol.codec import encode_request
    from broker.protocol.header import RequestHeader
    from broker.shape import shape
    from broker.tests.conftest import request_class

    cls = request_class("fetch", 12)
    return encode_request(RequestHeader(1, 12, 7, "hog"), shape(cls, body))


# The pool on its own.


async def test_pool_grants_only_what_it_has_and_the_lane_breaks_the_deadlock() -> None:
    pool = RequestPool(1000)
    a, b = ConnectionBudget(pool, 1 << 20), ConnectionBudget(pool, 1 << 20)
    assert await a.grant(800, None, mid_frame=False) == 800
    a.received(800, 700)  # 100 given back
    assert pool.available == 300
    assert await b.grant(800, None, mid_frame=False) == 300
    b.received(300, 300)
    assert pool.available == 0
    # Pool empty: a connection inside a frame takes the lane for what its frame lacks...
    assert await b.grant(800, 500, mid_frame=True) == 500
    assert pool.lane is b
    b.received(500, 500)
    # ...and only one at a time: `a` waits (reads nothing) until bytes come back.
    with trio.move_on_after(0.1) as waited:
        await a.grant(800, 10, mid_frame=True)
    assert waited.cancelled_caught
    ticket = b.frame_done(800)  # b's frame is whole: the lane is free, its bytes are a ticket
    assert pool.lane is None and ticket is not None
    assert pool.available == -500  # the lane went past the bound by what b's frame lacked
    ticket.release()
    assert pool.available == 300  # a still holds its 700
    ticket.release()  # once only
    assert pool.available == 300
    a.close()
    assert pool.available == pool.capacity


async def test_unbounded_pool_grants_everything() -> None:
    pool = RequestPool(-1)
    a = ConnectionBudget(pool, 1)
    assert await a.grant(1 << 30, None, mid_frame=False) == 1 << 30
    assert a.frame_done(10) is None


async def test_fetch_data_read_into_memory_comes_from_the_pool(served: Served) -> None:
    """30 partitions of 30 KiB (each below the sendfile size, so read into memory) against
    a 512 KiB pool: the answer holds what the pool had room for, the rest comes next time,
    and every byte goes back once the answer is sent."""
    await create(served.broker, "mem-answer", partitions=30)
    c = await served.broker.connect()
    one = batch([b"m" * 30_000])
    for p in range(30):
        await produce(c, "mem-answer", one, partition=p)
    body = fetch_body("mem-answer", 0, max_bytes=100 << 20)
    body["topics"] = [
        {
            "topic": "mem-answer",
            "partitions": [
                {
                    "partition": p,
                    "fetch_offset": 0,
                    "partition_max_bytes": 1 << 20,
                    "log_start_offset": -1,
                }
                for p in range(30)
            ],
        }
    ]
    r = await c.call("fetch", 12, body)
    sizes = [len(p.records or b"") for p in r.responses[0].partitions]
    assert sizes[0] == len(one)  # the first batch always
    assert 0 < sum(sizes) <= POOL
    assert sum(sizes) < 30 * len(one)  # not everything at once
    await settle()
    assert served.server.statistics()["answer_bytes"] == 0  # all back once sent
    # Asking again from where the answer stopped gets the rest.
    got = {i for i, n in enumerate(sizes) if n}
    body["topics"][0]["partitions"] = [
        {"partition": p, "fetch_offset": 0, "partition_max_bytes": 1 << 20, "log_start_offset": -1}
        for p in range(30)
        if p not in got
    ]
    r = await c.call("fetch", 12, body)
    assert all(len(p.records or b"") in (0, len(one)) for p in r.responses[0].partitions)
    assert sum(len(p.records or b"") for p in r.responses[0].partitions) > 0

"""File descriptors: accept under EMFILE, partitions past the open-file budget, limits."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from broker import node as node_module
from broker.compose import open_node
from broker.config import BrokerConfig
from broker.server import Server, accept_or_wait, run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_server import batch
from storage.handles import FdBudget

PARTITION_FILES = 40  # ten partitions open at once


class FlakyListener(trio.abc.Listener[Any]):
    """accept() fails with `errors` in turn, then returns "conn"."""

    def __init__(self, errors: list[int]) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def accept(self) -> Any:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, os.strerror(code))
        return "conn"

    async def aclose(self) -> None:
        pass


async def test_accept_waits_out_descriptor_exhaustion(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    listener = FlakyListener([errno.EMFILE] * 5 + [errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
    start = trio.current_time()
    assert await accept_or_wait(listener, "PLAINTEXT") == "conn"
    assert listener.calls == 9
    assert trio.current_time() - start >= 0.79  # slowed down, not spinning
    warnings = [r for r in caplog.records if "accept on PLAINTEXT" in r.getMessage()]
    assert len(warnings) == 2  # one when the burst starts, one when it is over


class ExhaustedListener(trio.abc.Listener[Any]):
    """A real listener whose first accepts fail with EMFILE, as when every descriptor
    is taken."""

    def __init__(self, inner: trio.SocketListener, failures: int) -> None:
        self.inner = inner
        self.failures = failures

    async def accept(self) -> Any:
        await trio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.inner.accept()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_the_server_lives_through_emfile_on_accept(tmp_path: Path) -> None:
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    server = Server(node)
    spec = server.security.listeners[0]
    try:
        async with trio.open_nursery() as nursery:
            (inner,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            listener = ExhaustedListener(inner, failures=3)
            nursery.start_soon(server._accept_loop, listener, spec, nursery)
            port = inner.socket.getsockname()[1]
            with trio.fail_after(10):
                c = RawClient(await trio.open_tcp_stream("127.0.0.1", port))
                r = await c.call(
                    "api_versions", 3, {"client_software_name": "t", "client_software_version": "1"}
                )
            assert r.error_code == 0 and listener.failures == 0
            nursery.cancel_scope.cancel()
    finally:
        node.close()


async def test_accept_still_raises_other_errors() -> None:
    with pytest.raises(OSError) as info:
        await accept_or_wait(FlakyListener([errno.EBADF]), "PLAINTEXT")
    assert info.value.errno == errno.EBADF


@pytest.fixture
async def small_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Broker]:
    # the process's own limit is large here: give the node a budget as if it were small
    monkeypatch.setattr(
        node_module.FdBudget,
        "of_process",
        classmethod(lambda cls, max_connections: FdBudget(256, 96, PARTITION_FILES)),
    )
    config = BrokerConfig(
        data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2, max_broker_partitions=600
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, config)
        yield Broker(config, listeners[0].socket.getsockname()[1])
        nursery.cancel_scope.cancel()


def topic_spec(name: str, partitions: int) -> dict[str, Any]:
    return {
        "name": name,
        "num_partitions": partitions,
        "replication_factor": 1,
        "assignments": [],
        "configs": [],
    }


async def create_topics(broker: Broker, *topics: dict[str, Any]) -> Any:
    c = await broker.connect()
    return await c.call(
        "create_topics", 7, {"topics": list(topics), "timeout": 60_000, "validate_only": False}
    )


def open_fds(under: Path | None = None, *, topic: str = "") -> int:
    """Descriptors this process holds; with `under`, only those open on files below it
    in the folders of `topic`'s partitions (the whole process's count also moves with
    whatever else the runner opens or closes meanwhile: sockets and files of earlier
    tests, collected late, which made a bound on it fail in a full run)."""
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    prefix = os.path.realpath(under) + os.sep
    folder = re.compile(rf"/{re.escape(topic)}-\d+/")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing (the listing's own)
            path = os.readlink(f"/proc/self/fd/{fd}")
            n += path.startswith(prefix) and bool(folder.search(path))
    return n


async def test_more_partitions_than_the_file_budget_are_served(small_broker: Broker) -> None:
    data_dir = small_broker.config.data_dir
    n = 300  # 1,200 partition files, on a budget of 40
    r = await create_topics(small_broker, topic_spec("many", n))
    assert r.topics[0].error_code == 0, r
    assert open_fds(data_dir, topic="many") <= PARTITION_FILES
    c = await small_broker.connect()
    data = [batch([f"value-{i}".encode()]) for i in range(n)]
    # one Produce to every partition: a commit round over more logs than the budget holds
    r = await c.call(
        "produce",
        9,
        {
            "acks": -1,
            "timeout": 30_000,
            "topic_data": [
                {
                    "name": "many",
                    "partition_data": [{"index": i, "records": data[i]} for i in range(n)],
                }
            ],
        },
    )
    got = r.responses[0].partition_responses
    assert sorted(p.index for p in got) == list(range(n))
    assert all(p.error_code == 0 and p.base_offset == 0 for p in got), [
        p for p in got if p.error_code
    ][:3]
    assert open_fds(data_dir, topic="many") <= PARTITION_FILES
    for again in range(2):
        r = await c.call(
            "fetch",
            12,
            {
                "replica_id": -1,
                "max_wait": 0,
                "min_bytes": 0,
                "max_bytes": 50 << 20,
                "isolation_level": 0,
                "session_id": 0,
                "session_epoch": -1,
                "topics": [
                    {
                        "topic": "many",
                        "partitions": [
                            {
                                "partition": i,
                                "fetch_offset": 0,
                                "partition_max_bytes": 1 << 20,
                                "current_leader_epoch": -1,
                                "last_fetched_epoch": -1,
                                "log_start_offset": -1,
                            }
                            for i in range(n)
                        ],
                    }
                ],
                "forgotten_topics_data": [],
                "rack_id": "",
            },
        )
        parts = r.responses[0].partitions
        assert all(p.error_code == 0 and p.high_watermark == 1 for p in parts), again
        assert all(
            bytes(p.records)[61:].find(f"value-{p.partition_index}".encode()) > 0 for p in parts
        )
    assert open_fds(data_dir, topic="many") <= PARTITION_FILES


async def test_partitions_past_the_limits_are_refused(small_broker: Broker) -> None:
    r = await create_topics(small_broker, topic_spec("a", 6_000), topic_spec("b", 5_000))
    assert [t.error_code for t in r.topics] == [44, 44]  # POLICY_VIOLATION, as Kafka 4.0
    assert "Excessively large number of partitions per request" in r.topics[0].error_message
    r = await create_topics(small_broker, topic_spec("c", 500))
    assert r.topics[0].error_code == 0
    r = await create_topics(small_broker, topic_spec("d", 200))
    assert r.topics[0].error_code == 44
    assert "max.broker.partitions" in r.topics[0].error_message
    c = await small_broker.connect()
    meta = await c.call(
        "metadata",
        12,
        {
            "topics": [{"name": "d", "topic_id": None}],
            "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False,
        },
    )
    assert meta.topics[0].error_code == 3  # nothing half-made


async def test_creating_thousands_of_partitions_does_not_stall_the_loop(tmp_path: Path) -> None:
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = trio.current_time()
        while True:
            await trio.sleep(0.005)
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            start = trio.current_time()
            topic = await node.create_topic_off_loop("wide", 2_000)
            took = trio.current_time() - start
            nursery.cancel_scope.cancel()
        assert topic is not None and len(topic.partitions) == 2_000
        assert node.store.handles is not None
        assert node.store.handles.total <= node.store.handles.budget
        # the loop kept running while the archives were made
        assert took > 0.5 and max(gaps, default=took) < took / 4, (took, gaps[-3:])
    finally:
        node.close()


async def test_a_mirror_of_more_partitions_than_its_file_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.mirror import discover

    monkeypatch.setattr(
        node_module.FdBudget,
        "of_process",
        classmethod(lambda cls, max_connections: FdBudget(256, 96, 24)),
    )
    n = 30
    wcfg = BrokerConfig(
        data_dir=tmp_path / "w",
        listen_port=0,
        shutdown_grace_s=2,
        replication_listen=("127.0.0.1", 0),
    )
    async with trio.open_nursery() as nursery:
        wport = (await nursery.start(run, wcfg))[0].socket.getsockname()[1]
        writer = Broker(wcfg, wport)
        assert (await create_topics(writer, topic_spec("m", n))).topics[0].error_code == 0
        w = await writer.connect()
        r = await w.call(
            "produce",
            9,
            {
                "acks": -1,
                "timeout": 30_000,
                "topic_data": [
                    {
                        "name": "m",
                        "partition_data": [
                            {"index": i, "records": batch([f"v{i}".encode()])} for i in range(n)
                        ],
                    }
                ],
            },
        )
        assert all(p.error_code == 0 for p in r.responses[0].partition_responses)
        key, _ = await discover("127.0.0.1", wport)
        mcfg = BrokerConfig(
            data_dir=tmp_path / "m",
            listen_port=0,
            shutdown_grace_s=2,
            auto_create_topics=False,
            mirrors=[f"127.0.0.1:{wport}@{key.hex()}"],
        )
        mport = (await nursery.start(run, mcfg))[0].socket.getsockname()[1]
        m = await Broker(mcfg, mport).connect()
        with trio.fail_after(60):
            for i in range(n):
                while True:
                    lo = await m.call(
                        "list_offsets",
                        1,
                        {
                            "replica_id": -1,
                            "topics": [
                                {
                                    "name": "m",
                                    "partitions": [{"partition_index": i, "timestamp": -1}],
                                }
                            ],
                        },
                    )
                    p = lo.topics[0].partitions[0]
                    if p.error_code == 0 and p.offset == 1:
                        break
                    await trio.sleep(0.05)
        r = await m.call(
            "fetch",
            4,
            {
                "replica_id": -1,
                "max_wait": 0,
                "min_bytes": 0,
                "max_bytes": 1 << 24,
                "isolation_level": 0,
                "topics": [
                    {
                        "topic": "m",
                        "partitions": [
                            {"partition": i, "fetch_offset": 0, "partition_max_bytes": 1 << 20}
                            for i in range(n)
                        ],
                    }
                ],
            },
        )
        parts = r.responses[0].partitions
        assert all(
            p.error_code == 0 and f"v{p.partition_index}".encode() in bytes(p.records)
            for p in parts
        )
        # Writer and mirror: a budget of 24 partition files each, which a commit round's
        # pinned slice (4 partitions of 4 files: storage/handles.py) may pass until the
        # next make_room. (The catalog, the lock and sockets are not on this budget.)
        for data_dir in (wcfg.data_dir, mcfg.data_dir):
            assert open_fds(data_dir, topic="m") <= 24 + 4 * 4
        nursery.cancel_scope.cancel()


async def test_concurrent_creations_count_against_the_limit(tmp_path: Path) -> None:
    node = open_node(
        BrokerConfig(data_dir=tmp_path / "data", listen_port=0, max_broker_partitions=100)
    )
    codes: list[tuple[str, int]] = []

    async def create(name: str) -> None:
        try:
            await node.create_topic_off_loop(name, 60)
            codes.append((name, 0))
        except node_module.TopicError as exc:
            codes.append((name, exc.code))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(create, "one")
            await trio.testing.wait_all_tasks_blocked()  # "one" is being made in a thread
            assert "one" in node._creating
            with pytest.raises(node_module.TopicError) as info:
                node.topic_for_write("one")  # a produce's auto-creation meanwhile
            assert info.value.code == 5  # LEADER_NOT_AVAILABLE: retriable, shows up shortly
            nursery.start_soon(create, "two")
            nursery.start_soon(create, "one")  # the same name while it is being made
        # one made; the other past max.broker.partitions (POLICY_VIOLATION); the same name
        # again: TOPIC_ALREADY_EXISTS, never an internal error
        assert sorted(c for _, c in codes) == [0, 36, 44], codes
        assert node.partition_count() == 60 + 1  # and the offsets topic
    finally:
        node.close()


async def test_a_fetch_without_a_descriptor_to_spare_copies_instead(
    small_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import broker.handlers.fetch as fetch_handler

    def no_descriptor(fd: int, position: int, size: int) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(fetch_handler, "FileSlice", no_descriptor)
    assert (await create_topics(small_broker, topic_spec("big", 1))).topics[0].error_code == 0
    c = await small_broker.connect()
    data = batch([b"x" * 200_000])  # above SENDFILE_MIN_BYTES: would go by sendfile
    r = await c.call(
        "produce",
        9,
        {
            "acks": -1,
            "timeout": 5000,
            "topic_data": [{"name": "big", "partition_data": [{"index": 0, "records": data}]}],
        },
    )
    assert r.responses[0].partition_responses[0].error_code == 0
    r = await c.call(
        "fetch",
        4,
        {
            "replica_id": -1,
            "max_wait": 0,
            "min_bytes": 0,
            "max_bytes": 1 << 24,
            "isolation_level": 0,
            "topics": [
                {
                    "topic": "big",
                    "partitions": [
                        {"partition": 0, "fetch_offset": 0, "partition_max_bytes": 1 << 24}
                    ],
                }
            ],
        },
    )
    p = r.responses[0].partitions[0]
    assert p.error_code == 0 and len(bytes(p.records)) == len(data)


async def test_a_round_out_of_descriptors_writes_the_partition_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage.errors import StorageError

    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    try:
        topic = await node.create_topic_off_loop("t", 1)
        assert topic is not None
        p = topic.partitions[0]
        assert p.log.parked  # made in a thread, parked until used
        real = p.log._unpark

        def exhausted() -> None:
            raise StorageError("cannot reopen") from OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(p.log, "_unpark", exhausted)
        _, last = p.admit(bytearray(batch([b"v"])), 0)
        node.mark_dirty(p, wake=False)
        await node.commit_round()
        assert p.failed is None and p.queued  # not offline: kept for a later round
        monkeypatch.setattr(p.log, "_unpark", real)
        await node.commit_round(every_partition=True)  # the tick
        assert p.failed is None and not p.queued and p.log.high_watermark == last + 1
    finally:
        node.close()

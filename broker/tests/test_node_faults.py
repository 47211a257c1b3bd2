"""Disk errors in the node's background work: a partition goes offline, the broker lives."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.compose import open_node
from broker.config import BrokerConfig
from broker.node import KAFKA_STORAGE_ERROR, Node, TopicError, ms_now
from broker.server import run
from storage import FsyncPolicy, PartitionLog, Store
from storage.batch import build_batch, record_values
from storage.fs import FaultyFileSystem


async def test_a_disk_error_in_retention_takes_one_partition_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    try:
        topic = node.create_topic("t", 2)
        assert topic is not None
        bad, good = topic.partitions

        def broken(now_ms: int) -> int:
            raise OSError(errno.EIO, "injected fsync failure")

        monkeypatch.setattr(bad.log, "apply_retention", broken)
        # The retention loop calls this every check interval: it must not raise, or the
        # broker's background nursery (and the broker) would end.
        assert await node.apply_retention() == 0
        assert bad.failed is not None and "retention failed" in bad.failed
        assert good.failed is None
        # The next pass skips the offline partition instead of failing again.
        assert await node.apply_retention() == 0
    finally:
        node.close()


def _faulty_node(data_dir: Path, fs: FaultyFileSystem) -> Node:
    config = BrokerConfig(data_dir=data_dir, listen_port=0)
    return Node(config, Store.open(data_dir, fsync=config.fsync, fs=fs))


async def _produce(node: Node, topic: str, value: bytes) -> int:
    p = node.topics[topic].partitions[0]
    _, last = p.admit(build_batch([value], timestamp_ms=ms_now()), 0)
    node.mark_dirty(p)
    await node.commit_round()
    await p.wait_durable(last)
    return last


def _values(node: Node, topic: str) -> list[bytes]:
    plog = node.topics[topic].partitions[0].log
    return [
        v
        for b in _batches(plog.read_bytes(plog.log_start_offset, 1 << 20))
        for v in record_values(b)
    ]


def _batches(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
        out.append(data[pos : pos + size])
        pos += size
    return out


async def test_a_new_topic_on_a_full_disk_is_a_storage_error_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    fs = FaultyFileSystem()
    node = _faulty_node(tmp_path / "data", fs)
    try:
        fs.fail_write = lambda path: "/fresh-" in path
        with pytest.raises(TopicError) as refused:
            node.create_topic("fresh", 2)
        assert refused.value.code == KAFKA_STORAGE_ERROR
        assert "fresh" not in node.topics and "fresh" not in node.store.topics()
        # auto-creation (Produce, Metadata) answers the same
        with pytest.raises(TopicError) as auto:
            node.topic_for_write("fresh")
        assert auto.value.code == KAFKA_STORAGE_ERROR
        fs.fail_write = None  # room again: the same name is created whole
        topic = node.create_topic("fresh", 2)
        assert topic is not None and all(p.failed is None for p in topic.partitions)
    finally:
        node.close()


async def test_writes_resume_once_the_disk_has_room(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    node = _faulty_node(tmp_path / "data", fs)
    try:
        node.create_topic("t", 1)
        await _produce(node, "t", b"acked")
        fs.fail_write = lambda path: "/t-0/" in path and path.endswith(".bidx")
        with pytest.raises(TopicError) as full:
            await _produce(node, "t", b"lost")
        assert full.value.code == KAFKA_STORAGE_ERROR
        p = node.topics["t"].partitions[0]
        assert p.failed and p.retry
        assert await node.retry_offline() == 0  # still full: still offline, still served
        assert p.failed and _values(node, "t") == [b"acked"]
        fs.fail_write = None
        assert await node.retry_offline() == 0  # backing off after a failed reopen
        p.retry_at = 0.0
        assert await node.retry_offline() == 1
        assert p.failed is None
        await _produce(node, "t", b"again")
        # the batch written before the failure was signed by the reopen (it was on disk)
        assert _values(node, "t") in ([b"acked", b"again"], [b"acked", b"lost", b"again"])
    finally:
        node.close()


async def test_a_restart_on_a_full_disk_serves_every_acknowledged_record(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    node = _faulty_node(tmp_path / "data", fs)
    node.create_topic("t", 1)
    for i in range(3):
        await _produce(node, "t", b"%d" % i)
    p = node.topics["t"].partitions[0]
    p.log.append(build_batch([b"unsigned"], timestamp_ms=ms_now()))  # written, not signed
    fs.crash("keep")  # killed; the lock goes with the process
    node.store._lock.release()  # type: ignore[union-attr]

    fs.fail_write = lambda path: "/t-0/" in path  # recovery must sign that tail: no room
    node = _faulty_node(tmp_path / "data", fs)
    try:
        p = node.topics["t"].partitions[0]
        assert p.failed and p.retry
        assert _values(node, "t") == [b"0", b"1", b"2"]
        with pytest.raises(TopicError) as offline:
            await _produce(node, "t", b"x")
        assert offline.value.code == KAFKA_STORAGE_ERROR
        fs.fail_write = None
        assert await node.retry_offline() == 1
        await _produce(node, "t", b"3")
        assert _values(node, "t") == [b"0", b"1", b"2", b"unsigned", b"3"]
    finally:
        node.close()


async def test_a_read_error_answers_kafka_storage_error_and_the_connection_lives(
    broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.tests.test_server import batch, create, fetch, produce

    real_read = PartitionLog.read

    def read(self: PartitionLog, offset: int, max_bytes: int) -> Any:
        if "/eio-" in self.path:
            raise OSError(errno.EIO, "injected read failure")
        return real_read(self, offset, max_bytes)

    await create(broker, "eio")
    await create(broker, "fine")
    c = await broker.connect()
    assert (await produce(c, "eio", batch([b"a"]))).error_code == 0
    assert (await produce(c, "fine", batch([b"b"]))).error_code == 0
    monkeypatch.setattr(PartitionLog, "read", read)
    assert (await fetch(c, "eio", 0)).error_code == KAFKA_STORAGE_ERROR
    assert (await fetch(c, "fine", 0)).error_code == 0  # same connection, other partition


async def test_a_delete_the_catalog_cannot_record_keeps_the_topic_whole(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    node = _faulty_node(tmp_path / "data", fs)
    try:
        node.create_topic("t", 1)
        await _produce(node, "t", b"kept")
        catalog = str((tmp_path / "data" / "__catalog").resolve())
        fs.fail_write = lambda path: path.startswith(catalog)
        with pytest.raises(TopicError) as refused:
            await node.delete_topic("t")
        assert refused.value.code == KAFKA_STORAGE_ERROR
        assert "t" in node.topics and node.topics["t"].partitions[0].failed is None
        await _produce(node, "t", b"still writable")
        fs.fail_write = None
        await node.delete_topic("t")
        assert "t" not in node.topics and "t" not in node.store.topics()
    finally:
        node.close()


async def test_an_io_error_is_not_retried_only_a_full_disk_is(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    node = _faulty_node(tmp_path / "data", fs)
    try:
        node.create_topic("t", 1)
        await _produce(node, "t", b"acked")
        p = node.topics["t"].partitions[0]
        fs.fail_fsync = lambda path: "/t-0/" in path
        node.config.fsync = p.log.policy = FsyncPolicy.ALWAYS  # every round fsyncs
        with pytest.raises(TopicError):
            await _produce(node, "t", b"x")
        assert p.failed and not p.retry  # fsyncgate: the page cache cannot be trusted now
        fs.fail_fsync = None
        p.retry_at = 0.0
        assert await node.retry_offline() == 0 and p.failed
        assert _values(node, "t") == [b"acked"]  # still served up to its signed head
    finally:
        node.close()


async def test_a_close_that_fails_at_shutdown_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from storage.errors import StorageError

    def full(self: Store) -> None:
        raise StorageError("1 logs failed to close: [Errno 28] No space left on device")

    monkeypatch.setattr(Store, "close", full)
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(run, config)
        nursery.cancel_scope.cancel()
    assert "closing the data dir failed" in caplog.text

"""Mirrors in one process: a writer and a mirror node over loopback.

Discovery through DescribeConfigs, catalog and partition following, Fetch of the same
bytes from the mirror, NOT_LEADER_OR_FOLLOWER on produce, a topic created later showing
up, a pinned key that does not match, and equivocation caught by the head probe."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig, ConfigError
from broker.mirror import DiscoveryError, MirrorTarget, discover, kafka_request, probe_head
from broker.server import run
from broker.tests.conftest import RawClient
from storage.batch import build_batch
from storage.follower import Equivocation, FollowerLog
from storage.hypercore import KeyPair
from storage.log import FsyncPolicy, PartitionLog
from storage.replication import PartitionLogSource, ReplicationSession


def test_mirror_target_parse() -> None:
    assert MirrorTarget.parse("h:1") == MirrorTarget("h", 1, None)
    key = bytes(range(32))
    assert MirrorTarget.parse(f"h:1@{key.hex()}") == MirrorTarget("h", 1, key)
    for bad in ("h:1@zz", "h:1@abcd", "nohost"):
        with pytest.raises(ConfigError):
            MirrorTarget.parse(bad)


async def _start(nursery: trio.Nursery, config: BrokerConfig) -> int:
    listeners = await nursery.start(run, config)
    return int(listeners[0].socket.getsockname()[1])


async def _client(port: int) -> RawClient:
    return RawClient(await trio.open_tcp_stream("127.0.0.1", port))


async def _produce(c: RawClient, topic: str, values: list[bytes]) -> Any:
    batch = bytes(build_batch(values, timestamp_ms=1_700_000_000_000))
    return await c.call("produce", 8, {"acks": -1, "timeout": 5000, "transactional_id": None, "topic_data": [
        {"name": topic, "partition_data": [{"index": 0, "records": batch}]}]})


async def _hwm(c: RawClient, topic: str, partition: int = 0) -> tuple[int, int]:
    r = await c.call("list_offsets", 1, {"replica_id": -1, "topics": [
        {"name": topic, "partitions": [{"partition_index": partition, "timestamp": -1}]}]})
    p = r.topics[0].partitions[0]
    return p.error_code, p.offset


async def _fetch(c: RawClient, topic: str, partition: int = 0) -> bytes:
    r = await c.call("fetch", 4, {"replica_id": -1, "max_wait": 0, "min_bytes": 0, "max_bytes": 1 << 24,
                                  "isolation_level": 0, "topics": [{"topic": topic, "partitions": [
                                      {"partition": partition, "fetch_offset": 0, "partition_max_bytes": 1 << 24}]}]})
    return bytes(r.responses[0].partitions[0].records or b"")


async def _wait_hwm(c: RawClient, topic: str, want: int, partition: int = 0) -> None:
    with trio.fail_after(20):
        while True:  # polling a remote process's state: no event to wait on
            if await _hwm(c, topic, partition) == (0, want):
                return
            await trio.sleep(0.05)


async def test_writer_and_mirror_in_process(tmp_path: Path) -> None:
    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", 0))
    async with trio.open_nursery() as nursery:
        wport = await _start(nursery, wcfg)
        key, address = await discover("127.0.0.1", wport)
        assert address is not None and address.startswith("127.0.0.1:")
        w = await _client(wport)
        r = await _produce(w, "early", [b"a", b"b", b"c"])
        assert r.responses[0].partition_responses[0].error_code == 0
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}@{key.hex()}"])
        mport = await _start(nursery, mcfg)
        m = await _client(mport)
        await _wait_hwm(m, "early", 3)
        assert await _fetch(m, "early") == await _fetch(w, "early")
        # live: more records, and a topic created after the mirror started
        await _produce(w, "early", [b"d"])
        await _produce(w, "late", [b"x", b"y"])
        await _wait_hwm(m, "early", 4)
        await _wait_hwm(m, "late", 2)
        assert await _fetch(m, "late") == await _fetch(w, "late")
        r = await _produce(m, "late", [b"lost?"])
        assert r.responses[0].partition_responses[0].error_code == 6  # NOT_LEADER_OR_FOLLOWER
        assert await _hwm(m, "late") == (0, 2)
        # a mirror pinned to another key stores nothing
        other = dataclasses.replace(mcfg, data_dir=tmp_path / "m2", mirrors=[f"127.0.0.1:{wport}@{'ab' * 32}"])
        oport = await _start(nursery, other)
        o = await _client(oport)
        await trio.sleep(1)
        assert (await _hwm(o, "early"))[0] == 3  # UNKNOWN_TOPIC_OR_PARTITION
        assert not (tmp_path / "m2" / "__mirrors" / key.hex()).exists()
        nursery.cancel_scope.cancel()


async def test_probe_catches_equivocation(tmp_path: Path) -> None:
    kp = KeyPair.from_seed(bytes([5]) * 32)
    honest = PartitionLog.open(tmp_path / "honest", kp, fsync=FsyncPolicy.NEVER)
    evil = PartitionLog.open(tmp_path / "evil", kp, fsync=FsyncPolicy.NEVER)
    for i in range(4):
        honest.append(build_batch([b"h%d" % i], timestamp_ms=1000))
        evil.append(build_batch([b"e%d" % i], timestamp_ms=1000))
    honest.commit()
    evil.commit()
    follower = FollowerLog.open_replica(tmp_path / "m", kp.public_key)
    server = ReplicationSession.serve(PartitionLogSource(honest))
    client = ReplicationSession.follow(honest.key, follower, initiator=True, public_key=kp.public_key)
    for _ in range(1000):  # sans-I/O: exchange until quiet
        a, b = client.data_to_send(), server.data_to_send()
        if not a and not b:
            break
        if a:
            server.receive_data(a)
        if b:
            client.receive_data(b)
    assert follower.high_watermark == 4

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def serve_evil(stream: trio.SocketStream) -> None:
        s = ReplicationSession.serve_any(lambda dk: PartitionLogSource(evil))
        try:
            while True:
                out = s.data_to_send()
                if out:
                    await stream.send_all(out)
                data = await stream.receive_some(1 << 16)
                if not data:
                    return
                s.receive_data(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve_evil, listeners)
        with trio.fail_after(10), pytest.raises(Equivocation):
            await probe_head(f"127.0.0.1:{port}", follower)
        nursery.cancel_scope.cancel()
    assert follower.frozen
    assert follower.high_watermark == 4  # still serves what it verified
    follower.close()
    honest.close()
    evil.close()


async def _serve_archive(stream: trio.SocketStream, lg: PartitionLog) -> None:
    from storage.replication.session import Connection

    src = PartitionLogSource(lg)
    s = Connection(initiator=False, lookup=lambda dk: src)  # a channel per probe/follow
    try:
        while True:
            out = s.data_to_send()
            if out:
                await stream.send_all(out)
            data = await stream.receive_some(1 << 16)
            if not data:
                return
            s.receive_data(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def test_a_longer_fork_is_caught_frozen_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A copy of the writer's data dir (same key) that appended other records to a
    LONGER length than the mirror verified: `follow_forever` freezes the archive, keeps
    both heads, logs one ERROR and stops (no retrying at INFO forever)."""
    import shutil

    from broker.mirror import _link_to, follow_forever
    from storage.follower import EVIDENCE_FILE, check_evidence

    kp = KeyPair.from_seed(bytes([6]) * 32)
    honest = PartitionLog.open(tmp_path / "honest", kp, fsync=FsyncPolicy.NEVER)
    for i in range(3):
        honest.append(build_batch([b"h%d" % i], timestamp_ms=1000))
    honest.commit()
    honest.close()
    shutil.copytree(tmp_path / "honest", tmp_path / "evil")
    honest = PartitionLog.open(tmp_path / "honest", kp, fsync=FsyncPolicy.NEVER)
    honest.append(build_batch([b"h3"], timestamp_ms=1000))
    honest.commit()
    evil = PartitionLog.open(tmp_path / "evil", kp, fsync=FsyncPolicy.NEVER)
    for i in range(40):
        evil.append(build_batch([b"e%d" % i], timestamp_ms=1000))
        evil.commit()
    follower = FollowerLog.open_replica(tmp_path / "m", kp.public_key)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    serving = [honest]
    moved: list[int] = []
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners,
                           lambda st: _serve_archive(st, serving[0]), listeners)
        async with _link_to(f"127.0.0.1:{port}") as link:
            with trio.move_on_after(5):  # live: follows the honest writer until cancelled
                while follower.high_watermark < 4:
                    with trio.move_on_after(0.5):
                        await follow_forever(link, follower, lambda: moved.append(1), "t-0")
            assert follower.high_watermark == 4
        serving[0] = evil  # the same address now serves the longer fork
        caplog.clear()
        async with _link_to(f"127.0.0.1:{port}") as link:
            with trio.fail_after(10):
                await follow_forever(link, follower, lambda: None, "t-0")  # returns: frozen
            with trio.fail_after(10):
                await follow_forever(link, follower, lambda: None, "t-0")  # again: quiet
        nursery.cancel_scope.cancel()
    assert follower.frozen
    assert follower.high_watermark == 4  # still serves what it verified
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "EQUIVOCATION" in errors[0], errors
    assert not [r for r in caplog.records if r.levelno == logging.INFO and "t-0" in r.getMessage()]
    follower.close()
    assert (tmp_path / "m" / EVIDENCE_FILE).is_file()
    assert check_evidence(str(tmp_path / "m"), kp.public_key) is not None
    honest.close()
    evil.close()


async def test_replication_port_drops_a_peer_that_never_handshakes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replication port is open to anyone: a connection that sends nothing (or half
    a handshake) is dropped after HANDSHAKE_TIMEOUT_S; one that completes the handshake
    stays, idle, as long as it likes."""
    from broker import replication_server
    from storage.replication.session import Connection

    monkeypatch.setattr(replication_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    cfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                       replication_listen=("127.0.0.1", 0))
    async with trio.open_nursery() as nursery:
        port = await _start(nursery, cfg)
        _, address = await discover("127.0.0.1", port)
        assert address is not None
        rhost, rport = address.rsplit(":", 1)
        mute = await trio.open_tcp_stream(rhost, int(rport))
        half = await trio.open_tcp_stream(rhost, int(rport))
        await half.send_all(b"\x20\x00\x00" + bytes(10))  # a Noise message, cut short
        good = await trio.open_tcp_stream(rhost, int(rport))
        conn = Connection(initiator=True)
        with trio.fail_after(5):
            while not conn.stream.established:
                out = conn.data_to_send()
                if out:
                    await good.send_all(out)
                data = await good.receive_some(1 << 16)
                assert data
                conn.receive_data(data)
        with trio.fail_after(5):
            assert await mute.receive_some(100) == b""  # closed by the server
            assert await half.receive_some(100) == b""
        with trio.move_on_after(1.5):
            assert await good.receive_some(100) != b""  # (nothing comes: it stays open)
        for st in (mute, half, good):
            await st.aclose()
        nursery.cancel_scope.cancel()


async def test_a_writer_truncated_below_our_copy_is_no_equivocation(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `never` writer loses its unsynced tail across a reboot and goes on under fork 1
    (FORMAT.md sec. 8, case 9), shorter than what the mirror verified: legitimate in
    Hypercore (a truncate), so no evidence and no freeze; the mirror cannot reorg, says
    so at ERROR once and stops following that archive, serving what it verified."""
    from broker.mirror import _link_to, follow_forever
    from storage.follower import EVIDENCE_FILE
    from storage.fs import FaultyFileSystem

    kp = KeyPair.from_seed(bytes([7]) * 32)
    fs = FaultyFileSystem()
    w = PartitionLog.open(tmp_path / "w", kp, fsync=FsyncPolicy.NEVER, fs=fs)
    for i in range(2):
        w.append(build_batch([b"durable%d" % i], timestamp_ms=1000))
    w.commit(force_sync=True)
    for i in range(3):
        w.append(build_batch([b"lost%d" % i], timestamp_ms=1000))
    w.commit()
    follower = FollowerLog.open_replica(tmp_path / "m", kp.public_key)
    server = ReplicationSession.serve(PartitionLogSource(w))
    client = ReplicationSession.follow(w.key, follower, initiator=True, public_key=kp.public_key)
    for _ in range(1000):
        a, b = client.data_to_send(), server.data_to_send()
        if not a and not b:
            break
        if a:
            server.receive_data(a)
        if b:
            client.receive_data(b)
    assert follower.high_watermark == 5
    fs.crash("drop")
    monkeypatch.setattr("storage.format.BOOT_ID", b"\x42" * 16)  # the machine rebooted
    w = PartitionLog.open(tmp_path / "w", kp, fsync=FsyncPolicy.NEVER, fs=fs)
    w.append(build_batch([b"new"], timestamp_ms=1000))
    w.commit()
    assert w.fork == 1 and w.head is not None and w.head.length == 3
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, lambda st: _serve_archive(st, w), listeners)
        for _ in range(2):  # a second attempt (a reconnect) says nothing more
            async with _link_to(f"127.0.0.1:{port}") as link:
                with trio.fail_after(10):
                    await follow_forever(link, follower, lambda: None, "t-0")
        nursery.cancel_scope.cancel()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "truncated" in errors[0] and "EQUIVOCATION" not in errors[0]
    assert not follower.frozen and follower.reorg_needed
    assert not (tmp_path / "m" / EVIDENCE_FILE).exists()
    assert follower.high_watermark == 5  # still serves what it verified
    follower.close()
    w.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


async def test_a_longer_fork_of_the_writers_catalog_stops_the_mirror_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nodes in process: a copy of the writer's data dir (same node key) comes back at
    the writer's address with a catalog that went its own way and is LONGER than the
    mirror's. The mirror freezes its catalog copy (evidence kept), logs one ERROR, stops
    following that node (no retrying) and keeps serving every topic it verified."""
    import shutil

    from storage.follower import EVIDENCE_FILE, check_evidence
    from storage.store import CATALOG_DIR

    wport, rport = _free_port(), _free_port()
    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=wport, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", rport))
    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as outer:

        async def node(cfg: BrokerConfig, scope: trio.CancelScope,
                       task_status: trio.TaskStatus[int]) -> None:
            with scope:
                async with trio.open_nursery() as n:
                    task_status.started(await _start(n, cfg))

        first = trio.CancelScope()
        await outer.start(node, wcfg, first)
        await _produce(await _client(wport), "a", [b"1"])
        first.cancel()
        await trio.sleep(0.3)
        await trio.to_thread.run_sync(shutil.copytree, tmp_path / "w", tmp_path / "evil")
        writer = trio.CancelScope()
        await outer.start(node, wcfg, writer)
        await _produce(await _client(wport), "b", [b"2"])
        key, _ = await discover("127.0.0.1", wport)
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}"])
        mport = await outer.start(node, mcfg, trio.CancelScope())
        m = await _client(mport)
        await _wait_hwm(m, "a", 1)
        await _wait_hwm(m, "b", 1)
        writer.cancel()
        await trio.sleep(0.3)
        ecfg = dataclasses.replace(wcfg, data_dir=tmp_path / "evil")
        await outer.start(node, ecfg, trio.CancelScope())
        e = await _client(wport)
        for t in ("c", "d", "e"):  # its catalog: a, c, d, e (ours: a, b)
            await _produce(e, t, [b"3"])
        with trio.fail_after(20):
            while True:  # polling the log: no event to wait on
                if "EQUIVOCATION" in caplog.text:
                    break
                await trio.sleep(0.1)
        await trio.sleep(6)  # past the longest reconnect backoff: nothing more is tried
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "EQUIVOCATION" in errors[0], errors
        assert await _hwm(m, "a") == (0, 1) and await _hwm(m, "b") == (0, 1)
        assert (await _hwm(m, "c"))[0] == 3  # UNKNOWN_TOPIC_OR_PARTITION: nothing forged
        cat = tmp_path / "m" / "__mirrors" / key.hex() / CATALOG_DIR
        assert (cat / EVIDENCE_FILE).is_file()
        assert check_evidence(str(cat), key) is not None
        outer.cancel_scope.cancel()


async def test_mirror_restarted_while_writer_is_down_serves_its_copy(tmp_path: Path) -> None:
    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", 0))
    writer_scope = trio.CancelScope()  # the writer's lifetime
    async with trio.open_nursery() as outer:
        writer_nursery_done = trio.Event()

        async def writer_life(task_status: trio.TaskStatus[int]) -> None:
            with writer_scope:
                async with trio.open_nursery() as n:
                    task_status.started(await _start(n, wcfg))
            writer_nursery_done.set()

        wport = await outer.start(writer_life)
        w = await _client(wport)
        await _produce(w, "t", [b"1", b"2"])
        want = await _fetch(w, "t")
        # trust on first use: no key given
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}"])
        with trio.CancelScope() as mirror_scope:
            async with trio.open_nursery() as n:
                m = await _client(await _start(n, mcfg))
                await _wait_hwm(m, "t", 2)
                mirror_scope.cancel()
        writer_scope.cancel()  # the writer goes away for good
        await writer_nursery_done.wait()
        async with trio.open_nursery() as n:  # the mirror comes back alone
            m = await _client(await _start(n, mcfg))
            assert await _hwm(m, "t") == (0, 2)
            assert await _fetch(m, "t") == want
            n.cancel_scope.cancel()
        outer.cancel_scope.cancel()


async def test_stock_node_hypercore_replicates_a_partition_from_the_broker(tmp_path: Path) -> None:
    """The existing Hypercore network can carry our data: npm hypercore 11 dials the
    broker's --replication-listen port, replicates one partition's archive, verifies
    every proof and the signed head, and gets exactly the bytes Kafka Fetch serves."""
    import hashlib
    import io
    import json
    from contextlib import redirect_stdout

    from storage.cli import keys_command
    from storage.tests.test_replication_interop import PEER, _require_node

    node_bin = _require_node()
    cfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                       replication_listen=("127.0.0.1", 0))
    async with trio.open_nursery() as nursery:
        wport = await _start(nursery, cfg)
        _, address = await discover("127.0.0.1", wport)
        assert address is not None
        w = await _client(wport)
        for i in range(5):  # five produces: five batches, five blocks
            await _produce(w, "t", [b"record %d-%d" % (i, j) for j in range(3)])
        served = await _fetch(w, "t")
        out = io.StringIO()
        with redirect_stdout(out):
            assert keys_command(str(cfg.data_dir)) == 0
        key = next(line.split("\t")[2] for line in out.getvalue().splitlines() if line.startswith("t\t0\t"))
        with trio.fail_after(60):
            proc = await trio.run_process(
                [node_bin, str(PEER), "fetch", address.rsplit(":", 1)[1], key, "5",
                 hashlib.sha256(served).hexdigest()],
                capture_stdout=True, capture_stderr=True, check=False)
        assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()
        result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        assert result["ok"] and result["length"] == 5 and result["bytes"] == len(served)
        nursery.cancel_scope.cancel()


async def test_mirror_of_eight_partitions_uses_one_replication_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every archive (catalog, 8 partitions, the probes) is a channel of ONE connection to
    the writer, as Hypercore replicates many cores over one stream; all 8 partitions
    arrive byte-exact, also what is produced after the mirror caught up."""
    caplog.set_level(logging.INFO, logger="hyperkafka.replication")
    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", 0))
    parts = 8
    async with trio.open_nursery() as nursery:
        wport = await _start(nursery, wcfg)
        key, _ = await discover("127.0.0.1", wport)
        w = await _client(wport)
        r = await w.call("create_topics", 4, {"timeout_ms": 5000, "validate_only": False, "topics": [
            {"name": "wide", "num_partitions": parts, "replication_factor": 1,
             "assignments": [], "configs": []}]})
        assert r.topics[0].error_code == 0

        async def produce(p: int, values: list[bytes]) -> None:
            batch = bytes(build_batch(values, timestamp_ms=1_700_000_000_000))
            r = await w.call("produce", 8, {"acks": -1, "timeout": 5000, "transactional_id": None,
                                            "topic_data": [{"name": "wide", "partition_data": [
                                                {"index": p, "records": batch}]}]})
            assert r.responses[0].partition_responses[0].error_code == 0

        for p in range(parts):
            await produce(p, [b"p%d-r%d" % (p, i) * (p + 1) for i in range(p + 2)])
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}@{key.hex()}"])
        m = await _client(await _start(nursery, mcfg))
        for p in range(parts):
            await _wait_hwm(m, "wide", p + 2, partition=p)
        for p in range(parts):  # live: a new batch on every partition
            await produce(p, [b"live-%d" % p])
        for p in range(parts):
            await _wait_hwm(m, "wide", p + 3, partition=p)
            assert await _fetch(m, "wide", p) == await _fetch(w, "wide", p)
        accepted = [rec.getMessage() for rec in caplog.records
                    if rec.getMessage().startswith("replication connection ")]
        assert len(accepted) == 1, accepted
        nursery.cancel_scope.cancel()


async def test_a_cancel_while_a_head_is_being_stored_stores_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel (shutdown, the channel's end) that arrives after a verified head was
    prepared for storing and before its worker thread started: trio delivers it before
    it starts the thread. The head is stored anyway (its blocks are readable already)
    and the cancel goes on; before, finishing the unrun job raised StorageError "head ...
    was not stored" over the cancel (a mirror that failed at shutdown, a flaky test)."""
    from broker.mirror import _Sink

    kp = KeyPair.from_seed(bytes([8]) * 32)
    w = PartitionLog.open(tmp_path / "w", kp, fsync=FsyncPolicy.NEVER)
    for i in range(4):
        w.append(build_batch([b"r%d" % i], timestamp_ms=1000))
    w.commit()
    head = w.head
    assert head is not None
    follower = FollowerLog.open_replica(tmp_path / "m", kp.public_key)
    sink = _Sink(follower, lambda: None)
    for i in range(4):
        leaf = w.node(2 * i)
        assert leaf is not None
        sink.put_block(i, w.block(i), leaf)
    sink.put_head(4, head.fork, head.signature, list(head.roots))
    assert follower.high_watermark == 4  # revealed
    prepare = follower.prepare_accept
    with trio.CancelScope() as cs:

        def prepared_then_cancelled(*args: Any) -> Any:
            aj = prepare(*args)
            cs.cancel()  # the cancel lands in the window before the worker thread
            return aj

        monkeypatch.setattr(follower, "prepare_accept", prepared_then_cancelled)
        await sink.store_heads()
        await trio.lowlevel.checkpoint()
    assert cs.cancelled_caught
    assert follower.head is not None and follower.head.length == 4
    assert follower.high_watermark == 4 and follower.log.writable
    follower.close()
    w.close()


async def _echo_server(nursery: trio.Nursery) -> int:
    """A port that sends every byte back: what a probe connected to itself reads."""

    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            async for data in stream:
                await stream.send_all(data)

    listeners = await nursery.start(trio.serve_tcp, echo, 0)
    return int(listeners[0].socket.getsockname()[1])


async def test_a_peer_answering_non_kafka_bytes_is_a_discovery_error() -> None:
    # The cluster's liveness probe catches DiscoveryError (and OSError) and probes again;
    # anything else would end the probe task and take the broker down with it.
    async with trio.open_nursery() as nursery:
        port = await _echo_server(nursery)
        with pytest.raises(DiscoveryError, match="sent no Kafka response"):
            await kafka_request("127.0.0.1", port, 3, 1, "metadata", {"topics": None})
        nursery.cancel_scope.cancel()


async def test_a_peer_announcing_a_huge_answer_is_a_discovery_error() -> None:
    # 2 GiB announced, then bytes for as long as we read: refused at once, not buffered
    async def liar(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(1 << 16)
            await stream.send_all(b"\x7f\xff\xff\xff" + bytes(1 << 16))
            with contextlib.suppress(trio.BrokenResourceError):
                while True:
                    await stream.send_all(bytes(1 << 16))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, liar, 0)
        port = int(listeners[0].socket.getsockname()[1])
        with trio.fail_after(3), pytest.raises(DiscoveryError, match="announced"):
            await kafka_request("127.0.0.1", port, 3, 1, "metadata", {"topics": None})
        nursery.cancel_scope.cancel()


async def test_a_connection_to_itself_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # TCP simultaneous open: a socket bound to P that connects to P is connected to itself,
    # which is what the kernel may hand a probe of a dead peer's port on this host.
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await sock.connect(("127.0.0.1", port))
    assert sock.getsockname() == sock.getpeername()

    async def looped(host: str, p: int) -> trio.SocketStream:
        return trio.SocketStream(sock)

    monkeypatch.setattr(trio, "open_tcp_stream", looped)
    with pytest.raises(ConnectionRefusedError, match="reached itself"):
        await kafka_request("127.0.0.1", port, 3, 1, "metadata", {"topics": None})
    assert sock.fileno() == -1  # closed


async def test_a_mirror_catching_up_logs_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import broker.mirror

    monkeypatch.setattr(broker.mirror, "PROGRESS_INTERVAL_S", 0.0)  # a line per check
    blocks = 600  # > 2 x storage.progress.CHECK_EVERY
    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", 0))
    async with trio.open_nursery() as nursery:
        wport = await _start(nursery, wcfg)
        key, _ = await discover("127.0.0.1", wport)
        w = await _client(wport)
        for i in range(blocks):
            await _produce(w, "big", [b"v%d" % i])
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}@{key.hex()}"])
        with caplog.at_level(logging.INFO, logger="hyperkafka.mirror"):
            mport = await _start(nursery, mcfg)
            m = await _client(mport)
            await _wait_hwm(m, "big", blocks)
            await _produce(w, "big", [b"live"])  # live afterwards: no more progress lines
            await _wait_hwm(m, "big", blocks + 1)
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "big-0: catching up: " in r.getMessage()]
    assert len(lines) >= 2, lines
    assert f"/{blocks} blocks (" in lines[0] and "blocks/s" in lines[0]
    assert lines[-1].startswith(str(tmp_path / "m")) and f"{blocks}/{blocks} blocks (100%)" in lines[-1]


async def test_a_mirror_follows_config_changes_and_new_partitions(tmp_path: Path) -> None:
    """IncrementalAlterConfigs and CreatePartitions on the writer, made while the mirror
    runs: its DescribeConfigs shows the new value (and its logs apply it), its Metadata
    the new partitions, and it serves their records byte-exact; after a restart too."""
    from broker.tests.test_admin_apis import describe_topic_configs, incremental

    wcfg = BrokerConfig(data_dir=tmp_path / "w", listen_port=0, shutdown_grace_s=2,
                        replication_listen=("127.0.0.1", 0))

    async def partitions(c: RawClient) -> int:
        md = await c.call("metadata", 12, {"topics": [{"name": "grows", "topic_id": None}],
                                           "allow_auto_topic_creation": False,
                                           "include_topic_authorized_operations": False})
        return len(md.topics[0].partitions)

    async with trio.open_nursery() as nursery:
        wport = await _start(nursery, wcfg)
        key, _ = await discover("127.0.0.1", wport)
        w = await _client(wport)
        await _produce(w, "grows", [b"a", b"b"])
        mcfg = BrokerConfig(data_dir=tmp_path / "m", listen_port=0, shutdown_grace_s=2,
                            auto_create_topics=False, mirrors=[f"127.0.0.1:{wport}@{key.hex()}"])
        async with trio.open_nursery() as mirror_nursery:
            m = await _client(await _start(mirror_nursery, mcfg))
            await _wait_hwm(m, "grows", 2)
            assert (await incremental(w, "grows", [("segment.bytes", 0, "1048576")])).error_code == 0
            r = await w.call("create_partitions", 3, {"topics": [{"name": "grows", "count": 3, "assignments": None}],
                                                      "timeout": 5000, "validate_only": False})
            assert r.results[0].error_code == 0, r
            batch = bytes(build_batch([b"p2-a", b"p2-b", b"p2-c"], timestamp_ms=1_700_000_000_000))
            r = await w.call("produce", 8, {"acks": -1, "timeout": 5000, "transactional_id": None, "topic_data": [
                {"name": "grows", "partition_data": [{"index": 2, "records": batch}]}]})
            assert r.responses[0].partition_responses[0].error_code == 0
            with trio.fail_after(20):
                while await partitions(m) != 3:  # noqa: ASYNC110 (another node's state: polled)
                    await trio.sleep(0.05)
            await _wait_hwm(m, "grows", 3, partition=2)
            assert await _fetch(m, "grows", 2) == await _fetch(w, "grows", 2)
            assert await _hwm(m, "grows", 1) == (0, 0)
            configs = await describe_topic_configs(m, "grows")
            assert configs["segment.bytes"] == ("1048576", 1)
            mirror_nursery.cancel_scope.cancel()
        # restarted: the grown topic and its configs are served from the local copy
        m = await _client(await _start(nursery, mcfg))
        assert await partitions(m) == 3
        assert (await describe_topic_configs(m, "grows"))["segment.bytes"] == ("1048576", 1)
        assert await _fetch(m, "grows", 2) == await _fetch(w, "grows", 2)
        nursery.cancel_scope.cancel()


async def test_a_connection_lost_while_being_cancelled_is_the_cancellation() -> None:
    """A shutdown cancels the mirror while the writer's end of the connection closes: a
    channel task fails with BrokenResourceError as the others are cancelled. The group of
    both must come out as the cancellation (absorbed by its scope), not escape the mirror."""
    from broker.mirror import _single_error

    with trio.CancelScope() as scope, _single_error():
        async with trio.open_nursery() as nursery:

            async def breaks() -> None:
                scope.cancel()
                raise trio.BrokenResourceError("replication connection lost")

            nursery.start_soon(breaks)
            await trio.sleep_forever()
    assert scope.cancelled_caught

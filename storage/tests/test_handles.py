"""The file budget: partition logs park their files when idle and reopen them on use."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys

import pytest
from storage_testutil import KEYPAIR, make_batch

from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.errors import StorageError
from storage.fs import FaultyFileSystem
from storage.handles import MISC_RESERVE, FdBudget, HandleCache
from storage.store import Store


def fds_under(root: os.PathLike[str] | str) -> int:
    """Descriptors of this process open on files below `root`: the whole process's count
    also moves with whatever else the test runner closes meanwhile (sockets and files of
    earlier tests, collected late), which made equalities on it flaky."""
    prefix = os.path.realpath(root) + os.sep
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        # (one closed since the listing, the listing's own descriptor among them, is skipped)
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
    return n


def open_fds(fs: FaultyFileSystem) -> int:
    return len(fs._path_of)


def test_more_partitions_than_the_budget_all_write_read_and_fsync(tmp_path):
    """24 partitions on a budget of 3 open at once: every one is written, read and fsynced
    through descriptors reopened after it was parked, and a power loss keeps it all."""
    fs = FaultyFileSystem()
    cache = HandleCache(12)  # head, tree, .log, .bidx: three partitions at once
    paths = [tmp_path / f"p{i}" for i in range(24)]
    # `interval` with a long interval: appends are published without an fsync, the log
    # is parked with unsynced data, and the forced sync later runs on new descriptors.
    cfg = LogConfig(flush_interval_ms=3_600_000)
    logs = []
    for p in paths:
        lg = PartitionLog.open(p, KEYPAIR, fsync=FsyncPolicy.INTERVAL, config=cfg, fs=fs)
        lg.attach_handles(cache)
        logs.append(lg)
        assert open_fds(fs) <= cache.budget
    for rnd in range(3):
        for i, lg in enumerate(logs):
            lg.append(make_batch(2, seed=rnd * 100 + i))
            lg.commit()
            assert open_fds(fs) <= cache.budget
    assert cache.parks > 0
    assert sum(lg.parked for lg in logs) >= len(logs) - 3
    for i, lg in enumerate(logs):
        data = lg.read_bytes(0, 1 << 20)
        assert len(data) == 3 * len(make_batch(2)), i
        assert open_fds(fs) <= cache.budget
    for lg in logs:
        lg.commit(force_sync=True)  # reopens, fsyncs the data written through old fds
        assert open_fds(fs) <= cache.budget
    fs.crash("drop")  # everything not fsynced is gone
    for i, p in enumerate(paths):
        lg = PartitionLog.open(p, KEYPAIR, fsync=FsyncPolicy.INTERVAL, fs=fs)
        assert lg.high_watermark == 6, i
        assert len(lg.read_bytes(0, 1 << 20)) == 3 * len(make_batch(2))
        lg.close()


def test_a_busy_log_is_never_parked(tmp_path):
    fs = FaultyFileSystem()
    cache = HandleCache(10)

    def new(name):
        lg = PartitionLog.open(tmp_path / name, KEYPAIR, fsync=FsyncPolicy.ALWAYS, fs=fs)
        lg.attach_handles(cache)
        lg.append(make_batch(1))
        return lg

    a = new("a")  # pending: the next commit job reads it by descriptor
    b = new("b")
    b.commit()
    c = new("c")
    c.commit()
    assert not a.parked and b.parked  # b was the idle one
    job = a.prepare_commit(force_sync=True)
    assert job is not None
    b.read_bytes(0, 100)  # needs room: c is parked, never a (its job is in flight)
    assert not a.parked and c.parked
    job.run()
    a.publish(job)
    c.pin()  # a, least recently used and idle now, makes room
    assert a.parked
    a.read_bytes(0, 100)  # pinned c stays, idle b goes
    assert not c.parked and b.parked
    c.unpin()
    b.read_bytes(0, 100)
    assert c.parked
    b.append(make_batch(1))
    with pytest.raises(StorageError, match="in use"):
        b.park()  # pending data: its descriptors are named by the next job
    assert open_fds(fs) <= cache.budget
    for lg in (a, b, c):
        lg.close()
    assert cache.total == 0 and open_fds(fs) == 0


def test_a_file_removed_while_parked_is_an_error_not_an_empty_file(tmp_path):
    cache = HandleCache(4)
    a = PartitionLog.open(tmp_path / "a", KEYPAIR, fsync=FsyncPolicy.ALWAYS)
    a.attach_handles(cache)
    a.append(make_batch(1))
    a.commit()
    b = PartitionLog.open(tmp_path / "b", KEYPAIR)
    b.attach_handles(cache)
    assert a.parked
    log_file = next(n for n in os.listdir(tmp_path / "a") if n.endswith(".log"))
    os.unlink(tmp_path / "a" / log_file)
    with pytest.raises(StorageError, match="cannot reopen"):
        a.read_bytes(0, 100)
    assert not (tmp_path / "a" / log_file).exists()
    b.close()


def test_store_keeps_partition_files_within_the_budget(tmp_path):
    cache = HandleCache(40)
    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS, handles=cache)
    store.create_topic("t", 50, {})
    before = fds_under(tmp_path)
    for p in range(50):
        lg = store.log("t", p)
        lg.append(make_batch(1, seed=p))
        lg.commit()
    assert fds_under(tmp_path) - before <= cache.budget
    for p in range(50):
        assert store.log("t", p).read_bytes(0, 1 << 20)
    store.close()
    assert cache.total == 0


def test_prepared_partitions_hold_no_descriptors_until_used(tmp_path):
    import uuid

    cache = HandleCache(40)
    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS, handles=cache)
    before = fds_under(tmp_path)
    tid = uuid.uuid4()
    logs = store.prepare_partitions("big", tid, 200, LogConfig())
    assert fds_under(tmp_path) == before
    store.create_topic("big", 200, {}, topic_id=tid)
    store.adopt("big", logs)
    lg = store.log("big", 199)
    lg.append(make_batch(1))
    lg.commit()
    assert store.log("big", 199).high_watermark == 1
    store.close()
    reopened = Store.open(tmp_path, handles=cache)
    assert reopened.log("big", 199).high_watermark == 1
    reopened.close()


def test_discard_removes_prepared_archives(tmp_path):
    import uuid

    store = Store.open(tmp_path)
    logs = store.prepare_partitions("gone", uuid.uuid4(), 3, LogConfig())
    store.discard("gone", logs)
    assert not any(n.startswith("gone-") for n in os.listdir(tmp_path))
    store.close()


def test_budget_split():
    b = FdBudget.split(256, max_connections=10_000)
    assert b.sockets + b.partition_files + MISC_RESERVE <= 256
    assert b.partition_files >= 48 and b.sockets >= 48
    big = FdBudget.split(1 << 20, max_connections=10_000)
    assert big.sockets == 10_000 + MISC_RESERVE
    assert big.partition_files == (1 << 20) - MISC_RESERVE - big.sockets


def test_budget_raises_the_soft_limit_to_the_hard_limit():
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"hard open-file limit {hard} is too low to test raising")
    code = (
        "import resource\n"
        "from storage.handles import FdBudget\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512))\n"
        "b = FdBudget.of_process(10_000)\n"
        "print(b.limit, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["512", "512"]


def test_a_retention_check_with_nothing_to_drop_leaves_a_parked_log_parked(tmp_path):
    cache = HandleCache(4)
    a = PartitionLog.open(tmp_path / "a", KEYPAIR, fsync=FsyncPolicy.ALWAYS)
    a.attach_handles(cache)
    a.append(make_batch(1))
    a.commit()
    b = PartitionLog.open(tmp_path / "b", KEYPAIR)
    b.attach_handles(cache)
    assert a.parked
    assert a.apply_retention(now_ms=2_000) == 0
    assert a.drop_segments_below(0) == 0
    assert a.parked and not b.parked
    a.close()
    b.close()


def test_preopen_recovers_every_partition_parked(tmp_path):
    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS)
    store.create_topic("t", 40, {})
    for p in range(40):
        lg = store.log("t", p)
        lg.append(make_batch(1, seed=p))
        lg.commit()
    store.close()
    cache = HandleCache(12)
    store = Store.open(tmp_path, handles=cache)
    before = fds_under(tmp_path)
    assert store.preopen([("t", p, LogConfig()) for p in range(40)]) == 40
    assert fds_under(tmp_path) == before  # all parked
    assert all(store.log("t", p).high_watermark == 1 for p in range(40))
    assert all(
        len(store.log("t", p).read_bytes(0, 1 << 20)) == len(make_batch(1)) for p in range(40)
    )
    assert fds_under(tmp_path) - before <= cache.budget
    store.close()

"""How a commit job reads back and hashes what was appended: FileSystem.read_view (page-cache
maps for large spans, pread for small ones) and leaf hashing shared with helper threads."""

from __future__ import annotations

import os

import pytest
from storage_testutil import KEYPAIR, batch_of_size, tree_hash_of

from storage import FsyncPolicy, LogConfig, PartitionLog, hashing
from storage import log as log_mod
from storage.fs import MAP_MIN, FaultyFileSystem, OsFileSystem
from storage.hypercore import leaf_hash


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(3 * MAP_MIN + 12345)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 70001, MAP_MIN + 3])
@pytest.mark.parametrize("size", [1, 1000, MAP_MIN - 1, MAP_MIN, MAP_MIN + 4097])
def test_read_view_returns_the_file_bytes(data_file, offset, size):
    fd, data = data_file
    with OsFileSystem().read_view(fd, size, offset) as view:
        assert bytes(view) == data[offset : offset + size]
        assert bytes(view[5:9]) == data[offset + 5 : offset + min(9, size)]  # slice, dropped


def test_read_view_is_short_at_end_of_file_and_released_after(data_file):
    fd, data = data_file
    with OsFileSystem().read_view(fd, 2 * MAP_MIN, len(data) - 100) as view:
        assert bytes(view) == data[-100:]
    with pytest.raises(ValueError):
        bytes(view)  # the map is gone with the block
    with OsFileSystem().read_view(fd, 2 * MAP_MIN, len(data) + 5) as view:
        assert len(view) == 0


def test_read_view_keeps_a_slice_held_past_the_block_valid(data_file):
    fd, data = data_file
    with OsFileSystem().read_view(fd, MAP_MIN, 0) as view:
        kept = view[10:20]
    # not unmapped under a live slice (no BufferError either): it goes when the slice goes
    assert bytes(kept) == data[10:20]
    kept.release()


def _items(sizes):
    out, pos = [], 0
    for s in sizes:
        out.append((pos, s))
        pos += s
    return out, pos


def _hash_all(view, items, helpers):
    """hash_leaves' leaves as consumed, checking the ranges come in order and complete."""
    got: list[bytes] = []

    def consume(leaves, lo, hi):
        assert lo == len(got) and hi > lo
        assert all(len(leaf) == 32 for leaf in leaves[lo:hi])
        got.extend(leaves[lo:hi])

    hashing.hash_leaves(view, items, consume, helpers)
    return got


@pytest.mark.parametrize("helpers", [0, 1, 3])
@pytest.mark.parametrize("sizes", [
    [16384] * 200,  # 3.1 MiB: parallel, 16 batches per chunk
    [1 << 20] * 3 + [5000, 70000],  # a chunk per batch, uneven
    [1024] * 600,  # small batches: one thread
])
def test_hash_leaves_matches_one_by_one(sizes, helpers):
    items, total = _items(sizes)
    view = memoryview(os.urandom(total))
    expect = [leaf_hash(view[o : o + s]) for o, s in items]
    assert _hash_all(view, items, helpers) == expect


@pytest.mark.parametrize("helpers", [0, 1])
def test_hash_leaves_reports_a_hashing_failure(monkeypatch, helpers):
    items, total = _items([16384] * 100)
    calls = []
    real = hashing.compute_leaf

    def flaky(data, size):
        calls.append(size)
        if len(calls) == 40:
            raise OSError("boom")
        return real(data, size)

    monkeypatch.setattr(hashing, "compute_leaf", flaky)
    with pytest.raises(OSError, match="boom"):
        _hash_all(memoryview(bytes(total)), items, helpers)


def test_idle_helpers_follow_the_load(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(hashing, "LEAF_HELPERS", 1)
    for load, want in ((0.2, 1), (1.2, 0), (7.5, 0)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert hashing.idle_helpers() == want


@pytest.mark.parametrize("helpers", [0, 1])
@pytest.mark.parametrize("fs_cls", [OsFileSystem, FaultyFileSystem])
def test_large_commits_across_segments_sign_the_tree_of_what_was_written(tmp_path, fs_cls,
                                                                         helpers, monkeypatch):
    monkeypatch.setattr(hashing, "idle_helpers", lambda: helpers)
    # 3 MiB of 16 KiB batches per commit (parallel hashing of a mapped span), rolling a
    # segment every 1 MiB so one job reads back spans of several segments
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.INTERVAL,
                           config=LogConfig(segment_bytes=1 << 20), fs=fs_cls())
    written = []
    for round_ in range(3):
        for i in range(192):
            b = batch_of_size(16384, ts=round_ * 1000 + i)
            lg.append(b)
            written.append(bytes(b))
        head = lg.commit()
        assert head is not None and head.length == len(written)
        assert head.tree_hash == tree_hash_of(written)
    lg.close()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.INTERVAL,
                           config=LogConfig(segment_bytes=1 << 20))
    assert lg.head is not None and lg.head.tree_hash == tree_hash_of(written)
    assert len(lg._segments) > 3
    lg.close()


needs_native = pytest.mark.skipif(not hashing.NATIVE_LEAVES, reason="storage._native not built")


def _count_native_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = hashing.leaf_hashes

    def counting(blocks):
        calls.append(len(blocks))
        return real(blocks)

    monkeypatch.setattr(hashing, "leaf_hashes", counting)
    return calls


@needs_native
def test_one_native_call_hashes_every_job_of_a_round(tmp_path, monkeypatch):
    """hash_jobs: the leaves of three partitions' jobs (one of them over two segments) in
    one call, and each job signs the tree of exactly what it wrote."""
    logs = [PartitionLog.open(tmp_path / str(i), KEYPAIR, fsync=FsyncPolicy.NEVER,
                              config=LogConfig(segment_bytes=40_000)) for i in range(3)]
    written: list[list[bytes]] = [[], [], []]
    for i, lg in enumerate(logs):
        for n in range(2 + 2 * i):
            b = batch_of_size(5000 + 7000 * i + n)
            lg.append(b)
            written[i].append(bytes(b))
    assert len(logs[2]._segments) >= 2  # its job reads back spans of several segments
    calls = _count_native_calls(monkeypatch)
    jobs = [lg.prepare_commit(force_sync=True) for lg in logs]
    assert all(j is not None and j.needs_leaves() for j in jobs)
    log_mod.hash_jobs(jobs)
    assert calls == [sum(len(w) for w in written)]
    for job, w in zip(jobs, written, strict=True):
        assert job.leaves == [leaf_hash(b) for b in w]
        assert not job.waits_for_fsync() or job.sync_fds
        job.run()
    assert calls == [sum(len(w) for w in written)]  # run() hashed nothing again
    for lg, job, w in zip(logs, jobs, written, strict=True):
        assert lg.publish(job).tree_hash == tree_hash_of(w)
        lg.close()


@needs_native
def test_a_job_that_cannot_read_back_fails_alone(tmp_path, monkeypatch):
    fs = FaultyFileSystem()
    logs = [PartitionLog.open(tmp_path / str(i), KEYPAIR, fsync=FsyncPolicy.NEVER, fs=fs)
            for i in range(2)]
    for lg in logs:
        lg.append(batch_of_size(9000))
    jobs = [lg.prepare_commit(force_sync=True) for lg in logs]
    bad_fd = jobs[0].pending[0][0]
    real = fs.read_view

    def read_view(fd, size, offset):
        if fd == bad_fd:
            raise OSError(5, "injected read error")
        return real(fd, size, offset)

    monkeypatch.setattr(fs, "read_view", read_view)
    log_mod.hash_jobs(jobs)
    assert jobs[0].leaves is None and jobs[1].leaves is not None
    with pytest.raises(log_mod.StorageError):
        jobs[0].run()
    jobs[1].run()
    logs[1].publish(jobs[1])
    logs[1].close()

"""INTERVAL writers fsync in a background thread beside later commits (FORMAT.md sec. 6).

What must hold: heads keep being published while the sync runs; the first commit after
it finished records its derived length and fsyncs the head; a failed background fsync
poisons the log; a power loss before the sync finished recovers a verified prefix under a
new fork (as for any interval writer), and after it finished keeps everything it covered.
"""

from __future__ import annotations

import os

import pytest
from storage_testutil import KEYPAIR, make_batch, split_batches, tree_hash_of

import storage.format as fmt_mod
import storage.log as log_mod
from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.errors import StorageError
from storage.fs import FaultyFileSystem
from storage.verify import verify_partition

EVERY_COMMIT = LogConfig(flush_interval_ms=0)  # every prepare_commit finds a sync due


def open_log(path, fs):
    return PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.INTERVAL, fs=fs,
                             config=EVERY_COMMIT)


def fill(lg, n, start=0):
    out = []
    for i in range(start, start + n):
        b = make_batch(2, value_size=40, seed=i, ts=i)
        lg.append(b)
        out.append(bytes(b))
    return out


def served(lg):
    out, off = [], lg.log_start_offset
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 30)
        out += split_batches(r.read())
        off = r.end_offset
    return out


def driven_commit(lg):
    """What the broker does: prepare, run (in any thread), publish."""
    job = lg.prepare_commit()
    assert job is not None
    job.run()
    return job, lg.publish(job)


def test_sync_runs_beside_commits_and_the_next_head_records_it(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    first = fill(lg, 3)
    job, head = driven_commit(lg)
    assert job.background and job.sync is not None
    assert head.length == 3 and head.derived_length == 0  # not durable yet
    assert lg.high_watermark == head.next_offset  # published without waiting
    job.sync.wait()
    second = fill(lg, 2, start=3)
    job2, head2 = driven_commit(lg)
    # the sync had finished: this head says so, and was fsynced itself
    assert head2.derived_length == 3 and job2.sync_head
    # the second sync started by job2 may still run; a power loss right now keeps at
    # least what the first sync covered, under a new fork, byte for byte a prefix
    job2.sync.wait()
    fs.crash("drop")
    fmt_mod.BOOT_ID, saved = b"\x77" * 16, fmt_mod.BOOT_ID
    try:
        lg = open_log(tmp_path, fs)
        got = served(lg)
        assert got == (first + second)[: len(got)] and len(got) >= 3
        assert lg.head.tree_hash == tree_hash_of(got)
        lg.close()
        assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    finally:
        fmt_mod.BOOT_ID = saved


def test_power_loss_before_the_background_sync_ran(tmp_path, monkeypatch):
    fs = FaultyFileSystem(3)
    lg = open_log(tmp_path, fs)
    acked = fill(lg, 4)
    lg.commit(force_sync=True)  # durable: this much must survive
    monkeypatch.setattr(log_mod.BackgroundSync, "_run", lambda self: None)  # never syncs
    more = fill(lg, 3, start=4)
    _, head = driven_commit(lg)
    assert head.length == 7
    fs.crash("drop")
    monkeypatch.setattr("storage.format.BOOT_ID", b"\x78" * 16)
    lg = open_log(tmp_path, fs)
    got = served(lg)
    assert got[:4] == acked and got == (acked + more)[: len(got)]
    # heads up to 7 may have been sent: the surviving tree is signed under a new fork
    assert lg.fork == 1
    assert lg.head.tree_hash == tree_hash_of(got)
    lg.close()
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok


def test_failed_background_fsync_poisons_the_log(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    fill(lg, 2)
    fs.fail_fsync = lambda path: path.endswith(".log")
    job, _ = driven_commit(lg)  # interval heads are published before their data is durable
    assert job.sync is not None
    job.sync.wait()
    with pytest.raises(StorageError, match="background fsync failed"):
        lg.prepare_commit()
    with pytest.raises(StorageError):
        fill(lg, 1, start=2)
    fs.fail_fsync = None
    lg._close_fds()


def test_no_second_sync_while_one_runs_and_close_waits(tmp_path, monkeypatch):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    fill(lg, 2)
    job, _ = driven_commit(lg)
    sync = job.sync
    assert sync is not None
    monkeypatch.setattr(sync, "done", lambda: False)  # still writing back
    fill(lg, 1, start=2)
    job2, _ = driven_commit(lg)
    assert not job2.background and job2.sync is None and not job2.sync_fds
    monkeypatch.undo()
    fill(lg, 1, start=3)
    lg.close()  # waits for the sync, then syncs everything and marks the head clean
    assert lg._sync is None
    fs.crash("drop")
    lg = open_log(tmp_path, fs)
    assert len(served(lg)) == 4 and lg.fork == 0
    lg.close()
    assert os.path.exists(tmp_path / "head")


def test_an_idle_log_stops_committing_once_its_data_and_head_are_synced(tmp_path):
    # Regression: the head commit after a finished background sync started another,
    # empty, background sync, so an idle log fsynced its head and started a thread on
    # every commit tick, forever (a third of a core with 1,000 idle partitions).
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    assert lg.quiescent
    fill(lg, 3)
    assert not lg.quiescent
    jobs = 0
    for _ in range(50):
        job = lg.prepare_commit()
        if job is None:
            if lg._sync is None:
                break
            lg._sync.wait()  # let the background sync finish, then look again
            continue
        job.run()
        lg.publish(job)
        jobs += 1
    else:
        pytest.fail("an idle log kept preparing commit jobs")
    assert jobs <= 3  # the data's head, its sync's head record, nothing more
    assert lg.quiescent  # the broker's tick skips it from now on
    assert lg.prepare_commit() is None
    fill(lg, 1, start=3)
    assert not lg.quiescent
    lg.close()
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok

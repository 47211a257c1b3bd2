"""Crash recovery through the filesystem seam: torn writes, lost writes, failed fsyncs."""

from __future__ import annotations

import logging
import os

import pytest
from storage_testutil import KEYPAIR, make_batch, split_batches, tree_hash_of

import storage.log as log_mod
from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.errors import ArchiveDamaged, StorageError
from storage.fs import FaultyFileSystem
from storage.hypercore import verify_head
from storage.verify import verify_partition


def open_log(path, fs, policy=FsyncPolicy.ALWAYS, **kw):
    return PartitionLog.open(path, KEYPAIR, fsync=policy, fs=fs, **kw)


def fill(lg, n, start=0):
    out = []
    for i in range(start, start + n):
        b = make_batch(2, value_size=30, seed=i, ts=i)
        lg.append(b)
        out.append(bytes(b))
    return out


def all_bytes(lg):
    out, off = [], lg.log_start_offset
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 30)
        out += split_batches(r.read())
        off = r.end_offset
    return out


def assert_consistent(lg, expected):
    assert all_bytes(lg) == expected
    head = lg.head
    assert head is not None
    assert head.tree_hash == tree_hash_of(expected)
    assert verify_head(KEYPAIR.public_key, lg.key, head.tree_hash, head.length, head.fork,
                       head.signature)
    assert verify_partition(lg.path, KEYPAIR.public_key).ok


@pytest.mark.parametrize("mode", ["drop", "tear"])
def test_always_keeps_every_acknowledged_batch_after_power_loss(tmp_path, monkeypatch, mode):
    for seed in range(8):
        monkeypatch.setattr("storage.format.BOOT_ID", bytes([seed]) * 16)
        d = tmp_path / f"{mode}{seed}"
        fs = FaultyFileSystem(seed)
        lg = open_log(d, fs)
        acked = fill(lg, 10)
        lg.commit()
        unacked = fill(lg, 5, start=10)  # written, never committed
        fs.crash(mode)
        monkeypatch.setattr("storage.format.BOOT_ID", bytes([seed + 100]) * 16)  # power loss
        lg = open_log(d, fs)
        got = all_bytes(lg)
        assert got[:10] == acked
        assert got[10:] == unacked[: len(got) - 10]  # a prefix of the tail may survive
        assert lg.fork == 0
        assert_consistent(lg, got)
        lg.close()


def test_torn_tail_is_cut(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    acked = fill(lg, 3)
    lg.commit()
    lg.close()
    seg = tmp_path / "00000000000000000000.log"
    extra = make_batch(5, seed=99)
    with open(seg, "ab") as f:  # half a batch at the end, as a crash mid-write leaves it
        f.write(bytes(extra[: len(extra) // 2]))
    lg = open_log(tmp_path, fs)
    assert all_bytes(lg) == acked and lg.log_end_offset == 6
    assert os.path.getsize(seg) == sum(map(len, acked))
    more = fill(lg, 2, start=3)
    lg.commit()
    assert_consistent(lg, acked + more)
    lg.close()


def test_lost_index_is_rebuilt_from_the_log(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    acked = fill(lg, 6)
    lg.commit()
    lg.close()
    idx = tmp_path / "00000000000000000000.bidx"
    with open(idx, "r+b") as f:
        f.truncate(64 + 2 * 64)  # only two entries left
    lg = open_log(tmp_path, fs)
    assert_consistent(lg, acked)
    lg.close()
    os.unlink(idx)
    lg = open_log(tmp_path, fs)
    assert_consistent(lg, acked)
    lg.close()


def test_torn_head_slot_falls_back_to_the_previous_head(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    first = fill(lg, 2)
    lg.commit()
    second = fill(lg, 2, start=2)
    lg.commit()
    seq = lg.head.seq
    fs.crash("keep")
    with open(tmp_path / "head", "r+b") as f:  # tear the newest slot
        f.seek((seq % 2) * log_mod.SLOT_SIZE + 100)
        f.write(b"\xff" * 10)
    lg = open_log(tmp_path, fs)
    # the older head is used; the two later batches are intact in the log, so they are
    # re-signed (same tree as before: no equivocation)
    assert lg.head.length == 4 and lg.fork == 0
    assert_consistent(lg, first + second)
    lg.close()


def test_failed_fsync_poisons_the_log_and_recovery_keeps_acked_data(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs)
    acked = fill(lg, 4)
    lg.commit()
    fill(lg, 2, start=4)
    fs.fail_fsync = lambda path: path.endswith(".log")
    with pytest.raises(StorageError):
        lg.commit()
    assert lg.high_watermark == 8  # nothing new acknowledged
    with pytest.raises(StorageError):
        lg.append(make_batch())
    with pytest.raises(StorageError):
        lg.prepare_commit()
    fs.fail_fsync = None
    fs.crash("drop")
    lg = open_log(tmp_path, fs)
    got = all_bytes(lg)
    assert got[:4] == acked and lg.head.length >= 4
    assert_consistent(lg, got)
    lg.close()


def test_short_writes_are_completed(tmp_path):
    fs = FaultyFileSystem()
    fs.short_writes = True
    lg = open_log(tmp_path, fs)
    batches = fill(lg, 5)
    lg.commit()
    lg.close()
    fs.short_writes = False
    lg = open_log(tmp_path, fs)
    assert_consistent(lg, batches)
    lg.close()


def test_data_shorter_than_signed_head_same_boot_is_damage(tmp_path, caplog):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs, FsyncPolicy.ALWAYS)
    batches = fill(lg, 6)
    lg.commit()
    lg.close()
    seg = tmp_path / "00000000000000000000.log"
    keep = sum(map(len, batches[:3]))
    with open(seg, "r+b") as f:
        f.truncate(keep)
    with caplog.at_level(logging.ERROR):
        lg = open_log(tmp_path, fs)
    assert lg.damage is not None and lg.damage.offset == 6
    with pytest.raises(ArchiveDamaged):
        lg.append(make_batch())
    # what is there and verifies against the signed head is still served
    assert all_bytes(lg) == batches[:3]
    assert lg.head.length == 6  # the signed head is kept, never replaced by a shorter tree
    lg.close()
    assert not verify_partition(str(tmp_path), KEYPAIR.public_key).ok


@pytest.mark.parametrize("policy", [FsyncPolicy.INTERVAL, FsyncPolicy.NEVER])
def test_power_loss_of_relaxed_writer_truncates_with_fork(tmp_path, monkeypatch, caplog, policy):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs, policy, config=LogConfig(flush_interval_ms=3_600_000))
    durable = fill(lg, 3)
    lg.commit(force_sync=True)
    more = fill(lg, 4, start=3)
    lg.commit()  # signed and published from page cache only
    assert lg.high_watermark == 14
    fs.crash("drop")
    monkeypatch.setattr("storage.format.BOOT_ID", b"\x42" * 16)  # the machine rebooted
    with caplog.at_level(logging.WARNING):
        lg = open_log(tmp_path, fs, policy)
    assert "fork 0 -> 1" in caplog.text
    assert lg.fork == 1 and lg.head.fork == 1
    got = all_bytes(lg)
    assert got == durable  # what was lost is gone; the rest is re-signed under fork 1
    assert_consistent(lg, got)
    again = fill(lg, 2, start=50)
    lg.commit()
    assert_consistent(lg, got + again)
    lg.close()
    del more


def test_process_crash_of_relaxed_writer_keeps_everything_same_fork(tmp_path):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs, FsyncPolicy.NEVER)
    acked = fill(lg, 5)
    lg.commit()
    tail = fill(lg, 2, start=5)
    fs.crash("keep")
    lg = open_log(tmp_path, fs, FsyncPolicy.NEVER)
    assert lg.fork == 0
    assert_consistent(lg, acked + tail)
    lg.close()


def test_reopen_after_reboot_with_always_rechecks_only_past_the_derived_checkpoint(
        tmp_path, monkeypatch):
    fs = FaultyFileSystem()
    lg = open_log(tmp_path, fs, FsyncPolicy.ALWAYS, config=LogConfig(flush_interval_ms=3_600_000))
    batches = fill(lg, 4)
    lg.commit(force_sync=True)  # index and tree synced at 4
    batches += fill(lg, 4, start=4)
    lg.commit()  # .log and head synced, .bidx and tree not
    fs.crash("drop")
    monkeypatch.setattr("storage.format.BOOT_ID", b"\x43" * 16)
    lg = open_log(tmp_path, fs, FsyncPolicy.ALWAYS)
    assert lg.fork == 0 and lg.damage is None
    assert_consistent(lg, batches)
    lg.close()


@pytest.mark.parametrize("mode", ["keep", "drop", "tear"])
@pytest.mark.parametrize("policy", [FsyncPolicy.ALWAYS, FsyncPolicy.NEVER])
@pytest.mark.parametrize("after", [0, 1, 3])
def test_delete_records_to_the_end_of_the_active_segment_then_crashes(tmp_path, mode, policy,
                                                                      after):
    """DeleteRecords up to the high watermark leaves the active segment wholly below the
    log start; appends then roll a new one. Reopened after a crash, that segment is not a
    leftover of retention (its leaves are the first the head keeps): the leaves after it
    keep their numbers, and the log opens, serves, takes appends and verifies."""
    fs = FaultyFileSystem()
    config = LogConfig(segment_bytes=300, retention_ms=-1)  # two batches a segment
    lg = open_log(tmp_path, fs, policy, config=config)
    fill(lg, 6)
    lg.commit()
    hwm = lg.high_watermark
    assert lg.delete_records_below(hwm) == hwm
    tail = fill(lg, after, start=6)
    lg.commit(force_sync=True)
    fs.crash(mode)
    lg = open_log(tmp_path, fs, policy, config=config)
    assert lg.log_start_offset == hwm
    got = all_bytes(lg)
    assert got == tail[: len(got)]
    assert policy is not FsyncPolicy.ALWAYS or got == tail
    more = fill(lg, 2, start=20)
    lg.commit(force_sync=True)
    fs.crash(mode)
    lg = open_log(tmp_path, fs, policy, config=config)
    assert all_bytes(lg)[-2:] == more
    assert verify_partition(lg.path, KEYPAIR.public_key).ok
    lg.close()

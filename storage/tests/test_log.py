"""PartitionLog: append, group commit, reads, timestamps, segments, reopen."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
from storage_testutil import KEYPAIR, batch_of_size, crc_ok, make_batch, split_batches, tree_hash_of

from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.errors import CorruptBatch, LogClosed, OffsetOutOfRange, StorageError
from storage.hypercore import archive_key, verify_head


def open_log(path, **kw):
    kw.setdefault("fsync", FsyncPolicy.ALWAYS)
    return PartitionLog.open(path, KEYPAIR, **kw)


def test_append_assigns_offsets_in_place_and_is_invisible_until_commit(tmp_path):
    lg = open_log(tmp_path)
    b = make_batch(3)
    assert lg.append(b, leader_epoch=7) == (0, 2)
    assert struct.unpack_from(">qii", b, 0)[::2] == (0, 7)
    assert crc_ok(bytes(b))  # baseOffset and epoch are outside the CRC
    assert lg.append(make_batch(2)) == (3, 4)
    assert lg.log_end_offset == 5
    assert lg.high_watermark == 0
    assert lg.read(0, 1 << 20).size == 0
    with pytest.raises(OffsetOutOfRange):
        lg.read(1, 100)
    head = lg.commit()
    assert head is not None and head.length == 2 and head.next_offset == 5
    assert lg.high_watermark == 5
    assert verify_head(KEYPAIR.public_key, archive_key(KEYPAIR.public_key), head.tree_hash,
                       2, 0, head.signature)
    assert lg.read_bytes(0, 1 << 20)[: len(b)] == bytes(b)
    lg.close()


@pytest.mark.parametrize("end", ["close", "discard"])
def test_a_read_of_a_closed_log_says_so(tmp_path, end):
    # A request may still hold a log its partition replaced (a leader stepping down
    # reopens its archive as a replica): the read is refused with a typed error, not an
    # IndexError from the emptied segment list.
    lg = open_log(tmp_path)
    lg.append(make_batch(3))
    lg.commit()
    getattr(lg, end)()
    with pytest.raises(LogClosed):
        lg.read(0, 1 << 20)
    with pytest.raises(LogClosed):
        lg.read(1, 1 << 20, end=3)


def test_append_rejects_bad_framing(tmp_path):
    lg = open_log(tmp_path)
    b = make_batch()
    with pytest.raises(CorruptBatch):
        lg.append(b + b"x")
    b2 = make_batch()
    b2[16] = 1
    with pytest.raises(CorruptBatch):
        lg.append(b2)
    with pytest.raises(CorruptBatch):
        lg.append(bytearray(10))
    assert lg.log_end_offset == 0
    lg.close()


def test_read_ranges(tmp_path):
    lg = open_log(tmp_path)
    batches = []
    for i in range(10):
        b = make_batch(3, value_size=20, seed=i)
        lg.append(b)
        batches.append(bytes(b))
    lg.commit()
    size = len(batches[0])
    # mid-batch offset -> the batch containing it
    r = lg.read(4, size)
    assert (r.base_offset, r.end_offset, r.size) == (3, 6, size)
    assert r.read() == batches[1]
    # at least one whole batch even when max_bytes is smaller
    assert lg.read(0, 1).size == size
    # max_bytes cuts at whole batches
    r = lg.read(0, 2 * size + size // 2)
    assert split_batches(r.read()) == batches[:2]
    assert lg.read(0, 1 << 30).read() == b"".join(batches)
    # at the high watermark: empty; above or below the log: out of range
    assert lg.read(30, 100).size == 0
    with pytest.raises(OffsetOutOfRange):
        lg.read(31, 100)
    with pytest.raises(OffsetOutOfRange):
        lg.read(-1, 100)
    # never past the high watermark
    lg.append(make_batch(1))
    assert lg.read(0, 1 << 30).end_offset == 30
    lg.close()


def test_filerange_is_sendfile_ready(tmp_path):
    lg = open_log(tmp_path)
    for i in range(5):
        lg.append(make_batch(2, seed=i))
    lg.commit()
    r = lg.read(2, 1 << 20)
    a, b = socket.socketpair()
    with a, b:
        sent = os.sendfile(a.fileno(), r.fd, r.position, r.size)
        assert sent == r.size
        got = b""
        while len(got) < r.size:
            got += b.recv(65536)
    assert got == r.read()
    lg.close()


def test_segments_roll_by_bytes_and_reads_stay_in_one_segment(tmp_path):
    lg = open_log(tmp_path, config=LogConfig(segment_bytes=1000))
    batches = []
    for i in range(30):
        b = batch_of_size(300, ts=i)
        lg.append(b)
        batches.append(bytes(b))
    lg.commit()
    logs = sorted(n for n in os.listdir(tmp_path) if n.endswith(".log"))
    assert len(logs) == 10 and logs[1] == "00000000000000000003.log"
    r = lg.read(0, 1 << 20)
    assert (r.base_offset, r.end_offset) == (0, 3)
    got, off = [], 0
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 20)
        got += split_batches(r.read())
        off = r.end_offset
    assert got == batches
    lg.close()


def test_segments_roll_by_time(tmp_path):
    lg = open_log(tmp_path, config=LogConfig(segment_ms=0))
    for i in range(3):
        lg.append(make_batch(seed=i))
    lg.commit()
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".log")]) == 3
    lg.close()


def test_timestamps_and_headers(tmp_path):
    lg = open_log(tmp_path)
    stamps = [100, 300, 200, 300, 50]
    for i, t in enumerate(stamps):
        lg.append(make_batch(2, ts=t, seed=i))
    assert lg.batch_for_timestamp(150) is None  # nothing committed yet
    lg.commit()
    b = lg.batch_for_timestamp(150)
    assert b is not None and struct.unpack_from(">q", b, 0)[0] == 2
    assert lg.batch_for_timestamp(301) is None
    m = lg.batch_with_max_timestamp()
    assert m is not None and struct.unpack_from(">q", m, 0)[0] == 2  # first of the max
    heads = list(lg.batch_headers(5))
    assert [struct.unpack_from(">q", h, 0)[0] for h in heads] == [4, 6, 8]
    assert all(len(h) == 61 for h in heads)
    lg.close()


def test_three_step_commit_with_appends_during_run(tmp_path):
    lg = open_log(tmp_path, fsync=FsyncPolicy.ALWAYS, config=LogConfig(segment_bytes=2000))
    all_batches = []
    for i in range(5):
        b = batch_of_size(500, ts=i)
        lg.append(b)
        all_batches.append(bytes(b))
    job = lg.prepare_commit()
    assert job is not None
    with pytest.raises(StorageError):
        lg.prepare_commit()  # one job in flight at a time
    t = threading.Thread(target=job.run)
    t.start()
    for i in range(20):  # appends (and segment rolls) continue meanwhile
        b = batch_of_size(500, ts=100 + i)
        lg.append(b)
        all_batches.append(bytes(b))
    t.join()
    head = lg.publish(job)
    assert head.length == 5 and lg.high_watermark == 5
    assert lg.read(0, 1 << 30).end_offset == 4 or lg.read(0, 1 << 30).end_offset <= 5
    head2 = lg.commit()
    assert head2 is not None and head2.length == 25
    assert head2.tree_hash == tree_hash_of(all_batches)
    lg.close()
    lg = open_log(tmp_path, config=LogConfig(segment_bytes=2000))
    assert lg.high_watermark == 25 and lg.head is not None and lg.head.length == 25
    got, off = [], 0
    while off < 25:
        r = lg.read(off, 1 << 20)
        got += split_batches(r.read())
        off = r.end_offset
    assert got == all_batches
    lg.close()


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_reopen_continues_the_same_tree(tmp_path, policy):
    lg = open_log(tmp_path, fsync=policy)
    batches = []
    for i in range(7):
        b = make_batch(2, seed=i)
        lg.append(b)
        batches.append(bytes(b))
    lg.commit()
    lg.close()
    lg = open_log(tmp_path, fsync=policy)
    assert (lg.log_end_offset, lg.high_watermark, lg.length, lg.fork) == (14, 14, 7, 0)
    for i in range(7, 12):
        b = make_batch(2, seed=i)
        lg.append(b)
        batches.append(bytes(b))
    head = lg.commit()
    assert head is not None and head.tree_hash == tree_hash_of(batches)
    assert split_batches(lg.read_bytes(0, 1 << 30)) == batches
    lg.close()


def test_interval_policy_syncs_only_when_due(tmp_path):
    from storage.fs import FaultyFileSystem

    fs = FaultyFileSystem()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.INTERVAL,
                           config=LogConfig(flush_interval_ms=60_000), fs=fs)
    before = fs.fsyncs
    for i in range(5):
        lg.append(make_batch(seed=i))
        lg.commit()
    # heads published from page cache; only the first commit fsyncs the head slot, to
    # clear the on-disk clean-shutdown flag before anything is signed (FORMAT.md sec. 6)
    assert fs.fsyncs == before + 1
    assert lg.high_watermark == 5
    lg.close()
    assert fs.fsyncs > before


def test_never_policy_does_not_fsync_on_commit(tmp_path):
    from storage.fs import FaultyFileSystem

    fs = FaultyFileSystem()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.NEVER, fs=fs)
    before = fs.fsyncs
    lg.append(make_batch())
    lg.commit()
    lg.append(make_batch())
    lg.commit()
    assert fs.fsyncs == before + 1 and lg.high_watermark == 2
    lg.close()

"""Retention drops whole segments, advances log_start_offset, keeps the tree for proofs."""

from __future__ import annotations

import os

import pytest
from storage_testutil import KEYPAIR, batch_of_size, split_batches, tree_hash_of

from storage import FsyncPolicy, LogConfig, PartitionLog, recovery
from storage.errors import OffsetOutOfRange
from storage.hypercore import Frontier, leaf_hash
from storage.verify import verify_partition


def setup(tmp_path, cfg, n=20):
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS, config=cfg)
    batches = []
    for i in range(n):
        b = batch_of_size(300, ts=1000 * i)
        lg.append(b)
        batches.append(bytes(b))
    lg.commit()
    return lg, batches


def segments(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".log"))


def test_retention_by_bytes(tmp_path):
    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1000, retention_bytes=2000,
                                            retention_ms=-1))
    assert len(segments(tmp_path)) == 7  # 3 batches per segment, last one partial
    dropped = lg.apply_retention(now_ms=10**12)
    assert dropped == 4  # Kafka rule: drop while the rest is still >= retention_bytes
    assert segments(tmp_path)[0] == "00000000000000000012.log"
    assert lg.log_start_offset == 12
    with pytest.raises(OffsetOutOfRange):
        lg.read(11, 100)
    assert split_batches(lg.read_bytes(12, 1 << 20)) == batches[12:15]
    # the tree file still holds the nodes of the dropped leaves: proofs stay possible
    assert lg.node(0).hash == leaf_hash(batches[0])
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS,
                           config=LogConfig(segment_bytes=1000))
    assert lg.log_start_offset == 12 and lg.high_watermark == 20
    more = []
    for _ in range(3):
        b = batch_of_size(300, ts=5)
        lg.append(b)
        more.append(bytes(b))
    head = lg.commit()
    assert head.tree_hash == tree_hash_of(batches + more)  # the same tree continues
    assert head.log_start_offset == 12 and head.min_index == 12
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    # every retained batch still authenticates on first read after reopen
    lg.close()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS)
    assert split_batches(lg.read_bytes(12, 1 << 20)) == batches[12:15]
    lg.close()


def test_retention_by_time_keeps_the_active_segment_and_unpublished_data(tmp_path):
    lg, _ = setup(tmp_path, LogConfig(segment_bytes=1000, retention_ms=5_000))
    # segment k holds timestamps 3000k .. 3000k+2000
    assert lg.apply_retention(now_ms=11_500) == 2  # segments with max ts < 6500: [0..3),[3..6)
    assert lg.log_start_offset == 6
    assert lg.apply_retention(now_ms=11_500) == 0
    assert lg.apply_retention(now_ms=10**9) == 4  # never the active segment
    assert lg.log_start_offset == 18 and len(segments(tmp_path)) == 1
    lg.close()


def test_interrupted_retention_is_finished_at_open(tmp_path):
    lg, _ = setup(tmp_path, LogConfig(segment_bytes=1000, retention_bytes=2000,
                                      retention_ms=-1))
    seg0 = os.path.join(tmp_path, "00000000000000000000.log")
    with open(seg0, "rb") as f:
        saved = f.read()
    with open(seg0[:-4] + ".bidx", "rb") as f:
        saved_idx = f.read()
    lg.apply_retention(now_ms=0)
    lg.close()
    # crash after the head was written but before the files were unlinked
    with open(seg0, "wb") as f:
        f.write(saved)
    with open(seg0[:-4] + ".bidx", "wb") as f:
        f.write(saved_idx)
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS)
    assert not os.path.exists(seg0) and lg.log_start_offset == 12
    lg.close()


def test_frontier_of_min_index_from_tree_file(tmp_path):
    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1000, retention_bytes=0,
                                            retention_ms=-1))
    lg.apply_retention(now_ms=0)
    f = Frontier()
    for b in batches[: lg.head.min_index]:
        f.append(leaf_hash(b), len(b))
    assert recovery.stored_roots(lg, lg.head.min_index).tree_hash() == f.tree_hash()
    lg.close()


def test_inclusion_and_consistency_proofs_from_the_tree_file_after_retention(tmp_path):
    from storage.hypercore.proofs import consistency_proof, inclusion_proof, verify_proof

    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1000, retention_bytes=2000,
                                            retention_ms=-1))
    lg.apply_retention(now_ms=0)
    assert lg.log_start_offset == 12
    head = lg.head

    def node(i):
        n = lg.node(i)
        assert n is not None, i
        return n

    # a receipt for a retained batch, built only from stored nodes (some of whose leaves
    # are gone), verifies against the signed head
    p = inclusion_proof(node, head.length, head.fork, head.signature, 13, lg.read_bytes(13, 1))
    v = verify_proof(p, public_key=KEYPAIR.public_key, key=lg.key, fork=head.fork)
    assert v is not None
    # and a consistency proof from a length whose data was dropped
    c = consistency_proof(node, 5, head.length, head.fork, head.signature)
    f = Frontier()
    for b in batches[:5]:
        f.append(leaf_hash(b), len(b))
    verify_proof(c, public_key=KEYPAIR.public_key, key=lg.key, fork=head.fork, trusted=f)
    lg.close()


def test_roll_starts_a_new_segment_at_the_next_append(tmp_path):
    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1 << 20, retention_ms=-1), n=5)
    assert segments(tmp_path) == ["00000000000000000000.log"]
    lg.roll()
    lg.roll()  # idempotent: no empty segment in between
    b = batch_of_size(300, ts=1)
    lg.append(b)
    lg.commit()
    assert segments(tmp_path) == ["00000000000000000000.log", "00000000000000000005.log"]
    lg.append(batch_of_size(300, ts=2))
    lg.commit()
    assert segments(tmp_path)[-1] == "00000000000000000005.log"  # only one roll
    assert split_batches(lg.read_bytes(0, 1 << 20)) == batches
    lg.close()


def test_drop_segments_below_an_offset(tmp_path):
    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1000, retention_ms=-1))
    # segments [0,3) [3,6) ... [18,20): only whole segments ending at or below 10 go
    assert lg.drop_segments_below(10) == 3
    assert lg.log_start_offset == 9
    assert split_batches(lg.read_bytes(9, 1 << 20)) == batches[9:12]
    assert lg.drop_segments_below(10) == 0
    # nothing above the high watermark, never the active segment
    lg.append(batch_of_size(300, ts=1))
    assert lg.drop_segments_below(10**6) == 3  # [9,12) [12,15) [15,18); [18,21) is active
    assert lg.log_start_offset == 18
    lg.commit()
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS)
    assert lg.log_start_offset == 18 and lg.high_watermark == 21
    assert split_batches(lg.read_bytes(18, 1 << 20))[:2] == batches[18:20]
    lg.close()


def test_drop_segments_below_waits_for_the_commit_job(tmp_path):
    lg, _ = setup(tmp_path, LogConfig(segment_bytes=1000, retention_ms=-1))
    lg.append(batch_of_size(300, ts=1))
    job = lg.prepare_commit()
    assert job is not None
    assert lg.drop_segments_below(10) == 0  # a job is in flight: try again later
    job.run()
    lg.publish(job)
    assert lg.drop_segments_below(10) == 3
    lg.close()


def test_delete_records_inside_a_segment_survives_reopen_and_stays_provable(tmp_path):
    """Kafka's DeleteRecords: the log start moves to any offset up to the high watermark;
    whole segments below it go, the one holding it stays; reopen keeps the start (the
    first segment then begins below it), and the tree of every signed batch remains."""
    lg, batches = setup(tmp_path, LogConfig(segment_bytes=1000, retention_ms=-1))
    head_before = lg.head
    assert lg.delete_records_below(7) == 7  # segment [6, 9) holds offset 7
    assert segments(tmp_path)[0] == "00000000000000000006.log"
    assert lg.log_start_offset == 7
    with pytest.raises(OffsetOutOfRange):
        lg.read(6, 100)
    assert lg.delete_records_below(3) == 7  # never backwards
    with pytest.raises(ValueError):
        lg.delete_records_below(21)  # above the high watermark
    assert lg.node(0).hash == leaf_hash(batches[0])  # dropped leaves' nodes stay
    assert lg.head.tree_hash == head_before.tree_hash and lg.head.signature == head_before.signature
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()
    lg = PartitionLog.open(tmp_path, KEYPAIR, fsync=FsyncPolicy.ALWAYS, config=LogConfig(segment_bytes=1000))
    assert lg.damage is None
    assert (lg.log_start_offset, lg.high_watermark) == (7, 20)
    assert split_batches(lg.read_bytes(7, 1 << 20)) == batches[7:9]
    # retention later drops the segment [6, 9) whole: the start never goes back
    lg.apply_retention(now_ms=10**12)
    assert lg.log_start_offset >= 7
    b = batch_of_size(300, ts=5)
    lg.append(b)
    head = lg.commit()
    assert head.tree_hash == tree_hash_of([*batches, bytes(b)])  # the same tree continues
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()

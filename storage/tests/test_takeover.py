"""A replica of a quorum-signed archive takes it over after a failover vote
(PartitionLog.take_over): it keeps what it was elected with (its stored head and the
signed tail past it), cuts the rest, continues the same archive on a fork that is the
new leader epoch, and what it writes verifies as the archive's history."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.batch import build_batch
from storage.epochs import EpochCache, EpochEntry
from storage.errors import StorageError
from storage.follower import FollowerLog
from storage.fs import OsFileSystem
from storage.hypercore import KeyPair, leaf_hash
from storage.hypercore.multisig import (
    assemble_quorum,
    sign_partial,
    verify_manifest_head,
)
from storage.tests.test_quorum_archive import KPS, MANIFEST, _batches, _source
from storage.verify import verify_partition


def _replica_with_signed_tail(path: Path) -> tuple[FollowerLog, list[bytes], list[bytes]]:
    """A replica (broker 0's key) whose stored quorum head covers 4 blocks, that signed
    a head at 6 (never stored here), and holds 7 (the last one no quorum signed)."""
    leader = _source(0)
    replica = FollowerLog.open_replica(path, MANIFEST)
    bs = _batches(7)
    leader.append(*bs[:4])
    for i, b in enumerate(bs):
        replica.append_block(i, b, leaf_hash(b))
    th4 = leader.frontier.tree_hash()
    p = replica.sign_held(KPS[0], 0, 4, th4)
    sig = assemble_quorum(MANIFEST, [p, sign_partial(KPS[2], MANIFEST, th4, 4, 0)])
    assert replica.accept_head(4, 0, sig, leader.frontier.roots())
    leader.append(*bs[4:6])
    trees = [th4, leader.frontier.tree_hash()]
    replica.sign_held(KPS[0], 0, 6, trees[1])
    return replica, bs, trees


def _quorum(lg: FollowerLog, other: int = 2):  # type: ignore[no-untyped-def]
    def sign(th: bytes, n: int, fork: int) -> bytes:
        mine = sign_partial(KPS[0], MANIFEST, th, n, fork)
        return assemble_quorum(MANIFEST, [mine, sign_partial(KPS[other], MANIFEST, th, n, fork)])

    return sign


def test_the_elected_replica_continues_the_archive_on_a_new_fork(tmp_path: Path) -> None:
    replica, bs, trees = _replica_with_signed_tail(tmp_path / "r")
    v = replica.vote(3)
    assert (v.fork, v.length) == (0, 6)
    lg = replica.log
    lg.take_over(KPS[0], 3, v.length)
    assert lg.length == 6 and not lg.replica and lg.fork == 3
    lg.quorum_sign = _quorum(replica)
    head = lg.commit()
    assert head is not None and (head.fork, head.length, head.tree_hash) == (3, 6, trees[1])
    assert verify_manifest_head(MANIFEST, lg.key, head.tree_hash, 6, 3, head.signature)
    assert lg.high_watermark == 12  # 6 batches of 2 records: every elected one readable
    epochs = EpochCache(OsFileSystem(), str(tmp_path / "r"))
    assert epochs.entries == [EpochEntry(0, 0), EpochEntry(3, 12)]
    assert epochs.end_offset_for(0, 12) == (0, 12)  # a follower of epoch 0 truncates to 12
    # the new leader writes on: offsets go on from the elected ones, stamped epoch 3
    base, last = lg.append(build_batch([b"new", b"leader"], timestamp_ms=9), leader_epoch=3)
    assert (base, last) == (12, 13)
    head = lg.commit()
    assert head is not None and (head.fork, head.length) == (3, 7)
    assert [lg.block(i) for i in range(6)] == bs[:6]  # block 6 (never a quorum's) is gone
    assert lg.block(6) != bs[6]
    replica.close()
    r = verify_partition(str(tmp_path / "r"), MANIFEST)
    assert r.ok, r
    again = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    assert again.head is not None and (again.head.fork, again.head.length) == (3, 7)
    again.close()


def test_a_takeover_at_the_stored_head_cuts_the_whole_tail(tmp_path: Path) -> None:
    replica, _, trees = _replica_with_signed_tail(tmp_path / "r")
    lg = replica.log
    lg.take_over(KPS[0], 1, 4)
    lg.quorum_sign = _quorum(replica)
    head = lg.commit()
    assert head is not None and (head.fork, head.length, head.tree_hash) == (1, 4, trees[0])
    assert EpochCache(OsFileSystem(), str(tmp_path / "r")).entries == [
        EpochEntry(0, 0), EpochEntry(1, 8)
    ]
    replica.close()
    assert verify_partition(str(tmp_path / "r"), MANIFEST).ok


def test_a_takeover_that_cannot_be_done_changes_nothing(tmp_path: Path) -> None:
    replica, _, _ = _replica_with_signed_tail(tmp_path / "r")
    lg = replica.log
    with pytest.raises(StorageError, match="not one of the archive's signers"):
        lg.take_over(KeyPair.from_seed(b"\x09" * 32), 1, 6)
    with pytest.raises(StorageError, match="cannot keep 3 blocks"):
        lg.take_over(KPS[0], 1, 3)  # below the stored quorum head
    with pytest.raises(StorageError, match="cannot keep 9 blocks"):
        lg.take_over(KPS[0], 1, 9)  # more than it holds
    with pytest.raises(StorageError, match="not newer than fork 0"):
        lg.take_over(KPS[0], 0, 6)
    assert lg.replica and lg.length == 7 and lg.fork == 0
    assert EpochCache(OsFileSystem(), str(tmp_path / "r")).entries == []
    replica.close()
    single = FollowerLog.open_replica(tmp_path / "s", KPS[0].public_key)
    with pytest.raises(StorageError, match="not a replica of a quorum-signed"):
        single.log.take_over(KPS[0], 1, 0)
    single.close()


def test_another_replica_follows_the_new_leaders_fork(tmp_path: Path) -> None:
    """A replica that stored the old leader's quorum head (fork 0, 4 blocks) replicates
    the new leader's archive after the takeover: the new fork keeps every block it holds,
    so it follows it (FORMAT.md section 10) and ends with the new leader's head."""
    from storage.replication import MemoryArchive, ReplicationSession
    from storage.replication.sources import PartitionLogSource
    from storage.tests.test_follower import _pump

    replica, _bs, _ = _replica_with_signed_tail(tmp_path / "r")
    other = FollowerLog.open_replica(tmp_path / "o", MANIFEST)
    server = ReplicationSession.serve(_source(4))
    client = ReplicationSession.follow(MANIFEST.hash(), other, initiator=True, have=other.verified_tree())
    _pump(client, server)
    assert other.head is not None and (other.head.fork, other.head.length) == (0, 4)
    lg = replica.log
    lg.take_over(KPS[0], 2, 6)
    lg.quorum_sign = _quorum(replica)
    lg.commit()
    lg.append(build_batch([b"after"], timestamp_ms=5), leader_epoch=2)
    head = lg.commit()
    assert head is not None and (head.fork, head.length) == (2, 7)
    # as broker/mirror.py does: probe the peer's head at our length (Hypercore's
    # conflict check) and learn the new fork keeps our tree; then follow it
    server = ReplicationSession.serve(PartitionLogSource(lg))
    probe = ReplicationSession.follow(MANIFEST.hash(), MemoryArchive(MANIFEST), initiator=True,
                                      window=0, public_key=MANIFEST, probe_at=4)  # fmt: skip
    _pump(probe, server)
    assert probe.latest_head is not None
    other.check_conflict(*probe.latest_head, proof=probe.latest_proof)
    assert other.follow_fork == 2
    server = ReplicationSession.serve(PartitionLogSource(lg))
    client = ReplicationSession.follow(
        MANIFEST.hash(), other, initiator=True, have=other.verified_tree(), fork=other.follow_fork
    )
    _pump(client, server)
    assert other.head is not None and (other.head.fork, other.head.length) == (2, 7)
    assert [other.log.block(i) for i in range(7)] == [lg.block(i) for i in range(7)]
    other.close()
    replica.close()
    assert verify_partition(str(tmp_path / "o"), MANIFEST).ok


def test_the_old_leader_comes_back_as_a_replica_of_the_new_fork(tmp_path: Path) -> None:
    """The deposed leader's archive (fork 0, a quorum head at 4 blocks, then batches no
    quorum signed) is reopened as a replica: its unsigned tail is cut, and it follows
    the new leader's fork, which kept its 4 blocks."""
    from storage.log import FsyncPolicy, PartitionLog
    from storage.manifest_file import write_manifest
    from storage.replication import MemoryArchive, ReplicationSession
    from storage.replication.sources import PartitionLogSource
    from storage.tests.test_follower import _pump

    fs = OsFileSystem()
    old_path = tmp_path / "old"
    old_path.mkdir()
    write_manifest(fs, str(old_path), MANIFEST)
    old = PartitionLog.open(old_path, KPS[1], fsync=FsyncPolicy.ALWAYS)
    old.quorum_sign = _quorum_as(1, 2)
    for v in (b"a", b"b", b"c", b"d"):
        old.append(build_batch([v], timestamp_ms=1))
    head = old.commit()
    assert head is not None and (head.fork, head.length) == (0, 4)
    acked = [old.block(i) for i in range(4)]

    def refused(th: bytes, n: int, f: int) -> bytes:
        raise StorageError("no quorum")

    old.quorum_sign = refused
    old.append(build_batch([b"never acknowledged"], timestamp_ms=1))
    with pytest.raises(StorageError):
        old.commit()
    old.close()

    # the new leader: a replica holding the 4 acknowledged blocks, elected, writes on
    new = FollowerLog.open_replica(tmp_path / "new", MANIFEST)
    for i, b in enumerate(acked):
        new.append_block(i, b, leaf_hash(b))
    lg = new.log
    lg.take_over(KPS[0], 1, 4)
    lg.quorum_sign = _quorum(new)
    lg.commit()
    lg.append(build_batch([b"e"], timestamp_ms=2), leader_epoch=1)
    assert lg.commit() is not None

    back = FollowerLog.open_replica(old_path, MANIFEST)
    assert back.head is not None and (back.head.fork, back.head.length) == (0, 4)
    assert back.length == 4  # the batch no quorum signed is gone
    server = ReplicationSession.serve(PartitionLogSource(lg))
    probe = ReplicationSession.follow(MANIFEST.hash(), MemoryArchive(MANIFEST), initiator=True,
                                      window=0, public_key=MANIFEST, probe_at=4)  # fmt: skip
    _pump(probe, server)
    assert probe.latest_head is not None
    back.check_conflict(*probe.latest_head, proof=probe.latest_proof)
    server = ReplicationSession.serve(PartitionLogSource(lg))
    client = ReplicationSession.follow(MANIFEST.hash(), back, initiator=True,
                                       have=back.verified_tree(), fork=back.follow_fork)  # fmt: skip
    _pump(client, server)
    assert back.head is not None and (back.head.fork, back.head.length) == (1, 5)
    assert [back.log.block(i) for i in range(5)] == [lg.block(i) for i in range(5)]
    back.close()
    new.close()
    assert verify_partition(str(old_path), MANIFEST).ok


def _quorum_as(a: int, b: int):  # type: ignore[no-untyped-def]
    def sign(th: bytes, n: int, fork: int) -> bytes:
        return assemble_quorum(
            MANIFEST,
            [sign_partial(KPS[a], MANIFEST, th, n, fork), sign_partial(KPS[b], MANIFEST, th, n, fork)],
        )

    return sign


def test_an_empty_archive_taken_over_commits_without_asking_its_replicas(tmp_path: Path) -> None:
    """A failover of a partition nothing was written to yet (an empty topic: common): its
    new leader's first commit is the empty tree on the new fork. Replicas refuse to sign
    length 0 (there is nothing to vouch for), and a head of length 0 is never verified,
    so it needs no signature. Before, the commit asked them anyway: refused, the
    partition went offline, and the commit was tried again (5 s of waiting each time, in
    the broker's group commit round, which every partition of that broker waits for)."""
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    v = replica.vote(1)
    assert v.length == 0
    lg = replica.log
    lg.take_over(KPS[0], 1, 0)

    def refused(th: bytes, n: int, fork: int) -> bytes:
        raise StorageError(f"nothing to sign at length {n}")

    lg.quorum_sign = refused
    lg.commit()  # (a head of the empty tree on fork 1, or none at all)
    assert lg.fork == 1 and lg.length == 0
    lg.quorum_sign = _quorum(replica)
    lg.append(build_batch([b"first"], timestamp_ms=9), leader_epoch=1)
    head = lg.commit()
    assert head is not None and (head.fork, head.length) == (1, 1)
    assert verify_manifest_head(MANIFEST, lg.key, head.tree_hash, 1, 1, head.signature)
    replica.close()
    r = verify_partition(str(tmp_path / "r"), MANIFEST)
    assert r.ok, r
    again = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    assert again.head is not None and (again.head.fork, again.head.length) == (1, 1)
    again.close()

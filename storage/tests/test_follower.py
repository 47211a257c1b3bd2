"""FollowerLog: a persistent mirror archive fed by a replication session.

Covers: catch-up and live heads from a real PartitionLog writer, the writer's signature
kept (offline verify with the writer's key), crash safety (blocks past the last head are
dropped, not signed), a tampered block refused on read and fetched again, a peer signing
with another key refused, and equivocation frozen with evidence on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.errors import CorruptBatch, StorageError
from storage.follower import (
    EVIDENCE_FILE,
    Equivocation,
    FollowerLog,
    VerificationFailed,
    check_evidence,
)
from storage.hypercore import KeyPair, archive_key, leaf_hash
from storage.log import FsyncPolicy, PartitionLog
from storage.replication import (
    PartitionLogSource,
    RemoteProtocolError,
    ReplicationSession,
)
from storage.tests.storage_testutil import make_batch
from storage.verify import verify_partition

KP = KeyPair.from_seed(bytes([3]) * 32)
OTHER = KeyPair.from_seed(bytes([4]) * 32)


def _writer(path: Path, n: int, kp: KeyPair = KP, seed: int = 0) -> PartitionLog:
    w = PartitionLog.open(path, kp, fsync=FsyncPolicy.NEVER)
    for i in range(n):
        w.append(make_batch(3, 40, ts=1000 + i, seed=seed * 1000 + i))
        if i % 7 == 6:
            w.commit()
    w.commit()
    return w


def _pump(a: ReplicationSession, b: ReplicationSession) -> None:
    for _ in range(100_000):
        da, db = a.data_to_send(), b.data_to_send()
        if not da and not db:
            return
        if da:
            b.receive_data(da)
        if db:
            a.receive_data(db)
    raise AssertionError("sessions did not go quiet")


def _sync(writer: PartitionLog, follower: FollowerLog, live: bool = False,
          lookup: bool = False) -> tuple[ReplicationSession, ReplicationSession]:
    src = PartitionLogSource(writer)
    if lookup:
        server = ReplicationSession.serve_any(
            lambda dk: src if dk == ReplicationSession.serve(src).discovery_key else None)
    else:
        server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(writer.key, follower, initiator=True, live=live,
                                       have=follower.verified_tree(), fork=follower.follow_fork)
    _pump(client, server)
    return server, client


def _all(lg: PartitionLog) -> bytes:
    out = b""
    off = lg.log_start_offset
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 20)
        out += r.read()
        off = r.end_offset
    return out


def test_catch_up_live_and_verify_offline(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 20)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    server, client = _sync(w, f, live=True, lookup=True)
    assert f.high_watermark == w.high_watermark > 0
    assert _all(f) == _all(w)
    # live: the writer appends, the server announces, the follower catches up
    for i in range(5):
        w.append(make_batch(2, 10, seed=500 + i))
    w.commit()
    server.notify_append()
    _pump(client, server)
    assert f.high_watermark == w.high_watermark
    assert _all(f) == _all(w)
    assert f.head is not None and f.head.signature == w.head.signature  # type: ignore[union-attr]
    f.close()
    res = verify_partition(str(tmp_path / "m"), KP.public_key)
    assert res.ok and res.signed_length == 25, res
    # the follower is read-only for Kafka: it cannot sign
    f2 = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert f2.log.prepare_commit() is None
    assert _all(f2) == _all(w)
    f2.close()
    w.close()


def test_resume_after_restart_fetches_only_the_rest(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 10)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    f.close()
    for i in range(4):
        w.append(make_batch(1, 10, seed=900 + i))
    w.commit()
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _, client = _sync(w, f)
    assert client.stats.blocks == 4
    assert _all(f) == _all(w)
    f.close()
    w.close()


def test_blocks_past_the_head_are_dropped_at_reopen_not_signed(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 6)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(4):  # blocks delivered but the head (length 6) never arrived: a crash
        f.put_block(i, w.block(i), _leaf(w, i))
    assert f.high_watermark == 0
    f.log._close_fds()  # simulate a crash: no close(), nothing committed
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert f.length == 0 and f.high_watermark == 0
    _sync(w, f)
    assert _all(f) == _all(w)
    f.close()
    assert verify_partition(str(tmp_path / "m"), KP.public_key).ok
    w.close()


def _leaf(w: PartitionLog, i: int):  # type: ignore[no-untyped-def]
    n = w.node(2 * i)
    assert n is not None
    return n


def test_bad_block_or_head_refused(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 3)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    with pytest.raises(VerificationFailed):  # not a batch
        f.append_block(0, b"x" * 30, _leaf(w, 0).hash)
    with pytest.raises(VerificationFailed):  # not the next offset
        f.append_block(0, w.block(1), _leaf(w, 1).hash)
    for i in range(3):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    head = w.head
    assert head is not None
    with pytest.raises(VerificationFailed):
        f.accept_head(3, 0, bytes(68), head.roots)
    assert f.high_watermark == 0
    assert f.accept_head(3, 0, head.signature, head.roots)
    assert f.high_watermark == w.high_watermark
    f.close()
    w.close()


def test_another_key_is_refused(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 3, kp=OTHER)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    src = PartitionLogSource(w)
    server = ReplicationSession.serve(src)
    # we ask for KP's archive; the peer only holds OTHER's: it rejects the channel
    client = ReplicationSession.follow(archive_key(KP.public_key), f, initiator=True)
    with pytest.raises(RemoteProtocolError):
        _pump(client, server)
    assert f.high_watermark == 0 and f.length == 0
    # a sink of KP fed with OTHER's head: the head does not verify
    for i in range(3):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    head = w.head
    assert head is not None
    with pytest.raises(VerificationFailed):
        f.accept_head(3, 0, head.signature, head.roots)
    # reopening a follower dir under another key is refused
    f.close()
    with pytest.raises(VerificationFailed):
        FollowerLog.open_replica(tmp_path / "m", OTHER.public_key)
    w.close()


def test_tampered_block_refused_then_fetched_again(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 12)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    want = _all(w)
    f.close()
    # flip a byte inside a record of block 5 on the mirror's disk, CRC left wrong or right
    seg = os.path.join(tmp_path / "m", "00000000000000000000.log")
    pos = sum(len(w.block(i)) for i in range(5)) + 70
    with open(seg, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0xFF]))
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    with pytest.raises(CorruptBatch):
        _all(f)
    bad = f.bad_block()
    assert bad == 5
    # fetch it again over the protocol, verified against our own signed head
    server = ReplicationSession.serve(PartitionLogSource(w))
    client = ReplicationSession.follow(w.key, f, initiator=True, live=True, have=f.verified_tree(),
                                       public_key=KP.public_key)
    _pump(client, server)
    client.refetch(bad)
    _pump(client, server)
    assert f.bad_block() is None
    assert _all(f) == want
    f.close()
    assert verify_partition(str(tmp_path / "m"), KP.public_key).ok
    w.close()


def test_equivocation_same_length_freezes_with_evidence(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 5)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    hw = f.high_watermark
    # the same key signs another history of the same length
    evil = _writer(tmp_path / "evil", 5, seed=7)
    eh = evil.head
    assert eh is not None and eh.length == 5 and eh.tree_hash != f.head.tree_hash  # type: ignore[union-attr]
    with pytest.raises(Equivocation):
        f.accept_head(5, 0, eh.signature, eh.roots)
    assert f.frozen
    assert f.high_watermark == hw  # keeps serving what it verified
    with pytest.raises(Equivocation):
        f.append_block(5, w.block(0), _leaf(w, 0).hash)
    f.close()
    path = str(tmp_path / "m")
    assert os.path.exists(os.path.join(path, EVIDENCE_FILE))
    assert check_evidence(path, KP.public_key) is not None
    assert check_evidence(path, OTHER.public_key) is None  # evidence must verify
    again = FollowerLog.open_replica(path, KP.public_key)
    assert again.frozen
    again.close()
    w.close()
    evil.close()


def test_equivocation_other_fork_and_non_prefix(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 8)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    evil = _writer(tmp_path / "evil", 4, seed=9)  # shorter, another history
    eh = evil.head
    assert eh is not None
    with pytest.raises(Equivocation):
        f.accept_head(eh.length, eh.fork, eh.signature, eh.roots)
    f.close()
    # the evidence carries our own proof of our tree at the shorter length
    desc = check_evidence(str(tmp_path / "m"), KP.public_key)
    assert desc is not None and "at length 4" in desc
    w.close()
    evil.close()


def test_verify_command_reports_a_longer_fork(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from storage.cli import verify_command
    from storage.replication import MemoryArchive
    from storage.store import CATALOG_DIR, MIRRORS_DIR, Store

    w = Store.open(tmp_path / "w", fsync=FsyncPolicy.NEVER)
    w.create_topic("t", 1, {})
    plog = w.log("t", 0)
    for i in range(4):
        plog.append(make_batch(2, 20, seed=i))
    plog.commit()
    Store.open(tmp_path / "m").close()
    base = tmp_path / "m" / MIRRORS_DIR / w.node_public_key.hex()
    cat = FollowerLog.open_replica(base / CATALOG_DIR, w.node_public_key)
    _sync(w.catalog_log, cat)
    cat.close()
    part = FollowerLog.open_replica(base / "t-0", plog.public_key)
    _sync(plog, part)
    # the writer's key signs another history, longer than what the mirror holds
    kp = w.partition_keypair("t", 0)
    evil = PartitionLog.open(tmp_path / "evil", kp, fsync=FsyncPolicy.NEVER)
    for i in range(9):
        evil.append(make_batch(2, 20, seed=200 + i))
    evil.commit()
    server = ReplicationSession.serve(PartitionLogSource(evil))
    client = ReplicationSession.follow(evil.key, MemoryArchive(kp.public_key), initiator=True,
                                       window=0, public_key=kp.public_key, probe_at=4)
    _pump(client, server)
    assert client.latest_head is not None
    with pytest.raises(Equivocation):
        part.check_conflict(*client.latest_head, proof=client.latest_proof)
    part.close()
    capsys.readouterr()
    assert verify_command(str(tmp_path / "m"), None) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "/t 0" in bad[0] and "equivocation" in bad[0]
    assert "length 9" in bad[0] and "at length 4" in bad[0] and EVIDENCE_FILE in bad[0]
    evil.close()
    w.close()


def test_public_key_learned_from_manifest_even_when_empty(tmp_path: Path) -> None:
    from storage.replication import MemoryArchive

    for n in (0, 3):
        w = _writer(tmp_path / f"w{n}", n)
        server = ReplicationSession.serve(PartitionLogSource(w))
        client = ReplicationSession.follow(w.key, MemoryArchive(KP.public_key), initiator=True)
        _pump(client, server)
        assert client.public_key == KP.public_key
        w.close()


def test_verify_command_checks_mirrors_and_reports_equivocation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from storage.cli import verify_command
    from storage.store import CATALOG_DIR, MIRRORS_DIR, Store

    w = Store.open(tmp_path / "w", fsync=FsyncPolicy.NEVER)
    w.create_topic("t", 1, {})
    plog = w.log("t", 0)
    for i in range(4):
        plog.append(make_batch(2, 20, seed=i))
    plog.commit()
    m = Store.open(tmp_path / "m")
    m.close()
    base = tmp_path / "m" / MIRRORS_DIR / w.node_public_key.hex()
    cat = FollowerLog.open_replica(base / CATALOG_DIR, w.node_public_key)
    _sync(w.catalog_log, cat)
    part = FollowerLog.open_replica(base / "t-0", plog.public_key)
    _sync(plog, part)
    cat.close()
    assert verify_command(str(tmp_path / "m"), None) == 0
    out = capsys.readouterr().out
    assert f"ok mirror:{w.node_public_key.hex()[:16]}/t 0 4 blocks, 4 signed" in out
    # the writer's key signs a second history at the same length: evidence, frozen, BAD
    evil = PartitionLog.open(tmp_path / "evil", w.partition_keypair("t", 0), fsync=FsyncPolicy.NEVER)
    for i in range(4):
        evil.append(make_batch(2, 20, seed=100 + i))
    evil.commit()
    eh = evil.head
    assert eh is not None
    with pytest.raises(Equivocation):
        part.accept_head(eh.length, eh.fork, eh.signature, eh.roots)
    part.close()
    assert verify_command(str(tmp_path / "m"), None) == 1
    out = capsys.readouterr().out
    assert "BAD mirror:" in out and "equivocation" in out
    evil.close()
    w.close()


def test_leaves_that_do_not_form_the_signed_tree_never_published(tmp_path: Path) -> None:
    """Blocks whose delivered leaf hashes do not fold into the tree the head signs (a
    session that lied, or handed over blocks in another order) never become visible.
    (The leaf hash is the caller's hash of exactly the bytes handed over; they are
    written unchanged and hashed once.)"""
    w = _writer(tmp_path / "w", 3)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    forged = bytearray(w.block(2))
    forged[-1] ^= 1
    for i in range(2):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    f.append_block(2, bytes(forged), leaf_hash(bytes(forged)))
    head = w.head
    assert head is not None
    with pytest.raises(StorageError):
        f.accept_head(3, 0, head.signature, head.roots)
    assert f.high_watermark == 0
    f.log._close_fds()
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)  # recovery drops the tail
    assert f.length == 0 and f.high_watermark == 0
    _sync(w, f)
    assert _all(f) == _all(w)
    f.close()
    w.close()


def test_interrupted_session_resumes_after_discarding_unsigned_blocks(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 9)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(5):  # a session delivered 5 blocks, then the connection dropped
        f.put_block(i, w.block(i), _leaf(w, i))
    f.discard_unsigned()
    assert f.length == 0
    _sync(w, f)
    assert _all(f) == _all(w)
    f.close()
    w.close()


def test_a_newer_fork_is_a_truncation_not_equivocation(tmp_path: Path) -> None:
    """Hypercore's truncate bumps the fork id (our writer does it after a power loss):
    legitimate, so never evidence nor a freeze. A new fork that keeps our tree is
    followed; one that dropped blocks we hold needs a reorg, which a mirror does not do
    (ForkChanged, nothing stored). A head of an older fork is stale: ignored."""
    from storage.follower import ForkChanged
    from storage.hypercore import sign_head

    w = _writer(tmp_path / "w", 4)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    head = w.head
    assert head is not None
    # a shorter head on fork 1 (a real truncation), another history
    evil = _writer(tmp_path / "evil", 2, seed=5)
    eh = evil.head
    assert eh is not None
    with pytest.raises(ForkChanged):
        f.check_conflict(eh.length, 1, sign_head(KP, w.key, eh.tree_hash, eh.length, 1), eh.roots)
    # the same length on fork 1 with another tree: a truncate and a re-append
    with pytest.raises(ForkChanged):
        other = _writer(tmp_path / "other", 4, seed=6)
        oh = other.head
        assert oh is not None
        f.check_conflict(4, 1, sign_head(KP, w.key, oh.tree_hash, 4, 1), oh.roots)
    assert f.follow_fork == 0
    # the same tree, validly signed under fork 1: nothing to undo, followed on fork 1
    sig = sign_head(KP, w.key, head.tree_hash, head.length, 1)
    assert f.check_conflict(head.length, 1, sig, head.roots) is False
    assert f.follow_fork == 1
    # and now fork 0 is the stale one
    assert f.check_conflict(head.length, 0, head.signature, head.roots) is False
    assert not f.frozen
    assert not os.path.exists(tmp_path / "m" / EVIDENCE_FILE)
    assert f.high_watermark == head.next_offset
    f.close()
    w.close()
    evil.close()
    other.close()


def _reboot_writer(path: Path, monkeypatch: pytest.MonkeyPatch) -> PartitionLog:
    """Writer `path` reopened as after an unclean shutdown across a reboot: recovery
    re-signs what survived (here everything) under fork + 1 (FORMAT.md sec. 8, case 9)."""

    monkeypatch.setattr("storage.format.BOOT_ID", os.urandom(16))
    w = PartitionLog.open(path, KP, fsync=FsyncPolicy.NEVER)
    return w


def test_a_writer_that_moved_to_a_new_fork_keeping_our_blocks_is_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's recovery after a reboot bumps its fork without dropping what we
    hold: the mirror checks that (the probe's proof of the new fork's tree at our
    length), follows the new fork and stores its heads; after a restart of the mirror it
    resumes on that fork. (Before: `reorgs unsupported` forever, or frozen.)"""
    w = _writer(tmp_path / "w", 5)  # never closed: an unclean shutdown
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    w2 = _reboot_writer(tmp_path / "w", monkeypatch)
    assert w2.fork == 1 and w2.head is not None and w2.head.length == 5
    for i in range(7):
        w2.append(make_batch(2, 20, ts=3000 + i, seed=500 + i))
    w2.commit()
    assert _probe(w2, f) is True  # longer, on fork 1, keeps our 5 blocks
    assert f.follow_fork == 1
    _sync(w2, f)
    assert f.head is not None and (f.head.length, f.head.fork) == (12, 1)
    assert _all(f) == _all(w2)
    f.close()
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert f.follow_fork == 1
    w2.append(make_batch(2, 20, ts=4000, seed=900))
    w2.commit()
    assert _probe(w2, f) is True
    _sync(w2, f)  # resumes on fork 1
    assert f.head is not None and (f.head.length, f.head.fork) == (13, 1)
    assert not f.frozen
    f.close()
    assert verify_partition(str(tmp_path / "m"), KP.public_key).ok
    w2.close()
    w.close()


def test_reveal_makes_verified_blocks_readable_before_their_head_is_stored(tmp_path: Path) -> None:
    """A mirror serves blocks a session verified as soon as they are written; the head
    slot (durability) follows. Unstored, they vanish at a reopen and are fetched again."""
    w = _writer(tmp_path / "w", 9)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(9):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    assert f.high_watermark == 0
    assert not f.reveal(10)  # not delivered
    assert f.reveal(4) and not f.reveal(4)
    data = _all(f)
    assert data and w.read_bytes(0, len(data)) == data  # blocks 0..3, byte for byte
    assert f.head is None or f.head.length == 0  # nothing stored: no head on disk
    f.log._close_fds()
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert f.length == 0 and f.high_watermark == 0  # reopened at its last stored head
    for i in range(9):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    assert f.reveal(9)
    head = w.head
    assert head is not None
    assert f.accept_head(9, 0, head.signature, head.roots)
    assert f.high_watermark == w.high_watermark and _all(f) == _all(w)
    f.close()
    w.close()


def test_discarding_unstored_blocks_takes_back_what_was_revealed(tmp_path: Path) -> None:
    w = _writer(tmp_path / "w", 5)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(5):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    assert f.reveal(5)
    f.discard_unsigned()  # the session ended before the head was stored
    assert f.length == 0 and f.high_watermark == f.log_end_offset == 0
    _sync(w, f)
    assert _all(f) == _all(w)
    f.close()
    w.close()


def test_storing_an_older_head_keeps_what_a_newer_one_revealed(tmp_path: Path) -> None:
    """Heads are stored one at a time while newer ones are revealed: the high watermark
    never goes back (a consumer past it would get OFFSET_OUT_OF_RANGE and skip ahead)."""
    w = _writer(tmp_path / "w", 3)
    old = w.head
    assert old is not None
    for i in range(3, 6):
        w.append(make_batch(2, 30, ts=5000 + i, seed=900 + i))
    w.commit()
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(6):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    aj = f.prepare_accept(3, 0, old.signature, old.roots)
    assert aj is not None
    assert f.reveal(6)  # the newer head's blocks, verified, while the older is stored
    f.run_accept(aj)
    f.finish_accept(aj)
    assert f.head is not None and f.head.length == 3
    assert f.high_watermark == w.high_watermark and _all(f) == _all(w)
    new = w.head
    assert new is not None and f.accept_head(6, 0, new.signature, new.roots)
    assert f.high_watermark == w.high_watermark
    f.close()
    w.close()


def test_an_accept_job_never_run_leaves_the_log_at_its_last_head(tmp_path: Path) -> None:
    """A caller cancelled between prepare_accept and run_accept (trio checks for a cancel
    before it starts the worker thread) finishes the job unrun: no error over the
    caller's own, nothing poisoned, the log back at its last stored head (the prepared
    job had taken the covered blocks and folded their leaves into the frontier); the
    blocks are fetched again and their head stored."""
    w = _writer(tmp_path / "w", 3)
    old = w.head
    assert old is not None
    for i in range(3, 6):
        w.append(make_batch(2, 30, ts=5000 + i, seed=900 + i))
    w.commit()
    new = w.head
    assert new is not None
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    for i in range(6):
        f.append_block(i, w.block(i), _leaf(w, i).hash)
    assert f.accept_head(3, 0, old.signature, old.roots)
    assert f.reveal(6)
    aj = f.prepare_accept(6, 0, new.signature, new.roots)
    assert aj is not None
    assert f.finish_accept(aj) is False  # never ran: no StorageError
    assert f.head is not None and f.head.length == 3 and f.length == 3
    assert f.high_watermark == f.log_end_offset == old.next_offset
    _sync(w, f)  # fetched again
    assert f.head is not None and f.head.length == 6
    assert f.high_watermark == w.high_watermark and _all(f) == _all(w)
    f.close()
    assert verify_partition(str(tmp_path / "m"), KP.public_key).ok
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert f.length == 6 and _all(f) == _all(w)
    f.close()
    w.close()


def _forked_copy(tmp_path: Path, ours: int, extra: int) -> tuple[PartitionLog, PartitionLog]:
    """A writer at `ours` blocks, and a copy of its data dir (same key) taken one block
    earlier that appended `extra + 1` other records: longer, another history."""
    import shutil

    w = _writer(tmp_path / "w", ours - 1)
    w.close()
    shutil.copytree(tmp_path / "w", tmp_path / "evil")
    w = PartitionLog.open(tmp_path / "w", KP, fsync=FsyncPolicy.NEVER)
    w.append(make_batch(3, 40, ts=1000 + ours, seed=ours))
    w.commit()
    evil = PartitionLog.open(tmp_path / "evil", KP, fsync=FsyncPolicy.NEVER)
    for i in range(extra + 1):
        evil.append(make_batch(2, 30, ts=5000 + i, seed=77_000 + i))
        if i % 5 == 4:
            evil.commit()
    evil.commit()
    return w, evil


def _probe(writer: PartitionLog, f: FollowerLog) -> bool:
    """What broker.mirror.probe_head does, sans-I/O: the peer's head with the proof of
    its tree at our length, held against ours."""
    from storage.replication import MemoryArchive

    ours = f.verified_tree().length
    server = ReplicationSession.serve(PartitionLogSource(writer))
    client = ReplicationSession.follow(writer.key, MemoryArchive(KP.public_key), initiator=True,
                                       window=0, public_key=KP.public_key, probe_at=ours or None)
    _pump(client, server)
    head = client.latest_head
    assert head is not None
    return f.check_conflict(*head, proof=client.latest_proof if head[0] > ours else None)


@pytest.mark.parametrize(("ours", "extra"), [(5, 4), (5, 60), (8, 1), (1, 30)])
def test_equivocation_by_a_longer_head_freezes_with_evidence(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, ours: int, extra: int) -> None:
    """A copy of the writer's data dir (same key) that appended other records to a LONGER
    length than a mirror verified: its tree at our length, shown by the upgrade proof from
    0 (bound to its signature), is another one. Frozen, both heads and that proof kept,
    one ERROR, `verify` fails; the evidence survives a restart."""
    import logging

    w, evil = _forked_copy(tmp_path, ours, extra)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    w.close()
    assert evil.head is not None and evil.head.length == ours + extra
    hw = f.high_watermark
    caplog.set_level(logging.INFO)
    caplog.clear()
    with pytest.raises(Equivocation):
        _probe(evil, f)
    assert f.frozen
    assert f.high_watermark == hw  # keeps serving what it verified
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "EQUIVOCATION" in errors[0].getMessage()
    with pytest.raises(Equivocation):  # takes nothing new
        _probe(evil, f)
    f.close()
    path = str(tmp_path / "m")
    import json

    with open(os.path.join(path, EVIDENCE_FILE)) as fh:
        doc = json.load(fh)
    assert [h["length"] for h in doc["heads"]] == [ours, ours + extra] and doc["proof"]
    desc = check_evidence(path, KP.public_key)
    assert desc is not None and f"at length {ours}" in desc and EVIDENCE_FILE in desc
    assert check_evidence(path, OTHER.public_key) is None
    again = FollowerLog.open_replica(path, KP.public_key)
    assert again.frozen
    again.close()
    evil.close()


def test_a_legitimate_long_catch_up_is_no_equivocation(tmp_path: Path) -> None:
    """The same check on an honest writer that grew far past us (a tree of other shape
    at its length, ours as its prefix): no false positive, then a full catch-up."""
    w = _writer(tmp_path / "w", 5)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    for i in range(1500):
        w.append(make_batch(1, 10, ts=9000 + i, seed=4000 + i))
        if i % 97 == 0:
            w.commit()
    w.commit()
    assert _probe(w, f) is True
    _sync(w, f)
    assert f.head is not None and f.head.length == 1505
    assert _probe(w, f) is False  # equal now
    assert not f.frozen and not os.path.exists(tmp_path / "m" / EVIDENCE_FILE)
    f.close()
    assert verify_partition(str(tmp_path / "m"), KP.public_key).ok
    w.close()


def test_a_proof_that_does_not_fit_the_head_is_refused_not_evidence(tmp_path: Path) -> None:
    """A relay cannot frame the writer: a conflict proof that is not bound to the head
    it comes with (another head's proof, a lying node) is a bad proof, not evidence."""
    from dataclasses import replace

    from storage.hypercore import Node

    w, evil = _forked_copy(tmp_path, 5, 5)
    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    _sync(w, f)
    from storage.replication import MemoryArchive

    server = ReplicationSession.serve(PartitionLogSource(evil))
    client = ReplicationSession.follow(evil.key, MemoryArchive(KP.public_key), initiator=True,
                                       window=0, public_key=KP.public_key, probe_at=5)
    _pump(client, server)
    head, proof = client.latest_head, client.latest_proof
    assert head is not None and proof is not None and proof.upgrade is not None
    up = proof.upgrade
    bad_node = Node(up.nodes[0].index, up.nodes[0].size, bytes(32))
    for bad in (replace(proof, upgrade=replace(up, nodes=(bad_node, *up.nodes[1:]))),
                replace(proof, upgrade=replace(up, length=up.length - 1))):
        with pytest.raises(VerificationFailed):
            f.check_conflict(*head, proof=bad)
    assert not f.frozen
    # two consistent heads written as "evidence" prove nothing
    import json

    from storage.follower import _head_json

    h5 = f.head
    _sync(w, f)  # nothing new
    w.append(make_batch(2, 20, seed=999))
    w.commit()
    wh = w.head
    assert h5 is not None and wh is not None
    doc = {"reason": "forged", "heads": [
        _head_json(h5.length, h5.fork, h5.tree_hash, h5.signature, h5.roots),
        _head_json(wh.length, wh.fork, wh.tree_hash, wh.signature, wh.roots)],
        "proof": client.latest_proof.encode().hex() if client.latest_proof else ""}
    (tmp_path / "m" / EVIDENCE_FILE).write_text(json.dumps(doc))
    assert check_evidence(str(tmp_path / "m"), KP.public_key) is None
    f.close()
    again = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    assert not again.frozen  # as verify says: no evidence, no freeze
    again.close()
    w.close()
    evil.close()

"""The replica's signing rule (storage/quorum.py, FORMAT.md section 11) and the cluster
partition manifest.

A replica signs a proposed head only for the tree of what it holds and never two heads
that disagree within a fork, across crashes (the record is durable before the signature
is returned); hostile proposals are refused and leave no record behind."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.errors import ArchiveDamaged
from storage.fs import FaultyFileSystem, OsFileSystem
from storage.hypercore import Frontier, KeyPair
from storage.hypercore.multisig import assemble_quorum, verify_manifest_head, verify_partial
from storage.quorum import (
    PROMISED_FILE,
    SIGNED_FILE,
    RefusedToPromise,
    RefusedToSign,
    SignedRecord,
    Vote,
    partition_manifest,
    promise,
    read_promise,
    read_record,
    sign_proposal,
)
from storage.store import partition_key_name

KPS = [KeyPair.from_seed(bytes([0x21 + i]) * 32) for i in range(3)]
TID = uuid.UUID("0123456789abcdef0123456789abcdef")
MANIFEST = partition_manifest([kp.public_key for kp in KPS], TID, 0)


class Replica:
    """The blocks a replica holds, as trees by length (what `tree_at` reads)."""

    def __init__(self, blocks: list[bytes]) -> None:
        self.trees: list[bytes] = [Frontier().tree_hash()]
        f = Frontier()
        for b in blocks:
            f.append_data(b)
            self.trees.append(f.tree_hash())

    def tree_at(self, n: int) -> bytes | None:
        return self.trees[n] if n < len(self.trees) else None


def _blocks(n: int, salt: bytes = b"") -> list[bytes]:
    return [b"batch %d" % i + salt for i in range(n)]


def _sign(
    path: Path,
    r: Replica,
    fork: int,
    length: int,
    th: bytes | None = None,
    kp: int = 1,
    fs: OsFileSystem | None = None,
):  # type: ignore[no-untyped-def]
    tree = r.tree_at(length) if th is None else th
    assert tree is not None
    return sign_proposal(
        fs or OsFileSystem(), str(path), KPS[kp], MANIFEST, fork, length, tree, r.tree_at
    )


def test_partition_manifest_is_unique_per_partition_and_topic() -> None:
    keys = [kp.public_key for kp in KPS]
    assert MANIFEST.quorum == 2 and MANIFEST.version == 2
    assert MANIFEST.user_data == partition_key_name(TID, 0)
    others = {
        partition_manifest(keys, TID, 1).hash(),
        partition_manifest(keys, uuid.uuid4(), 0).hash(),
    }
    assert MANIFEST.hash() not in others and len(others) == 2
    assert partition_manifest(keys[::-1], TID, 0).hash() != MANIFEST.hash()  # order matters


def test_signs_what_it_holds_and_records_it_first(tmp_path: Path) -> None:
    r = Replica(_blocks(6))
    p1 = _sign(tmp_path, r, 0, 4)
    th4 = r.tree_at(4)
    assert th4 is not None and verify_partial(MANIFEST, p1, th4, 4, 0) and p1.signer == 1
    assert read_record(OsFileSystem(), str(tmp_path)) == SignedRecord(0, 4, th4)
    p2 = _sign(tmp_path, r, 0, 6)  # the same history, grown
    assert read_record(OsFileSystem(), str(tmp_path)) == SignedRecord(0, 6, r.tree_at(6))
    again = _sign(tmp_path, r, 0, 6)  # the same head again: the same signature
    assert again == p2
    (tmp_path / "leader").mkdir()
    leader = _sign(tmp_path / "leader", r, 0, 6, kp=0)
    sig = assemble_quorum(MANIFEST, [p2, leader])
    assert verify_manifest_head(MANIFEST, MANIFEST.hash(), r.trees[6], 6, 0, sig)


def test_refuses_a_tree_it_does_not_hold(tmp_path: Path) -> None:
    r = Replica(_blocks(5))
    with pytest.raises(RefusedToSign, match="not the tree"):
        _sign(tmp_path, r, 0, 5, th=Replica(_blocks(5, b"!")).trees[5])
    with pytest.raises(RefusedToSign, match="fewer"):
        _sign(tmp_path, r, 0, 9, th=bytes(32))
    with pytest.raises(RefusedToSign, match="nothing"):
        _sign(tmp_path, r, 0, 0)
    assert not (tmp_path / SIGNED_FILE).exists()


def test_never_two_disagreeing_heads_in_a_fork(tmp_path: Path) -> None:
    r = Replica(_blocks(5))
    _sign(tmp_path, r, 3, 5)
    # its blocks were replaced by another history (no fork change): refuse to grow it
    other = Replica(_blocks(5, b"?") + _blocks(2))
    with pytest.raises(RefusedToSign, match="no longer form the tree"):
        _sign(tmp_path, other, 3, 7)
    with pytest.raises(RefusedToSign, match="below length 5"):
        _sign(tmp_path, r, 3, 4)
    with pytest.raises(RefusedToSign, match="older than fork 3"):
        _sign(tmp_path, r, 2, 5)
    assert read_record(OsFileSystem(), str(tmp_path)) == SignedRecord(3, 5, r.trees[5])
    # a new fork (a new leader epoch) may rewrite the unsigned tail: allowed
    _sign(tmp_path, other, 4, 7)
    assert read_record(OsFileSystem(), str(tmp_path)) == SignedRecord(4, 7, other.trees[7])


def test_a_non_signer_writes_no_record(tmp_path: Path) -> None:
    r = Replica(_blocks(2))
    outsider = KeyPair.from_seed(b"\x01" * 32)
    with pytest.raises(ValueError, match="not a declared signer"):
        sign_proposal(
            OsFileSystem(), str(tmp_path), outsider, MANIFEST, 0, 2, r.trees[2], r.tree_at
        )
    assert not (tmp_path / SIGNED_FILE).exists()


def test_a_damaged_record_refuses_everything(tmp_path: Path) -> None:
    r = Replica(_blocks(3))
    _sign(tmp_path, r, 0, 2)
    data = bytearray((tmp_path / SIGNED_FILE).read_bytes())
    data[20] ^= 1
    (tmp_path / SIGNED_FILE).write_bytes(bytes(data))
    with pytest.raises(ArchiveDamaged, match="CRC"):
        _sign(tmp_path, r, 0, 3)
    (tmp_path / SIGNED_FILE).write_bytes(b"short")
    with pytest.raises(ArchiveDamaged):
        _sign(tmp_path, r, 5, 3)


def test_the_record_survives_a_crash_right_after_signing(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    r = Replica(_blocks(4))
    _sign(tmp_path, r, 1, 4, fs=fs)
    fs.crash()
    assert read_record(OsFileSystem(), str(tmp_path)) == SignedRecord(1, 4, r.trees[4])
    other = Replica(_blocks(4, b"x"))
    with pytest.raises(RefusedToSign):
        _sign(tmp_path, other, 1, 4)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(1, 6)), max_size=12))
def test_signed_heads_never_disagree_within_a_fork(ops: list[tuple[int, int, int]]) -> None:
    """Any sequence of proposals from two histories on a few forks: whatever is signed
    within one fork is one history (each signed head is a prefix of the next)."""
    import tempfile

    hist = [Replica(_blocks(6)), Replica(_blocks(6, b"b"))]
    with tempfile.TemporaryDirectory() as d:
        signed: dict[int, list[tuple[int, bytes]]] = {}
        for fork, h, length in ops:
            try:
                _sign(Path(d), hist[h], fork, length)
            except RefusedToSign:
                continue
            signed.setdefault(fork, []).append((length, hist[h].trees[length]))
        for heads in signed.values():
            for (la, ta), (lb, tb) in itertools.pairwise(heads):
                assert lb >= la
                # the later head's history at la is the earlier head's tree
                later = next(x for x in hist if x.trees[lb] == tb)
                assert later.trees[la] == ta


def test_a_vote_promises_the_epoch_before_answering(tmp_path: Path) -> None:
    """A failover vote for epoch E is durable before it is answered, is answered again for
    the same E, is refused for an older one, and from then on no fork older than E is
    signed: a deposed leader cannot complete a head behind the election's back."""
    fs = OsFileSystem()
    r = Replica(_blocks(6))
    _sign(tmp_path, r, 0, 4)
    # stored head at 2 (a quorum head that reached it); signed record at 4: the vote is 4
    v = promise(fs, str(tmp_path), 3, (0, 2, r.trees[2]), r.tree_at)
    assert v == Vote(3, 0, 4, r.trees[4]) and read_promise(fs, str(tmp_path)) == 3
    assert (tmp_path / PROMISED_FILE).stat().st_size == 24
    assert promise(fs, str(tmp_path), 3, (0, 2, r.trees[2]), r.tree_at) == v  # a retry
    with pytest.raises(RefusedToPromise, match="older than epoch 3"):
        promise(fs, str(tmp_path), 2, None, r.tree_at)
    with pytest.raises(RefusedToPromise, match="start at 1"):
        promise(fs, str(tmp_path), 0, None, r.tree_at)
    # the old leader (fork 0) asks it to grow its head: refused, also for a fork below 3
    with pytest.raises(RefusedToSign, match="promised a vote"):
        _sign(tmp_path, r, 0, 6)
    with pytest.raises(RefusedToSign, match="promised a vote"):
        _sign(tmp_path, r, 2, 6)
    assert read_record(fs, str(tmp_path)) == SignedRecord(0, 4, r.trees[4])
    _sign(tmp_path, r, 3, 6)  # the new leader's fork
    assert read_record(fs, str(tmp_path)) == SignedRecord(3, 6, r.trees[6])
    assert promise(fs, str(tmp_path), 4, None, r.tree_at) == Vote(4, 3, 6, r.trees[6])


def test_a_vote_answers_only_heads_whose_blocks_it_holds(tmp_path: Path) -> None:
    fs = OsFileSystem()
    r = Replica(_blocks(6))
    _sign(tmp_path, r, 1, 6)
    short = Replica(_blocks(3))  # it lost the signed tail (a reopen cut it)
    assert promise(fs, str(tmp_path), 2, (1, 3, short.trees[3]), short.tree_at) == Vote(
        2, 1, 3, short.trees[3]
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert promise(fs, str(empty), 1, None, short.tree_at).rank == (0, 0)


def test_a_damaged_promise_refuses_votes_and_signatures(tmp_path: Path) -> None:
    fs = OsFileSystem()
    r = Replica(_blocks(3))
    promise(fs, str(tmp_path), 5, None, r.tree_at)
    data = bytearray((tmp_path / PROMISED_FILE).read_bytes())
    data[9] ^= 1
    (tmp_path / PROMISED_FILE).write_bytes(bytes(data))
    with pytest.raises(ArchiveDamaged, match="CRC"):
        promise(fs, str(tmp_path), 6, None, r.tree_at)
    with pytest.raises(ArchiveDamaged, match="CRC"):
        _sign(tmp_path, r, 9, 3)
    assert not (tmp_path / SIGNED_FILE).exists()


def test_the_promise_survives_a_crash_right_after_the_vote(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    r = Replica(_blocks(3))
    promise(fs, str(tmp_path), 2, None, r.tree_at)
    fs.crash()
    assert read_promise(OsFileSystem(), str(tmp_path)) == 2
    with pytest.raises(RefusedToSign, match="promised a vote"):
        _sign(tmp_path, r, 1, 3)


def test_manifest_partition_reads_the_index_back() -> None:
    from storage.quorum import manifest_partition

    keys = [kp.public_key for kp in KPS]
    assert manifest_partition(MANIFEST) == 0
    assert manifest_partition(partition_manifest(keys, TID, 12)) == 12
    from storage.hypercore import Manifest

    assert manifest_partition(Manifest.default(KPS[0].public_key)) is None

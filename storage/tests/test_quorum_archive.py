"""Quorum-signed archives on disk: head slots with a quorum signature, the `manifest`
file, a mirror (FollowerLog) storing one, and offline `verify` of it.

Single-signer archives must not change by a byte: their 68-byte signature stays inline
at offset 80 with the flag clear (checked here against the slot layout)."""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path

import pytest

from storage.batch import build_batch
from storage.cli import _signer
from storage.errors import StorageError
from storage.follower import PUBLIC_KEY_FILE, FollowerLog, VerificationFailed
from storage.format import FLAG_CLEAN, FLAG_LONG_SIGNATURE, SLOT_SIZE, Head, read_head_slots
from storage.fs import OsFileSystem
from storage.hypercore import KeyPair, Manifest, Node, sign_raw, signable
from storage.hypercore.multisig import (
    PartialSignature,
    assemble,
    assemble_quorum,
    multisig_manifest,
    sign_partial,
)
from storage.manifest_file import MANIFEST_FILE
from storage.replication import MemoryArchive, ReplicationSession
from storage.tests.test_follower import _pump
from storage.verify import verify_partition

KPS = [KeyPair.from_seed(bytes([0x51 + i]) * 32) for i in range(3)]
MANIFEST = multisig_manifest([kp.public_key for kp in KPS])  # quorum 2 of 3


def _head(sig: bytes, roots: int = 3) -> Head:
    rs = tuple(
        Node(2**k - 1 + 2**k * j, 10, bytes([j]) * 32) for j, k in enumerate([5, 3, 1][:roots])
    )
    return Head(0, 42, 30, b"\x07" * 32, sig, 99, 0, 0, rs, seq=4, flags=FLAG_CLEAN | (1 << 8))


def test_single_signer_signature_stays_inline() -> None:
    h = _head(b"\xab" * 68)
    slot = h.encode()
    assert slot[80:148] == b"\xab" * 68
    assert struct.unpack_from("<I", slot, 12)[0] & FLAG_LONG_SIGNATURE == 0
    assert Head.decode(slot) == h


@pytest.mark.parametrize("n", [0, 1, 134, 200, 794])
def test_other_signatures_follow_the_roots(n: int) -> None:
    sig = bytes(range(256)) * 4
    h = _head(sig[:n], roots=3)
    slot = h.encode()
    assert slot[80:148] == bytes(68)
    assert struct.unpack_from("<I", slot, 12)[0] & FLAG_LONG_SIGNATURE
    tail = 208 + 3 * 48
    assert struct.unpack_from("<H", slot, tail)[0] == n and slot[tail + 2 : tail + 2 + n] == sig[:n]
    back = Head.decode(slot)
    assert back == h and back is not None and back.flags == h.flags  # the flag is format-only


def test_a_signature_that_does_not_fit_is_refused() -> None:
    with pytest.raises(StorageError, match="does not fit"):
        _head(bytes(SLOT_SIZE)).encode()


def test_a_long_signature_length_past_the_slot_is_a_torn_slot() -> None:
    slot = bytearray(_head(bytes(134)).encode())
    struct.pack_into("<H", slot, 208 + 3 * 48, 4000)
    import crc32c

    struct.pack_into("<I", slot, 8, crc32c.crc32c(bytes(slot[12:])))
    assert Head.decode(bytes(slot)) is None


def _batches(n: int) -> list[bytes]:
    out, off = [], 0
    for i in range(n):
        b = build_batch([b"v%d" % i, b"w%d" % i], timestamp_ms=1000 + i)
        struct.pack_into(">q", b, 0, off)  # baseOffset, as a writer stamps it
        off += 2
        out.append(bytes(b))
    return out


def _source(n: int) -> MemoryArchive:
    src = MemoryArchive.create_multisig(MANIFEST, [KPS[1], KPS[2]])
    bs = _batches(n)
    for i in range(0, n, 4):
        src.append(*bs[i : i + 4])
    return src


def _mirror(path: Path, src: MemoryArchive) -> FollowerLog:
    lg = FollowerLog.open_replica(path, MANIFEST)
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, lg, initiator=True, have=lg.verified_tree())
    _pump(client, server)
    return lg


def test_mirror_stores_and_verifies_a_quorum_signed_archive(tmp_path: Path) -> None:
    src = _source(10)
    lg = _mirror(tmp_path / "p", src)
    assert lg.key == MANIFEST.hash() and lg.head_signer == MANIFEST
    assert lg.head is not None and lg.head.length == 10 and lg.high_watermark == 20
    assert lg.head.signature == src.head().signature and len(lg.head.signature) == 134
    assert (tmp_path / "p" / MANIFEST_FILE).read_bytes() == MANIFEST.encode()
    assert not (tmp_path / "p" / PUBLIC_KEY_FILE).exists()
    lg.close()
    # reopening runs recovery, which checks the stored quorum head
    lg = FollowerLog.open_replica(tmp_path / "p", MANIFEST)
    assert lg.head is not None and lg.head.length == 10
    src.append(*_batches(13)[10:])
    lg.close()
    lg = _mirror(tmp_path / "p", src)
    assert lg.head is not None and lg.head.length == 13
    lg.close()
    res = verify_partition(str(tmp_path / "p"), MANIFEST)
    assert res.ok and res.length == 13 and res.signed_length == 13, res
    # one signer's key alone is not what signs this archive
    assert not verify_partition(str(tmp_path / "p"), KPS[1].public_key).ok


def test_another_signer_or_manifest_is_refused(tmp_path: Path) -> None:
    _mirror(tmp_path / "p", _source(2)).close()
    with pytest.raises(VerificationFailed, match="quorum-signed"):
        FollowerLog.open_replica(tmp_path / "p", KPS[0].public_key)
    other = multisig_manifest([kp.public_key for kp in KPS], 3)
    with pytest.raises(VerificationFailed, match="another manifest"):
        FollowerLog.open_replica(tmp_path / "p", other)


def _rewrite_head(path: Path, signature: bytes) -> None:
    fs = OsFileSystem()
    fd = fs.open(str(path / "head"), os.O_RDWR)
    try:
        head, _ = read_head_slots(fs, fd)
        assert head is not None
        new = Head(**{**head.__dict__, "signature": signature, "seq": head.seq + 1})
        fs.pwrite_all(fd, new.encode(), (new.seq % 2) * SLOT_SIZE)
    finally:
        fs.close(fd)


def test_verify_rejects_a_head_below_quorum_and_tampered_data(tmp_path: Path) -> None:
    src = _source(6)
    _mirror(tmp_path / "p", src).close()
    h = src.head()
    th = src.frontier.tree_hash()
    one = assemble([sign_partial(KPS[0], MANIFEST, th, h.length, h.fork)])
    _rewrite_head(tmp_path / "p", one)
    res = verify_partition(str(tmp_path / "p"), MANIFEST)
    assert not res.ok and "not signed by a quorum (2 of 3)" in res.reason, res
    # two proofs, but the second by a non-signer posing as signer 2
    outsider = KeyPair.from_seed(b"\x66" * 32)
    msg = signable(MANIFEST.hash(), th, h.length, h.fork)
    forged = assemble(
        [
            sign_partial(KPS[0], MANIFEST, th, h.length, h.fork),
            PartialSignature(2, sign_raw(outsider, msg)),
        ]
    )
    _rewrite_head(tmp_path / "p", forged)
    assert "not signed by a quorum" in verify_partition(str(tmp_path / "p"), MANIFEST).reason
    # a valid quorum again, then one flipped byte in a batch
    good = assemble([sign_partial(kp, MANIFEST, th, h.length, h.fork) for kp in KPS[1:]])
    _rewrite_head(tmp_path / "p", good)
    assert verify_partition(str(tmp_path / "p"), MANIFEST).ok
    log_file = tmp_path / "p" / f"{0:020d}.log"
    data = bytearray(log_file.read_bytes())
    data[-3] ^= 1
    log_file.write_bytes(bytes(data))
    res = verify_partition(str(tmp_path / "p"), MANIFEST)
    assert not res.ok and res.first_bad_offset is not None


def test_cli_picks_the_manifest_and_checks_it_against_the_catalog(tmp_path: Path) -> None:
    _mirror(tmp_path / "p", _source(2)).close()
    signer, why = _signer(str(tmp_path / "p"), None, [MANIFEST.hash()])
    assert signer == MANIFEST and why is None
    _s, why = _signer(str(tmp_path / "p"), None, [bytes(32)])
    assert why == "manifest does not match the catalog's archive key"
    (tmp_path / "p" / MANIFEST_FILE).write_bytes(b"\x01\x00")
    _s, why = _signer(str(tmp_path / "p"), None, [MANIFEST.hash()])
    assert why is not None and "manifest" in why


# ------------------------------------------------- a quorum-signed topic in a data dir


def _quorum_log(tmp_path: Path, m: Manifest | None, held: list[bytes]):  # type: ignore[no-untyped-def]
    """A Store whose topic "q" (1 partition) is quorum-signed by three brokers (KPS): this
    node and two replicas that sign through the signing rule (storage/quorum.py) over
    the tree of `held`, the batches "sent" to them, hashed on their own. Creates the
    topic when `m` is None."""
    from storage.hypercore import Frontier
    from storage.log import FsyncPolicy
    from storage.quorum import partition_manifest, sign_proposal
    from storage.store import Store

    st = Store.open(tmp_path / "d", fsync=FsyncPolicy.NEVER)
    if m is None:
        tid = uuid.uuid4()
        m = partition_manifest([kp.public_key for kp in KPS], tid, 0)
        st.create_topic("q", 1, {}, topic_id=tid, manifests=[m])
    lg = st.log("q", 0)
    assert lg.key == m.hash() == st.archive_key("q", 0)

    def tree_at(k: int) -> bytes | None:
        if k > len(held):
            return None
        f = Frontier()
        for blk in held[:k]:
            f.append_data(blk)
        return f.tree_hash()

    def quorum_sign(th: bytes, length: int, fork: int) -> bytes:
        parts = []
        for i in (1, 2):
            d = tmp_path / f"replica{i}"
            d.mkdir(exist_ok=True)
            parts.append(
                sign_proposal(OsFileSystem(), str(d), KPS[i], m, fork, length, th, tree_at)
            )
        return assemble_quorum(m, parts)

    lg.quorum_sign = quorum_sign
    return st, lg, m


def test_verify_command_checks_a_quorum_signed_topic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from storage.cli import verify_command

    held: list[bytes] = []
    st, lg, m = _quorum_log(tmp_path, None, held)
    lg.quorum_sign = None  # no replicas: the writer must not sign alone
    with pytest.raises(StorageError, match="not signed alone"):
        lg.append(build_batch([b"x"], timestamp_ms=1))
        lg.commit()
    st.close()
    # reopened: the unsigned block is cut (nobody acknowledged it), then replicas sign
    st, lg, m = _quorum_log(tmp_path, m, held)
    assert lg.log_end_offset == 0
    for i in range(4):
        b = build_batch([b"a%d" % i, b"b%d" % i], timestamp_ms=10 + i)
        lg.append(b)
        held.append(bytes(b))  # as stamped by the writer: what it sends its replicas
        lg.commit()
    assert lg.head is not None and lg.head.length == 4 and len(lg.head.signature) == 134
    st.close()
    assert verify_command(str(tmp_path / "d"), None) == 0
    assert "ok q 0 4 blocks, 4 signed" in capsys.readouterr().out
    # a flipped byte in a stored batch: BAD, naming where
    seg = tmp_path / "d" / "q-0" / f"{0:020d}.log"
    data = bytearray(seg.read_bytes())
    data[-2] ^= 1
    seg.write_bytes(bytes(data))
    assert verify_command(str(tmp_path / "d"), None) == 1
    assert "BAD q 0 6" in capsys.readouterr().out
    data[-2] ^= 1
    seg.write_bytes(bytes(data))
    # a head carrying one signer only (below the quorum): BAD, saying so
    fs = OsFileSystem()
    fd = fs.open(str(tmp_path / "d" / "q-0" / "head"), os.O_RDONLY)
    h = read_head_slots(fs, fd)[0]
    fs.close(fd)
    assert h is not None
    good = h.signature
    _rewrite_head(
        tmp_path / "d" / "q-0", assemble([sign_partial(KPS[1], m, h.tree_hash, 4, h.fork)])
    )
    assert verify_command(str(tmp_path / "d"), None) == 1
    assert "head is not signed by a quorum (2 of 3)" in capsys.readouterr().out
    _rewrite_head(tmp_path / "d" / "q-0", good)
    assert verify_command(str(tmp_path / "d"), None) == 0
    capsys.readouterr()
    # a manifest swapped for another: BAD, it is not the archive the catalog signed
    other = multisig_manifest([kp.public_key for kp in KPS], 3, m.user_data)
    (tmp_path / "d" / "q-0" / MANIFEST_FILE).write_bytes(other.encode())
    assert verify_command(str(tmp_path / "d"), None) == 1
    assert "BAD q 0 - manifest does not match the catalog's archive key" in capsys.readouterr().out
    # and the store refuses to open it as the catalog's archive
    from storage.log import FsyncPolicy
    from storage.store import Store

    st = Store.open(tmp_path / "d", fsync=FsyncPolicy.NEVER)
    with pytest.raises(StorageError, match="not the catalog's"):
        st.log("q", 0)
    st.close()


def _one_signed(tmp_path: Path):  # type: ignore[no-untyped-def]
    """`_quorum_log` with one batch appended and quorum-signed: (store, log, manifest,
    the batches its replicas hold)."""
    held: list[bytes] = []
    st, lg, m = _quorum_log(tmp_path, None, held)
    b = build_batch([b"a"], timestamp_ms=1)
    lg.append(b)
    held.append(bytes(b))
    lg.commit()
    return st, lg, m, held


def test_a_quorum_signature_that_does_not_verify_is_never_stored(tmp_path: Path) -> None:
    st, lg, m, held = _one_signed(tmp_path)
    assert lg.head is not None and lg.head.length == 1
    lg.quorum_sign = lambda th, n, f: assemble([sign_partial(KPS[1], m, th, n, f)])  # one signer
    lg.append(build_batch([b"b"], timestamp_ms=2))
    with pytest.raises(StorageError, match="does not verify"):
        lg.commit()
    st.close()
    st, lg, m = _quorum_log(tmp_path, m, held)
    assert lg.head is not None and lg.head.length == 1 and lg.log_end_offset == 1
    st.close()


def test_close_does_not_ask_the_quorum_signer(tmp_path: Path) -> None:
    """At close nobody is asked to sign: the signer reaches the replicas through the
    broker's event loop, which waits for the close (asked, a broker's shutdown hung for
    ever). The unsigned tail stays on disk past the clean head; the next open cuts it."""
    st, lg, m, held = _one_signed(tmp_path)

    asked: list[int] = []

    def sign(th: bytes, n: int, f: int) -> bytes:
        asked.append(n)
        raise AssertionError("the signer was asked at close")

    lg.quorum_sign = sign
    lg.append(build_batch([b"b"], timestamp_ms=2))  # appended, not committed
    st.close()
    assert asked == []
    st, lg, m = _quorum_log(tmp_path, m, held)
    assert lg.head is not None and lg.head.length == 1 and lg.log_end_offset == 1
    st.close()


def test_a_replica_signs_only_the_blocks_it_holds(tmp_path: Path) -> None:
    """A replica (FollowerLog of the quorum archive) takes the leader's blocks before any
    head covers them, signs the proposed head over them, and the quorum head it helped
    make is then stored; a proposal for another history is refused, also after a crash."""
    from storage.hypercore import leaf_hash
    from storage.quorum import RefusedToSign, read_record

    leader = _source(0)
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    bs = _batches(6)
    leader.append(*bs[:4])
    for i, b in enumerate(bs[:4]):
        replica.append_block(i, b, leaf_hash(b))
    th = leader.frontier.tree_hash()
    p = replica.sign_held(KPS[0], 0, 4, th)
    assert p.signer == 0 and read_record(OsFileSystem(), str(tmp_path / "r")) is not None
    with pytest.raises(RefusedToSign, match="not the tree"):
        replica.sign_held(KPS[0], 0, 4, bytes(32))
    with pytest.raises(RefusedToSign, match="fewer"):
        replica.sign_held(KPS[0], 0, 5, th)
    sig = assemble_quorum(MANIFEST, [p, sign_partial(KPS[2], MANIFEST, th, 4, 0)])
    assert replica.accept_head(4, 0, sig, leader.frontier.roots())
    assert replica.head is not None and replica.head.length == 4
    # the stored head's tree is what it signed: signing it again is idempotent
    assert replica.sign_held(KPS[0], 0, 4, th) == p
    # two more blocks; then a crash before any head covers them
    leader.append(*bs[4:])
    for i in (4, 5):
        replica.append_block(i, bs[i], leaf_hash(bs[i]))
    th6 = leader.frontier.tree_hash()
    replica.sign_held(KPS[0], 0, 6, th6)
    replica.close()
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    assert replica.head is not None and replica.head.length == 4  # the unsigned tail is gone
    # another history at length 6 in the same fork: refused (it signed one already)
    other = _batches(6)
    alt = build_batch([b"other", b"history"], timestamp_ms=7)
    struct.pack_into(">q", alt, 0, 10)  # a valid batch at the same offset, other records
    other[5] = bytes(alt)
    for i in (4, 5):
        replica.append_block(i, other[i], leaf_hash(other[i]))
    f = replica.verified_tree()
    for b in other[4:]:
        f.append_data(b)
    with pytest.raises(RefusedToSign, match="not the tree"):
        replica.sign_held(KPS[0], 0, 6, th6)
    with pytest.raises(RefusedToSign, match="no longer form the tree"):
        replica.sign_held(KPS[0], 0, 6, f.tree_hash())
    replica.sign_held(KPS[0], 1, 6, f.tree_hash())  # a new fork may: the tail was never a quorum's
    replica.close()
    single = FollowerLog.open_replica(tmp_path / "s", KPS[0].public_key)
    with pytest.raises(StorageError, match="not a quorum-signed"):
        single.sign_held(KPS[0], 0, 1, bytes(32))
    single.close()


def test_a_replica_that_signed_blocks_then_replicates_their_head(tmp_path: Path) -> None:
    """Blocks a replica took from its leader's proposal (and signed) are delivered again
    by the replication session once a quorum head covers them: the same bytes are kept
    (no error, no second copy) and the head is stored over them."""
    from storage.hypercore import leaf_hash

    src = _source(0)
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    bs = _batches(4)
    for i, b in enumerate(bs[:3]):
        replica.append_block(i, b, leaf_hash(b))  # the proposal's blocks
    src.append(*bs)  # the quorum head over 4 blocks, 3 of which the replica holds
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(
        src.key, replica, initiator=True, have=replica.verified_tree()
    )
    _pump(client, server)
    assert replica.head is not None and replica.head.length == 4 and replica.length == 4
    assert [replica.log.block(i) for i in range(4)] == bs
    replica.close()
    assert verify_partition(str(tmp_path / "r"), MANIFEST).ok


def test_a_replica_votes_its_longest_head_it_still_holds(tmp_path: Path) -> None:
    """FollowerLog.vote: the head it signed past its stored one while it holds those
    blocks (an acknowledged write may live on only as that), its stored head once a
    reopen cut them; the promise holds across the reopen."""
    from storage.hypercore import leaf_hash
    from storage.quorum import RefusedToPromise, RefusedToSign

    leader = _source(0)
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    bs = _batches(6)
    leader.append(*bs[:4])
    for i, b in enumerate(bs[:4]):
        replica.append_block(i, b, leaf_hash(b))
    th4 = leader.frontier.tree_hash()
    p = replica.sign_held(KPS[0], 0, 4, th4)
    sig = assemble_quorum(MANIFEST, [p, sign_partial(KPS[2], MANIFEST, th4, 4, 0)])
    assert replica.accept_head(4, 0, sig, leader.frontier.roots())
    leader.append(*bs[4:])
    for i in (4, 5):
        replica.append_block(i, bs[i], leaf_hash(bs[i]))
    th6 = leader.frontier.tree_hash()
    replica.sign_held(KPS[0], 0, 6, th6)
    v = replica.vote(1)
    assert (v.epoch, v.fork, v.length, v.tree_hash) == (1, 0, 6, th6)
    with pytest.raises(RefusedToSign, match="promised"):
        replica.sign_held(KPS[0], 0, 6, th6)
    replica.close()
    replica = FollowerLog.open_replica(tmp_path / "r", MANIFEST)
    v = replica.vote(1)
    assert (v.fork, v.length, v.tree_hash) == (0, 4, th4)
    with pytest.raises(RefusedToPromise):
        replica.vote(0)
    replica.close()
    single = FollowerLog.open_replica(tmp_path / "s", KPS[0].public_key)
    with pytest.raises(StorageError, match="not a quorum-signed"):
        single.vote(1)
    single.close()

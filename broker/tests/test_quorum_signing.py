"""The propose/sign channel of quorum-signed partitions (broker/cluster/signing.py): a
leader's real quorum archive (a Store topic with a 2-of-3 manifest), two replicas' real
follower archives signing through the signing rule, and an in-process transport that
carries every message through its codec. The placement side: test_quorum_placement.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from broker.cluster.signing import (
    Answer,
    MessageError,
    NotEnoughSigners,
    Proposal,
    QuorumAssembler,
    ReplicaSigner,
)
from storage.batch import build_batch
from storage.errors import StorageError
from storage.follower import FollowerLog
from storage.fs import OsFileSystem
from storage.hypercore import Frontier, KeyPair
from storage.hypercore.multisig import verify_manifest_head
from storage.log import FsyncPolicy, PartitionLog
from storage.quorum import partition_manifest, read_record
from storage.store import Store

KPS = [KeyPair.from_seed(bytes([0x61 + i]) * 32) for i in range(4)]  # brokers 1, 2, 3 (+ 4)
LEADER = 1


class Net:
    """Brokers 2 and 3 answer through their ReplicaSigner, every message encoded and
    decoded on the way; `dead` ones never answer; `sender` is who the replica is told
    sent it (the transport authenticates it)."""

    def __init__(self, signers: dict[int, ReplicaSigner]) -> None:
        self.signers = signers
        self.dead: set[int] = set()
        self.sender = LEADER
        self.sent: list[tuple[int, Proposal]] = []

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        if node_id in self.dead:
            await trio.sleep_forever()
        p = Proposal.decode(proposal.encode(), 1 << 20)
        self.sent.append((node_id, p))
        a = await trio.to_thread.run_sync(self.signers[node_id].handle, self.sender, p)
        return Answer.decode(a.encode())


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.tid = uuid.uuid4()
        self.manifest = partition_manifest([kp.public_key for kp in KPS[:3]], self.tid, 0)
        self.store = Store.open(tmp_path / "leader", fsync=FsyncPolicy.ALWAYS)
        self.store.create_topic("q", 1, {}, topic_id=self.tid, manifests=[self.manifest])
        self.lg: PartitionLog = self.store.log("q", 0)
        self.replicas = {
            i: FollowerLog.open_replica(tmp_path / f"r{i}", self.manifest) for i in (2, 3)
        }
        self.signers = {
            i: ReplicaSigner(KPS[i - 1], self._archive(i), lambda _k: LEADER) for i in (2, 3)
        }
        self.net = Net(self.signers)
        self.asm = QuorumAssembler(
            LEADER, KPS[0], self.manifest, [1, 2, 3], self.net, self.lg.block,
            lambda: self.lg.published_length, timeout_s=0.5,
        )  # fmt: skip
        self.lg.quorum_sign = lambda th, n, f: trio.from_thread.run(self.asm.sign, th, n, f)

    def _archive(self, i: int) -> Callable[[bytes], FollowerLog | None]:
        return lambda key: self.replicas[i] if key == self.manifest.hash() else None

    async def produce(self, *values: bytes) -> None:
        for v in values:
            self.lg.append(build_batch([v], timestamp_ms=1_700_000_000_000))
        await trio.to_thread.run_sync(self.lg.commit)

    def close(self) -> None:
        # closing commits what is pending: outside the test's trio run now, its own run
        self.net.dead = set()
        self.lg.quorum_sign = lambda th, n, f: trio.run(self.asm.sign, th, n, f)
        self.store.close()
        for r in self.replicas.values():
            r.close()


@pytest.fixture
def s(tmp_path: Path) -> Setup:
    setup = Setup(tmp_path)
    yield setup  # type: ignore[misc]
    setup.close()


def _tree(blocks: list[bytes]) -> bytes:
    f = Frontier()
    for b in blocks:
        f.append_data(b)
    return f.tree_hash()


async def test_a_quorum_signs_each_head_and_replicas_hold_the_blocks(s: Setup) -> None:
    await s.produce(b"a", b"b")
    head = s.lg.head
    assert head is not None and head.length == 2
    assert verify_manifest_head(
        s.manifest, s.lg.key, head.tree_hash, head.length, head.fork, head.signature
    )
    # the first replica to answer sufficed (2 of 3, the leader counting)
    signed = [i for i in (2, 3) if read_record(OsFileSystem(), s.replicas[i].path)]
    assert signed and all(s.replicas[i].length == 2 for i in signed)
    rec = read_record(OsFileSystem(), s.replicas[signed[0]].path)
    assert rec is not None and (rec.fork, rec.length, rec.tree_hash) == (0, 2, head.tree_hash)
    await s.produce(b"c")  # the next proposal carries only the new block to those
    assert s.lg.head is not None and s.lg.head.length == 3
    last = [p for i, p in s.net.sent if i == signed[0]][-1]
    assert (last.start, len(last.blocks)) == (2, 1)


async def test_one_dead_replica_does_not_block_two_do(s: Setup) -> None:
    s.net.dead = {3}
    with trio.fail_after(5):
        await s.produce(b"a")
    assert s.lg.head is not None and s.lg.head.length == 1
    s.net.dead = {2, 3}
    with trio.fail_after(5):
        with pytest.raises(StorageError):  # NotEnoughSigners, raised through the commit
            await s.produce(b"b")
    assert s.lg.head is not None and s.lg.head.length == 1  # nothing unsigned published
    assert s.lg.high_watermark == 1


async def test_assembler_raises_not_enough_signers(s: Setup) -> None:
    s.net.dead = {2, 3}
    s.lg.append(build_batch([b"x"], timestamp_ms=1))
    with trio.fail_after(5), pytest.raises(NotEnoughSigners):
        await s.asm.sign(_tree([s.lg.block(0)]), 1, 0)


def _proposal(s: Setup, blocks: list[bytes], fork: int = 0, start: int = 0) -> Proposal:
    return Proposal(s.manifest.hash(), fork, start + len(blocks), _tree(blocks), start,
                    tuple(blocks))  # fmt: skip


def _stamped(*values: bytes) -> list[bytes]:
    """Batches as a leader stores them: consecutive base offsets."""
    out = []
    for off, v in enumerate(values):
        b = bytearray(build_batch([v], timestamp_ms=1))
        b[0:8] = off.to_bytes(8, "big")
        out.append(bytes(b))
    return out


def test_replica_signs_the_tree_of_what_it_holds(s: Setup) -> None:
    blocks = _stamped(b"a", b"b")
    a = s.signers[2].handle(LEADER, _proposal(s, blocks))
    assert a.signed and a.held == 2 and a.signer == 1
    # the same again is signed again (same history); the leader repeating held blocks
    assert s.signers[2].handle(LEADER, _proposal(s, blocks)).signed


def test_replica_refuses_a_proposal_that_disagrees_with_what_it_signed(s: Setup) -> None:
    assert s.signers[2].handle(LEADER, _proposal(s, _stamped(b"a", b"b"))).signed
    # another history at the same length and fork: its unsigned tail is replaced by the
    # new blocks, but the signing rule (on disk) refuses to sign a second tree there
    a = s.signers[2].handle(LEADER, _proposal(s, _stamped(b"x", b"y")))
    assert not a.signed and "no longer form the tree it signed" in a.reason
    # on a newer fork (a new leader epoch) the same is allowed: Hypercore's truncate
    assert s.signers[2].handle(LEADER, _proposal(s, _stamped(b"x", b"y"), fork=1)).signed
    # and an older fork never again
    a = s.signers[2].handle(LEADER, _proposal(s, _stamped(b"x", b"y", b"z"), fork=0))
    assert not a.signed and "older" in a.reason


def test_replica_refuses_a_tree_that_is_not_its_blocks(s: Setup) -> None:
    blocks = _stamped(b"a", b"b")
    p = _proposal(s, blocks)
    bad = Proposal(p.archive, 0, 2, _tree(_stamped(b"a", b"c")), 0, p.blocks)
    a = s.signers[2].handle(LEADER, bad)
    assert not a.signed and "not the tree of what it holds" in a.reason
    assert read_record(OsFileSystem(), s.replicas[2].path) is None  # nothing promised
    short = Proposal(p.archive, 0, 3, _tree([*blocks, blocks[0]]), 0, p.blocks)
    a = s.signers[2].handle(LEADER, short)  # a length past the blocks it holds
    assert not a.signed and "fewer" in a.reason


def test_replica_refuses_who_is_not_the_leader_or_not_its_archive(s: Setup) -> None:
    p = _proposal(s, _stamped(b"a"))
    a = s.signers[2].handle(3, p)  # broker 3 is a replica, not the placed leader
    assert not a.signed and "not the placed leader" in a.reason
    assert s.replicas[2].length == 0  # nothing stored from it
    other = ReplicaSigner(KPS[3], s.signers[2].archive, lambda _k: LEADER)
    a = other.handle(LEADER, p)  # a broker whose key is not in the manifest
    assert not a.signed and "not one of the archive's signers" in a.reason
    a = s.signers[2].handle(LEADER, Proposal(bytes(32), 0, 1, bytes(32), 0, p.blocks))
    assert not a.signed and a.reason == "no copy of this archive here"


def test_replica_refuses_malformed_batches_and_stores_nothing(s: Setup) -> None:
    good = _stamped(b"a")[0]
    bad = bytearray(good)
    bad[-1] ^= 0xFF  # CRC-32C no longer matches
    a = s.signers[2].handle(LEADER, _proposal(s, [bytes(bad)]))
    assert not a.signed and "not a valid record batch" in a.reason
    assert s.replicas[2].length == 0
    assert read_record(OsFileSystem(), s.replicas[2].path) is None


def test_replica_refuses_past_its_budget_and_asks_from_what_it_holds(s: Setup) -> None:
    small = ReplicaSigner(KPS[1], s.signers[2].archive, lambda _k: LEADER, max_bytes=10)
    a = small.handle(LEADER, _proposal(s, _stamped(b"a")))
    assert not a.signed and "budget" in a.reason
    blocks = _stamped(b"a", b"b", b"c")
    a = s.signers[2].handle(LEADER, Proposal(s.manifest.hash(), 0, 3, _tree(blocks), 2,
                                             (blocks[2],)))  # fmt: skip
    assert not a.signed and a.held == 0 and "send from there" in a.reason


async def test_leader_resends_from_what_a_replica_holds(s: Setup) -> None:
    await s.produce(b"a", b"b")
    # a replica that lost its copy (new disk) says it holds nothing: resent from 0
    s.net.dead = {3}
    s.asm.held[2] = 2
    s.replicas[2].close()
    fresh = s.replicas[2].path + "-new"
    s.replicas[2] = FollowerLog.open_replica(fresh, s.manifest)
    await s.produce(b"c")
    assert s.lg.head is not None and s.lg.head.length == 3
    starts = [p.start for i, p in s.net.sent if i == 2]
    assert starts[-2:] == [2, 0] and s.replicas[2].length == 3


def test_codec_bounds() -> None:
    p = Proposal(b"k" * 32, 1, 5, b"t" * 32, 3, (b"x" * 100, b"y"))
    assert Proposal.decode(p.encode(), 1000) == p
    with pytest.raises(MessageError):
        Proposal.decode(p.encode(), 50)  # past the budget, before allocating it
    with pytest.raises(MessageError):
        Proposal.decode(p.encode()[:-1], 1000)
    a = Answer(b"k" * 32, 1, 5, 4, 2, b"s" * 64)
    assert Answer.decode(a.encode()) == a and a.signed
    r = Answer(b"k" * 32, 1, 5, 4, reason="no")
    assert Answer.decode(r.encode()) == r and not r.signed
    with pytest.raises(MessageError):
        Answer.decode(a.encode() + b"\x00")


# ------------------------------------------- the channel over real replication connections


async def test_proposals_over_noise_connections_and_who_may_open_them(tmp_path: Path) -> None:
    """The leader's links reach brokers 2 and 3 over real replication connections (Noise
    with its node key, protomux, the ``hyperkafka/quorum`` channel): each replica takes
    the channel only from a broker of the cluster, identified by its Noise static key;
    a commit then gets its quorum head. A stranger's channel is rejected."""
    from broker.quorum_link import LinkPeers, QuorumLink, accept_proposals, serve_proposals
    from storage.replication.noise import Ed25519KeyPair
    from storage.replication.session import Connection
    from storage.replication.trio_driver import ConnectionDriver

    s = Setup(tmp_path)
    keys = {kp.public_key: i + 1 for i, kp in enumerate(KPS[:3])}
    try:
        async with trio.open_nursery() as nursery:

            async def connect(node_id: int) -> trio.abc.Stream:
                ours, theirs = trio.testing.memory_stream_pair()
                conn = Connection(initiator=False)
                send, recv = trio.open_memory_channel[Any](8)
                conn.accept = accept_proposals(conn, keys.get, send)
                driver = ConnectionDriver(theirs, conn)
                nursery.start_soon(driver.run)
                nursery.start_soon(serve_proposals, s.signers[node_id], recv, driver.kick)
                return ours

            def leader_keypair(kp: KeyPair) -> Ed25519KeyPair:
                return Ed25519KeyPair(kp.public_key, kp.secret_key)

            s.asm.peers = LinkPeers(leader_keypair(KPS[0]), connect, nursery)
            with trio.fail_after(10):
                await s.produce(b"a", b"b")
                assert s.lg.head is not None and s.lg.head.length == 2
                assert verify_manifest_head(
                    s.manifest, s.lg.key, s.lg.head.tree_hash, 2, 0, s.lg.head.signature
                )
            # a peer whose key is no broker's (KPS[3]): the channel is rejected, its
            # propose sees the channel closed
            stranger = QuorumLink(leader_keypair(KPS[3]))
            nursery.start_soon(stranger.run, await connect(2))
            with trio.fail_after(10), pytest.raises(trio.BrokenResourceError):
                await stranger.propose(_proposal(s, _stamped(b"x")))
            assert s.replicas[2].length == 2  # nothing of it stored
            nursery.cancel_scope.cancel()
    finally:
        s.close()

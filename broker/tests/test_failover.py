"""The failover vote of quorum-signed partitions (broker/cluster/failover.py): real
replica archives vote through their signing rule's promise, every message through its
codec; the controller elects the longest head among a majority, and once a majority
voted, the deposed leader cannot get another head signed. The placement's leader epochs
against a real etcd."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest
import trio

from broker.cluster.etcd import Etcd
from broker.cluster.failover import (
    VOTE,
    VOTE_REQUEST,
    ReplicaVoter,
    VoteAnswer,
    VoteRequest,
    choose_leader,
    elect,
    majority,
)
from broker.cluster.membership import Member, Membership, Placement
from broker.cluster.signing import ANSWER, PROPOSE, MessageError
from broker.tests.test_membership import _until
from broker.tests.test_quorum_signing import Setup
from compat_tests.etcd import EtcdServer
from storage.batch import build_batch
from storage.errors import StorageError
from storage.quorum import read_promise, read_record

CONTROLLER = 3


class Ballot:
    """Brokers 2 and 3 vote through their ReplicaVoter, every message encoded and
    decoded; `dead` ones never answer; `broken` ones fail the connection."""

    def __init__(self, voters: dict[int, ReplicaVoter]) -> None:
        self.voters = voters
        self.dead: set[int] = set()
        self.broken: set[int] = set()
        self.sender = CONTROLLER

    async def vote(self, node_id: int, request: VoteRequest) -> VoteAnswer:
        if node_id in self.dead:
            await trio.sleep_forever()
        if node_id in self.broken:
            raise trio.BrokenResourceError("connection reset")
        req = VoteRequest.decode(request.encode())
        a = await trio.to_thread.run_sync(self.voters[node_id].handle, self.sender, req)
        return VoteAnswer.decode(a.encode())


@pytest.fixture
def s(tmp_path: Path) -> Setup:
    setup = Setup(tmp_path)
    yield setup  # type: ignore[misc]
    setup.close()


def _ballot(s: Setup) -> Ballot:
    return Ballot({
        i: ReplicaVoter(lambda k, i=i: s.replicas[i] if k == s.manifest.hash() else None,
                        lambda: CONTROLLER)
        for i in (2, 3)
    })  # fmt: skip


def test_message_types_and_codec_bounds() -> None:
    assert len({PROPOSE, ANSWER, VOTE_REQUEST, VOTE}) == 4
    req = VoteRequest(bytes(range(32)), 7)
    assert VoteRequest.decode(req.encode()) == req
    a = VoteAnswer(bytes(32), 7, 2, 9, b"\x01" * 32)
    assert VoteAnswer.decode(a.encode()) == a and a.granted and a.rank == (2, 9)
    no = VoteAnswer(bytes(32), 7, reason="x" * 600)
    assert not VoteAnswer.decode(no.encode()).granted
    for bad in (b"", req.encode()[:20], req.encode() + b"\x00"):
        with pytest.raises(MessageError):
            VoteRequest.decode(bad)
    wrong_hash = bytes(32) + bytes([7, 2, 9, 5]) + b"\x01" * 5 + b"\x00"
    for bad in (b"", a.encode()[:40], a.encode() + b"!", wrong_hash):
        with pytest.raises(MessageError):
            VoteAnswer.decode(bad)


def test_choose_the_longest_head_among_a_majority() -> None:
    th = b"\x02" * 32
    v = {
        2: VoteAnswer(bytes(32), 5, 1, 10, th),
        3: VoteAnswer(bytes(32), 5, 0, 99, th),  # longer, but an older fork
        4: VoteAnswer(bytes(32), 5, 1, 10, th),  # a tie: the lowest id
        5: VoteAnswer(bytes(32), 5, reason="promised epoch 6"),
    }
    assert choose_leader(v, 3) == 2
    assert choose_leader(v, 4) is None  # a refusal is no vote
    assert choose_leader({3: v[3]}, 1) == 3
    assert choose_leader({}, 1) is None
    for perm in itertools.permutations(v.items()):
        assert choose_leader(dict(perm), 2) == 2


async def test_the_longest_signed_head_wins_and_the_old_leader_is_cut_off(s: Setup) -> None:
    """Replica 3 is down while the leader writes: replica 2 alone signed (with the
    leader) the acknowledged heads. The leader dies; the controller's vote among 2 and
    3 (a majority of 3) elects 2, whose head holds every acknowledged batch. The old
    leader, back, cannot have another head signed on its fork: both promised."""
    ballot = _ballot(s)
    s.net.dead = {3}
    await s.produce(b"a", b"b")
    await s.produce(b"c")
    acked = s.lg.head
    assert acked is not None and acked.length == 3
    assert s.replicas[3].length == 0 and read_record(s.store.fs, s.replicas[2].path)
    need = majority(s.manifest)
    assert need == 2
    with trio.fail_after(5):
        e = await elect(s.manifest.hash(), 1, [2, 3], need, ballot, timeout_s=1)
    assert e is not None and e.leader == 2 and (e.fork, e.length) == (0, 3)
    assert e.votes[3].granted and e.votes[3].length == 0
    assert all(read_promise(s.store.fs, s.replicas[i].path) == 1 for i in (2, 3))
    # the deposed leader goes on writing on its fork 0: no replica signs it any more
    s.net.dead = set()
    with trio.fail_after(10), pytest.raises(StorageError):
        await s.produce(b"d")
    assert s.lg.head is not None and s.lg.head.length == 3
    rec = read_record(s.store.fs, s.replicas[2].path)
    assert rec is not None and (rec.fork, rec.length) == (0, 3)


async def test_an_election_needs_a_majority_of_answers(s: Setup) -> None:
    ballot = _ballot(s)
    await s.produce(b"a")
    ballot.dead = {3}
    with trio.fail_after(5):
        assert await elect(s.manifest.hash(), 1, [2, 3], 2, ballot, timeout_s=0.3) is None
    ballot.dead, ballot.broken = set(), {3}
    assert await elect(s.manifest.hash(), 1, [2, 3], 2, ballot, timeout_s=0.3) is None
    ballot.broken = set()
    ballot.sender = 2  # not the controller: no promise made
    assert await elect(s.manifest.hash(), 2, [2, 3], 2, ballot, timeout_s=0.3) is None
    assert read_promise(s.store.fs, s.replicas[3].path) == 0
    ballot.sender = CONTROLLER
    e = await elect(s.manifest.hash(), 2, [2, 3], 2, ballot, timeout_s=0.3)
    assert e is not None and e.length == 1
    # an older epoch is refused now by both
    assert await elect(s.manifest.hash(), 1, [2, 3], 2, ballot, timeout_s=0.3) is None
    assert await elect(bytes(32), 3, [2, 3], 1, ballot, timeout_s=0.3) is None  # no copy


# ----------------------------------------------------------------- the placement


def test_placement_leader_epochs_round_trip() -> None:
    p = Placement("t", 1, 3, {"a": "b"}, 3, ((1, 2, 3), (1, 3, 2), (1, 2, 3)))
    assert Placement.decode("t", p.encode()) == p and b"leaders" not in p.encode()
    assert [p.leader_of(i) for i in range(3)] == [1, 1, 1] and p.epoch_of(2) == 0
    q = p.with_leader(1, 3, 4)
    assert q.leaders == (1, 3, 1) and q.leader_epochs == (0, 4, 0)
    assert Placement.decode("t", q.encode()) == q and q.encode() == Placement.decode("t", q.encode()).encode()


async def test_record_leader_is_fenced_and_grows_the_epoch(etcd: EtcdServer) -> None:
    ms = [
        Membership(Etcd([etcd.endpoint]), "f", Member(i, "127.0.0.1", 9000 + i, "r", f"{i:064x}"), 3)
        for i in (1, 2)
    ]  # fmt: skip
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for m in ms:
                await nursery.start(m.run)
            await _until(lambda: any(m.is_controller for m in ms))
            ctl = next(m for m in ms if m.is_controller)
            other = next(m for m in ms if not m.is_controller)
            assert await ctl.place(Placement("t", 1, 2, {}, 2, ((1, 2), (1, 2))))
            assert await ctl.record_leader("t", 0, 2, 1) is True
            assert await ctl.record_leader("t", 0, 1, 1) is False  # not a newer epoch
            assert await ctl.record_leader("nope", 0, 2, 5) is False
            assert await other.record_leader("t", 1, 2, 1) is None  # not the controller
            await _until(lambda: bool(getattr(other.placements.get("t"), "leaders", ())))
            seen = other.placements["t"]
            assert (seen.leader_of(0), seen.epoch_of(0), seen.leader_of(1)) == (2, 1, 1)
            # a placement changed behind this view: the record fails, nothing is lost
            stale = ctl.placements["t"]
            key = ctl.topic_key("t")
            await Etcd([etcd.endpoint]).put(key, stale.with_leader(1, 2, 9).encode())
            ctl.placements["t"] = stale
            assert await ctl.record_leader("t", 0, 1, 2) is False
            nursery.cancel_scope.cancel()


async def test_votes_over_noise_connections(tmp_path: Path) -> None:
    """The controller's vote travels on the replicas' ``hyperkafka/quorum`` channel over
    real replication connections (Noise with its node key), next to proposals; a
    replica answers it only from the broker its cluster view names controller."""
    from typing import Any

    import trio.testing

    from broker.quorum_link import LinkPeers, accept_proposals, serve_proposals
    from broker.tests.test_quorum_signing import KPS
    from storage.replication.noise import Ed25519KeyPair
    from storage.replication.session import Connection
    from storage.replication.trio_driver import ConnectionDriver

    s = Setup(tmp_path)
    ballot = _ballot(s)
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
                nursery.start_soon(
                    serve_proposals, s.signers[node_id], recv, driver.kick, ballot.voters[node_id]
                )
                return ours

            s.asm.peers = LinkPeers(Ed25519KeyPair(KPS[0].public_key, KPS[0].secret_key), connect, nursery)
            with trio.fail_after(10):
                await s.produce(b"a", b"b")
                assert s.lg.head is not None and s.lg.head.length == 2
                # the leader (broker 1) is no controller: its vote request is refused
                no = await s.asm.peers.vote(2, VoteRequest(s.manifest.hash(), 1))
                assert not no.granted and "not the controller" in no.reason
                kp = KPS[CONTROLLER - 1]
                controller = LinkPeers(Ed25519KeyPair(kp.public_key, kp.secret_key), connect, nursery)
                e = await elect(s.manifest.hash(), 1, [2, 3], 2, controller, timeout_s=5)
                assert e is not None and e.length == 2 and set(e.votes) == {2, 3}
                assert e.leader == min(i for i in (2, 3) if e.votes[i].length == 2)
            nursery.cancel_scope.cancel()
    finally:
        s.close()


def test_a_replica_takes_proposals_from_the_recorded_leader(tmp_path: Path) -> None:
    """After a failover the placement names a partition's new leader: replicas take
    that partition's proposals from it, and no longer from the topic's writer; the
    other partitions keep their writer."""
    import types

    from broker.quorum_link import QuorumRole
    from broker.tests.test_quorum_signing import KPS
    from storage.follower import FollowerLog
    from storage.quorum import partition_manifest

    tid = uuid.uuid4()
    keys = [kp.public_key for kp in KPS[:3]]
    placement = Placement("q", 1, 2, {}, 3, ((1, 2, 3), (1, 3, 2)))
    cluster = types.SimpleNamespace(membership=types.SimpleNamespace(placements={"q": placement}))

    async def nowhere(_i: int) -> tuple[str, int]:
        raise OSError("unused")

    role = QuorumRole(2, KPS[1], cluster, nowhere)  # type: ignore[arg-type]
    logs = [FollowerLog.open_replica(tmp_path / f"q-{p}", partition_manifest(keys, tid, p)) for p in (0, 1)]
    try:
        for lg in logs:
            role.register("q", lg)
        assert [role._leader_of(lg.key) for lg in logs] == [1, 1]
        cluster.membership.placements["q"] = placement.with_leader(1, 3, 1)
        assert [role._leader_of(lg.key) for lg in logs] == [1, 3]
        assert role._leader_of(bytes(32)) is None
    finally:
        for lg in logs:
            lg.close()


async def test_the_controller_fails_a_dead_leader_over(etcd: EtcdServer, tmp_path: Path) -> None:
    """fail_over: nothing while the leader is alive or for a broker that is not the
    controller; once it is dead, a vote among the live replicas and the winner recorded
    in the placement with the next epoch; the next failover moves on from there."""
    from broker.cluster.failover import fail_over

    s = Setup(tmp_path)
    ballot = _ballot(s)
    ms = [
        Membership(Etcd([etcd.endpoint]), "g", Member(i, "127.0.0.1", 9000 + i, "r", f"{i:064x}"), 3)
        for i in (7, 8)
    ]  # fmt: skip
    dead: set[int] = set()
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for m in ms:
                    await nursery.start(m.run)
                await _until(lambda: any(m.is_controller for m in ms))
                ctl = next(m for m in ms if m.is_controller)
                other = next(m for m in ms if not m.is_controller)
                assert await ctl.place(Placement("q", 1, 1, {}, 3, ((1, 2, 3),)))
                await _until(lambda: "q" in other.placements)
                await s.produce(b"a", b"b")

                def alive(i: int) -> bool:
                    return i not in dead

                assert await fail_over(ctl, alive, "q", 0, s.manifest, ballot) is None
                dead.add(1)
                assert await fail_over(other, alive, "q", 0, s.manifest, ballot) is None
                assert await fail_over(ctl, alive, "q", 5, s.manifest, ballot) is None
                e = await fail_over(ctl, alive, "q", 0, s.manifest, ballot, timeout_s=2)
                assert e is not None and e.length == 2
                p = ctl.placements["q"]
                assert (p.leader_of(0), p.epoch_of(0)) == (e.leader, 1)
                assert all(read_promise(s.store.fs, s.replicas[i].path) == 1 for i in (2, 3))
                # the new leader dies too, the old one still down: one voter, no majority
                dead.add(e.leader)
                assert await fail_over(ctl, alive, "q", 0, s.manifest, ballot, timeout_s=0.3) is None
                # the old leader is back but answers no vote: still no majority
                dead.discard(1)
                ballot.broken = {1}
                assert await fail_over(ctl, alive, "q", 0, s.manifest, ballot, timeout_s=0.3) is None
                assert ctl.placements["q"].epoch_of(0) == 1
                nursery.cancel_scope.cancel()
    finally:
        s.close()


async def test_the_epoch_moves_past_the_fork_of_every_head_voted() -> None:
    """A deposed leader's recovery may have moved its fork on (FORMAT.md section 8 case
    9) and a replica signed it: the vote is asked again past that fork, so the new
    leader's fork is newer than every head kept."""
    import types

    from broker.cluster.failover import fail_over
    from storage.hypercore import KeyPair
    from storage.quorum import partition_manifest

    keys = [KeyPair.from_seed(bytes([i]) * 32).public_key for i in (1, 2, 3)]
    manifest = partition_manifest(keys, uuid.uuid4(), 0)
    asked: list[int] = []
    recorded: list[tuple[str, int, int, int]] = []

    class Voters:
        async def vote(self, node_id: int, request: VoteRequest) -> VoteAnswer:
            asked.append(request.epoch)
            fork = 4 if node_id == 2 else 0
            return VoteAnswer(request.archive, request.epoch, fork, 9, b"\x01" * 32)

    async def record_leader(topic: str, index: int, leader: int, epoch: int, session: int = 0) -> bool:
        recorded.append((topic, index, leader, epoch))
        return True

    m = types.SimpleNamespace(
        is_controller=True,
        placements={"q": Placement("q", 1, 1, {}, 3, ((1, 2, 3),)).with_leader(0, 1, 2)},
        record_leader=record_leader,
        sessions={},
    )
    e = await fail_over(m, lambda i: i != 1, "q", 0, manifest, Voters())  # type: ignore[arg-type]
    assert e is not None and e.leader == 2 and e.fork == 4
    assert sorted(set(asked)) == [3, 5] and recorded == [("q", 0, 2, 5)]


async def test_a_failover_end_to_end_without_brokers(s: Setup) -> None:
    """The pieces together, in one process, every message through its codec: broker 1
    leads and acknowledges heads signed with replica 2 (3 is down); 1 dies; 3 is back;
    the controller elects 2; 2 takes its copy over on fork 1 and has it signed by 3
    (which is sent the blocks it lacks), then writes on; every acknowledged batch is in
    the new history at its offset; the deposed leader gets nothing signed; a reader of
    epoch 0 learns where to truncate from the new leader's checkpoint."""
    from broker.cluster.signing import QuorumAssembler, ReplicaSigner
    from broker.handlers.offsets import end_offset_for
    from broker.tests.test_quorum_signing import KPS, Net
    from storage.epochs import EpochCache
    from storage.hypercore.multisig import verify_manifest_head

    ballot = _ballot(s)
    s.net.dead = {3}
    await s.produce(b"a", b"b")
    await s.produce(b"c")
    acked = s.lg.head
    assert acked is not None and acked.length == 3
    acked_blocks = [s.lg.block(i) for i in range(3)]
    s.net.dead = set()
    e = await elect(s.manifest.hash(), 1, [2, 3], 2, ballot, timeout_s=2)
    assert e is not None and e.leader == 2 and e.length == 3
    new_leader = 2
    # replicas now take proposals from broker 2 (its placement records it)
    signer3 = ReplicaSigner(KPS[2], lambda k: s.replicas[3] if k == s.manifest.hash() else None,
                            lambda _k: new_leader)  # fmt: skip
    s.signers[3] = signer3
    lg2 = s.replicas[2].log
    await trio.to_thread.run_sync(lg2.take_over, KPS[1], e.epoch, e.length)
    net2 = Net({3: signer3})
    net2.sender, net2.dead = new_leader, {1}  # the deposed leader is down
    asm2 = QuorumAssembler(new_leader, KPS[1], s.manifest, [1, 2, 3], net2,
                           lg2.block, lambda: lg2.published_length, timeout_s=2)  # fmt: skip
    token = trio.lowlevel.current_trio_token()
    lg2.quorum_sign = lambda th, n, f: trio.from_thread.run(asm2.sign, th, n, f, trio_token=token)
    head = await trio.to_thread.run_sync(lg2.commit)
    assert head is not None and (head.fork, head.length) == (1, 3)
    assert [lg2.block(i) for i in range(3)] == acked_blocks
    lg2.append(build_batch([b"d"], timestamp_ms=1_700_000_000_001), leader_epoch=1)
    head = await trio.to_thread.run_sync(lg2.commit)
    assert head is not None and (head.fork, head.length) == (1, 4)
    assert verify_manifest_head(s.manifest, lg2.key, head.tree_hash, 4, 1, head.signature)
    rec = read_record(s.store.fs, s.replicas[3].path)
    assert rec is not None and (rec.fork, rec.length, rec.tree_hash) == (1, 4, head.tree_hash)
    # the deposed leader: 2 is no replica any more, 3 takes proposals from 2 only (and
    # promised epoch 1)
    s.lg.append(build_batch([b"late"], timestamp_ms=1))
    with trio.fail_after(10), pytest.raises(StorageError):
        await trio.to_thread.run_sync(s.lg.commit)
    cache = EpochCache(s.store.fs, s.replicas[2].path)
    assert end_offset_for(1, cache, lg2.high_watermark, 0) == (0, 3)
    lg2.quorum_sign = lambda th, n, f: trio.run(asm2.sign, th, n, f)  # close() commits


async def test_a_deposed_leader_not_stepped_down_yet_refuses_proposals(s: Setup) -> None:
    """Broker 2, elected in epoch 1, writes its copy; a later failover (2 paused past
    the session timeout) placed broker 3: 3's proposals reach 2 before 2's takeover loop
    stepped it down. They are refused, an answer like any refusal. Before, the copy took
    the blocks as a replica would and failed an assertion ("not a replica"), which ended
    the replication connection carrying every archive's proposals between 3 and 2."""
    from broker.cluster.signing import Proposal, ReplicaSigner
    from broker.tests.test_quorum_signing import KPS

    await s.produce(b"a")
    lg2 = s.replicas[2].log
    await trio.to_thread.run_sync(lg2.take_over, KPS[1], 1, 1)  # 2 elected in epoch 1
    signer2 = ReplicaSigner(KPS[1], lambda k: s.replicas[2] if k == s.manifest.hash() else None,
                            lambda _k: 3)  # the placement names 3 now  # fmt: skip
    block = bytes(build_batch([b"b"], timestamp_ms=1_700_000_000_001, base_offset=1))
    p = Proposal(s.manifest.hash(), 2, 2, bytes(32), 1, (block,))
    a = signer2.handle(3, p)
    assert a.signature == b"" and "has not stepped down" in a.reason
    assert s.replicas[2].length == 1  # nothing taken
    lg2.discard()  # (its close would commit, and only a quorum signs it)


async def test_a_replica_signs_nothing_while_a_vote_it_promised_is_under_way(s: Setup) -> None:
    """Replica 3 promised epoch 1 to a vote whose leader is not recorded yet; the placed
    leader (1, the writer) moved to fork 1 by itself meanwhile (a restart cut an unsigned
    tail, PartitionLog.next_fork). Its proposals on fork 1 are refused until a leader of
    epoch 1 is recorded: signed, they could make a quorum-signed history of fork 1 that
    disagrees with the one of the leader the vote elects in epoch 1. (The promise alone
    only refuses forks older than 1.)"""
    from broker.cluster.signing import Proposal, ReplicaSigner
    from broker.tests.test_quorum_signing import KPS

    await s.produce(b"a")
    await trio.to_thread.run_sync(s.replicas[3].vote, 1)
    recorded = [0]
    signer3 = ReplicaSigner(KPS[2], lambda k: s.replicas[3] if k == s.manifest.hash() else None,
                            lambda _k: 1, lambda _k: recorded[0])  # fmt: skip
    block = bytes(build_batch([b"b"], timestamp_ms=1_700_000_000_001, base_offset=1))
    p = Proposal(s.manifest.hash(), 1, 2, bytes(32), 1, (block,))
    a = signer3.handle(1, p)
    assert a.signature == b"" and "a vote for leader epoch 1 is under way" in a.reason
    assert s.replicas[3].length == 1  # nothing taken
    # recorded: the gate opens (this proposal's tree is made up, so it is refused for that)
    recorded[0] = 1
    a = signer3.handle(1, p)
    assert a.signature == b"" and "under way" not in a.reason and "tree" in a.reason

"""Quorum-signed partitions under load (issue 17): a head that cannot be quorum-signed
answers its producers (never leaves them waiting on a log that no longer holds their
batch), and replicas that fell far behind catch up in bounded proposals.

A real node (its produce handler, commit round and offline retry) writes a quorum-signed
partition; its two replicas are real follower archives answering through their
ReplicaSigner over the in-process transport of test_quorum_signing.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.api import Deferred
from broker.cluster.signing import MAX_PROPOSAL_BYTES, Answer, Proposal, ReplicaSigner
from broker.compose import open_node
from broker.config import BrokerConfig
from broker.handlers import errors
from broker.node import Node, Partition, ms_now
from broker.protocol import records
from broker.quorum_link import Queued, serve_proposals
from broker.tests.quorum_fixtures import (
    answer,
    assembler,
    open_quorum_node,
    open_replicas,
    replica_signers,
    send_produce,
    wire,
)
from broker.tests.test_quorum_signing import LEADER, Net
from storage.batch import build_batch
from storage.epochs import EpochCache
from storage.hypercore import Frontier


class QuorumNode:
    """Node `LEADER` writing topic "q" (one quorum-signed partition, signers KPS[:3]);
    brokers 2 and 3 are follower archives signing through `net`."""

    def __init__(self, tmp_path: Path) -> None:
        self.node: Node = open_quorum_node(tmp_path)
        topic = self.node.create_topic("q", 1)
        assert topic is not None
        self.p: Partition = topic.partitions[0]
        self.replicas = {i: r for (i, _), r in open_replicas(tmp_path, [self.p]).items()}
        self.net: Net = Net(replica_signers({(i, self.p.log.key): r for i, r in self.replicas.items()}))
        self.asm = assembler(self.net, lambda: self.p.log, timeout_s=0.5)
        self.wire()

    def wire(self) -> None:
        """Give the (possibly reopened) log its quorum signer, as QuorumRole.run does."""
        wire(self.p.log, self.asm)

    async def send(self, values: list[bytes], seq: int, timeout_ms: int = 30_000) -> Deferred:
        """A Produce (v9, acks=all) of one idempotent batch (producer 7, epoch 0); its
        answer is the Deferred's to give."""
        d = await self.produce(values, seq, -1, timeout_ms)
        assert isinstance(d, Deferred)
        return d

    async def produce(self, values: list[bytes], seq: int, acks: int, timeout_ms: int = 30_000) -> Any:
        """The produce handler's reply to a Produce (v9) of one idempotent batch."""
        return await send_produce(self.node, "q", 0, values, seq, acks=acks, timeout_ms=timeout_ms)

    async def acked(self, value: bytes, seq: int) -> None:
        """A batch of `value` (sequence `seq`) and a commit round: acknowledged, at offset `seq`."""
        d = await self.send([value], seq)
        with trio.fail_after(10):
            await self.node.commit_round()
            assert await answer(d) == (errors.NONE, seq)

    async def not_signed(self, value: bytes, seq: int) -> None:
        """A batch of `value` and a commit round whose head no quorum signs (the caller
        saw to it): written, not acknowledged."""
        d = await self.send([value], seq)
        with trio.fail_after(10):
            await self.node.commit_round()
            assert (await answer(d))[0] == errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND

    def close(self) -> None:
        self.net.dead = set()
        self.p.log.quorum_sign = lambda th, n, f: trio.run(self.asm.sign, th, n, f)
        self.node.close()
        for r in self.replicas.values():
            r.close()


@pytest.fixture
def q(tmp_path: Path) -> Iterator[QuorumNode]:
    setup = QuorumNode(tmp_path)
    yield setup
    setup.close()


async def test_a_head_no_quorum_signed_is_answered_and_asked_again_once_the_replicas_are_back(
    q: QuorumNode,
) -> None:
    await q.acked(b"a", 0)
    # both replicas gone: the head over "b" cannot be quorum-signed
    q.net.dead = {2, 3}
    d = await q.send([b"b"], 1)
    with trio.fail_after(10):
        await q.node.commit_round()
    assert q.p.failed is not None and q.p.failed_code == errors.NOT_ENOUGH_REPLICAS
    # its producer is answered at once, not after the request timeout: written, not
    # acknowledged (retriable); produces meanwhile are refused before the append
    with trio.fail_after(5):
        assert (await answer(d))[0] == errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND
    assert (await answer(await q.send([b"x"], 2)))[0] == errors.NOT_ENOUGH_REPLICAS
    # the log kept "b", unsigned, and is not poisoned
    assert q.p.log.writable and q.p.log.log_end_offset == 2 and q.p.high_watermark == 1
    # while the cluster says the quorum is not alive, the partition stays offline
    q.p.retry_at = 0.0
    real = q.node.cluster.produce_refusal
    q.node.cluster.produce_refusal = lambda *_a: "replicas dead"  # type: ignore[method-assign]
    assert await q.node.retry_offline() == 0 and q.p.failed is not None
    q.node.cluster.produce_refusal = real  # type: ignore[method-assign]
    # replicas back: the same leader, the same log, the same fork, no election
    q.net.dead = set()
    log_before = q.p.log
    assert await q.node.retry_offline() == 1
    assert q.p.failed is None and q.p.log is log_before and q.p.log.fork == 0
    # the idempotent producer's retry of "b" is a duplicate of offset 1, acknowledged by
    # the head the next round has signed over the kept tail; the next batch follows it
    await q.acked(b"b", 1)
    await q.acked(b"c", 2)
    head = q.p.log.head
    assert head is not None and (head.fork, head.length) == (0, 3) and q.p.high_watermark == 3
    assert all(r.length == 3 for r in q.replicas.values())


async def test_an_elected_leader_whose_head_no_quorum_signed_takes_its_partition_back(
    q: QuorumNode,
) -> None:
    """A partition a failover made this broker lead (a led partition of a topic it
    mirrors, broker/takeover.py): a failed quorum commit once left it offline until the
    next failover; it comes back as the original writer's does."""
    q.p.topic.mirrored = True
    q.p.led = True
    await q.acked(b"a", 0)
    q.net.dead = {2, 3}
    await q.not_signed(b"b", 1)
    q.net.dead = {3}  # one replica back: with the leader, a quorum
    q.p.retry_at = 0.0
    assert await q.node.retry_offline() == 1 and q.p.failed is None
    await q.acked(b"c", 2)
    assert q.p.log.fork == 0 and q.p.high_watermark == 3 and q.replicas[2].length == 3


class LateNet(Net):
    """`Net` whose `late` replicas sign a proposal but whose answer never reaches the
    leader: a signature that came after the leader gave up on the head."""

    def __init__(self, signers: dict[int, ReplicaSigner]) -> None:
        super().__init__(signers)
        self.late: set[int] = set()

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        if node_id in self.late:
            a = await trio.to_thread.run_sync(self.signers[node_id].handle, self.sender, proposal)
            assert a.signed, a.reason
            await trio.sleep_forever()
        return await super().propose(node_id, proposal)


async def test_a_leader_that_cut_a_tail_replicas_signed_late_writes_on_a_new_fork(
    tmp_path: Path,
) -> None:
    """Both replicas signed the head over "b" after the leader gave up on it; the leader
    restarts, its open cuts "b" (no head of its covers it), and "c" takes its place at
    the same length. On the same fork both replicas would refuse that head for good
    (it disagrees with the one they signed); the leader's next head is on a new fork."""
    q = QuorumNode(tmp_path)
    try:
        q.net = q.asm.peers = LateNet(q.net.signers)
        await q.acked(b"a", 0)
        q.net.late = {2, 3}
        await q.not_signed(b"b", 1)
        assert all(r.length == 2 for r in q.replicas.values())  # they hold and signed "b"
        q.net.late = set()
        # the leader restarts (its unsigned tail durable past its last head)
        q.p.log.quorum_sign = None
        q.node.close()
        q.node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
        q.p = q.node.topics["q"].partitions[0]
        assert q.p.log.log_end_offset == 1 and q.p.log.cut_at_open == 1
        q.wire()
        await q.acked(b"c", 1)  # (the producer's retry of "b" may differ: "c")
        head = q.p.log.head
        assert head is not None and (head.fork, head.length) == (1, 2)
        assert q.p.log.fork == 1 and q.p.log.cut_at_open == 0
        assert await _fetched_values(q) == [b"a", b"c"]
        # the leader epochs: fork 1 starts at offset 1 (OffsetForLeaderEpoch, Fetch), and
        # each batch is stamped with the epoch it was written in (a consumer checks its
        # position with the epoch of the last batch it read: KIP-320)
        assert [(e.epoch, e.start_offset) for e in EpochCache(q.p.log.fs, q.p.log.path).entries] == [(0, 0), (1, 1)]
        stamped = [records.parse_batch_header(b).partition_leader_epoch
                   for b in records.split_batches(q.p.log.read_bytes(0, 1 << 20))]
        assert stamped == [0, 1]
    finally:
        q.close()


async def _fetched_values(q: QuorumNode) -> list[bytes | None]:
    data = q.p.log.read_bytes(0, 1 << 26)
    return [r.value for b in records.split_batches(data) for r in records.decode_records(b)]


async def test_produces_to_a_partition_that_went_offline_get_not_enough_replicas(
    q: QuorumNode,
) -> None:
    q.net.dead = {2, 3}
    first = await q.send([b"a"], 0)
    second = await q.send([b"b"], 1)
    with trio.fail_after(10):
        await q.node.commit_round()
        await q.node.commit_round()
        # written (the log keeps them for its next head), not acknowledged
        assert (await answer(first))[0] == errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND
        assert (await answer(second))[0] == errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND
    later = await q.send([b"c"], 2)  # refused before the append while offline
    assert (await answer(later))[0] == errors.NOT_ENOUGH_REPLICAS
    assert q.p.queued == []


# ----------------------------------------------------------------- replicas far behind


class FullNet(Net):
    """`Net` with the real proposal budget on the way, and replicas that answer slowly
    (`delay[node_id]` seconds before handling each proposal)."""

    def __init__(self, signers: dict[int, ReplicaSigner]) -> None:
        super().__init__(signers)
        self.delay: dict[int, float] = {}

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        if node_id in self.dead:
            await trio.sleep_forever()
        await trio.sleep(self.delay.get(node_id, 0.0))
        p = Proposal.decode(proposal.encode(), MAX_PROPOSAL_BYTES)
        self.sent.append((node_id, p))
        a = await trio.to_thread.run_sync(self.signers[node_id].handle, self.sender, p)
        return Answer.decode(a.encode())


BIG = 950_000  # a value: ten batches of it are more than one proposal's 8 MiB


async def _burst(q: QuorumNode, first_seq: int, count: int) -> list[Deferred]:
    """`count` batches of one BIG value each, admitted before one commit round."""
    return [await q.send([bytes([65 + i % 26]) * BIG], first_seq + i) for i in range(count)]


async def test_a_burst_past_the_proposal_budget_and_a_slow_replica_far_behind_are_signed(
    tmp_path: Path,
) -> None:
    q = QuorumNode(tmp_path)
    try:
        q.net = q.asm.peers = FullNet(q.net.signers)
        q.asm.timeout_s = 20.0  # the machine is shared: the window is not what is tested
        # 1. one round of ~9.5 MiB of unsigned blocks, broker 3 away: broker 2 is sent
        # them in pieces and signs
        q.net.dead = {3}
        ds = await _burst(q, 0, 10)
        with trio.fail_after(60):
            await q.node.commit_round()
            assert [(await answer(d))[0] for d in ds] == [errors.NONE] * 10
        assert q.p.failed is None and q.p.log.published_length == 10
        assert q.replicas[2].length == 10 and q.replicas[3].length == 0
        sizes = [sum(len(b) for b in p.blocks) for i, p in q.net.sent if i == 2]
        assert len(sizes) >= 2 and max(sizes) <= MAX_PROPOSAL_BYTES
        # 2. broker 2 away, broker 3 back but slow and ~9.5 MiB behind: the next head is
        # signed by it, after it caught up in pieces
        q.net.dead = {2}
        q.net.delay[3] = 0.2
        d = await q.send([b"after"], 10)
        with trio.fail_after(60):
            await q.node.commit_round()
            assert (await answer(d))[0] == errors.NONE
        assert q.p.log.published_length == 11 and q.replicas[3].length == 11
        # (sent from the last quorum head first, then from the nothing it holds)
        starts = [p.start for i, p in q.net.sent if i == 3]
        assert starts[:2] == [10, 0] and len(starts) >= 3
    finally:
        q.close()


async def test_a_proposal_waits_for_the_replicas_accept_job_instead_of_refusing(
    q: QuorumNode,
) -> None:
    q.net.dead = {3}
    d = await q.send([b"a"], 0)
    await q.node.commit_round()
    assert (await answer(d))[0] == errors.NONE
    head = q.p.log.head
    assert head is not None and q.replicas[2].length == 1
    # broker 2's mirror is storing that head (its accept job in flight) when the
    # proposal of the next head arrives
    r2 = q.replicas[2]
    job = r2.prepare_accept(head.length, head.fork, head.signature, head.roots)
    assert job is not None and r2.busy
    q.p.log.append(build_batch([b"b"], timestamp_ms=ms_now()))
    blocks = [q.p.log.block(0), q.p.log.block(1)]
    f = Frontier()
    for b in blocks:
        f.append_data(b)
    p = Proposal(q.p.log.key, 0, 2, f.tree_hash(), 1, (blocks[1],))
    sent: list[Answer] = []
    answered = trio.Event()

    class Conn:
        def send_protocol(self, _channel: object, _type: int, payload: bytes) -> None:
            sent.append(Answer.decode(payload))
            answered.set()

    send, receive = trio.open_memory_channel[Queued](4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_proposals, q.net.signers[2], receive, lambda: None)
        send.send_nowait((Conn(), None, LEADER, p))  # type: ignore[arg-type]
        await trio.sleep(0.2)
        await trio.to_thread.run_sync(r2.run_accept, job)
        assert r2.finish_accept(job)
        with trio.fail_after(5):
            await answered.wait()
        nursery.cancel_scope.cancel()
    assert sent[0].signed, sent[0].reason
    # (the leader's own commit of block 1 happens at the fixture's close)


# ----------------------------------------------------------------- back-pressure


def _unsigned_in_memory(q: QuorumNode) -> int:
    """Bytes of batches admitted and held in memory (request frames) until a round
    writes them."""
    return sum(len(b) for b, _ in q.p.queued)


def _unsigned_on_disk(q: QuorumNode) -> int:
    lg = q.p.log
    return sum(len(lg.block(i)) for i in range(lg.published_length, lg.length))


@pytest.mark.parametrize("acks", [0, -1])
async def test_produces_wait_for_a_slow_replica_instead_of_piling_up_unsigned_bytes(
    tmp_path: Path, acks: int
) -> None:
    """One replica away, the other slow to sign (0.3 s a proposal): a producer that sends
    without waiting for answers (acks=0, or acks=all with its answers read later) is
    held at the produce once its partition holds hyperkafka.quorum.unsigned.max.bytes
    (1 MiB here) that no head covers, instead of the leader taking all of it into
    memory; every batch is written, in order, and every acks=all answer is a success."""
    q = QuorumNode(tmp_path)
    budget, size, count = 1 << 20, 200_000, 30  # 6 MB sent, 1 MiB allowed unsigned
    try:
        q.node.config = dataclasses.replace(q.node.config, quorum_unsigned_max_bytes=budget)
        q.net = q.asm.peers = FullNet(q.net.signers)
        q.asm.timeout_s = 30.0  # the machine is shared: the window is not what is tested
        q.net.dead = {3}
        q.net.delay[2] = 0.3
        most = {"memory": 0, "unsigned": 0}
        replies: list[Any] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(q.node.commit_loop)

                async def watch() -> None:
                    while True:
                        most["memory"] = max(most["memory"], _unsigned_in_memory(q))
                        most["unsigned"] = max(most["unsigned"], _unsigned_in_memory(q) + _unsigned_on_disk(q))
                        await trio.sleep(0.005)

                nursery.start_soon(watch)
                for i in range(count):
                    replies.append(await q.produce([bytes([65 + i % 26]) * size], i, acks))
                while q.p.high_watermark < count:
                    await q.p.wait_durable(count - 1)
                nursery.cancel_scope.cancel()
            if acks == -1:
                assert [await answer(d) for d in replies] == [(errors.NONE, i) for i in range(count)]
        # at most the budget and one batch was ever waiting for a signature
        assert most["unsigned"] <= budget + size + 1024, most
        assert q.p.unsigned_bytes == 0 and q.p.failed is None
        values = await _fetched_values(q)
        assert values == [bytes([65 + i % 26]) * size for i in range(count)]
        print(f"acks={acks}: at most {most['unsigned']} bytes unsigned, {most['memory']} in memory; "
              f"{count * size} sent")
    finally:
        q.close()

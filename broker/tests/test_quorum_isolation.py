"""One quorum-signed partition whose replicas do not sign holds no other partition's
acknowledgements (the Jepsen quorum run's cross-partition stall): its head waits for
its replicas in a task of its own (broker/node.py `_sign_alone`) while the commit loop's
rounds go on publishing the others'.

A real node (produce handler, commit loop) writes topic "q" (two quorum-signed
partitions, signers brokers 1, 2, 3) and topic "s" (single-signer). Brokers 2 and 3 are
real follower archives answering through their ReplicaSigner over the in-process
transport of test_quorum_signing.py, except that no proposal for partition q-0 is ever
answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from broker.api import Deferred
from broker.cluster.signing import Answer, Proposal, ReplicaSigner
from broker.handlers import errors
from broker.node import Node, Partition
from broker.tests.quorum_fixtures import (
    answer,
    assembler,
    open_quorum_node,
    open_replicas,
    replica_signers,
    send_produce,
    wire,
)
from broker.tests.test_quorum_signing import Net

# The stalled partition's signing window: long, so that "answered while q-0 still waits"
# holds on a loaded machine, and a round that waited for it (the bug) is plain to see.
SIGN_S = 8.0


class StallNet(Net):
    """`Net` where no replica ever answers a proposal for archive `stalled`."""

    def __init__(self, signers: dict[int, ReplicaSigner], stalled: bytes) -> None:
        super().__init__(signers)
        self.stalled = stalled

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        if proposal.archive == self.stalled:
            await trio.sleep_forever()
        return await super().propose(node_id, proposal)


class TwoTopics:
    def __init__(self, tmp_path: Path) -> None:
        self.node: Node = open_quorum_node(tmp_path)
        q = self.node.create_topic("q", 2)
        s = self.node.create_topic("s", 1)
        assert q is not None and s is not None
        self.a: Partition = q.partitions[0]  # its replicas never answer
        self.b: Partition = q.partitions[1]  # quorum-signed, healthy replicas
        self.s: Partition = s.partitions[0]  # single-signer
        assert self.s.log.quorum_sign is None
        self.replicas = open_replicas(tmp_path, (self.a, self.b))
        self.net = StallNet(replica_signers(self.replicas), self.a.log.key)
        for p in (self.a, self.b):
            lg = p.log
            wire(lg, assembler(self.net, lambda lg=lg: lg, timeout_s=SIGN_S))

    async def send(self, topic: str, index: int, value: bytes, seq: int) -> Deferred:
        """An idempotent acks=all Produce (v9) of one batch; its answer is the Deferred's."""
        d = await send_produce(self.node, topic, index, [value], seq, timeout_ms=60_000, producer_id=7 + index)
        assert isinstance(d, Deferred)
        return d

    def close(self) -> None:
        self.node.close()
        for r in self.replicas.values():
            r.close()


def _head_length(p: Partition) -> int:
    """The length of the partition's stored head (a new quorum archive holds the empty
    head, length 0, that nobody signs)."""
    head = p.log.head
    return 0 if head is None else head.length


@pytest.fixture
def t(tmp_path: Path) -> Iterator[TwoTopics]:
    setup = TwoTopics(tmp_path)
    yield setup
    setup.close()


async def test_a_partition_whose_replicas_do_not_sign_holds_no_other_partitions_acks(
    t: TwoTopics,
) -> None:
    answers: dict[str, tuple[int, int]] = {}
    took: dict[str, float] = {}

    async def produce_and_wait(name: str, topic: str, index: int, value: bytes, seq: int) -> None:
        start = trio.current_time()
        d = await t.send(topic, index, value, seq)
        answers[name] = await answer(d)
        took[name] = trio.current_time() - start

    with trio.fail_after(SIGN_S * 6):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.node.commit_loop)
            async with trio.open_nursery() as produces:
                # A first: every later round would have waited behind its head (the bug)
                produces.start_soon(produce_and_wait, "a", "q", 0, b"a0", 0)
                await trio.sleep(0.2)
                for k in range(3):  # several rounds, while A's head still waits
                    async with trio.open_nursery() as wave:
                        wave.start_soon(produce_and_wait, f"s{k}", "s", 0, b"s%d" % k, k)
                        wave.start_soon(produce_and_wait, f"b{k}", "q", 1, b"b%d" % k, k)
                    # answered while A's signing window is still open
                    assert "a" not in answers, (answers, took)
                    assert answers[f"s{k}"] == (errors.NONE, k)
                    assert answers[f"b{k}"] == (errors.NONE, k)
                    assert took[f"s{k}"] < SIGN_S / 2 and took[f"b{k}"] < SIGN_S / 2, took
                # no head of A meanwhile: nothing of it is readable or published
                assert t.a.high_watermark == 0 and _head_length(t.a) == 0
                assert t.a.signing and t.a.failed is None
                # what shutdown waits for (broker/server.py): A's signing task ends
                await t.node.wait_signed()
                assert not t.a.signing and t.a.failed_code == errors.NOT_ENOUGH_REPLICAS
            # A's quorum failed: its producer gets the error a failed quorum head gives
            assert answers["a"][0] == errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND
            assert took["a"] >= SIGN_S
            nursery.cancel_scope.cancel()
    assert t.a.failed_code == errors.NOT_ENOUGH_REPLICAS and not t.a.signing
    assert t.a.high_watermark == 0 and _head_length(t.a) == 0  # never a head no quorum signed
    assert t.a.log.log_end_offset == 1  # its batch is kept, unsigned, for the next try
    # B's heads are quorum heads, in order, and its replicas hold what they signed
    head = t.b.log.head
    assert head is not None and head.length == 3 and t.b.high_watermark == 3
    assert all(t.replicas[i, t.b.log.key].length == 3 for i in (2, 3))
    assert t.s.high_watermark == 3

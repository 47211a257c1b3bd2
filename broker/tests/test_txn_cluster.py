"""Transactions in cluster mode, below the cluster (broker/transactions/shards.py
"Where the coordinator lives"), with a fake etcd view: a broker named coordinator of a
partition of __transaction_state takes it over from the previous holder's archive (by log
order), completes its prepared transactions and times out its open ones as a restart
does, answers COORDINATOR_LOAD_IN_PROGRESS before and NOT_COORDINATOR once fenced; the
markers of a transaction go to each partition's leader and are retried until acknowledged
(a deleted topic's dropped); the group coordinator keeps transactional offsets pending in
its archive until the marker for its partition of __consumer_offsets. The placement of
__transaction_state by the controller runs against a real etcd (as test_shards.py).

The whole thing with real brokers and librdkafka: compat_tests/test_txn_cluster.py.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.cluster import NullCluster, PeerCopy
from broker.cluster.shards import Shard, place_shards
from broker.config import BrokerConfig
from broker.groups import codes
from broker.groups.records import PendingOffset
from broker.protocol.records import iter_records
from broker.tests.test_groups_maintenance import T0, Clock, eventually, fetched, running
from broker.tests.test_membership import _members, _until
from broker.transactions.coordinator import (
    COORDINATOR_LOAD_IN_PROGRESS,
    NOT_COORDINATOR,
    REQUEST_TIMED_OUT,
    TRANSACTION_COORDINATOR_FENCED,
    TXN_TOPIC,
    CoordinatorError,
)
from broker.transactions.records import (
    ATTR_CONTROL,
    MarkerType,
    Status,
    marker_coordinator_epoch,
    marker_type,
)
from compat_tests.etcd import EtcdServer


def _marker_epochs(p: Any) -> list[int]:
    """The coordinator epochs of the control records in partition `p`, in log order."""
    out = []
    for header in p.log.batch_headers(p.log.log_start_offset):
        if struct.unpack_from(">h", header, 21)[0] & ATTR_CONTROL:
            for rec in iter_records(p.log.read_bytes(struct.unpack_from(">q", header, 0)[0], 1)):
                if marker_type(rec.key) is not None:
                    out.append(marker_coordinator_epoch(rec.value))
    return out


HOLDER = 7  # the previous coordinator (its archive: another node's, standing in for our copy)


class FakeMembership:
    def __init__(self, me: int) -> None:
        self.me_id = me
        self.shards: dict[str, dict[int, Shard]] = {}
        self.changed = trio.Event()
        self.claims: list[dict[int, int]] = []
        self.revision = 100

    def lease_valid(self) -> bool:
        return True

    async def claim_shards(self, topic: str, seen: dict[int, int]) -> int | None:
        current = self.shards.get(topic, {})
        if any(current[p].revision != rev for p, rev in seen.items()):
            return None
        self.revision += 1
        for p in seen:
            current[p] = Shard(topic, p, self.me_id, self.me_id, self.revision)
        self.claims.append(dict(seen))
        return self.revision


class FakeCluster(NullCluster):
    """The etcd view as the transaction coordinator reads it (`Cluster`'s members it
    uses), over a single broker's null view for everything else."""

    def __init__(self, me: int) -> None:
        super().__init__(me, "127.0.0.1", 9092, None, "fake")
        self.membership = FakeMembership(me)
        self.copies: dict[str, dict[int, PeerCopy]] = {TXN_TOPIC: {}, "__consumer_offsets": {}}
        self.session_s = 1.0
        self.fence_holds = True
        self.writers: dict[str, int | None] = {}

    def shard_count(self, topic: str) -> int | None:
        shards = self.membership.shards.get(topic)
        return max(shards) + 1 if shards else 0

    def coordinator(self, topic: str, partition: int) -> int | None:
        if topic != TXN_TOPIC:
            return self.me  # (this broker coordinates the groups)
        shard = self.membership.shards.get(topic, {}).get(partition)
        return None if shard is None else shard.owner

    async def check_fence(self, topic: str, revisions: dict[int, int]) -> bool:
        return self.fence_holds

    async def wait_handed_over(self, timeout_s: float, topic: str = "") -> bool:
        return True

    def placed_writer(self, name: str) -> int | None:
        return self.writers.get(name, self.me)

    def alive(self, node_id: int, now: float | None = None) -> bool:
        return True


def _config(path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=path, listen_port=0)
    config.static.update({"transaction.state.log.num.partitions": "1",
                          "transaction.abort.timed.out.transaction.cleanup.interval.ms": "50"})
    return config


def _shard_cluster(node: Any, owner: int, holder: int | None, revision: int = 5) -> FakeCluster:
    """Make `node`'s transaction coordinator a cluster member named coordinator (or not)
    of the one partition of __transaction_state."""
    fake = FakeCluster(node.config.node_id)
    fake.membership.shards[TXN_TOPIC] = {0: Shard(TXN_TOPIC, 0, owner, holder, revision)}
    node.cluster = fake
    node.transactions.sharded = fake
    return fake


async def test_a_new_coordinator_adopts_completes_prepared_and_times_out_open_ones(tmp_path: Path) -> None:
    clock = Clock()
    # The previous coordinator, alone: one transaction prepared (its markers not written:
    # it died between the phases), one open, one complete.
    async with running(_config(tmp_path / "old"), clock) as old:
        old.transactions.wall = clock
        old.create_topic("t", 1)
        c = old.transactions
        pid_d, _ = await c.init_producer_id("done", 60_000)
        await c.add_partitions("done", pid_d, 0, [("t", 0)])
        await c.end_txn("done", pid_d, 0, True)

        async def died_between_the_phases(_txn: Any) -> None:
            pass

        c.complete = died_between_the_phases  # type: ignore[method-assign]
        pid_p, _ = await c.init_producer_id("prepared", 60_000)
        await c.add_partitions("prepared", pid_p, 0, [("t", 0)])
        await c._prepare(c.txns["prepared"], Status.PREPARE_COMMIT)
        pid_o, _ = await c.init_producer_id("open", 10_000)
        await c.add_partitions("open", pid_o, 0, [("t", 0)])
        theirs = old.topics[TXN_TOPIC].partitions[0].log
        async with running(_config(tmp_path / "new"), clock) as new:
            new.transactions.wall = clock
            new.create_topic("t", 1)
            fake = _shard_cluster(new, owner=new.config.node_id, holder=HOLDER)
            fake.copies[TXN_TOPIC][HOLDER] = PeerCopy(theirs)
            coordinator = new.transactions
            # Named, not loaded yet: the producer is told to retry.
            with pytest.raises(CoordinatorError) as info:
                await coordinator.init_producer_id("open", 10_000)
            assert info.value.code == COORDINATOR_LOAD_IN_PROGRESS
            assert await coordinator.take_over(fake, {0: 5})
            assert fake.membership.claims == [{0: 5}]
            assert coordinator.shards == {0: 101}
            assert {t: x.status for t, x in coordinator.txns.items()} == {
                "prepared": Status.PREPARE_COMMIT, "open": Status.ONGOING, "done": Status.COMPLETE_COMMIT}
            assert coordinator.txns["prepared"].producer_id == pid_p  # the producer id moves with it
            # The sweep completes the prepared one (its marker into t-0, written here),
            # and aborts the open one once its timeout has run out, with a bumped epoch.
            await eventually(lambda: coordinator.txns["prepared"].status is Status.COMPLETE_COMMIT)
            assert coordinator.txns["open"].status is Status.ONGOING
            clock.now = T0 + 11_000
            await eventually(lambda: coordinator.txns["open"].status is Status.COMPLETE_ABORT)
            assert coordinator.txns["open"].producer_epoch == 1
            t0 = new.partition("t", 0)
            assert t0 is not None and t0.log.log_end_offset == 2  # two markers, one each
            # Fenced (the controller moved the partition meanwhile): nothing acknowledged,
            # the partition given up.
            fake.fence_holds = False
            with pytest.raises(CoordinatorError) as info:
                await coordinator.init_producer_id("fresh", 10_000)
            assert info.value.code == NOT_COORDINATOR
            assert coordinator.shards == {} and coordinator.txns == {}


async def test_adoption_is_by_the_holders_log_not_ours(tmp_path: Path) -> None:
    """Our own archive holds an older word of an id (we coordinated it before the
    holder did): the holder's last word replaces it."""
    clock = Clock()
    async with running(_config(tmp_path / "old"), clock) as old:
        pid, _ = await old.transactions.init_producer_id("x", 60_000)
        await old.transactions.init_producer_id("x", 60_000)  # epoch 1 there
        async with running(_config(tmp_path / "new"), clock) as new:
            await new.transactions.init_producer_id("x", 60_000)  # ours: another pid, epoch 0
            fake = _shard_cluster(new, owner=new.config.node_id, holder=HOLDER)
            fake.copies[TXN_TOPIC][HOLDER] = PeerCopy(old.topics[TXN_TOPIC].partitions[0].log)
            assert await new.transactions.take_over(fake, {0: 5})
            x = new.transactions.txns["x"]
            assert (x.producer_id, x.producer_epoch) == (pid, 1)


async def test_markers_are_retried_until_every_leader_acknowledged(tmp_path: Path) -> None:
    clock = Clock()
    config = _config(tmp_path / "data")
    async with running(config, clock) as node:
        node.create_topic("here", 1)
        fake = _shard_cluster(node, owner=node.config.node_id, holder=None)
        fake.writers.update({"far": 2, "gone": None})
        coordinator = node.transactions
        coordinator.shards[0] = 5  # serving the one partition of __transaction_state, claimed at 5
        calls: list[list[tuple[str, int]]] = []

        async def markers_to(broker: int, pid: int, epoch: int, commit: bool, keys: Sequence[tuple[str, int]],
                             coordinator_epoch: int) -> tuple[list[tuple[str, int]], str, list[tuple[str, int]]]:
            assert broker == 2 and coordinator_epoch == 5  # the claim's revision
            calls.append(list(keys))
            if len(calls) < 3:  # the leader moving: NOT_LEADER_OR_FOLLOWER twice
                return [], "far-0: error 6 from broker 2", []
            return list(keys), "", []

        coordinator._markers_to = markers_to  # type: ignore[method-assign]
        with trio.fail_after(10):
            await coordinator._send_markers(42, 0, True, [("here", 0), ("far", 0), ("gone", 3)], "x")
        assert calls == [[("far", 0)]] * 3  # the deleted topic's marker dropped, never sent
        here = node.partition("here", 0)
        assert here is not None and here.log.log_end_offset == 1
        assert _marker_epochs(here) == [5]  # the local marker carries the coordinator epoch too
        # A leader that never answers: the completion fails in time, for `run` to retry.
        coordinator.settings.state_write_timeout_ms = 300
        calls.clear()

        async def never(*_args: Any) -> tuple[list[tuple[str, int]], str, list[tuple[str, int]]]:
            calls.append([])
            return [], "broker 2 is not alive", []

        coordinator._markers_to = never  # type: ignore[method-assign]
        with trio.fail_after(10), pytest.raises(CoordinatorError) as info:
            await coordinator._send_markers(42, 0, True, [("far", 0)], "x")
        assert info.value.code == REQUEST_TIMED_OUT and len(calls) >= 2


async def test_a_fenced_coordinator_stops_completing(tmp_path: Path) -> None:
    """A partition refuses our marker with TRANSACTION_COORDINATOR_FENCED (a coordinator
    of a newer epoch wrote one for this producer there): the coordinator stops sending
    markers at once, as Kafka's TransactionMarkerChannelManager, gives up the partition
    of __transaction_state it held at that epoch, and writes nothing more."""
    clock = Clock()
    config = _config(tmp_path / "data")
    async with running(config, clock) as node:
        node.transactions.wall = clock
        node.create_topic("here", 1)
        fake = _shard_cluster(node, owner=node.config.node_id, holder=None)
        fake.writers["far"] = 2
        coordinator = node.transactions
        coordinator.shards[0] = 5
        calls: list[int] = []

        async def markers_to(broker: int, pid: int, epoch: int, commit: bool, keys: Sequence[tuple[str, int]],
                             coordinator_epoch: int) -> tuple[list[tuple[str, int]], str, list[tuple[str, int]]]:
            calls.append(coordinator_epoch)
            return [], "", list(keys)  # the leader took a newer coordinator's marker

        coordinator._markers_to = markers_to  # type: ignore[method-assign]
        with trio.fail_after(10), pytest.raises(CoordinatorError) as info:
            await coordinator._send_markers(42, 0, True, [("far", 0)], "x")
        assert info.value.code == TRANSACTION_COORDINATOR_FENCED
        assert calls == [5]  # not retried
        assert coordinator.shards == {}  # given up
        # A local partition: a transaction prepared here, whose partition took a marker of
        # coordinator epoch 9 for the producer meanwhile.
        coordinator.shards[0] = 5
        pid, _ = await coordinator.init_producer_id("x", 60_000)
        await coordinator.add_partitions("x", pid, 0, [("here", 0)])
        assert await coordinator.write_markers(pid, 0, False, [("here", 0)], 9) == {("here", 0): codes.NONE}
        here = node.partition("here", 0)
        assert here is not None and _marker_epochs(here) == [9]
        assert await coordinator.write_markers(pid, 0, True, [("here", 0)], 5) == {
            ("here", 0): TRANSACTION_COORDINATOR_FENCED}
        await coordinator.end_txn("x", pid, 0, True)  # decided; its markers are refused
        assert coordinator.shards == {} and "x" not in coordinator.txns
        await trio.sleep(0.3)  # sweeps run meanwhile (every 50 ms): nothing is retried
        assert _marker_epochs(here) == [9] and here.log.log_end_offset == 1


async def test_pending_transactional_offsets_live_in_the_group_coordinators_archive(tmp_path: Path) -> None:
    clock = Clock()
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0)
    async with running(config, clock) as node:
        node.create_topic("t", 2)
        g = node.groups
        p = g.shard_of("g")
        assert await g.txn_offset_commit("g", 9, 0, [PendingOffset("t", 0, 5, -1, "a")]) == codes.NONE
        assert await g.txn_offset_commit("g", 9, 0, [PendingOffset("t", 1, 6, -1, "")]) == codes.NONE
        assert g.pending_offsets("g") == {("t", 0), ("t", 1)}
        assert fetched(g, "g") == {}
    async with running(config, clock, close=False) as node:  # pending survives a restart
        g = node.groups
        assert g.pending_offsets("g") == {("t", 0), ("t", 1)}
        # a marker for another partition of __consumer_offsets changes nothing here
        assert await g.complete_transaction(9, 0, True, (p + 1) % 50, 0) == codes.NONE
        assert g.pending_offsets("g") == {("t", 0), ("t", 1)}
        assert await g.complete_transaction(9, 0, True, p, 0) == codes.NONE
        assert g.pending_offsets("g") == set()
        assert fetched(g, "g") == {("t", 0): 5, ("t", 1): 6}
        # the next transaction aborts: dropped; a late commit of an older epoch is refused
        assert await g.txn_offset_commit("g", 9, 1, [PendingOffset("t", 0, 50, -1, "")]) == codes.NONE
        assert await g.complete_transaction(9, 1, False, p, 0) == codes.NONE
        assert await g.txn_offset_commit("g", 9, 0, [PendingOffset("t", 0, 70, -1, "")]) == codes.INVALID_PRODUCER_EPOCH
        assert g.pending_offsets("g") == set()
        assert fetched(g, "g") == {("t", 0): 5, ("t", 1): 6}
    async with running(config, clock) as node:
        assert node.groups.pending_offsets("g") == set()
        assert fetched(node.groups, "g") == {("t", 0): 5, ("t", 1): 6}


async def test_the_controller_places_transaction_state_with_no_holder(etcd: EtcdServer) -> None:
    """__transaction_state is placed as __consumer_offsets is, but a partition placed for
    the first time never names the legacy groups holder: no transaction state predates
    sharding."""
    with trio.fail_after(40):
        async with _members(etcd, 1, 2) as ms, trio.open_nursery() as nursery:
            for m in ms:
                m.legacy_holder = 1  # (as if ``groups/coordinator`` named broker 1)
                nursery.start_soon(lambda m=m: place_shards(m, TXN_TOPIC, 4, legacy=False))
            # (placed on broker 1 alone if it is controller before broker 2 registers; then
            # half move to broker 2, their preferred)
            await _until(lambda: all(
                len(m.shards.get(TXN_TOPIC, {})) == 4 and {s.owner for s in m.shards[TXN_TOPIC].values()} == {1, 2}
                for m in ms))
            assert {s.holder for s in ms[0].shards[TXN_TOPIC].values()} == {None}
            nursery.cancel_scope.cancel()


async def test_a_leader_verifies_transactional_batches_with_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KIP-890 part 1 where another broker coordinates the transactional id: it is asked
    (a forwarded DescribeTransactions) once per producer, epoch and partition, and the
    answer holds until that partition's marker."""
    from types import SimpleNamespace

    from broker import forwarding
    from broker.node import TopicError

    asked: list[str] = []
    answer: dict[str, Any] = {"fail": False}

    async def forward_to(_cluster: Any, broker: int, key: int, version: int, schema: str, body: Any) -> Any:
        assert (broker, key, schema) == (2, 65, "describe_transactions")
        asked.append(body["transactional_ids"][0])
        if answer["fail"]:
            raise TopicError(5, "broker 2 did not answer")
        topics = [SimpleNamespace(topic="t", partitions=[0])]
        return SimpleNamespace(transaction_states=[SimpleNamespace(
            error_code=0, transaction_state="Ongoing", producer_id=5, producer_epoch=1, topics=topics)])

    monkeypatch.setattr(forwarding, "forward_to", forward_to)
    async with running(_config(tmp_path / "data"), Clock()) as node:
        node.create_topic("t", 2)
        _shard_cluster(node, owner=2, holder=None)  # another broker coordinates every id
        c = node.transactions
        assert c.check_produce(5, 1, "t", 0) is not None  # nothing verified yet
        assert await c.verify_produce("x", [("t", 0, 5, 1), ("t", 1, 5, 1)]) == {
            ("t", 1): (48, "t-1 is not part of an ongoing transaction of producer 5")}
        assert c.check_produce(5, 1, "t", 0) is None
        assert (await c.verify_produce("x", [("t", 0, 5, 0)]))[("t", 0)][0] == 47  # an older epoch
        assert (await c.verify_produce("x", [("t", 0, 6, 1)]))[("t", 0)][0] == 49  # not its producer
        asked.clear()
        assert await c.verify_produce("x", [("t", 0, 5, 1)]) == {}  # cached: not asked again
        assert asked == []
        # the partition's marker ends the transaction there: asked again next time
        t0 = node.partition("t", 0)
        assert t0 is not None
        c._admit_marker(t0, MarkerType.COMMIT, 5, 1, 0, T0)
        assert c.check_produce(5, 1, "t", 0) is not None
        answer["fail"] = True
        assert (await c.verify_produce("x", [("t", 0, 5, 1)]))[("t", 0)][0] == 19  # NOT_ENOUGH_REPLICAS: retriable
        assert asked == ["x"]

"""Cluster mode's pieces: the broker list, liveness and failover, the ISR rule, acks=all's
wait, the read-replica choice, and the config that turns it on. Processes and real clients: compat_tests/test_cluster.py."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from broker.cli import _parser as parser
from broker.cli import build_config
from broker.cluster import NO_LEADER, Cluster
from broker.cluster.etcd import Etcd
from broker.cluster.membership import Member, Membership
from broker.cluster.shards import partition_for
from broker.config import BrokerConfig, ConfigError, apply_properties
from broker.mirror import kafka_request
from broker.server import run
from broker.tests.conftest import RawClient
from compat_tests.etcd import EtcdServer
from compat_tests.ports import free_port
from storage.batch import build_batch

KEY = b"k" * 32
LAG_MS = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


SESSION_MS = 3000


def _membership(me: int = 1, members: tuple[int, ...] = (1, 2, 3), controller: int | None = 1) -> Membership:
    """A view of etcd as the watch would have filled it (no etcd: the pieces above it)."""
    m = Membership(Etcd(["http://127.0.0.1:1"]), "test", Member(me, f"h{me}", 9092, f"r{me}"), 3, clock=lambda: 0.0)
    m.lease, m._lease_deadline = 1, float("inf")
    m.members = {i: Member(i, f"h{i}", 9092, f"r{i}") for i in members}
    m.controller, m.controller_epoch = controller, (7 if controller is not None else 0)
    return m


def _cluster(me: int = 1, clock: Clock | None = None, members: tuple[int, ...] = (1, 2, 3)) -> Cluster:
    c = Cluster(_membership(me, members), replica_lag_ms=LAG_MS, session_timeout_ms=SESSION_MS, clock=clock or Clock())
    c.learn(2, b"2" * 32)
    c.learn(3, b"3" * 32)
    return c


def test_properties_and_flags(tmp_path: Path) -> None:
    endpoints = "http://127.0.0.1:2379, http://10.0.0.2:2379/"
    config = apply_properties(BrokerConfig(), {"hyperkafka.cluster.etcd.endpoints": endpoints,
                                               "replica.lag.time.max.ms": "2500"})
    assert config.cluster_etcd_endpoints == ["http://127.0.0.1:2379", "http://10.0.0.2:2379"]
    assert config.cluster_name == "hyperkafka" and config.replica_lag_ms == 2500
    assert config.session_timeout_ms == 9000  # Kafka's broker.session.timeout.ms default
    assert apply_properties(BrokerConfig(), {"broker.session.timeout.ms": "1500"}).session_timeout_ms == 1500
    assert apply_properties(BrokerConfig(), {"hyperkafka.cluster.name": "prod"}).cluster_name == "prod"
    for bad in ({"replica.lag.time.max.ms": "0"}, {"broker.session.timeout.ms": "0"},
                {"hyperkafka.cluster.etcd.endpoints": "127.0.0.1:2379"},
                {"hyperkafka.cluster.etcd.endpoints": ","}, {"hyperkafka.cluster.name": "a/b"},
                {"hyperkafka.cluster.brokers": "1@h1:9092"}):  # static membership is gone
        with pytest.raises(ConfigError):
            apply_properties(BrokerConfig(), bad)
    with pytest.raises(ConfigError):
        apply_properties(BrokerConfig(), {"replica.selector.class": "com.example.Mine"})
    leader_only = "org.apache.kafka.common.replica.LeaderSelector"
    assert apply_properties(BrokerConfig(), {"replica.selector.class": leader_only}).replica_selector == leader_only
    props = tmp_path / "server.properties"
    props.write_text(f"node.id=2\nhyperkafka.cluster.etcd.endpoints={endpoints}\n")
    with pytest.raises(ConfigError, match="replication"):
        build_config(parser().parse_args(["serve", "--config", str(props)]))
    config = build_config(parser().parse_args(["serve", "--config", str(props), "--replication-listen", "127.0.0.1:0"]))
    assert config.node_id == 2 and config.auto_create_topics  # placed by the controller, asked by others
    names = {e.name: e.value for e in config.describe_broker()}
    assert names["hyperkafka.cluster.etcd.endpoints"] == "http://127.0.0.1:2379,http://10.0.0.2:2379"
    assert names["hyperkafka.cluster.name"] == "hyperkafka"
    assert names["broker.session.timeout.ms"] == "9000"
    assert "hyperkafka.cluster.etcd.endpoints" not in {e.name for e in BrokerConfig().describe_broker()}


def test_membership() -> None:
    c = _cluster(me=2)
    assert c.controller_id == 1 and not c.is_controller and _cluster(me=1).is_controller
    assert [b.node_id for b in c.peers()] == [1, 3]
    assert c.replicas(2) == [2, 1, 3] and c.replicas(1) == [1, 2, 3]
    assert c.cluster_id == _cluster(me=3).cluster_id  # every broker names the same cluster
    assert c.broker_for_identity(b"3" * 32) == 3 and c.broker_for_identity(b"x" * 32) is None
    assert c.racks == {1: "r1", 2: "r2", 3: "r3"}


def test_liveness_is_the_etcd_view() -> None:
    c = _cluster(me=2)
    m = c.membership
    assert c.live_ids() == [1, 2, 3] and c.controller_id == 1
    del m.members[1]  # its lease expired: etcd deleted its registration (and the controller key)
    m.controller, m.controller_epoch = None, 0
    assert c.live_ids() == [2, 3] and not c.alive(1) and c.controller_id == NO_LEADER and not c.is_controller
    m.controller, m.controller_epoch = 2, 9  # won the election
    assert c.is_controller
    m._lease_deadline = float("-inf")  # by our own clock our lease may have expired: we do not act
    assert not c.is_controller
    m.members.clear()
    assert c.live_ids() == [2] and c.alive(2)  # never dead to itself


def test_leadership_fails_over_to_the_lowest_live_in_sync_replica() -> None:
    c = _cluster(me=3)
    members = c.membership.members
    assert c.leadership(1, [1, 2, 3]) == (1, [1, 2, 3])
    gone = members.pop(1)
    # the writer is dead: a live in-sync mirror leads (for reads), the ISR loses the dead
    assert c.leadership(1, [1, 2, 3]) == (2, [2, 3])
    assert c.leadership(1, [1, 3]) == (3, [3])  # 2 was not in sync: never picked
    assert c.leadership(1, [1]) == (NO_LEADER, [])  # nobody holds it all: offline
    members[1] = gone
    assert c.leadership(1, [1, 3]) == (1, [1, 3])  # the writer is back: it leads again
    del members[2]
    assert c.leadership(1, [1, 2, 3]) == (1, [1, 3])  # a dead mirror leaves the ISR


def test_metadata_reports_from_peers() -> None:
    c = _cluster(me=3)
    c.take_metadata(1, [("t", 0, [1, 2, 3], [1, 2, 3]), ("t", 1, [1, 2, 3], [1, 3]),
                        ("u", 0, [2, 1, 3], [2, 1, 3])])  # u: 1 reports 2's partition, 2 is the authority
    assert c.remote_isr == {("t", 0): [1, 2, 3], ("t", 1): [1, 3]}
    c.take_metadata(2, [("u", 0, [2, 1, 3], [2, 1, 3])])
    c.take_metadata(1, [("t", 0, [1, 2, 3], [1, 2])])  # t-1 deleted on its writer
    assert c.remote_isr == {("t", 0): [1, 2], ("u", 0): [2, 1, 3]}
    del c.membership.members[1]
    c.take_metadata(2, [("u", 0, [2, 1, 3], [2, 3])])
    assert c.leadership(1, c.remote_isr[("t", 0)]) == (2, [2])  # the writer's last report decides


def test_a_broker_started_after_a_writer_died_learns_its_isr_from_a_peer() -> None:
    c = _cluster(me=3, members=(2, 3))  # 1 is not registered since we started
    # 2 still knows 1's last ISR and leads t-0 for reads
    c.take_metadata(2, [("t", 0, [1, 2, 3], [2, 3])])
    assert c.leadership(1, c.remote_isr[("t", 0)]) == (2, [2, 3])  # the same leader as 2 names
    c.take_metadata(2, [("t", 0, [1, 2, 3], [2])])
    assert c.remote_isr[("t", 0)] == [2, 3]  # known now: a peer's view does not replace it
    c.membership.members[1] = Member(1, "h1", 9092)
    c.take_metadata(1, [("t", 0, [1, 2, 3], [1])])  # the writer is back: its report is the truth
    assert c.remote_isr[("t", 0)] == [1] and c.leadership(1, [1]) == (1, [1])


def test_a_dead_follower_leaves_the_isr_at_once() -> None:
    clock = Clock()
    c = Cluster(_membership(1), replica_lag_ms=30_000, session_timeout_ms=SESSION_MS, clock=clock)
    c.published(KEY, 5)
    for peer in (2, 3):
        c.connected(KEY, peer)
        c.acked(KEY, peer, 5)
    assert c.isr(KEY) == [1, 2, 3]
    gone = c.membership.members.pop(2)
    # 2 still has its connection open (a stopped process keeps it) and is within the
    # lag, but its lease expired: fenced, as Kafka's controller fences it
    assert c.isr(KEY) == [1, 3]
    c.membership.members[2] = gone
    assert c.isr(KEY) == [1, 2, 3]


def test_isr_follows_acked_lengths_and_the_lag() -> None:
    clock = Clock()
    c = _cluster(clock=clock)
    c.published(KEY, 5)
    assert c.isr(KEY) == [1]  # nobody has said what it holds
    c.connected(KEY, 2)
    c.acked(KEY, 2, 4)
    assert c.isr(KEY) == [1]  # must first hold what the leader had when it started
    c.acked(KEY, 2, 5)
    c.connected(KEY, 3)
    c.acked(KEY, 3, 5)
    assert c.isr(KEY) == [1, 2, 3]
    clock.now += 0.1
    c.published(KEY, 9)  # a new head: followers have the lag to catch up
    clock.now += LAG_MS / 1000 - 0.2
    c.acked(KEY, 3, 9)
    assert c.isr(KEY) == [1, 2, 3]
    clock.now += 0.2  # 2 has not held the head of `lag` ago: out
    assert c.isr(KEY) == [1, 3]
    c.acked(KEY, 2, 9)
    assert c.isr(KEY) == [1, 2, 3]
    c.disconnected(KEY, 3)  # gone, but in sync until the lag has passed
    clock.now += LAG_MS / 1000 - 0.01
    assert c.isr(KEY) == [1, 2, 3]
    clock.now += 0.02
    assert c.isr(KEY) == [1, 2]
    c.connected(KEY, 3)  # back: it must say again what it holds
    assert c.isr(KEY) == [1, 2]
    c.acked(KEY, 3, 9)
    assert c.isr(KEY) == [1, 2, 3]
    c.acked(b"elsewhere" * 4, 2, 3)  # an archive this broker does not write: not tracked
    assert c.isr(b"elsewhere" * 4) == [1]


def test_preferred_read_replica() -> None:
    clock = Clock()
    c = _cluster(clock=clock)
    c.published(KEY, 5)
    for peer in (2, 3):
        c.connected(KEY, peer)
        c.acked(KEY, peer, 5)
    assert c.preferred_read_replica(KEY, "r2") == 2
    assert c.preferred_read_replica(KEY, "r3") == 3
    assert c.preferred_read_replica(KEY, "r1") is None  # the leader's own rack: read it there
    assert c.preferred_read_replica(KEY, "elsewhere") is None
    assert c.preferred_read_replica(KEY, "") is None
    c.disconnected(KEY, 2)
    clock.now += 2 * LAG_MS / 1000
    assert c.preferred_read_replica(KEY, "r2") is None  # out of sync: never sent there
    c.membership.members[3] = Member(3, "h3", 9092, "r2")
    assert c.preferred_read_replica(KEY, "r2") == 3
    c.rack_aware = False  # replica.selector.class=...LeaderSelector
    assert c.preferred_read_replica(KEY, "r2") is None


async def test_wait_replicated_waits_for_every_in_sync_follower(autojump_clock: trio.testing.MockClock) -> None:
    c = Cluster(_membership(1), replica_lag_ms=LAG_MS, clock=trio.current_time)
    c.published(KEY, 1)
    for peer in (2, 3):
        c.connected(KEY, peer)
        c.acked(KEY, peer, 1)
    c.published(KEY, 2)
    async with trio.open_nursery() as nursery:
        got: list[bool] = []

        async def wait() -> None:
            got.append(await c.wait_replicated(KEY, 2, 2))

        nursery.start_soon(wait)
        await trio.sleep(0.01)
        c.acked(KEY, 2, 2)
        await trio.sleep(0.01)
        assert got == []  # 3 is still in sync and does not hold it yet
        c.acked(KEY, 3, 2)
    assert got == [True]

    # both followers gone: they leave the ISR after the lag, then too few replicas hold it
    c.published(KEY, 3)
    c.disconnected(KEY, 2)
    c.disconnected(KEY, 3)
    start = trio.current_time()
    assert await c.wait_replicated(KEY, 3, 2) is False
    assert trio.current_time() - start >= LAG_MS / 1000
    # and with min.insync.replicas=1 the leader alone is enough once they left
    assert await c.wait_replicated(KEY, 3, 1) is True


async def test_wait_replicated_of_a_quorum_archive_counts_its_signers(autojump_clock: trio.testing.MockClock) -> None:
    # acks=all on a quorum-signed partition: the replicas that signed a head hold its
    # blocks; with min.insync.replicas within the quorum nobody else is waited for, even
    # a third replica in sync whose mirror has not said it holds them yet
    c = Cluster(_membership(1), replica_lag_ms=LAG_MS, clock=trio.current_time)
    c.published(KEY, 1)
    for peer in (2, 3):
        c.connected(KEY, peer)
        c.acked(KEY, peer, 1)
    c.signer_signed(KEY, 2, 0, 2)
    c.published(KEY, 2)
    with trio.fail_after(0.001):
        assert await c.wait_replicated(KEY, 2, 2) is True
    # min.insync.replicas=3: the third replica is waited for (its signature or its range)
    async with trio.open_nursery() as nursery:
        got: list[bool] = []

        async def wait() -> None:
            got.append(await c.wait_replicated(KEY, 2, 3))

        nursery.start_soon(wait)
        await trio.sleep(0.3)
        assert got == []
        c.acked(KEY, 3, 2)
    assert got == [True]
    # a newer fork forgets what was signed on the older one (a cut may have dropped it)
    c.signer_signed(KEY, 3, 1, 3)
    c.signer_signed(KEY, 2, 0, 9)  # (a late answer of the old fork counts for nothing)
    with trio.fail_after(0.001):
        assert await c.wait_replicated(KEY, 3, 2) is True
    with trio.move_on_after(1):
        await c.wait_replicated(KEY, 4, 2)
        raise AssertionError("length 4 was signed by no replica")
    # too few replicas alive to ever get there: False at once
    c.membership.members.pop(2)
    c.membership.members.pop(3)
    with trio.fail_after(0.001):
        assert await c.wait_replicated(KEY, 4, 2) is False


# ------------------------------------------------------------ one broker of a cluster


async def _serve(nursery: trio.Nursery, tmp_path: Path, node_id: int, ports: list[int], endpoint: str,
                 session_ms: int = 3000, **props: str) -> RawClient:
    """Broker `node_id` of a cluster on the etcd at `endpoint`, in this process."""
    config = apply_properties(BrokerConfig(data_dir=tmp_path / f"b{node_id}", listen_port=ports[node_id - 1],
                                           shutdown_grace_s=2, replication_listen=("127.0.0.1", 0)),
                              {"node.id": str(node_id), "broker.rack": f"r{node_id}",
                               "hyperkafka.cluster.etcd.endpoints": endpoint,
                               "broker.session.timeout.ms": str(session_ms), **props})
    await nursery.start(run, config)
    return RawClient(await trio.open_tcp_stream("127.0.0.1", ports[node_id - 1]))


async def _controller(c: RawClient) -> int:
    md = await c.call("metadata", 9, {"topics": [], "allow_auto_topic_creation": False,
                                      "include_cluster_authorized_operations": False,
                                      "include_topic_authorized_operations": False})
    return int(md.controller_id)


def _free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


async def test_controller_alone_answers_as_a_cluster(tmp_path: Path, etcd: EtcdServer) -> None:
    ports = _free_ports(3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            c = await _serve(nursery, tmp_path, 1, ports, etcd.endpoint)

            async def elected() -> bool:
                return await _controller(c) == 1

            await _until(elected)
            r = await c.call("create_topics", 5, {"topics": [
                {"name": "t", "num_partitions": 1, "replication_factor": 1, "assignments": [],
                 "configs": [{"name": "min.insync.replicas", "value": "2"}]},
                {"name": "too-many", "num_partitions": 1, "replication_factor": 2, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert [(t.error_code, t.replication_factor) for t in r.topics] == [(0, 1), (38, -1)]
            md = await c.call("metadata", 9, {"topics": [{"name": "t"}], "allow_auto_topic_creation": False,
                                              "include_cluster_authorized_operations": False,
                                              "include_topic_authorized_operations": False})
            assert [(b.node_id, b.port, b.rack) for b in md.brokers] == [(1, ports[0], "r1")]
            assert md.controller_id == 1
            p = md.topics[0].partitions[0]
            assert (p.leader_id, list(p.replica_nodes), list(p.isr_nodes), list(p.offline_replicas)) == (
                1, [1], [1], [])
            batch = bytes(build_batch([b"v"], timestamp_ms=1_700_000_000_000))

            async def produce(acks: int) -> int:
                r = await c.call("produce", 8, {"acks": acks, "timeout": 5000, "transactional_id": None, "topic_data": [
                    {"name": "t", "partition_data": [{"index": 0, "records": batch}]}]})
                return int(r.responses[0].partition_responses[0].error_code)

            assert await produce(-1) == 19  # NOT_ENOUGH_REPLICAS: the ISR is the leader alone
            assert await produce(1) == 0
            nursery.cancel_scope.cancel()


async def test_other_brokers_route_to_the_controller_and_groups_to_their_coordinator(tmp_path: Path, etcd: EtcdServer) -> None:
    ports = _free_ports(3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            c1 = await _serve(nursery, tmp_path, 1, ports, etcd.endpoint)

            async def elected() -> bool:
                return await _controller(c1) == 1

            await _until(elected)
            c = await _serve(nursery, tmp_path, 2, ports, etcd.endpoint)

            async def registered() -> bool:
                md = await _metadata(c, "t")
                return [(b.node_id, b.port, b.rack) for b in md.brokers] == [(1, ports[0], "r1"), (2, ports[1], "r2")]

            await _until(registered)  # from etcd: brokers, their addresses and racks
            r = await c.call("create_topics", 5, {"topics": [
                {"name": "t", "num_partitions": 1, "replication_factor": -1, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            # forwarded to the controller (KIP-590), which places it
            assert (r.topics[0].error_code, r.topics[0].num_partitions) == (0, 1)
            # Groups are sharded as Kafka's: group -> a partition of __consumer_offsets
            # (Kafka's hash, 50 partitions) -> its preferred broker, here [1, 2][p % 2].
            by_broker = {[1, 2][partition_for(f"g{i}", 50) % 2]: f"g{i}" for i in range(20)}
            g1, g2 = by_broker[1], by_broker[2]

            async def sharded() -> bool:  # the batched FindCoordinator (v4+), asked of broker 2
                fc = await c.call("find_coordinator", 4, {"key_type": 0, "coordinator_keys": [g1, g2]})
                return [(x.node_id, x.port, x.error_code) for x in fc.coordinators] == [
                    (1, ports[0], 0), (2, ports[1], 0)]

            await _until(sharded)
            fc = await c1.call("find_coordinator", 3, {"key": g2, "key_type": 0})  # the same from broker 1
            assert (fc.node_id, fc.port) == (2, ports[1])
            # group requests sent to another broker anyway: NOT_COORDINATOR, the client asks again
            hb = await c.call("heartbeat", 4, {"group_id": g1, "generation_id": 1, "member_id": "m",
                                               "group_instance_id": None})
            assert hb.error_code == 16

            async def served() -> bool:  # once broker 2 took its partitions over (not LOAD_IN_PROGRESS)
                of = await c.call("offset_fetch", 8, {"groups": [{"group_id": g1, "topics": None},
                                                                 {"group_id": g2, "topics": None}],
                                                      "require_stable": False})
                return [g.error_code for g in of.groups] == [16, 0]

            await _until(served)
            # every broker lists the same partitions of __consumer_offsets, led by their coordinators
            views = []
            for client in (c1, c):
                md = await _metadata(client, "__consumer_offsets")
                views.append(sorted((p.partition_index, p.leader_id) for p in md.topics[0].partitions))
            assert views[0] == views[1] and len(views[0]) == 50
            assert {leader for _, leader in views[0]} == {1, 2}
            md = await c.call("metadata", 9, {"topics": [{"name": "new"}], "allow_auto_topic_creation": True,
                                              "include_cluster_authorized_operations": False,
                                              "include_topic_authorized_operations": False})
            # forwarded to the controller: the client is told to ask again
            assert md.controller_id == 1 and md.topics[0].error_code == 5

            async def created() -> bool:
                md = await _metadata(c, "new")
                return md.topics[0].error_code == 0

            await _until(created)
            nursery.cancel_scope.cancel()


async def test_create_topics_sent_to_a_former_controller(tmp_path: Path, etcd: EtcdServer) -> None:
    """The controller moves (its lease lost, as in a partition from etcd, then healed): a
    client that still routes CreateTopics by the controller id of an old Metadata answer
    (librdkafka asks for Metadata again only on a new connection, never on NOT_CONTROLLER)
    sends it to the former controller, which forwards it to the new one. Without that, the
    Jepsen test's admin client was answered NOT_CONTROLLER until the end of the run."""
    ports = _free_ports(2)
    client = Etcd([etcd.endpoint])
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            c1 = await _serve(nursery, tmp_path, 1, ports, etcd.endpoint)

            async def elected() -> bool:
                return await _controller(c1) == 1

            await _until(elected)
            c2 = await _serve(nursery, tmp_path, 2, ports, etcd.endpoint)
            r = await c1.call("create_topics", 5, {"topics": [
                {"name": "before", "num_partitions": 1, "replication_factor": -1, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 0

            async def moved() -> bool:
                """Broker 2 is controller in both brokers' views; while broker 1 is, its
                lease is revoked (it registers again at once, as after a heal)."""
                kvs, _ = await client.get(b"/", prefix=True)
                ctl = [kv for kv in kvs if kv.key.endswith(b"/controller")]
                if ctl and json.loads(ctl[0].value)["id"] == 1:
                    await client.revoke(ctl[0].lease)
                    return False
                return await _controller(c1) == 2 and await _controller(c2) == 2

            await _until(moved)

            async def back() -> bool:
                md = await _metadata(c2, "before")
                return [b.node_id for b in md.brokers] == [1, 2]

            await _until(back)  # broker 1 registered again: a live broker, not the controller
            r = await c1.call("create_topics", 5, {"topics": [
                {"name": "after", "num_partitions": 2, "replication_factor": -1, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert (r.topics[0].error_code, r.topics[0].num_partitions) == (0, 2), r.topics[0].error_message

            async def placed() -> bool:
                return (await _metadata(c1, "after")).topics[0].error_code == 0

            await _until(placed)
            # a request another broker forwarded is not forwarded again (no loop)
            raw = await kafka_request("127.0.0.1", ports[0], 19, 7, "create_topics", {"topics": [
                {"name": "again", "num_partitions": 1, "replication_factor": -1, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert raw.topics[0].error_code == 41  # NOT_CONTROLLER
            nursery.cancel_scope.cancel()


async def test_topic_changes_forwarded_to_its_writer(tmp_path: Path, etcd: EtcdServer) -> None:
    """AlterConfigs, IncrementalAlterConfigs and CreatePartitions for a topic another
    broker writes are forwarded to it (only the writer signs the topic's catalog): a
    client sends them to the controller or any broker (Kafka's brokers forward them to
    the controller, KIP-590) and would not know to ask the writer. Single-signer topics on
    purpose (quorum-signed partitions are on by default): a quorum-signed topic's configs
    are its etcd record's, changed by any broker (test_quorum_admin.py), and it is not
    grown."""
    ports = _free_ports(2)
    single = {"hyperkafka.quorum.partitions.enable": "false"}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            c1 = await _serve(nursery, tmp_path, 1, ports, etcd.endpoint, **single)

            async def elected() -> bool:
                return await _controller(c1) == 1

            await _until(elected)
            c2 = await _serve(nursery, tmp_path, 2, ports, etcd.endpoint, **single)

            async def both() -> bool:
                return [b.node_id for b in (await _metadata(c1, "w")).brokers] == [1, 2]

            await _until(both)
            r = await c1.call("create_topics", 5, {"topics": [  # written by broker 2
                {"name": "w", "num_partitions": -1, "replication_factor": -1,
                 "assignments": [{"partition_index": 0, "broker_ids": [2]}], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 0, r.topics[0].error_message

            async def mirrored() -> bool:
                t = (await _metadata(c1, "w")).topics[0]
                return not t.error_code and t.partitions[0].leader_id == 2

            await _until(mirrored)

            def resource(*configs: dict[str, Any]) -> dict[str, Any]:
                return {"resources": [{"resource_type": 2, "resource_name": "w", "configs": list(configs)}],
                        "validate_only": False}

            async def configs_on_2() -> dict[str, str]:
                d = await c2.call("describe_configs", 4, {
                    "resources": [{"resource_type": 2, "resource_name": "w", "configuration_keys": None}],
                    "include_synonyms": False, "include_documentation": False})
                return {e.name: e.value for e in d.results[0].configs if e.config_source == 1}

            # sent to the controller (broker 1): applied by the writer (broker 2)
            r = await c1.call("incremental_alter_configs", 1, resource(
                {"name": "retention.ms", "config_operation": 0, "value": "1234"}))
            assert r.responses[0].error_code == 0, r.responses[0].error_message
            assert await configs_on_2() == {"retention.ms": "1234"}
            r = await c1.call("alter_configs", 2, resource({"name": "segment.bytes", "value": "1048576"}))
            assert r.responses[0].error_code == 0, r.responses[0].error_message
            assert await configs_on_2() == {"segment.bytes": "1048576"}
            # the writer's refusal comes back as it is
            r = await c1.call("incremental_alter_configs", 1, resource(
                {"name": "remote.storage.enable", "config_operation": 0, "value": "true"}))
            assert r.responses[0].error_code == 40  # INVALID_CONFIG
            # a change another broker forwarded is not forwarded again (no loop)
            raw = await kafka_request("127.0.0.1", ports[0], 44, 1, "incremental_alter_configs", resource(
                {"name": "retention.ms", "config_operation": 0, "value": "1"}))
            assert raw.responses[0].error_code == 42  # INVALID_REQUEST, naming the writer
            assert "broker 2" in raw.responses[0].error_message

            def grow(count: int) -> dict[str, Any]:
                return {"topics": [{"name": "w", "count": count, "assignments": None}],
                        "timeout": 5000, "validate_only": False}

            r = await c1.call("create_partitions", 3, grow(2))  # the controller: to the writer
            assert r.results[0].error_code == 0, r.results[0].error_message
            r = await c2.call("create_partitions", 3, grow(3))  # the writer, not the controller
            assert r.results[0].error_code == 0, r.results[0].error_message
            assert len((await _metadata(c2, "w")).topics[0].partitions) == 3
            raw = await kafka_request("127.0.0.1", ports[0], 37, 3, "create_partitions", grow(4))
            assert raw.results[0].error_code == 42  # forwarded here already: not again
            nursery.cancel_scope.cancel()


async def _metadata(c: RawClient, topic: str) -> Any:
    return await c.call("metadata", 9, {"topics": [{"name": topic}], "allow_auto_topic_creation": False,
                                        "include_cluster_authorized_operations": False,
                                        "include_topic_authorized_operations": False})


async def _create(c: RawClient, topics: list[dict[str, Any]]) -> Any:
    """CreateTopics, asked again if the controller had not heard every broker since it
    started within the request's timeout (NOT_CONTROLLER, which Java's Admin retries)."""
    while True:
        r = await c.call("create_topics", 5, {"topics": topics, "timeout": 5000, "validate_only": False})
        if all(t.error_code != 41 for t in r.topics):
            return r
        await trio.sleep(0.05)


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    while True:  # another broker's state, over the network: no event to wait on
        if await check():
            return
        await trio.sleep(0.05)


async def test_two_brokers_in_process(tmp_path: Path, etcd: EtcdServer) -> None:
    """Broker 2 mirrors broker 1: the ISR grows from its range messages, acks=all with
    min.insync.replicas=2 succeeds, a fetch from its rack is sent to it, and a deletion
    sent to broker 2 is forwarded to the controller and removes the topic from both."""
    ports = _free_ports(2)

    async def serve(nursery: trio.Nursery, node_id: int) -> RawClient:
        return await _serve(nursery, tmp_path, node_id, ports, etcd.endpoint, **{"replica.lag.time.max.ms": "2000"})

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            c1 = await serve(nursery, 1)

            async def elected() -> bool:
                return await _controller(c1) == 1

            await _until(elected)  # 1 is controller: it places "t" on the least loaded broker, 1
            c2 = await serve(nursery, 2)
            r = await _create(c1, [{"name": "t", "num_partitions": 1, "replication_factor": 2, "assignments": [],
                                    "configs": [{"name": "min.insync.replicas", "value": "2"}]}])
            assert r.topics[0].error_code == 0

            async def isr_everywhere() -> bool:
                for c in (c1, c2):
                    md = await _metadata(c, "t")
                    if md.topics[0].error_code or list(md.topics[0].partitions[0].isr_nodes) != [1, 2]:
                        return False
                return True

            await _until(isr_everywhere)
            md = await _metadata(c2, "t")
            assert [(b.node_id, b.rack) for b in md.brokers] == [(1, "r1"), (2, "r2")]
            p = md.topics[0].partitions[0]
            assert (p.leader_id, list(p.replica_nodes)) == (1, [1, 2])

            batch = bytes(build_batch([b"v"], timestamp_ms=1_700_000_000_000))
            r = await c1.call("produce", 8, {"acks": -1, "timeout": 10000, "transactional_id": None, "topic_data": [
                {"name": "t", "partition_data": [{"index": 0, "records": batch}]}]})
            assert r.responses[0].partition_responses[0].error_code == 0
            r = await c2.call("produce", 8, {"acks": -1, "timeout": 10000, "transactional_id": None, "topic_data": [
                {"name": "t", "partition_data": [{"index": 0, "records": batch}]}]})
            assert r.responses[0].partition_responses[0].error_code == 6  # NOT_LEADER_OR_FOLLOWER

            def fetch(rack: str) -> dict[str, Any]:
                return {"replica_id": -1, "max_wait": 0, "min_bytes": 0, "max_bytes": 1 << 20, "isolation_level": 0,
                        "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [], "rack_id": rack,
                        "topics": [{"topic": "t", "partitions": [
                            {"partition": 0, "current_leader_epoch": 0, "fetch_offset": 0, "log_start_offset": -1,
                             "partition_max_bytes": 1 << 20}]}]}

            f = (await c1.call("fetch", 11, fetch("r2"))).responses[0].partitions[0]
            assert (f.preferred_read_replica, f.records or b"") == (2, b"")  # go to broker 2
            f = (await c1.call("fetch", 11, fetch("r1"))).responses[0].partitions[0]
            assert f.preferred_read_replica == -1 and f.records  # the leader's own rack
            at_leader = bytes(f.records)
            f = (await c2.call("fetch", 11, fetch("r2"))).responses[0].partitions[0]
            # broker 2 serves its verified copy, byte for byte the leader's
            assert (f.preferred_read_replica, f.high_watermark, bytes(f.records)) == (-1, 1, at_leader)

            # beyond what broker 2 holds: the error for a client that sent an epoch (it asks
            # the leader), an empty answer for one that did not (as Kafka)
            ahead = fetch("r2")
            ahead["topics"][0]["partitions"][0]["fetch_offset"] = 5
            f = (await c2.call("fetch", 11, ahead)).responses[0].partitions[0]
            assert (f.error_code, f.high_watermark) == (1, 1)
            ahead["topics"][0]["partitions"][0]["current_leader_epoch"] = -1
            f = (await c2.call("fetch", 11, ahead)).responses[0].partitions[0]
            assert (f.error_code, f.records or b"") == (0, b"")

            # producer ids: each broker hands out its own range, so any broker may answer
            pids = [(await c.call("init_producer_id", 1, {"transactional_id": None, "transaction_timeout": 60000})).producer_id
                    for c in (c1, c2)]
            assert pids[0] >> 40 == 1 and pids[1] >> 40 == 2

            # a deletion another broker forwarded is not forwarded again (no loop)
            raw = await kafka_request("127.0.0.1", ports[1], 20, 4, "delete_topics",
                                      {"topic_names": ["t"], "timeout": 5000})
            assert raw.responses[0].error_code == 41  # NOT_CONTROLLER
            # sent to broker 2, not the controller: forwarded to it (KIP-590; librdkafka
            # never asks for Metadata again on NOT_CONTROLLER), and gone here when answered
            r = await c2.call("delete_topics", 4, {"topic_names": ["t"], "timeout": 5000})
            assert r.responses[0].error_code == 0, r.responses[0].error_message
            assert (await _metadata(c2, "t")).topics[0].error_code == 3
            r = await c1.call("delete_topics", 4, {"topic_names": ["t"], "timeout": 5000})
            assert r.responses[0].error_code == 3  # UNKNOWN_TOPIC_OR_PARTITION: deleted once
            assert list((tmp_path / "b2" / "__mirrors").glob("*/t-0")) == []  # the copy is deleted too
            nursery.cancel_scope.cancel()


async def _commit(c: RawClient, group: str, offset: int) -> int:
    """A commit of `offset` for t-0 (generation -1: a group without members), retried
    while the coordinator is loading; its error code."""
    while True:
        r = await c.call("offset_commit", 8, {
            "group_id": group, "generation_id_or_member_epoch": -1, "member_id": "", "group_instance_id": None,
            "topics": [{"name": "t", "partitions": [{"partition_index": 0, "committed_offset": offset,
                                                     "committed_leader_epoch": -1, "committed_metadata": None}]}]})
        code = int(r.topics[0].partitions[0].error_code)
        if code != 14:  # COORDINATOR_LOAD_IN_PROGRESS: retriable
            return code
        await trio.sleep(0.05)


async def _committed(c: RawClient, group: str) -> tuple[int, int]:
    """(error, committed offset of t-0) from OffsetFetch, retried while loading."""
    while True:
        r = await c.call("offset_fetch", 8, {"groups": [{"group_id": group, "topics": [
            {"name": "t", "partition_indexes": [0]}]}], "require_stable": False})
        g = r.groups[0]
        if g.error_code != 14:
            return int(g.error_code), int(g.topics[0].partitions[0].committed_offset) if g.topics else -1
        await trio.sleep(0.05)


async def test_failover_when_the_writer_dies(tmp_path: Path, etcd: EtcdServer) -> None:
    """Broker 1 (writer and controller) stops: broker 2 drops it from Metadata after the
    session timeout, leads its partition for reads, refuses produce there with a retriable
    error, becomes controller (CreateTopics) and coordinator of broker 1's groups with their
    committed offsets; broker 1 back leads again and coordinates its groups again (its
    partitions of __consumer_offsets move back) with broker 2's commits. Single-signer
    topics on purpose (quorum-signed partitions are on by default): their writes wait for
    their writer; a quorum-signed partition's failover elects a leader (test_takeover.py,
    compat_tests/test_cluster_failover.py)."""
    ports = _free_ports(2)

    async def serve(nursery: trio.Nursery, node_id: int) -> RawClient:
        return await _serve(nursery, tmp_path, node_id, ports, etcd.endpoint, session_ms=2000,
                            **{"replica.lag.time.max.ms": "5000", "hyperkafka.quorum.partitions.enable": "false"})

    batch = bytes(build_batch([b"v"], timestamp_ms=1_700_000_000_000))

    async def produce(c: RawClient, topic: str) -> int:
        r = await c.call("produce", 8, {"acks": 1, "timeout": 5000, "transactional_id": None, "topic_data": [
            {"name": topic, "partition_data": [{"index": 0, "records": batch}]}]})
        return int(r.responses[0].partition_responses[0].error_code)

    async def fetch(c: RawClient, offset: int = 0) -> Any:
        f = await c.call("fetch", 11, {
            "replica_id": -1, "max_wait": 0, "min_bytes": 0, "max_bytes": 1 << 20, "isolation_level": 0,
            "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "",
            "topics": [{"topic": "t", "partitions": [{"partition": 0, "current_leader_epoch": 0, "fetch_offset": offset,
                                                      "log_start_offset": -1, "partition_max_bytes": 1 << 20}]}]})
        return f.responses[0].partitions[0]

    def view(md: Any) -> tuple[list[int], int, tuple[int, ...]]:
        if md.topics[0].error_code:
            return [b.node_id for b in md.brokers], md.controller_id, (md.topics[0].error_code,)
        p = md.topics[0].partitions[0]
        return ([b.node_id for b in md.brokers], md.controller_id,
                (p.error_code, p.leader_id, list(p.replica_nodes), list(p.isr_nodes), list(p.offline_replicas)))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as first:
                async with trio.open_nursery() as inner:
                    c1 = await serve(inner, 1)

                    async def elected() -> bool:
                        return await _controller(c1) == 1

                    await _until(elected)
                    c2 = await serve(nursery, 2)
                    r = await _create(c1, [{"name": "t", "num_partitions": 1, "replication_factor": 2,
                                            "assignments": [], "configs": []}])
                    assert r.topics[0].error_code == 0
                    assert await produce(c1, "t") == 0

                    async def in_sync() -> bool:
                        return view(await _metadata(c2, "t")) == ([1, 2], 1, (0, 1, [1, 2], [1, 2], []))

                    await _until(in_sync)
                    # committed on broker 1 (the coordinator): broker 2 holds the record
                    # (it is in sync) before the commit is answered
                    assert await _commit(c1, "offsets", 1) == 0
                    at_writer = bytes((await fetch(c1)).records)
                    first.cancel()  # broker 1 stops

            async def failed_over() -> bool:  # 1 left etcd; 2 was elected controller
                return view(await _metadata(c2, "t"))[:2] == ([2], 2)

            await _until(failed_over)
            # the dead writer's partition: broker 2 leads it for reads, 1 is offline
            assert view(await _metadata(c2, "t")) == ([2], 2, (0, 2, [1, 2], [2], [1]))
            assert await produce(c2, "t") == 6  # NOT_LEADER_OR_FOLLOWER: retriable, nothing lost
            part = await fetch(c2)
            # what the writer served, byte for byte, from the mirror's verified copy
            assert (part.error_code, part.high_watermark, bytes(part.records)) == (0, 1, at_writer)
            # a consumer ahead of the copy (it read records at the writer that broker 2 has
            # not got yet): an empty answer, not OFFSET_OUT_OF_RANGE (which would reset it)
            ahead = await fetch(c2, offset=5)
            assert (ahead.error_code, ahead.records or b"") == (0, b"")
            # broker 2 is the controller now: it creates topics (and writes them) and
            # coordinates groups
            fc = await c2.call("find_coordinator", 3, {"key": "g", "key_type": 0})
            assert (fc.error_code, fc.node_id, fc.port) == (0, 2, ports[1])
            r = await c2.call("create_topics", 5, {"topics": [
                {"name": "u", "num_partitions": 1, "replication_factor": 2, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 38  # one broker is registered: as Kafka
            r = await c2.call("create_topics", 5, {"topics": [
                {"name": "u", "num_partitions": 1, "replication_factor": 1, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 0
            assert await produce(c2, "u") == 0
            r = await c2.call("delete_topics", 4, {"topic_names": ["t"], "timeout": 5000})
            assert r.responses[0].error_code == 5  # its writer is down: LEADER_NOT_AVAILABLE, retriable

            join = {"group_id": "g", "session_timeout": 10000, "rebalance_timeout": 10000, "member_id": "",
                    "group_instance_id": None, "protocol_type": "consumer", "reason": None,
                    "protocols": [{"name": "range", "metadata": b""}]}
            # broker 2 took over broker 1's commits (from its copy of 1's offsets archive)
            assert await _committed(c2, "offsets") == (0, 1)
            joined = await c2.call("join_group", 9, join)
            assert joined.error_code == 79  # MEMBER_ID_REQUIRED: broker 2 coordinates the group
            assert await _commit(c2, "offsets", 2) == 0

            c1 = await serve(nursery, 1)  # the writer is back: it leads again
            # broker 2 stays controller (etcd elected it; nothing moves it back), and "u" is
            # placed on broker 2: never created a second time
            assert await _controller(c1) == 2
            r = await c2.call("create_topics", 5, {"topics": [
                {"name": "u", "num_partitions": 1, "replication_factor": 2, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 36  # TOPIC_ALREADY_EXISTS
            r = await c1.call("create_topics", 5, {"topics": [
                {"name": "u", "num_partitions": 1, "replication_factor": 2, "assignments": [], "configs": []}],
                "timeout": 5000, "validate_only": False})
            assert r.topics[0].error_code == 36  # forwarded to the controller: TOPIC_ALREADY_EXISTS

            async def back() -> bool:
                return view(await _metadata(c2, "t"))[:2] == ([1, 2], 2)

            await _until(back)
            assert view(await _metadata(c2, "t"))[2][:3] == (0, 1, [1, 2])
            # Groups are sharded: "offsets" maps to a partition of __consumer_offsets whose
            # preferred broker is 1, so it moves back there, which adopts broker 2's commit;
            # "g" stays on broker 2 (its preferred), and broker 1 sends its member there.
            async def offsets_back() -> bool:
                return await _committed(c1, "offsets") == (0, 2)

            await _until(offsets_back)
            assert await _committed(c2, "offsets") == (16, -1)  # NOT_COORDINATOR
            join["member_id"] = joined.member_id
            assert (await c1.call("join_group", 9, join)).error_code == 16  # NOT_COORDINATOR
            fc = await c1.call("find_coordinator", 3, {"key": "g", "key_type": 0})
            assert (fc.node_id, fc.port) == (2, ports[1])
            assert await produce(c1, "t") == 0

            async def u_on_1() -> bool:  # the topic created meanwhile: broker 2 writes it
                md = await _metadata(c1, "u")
                return not md.topics[0].error_code and md.topics[0].partitions[0].leader_id == 2

            await _until(u_on_1)
            # deleting "t" goes to the controller (2), which has its writer (1) delete it
            r = await c2.call("delete_topics", 4, {"topic_names": ["t"], "timeout": 5000})
            assert r.responses[0].error_code == 0
            assert (await _metadata(c2, "t")).topics[0].error_code == 3  # gone when the answer came

            async def t_gone_on_1() -> bool:
                return bool((await _metadata(c1, "t")).topics[0].error_code == 3)

            await _until(t_gone_on_1)
            nursery.cancel_scope.cancel()

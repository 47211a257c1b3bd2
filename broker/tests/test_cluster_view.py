"""The cluster view (broker/cluster/view.py): `NullCluster` answers for a single broker,
and it and the etcd `Cluster` answer the same questions the same way where a cluster of
one broker is the same thing as a broker alone."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from broker.cluster import Cluster, ClusterView, NullCluster
from broker.cluster.etcd import Etcd
from broker.cluster.membership import Member, Membership, Placement
from broker.cluster.shards import Shard
from broker.config import BrokerConfig
from broker.node import OFFSETS_TOPIC, LocalTopics, Node
from storage import Store

ME = 1
KEY = b"k" * 32


def _alone_in_etcd() -> Cluster:
    """The etcd view of a cluster whose only broker is this one: controller, writer of
    topic "t", coordinator of every partition of __consumer_offsets."""
    m = Membership(Etcd(["http://127.0.0.1:1"]), "test", Member(ME, "h1", 9092, "r1"), 3, clock=lambda: 0.0)
    m.lease, m._lease_deadline = 1, float("inf")
    m.members = {ME: Member(ME, "h1", 9092, "r1")}
    m.controller, m.controller_epoch = ME, 7
    m.placements["t"] = Placement("t", ME, 1)
    m.shards[OFFSETS_TOPIC] = {p: Shard(OFFSETS_TOPIC, p, ME, ME, 10 + p) for p in range(3)}
    return Cluster(m, replica_lag_ms=1000)


def _null() -> NullCluster:
    return NullCluster(ME, "h1", 9092, "r1", "cid")


VIEWS = {"null": _null, "etcd": _alone_in_etcd}


@pytest.mark.parametrize("make", VIEWS.values(), ids=list(VIEWS))
async def test_both_views_answer_alike_for_one_broker(make: Callable[[], ClusterView]) -> None:
    view: ClusterView = make()
    assert view.me == ME
    assert view.live_ids() == [ME]
    assert view.alive(ME) and not view.alive(2)
    assert view.peers() == []
    assert list(view.brokers) == [ME] and view.racks[ME] == "r1"
    assert view.controller_id == ME and view.is_controller
    assert view.replicas(ME) == [ME]
    assert view.leadership(ME, [ME]) == (ME, [ME])
    assert view.placed_writer("t") == ME
    assert view.placed_replicas("t", 0) is None  # a single-signer topic
    assert view.coordinator(OFFSETS_TOPIC, 0) == ME
    view.published(KEY, 5)
    assert view.isr(KEY) == [ME]
    assert view.short_of_insync(KEY, 1) is None
    with trio.fail_after(1):  # nobody else to wait for
        assert await view.wait_replicated(KEY, 5, 1)
    assert view.preferred_read_replica(KEY, "r2") is None
    assert view.broker_for_identity(b"x" * 32) is None
    assert view.remote_isr == {}


async def test_where_the_views_differ_is_only_what_a_cluster_adds() -> None:
    null, etcd = _null(), _alone_in_etcd()
    # Producer ids: a cluster broker hands out its own range; alone, from 0.
    assert null.producer_id_base == 0 and etcd.producer_id_base == ME << 40
    # acks=all alone waits for local durability only, and min.insync.replicas above one
    # is not refused (as before clusters); in etcd it counts the ISR.
    assert null.acks_all_replicas(2) == 0 and etcd.acks_all_replicas(2) == 2
    assert null.short_of_insync(KEY, 2) is None and etcd.short_of_insync(KEY, 2) == [ME]
    # Alone, __consumer_offsets is not sharded; etcd counts its placed partitions.
    assert null.shard_count(OFFSETS_TOPIC) is None and etcd.shard_count(OFFSETS_TOPIC) == 3
    assert etcd.shard_count("__transaction_state") == 0
    assert not null.multi_broker and etcd.multi_broker


async def test_the_null_cluster_is_everything_and_always_fenced_in() -> None:
    null = _null()
    assert null.placed_writer("any-topic") == ME  # every topic is written here
    assert null.coordinator("__transaction_state", 7) == ME  # every coordinator
    assert await null.check_fence(OFFSETS_TOPIC, {0: 3})  # nobody else can act
    assert await null.unplace("t")  # nothing is placed: nothing to fence
    assert null.produce_refusal("t", 0, None, 3) is None  # type: ignore[arg-type]
    assert not null.writes(KEY)  # no follower progress is tracked
    null.connected(KEY, 2)
    null.acked(KEY, 2, 10)
    null.disconnected(KEY, 2)
    assert null.isr(KEY) == [ME]


def test_a_node_always_has_a_cluster_view_and_keeps_its_cluster_id(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data")
    node = Node(config, Store.open(config.data_dir))
    try:
        assert isinstance(node.cluster, NullCluster)
        assert isinstance(node.topic_maker, LocalTopics)
        digest = hashlib.blake2b(node.store.node_public_key, digest_size=16).digest()
        # the id a single broker always had: a restart does not change it
        assert node.cluster_id == base64.urlsafe_b64encode(digest).decode().rstrip("=")
        assert node.cluster.cluster_id == node.cluster_id
        assert node.cluster.me == config.node_id
        assert node.allocate_producer_id() < 1 << 40
    finally:
        node.close()


def test_a_cluster_nodes_producer_ids_are_its_own_range(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data")
    node = Node(config, Store.open(config.data_dir), _alone_in_etcd())
    try:
        assert node.allocate_producer_id() >> 40 == ME
        assert node.cluster_id == node.cluster.cluster_id != NullCluster.from_config(
            config, node.store.node_public_key).cluster_id
    finally:
        node.close()

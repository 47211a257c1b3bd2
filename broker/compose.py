"""The composition root: builds a broker's node with its cluster view, its group
coordinator and its replication, and runs their background tasks.

`open_node` opens the data dir (descriptors on a budget, storage/handles.py), makes the
cluster view (`ClusterView`, broker/cluster/view.py): `Cluster.from_config` when the
config names etcd, else a `NullCluster`, with the matching `TopicMaker` (`PlacedTopics`,
broker/placement.py, or the node's own `LocalTopics`), the
`Node` (broker/node.py), its `GroupCoordinator` (broker/groups/coordinator.py, which
replays ``__consumer_offsets``) and its `TxnCoordinator` (broker/transactions/, which
replays ``__transaction_state``). `run_node` runs everything that keeps them moving: for
the etcd view, its session first (a cluster broker registers before anything else) and
placement (broker/placement.py) and the records of quorum-signed topics
(broker/placed_topics.py), which a NullCluster needs none of; the node's commit, retention, cleaner and offline-retry loops, the group
and transaction coordinators, and replication (broker/mirror.py) when the config asks for it.

Lower layers never import this module, nor each other upwards: broker.node imports neither
the coordinator, nor placement, nor the mirrors. Imported by the entry point
(broker/server.py) and by tests.
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from broker.cluster import Cluster, ClusterView, NullCluster
from broker.cluster.liveness import watch_peers
from broker.config import BrokerConfig
from broker.groups.coordinator import GroupCoordinator
from broker.mirror import run_replication
from broker.node import Node
from broker.placed_topics import follow_records
from broker.placement import PlacedTopics, follow_placements, manifest_hook
from broker.quorum_link import own_partitions, quorum_role
from broker.takeover import run_failover
from broker.transactions.coordinator import TxnCoordinator
from storage import Store
from storage.handles import FdBudget, HandleCache

log = logging.getLogger("hyperkafka.node")


def open_node(config: BrokerConfig) -> Node:
    """A broker's node, ready for `run_node` (blocking: run it in a worker thread)."""
    # Descriptors on a budget (storage/handles.py): partition files are opened on demand
    # within their share, so partitions are not bounded by RLIMIT_NOFILE.
    budget = FdBudget.of_process(config.max_connections)
    store = Store.open(
        config.data_dir, fsync=config.fsync, handles=HandleCache(budget.partition_files)
    )
    # (after the data dir's lock: a refused second broker says one line, the lock's)
    log.info("open-file budget: %s", budget.describe())
    cluster: ClusterView = (
        Cluster.from_config(config, store.node_public_key)
        if config.cluster_etcd_endpoints
        else NullCluster.from_config(config, store.node_public_key)
    )
    node = Node(config, store, cluster)
    if isinstance(cluster, Cluster):
        node.topic_maker = PlacedTopics(node, cluster)  # placed by the controller in etcd
        # quorum-signed topics where placement names replicas
        node.partition_manifests = manifest_hook(cluster)
        if config.quorum_partitions:
            node.quorum = quorum_role(node, cluster)
    node.fd_budget = budget
    node.groups = GroupCoordinator(node)  # replays __consumer_offsets (creates it once)
    node.transactions = TxnCoordinator(node)  # replays __transaction_state (alone: made at first use)
    return node


async def run_node(
    node: Node, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the node's background tasks until cancelled; started once they all are."""
    async with trio.open_nursery() as nursery:
        if isinstance(node.cluster, Cluster):  # registered in etcd before anything else
            await nursery.start(node.cluster.membership.run)
            if node.config.death_evidence:
                nursery.start_soon(watch_peers, node.cluster.membership)
            nursery.start_soon(follow_placements, node, node.cluster)
            nursery.start_soon(follow_records, node, node.cluster)  # quorum-signed topics
        nursery.start_soon(node.commit_loop)
        nursery.start_soon(node.retention_loop)
        if node.config.log_cleaner_enable:
            nursery.start_soon(node.cleaner.run)
        nursery.start_soon(node.offline_retry_loop)
        await nursery.start(node.groups.run)
        await nursery.start(node.transactions.run)
        if node.config.replication_listen is not None or node.config.mirrors:
            await nursery.start(run_replication, node)
        if node.quorum is not None:
            nursery.start_soon(node.quorum.run, partial(own_partitions, node))
            nursery.start_soon(run_failover, node, node.quorum.cluster, node.quorum)
        task_status.started()

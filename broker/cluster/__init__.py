"""Cluster mode: everything that concerns other brokers of the cluster lives in this package.

`etcd` (the etcd v3 JSON-gateway client), `membership` (this broker's etcd session: lease,
registration, controller election, fenced transactions, placement records, the watched
view of all of it) and `replicas` (`Cluster`: that view plus the ISR, acks=all and read
replicas). `view` is the one interface the rest of the broker calls (`ClusterView`), which
`Cluster` implements over etcd and `NullCluster` (`null`) for a single broker.
Operator docs: docs/clusters.md.
May import trio, `broker.config` and `storage`; never the protocol codec or the handlers.
"""

from broker.cluster.null import NullCluster
from broker.cluster.replicas import NO_LEADER, Cluster, PeerCopy, signed_blocks
from broker.cluster.view import ClusterView

__all__ = ["NO_LEADER", "Cluster", "ClusterView", "NullCluster", "PeerCopy", "signed_blocks"]

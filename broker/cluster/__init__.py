"""Cluster mode: everything that concerns other brokers of the cluster lives in this package.

`etcd` (the etcd v3 JSON-gateway client), `membership` (this broker's etcd session: lease,
registration, controller election, fenced transactions, placement records, the watched
view of all of it) and `replicas` (`Cluster`: that view plus the ISR, acks=all and read
replicas). Operator docs: docs/clusters.md.
May import trio, `broker.config` and `storage`; never the protocol codec or the handlers.
"""

from broker.cluster.replicas import NO_LEADER, Cluster, PeerCopy, signed_blocks

__all__ = ["NO_LEADER", "Cluster", "PeerCopy", "signed_blocks"]

"""Cluster mode: everything that concerns other brokers of the cluster lives in this package.

`replicas` (the ISR, acks=all, read replicas), `etcd` (the etcd v3 JSON-gateway client).
May import trio, `broker.config` and `storage`; never the protocol codec or the handlers.
"""

from broker.cluster.replicas import NO_LEADER, Cluster, PeerCopy, signed_blocks

__all__ = ["NO_LEADER", "Cluster", "PeerCopy", "signed_blocks"]

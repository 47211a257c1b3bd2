"""Cluster mode: quorum-signed partitions, who signs them (docs/clusters.md, issue 17).

Owns the placement side of a topic whose partitions are signed by a quorum of their
replicas (``hyperkafka.quorum.partitions.enable``): how many replicas a partition has
(`replication_factor`), which brokers they are (`choose_replicas`, recorded by the
controller in the topic's placement in etcd), the Hypercore v2 manifest each partition
gets from its replicas' node keys (`partition_manifests`, made by the writer when it
creates the topic), and what Metadata reports as a partition's replicas
(`placed_replicas`). The propose/sign channel is broker/cluster/signing.py.

Replication factor, as Kafka decides it: the factor CreateTopics asks for, else
``default.replication.factor``; more than the live brokers is refused with
INVALID_REPLICATION_FACTOR (Kafka's "cannot be reached because only N broker(s) are
registered"), except that the broker default is capped by the live brokers (so a
cluster configured for 3 still creates topics while it has 2). The quorum is a majority
of them, fixed in the manifest.

Replicas: the writer first (Kafka's preferred leader; placement is per topic, so every
partition of a topic has the same writer), then the other live brokers in id order,
rotated by the partition index so that followers spread as Kafka's assignment spreads
them. A CreateTopics replica assignment names them instead.

May import `broker.config`, `broker.cluster.*` and `storage`; never trio, the protocol
codec or the handlers.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker.cluster.membership import Membership, Placement
from storage.hypercore import Manifest
from storage.quorum import partition_manifest

if TYPE_CHECKING:  # (broker.cluster.replicas imports this module)
    from broker.cluster.replicas import Cluster


class QuorumPlacementError(Exception):
    """A quorum-signed topic cannot be placed as asked; `code` is the Kafka error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


INVALID_REPLICATION_FACTOR = 38
INVALID_REPLICA_ASSIGNMENT = 39


def replication_factor(asked: int, default: int, live: int) -> int:
    """The number of replicas of each partition of a new quorum-signed topic."""
    if asked == -1:
        return max(1, min(default, live))
    if not 1 <= asked <= live:
        raise QuorumPlacementError(
            INVALID_REPLICATION_FACTOR,
            f"Unable to replicate the partition {asked} time(s): The target replication factor "
            f"of {asked} cannot be reached because only {live} broker(s) are registered.",
        )
    return asked


def choose_replicas(
    writer: int, live: Sequence[int], factor: int, partitions: int
) -> tuple[tuple[int, ...], ...]:
    """Each partition's replicas: `writer` first, then `factor - 1` of the other `live`
    brokers, rotated by partition index."""
    others = sorted(i for i in set(live) if i != writer)
    if factor - 1 > len(others):
        raise QuorumPlacementError(
            INVALID_REPLICATION_FACTOR,
            f"Unable to replicate the partition {factor} time(s): only {len(others) + 1} "
            "broker(s) are registered.",
        )
    out = []
    for p in range(partitions):
        n = len(others)
        out.append((writer, *(others[(p + k) % n] for k in range(factor - 1))))
    return tuple(out)


def assigned_replicas(
    assignments: Sequence[tuple[int, Sequence[int]]], partitions: int, live: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """A CreateTopics replica assignment as each partition's replicas: every partition
    named once, the same first broker (the topic's writer) and the same count for all,
    no broker twice, every broker alive; else INVALID_REPLICA_ASSIGNMENT."""
    by_index = {int(i): tuple(int(b) for b in ids) for i, ids in assignments}
    if sorted(by_index) != list(range(partitions)):
        raise QuorumPlacementError(
            INVALID_REPLICA_ASSIGNMENT, "The replica assignment must name every partition once."
        )
    out = tuple(by_index[p] for p in range(partitions))
    if len({r[0] if r else None for r in out}) != 1 or not out[0]:
        raise QuorumPlacementError(
            INVALID_REPLICA_ASSIGNMENT,
            "Every partition of a topic has the same leader here: assignments must start "
            "with the same broker.",
        )
    if len({len(r) for r in out}) != 1:
        raise QuorumPlacementError(
            INVALID_REPLICA_ASSIGNMENT, "All partitions must have the same number of replicas."
        )
    for r in out:
        if len(set(r)) != len(r):
            raise QuorumPlacementError(
                INVALID_REPLICA_ASSIGNMENT,
                f"Duplicate brokers in the replica assignment {list(r)}.",
            )
        dead = [i for i in r if i not in live]
        if dead:
            raise QuorumPlacementError(
                INVALID_REPLICA_ASSIGNMENT, f"Broker(s) {dead} are not registered now."
            )
    return out


def node_key(membership: Membership, node_id: int) -> bytes | None:
    """The node key broker `node_id` published in etcd (``brokers/<id>``, else its
    lease-less ``members/<id>``); None when unknown."""
    m = membership.members.get(node_id) or membership.known.get(node_id)
    if node_id == membership.me.node_id:
        m = membership.me
    if m is None or len(m.node_key) != 64:
        return None
    try:
        return bytes.fromhex(m.node_key)
    except ValueError:
        return None


def manifests_for(
    membership: Membership, placement: Placement, topic_id: uuid.UUID
) -> list[Manifest]:
    """The manifest of each partition of a quorum-signed topic: its replicas' node keys
    in placement order, majority quorum, userData naming the partition (its topic id and
    index, storage/quorum.py). Raises QuorumPlacementError when a key is unknown."""
    out = []
    for p, replicas in enumerate(placement.replicas):
        keys = []
        for i in replicas:
            k = node_key(membership, i)
            if k is None:
                raise QuorumPlacementError(
                    INVALID_REPLICA_ASSIGNMENT, f"Broker {i} has published no node key."
                )
            keys.append(k)
        out.append(partition_manifest(keys, topic_id, p))
    return out


def partition_manifests(
    cluster: Cluster, name: str, topic_id: uuid.UUID, partitions: int
) -> list[Manifest] | None:
    """`Node.partition_manifests` in a cluster: the manifests of topic `name` when its
    placement records replicas (a quorum-signed topic), else None."""
    placement = cluster.membership.placements.get(name)
    if placement is None or not placement.replicas:
        return None
    if len(placement.replicas) != partitions:
        raise QuorumPlacementError(
            INVALID_REPLICA_ASSIGNMENT,
            f"Topic '{name}' is placed with {len(placement.replicas)} partitions, not {partitions}.",
        )
    return manifests_for(cluster.membership, placement, topic_id)


def placed_replicas(cluster: Cluster, topic: str, index: int) -> list[int] | None:
    """The replicas etcd's placement names for partition `index` of `topic` (writer
    first), or None when every broker mirrors it (a single-signer topic)."""
    placement = cluster.membership.placements.get(topic)
    if placement is None or not 0 <= index < len(placement.replicas):
        return None
    return list(placement.replicas[index])


def placed_leader(cluster: Cluster, topic: str, index: int) -> int | None:
    """The leader a failover recorded for partition `index` of quorum-signed `topic`
    (broker/cluster/failover.py), None while none did (its writer leads it)."""
    placement = cluster.membership.placements.get(topic)
    if placement is None or not 0 <= index < len(placement.replicas):
        return None
    return placement.leader_of(index) if placement.epoch_of(index) > 0 else None


def placed_epoch(cluster: Cluster, topic: str, index: int) -> int:
    """The leader epoch placement records for a partition (0: none recorded)."""
    placement = cluster.membership.placements.get(topic)
    return placement.epoch_of(index) if placement is not None else 0


def is_quorum_signed(manifest: Manifest | None, public_key: bytes) -> bool:
    """Whether an archive with this manifest is quorum-signed (not a default single
    signer's manifest)."""
    return manifest is not None and manifest != Manifest.default(public_key)


def produce_refusal(
    cluster: Cluster,
    topic: str,
    index: int,
    manifest: Manifest | None,
    public_key: bytes,
    signing: bool,
    min_insync: int,
) -> str | None:
    """Why a produce to a quorum-signed partition is refused before the append
    (NOT_ENOUGH_REPLICAS), None when it may go on. Every produce needs the quorum alive
    (its head cannot be signed otherwise); acks=all needs ``max(quorum,
    min.insync.replicas)`` (`min_insync`, 0 for acks 0/1). Liveness is etcd's leases.
    `signing`: the leader's signing for it is set up."""
    if not is_quorum_signed(manifest, public_key):
        return None
    assert manifest is not None
    if not signing:
        return f"Partition {topic}-{index}: quorum signing is not set up yet on its leader"
    replicas = placed_replicas(cluster, topic, index) or []
    live = [i for i in replicas if cluster.alive(i)]
    need = max(manifest.quorum, min_insync)
    if len(live) < need:
        return (
            f"Partition {topic}-{index} needs {need} live replicas to sign its head "
            f"(quorum {manifest.quorum} of {replicas}); alive: {live}"
        )
    return None

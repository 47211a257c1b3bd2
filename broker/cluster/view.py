"""The one interface through which a broker sees its cluster: `ClusterView`.

Everything the node (broker/node.py), produce, fetch and metadata (broker/handlers/), the
group and transaction coordinators and forwarding (broker/forwarding.py) ask about other
brokers goes through it: membership and liveness, the controller, placement lookups, the
coordinator of a partition of an internal topic, the ISR and the acks=all wait, and the
fencing of acts. Two implementations answer it:

* `Cluster` (broker/cluster/replicas.py), the etcd view of a cluster broker;
* `NullCluster` (broker/cluster/null.py), a single broker: it is every leader, the
  controller and every coordinator, acks=all waits only for local durability, and
  fencing always holds.

`Node.cluster` is always one of them (broker/compose.py picks it from the config), so
callers ask the question rather than test for a mode. What only a cluster broker runs
(its etcd session, placement following, mirroring the other members) is started by the
composition root for the etcd view alone; the null view needs no tasks.

May import trio, `broker.config` and `storage`; never the node, protocol codec or handlers.
"""

from __future__ import annotations

from typing import Protocol

from broker.config import ClusterBroker
from storage import PartitionLog


class ClusterView(Protocol):
    """What a broker knows about, and may ask of, its cluster."""

    me: int  # this broker's id
    cluster_id: str  # Kafka's cluster id (Metadata, DescribeCluster)
    # ISR of archives written by others, as their writer last reported it (Metadata):
    # (topic, partition) -> isr ids.
    remote_isr: dict[tuple[str, int], list[int]]

    # -- membership and liveness -----------------------------------------------

    @property
    def brokers(self) -> dict[int, ClusterBroker]:
        """Every broker of the cluster, alive or not, this one included."""
        ...

    @property
    def racks(self) -> dict[int, str | None]: ...

    @property
    def multi_broker(self) -> bool:
        """Whether other brokers may hold copies of this broker's partitions and serve
        reads of them (a cluster), so that a consumer may have learnt an offset
        elsewhere."""
        ...

    def alive(self, node_id: int, now: float | None = None) -> bool: ...

    def live_ids(self) -> list[int]: ...

    def peers(self) -> list[ClusterBroker]:
        """The other brokers, alive or not."""
        ...

    @property
    def controller_id(self) -> int:
        """The controller, or NO_LEADER while none is elected."""
        ...

    @property
    def is_controller(self) -> bool: ...

    @property
    def producer_id_base(self) -> int:
        """Added to every producer id this broker hands out (each broker its own range)."""
        ...

    # -- placement ---------------------------------------------------------------

    def replicas(self, leader: int) -> list[int]:
        """The replicas of a single-signer archive written by `leader`, leader first."""
        ...

    def leadership(self, writer: int, isr: list[int]) -> tuple[int, list[int]]:
        """(leader, isr) to report for a partition written by `writer`."""
        ...

    def placed_writer(self, name: str) -> int | None:
        """The broker placement names writer of topic `name` (None: not placed yet)."""
        ...

    def placed_replicas(self, topic: str, index: int) -> list[int] | None:
        """The replicas placement names for a quorum-signed partition (None: every
        broker holds it)."""
        ...

    def placed_leader(self, topic: str, index: int) -> int | None:
        """The leader a failover recorded for a quorum-signed partition (None: none
        did; its writer leads it)."""
        ...

    def placed_epoch(self, topic: str, index: int) -> int:
        """The leader epoch a failover recorded for a partition (0: none)."""
        ...

    async def unplace(self, name: str) -> bool | None:
        """Drop topic `name`'s placement, fenced by the controller epoch (None: fenced)."""
        ...

    def record_configs(self, name: str) -> tuple[str, dict[str, str]] | None:
        """For a quorum-signed topic whose etcd record is its truth (broker/placed_topics.py):
        (its topic id, its configs) as the view holds them; None otherwise."""
        ...

    async def set_record_configs(self, name: str, configs: dict[str, str]) -> bool | None:
        """Record new configs in such a topic's record, fenced by the controller epoch and
        by the record the view holds (False: it changed, or there is none; None: fenced)."""
        ...

    # -- coordinators of internal topics ---------------------------------------------

    def shard_count(self, topic: str) -> int | None:
        """How many partitions of internal `topic` are placed, each with its coordinator
        (0: none yet; None: not sharded, alone the internal topic is this broker's own)."""
        ...

    def coordinator(self, topic: str, partition: int) -> int | None:
        """The broker coordinating partition `partition` of internal `topic` (None: none now)."""
        ...

    async def check_fence(self, topic: str, revisions: dict[int, int]) -> bool:
        """Whether this broker still coordinates these partitions of `topic` at these
        revisions (its epochs): an act fenced by them may be acknowledged."""
        ...

    # -- ISR, acks=all and replica progress ---------------------------------------------

    def isr(self, key: bytes) -> list[int]:
        """The in-sync replicas of archive `key` written here, this broker first."""
        ...

    def short_of_insync(self, key: bytes, min_insync: int) -> list[int] | None:
        """The ISR of archive `key` when it is smaller than `min_insync` (a write that
        needs that many is refused before the append), else None."""
        ...

    def acks_all_replicas(self, min_insync: int) -> int:
        """How many replicas an acks=all write waits for once it is durable here (0:
        nothing beyond local durability)."""
        ...

    async def wait_replicated(self, key: bytes, length: int, min_insync: int) -> bool:
        """Wait until every in-sync follower holds `length` blocks of archive `key`;
        whether at least `min_insync` replicas hold them."""
        ...

    def produce_refusal(self, topic: str, index: int, log: PartitionLog, min_insync: int) -> str | None:
        """Why a produce to this partition written here is refused before the append
        (NOT_ENOUGH_REPLICAS: its signers are not alive), None when it may go on."""
        ...

    def published(self, key: bytes, length: int) -> None:
        """This broker published a signed head of `length` blocks for archive `key`."""
        ...

    def writes(self, key: bytes) -> bool:
        """Whether archive `key` is written here and its followers' progress is tracked."""
        ...

    def broker_for_identity(self, public_key: bytes) -> int | None:
        """The other broker whose node key authenticated a replication connection."""
        ...

    def connected(self, key: bytes, node_id: int) -> None: ...

    def disconnected(self, key: bytes, node_id: int) -> None: ...

    def acked(self, key: bytes, node_id: int, length: int) -> None:
        """Broker `node_id` holds the first `length` blocks of archive `key`."""
        ...

    def preferred_read_replica(self, key: bytes, client_rack: str) -> int | None:
        """KIP-392: a follower in the consumer's rack to fetch from (None: here)."""
        ...

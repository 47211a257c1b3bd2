"""`NullCluster`: the `ClusterView` (broker/cluster/view.py) of a broker that is alone.

A single broker is the whole cluster: it is alive, the controller, the writer and only
replica of every topic, and the coordinator of every partition of the internal topics.
Its ISR is itself; acks=all waits for nothing beyond the durability the produce already
waited for (as before there were clusters, ``min.insync.replicas`` is not enforced
alone); fencing always holds, since nobody else can act. It runs no task.

May import `broker.config`, `broker.cluster.view` and `storage`.
"""

from __future__ import annotations

import base64
import hashlib

from broker.config import BrokerConfig, ClusterBroker
from storage import PartitionLog


def cluster_id_of(node_key: bytes) -> str:
    """A single broker's cluster id: derived from its node key, stable across restarts."""
    digest = hashlib.blake2b(node_key, digest_size=16).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


class NullCluster:
    """The cluster of one broker (see the module docstring)."""

    def __init__(self, me: int, host: str, port: int, rack: str | None, cluster_id: str) -> None:
        self.me = me
        self.cluster_id = cluster_id
        self._me = ClusterBroker(me, host, port)
        self._rack = rack
        self.remote_isr: dict[tuple[str, int], list[int]] = {}

    @classmethod
    def from_config(cls, config: BrokerConfig, node_key: bytes) -> NullCluster:
        host, port = config.advertised
        return cls(config.node_id, host, port, config.rack, cluster_id_of(node_key))

    # -- membership and liveness -----------------------------------------------

    @property
    def brokers(self) -> dict[int, ClusterBroker]:
        return {self.me: self._me}

    @property
    def racks(self) -> dict[int, str | None]:
        return {self.me: self._rack}

    @property
    def multi_broker(self) -> bool:
        return False

    def alive(self, node_id: int, now: float | None = None) -> bool:
        return node_id == self.me

    def live_ids(self) -> list[int]:
        return [self.me]

    def peers(self) -> list[ClusterBroker]:
        return []

    @property
    def controller_id(self) -> int:
        return self.me

    @property
    def is_controller(self) -> bool:
        return True

    @property
    def producer_id_base(self) -> int:
        return 0

    # -- placement ---------------------------------------------------------------

    def replicas(self, leader: int) -> list[int]:
        return [leader]

    def leadership(self, writer: int, isr: list[int]) -> tuple[int, list[int]]:
        return writer, [i for i in isr if i == self.me]

    def placed_writer(self, name: str) -> int | None:
        return self.me

    def placed_replicas(self, topic: str, index: int) -> list[int] | None:
        return None

    def placed_leader(self, topic: str, index: int) -> int | None:
        return None

    def placed_epoch(self, topic: str, index: int) -> int:
        return 0

    async def unplace(self, name: str) -> bool | None:
        return True

    def record_configs(self, name: str) -> tuple[str, dict[str, str]] | None:
        return None

    async def set_record_configs(self, name: str, configs: dict[str, str]) -> bool | None:
        return False

    # -- coordinators of internal topics ---------------------------------------------

    def shard_count(self, topic: str) -> int | None:
        return None

    def coordinator(self, topic: str, partition: int) -> int | None:
        return self.me

    async def check_fence(self, topic: str, revisions: dict[int, int]) -> bool:
        return True

    # -- ISR, acks=all and replica progress ---------------------------------------------

    def isr(self, key: bytes) -> list[int]:
        return [self.me]

    def short_of_insync(self, key: bytes, min_insync: int) -> list[int] | None:
        return None

    def acks_all_replicas(self, min_insync: int) -> int:
        return 0

    async def wait_replicated(self, key: bytes, length: int, min_insync: int) -> bool:
        return True

    def produce_refusal(self, topic: str, index: int, log: PartitionLog, min_insync: int) -> str | None:
        return None

    def published(self, key: bytes, length: int) -> None:
        pass

    def writes(self, key: bytes) -> bool:
        return False

    def broker_for_identity(self, public_key: bytes) -> int | None:
        return None

    def connected(self, key: bytes, node_id: int) -> None:
        pass

    def disconnected(self, key: bytes, node_id: int) -> None:
        pass

    def acked(self, key: bytes, node_id: int, length: int) -> None:
        pass

    def preferred_read_replica(self, key: bytes, client_rack: str) -> int | None:
        return None

"""Cluster mode: topics are placed by the controller in etcd, and made by their writer.

Owns `PlacedTopics` (the `TopicMaker` of a cluster broker, broker/node.py: CreateTopics
and auto-creation go through it), `create_placed` (CreateTopics and auto-creation on the controller: validate, choose
the writer, record the placement in etcd under the controller's epoch, create the archives
when the writer is this broker), `choose_writer` (balanced and rack-aware) and
`follow_placements` (the writer side: a placement naming this broker whose topic is not
here yet is created here; the other brokers mirror it from the writer, broker/mirror.py).

A name is placed by a create-if-absent transaction fenced by the controller epoch
(broker/cluster/membership.py): two brokers that both think they are controller, or two
brokers auto-creating one name, never give it two writers.

Placement is per topic (every partition of a topic has the same writer): topics spread
over the brokers, partitions of one topic do not (yet).

CreateTopics sent to a broker that is not the controller is forwarded to the controller
(`forward_create`), as Kafka's brokers do since KIP-590: a client routes admin requests by
the controller id of its last Metadata answer, and librdkafka asks for Metadata again
only when a connection (re)opens or names no controller, never on NOT_CONTROLLER. Once
the controller had moved (lease lost in a partition, then healed), such a client sent
every CreateTopics to the old controller, which answered NOT_CONTROLLER for ever.
DeleteTopics is forwarded the same way (`forward_delete`); both go through
broker/forwarding.py, whose requests the controller never forwards again.

May import trio, `broker.node`, `broker.config`, `broker.cluster`, `broker.forwarding`.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio

from broker.cluster import Cluster, ClusterView
from broker.cluster.etcd import EtcdError
from broker.cluster.membership import Placement
from broker.cluster.quorum import (
    QuorumPlacementError,
    assigned_replicas,
    choose_replicas,
    partition_manifests,
    replication_factor,
)
from broker.config import validate_topic_configs
from broker.forwarding import FORWARD_TIMEOUT_S, forward_to_controller
from broker.node import (
    INTERNAL_TOPICS,
    INVALID_REPLICA_ASSIGNMENT,
    LEADER_NOT_AVAILABLE,
    NOT_CONTROLLER,
    TOPIC_ALREADY_EXISTS,
    UNKNOWN_TOPIC_OR_PARTITION,
    Node,
    Topic,
    TopicError,
)
from storage.hypercore import Manifest

log = logging.getLogger("hyperkafka.cluster")


class PlacedTopics:
    """`TopicMaker` (broker/node.py) of a cluster broker: the controller places a topic in
    etcd and its writer makes it; another broker forwards to the controller."""

    def __init__(self, node: Node, cluster: Cluster) -> None:
        self.node = node
        self.cluster = cluster

    def check_assignments(self, assignments: Sequence[tuple[int, Sequence[int]]]) -> str | None:
        brokers = self.cluster.brokers
        if any(not set(ids) <= set(brokers) for _, ids in assignments):
            return f"Only brokers {sorted(brokers)} exist"
        if len({ids[0] if ids else -1 for _, ids in assignments}) != 1:
            return "Every partition of a topic has the same writer here: name the same first broker for each"
        return None

    async def create(
        self,
        name: str,
        partitions: int,
        replication_factor: int,
        configs: Mapping[str, str | None],
        *,
        validate_only: bool,
        assignments: Sequence[tuple[int, Sequence[int]]],
    ) -> Topic | None:
        writer = assignments[0][1][0] if assignments else None  # Kafka's preferred leader
        return await create_placed(self.node, self.cluster, name, partitions, replication_factor, configs,
                                   validate_only=validate_only, writer=writer, assignments=assignments)

    async def auto_create(self, name: str) -> Topic:
        cluster = self.cluster
        if name in cluster.membership.placements:
            # placed in etcd, not here yet (its writer makes it, our mirror attaches it)
            raise TopicError(LEADER_NOT_AVAILABLE, "placed, not created yet")
        if not cluster.is_controller:
            await _create_on_controller(cluster, name)
            raise TopicError(LEADER_NOT_AVAILABLE, "created on the controller")
        topic = await create_placed(self.node, cluster, name)
        if topic is None:
            raise TopicError(LEADER_NOT_AVAILABLE, "placed on another broker")
        return topic

    def auto_create_for_write(self, name: str) -> Topic:
        # topics are placed by the controller, which Metadata asks
        raise TopicError(UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")


async def _create_on_controller(cluster: Cluster, name: str) -> None:
    """Auto-creation asked of a broker that is not the controller: ask the controller
    (Kafka forwards it there too, KIP-590); the topic reaches this broker through its
    mirror of the controller, meanwhile the client hears LEADER_NOT_AVAILABLE and asks
    again."""
    from broker.mirror import kafka_request  # the client side of the mirror machinery

    controller = cluster.brokers.get(cluster.controller_id)
    if controller is None:  # none elected right now: the client asks again
        return
    try:
        await kafka_request(controller.host, controller.port, 19, 4, "create_topics", {
            "topics": [{"name": name, "num_partitions": -1, "replication_factor": -1,
                        "assignments": [], "configs": []}],
            "timeout": 5000, "validate_only": False,
        })
    except Exception as exc:  # the client asks again; the next try forwards again
        log.info("auto-creating %s on controller %d failed: %s", name, controller.node_id, exc)


def choose_writer(cluster: Cluster) -> int:
    """The live broker to write a new topic: the one that writes the fewest topics (so
    every broker adds write capacity), among those the one whose rack writes the fewest
    (writers spread over racks), then the lowest id."""
    live = cluster.live_ids()
    racks = cluster.racks
    per_broker = Counter(p.writer for p in cluster.membership.placements.values())
    per_rack = Counter(racks.get(w) for w in per_broker.elements() if w in live)
    return min(live, key=lambda i: (per_broker[i], per_rack[racks.get(i)], i))


async def create_placed(
    node: Node,
    cluster: Cluster,
    name: str,
    partitions: int = -1,
    replication_factor: int = -1,
    configs: Mapping[str, str | None] | None = None,
    *,
    validate_only: bool = False,
    writer: int | None = None,
    assignments: Sequence[tuple[int, Sequence[int]]] = (),
) -> Topic | None:
    """Create a topic in cluster mode (this broker must be the controller): the topic when
    this broker writes it, None when another does (it makes it when it sees the record;
    Metadata says LEADER_NOT_AVAILABLE until then, as Kafka's does for a new topic).
    `writer`: the broker a replica assignment names first (Kafka's preferred leader)."""
    await node.create_topic_off_loop(
        name, partitions, replication_factor, configs, validate_only=True
    )
    if validate_only:
        return None
    if not cluster.is_controller:
        raise TopicError(
            NOT_CONTROLLER,
            f"This is not the correct controller for this cluster: "
            f"topics are created on broker {cluster.controller_id}.",
        )
    if partitions == -1:
        partitions = node.config.num_partitions
    if writer is None:
        writer = choose_writer(cluster)
    elif not cluster.alive(writer):
        raise TopicError(INVALID_REPLICA_ASSIGNMENT, f"Broker {writer} is not registered now.")
    replicas: tuple[tuple[int, ...], ...] = ()
    if node.config.quorum_partitions and name not in INTERNAL_TOPICS:
        replicas = quorum_replicas(
            node, cluster, writer, partitions, replication_factor, assignments
        )
    # A quorum-signed topic's id is chosen here and recorded with it: every broker tells
    # this topic from a later one of the same name by it (broker/placed_topics.py).
    topic_id = uuid.uuid4() if replicas else None
    placed_configs = {k: v for k, v in (configs or {}).items() if v is not None}
    if replicas:  # (the record holds its configs: as the catalog would, validated above)
        placed_configs = validate_topic_configs(placed_configs)
    placement = Placement(
        name,
        writer,
        partitions,
        placed_configs,
        replication_factor,
        replicas,
        topic_id=str(topic_id) if topic_id else "",
    )
    cluster.placing.add(name)  # `follow_placements` leaves it to us
    try:
        try:
            ok = await cluster.membership.place(placement)
        except EtcdError as exc:
            raise TopicError(NOT_CONTROLLER, f"The controller cannot reach etcd: {exc}") from None
        if ok is None:
            raise TopicError(
                NOT_CONTROLLER, "This broker is no longer the controller (its epoch was fenced)."
            )
        if not ok:
            raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists.")
        log.info("placed topic %s (%d partitions) on broker %d", name, partitions, writer)
        if writer != node.config.node_id:
            return None
        return await node.create_topic_off_loop(
            name, partitions, replication_factor, configs, topic_id=topic_id
        )
    finally:
        cluster.placing.discard(name)
        cluster.membership.poke()  # whatever `follow_placements` skipped meanwhile


def quorum_replicas(
    node: Node,
    cluster: Cluster,
    writer: int,
    partitions: int,
    asked: int,
    assignments: Sequence[tuple[int, Sequence[int]]],
) -> tuple[tuple[int, ...], ...]:
    """Each partition's replicas of a new quorum-signed topic (broker/cluster/quorum.py),
    or the Kafka error that refuses it."""
    live = cluster.live_ids()
    try:
        if assignments:
            return assigned_replicas(assignments, partitions, live)
        factor = replication_factor(asked, node.config.default_replication_factor, len(live))
        return choose_replicas(writer, live, factor, partitions)
    except QuorumPlacementError as exc:
        raise TopicError(exc.code, exc.message) from None


def manifest_hook(cluster: Cluster) -> Callable[[str, uuid.UUID, int], list[Manifest] | None]:
    """`Node.partition_manifests` of a cluster broker: a topic whose placement records
    replicas is made with quorum-signed partitions (broker/cluster/quorum.py)."""

    def manifests(name: str, topic_id: uuid.UUID, partitions: int) -> list[Manifest] | None:
        try:
            return partition_manifests(cluster, name, topic_id, partitions)
        except QuorumPlacementError as exc:
            raise TopicError(exc.code, exc.message) from None

    return manifests


async def forward_create(
    cluster: ClusterView,
    name: str,
    partitions: int,
    replication_factor: int,
    configs: Mapping[str, str | None],
    assignments: Sequence[tuple[int, Sequence[int]]] = (),
) -> dict[str, Any]:
    """Ask the controller to create `name` (this broker is not the controller): the
    controller's result for it (error_code, error_message, topic_id, num_partitions,
    replication_factor, configs)."""
    resp = await forward_to_controller(
        cluster,
        19,
        7,
        "create_topics",
        {
            "topics": [
                {
                    "name": name,
                    "num_partitions": partitions,
                    "replication_factor": replication_factor,
                    "assignments": [
                        {"partition_index": i, "broker_ids": list(ids)} for i, ids in assignments
                    ],
                    "configs": [{"name": k, "value": v} for k, v in configs.items()],
                }
            ],
            "timeout": int(FORWARD_TIMEOUT_S * 1000),
            "validate_only": False,
        },
    )
    r = next((t for t in resp.topics if t.name == name), None)
    if r is None:
        raise TopicError(
            NOT_CONTROLLER,
            f"The controller, broker {cluster.controller_id}, did not answer for {name}",
        )
    log.info(
        "forwarded CreateTopics %s to the controller, broker %d: error %d",
        name,
        cluster.controller_id,
        int(r.error_code),
    )
    return {
        "error_code": int(r.error_code),
        "error_message": r.error_message,
        "topic_id": r.topic_id,
        "num_partitions": int(r.num_partitions),
        "replication_factor": int(r.replication_factor),
        "configs": None
        if r.configs is None
        else [
            {
                "name": c.name,
                "value": c.value,
                "read_only": c.read_only,
                "config_source": int(c.config_source),
                "is_sensitive": c.is_sensitive,
            }
            for c in r.configs
        ],
    }


async def forward_delete(cluster: ClusterView, name: str, timeout_s: float) -> None:
    """Ask the controller to delete `name` (this broker is not the controller); its
    refusal as a TopicError. The controller may wait `timeout_s` for the topic's writer
    (broker/handlers/admin.py), so the exchange is given that much more; and it is told
    a little less than one exchange may last (`kafka_request`'s bound), so that its answer
    after waiting comes back instead of a time-out."""
    waited = max(0.1, min(timeout_s, FORWARD_TIMEOUT_S - 1.5))
    resp = await forward_to_controller(
        cluster,
        20,
        4,
        "delete_topics",
        {"topic_names": [name], "timeout": int(waited * 1000)},
        timeout_s + FORWARD_TIMEOUT_S,
    )
    r = next((t for t in resp.responses if t.name == name), None)
    if r is None:
        raise TopicError(
            NOT_CONTROLLER,
            f"The controller, broker {cluster.controller_id}, did not answer for {name}",
        )
    log.info(
        "forwarded DeleteTopics %s to the controller, broker %d: error %d",
        name,
        cluster.controller_id,
        int(r.error_code),
    )
    if r.error_code:
        raise TopicError(
            int(r.error_code), r.error_message or f"The controller refused to delete {name}"
        )


async def follow_placements(node: Node, cluster: Cluster) -> None:
    """The writer side of placement: whenever etcd places a topic on this broker that is
    not here, create it here (also after a crash between the record and the archives)."""
    membership = cluster.membership
    await membership.ready.wait()
    me = node.config.node_id
    while True:
        changed = membership.changed
        for p in list(membership.placements.values()):
            if (
                p.writer != me
                or p.name in node.topics
                or p.name in INTERNAL_TOPICS
                or node.creating(p.name)
                or p.name in cluster.placing
            ):
                continue
            try:
                await node.create_topic_off_loop(
                    p.name,
                    p.partitions,
                    p.replication_factor,
                    p.configs,
                    topic_id=uuid.UUID(p.topic_id) if p.topic_id else None,
                )
                log.info("created topic %s, placed here by the controller", p.name)
            except TopicError as exc:
                log.warning("cannot create topic %s placed here: %s", p.name, exc.message)
                await trio.sleep(1.0)
        await changed.wait()

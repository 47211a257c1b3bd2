"""CreateTopics, DeleteTopics and DescribeConfigs: topic administration.

Topics live in the node's catalog (itself a signed archive), so a created topic is
durable before the response says so. Every DescribeConfigs answer lists every config
with its value and source (topic override, broker file, or Kafka's default), since an
empty list breaks clients (librdkafka test 0092).

Cluster mode: CreateTopics sent to a broker that is not the controller is forwarded to
the controller (broker/placement.py `forward_create`), as Kafka does since KIP-590, and
so is DeleteTopics (`forward_delete`). On the controller, only a
topic's writer can change its catalog: a topic written by another broker (created while
the first controller was down) is deleted by forwarding the request to its writer, and
the answer comes once this broker's mirror has dropped it. With the writer down it is
refused with LEADER_NOT_AVAILABLE (retriable). A quorum-signed topic needs no writer:
the controller deletes its etcd record and every broker drops it on seeing that
(broker/placed_topics.py); the answer comes once the live brokers did (`_wait_dropped`).
DescribeConfigs of such a topic answers the configs of its record.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import trio

from broker.api import Reply, RequestContext, api
from broker.cluster import NO_LEADER, ClusterView
from broker.cluster.etcd import EtcdError
from broker.config import ConfigEntry, ConfigSource
from broker.forwarding import FORWARD_TIMEOUT_S, forward_to
from broker.handlers import errors
from broker.mirror import BROKER_CLIENT_ID
from broker.node import MAX_PARTITIONS_PER_REQUEST, Node, Topic, TopicError
from broker.placement import forward_create, forward_delete
from broker.replication_server import replication_config_entries
from broker.security.authz import Operation
from broker.security.session import authorize
from broker.shape import field_of

log = logging.getLogger("hyperkafka.admin")

RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4
RESOURCE_BROKER_LOGGER = 8


@api(19, "CreateTopics", (2, 7))
async def create_topics(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    results = []
    seen: set[str] = set()
    # As Kafka 4.0 (KAFKA-17870): a request creating more partitions in all is refused whole.
    asked = sum(len(t.assignments) if t.assignments else
                (t.num_partitions if t.num_partitions > 0 else node.config.num_partitions)
                for t in req.topics)
    for t in req.topics:
        entry: dict[str, Any] = {
            "name": t.name,
            "topic_id": None,
            "error_code": errors.NONE,
            "error_message": None,
            "num_partitions": -1,
            "replication_factor": -1,
            "configs": None,
        }
        results.append(entry)
        if t.name in seen:
            entry.update(error_code=errors.INVALID_REQUEST, error_message=f"Create topics request from client contains a duplicate topic {t.name}")
            continue
        seen.add(t.name)
        if asked > MAX_PARTITIONS_PER_REQUEST:
            entry.update(error_code=errors.POLICY_VIOLATION,
                         error_message=f"Excessively large number of partitions per request: {asked} "
                                       f"(at most {MAX_PARTITIONS_PER_REQUEST}).")
            continue
        if not authorize(ctx, Operation.CREATE, t.name):
            entry.update(error_code=errors.TOPIC_AUTHORIZATION_FAILED, error_message="Authorization failed.")
            continue
        partitions, replication = t.num_partitions, t.replication_factor
        if t.assignments:
            if partitions != -1 or replication != -1:
                entry.update(error_code=errors.INVALID_REQUEST, error_message="Both numPartitions or replicationFactor and replicasAssignments were set.")
                continue
            partitions = len(t.assignments)
            replication = len(t.assignments[0].broker_ids)
        assignments = [(a.partition_index, a.broker_ids) for a in t.assignments or ()]
        refused = node.topic_maker.check_assignments(assignments) if assignments else None
        if refused is not None:
            entry.update(error_code=errors.INVALID_REPLICA_ASSIGNMENT, error_message=refused)
            continue
        try:
            configs = {c.name: c.value for c in t.configs}
            try:
                # alone, made here; in a cluster, the controller places it in etcd
                # (broker/placement.py) and its writer makes it
                topic = await node.topic_maker.create(t.name, partitions, replication, configs,
                                                      validate_only=req.validate_only, assignments=assignments)
            except TopicError as exc:
                # Not the controller (any more): forward to the one etcd names (KIP-590), once.
                if (exc.code != errors.NOT_CONTROLLER or ctx.client_id == BROKER_CLIENT_ID
                        or node.cluster.controller_id in (NO_LEADER, node.config.node_id)):
                    raise
                entry.update(await forward_create(
                    node.cluster, t.name, t.num_partitions, t.replication_factor, configs, assignments))
                continue
        except TopicError as exc:
            entry.update(error_code=exc.code, error_message=exc.message)
            continue
        overrides = topic.record.configs if topic else {c.name: c.value for c in t.configs if c.value is not None}
        entry.update(
            topic_id=topic.topic_id if topic else None,
            num_partitions=len(topic.partitions) if topic else (partitions if partitions != -1 else node.config.num_partitions),
            replication_factor=len(node.cluster.brokers),
            configs=[
                {
                    "name": e.name,
                    "value": e.value,
                    "read_only": e.read_only,
                    "config_source": e.source,
                    "is_sensitive": e.sensitive,
                }
                for e in node.config.describe_topic(overrides)
            ],
        )
    return {"throttle_time": 0, "topics": results}



async def _unplace(cluster: ClusterView, name: str) -> None:
    """On the controller: drop the topic's placement from etcd (fenced by the controller
    epoch) before its archives go, so its writer does not make it again (alone: nothing
    is placed)."""
    try:
        ok = await cluster.unplace(name)
    except EtcdError as exc:
        raise TopicError(errors.NOT_CONTROLLER, f"The controller cannot reach etcd: {exc}") from None
    if ok is None:
        raise TopicError(errors.NOT_CONTROLLER, "This broker is no longer the controller (its epoch was fenced).")


async def _delete_on_writer(node: Node, cluster: ClusterView, name: str, writer: int, timeout_s: float) -> None:
    """Cluster mode, on the controller: delete `name`, which broker `writer` writes, there;
    return once our mirror dropped it (or the timeout passed: it will shortly)."""
    if not cluster.alive(writer):
        raise TopicError(errors.LEADER_NOT_AVAILABLE,
                         f"Topic {name} is written by broker {writer}, which is down; delete it once it is back.")
    resp = await forward_to(cluster, writer, 20, 4, "delete_topics",
                            {"topic_names": [name], "timeout": int(timeout_s * 1000)})
    code = int(resp.responses[0].error_code)
    if code != errors.NONE:
        raise TopicError(code, resp.responses[0].error_message or f"Broker {writer} refused to delete {name}")
    with trio.move_on_after(timeout_s):
        while name in node.topics and node.topics[name].mirrored:
            await node.wait_for_data()  # detaching a mirrored topic wakes it


async def _wait_dropped(node: Node, cluster: ClusterView, name: str, topic_id: uuid.UUID | None,
                        timeout_s: float) -> None:
    """On the controller, once the record of quorum-signed topic `name` is deleted: return
    when this broker and every live one dropped that topic (their Metadata no longer
    lists it with that id), or the timeout passed (they will shortly: the deletion is
    recorded; a live broker that is cut from etcd keeps it until it reads etcd again)."""
    from broker.mirror import DiscoveryError, kafka_request  # (the mirror's client side)

    def gone_here() -> bool:
        t = node.topics.get(name)
        return t is None or (topic_id is not None and t.topic_id != topic_id)

    async def gone_at(broker_id: int) -> bool:
        b = cluster.brokers.get(broker_id)
        if b is None or not cluster.alive(broker_id):
            return True
        try:
            resp = await kafka_request(b.host, b.port, 3, 10, "metadata", {
                "topics": [{"topic_id": None, "name": name}],
                "allow_auto_topic_creation": False, "include_cluster_authorized_operations": False,
                "include_topic_authorized_operations": False,
            })
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, DiscoveryError):
            return False  # (not answering now: asked again)
        t = resp.topics[0] if resp.topics else None
        return t is None or int(t.error_code) == errors.UNKNOWN_TOPIC_OR_PARTITION or (
            topic_id is not None and t.topic_id != topic_id)

    with trio.move_on_after(timeout_s) as scope:
        while not gone_here():
            with trio.move_on_after(0.5):
                await node.wait_for_data()  # (dropping a topic wakes it)
        waiting = [i for i in cluster.live_ids() if i != cluster.me]
        while waiting:
            waiting = [i for i in waiting if not await gone_at(i)]
            if waiting:
                await trio.sleep(0.1)
    if scope.cancelled_caught:
        log.info("DeleteTopics %s: not every live broker dropped it within %.1f s", name, timeout_s)


@api(20, "DeleteTopics", (1, 6))
async def delete_topics(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    if ctx.api_version >= 6:
        wanted = [(t.name, t.topic_id) for t in req.topics]
    else:
        wanted = [(name, None) for name in req.topic_names]
    by_id = {t.topic_id: t.name for t in node.topics.values()}
    # As Kafka: a topic named (or identified) twice in one request is refused, both times.
    counts: dict[object, int] = {}
    for name, topic_id in wanted:
        key = name if name is not None else topic_id
        counts[key] = counts.get(key, 0) + 1
    responses = []
    for name, topic_id in wanted:
        entry: dict[str, Any] = {"name": name, "topic_id": topic_id, "error_code": errors.NONE, "error_message": None}
        responses.append(entry)
        if counts[name if name is not None else topic_id] > 1:
            entry.update(error_code=errors.INVALID_REQUEST, error_message="Duplicate topic in request.")
            continue
        if name is None:
            if topic_id is None or topic_id not in by_id:
                entry.update(error_code=errors.UNKNOWN_TOPIC_ID, error_message="This server does not host this topic ID.")
                continue
            name = entry["name"] = by_id[topic_id]
        if not authorize(ctx, Operation.DELETE, name):
            entry.update(error_code=errors.TOPIC_AUTHORIZATION_FAILED, error_message="Authorization failed.")
            continue
        try:
            topic = node.topics.get(name)
            if topic is not None:
                entry["topic_id"] = topic.topic_id
            cluster = node.cluster
            timeout_s = min(max(req.timeout.total_seconds(), 0.1), FORWARD_TIMEOUT_S)
            if not cluster.is_controller and ctx.client_id != BROKER_CLIENT_ID:
                # Not the controller: forward to the one etcd names (KIP-590), once; the
                # answer comes once this broker dropped the topic too (or the timeout passed).
                await forward_delete(cluster, name, timeout_s)
                with trio.move_on_after(timeout_s):
                    while name in node.topics:
                        await node.wait_for_data()  # detaching a mirrored topic wakes it
                continue
            if (cluster.is_controller and node.config.delete_topic_enable
                    and cluster.placed_replicas(name, 0) is not None):
                # Quorum-signed: its record is its truth (broker/placed_topics.py), so its
                # deletion needs no writer alive: every broker drops it once it is gone.
                record = cluster.record_configs(name)
                tid = (topic.topic_id if topic is not None
                       else uuid.UUID(record[0]) if record is not None else None)
                await _unplace(cluster, name)
                entry["topic_id"] = tid
                log.info("deleted the record of quorum-signed topic %s (id %s)", name, tid)
                await _wait_dropped(node, cluster, name, tid, timeout_s)
                continue
            if (cluster.is_controller and topic is not None and topic.mirrored
                    and topic.leader_id is not None and node.config.delete_topic_enable):
                if not cluster.alive(topic.leader_id):
                    raise TopicError(errors.LEADER_NOT_AVAILABLE, f"Topic {name} is written by broker "
                                     f"{topic.leader_id}, which is down; delete it once it is back.")
                await _unplace(cluster, name)
                await _delete_on_writer(node, cluster, name, topic.leader_id, timeout_s)
                continue
            if cluster.is_controller and node.config.delete_topic_enable:
                await _unplace(cluster, name)
            await node.delete_topic(name)
        except TopicError as exc:
            entry.update(error_code=exc.code, error_message=exc.message)
    return {"throttle_time": 0, "responses": responses}


def topic_configs(node: Node, topic: Topic) -> Mapping[str, str]:
    """A topic's config overrides: a quorum-signed topic's as its etcd record holds them
    (this broker may not have applied the latest yet), else the catalog's."""
    record = node.cluster.record_configs(topic.name)
    if record is not None and record[0] == str(topic.topic_id):
        return record[1]
    return topic.configs


def _describe(entries: list[ConfigEntry], keys: Any, synonyms: bool, documentation: bool) -> list[dict[str, Any]]:
    wanted = set(keys) if keys else None
    out = []
    for e in entries:
        if wanted is not None and e.name not in wanted:
            continue
        out.append(
            {
                "name": e.name,
                "value": e.value,
                "read_only": e.read_only,
                "is_default": e.source == ConfigSource.DEFAULT_CONFIG,
                "config_source": e.source,
                "is_sensitive": e.sensitive,
                "synonyms": [{"name": n, "value": v, "source": s} for n, v, s in e.synonyms] if synonyms else [],
                "config_type": e.type,
                "documentation": e.doc if documentation else None,
            }
        )
    return out


@api(32, "DescribeConfigs", (1, 4))
async def describe_configs(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    synonyms = field_of(req, "include_synonyms", False)
    documentation = field_of(req, "include_documentation", False)
    results = []
    seen: set[tuple[int, str]] = set()
    for r in req.resources:
        entry: dict[str, Any] = {
            "error_code": errors.NONE,
            "error_message": None,
            "resource_type": r.resource_type,
            "resource_name": r.resource_name,
            "configs": [],
        }
        results.append(entry)
        if (r.resource_type, r.resource_name) in seen:
            # Each resource is described once: its configs again for every repetition
            # would turn a small request into an answer of gigabytes.
            entry.update(error_code=errors.INVALID_REQUEST, error_message="Duplicate resource in the request")
            continue
        seen.add((r.resource_type, r.resource_name))
        if r.resource_type == RESOURCE_TOPIC:
            # Kafka asks for DESCRIBE_CONFIGS; here that is the topic's describe right.
            if not authorize(ctx, Operation.DESCRIBE, r.resource_name):
                entry.update(error_code=errors.TOPIC_AUTHORIZATION_FAILED, error_message="Authorization failed.")
                continue
            topic = node.topics.get(r.resource_name)
            if topic is None:
                entry.update(error_code=errors.UNKNOWN_TOPIC_OR_PARTITION, error_message=f"Topic {r.resource_name} does not exist")
                continue
            configs = node.config.describe_topic(topic_configs(node, topic))
        elif r.resource_type == RESOURCE_BROKER:
            if r.resource_name not in ("", str(node.config.node_id)):
                entry.update(error_code=errors.INVALID_REQUEST, error_message=f"Unexpected broker id {r.resource_name}")
                continue
            configs = node.config.describe_broker() + replication_config_entries(node)
        elif r.resource_type == RESOURCE_BROKER_LOGGER:
            configs = []
        else:
            entry.update(error_code=errors.INVALID_REQUEST, error_message=f"Unsupported resource type {r.resource_type}")
            continue
        entry["configs"] = _describe(configs, r.configuration_keys, synonyms, documentation)
    return {"throttle_time": 0, "results": results}

"""ApiVersions, Metadata, DescribeCluster: what a client learns before anything else."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from broker.api import Reply, RequestContext, advertised, api
from broker.cluster import NO_LEADER, ClusterView
from broker.handlers import errors
from broker.node import (
    INTERNAL_TOPICS,
    Node,
    Partition,
    Topic,
    TopicError,
    check_topic_name,
)
from broker.security.authz import OPEN_OPERATIONS, Operation, Resource
from broker.security.session import authorize, authorized_operations, cluster_operations
from broker.shape import field_of
from storage.hypercore import Manifest

log = logging.getLogger("hyperkafka.metadata")

LEADER_EPOCH = 0  # one writer per archive, never re-elected: the epoch never moves


def leader_epoch(log: Any) -> int:
    """A partition's leader epoch: LEADER_EPOCH, but for a quorum-signed archive its fork,
    which a failover moves to the new leader's epoch (docs/clusters.md, storage/epochs.py)."""
    m = getattr(log, "manifest", None)
    if m is not None and m != Manifest.default(log.public_key):
        return int(log.fork)
    return LEADER_EPOCH


def epoch_error(current: int, epoch: int) -> int:
    """Kafka's check of a request's current_leader_epoch against the partition's: -1
    skips it, an older one is FENCED_LEADER_EPOCH, a newer one UNKNOWN_LEADER_EPOCH."""
    if current < 0 or current == epoch:
        return errors.NONE
    return errors.FENCED_LEADER_EPOCH if current < epoch else errors.UNKNOWN_LEADER_EPOCH
_ZERO_UUID = uuid.UUID(int=0)
_SOFTWARE = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?$")


@api(18, "ApiVersions", (0, 4))
async def api_versions(ctx: RequestContext, req: Any) -> Reply:
    keys = [{"api_key": k, "min_version": lo, "max_version": hi} for k, lo, hi in advertised()]
    error = errors.NONE
    if ctx.api_version >= 3:
        name = field_of(req, "client_software_name", "")
        version = field_of(req, "client_software_version", "")
        if not (_SOFTWARE.match(name) and _SOFTWARE.match(version)):
            error = errors.INVALID_REQUEST
    # No supported/finalized features: old librdkafka mis-parses tagged fields here.
    return {"error_code": error, "api_keys": keys, "throttle_time": 0}


def brokers(node: Node, ctx: RequestContext | None = None) -> list[dict[str, Any]]:
    # Kafka answers with the endpoint of the listener the request came in on.
    session = ctx.session if ctx is not None else None
    host, port = session.listener.advertised if session is not None else node.config.advertised
    me = node.config.node_id
    out: list[dict[str, Any]] = [{"node_id": me, "broker_id": me, "host": host, "port": port, "rack": node.config.rack}]
    cluster = node.cluster
    # Every other live broker (a dead one leaves, as Kafka's fenced brokers), at the
    # address the cluster list gives it; its rack once we have heard it from the broker
    # itself (discovery).
    out += [{"node_id": b.node_id, "broker_id": b.node_id, "host": b.host, "port": b.port,
             "rack": cluster.racks.get(b.node_id)} for b in cluster.peers() if cluster.alive(b.node_id)]
    out.sort(key=lambda b: b["node_id"])
    return out


def controller_id(node: Node) -> int:
    return node.cluster.controller_id


def _replicas(node: Node, topic: Topic, p: Partition) -> tuple[int, list[int], list[int], list[int]]:
    """(leader, replicas, isr, offline replicas) of one partition."""
    me = node.config.node_id
    cluster = node.cluster
    offline = [me] if p.failed else []
    if topic.name.startswith("__") or (topic.mirrored and topic.leader_id is None):
        # A broker's own internal archives, or a mirror of a node outside the cluster:
        # this broker is all Kafka needs to know of.
        return me, [me], [me], offline
    writer = me if topic.leader_id is None else topic.leader_id
    # a quorum-signed partition's replicas are its signers, as placed in etcd
    placed = cluster.placed_replicas(topic.name, p.index)
    replicas = placed if placed is not None else cluster.replicas(writer)
    offline += [i for i in replicas if not cluster.alive(i)]
    lead = cluster.placed_leader(topic.name, p.index)
    if lead is not None:
        # a failover recorded this partition's leader (broker/takeover.py): it leads, and
        # knows its ISR; elsewhere its live signers are reported in sync (each of them
        # signs its heads, or the partition takes no writes)
        if lead == me:
            return me, replicas, [i for i in cluster.isr(p.log.key) if i in replicas], offline
        live = [i for i in replicas if cluster.alive(i)]
        return (lead if cluster.alive(lead) else NO_LEADER), replicas, live, offline
    if writer == me:
        return me, replicas, [i for i in cluster.isr(p.log.key) if i in replicas], offline
    # Written elsewhere: the ISR as its writer last told us (it alone can know it), less
    # the dead; a live mirror of it leads (for reads) while the writer is dead.
    reported = cluster.remote_isr.get((topic.name, p.index), [writer])
    leader, isr = cluster.leadership(writer, [i for i in reported if i in replicas])
    return leader, replicas, isr, offline


def _leader_epoch(node: Node, topic: Topic, p: Partition) -> int:
    """The leader epoch Metadata reports: the copy's fork, or the epoch a failover
    recorded when this copy has not seen that fork yet (clients ignore a Metadata whose
    epoch is older than one they know). 0 for every partition no failover moved."""
    return max(leader_epoch(p.log), node.cluster.placed_epoch(topic.name, p.index))


def _sharded_partitions(cluster: ClusterView, name: str, count: int) -> list[dict[str, Any]]:
    """An internal topic in cluster mode: its partitions as etcd places them (each one's
    coordinator leads it, broker/cluster/shards.py), the same on every broker. Every
    broker copies every other's offsets archive: all are replicas, the live ones in sync."""
    out = []
    for index in range(count):
        owner = cluster.coordinator(name, index)
        if owner is None:
            continue
        replicas = cluster.replicas(owner)
        leader = owner if cluster.alive(owner) else NO_LEADER
        out.append({
            "error_code": errors.LEADER_NOT_AVAILABLE if leader == NO_LEADER else errors.NONE,
            "partition_index": index,
            "leader_id": leader,
            "leader_epoch": LEADER_EPOCH,
            "replica_nodes": replicas,
            "isr_nodes": [i for i in replicas if cluster.alive(i)],
            "offline_replicas": [i for i in replicas if not cluster.alive(i)],
        })
    return out


def describe_topic(node: Node, topic: Topic) -> dict[str, Any]:
    partitions = []
    # (alone, the internal topics are this broker's own archives: not sharded)
    shards = node.cluster.shard_count(topic.name) if topic.name in INTERNAL_TOPICS else None
    if shards is not None:
        partitions = _sharded_partitions(node.cluster, topic.name, shards)
    for p in [] if shards is not None else topic.partitions:
        leader, replicas, isr, offline = _replicas(node, topic, p)
        partitions.append({
            # Kafka's offline partition: no live in-sync replica to lead it
            "error_code": errors.LEADER_NOT_AVAILABLE if leader == NO_LEADER else errors.NONE,
            "partition_index": p.index,
            "leader_id": leader,
            "leader_epoch": _leader_epoch(node, topic, p),
            "replica_nodes": replicas,
            "isr_nodes": isr,
            "offline_replicas": offline,
        })
    return {
        "error_code": errors.NONE,
        "name": topic.name,
        "topic_id": topic.topic_id,
        "is_internal": topic.name.startswith("__"),
        "partitions": partitions,
    }


def _invalid_metadata_request(requested: Any) -> Reply:
    """MetadataRequest.getErrorResponse: no brokers, every requested topic INVALID_REQUEST
    (a null name as "", which is what the answer can carry)."""
    return {
        "throttle_time": 0,
        "brokers": [],
        "cluster_id": None,
        "controller_id": -1,
        "topics": [
            {"error_code": errors.INVALID_REQUEST, "name": e.name or "", "topic_id": field_of(e, "topic_id", _ZERO_UUID),
             "is_internal": False, "partitions": []}
            for e in requested
        ],
    }


@api(3, "Metadata", (0, 12))
async def metadata(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    requested = req.topics
    if requested is None or (ctx.api_version == 0 and not requested):
        # Kafka leaves out the topics the principal may not DESCRIBE.
        topics = [describe_topic(node, t) for t in node.visible_topics() if authorize(ctx, Operation.DESCRIBE, t.name, quiet=True)]
    elif ctx.api_version < 12 and any(e.name is None or field_of(e, "topic_id", None) not in (None, _ZERO_UUID) for e in requested):
        # v10-11 carry topic ids, but only v12+ may use them (an answer's name is not
        # nullable before v12): Kafka refuses the request, each topic INVALID_REQUEST.
        # (kio decodes the zero id, "none", as None.)
        return _invalid_metadata_request(requested)
    else:
        # v4+ lets the client forbid auto-creation; earlier versions always allow it.
        allow_create = field_of(req, "allow_auto_topic_creation", True) and node.config.auto_create_topics
        topics = []
        seen: set[str] = set()
        by_id: dict[Any, str] | None = None
        for entry in requested:
            name = entry.name
            if name is None and field_of(entry, "topic_id") is not None:
                # v12 addresses topics by id (KIP-848 consumers ask so for the topics of
                # their assignment): described as by name, unknown ids UNKNOWN_TOPIC_ID.
                if by_id is None:
                    by_id = {t.topic_id: n for n, t in node.topics.items()}
                name = by_id.get(entry.topic_id)
            if name is not None:
                # Kafka reads the names into a set: a topic named many times is described
                # once (else a topic of many partitions named 50,000 times is an answer of
                # gigabytes from a request of one megabyte).
                if name in seen:
                    continue
                seen.add(name)
            if name is None:  # v10+ may address topics by id only
                topics.append({"error_code": errors.UNKNOWN_TOPIC_ID, "name": None, "topic_id": field_of(entry, "topic_id"), "partitions": []})
                continue
            if not authorize(ctx, Operation.DESCRIBE, name):
                # Before the existence check, as Kafka: whether it exists is not told.
                topics.append({"error_code": errors.TOPIC_AUTHORIZATION_FAILED, "name": name, "topic_id": _ZERO_UUID, "partitions": []})
                continue
            topic = node.topics.get(name)
            if topic is None:
                try:
                    check_topic_name(name)
                    if not allow_create:
                        raise TopicError(errors.UNKNOWN_TOPIC_OR_PARTITION, "unknown topic")
                    if not authorize(ctx, Operation.CREATE, name):
                        raise TopicError(errors.TOPIC_AUTHORIZATION_FAILED, "not authorized to create")
                    topic = await node.topic_maker.auto_create(name)
                except TopicError as exc:
                    code = exc.code
                    if code in (errors.TOPIC_ALREADY_EXISTS, errors.NOT_CONTROLLER):
                        # written elsewhere, not attached here yet (or this controller
                        # is catching up), or still being deleted here: as Kafka's
                        # auto-creation, ask again
                        code = errors.LEADER_NOT_AVAILABLE
                    topics.append({"error_code": code, "name": name, "topic_id": _ZERO_UUID, "partitions": []})
                    continue
            assert topic is not None
            topics.append(describe_topic(node, topic))
    answer: dict[str, Any] = {
        "throttle_time": 0,
        "brokers": brokers(node, ctx),
        "cluster_id": node.cluster_id,
        "controller_id": controller_id(node),
        "topics": topics,
    }
    # v8+: asked for, as Kafka: the bits for every topic the principal may describe
    # (unknown ones included), and the cluster's (v8-v10).
    if field_of(req, "include_topic_authorized_operations", False):
        for t in topics:
            if t["error_code"] != errors.TOPIC_AUTHORIZATION_FAILED and t.get("name") is not None:
                ops = authorized_operations(ctx, t["name"], Resource.TOPIC)
                t["topic_authorized_operations"] = OPEN_OPERATIONS[Resource.TOPIC] if ops is None else ops
    if field_of(req, "include_cluster_authorized_operations", False):
        answer["cluster_authorized_operations"] = cluster_operations(ctx)
    return answer


@api(60, "DescribeCluster", (0, 1))
async def describe_cluster(ctx: RequestContext, req: Any) -> Reply:
    endpoint_type = field_of(req, "endpoint_type", 1)
    if endpoint_type != 1:
        return {"error_code": errors.MISMATCHED_ENDPOINT_TYPE, "error_message": "The request was sent to an endpoint of type BROKER, but we wanted an endpoint of type CONTROLLER", "cluster_id": ctx.node.cluster_id, "endpoint_type": endpoint_type, "brokers": []}
    return {
        "throttle_time": 0,
        "error_code": errors.NONE,
        "error_message": None,
        "endpoint_type": 1,
        "cluster_id": ctx.node.cluster_id,
        "controller_id": controller_id(ctx.node),
        "brokers": brokers(ctx.node, ctx),
        "cluster_authorized_operations": (
            cluster_operations(ctx) if field_of(req, "include_cluster_authorized_operations", False) else -(2**31)
        ),
    }


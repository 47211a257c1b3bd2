"""Partition administration: CreatePartitions, DeleteRecords, DescribeLogDirs,
DescribeProducers, ListPartitionReassignments.

CreatePartitions grows a topic written here (new archives, then a signed catalog change,
as CreateTopics). DeleteRecords moves a partition's log start offset (Kafka's low
watermark) and drops the whole segments below it; the Merkle tree and the signed heads
are untouched, so every offset once signed stays provable (storage/FORMAT.md section 4).
Both persist: the catalog and the head slot survive restarts.

DescribeLogDirs reports the one data directory with every partition's retained bytes.
DescribeProducers lists the producers each partition remembers (with the start of an open
transaction). Partitions are never reassigned (every broker of a cluster mirrors every
archive), so ListPartitionReassignments always answers with none.

Cluster mode: only a topic's writer signs its catalog, so CreatePartitions for a topic
written by another broker is forwarded to that broker (broker/forwarding.py), from any
broker: a client sends it to the controller (Kafka's brokers forward it there since
KIP-590), and librdkafka never asks for Metadata again on NOT_CONTROLLER. Forwarded
once: a request another broker forwarded here for a topic not written here is refused,
naming its writer. A topic whose partitions are quorum-signed is refused INVALID_REQUEST
(docs/clusters.md): its new partitions would be single-signer. DeleteRecords goes to a partition's leader, which here is its writer
(NOT_LEADER_OR_FOLLOWER elsewhere).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import trio

from broker.api import Reply, RequestContext, api
from broker.cluster import ClusterView
from broker.cluster.quorum import is_quorum_signed
from broker.forwarding import FORWARD_TIMEOUT_S, forward_to
from broker.handlers import errors
from broker.mirror import BROKER_CLIENT_ID
from broker.node import Node, Topic, TopicError
from broker.security.authz import Operation
from broker.security.session import authorize
from storage.errors import StorageError

INVALID_PARTITIONS = 37
OFFSET_OUT_OF_RANGE = 1


@api(37, "CreatePartitions", (0, 3))
async def create_partitions(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    counts = Counter(t.name for t in req.topics)
    # As Kafka's ControllerApis: a topic named more than once gets one INVALID_REQUEST
    # result, ahead of the others, and is not grown.
    results: list[dict[str, Any]] = [
        {
            "name": name,
            "error_code": errors.INVALID_REQUEST,
            "error_message": "Duplicate topic name.",
        }
        for name, n in counts.items()
        if n > 1
    ]
    for t in req.topics:
        if counts[t.name] > 1:
            continue
        entry: dict[str, Any] = {"name": t.name, "error_code": errors.NONE, "error_message": None}
        results.append(entry)
        try:
            await _grow(ctx, node, t, req.validate_only)
        except TopicError as exc:
            entry.update(error_code=exc.code, error_message=exc.message)
    return {"throttle_time": 0, "results": results}


async def _grow(ctx: RequestContext, node: Node, t: Any, validate_only: bool) -> None:
    if not authorize(ctx, Operation.CREATE, t.name):
        raise TopicError(errors.TOPIC_AUTHORIZATION_FAILED, "Authorization failed.")
    cluster = node.cluster
    topic = node.topics.get(t.name)
    if topic is None or t.name.startswith("__"):
        raise TopicError(errors.UNKNOWN_TOPIC_OR_PARTITION, f"The topic '{t.name}' does not exist.")
    first = topic.partitions[0].log if topic.partitions else None
    if cluster.placed_replicas(t.name, 0) is not None or (
        first is not None and is_quorum_signed(first.manifest, first.public_key)
    ):
        # Decided: refused, on every broker. A new partition would need replicas placed
        # and a manifest of their keys, signed by a quorum as the others; the catalog
        # path would make it single-signer, whose writer alone holds its key.
        raise TopicError(
            errors.INVALID_REQUEST,
            f"Topic {t.name} has quorum-signed partitions: CreatePartitions is not supported for "
            "them (new partitions would not be quorum-signed); create a new topic with more partitions.",
        )
    if (
        topic.mirrored
        and topic.leader_id is not None
        and ctx.client_id != BROKER_CLIENT_ID
    ):
        await _grow_on_writer(cluster, topic.leader_id, t, validate_only)
        return
    if topic.mirrored:
        where = (
            f"broker {topic.leader_id}"
            if topic.leader_id is not None
            else "the node it is mirrored from"
        )
        raise TopicError(
            errors.INVALID_REQUEST,
            f"Topic {t.name} is written by {where}; only its writer can add partitions.",
        )
    have = len(topic.partitions)
    if t.count < have:
        raise TopicError(
            INVALID_PARTITIONS,
            f"Topic currently has {have} partitions, which is higher than the requested {t.count}.",
        )
    if t.count == have:
        raise TopicError(INVALID_PARTITIONS, f"Topic already has {have} partitions.")
    if t.count > 100_000:
        raise TopicError(INVALID_PARTITIONS, "Number of partitions is larger than 100000.")
    if t.assignments is not None:
        if len(t.assignments) != t.count - have:
            raise TopicError(
                errors.INVALID_REPLICA_ASSIGNMENT,
                f"Increasing the number of partitions by {t.count - have} but {len(t.assignments)} assignments provided.",
            )
        brokers = set(cluster.brokers)
        if any(not a.broker_ids or not set(a.broker_ids) <= brokers for a in t.assignments):
            raise TopicError(
                errors.INVALID_REPLICA_ASSIGNMENT, f"Only brokers {sorted(brokers)} exist."
            )
    node.check_partition_limit(t.count - have)
    if not validate_only:
        await node.add_partitions(topic, t.count)


async def _grow_on_writer(cluster: ClusterView, writer: int, t: Any, validate_only: bool) -> None:
    """Have `writer`, which writes topic `t.name`, add its partitions; its refusal as a
    TopicError."""
    assignments = (
        None
        if t.assignments is None
        else [{"broker_ids": list(a.broker_ids)} for a in t.assignments]
    )
    resp = await forward_to(
        cluster,
        writer,
        37,
        3,
        "create_partitions",
        {
            "topics": [{"name": t.name, "count": t.count, "assignments": assignments}],
            "timeout": int(FORWARD_TIMEOUT_S * 1000),
            "validate_only": validate_only,
        },
    )
    r = resp.results[0]
    if r.error_code:
        raise TopicError(
            int(r.error_code), r.error_message or f"Broker {writer} refused to add partitions"
        )


@api(21, "DeleteRecords", (0, 2))
async def delete_records(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    topics = []
    for t in req.topics:
        parts: list[dict[str, Any]] = []
        topics.append({"name": t.name, "partitions": parts})
        allowed = authorize(ctx, Operation.DELETE, t.name)  # Kafka's DELETE on the topic
        topic = node.topics.get(t.name)
        for p in t.partitions:
            entry: dict[str, Any] = {
                "partition_index": p.partition_index,
                "low_watermark": -1,
                "error_code": errors.NONE,
            }
            parts.append(entry)
            if not allowed:
                entry["error_code"] = errors.TOPIC_AUTHORIZATION_FAILED
                continue
            if topic is None or not 0 <= p.partition_index < len(topic.partitions):
                entry["error_code"] = errors.UNKNOWN_TOPIC_OR_PARTITION
                continue
            if topic.mirrored:
                entry["error_code"] = errors.NOT_LEADER_OR_FOLLOWER
                continue
            partition = topic.partitions[p.partition_index]
            async with partition.lock:  # no commit round writes it meanwhile
                plog = partition.log
                offset = plog.high_watermark if p.offset == -1 else p.offset
                if partition.failed:
                    entry["error_code"] = partition.failed_code
                elif offset < 0 or offset > plog.high_watermark:
                    entry["error_code"] = OFFSET_OUT_OF_RANGE
                else:
                    try:
                        entry["low_watermark"] = plog.delete_records_below(offset)
                    except (StorageError, OSError) as exc:
                        node.fail_partition(partition, f"deleting records failed: {exc}")
                        entry["error_code"] = errors.KAFKA_STORAGE_ERROR
            partition.notify()
    return {"throttle_time": 0, "topics": topics}


@api(35, "DescribeLogDirs", (1, 4))
async def describe_log_dirs(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    wanted: list[tuple[Topic, Sequence[int]]]
    if req.topics is None:
        wanted = [
            (t, range(len(t.partitions)))
            for t in node.topics.values()
            if authorize(ctx, Operation.DESCRIBE, t.name, quiet=True)
        ]
    else:
        wanted = []
        for d in req.topics:
            topic = node.topics.get(d.topic)
            if topic is not None and authorize(ctx, Operation.DESCRIBE, d.topic, quiet=True):
                wanted.append((topic, [i for i in d.partitions if 0 <= i < len(topic.partitions)]))
    topics = []
    for topic, indexes in wanted:
        topics.append(
            {
                "name": topic.name,
                "partitions": [
                    {
                        "partition_index": i,
                        "partition_size": topic.partitions[i].log.retained_bytes,
                        "offset_lag": 0,
                        "is_future_key": False,
                    }
                    for i in indexes
                ],
            }
        )
    data_dir = node.config.data_dir.absolute()
    total = usable = -1
    try:
        st = await trio.to_thread.run_sync(os.statvfs, data_dir)
        total, usable = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        pass
    failed = any(
        p.failed and p.failed_code == errors.KAFKA_STORAGE_ERROR
        for t in node.topics.values()
        for p in t.partitions
    )
    return {
        "throttle_time": 0,
        "error_code": errors.NONE,
        "results": [
            {
                "error_code": errors.KAFKA_STORAGE_ERROR if failed else errors.NONE,
                "log_dir": str(data_dir),
                "topics": topics,
                "total_bytes": total,
                "usable_bytes": usable,
            }
        ],
    }


@api(61, "DescribeProducers", (0, 0))
async def describe_producers(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    topics = []
    for t in req.topics:
        parts: list[dict[str, Any]] = []
        topics.append({"name": t.name, "partitions": parts})
        allowed = authorize(ctx, Operation.READ, t.name)  # Kafka asks for READ on the topic
        topic = node.topics.get(t.name)
        for i in t.partition_indexes:
            entry: dict[str, Any] = {
                "partition_index": i,
                "error_code": errors.NONE,
                "error_message": None,
                "active_producers": [],
            }
            parts.append(entry)
            if not allowed:
                entry["error_code"] = errors.TOPIC_AUTHORIZATION_FAILED
            elif topic is None or not 0 <= i < len(topic.partitions):
                entry["error_code"] = errors.UNKNOWN_TOPIC_OR_PARTITION
            elif topic.mirrored:
                entry["error_code"] = errors.NOT_LEADER_OR_FOLLOWER
            else:
                entry["active_producers"] = [
                    {
                        "producer_id": pid,
                        "producer_epoch": e.epoch,
                        "last_sequence": e.last_seq,
                        "last_timestamp": e.last_timestamp,
                        # of its last marker here (-1: none); `kafka-transactions
                        # abort --start-offset` sends it back with its marker
                        "coordinator_epoch": topic.partitions[i].txns.coordinator_epochs.get(pid, -1),
                        # the first offset of its open transaction here (-1: none)
                        "current_txn_start_offset": topic.partitions[i].txns.ongoing.get(pid, -1),
                    }
                    for pid, e in sorted(topic.partitions[i].producers.items())
                ]
    return {"throttle_time": 0, "topics": topics}


@api(46, "ListPartitionReassignments", (0, 0))
async def list_partition_reassignments(ctx: RequestContext, req: Any) -> Reply:
    # Partitions never move: every broker of a cluster already mirrors every archive.
    return {"throttle_time": 0, "error_code": errors.NONE, "error_message": None, "topics": []}

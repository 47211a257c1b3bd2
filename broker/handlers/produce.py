"""Produce and InitProducerId: the write path (InitProducerId with a transactional id is
broker/handlers/transactions.py's).

Per partition, in this order and without yielding to the event loop (so checks and the
admission are atomic per partition): topic lookup (auto-create), batch checks (one v2
batch, CRC-32C, record count vs lastOffsetDelta, size, codec vs version), every record
checked as Kafka's LogValidator does (broker/validation.py, natively
where built: lengths, offset deltas, headers, timestamps, inflated size; refusals name
the first bad record in record_errors), for a transactional batch the transaction check
(KIP-890 part 1: only into a partition of the producer's ongoing transaction; a control
batch from a client is refused, only the broker writes markers), the idempotence verdict,
LogAppendTime stamping, then `Partition.admit`, which gives the
batch its offsets and queues it for the next commit round (node.py). The handler never
awaits, so the connection's reader goes on to the next request at once. The response
waits (in `Deferred`, answered in request order) until a commit round has written the
batch and published a signed head covering it: a produce is acknowledged only once
durable as the fsync policy says. acks=0 gets no response at all; a disk error found
after admission takes the partition offline, and the next produce to it learns that.
In cluster mode acks=all also waits for the in-sync mirrors (broker/cluster.py):
NOT_ENOUGH_REPLICAS before the append when the ISR is below min.insync.replicas,
NOT_ENOUGH_REPLICAS_AFTER_APPEND when too few replicas held it in the end or in time.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import trio

from broker.api import NO_RESPONSE, Deferred, Encoded, Reply, RequestContext, api
from broker.cleaner import keyless_message, keyless_record
from broker.cluster import signed_blocks
from broker.handlers import errors
from broker.handlers.transactions import init_transactional
from broker.idempotence import Verdict, last_sequence
from broker.node import Node, Partition, Topic, TopicError, ms_now
from broker.protocol import records
from broker.protocol.compression import recompress_batch
from broker.protocol.errors import ProtocolError, RecordBatchError
from broker.protocol.fastpath import ProducePartitionResult, encode_produce_response
from broker.security.authz import Operation
from broker.security.session import authorize, authorize_idempotent_write
from broker.validation import TimestampRange, check_batch, inflate_limit

log = logging.getLogger("hyperkafka.produce")

ZSTD = 4


# Kafka's ReplicaManager answers these before the log is consulted, with log start
# offset -1; every other error (sequence, epoch, record validation) carries the real one,
# which the Java producer compares with its last offset (KIP-360).
_NO_LOG_START_OFFSET = frozenset(
    {
        errors.CORRUPT_MESSAGE,
        errors.MESSAGE_TOO_LARGE,
        errors.KAFKA_STORAGE_ERROR,
        errors.NOT_ENOUGH_REPLICAS,
        errors.UNKNOWN_TOPIC_OR_PARTITION,
        errors.UNSUPPORTED_COMPRESSION_TYPE,
    }
)


TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53


def _has_transactional(req: Any) -> bool:
    """Whether a partition's first batch is transactional (Kafka's hasTransactionalRecords)."""
    for t in req.topic_data:
        for p in t.partition_data:
            data = p.records
            if data is not None and len(data) > 22 and data[22] & 0x10:  # attributes, low byte
                return True
    return False


def _transactional_batches(req: Any) -> list[tuple[str, int, int, int]]:
    """(topic, partition, producer id, epoch) of each partition whose batch is a
    transactional data batch (read from its header; the full checks come later)."""
    out = []
    for t in req.topic_data:
        for p in t.partition_data:
            data = p.records
            if data is not None and len(data) >= 61 and data[22] & 0x10 and not data[22] & 0x20:
                pid, epoch = struct.unpack_from(">qh", data, 43)
                out.append((t.name, p.index, pid, epoch))
    return out


class CloseConnection(ProtocolError):
    """A Kafka outcome the client can only learn by losing its connection."""


class _PartitionResult:
    __slots__ = ("base_offset", "before_log", "error", "generation", "log_append_time", "log_start_offset", "message", "min_insync", "partition", "record_index", "wait_for")

    def __init__(self, error: int = errors.NONE, message: str | None = None, record_index: int | None = None) -> None:
        self.error = error
        self.message = message
        self.record_index = record_index  # the first bad record of a refused batch (record_errors)
        self.base_offset = -1
        self.log_append_time = -1
        self.log_start_offset = -1  # reported for every partition that exists (KIP-360)
        self.partition: Partition | None = None
        self.wait_for = -1  # last offset that must be covered by a head before answering
        self.generation = 0  # the partition's generation it was admitted in (Partition.durable)
        self.min_insync = 0  # cluster mode, acks=all: replicas that must hold it (0: none waited for)
        self.before_log = False  # refused before the log was consulted (log start offset -1)


def _produce_one(ctx: RequestContext, topic: Topic, index: int, data: Any, acks: int) -> _PartitionResult:
    if not 0 <= index < len(topic.partitions):
        return _PartitionResult(errors.UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")
    partition = topic.partitions[index]
    cluster = ctx.node.cluster
    if topic.mirrored and not partition.led:  # another partition of it failed over here
        return _PartitionResult(errors.NOT_LEADER_OR_FOLLOWER,
                                f"Partition {topic.name}-{index} is a read-only mirror; produce to its leader")
    lead = cluster.placed_leader(topic.name, index)
    if lead is not None and lead != cluster.me:  # a failover moved its leader away
        return _PartitionResult(errors.NOT_LEADER_OR_FOLLOWER,
                                f"Broker {lead} leads partition {topic.name}-{index} since a failover")
    if not topic.mirrored or partition.led:  # quorum-signed: its signers alive, or nothing is written
        why = cluster.produce_refusal(topic.name, index, partition.log,
                                      topic.min_insync_replicas if acks == -1 else 0)
        if why is not None:
            return _PartitionResult(errors.NOT_ENOUGH_REPLICAS, why)
    if acks == -1:
        # Kafka's check before the append: too few in-sync replicas, nothing is written.
        isr = cluster.short_of_insync(partition.log.key, topic.min_insync_replicas)
        if isr is not None:
            return _PartitionResult(
                errors.NOT_ENOUGH_REPLICAS,
                f"The size of the current ISR {isr} is insufficient to satisfy the min.isr requirement "
                f"of {topic.min_insync_replicas} for partition {topic.name}-{index}",
            )
    # Checks, idempotence verdict and admission are one atomic step: nothing here yields.
    result = _admit_checked(ctx, topic, partition, data)
    if result.error not in _NO_LOG_START_OFFSET and not result.before_log:
        result.log_start_offset = partition.log.log_start_offset
    if acks == -1 and result.partition is not None:
        result.min_insync = cluster.acks_all_replicas(topic.min_insync_replicas)
    return result


def _admit_checked(ctx: RequestContext, topic: Topic, partition: Partition, data: Any) -> _PartitionResult:
    if partition.failed:
        return _PartitionResult(partition.failed_code, partition.failed)
    if not data:
        return _PartitionResult(errors.INVALID_RECORD, "Produce requests with version 3+ must have exactly one record batch")
    if len(data) > topic.max_message_bytes:
        return _PartitionResult(
            errors.MESSAGE_TOO_LARGE,
            f"The batch of {len(data)} bytes is larger than max.message.bytes ({topic.max_message_bytes})",
        )
    now = ms_now()
    bounds = None
    if not topic.log_append_time:
        bounds = TimestampRange.around(now, topic.timestamp_before_max_ms, topic.timestamp_after_max_ms)
    try:
        # Header, length, CRC-32C and every record in one native pass (GIL released); the
        # records' verdict is raised below, after the header-only checks, as Kafka orders them.
        checked = check_batch(data, max_inflated=inflate_limit(topic.max_message_bytes), timestamps=bounds)
    except RecordBatchError as exc:
        return _PartitionResult(exc.error_code, str(exc))
    batch = checked.header
    if batch.is_control:
        return _PartitionResult(errors.INVALID_RECORD, "Clients may not write control batches")
    if batch.is_transactional and batch.producer_id < 0:
        return _PartitionResult(errors.INVALID_RECORD, "A transactional batch needs a producer id")
    if batch.compression == ZSTD and ctx.api_version < 7:
        return _PartitionResult(errors.UNSUPPORTED_COMPRESSION_TYPE, "zstd needs Produce v7 or later")
    if batch.compression > ZSTD:
        return _PartitionResult(errors.UNSUPPORTED_COMPRESSION_TYPE, f"Unknown compression codec {batch.compression}")
    if batch.producer_id >= 0 and batch.base_sequence < 0:
        return _PartitionResult(errors.INVALID_RECORD, "An idempotent batch needs a base sequence")

    try:
        # Every record, before anything is signed.
        max_timestamp = checked.records()
        # A compacted topic keeps the last record per key: Kafka's LogValidator refuses
        # records without one there.
        keyless = keyless_record(data) if topic.compaction is not None else None
    except RecordBatchError as exc:
        return _PartitionResult(exc.error_code, str(exc), exc.record_index)
    if keyless is not None:
        return _PartitionResult(errors.INVALID_RECORD, keyless_message(topic.name, partition.index), keyless)

    if batch.is_transactional:
        # KIP-890 part 1: only into a partition of this producer's ongoing transaction.
        refused = ctx.node.transactions.check_produce(batch.producer_id, batch.producer_epoch, topic.name, partition.index)
        if refused is not None:
            refusal = _PartitionResult(*refused)
            refusal.before_log = True  # (Kafka's ReplicaManager verifies before the append)
            return refusal
    outcome = None
    if batch.producer_id >= 0:
        first_seq = batch.base_sequence
        last_seq = last_sequence(first_seq, batch.last_offset_delta)
        outcome = partition.producers.check(batch.producer_id, batch.producer_epoch, first_seq, last_seq)
        if outcome.verdict is Verdict.DUPLICATE:
            assert outcome.duplicate_of is not None
            result = _PartitionResult()
            result.base_offset = outcome.duplicate_of.first_offset
            result.partition, result.wait_for = partition, outcome.duplicate_of.last_offset
            result.generation = partition.generation
            return result
        if outcome.verdict is Verdict.FENCED:
            return _PartitionResult(errors.INVALID_PRODUCER_EPOCH, outcome.message)
        if outcome.verdict is Verdict.OUT_OF_ORDER:
            return _PartitionResult(errors.OUT_OF_ORDER_SEQUENCE_NUMBER, outcome.message)

    if topic.compression is not None and batch.compression != topic.compression:
        # compression.type names another codec: rebuilt as Kafka's LogValidator does,
        # before anything is signed; Kafka checks the rebuilt size against the limit.
        data = recompress_batch(data, topic.compression, topic.compression_level,
                                inflate_limit(topic.max_message_bytes))
        if len(data) > topic.max_message_bytes:
            return _PartitionResult(
                errors.MESSAGE_TOO_LARGE,
                f"Message batch size is {len(data)} bytes in append to partition {topic.name}-{partition.index} "
                f"which exceeds the maximum configured size of {topic.max_message_bytes}.",
            )
    # The log stamps the base offset into the batch: a writable view of the request frame
    # (the fast decoder's) is used as it is, anything else is copied once.
    buf = data if isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly) else bytearray(data)
    result = _PartitionResult()
    if topic.log_append_time:
        records.set_log_append_time(buf, now)
        result.log_append_time = now
    elif not batch.is_log_append_time and max_timestamp != batch.max_timestamp:
        # As Kafka's LogValidator: maxTimestamp is the records' own, whatever the producer
        # wrote (the time index, retention and ListOffsets trust it).
        records.set_max_timestamp(buf, max_timestamp)
    base, last = partition.admit(buf, batch.last_offset_delta)
    if batch.is_transactional:
        partition.txns.on_data(batch.producer_id, base)  # holds the last stable offset here
    stats = topic.stats
    stats.bytes_in += len(buf)
    stats.messages_in += batch.records_count
    if outcome is not None:
        partition.producers.record(
            batch.producer_id,
            batch.producer_epoch,
            batch.base_sequence,
            last_sequence(batch.base_sequence, batch.last_offset_delta),
            base,
            last,
            now if topic.log_append_time else max_timestamp,
        )
    ctx.node.mark_dirty(partition, wake=False)  # the reader runs the round after the chunk
    result.base_offset, result.partition, result.wait_for = base, partition, last
    result.generation = partition.generation
    return result


async def _room_for_unsigned(node: Node, topic: Topic, index: int) -> None:
    """Back-pressure on a quorum-signed partition whose replicas sign slower than its
    producers write (docs/clusters.md): past ``hyperkafka.quorum.unsigned.max.bytes``
    admitted and not yet signed, wait (this connection's reads with it) for its next
    head. The rounds owed by this reader go to the commit loop first: they are what
    frees the room."""
    if not 0 <= index < len(topic.partitions):
        return
    partition = topic.partitions[index]
    budget = node.config.quorum_unsigned_max_bytes
    if partition.over_budget(budget):
        if node.round_owed:
            node.wake_commit()
        await partition.wait_room(budget)


@api(0, "Produce", (0, 11), accepted_min=3)
async def produce(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    acks = req.acks
    if req.transactional_id is None and _has_transactional(req):
        # As Kafka: transactional records need the request's transactional id (its ACL).
        results = {
            (t.name, p.index): _PartitionResult(TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "Transactional records need a transactional id")
            for t in req.topic_data
            for p in t.partition_data
        }
    elif acks not in (0, 1, -1):
        results = {
            (t.name, p.index): _PartitionResult(errors.INVALID_REQUIRED_ACKS) for t in req.topic_data for p in t.partition_data
        }
    else:
        results = {}
        if req.transactional_id is not None:
            # KIP-890 part 1 where another broker coordinates the transactional id: it is
            # asked first (broker/transactions/coordinator.py `verify_produce`).
            unverified = await node.transactions.verify_produce(req.transactional_id, _transactional_batches(req))
            for (topic_name, index), (code, message) in unverified.items():
                refusal = results[(topic_name, index)] = _PartitionResult(code, message)
                refusal.before_log = True
        for t in req.topic_data:
            if not authorize(ctx, Operation.WRITE, t.name) or (t.name not in node.topics and not authorize(ctx, Operation.CREATE, t.name)):
                for p in t.partition_data:
                    results[(t.name, p.index)] = _PartitionResult(errors.TOPIC_AUTHORIZATION_FAILED, "Not authorized to write to this topic")
                continue
            try:
                topic = node.topic_for_write(t.name)
            except TopicError as exc:
                for p in t.partition_data:
                    results[(t.name, p.index)] = _PartitionResult(exc.code, exc.message)
                stats = node.topics[t.name].stats if t.name in node.topics else node.metrics.other
                stats.produce_requests += len(t.partition_data)
                stats.failed_produce += len(t.partition_data)
                continue
            stats = topic.stats
            for p in t.partition_data:
                if (t.name, p.index) in results:  # refused by the transaction coordinator
                    continue
                await _room_for_unsigned(node, topic, p.index)
                r = results[(t.name, p.index)] = _produce_one(ctx, topic, p.index, p.records, acks)
                stats.produce_requests += 1
                if r.error != errors.NONE:
                    stats.failed_produce += 1

    if acks == 0:
        failed = [r for r in results.values() if r.error != errors.NONE]
        if failed:
            # The client will never read an error code: Kafka closes the connection so
            # the producer notices and refreshes its metadata. So do we.
            raise CloseConnection(f"acks=0 produce failed: {failed[0].message or failed[0].error}")
        return NO_RESPONSE
    timeout_s = max(req.timeout.total_seconds(), 0.0)
    waiting = [r for r in results.values() if r.partition is not None and r.error == errors.NONE]

    # acks=all in a cluster waits for the in-sync mirrors as well (broker/cluster.py).
    for_mirrors = any(r.min_insync for r in waiting)

    def settled(r: _PartitionResult) -> bool:
        assert r.partition is not None
        try:
            return r.partition.durable(r.wait_for, r.generation)
        except TopicError:
            return True

    def ready() -> bool:
        # Every batch is under a published head (or its partition failed, or went
        # offline before publishing it): finish() will not wait. The usual case once the
        # writer gets here, as the round ran first.
        return not for_mirrors and all(settled(r) for r in waiting)

    async def finish() -> Encoded:
        replicated: set[int] = set()
        if not ready():
            with trio.move_on_after(timeout_s) as scope:
                for r in waiting:
                    assert r.partition is not None
                    try:
                        await r.partition.wait_durable(r.wait_for, r.generation)
                    except TopicError as exc:
                        r.error, r.message = exc.code, exc.message
                for r in waiting:
                    if r.error == errors.NONE and r.min_insync:
                        # The published head covers the batch; now the in-sync mirrors
                        # must hold it too.
                        plog = r.partition.log  # type: ignore[union-attr]
                        if await node.cluster.wait_replicated(plog.key, signed_blocks(plog), r.min_insync):
                            replicated.add(id(r))
                        else:
                            r.error, r.message = errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND, (
                                f"Fewer than min.insync.replicas={r.min_insync} replicas hold the batch")
            if scope.cancelled_caught:
                for r in waiting:
                    assert r.partition is not None
                    if r.error == errors.NONE:
                        try:
                            if not r.partition.durable(r.wait_for, r.generation):
                                r.error, r.message = errors.REQUEST_TIMED_OUT, "The head covering this batch was not published in time"
                        except TopicError as exc:
                            r.error, r.message = exc.code, exc.message
                    if r.error == errors.NONE and r.min_insync and id(r) not in replicated:
                        r.error, r.message = errors.NOT_ENOUGH_REPLICAS_AFTER_APPEND, (
                            f"The batch is stored, but in-sync replicas did not all hold it within the "
                            f"request timeout (min.insync.replicas={r.min_insync})")
        else:
            for r in waiting:
                assert r.partition is not None
                try:  # as wait_durable answers
                    r.partition.durable(r.wait_for, r.generation)
                except TopicError as exc:
                    r.error, r.message = exc.code, exc.message
        by_topic: dict[str, list[ProducePartitionResult]] = {}
        for (name, index), r in results.items():
            ok = r.error == errors.NONE
            by_topic.setdefault(name, []).append(
                ProducePartitionResult(
                    index,
                    r.error,
                    r.base_offset if ok else -1,
                    r.log_append_time if ok else -1,
                    r.log_start_offset,
                    r.message,
                    () if r.record_index is None else ((r.record_index, r.message),),
                )
            )
        topics = list(by_topic.items())
        cid, version = ctx.correlation_id, ctx.api_version
        return Encoded(
            encode_produce_response(cid, version, topics),
            lambda ms: encode_produce_response(cid, version, topics, throttle_ms=ms),
        )

    return Deferred(finish, ready)


@api(22, "InitProducerId", (0, 5))
async def init_producer_id(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_idempotent_write(ctx):
        return {"throttle_time": 0, "error_code": errors.CLUSTER_AUTHORIZATION_FAILED, "producer_id": -1, "producer_epoch": -1}
    if req.transactional_id is not None:
        return await init_transactional(ctx, req)
    # Without a transactional id Kafka always hands out a fresh id at epoch 0 (KIP-360
    # bumps included), so do we.
    try:
        pid = ctx.node.allocate_producer_id()
    except OSError as exc:  # the id block could not be made durable (a full disk): retriable
        log.error("cannot reserve producer ids: %s", exc)
        return {"throttle_time": 0, "error_code": errors.COORDINATOR_NOT_AVAILABLE, "producer_id": -1, "producer_epoch": -1}
    return {"throttle_time": 0, "error_code": errors.NONE, "producer_id": pid, "producer_epoch": 0}

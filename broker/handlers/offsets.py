"""ListOffsets and OffsetForLeaderEpoch.

ListOffsets: -1 is the high watermark (for read_committed the last stable offset), -2 the log start offset, -3 the record with
the largest timestamp (KIP-734), and t >= 0 the first record whose timestamp is >= t,
found through the batch index and then by reading the records of that one batch
(LogAppendTime batches answer with the batch's append time, as Kafka does).

OffsetForLeaderEpoch: an archive has one writer and its leader epoch is always 0, so
epoch 0 ends at the log end offset and any later epoch is unknown (-1, -1). A
quorum-signed partition's epoch is its archive's fork, which a failover moves on; its
leader-epoch checkpoint (storage/epochs.py) then answers as Kafka's leader does.
Requests naming a current_leader_epoch are checked against the partition's
(FENCED_LEADER_EPOCH older, UNKNOWN_LEADER_EPOCH newer).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from broker.api import Reply, RequestContext, api
from broker.handlers import errors
from broker.handlers.cluster import epoch_error, leader_epoch
from broker.node import Partition
from broker.protocol import records
from broker.protocol.errors import RecordBatchError
from broker.security.authz import Operation
from broker.security.session import authorize
from broker.transactions.partition import last_stable_offset
from storage.epochs import EpochCache
from storage.errors import StorageError

LATEST, EARLIEST, MAX_TIMESTAMP = -1, -2, -3


def _lookup(partition: Partition, timestamp: int, committed: bool = False) -> tuple[int, int, int]:
    """(error, offset, timestamp) for one ListOffsets query (`committed`: read_committed)."""
    plog = partition.log
    if timestamp == LATEST:
        hwm = plog.high_watermark
        return errors.NONE, last_stable_offset(partition) if committed else hwm, -1
    if timestamp == EARLIEST:
        return errors.NONE, plog.log_start_offset, -1
    try:
        if timestamp == MAX_TIMESTAMP:
            batch = plog.batch_with_max_timestamp()
        elif timestamp >= 0:
            batch = plog.batch_for_timestamp(timestamp)
        else:
            return errors.UNSUPPORTED_VERSION, -1, -1
    except (StorageError, OSError):  # unauthentic bytes, or the disk failed to read them
        return errors.KAFKA_STORAGE_ERROR, -1, -1
    if batch is None:
        return errors.NONE, -1, -1
    try:
        if timestamp >= 0:
            found = records.find_offset_for_timestamp(
                batch, timestamp, min_offset=plog.log_start_offset
            )
        else:
            found = _max_timestamp_record(batch, plog.log_start_offset)
    except RecordBatchError:
        return errors.CORRUPT_MESSAGE, -1, -1
    if found is None or found[0] >= plog.high_watermark:
        return errors.NONE, -1, -1
    return errors.NONE, found[0], found[1]


def _max_timestamp_record(batch: bytes, min_offset: int) -> tuple[int, int] | None:
    header = records.parse_batch_header(batch)
    if header.is_log_append_time:
        return max(header.base_offset, min_offset), header.max_timestamp
    best: tuple[int, int] | None = None
    for record in records.iter_records(batch):
        if record.offset < min_offset:
            continue  # below the log start (DeleteRecords)
        if best is None or record.timestamp > best[1]:
            best = (record.offset, record.timestamp)
    return best


@api(2, "ListOffsets", (1, 7))
async def list_offsets(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    # As Kafka's ListOffsetsRequest.duplicatePartitions: a partition named more than once
    # gets one INVALID_REQUEST entry (at its first place; Kafka answers from a map keyed by
    # partition) and is not looked up (a lookup by timestamp may scan batches: 20,000 of
    # them must not be 20,000 scans).
    named = Counter((t.name, p.partition_index) for t in req.topics for p in t.partitions)
    answered: set[tuple[str, int]] = set()
    committed = getattr(req, "isolation_level", 0) == 1  # READ_COMMITTED: latest is the LSO
    topics = []
    for t in req.topics:
        parts = []
        readable = authorize(ctx, Operation.READ, t.name)
        for p in t.partitions:
            if (t.name, p.partition_index) in answered:
                continue
            answered.add((t.name, p.partition_index))
            partition = node.partition(t.name, p.partition_index)
            entry: dict[str, Any] = {
                "partition_index": p.partition_index,
                "timestamp": -1,
                "offset": -1,
                "leader_epoch": -1,
            }
            if not readable:
                entry["error_code"] = errors.TOPIC_AUTHORIZATION_FAILED
            elif named[(t.name, p.partition_index)] > 1:
                entry["error_code"] = errors.INVALID_REQUEST
            elif partition is None:
                entry["error_code"] = errors.UNKNOWN_TOPIC_OR_PARTITION
            elif code := epoch_error(getattr(p, "current_leader_epoch", -1), leader_epoch(partition.log)):
                entry["error_code"] = code
            else:
                error, offset, timestamp = _lookup(partition, p.timestamp, committed)
                entry.update(
                    error_code=error,
                    offset=offset,
                    timestamp=timestamp,
                    leader_epoch=_epoch_at(partition, offset) if offset >= 0 else -1,
                )
            parts.append(entry)
        topics.append({"name": t.name, "partitions": parts})
    return {"throttle_time": 0, "topics": topics}


@api(23, "OffsetForLeaderEpoch", (2, 4))
async def offset_for_leader_epoch(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    topics = []
    for t in req.topics:
        parts = []
        describable = authorize(ctx, Operation.DESCRIBE, t.topic)  # Kafka: DESCRIBE on the topic
        for p in t.partitions:
            partition = node.partition(t.topic, p.partition)
            entry: dict[str, Any] = {
                "partition": p.partition,
                "error_code": errors.NONE,
                "leader_epoch": -1,
                "end_offset": -1,
            }
            current = getattr(p, "current_leader_epoch", -1)
            if not describable:
                entry["error_code"] = errors.TOPIC_AUTHORIZATION_FAILED
            elif partition is None:
                entry["error_code"] = errors.UNKNOWN_TOPIC_OR_PARTITION
            elif code := epoch_error(current, leader_epoch(partition.log)):
                entry["error_code"] = code
            else:
                epoch, end = end_offset_for(
                    leader_epoch(partition.log), partition_epochs(partition),
                    partition.log.high_watermark, p.leader_epoch,
                )  # fmt: skip
                entry.update(leader_epoch=epoch, end_offset=end)
            parts.append(entry)
        topics.append({"topic": t.topic, "partitions": parts})
    return {"throttle_time": 0, "topics": topics}


def partition_epochs(partition: Partition) -> EpochCache | None:
    """The leader-epoch checkpoint of a quorum-signed partition that changed leader."""
    lg = partition.log
    if leader_epoch(lg) == 0:
        return None
    try:
        return EpochCache(lg.fs, lg.path)
    except (OSError, StorageError):
        return None


def _epoch_at(partition: Partition, offset: int) -> int:
    cache = partition_epochs(partition)
    if cache is None or not cache.entries:
        return leader_epoch(partition.log)
    return max(0, cache.epoch_at(offset))


def end_offset_for(
    epoch: int, cache: EpochCache | None, high_watermark: int, requested: int
) -> tuple[int, int]:
    """OffsetForLeaderEpoch's (leader epoch, end offset) for `requested` on a partition
    in leader epoch `epoch` whose checkpoint is `cache` (None or empty: one epoch,
    `epoch`, the whole log). The end is never past the high watermark: a consumer
    truncates to it, and nothing above it was acknowledged."""
    if cache is None or not cache.entries:
        if 0 <= requested <= epoch:
            return (epoch, high_watermark)
        return (-1, -1)
    e, end = cache.end_offset_for(requested, high_watermark)
    return (e, min(end, high_watermark) if end >= 0 else end)

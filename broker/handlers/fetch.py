"""Fetch: the read path, with no decoding of what is served.

Batches go out exactly as stored (and signed), in whole batches, starting with the batch
that holds the requested offset, never past the high watermark (the length covered by
the last published signed head). As Kafka's ReplicaManager: the answer holds at most
min(the request's max_bytes, the broker's fetch.max.bytes) of records, each partition at
most its partition_max_bytes, except that the first partition with data gets at least
one whole batch even above both (KIP-74); a later partition whose next batch does not
fit what is left gets no records this time.

Records read into memory (below the sendfile size, or all over TLS) are taken from the
broker's answer memory pool (as large as queued.max.request.bytes, broker/memory.py)
until the answer is sent; with it spent, the answer holds what it has (the first batch
always) and the rest comes next time.

A partition named twice in one request is served once, as Kafka's FetchRequest folds the
partitions into one ordered map: the last entry's offset and limits win, at the place of
the first (so a request naming one partition 20,000 times reads it once).

Transactions: every answer carries the partition's last stable offset (below the first
open transaction; broker/transactions/partition.py). A read_committed fetch
(isolation_level 1) gets no batch at or past it, and the aborted transactions whose
records the answer may hold (producer id, first offset), which the client drops;
control batches (markers) are served like any batch, and clients skip them.

Fetch sessions (KIP-227) are not kept: every response is a full response naming every
requested partition with session id 0, which the KIP defines as "no session created";
clients then keep sending full fetches. A request naming a session we never gave out
gets FETCH_SESSION_ID_NOT_FOUND.

Follower fetching (KIP-392), cluster mode: a consumer fetch (v11+) whose rack_id differs
from this broker's rack, for a partition written here, is answered with the id of an
in-sync mirror in that rack as preferred_read_replica and no records (broker/cluster.py
picks it as Kafka's RackAwareReplicaSelector does); the consumer then fetches from that
mirror, which serves its own verified copy. While a partition's writer is dead a mirror
leads it for reads (broker/cluster.py) and serves the same way.

Over plain TCP a partition's data of SENDFILE_MIN_BYTES or more is answered as a
`FileSlice` (a segment file range on a descriptor of its own) that the server's writer
hands to `os.sendfile`: the batches never enter Python. Over TLS they are read.

Long poll: when fewer than min_bytes are ready the handler waits, inside a cancel scope
of max_wait_ms, for the node's next group commit, then reads again.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from broker.api import Reply, RequestContext, api
from broker.handlers import errors
from broker.handlers.cluster import epoch_error, leader_epoch
from broker.handlers.offsets import end_offset_for, partition_epochs
from broker.memory import AnswerMemory
from broker.node import Node
from broker.security.authz import Operation
from broker.security.session import authorize
from broker.sendfile import SENDFILE_MIN_BYTES, FileSlice, release
from broker.transactions.partition import last_stable_offset
from storage.errors import CorruptBatch, LogClosed, OffsetOutOfRange, StorageError

log = logging.getLogger("hyperkafka.fetch")


def requested_partitions(req: Any) -> list[tuple[str, list[Any]]]:
    """The request's partitions by topic, each (topic, partition) once: Kafka's
    LinkedHashMap put, so the last entry wins at the first one's place, and topics are
    grouped as they come (a topic split by another appears twice, as in Kafka's answer)."""
    wanted: dict[tuple[str, int], Any] = {}
    for t in req.topics:
        for p in t.partitions:
            wanted[(t.topic, p.partition)] = p
    grouped: list[tuple[str, list[Any]]] = []
    for (name, _), p in wanted.items():
        if not grouped or grouped[-1][0] != name:
            grouped.append((name, []))
        grouped[-1][1].append(p)
    return grouped


def _read_all(node: Node, req: Any, version: int, denied: frozenset[str] = frozenset(),
              rack: str = "", sendfile: bool = False,
              wanted: list[tuple[str, list[Any]]] | None = None,
              memory: AnswerMemory | None = None) -> tuple[list[dict[str, Any]], int, bool]:
    """(responses, bytes of records, whether a partition named a preferred read replica)."""
    budget = min(req.max_bytes if version >= 3 else 2**31 - 1, node.config.fetch_max_bytes)
    committed = getattr(req, "isolation_level", 0) == 1  # READ_COMMITTED
    total = 0
    redirected = False
    responses = []
    for name, partitions in requested_partitions(req) if wanted is None else wanted:
        topic = node.topics.get(name)
        parts = []
        for p in partitions:
            entry: dict[str, Any] = {
                "partition_index": p.partition,
                "error_code": errors.NONE,
                "high_watermark": -1,
                "last_stable_offset": -1,
                "log_start_offset": -1,
                # As Kafka: a list (maybe empty) for read_committed, null for
                # read_uncommitted; with an error, see below.
                "aborted_transactions": [] if committed else None,
                "preferred_read_replica": -1,
                "records": b"",
            }
            parts.append(entry)
            if name in denied:
                entry["error_code"] = errors.TOPIC_AUTHORIZATION_FAILED
                continue
            partition = None if topic is None or not 0 <= p.partition < len(topic.partitions) else topic.partitions[p.partition]
            if partition is None:
                entry["error_code"] = errors.UNKNOWN_TOPIC_OR_PARTITION
                continue
            # A partition taken offline for writes still serves what its heads cover.
            plog = partition.log
            hwm = plog.high_watermark
            entry["high_watermark"] = hwm
            lso = last_stable_offset(partition)
            entry["last_stable_offset"] = lso
            entry["log_start_offset"] = plog.log_start_offset
            current_epoch = getattr(p, "current_leader_epoch", -1)
            epoch_code = epoch_error(current_epoch, leader_epoch(plog))
            if epoch_code:
                entry["error_code"] = epoch_code
                continue
            diverging = _diverging(partition, getattr(p, "last_fetched_epoch", -1), p.fetch_offset)
            if diverging is not None:
                # KIP-320/595, as Kafka's leader: the fetcher's last epoch ended earlier
                # here (a failover cut what no quorum signed): it truncates to the end
                # named and fetches again; no records this time
                if diverging[1] < 0:
                    entry["error_code"] = errors.OFFSET_OUT_OF_RANGE
                else:
                    entry["diverging_epoch"] = {"epoch": diverging[0], "end_offset": diverging[1]}
                continue
            if rack and topic is not None and not topic.mirrored:
                # KIP-392, as Kafka's leader: a consumer in another rack than ours is sent
                # to an in-sync follower in its own rack, with no records this time.
                preferred = node.cluster.preferred_read_replica(plog.key, rack)
                if preferred is not None:
                    entry["preferred_read_replica"] = preferred
                    redirected = True
                    continue
            limit = min(p.partition_max_bytes, budget - total)
            if limit <= 0 and total > 0:
                continue
            try:
                # read_committed: nothing at or past the last stable offset.
                if committed:
                    where = plog.read(p.fetch_offset, max(limit, 1), end=lso)
                else:
                    where = plog.read(p.fetch_offset, max(limit, 1))
                if where.size > limit and total > 0:
                    # Only the first partition with data may go past the limits (KIP-74).
                    continue
                data: bytes | FileSlice
                if sendfile and where.size >= SENDFILE_MIN_BYTES:
                    try:
                        data = FileSlice(where.fd, where.position, where.size)
                    except OSError:  # no descriptor to spare for the dup (EMFILE): copy
                        data = where.read()
                elif memory is None or memory.take(where.size, anyway=total == 0):
                    data = where.read()
                else:
                    # Read into memory only what the broker's budget has room for (the
                    # first batch always, KIP-74): the rest is fetched next time.
                    continue
            except OffsetOutOfRange:
                if (topic is not None and topic.mirrored and node.cluster.multi_broker and p.fetch_offset > hwm
                        and ((version >= 11 and current_epoch < 0)
                             or (topic.leader_id is not None and not node.cluster.alive(topic.leader_id)))):
                    # A follower behind an offset the consumer learned at the leader, as
                    # Kafka's ReplicaManager answers it: a client that sent no leader epoch
                    # cannot tell "ask the leader" from "reset", so it gets an empty answer
                    # and asks again; one that sent an epoch gets the error and consults
                    # the leader. While the writer is dead this mirror may lead for reads
                    # and nobody else can have more: the consumer (which read acks=1
                    # records at the writer) gets an empty answer too and waits for the
                    # writer rather than resetting its offset.
                    continue
                entry["error_code"] = errors.OFFSET_OUT_OF_RANGE
                continue
            except CorruptBatch:
                # The stored batch does not match its signed leaf: never serve it.
                entry["error_code"] = errors.KAFKA_STORAGE_ERROR
                continue
            except LogClosed:
                # replaced while this request held it (a leader stepping down to follow a
                # new fork reopens its archive): the client asks Metadata and the successor
                entry["error_code"] = errors.NOT_LEADER_OR_FOLLOWER
                continue
            except StorageError as exc:  # its files could not be opened again (storage/handles.py)
                log.warning("fetch from %s-%d: %s", name, p.partition, exc)
                entry["error_code"] = errors.KAFKA_STORAGE_ERROR
                continue
            except OSError as exc:  # the disk failed to read it (EIO): this partition only
                log.error("reading %s-%d at %d failed: %s", name, p.partition, p.fetch_offset, exc)
                entry["error_code"] = errors.KAFKA_STORAGE_ERROR
                continue
            entry["records"] = data
            total += len(data)
            if committed:
                entry["aborted_transactions"] = [
                    {"producer_id": a.producer_id, "first_offset": a.first_offset}
                    for a in partition.txns.aborted_in(p.fetch_offset, where.end_offset)
                ]
        for entry in parts:
            # As Kafka: a partition refused before the read (unknown, not authorized) has
            # an empty list, one whose read failed has none.
            if entry["error_code"] in (errors.UNKNOWN_TOPIC_OR_PARTITION, errors.TOPIC_AUTHORIZATION_FAILED):
                entry["aborted_transactions"] = []
            elif entry["error_code"] != errors.NONE:
                entry["aborted_transactions"] = None
        responses.append({"topic": name, "partitions": parts})
    return responses, total, redirected


@api(1, "Fetch", (4, 12))
async def fetch(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    session_id = getattr(req, "session_id", 0)
    if session_id != 0:
        return {"throttle_time": 0, "error_code": errors.FETCH_SESSION_ID_NOT_FOUND, "session_id": 0, "responses": []}
    denied = frozenset(t.topic for t in req.topics if not authorize(ctx, Operation.READ, t.topic))
    # KIP-392: only a consumer's fetch (v11+) names a rack; a replica's is never redirected.
    rack = (getattr(req, "rack_id", "") or "") if getattr(req, "replica_id", -1) < 0 else ""
    sendfile = ctx.session is not None and ctx.session.sendfile
    wanted = requested_partitions(req)
    memory = ctx.memory
    responses, total, redirected = _read_all(node, req, ctx.api_version, denied, rack, sendfile, wanted, memory)
    max_wait = req.max_wait.total_seconds()
    # As Kafka: a min_bytes above what one answer may hold would only make it wait longer.
    min_bytes = min(req.min_bytes, node.config.fetch_max_bytes)
    if total < min_bytes and max_wait > 0 and not redirected:
        # (a preferred read replica is told at once, as Kafka does)
        with trio.move_on_after(max_wait):
            while total < min_bytes:
                await node.wait_for_data()
                release(responses)  # read again below: these ranges are not sent
                if memory is not None:
                    memory.give_back()  # (nor these bytes)
                responses, total, redirected = _read_all(node, req, ctx.api_version, denied, rack, sendfile, wanted, memory)
                if redirected:
                    break
    _count(node, responses)
    return {"throttle_time": 0, "error_code": errors.NONE, "session_id": 0, "responses": responses}


def _count(node: Node, responses: list[dict[str, Any]]) -> None:
    """Kafka's BrokerTopicMetrics of the answer: once per fetch, not per long-poll pass."""
    for r in responses:
        topic = node.topics.get(r["topic"])
        stats = topic.stats if topic is not None else node.metrics.other
        for part in r["partitions"]:
            stats.fetch_requests += 1
            stats.bytes_out += len(part["records"])
            if part["error_code"] == errors.KAFKA_STORAGE_ERROR:
                stats.failed_fetch += 1


def _diverging(partition: Any, last_fetched_epoch: int, fetch_offset: int) -> tuple[int, int] | None:
    """Fetch v12+'s divergence check of a partition whose leader epoch moved (a
    quorum-signed partition after a failover): (epoch, end offset) when the fetcher's
    last fetched epoch ended before its fetch offset here, or is older than any epoch
    here ((-1, -1): out of range); None to serve the fetch."""
    if last_fetched_epoch < 0:
        return None
    plog = partition.log
    epoch = leader_epoch(plog)
    if epoch == 0:
        return None
    e, end = end_offset_for(epoch, partition_epochs(partition), plog.high_watermark, last_fetched_epoch)
    if e < 0 or end < 0:
        return (-1, -1)
    if e < last_fetched_epoch or end < fetch_offset:
        return (e, end)
    return None

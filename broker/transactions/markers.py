"""The transaction coordinator's markers: the second phase of a transaction, as Kafka's
TransactionMarkerChannelManager (`_send_markers`), and WriteTxnMarkers (`write_markers`),
which writes markers into the partitions this broker leads.

A marker goes into every partition of the transaction: written here into those this
broker leads, sent (WriteTxnMarkers v1) to the current leader of every other one, retried
with backoff through leader moves and NOT_LEADER answers until each acknowledged; for a
group's partition of ``__consumer_offsets`` it goes to that group's coordinator, which
commits or drops the pending offsets (`GroupCoordinator.complete_transaction`). A
partition whose topic was deleted takes no marker. Every marker carries this
coordinator's epoch (`coordinator_epoch`: 0 alone, in a cluster the revision of the etcd
record it claimed the id's partition at), and a partition refuses one older than the
producer's last (TRANSACTION_COORDINATOR_FENCED): the fenced coordinator stops (`_fenced`).

Holds `MarkerSender`, the part of `TxnCoordinator` (broker/transactions/coordinator.py)
that sends and writes markers; it builds on `TxnShards` (the epoch and the fencing are
the partition's). Imports trio, `broker.transactions.records`, `.codes` and `.shards`;
the forwarding and the node at run time inside functions (they import the node, which
imports us).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from broker.transactions.codes import (
    COORDINATOR_NOT_AVAILABLE,
    INVALID_PRODUCER_EPOCH,
    INVALID_TOPIC_EXCEPTION,
    KAFKA_STORAGE_ERROR,
    NONE,
    NOT_COORDINATOR,
    NOT_LEADER_OR_FOLLOWER,
    REQUEST_TIMED_OUT,
    TRANSACTION_COORDINATOR_FENCED,
    UNKNOWN_TOPIC_OR_PARTITION,
    CoordinatorError,
)
from broker.transactions.records import MarkerType, control_batch
from broker.transactions.shards import OFFSETS_TOPIC, TXN_TOPIC, TxnShards

if TYPE_CHECKING:
    from broker.node import Partition

log = logging.getLogger("hyperkafka.transactions")

MARKER_BACKOFF_MIN_S = 0.05  # markers to other brokers: retried with backoff up to
MARKER_BACKOFF_MAX_S = 1.0
# The coordinator epoch of every marker of a broker alone (it coordinates every partition
# of __transaction_state, with no rival); in a cluster it is the revision of the etcd
# record this broker claimed the transactional id's partition at (`coordinator_epoch`).
ALONE_COORDINATOR_EPOCH = 0


class MarkerSender(TxnShards):
    """Markers of a `TxnCoordinator`: sent for its transactions, written for WriteTxnMarkers."""

    # KIP-890 part 1 where another broker coordinates (set by TxnCoordinator.__init__):
    # (producer id, topic, partition) -> the epoch the coordinator confirmed; a marker
    # into that partition ends it.
    _verified: dict[tuple[int, str, int], int]

    async def _send_markers(
        self,
        producer_id: int,
        epoch: int,
        commit: bool,
        partitions: Sequence[tuple[str, int]],
        tid: str,
    ) -> None:
        """Kafka's TransactionMarkerChannelManager: a marker into every partition of the
        transaction, each acknowledged by its current leader (this broker for those it
        leads; a group's coordinator for a partition of __consumer_offsets), sent again
        with backoff through leader moves, NOT_LEADER and NOT_COORDINATOR answers and
        unreachable brokers until every one acknowledged or `state_write_timeout_ms`
        ran out (CoordinatorError; `run` tries again later). A partition whose topic was
        deleted is dropped. Before each round, the coordinator checks that it still
        serves `tid` (its lease, its view of etcd) at the same epoch. Every marker carries
        the coordinator epoch (`coordinator_epoch`): a partition that took a newer
        coordinator's marker for this producer refuses it (TRANSACTION_COORDINATOR_FENCED,
        writing nothing), so a marker sent after a pause past that check cannot close the
        producer's next transaction; on that answer the coordinator stops, as Kafka's
        TransactionMarkerChannelManager does, and in a cluster gives the partition of
        __transaction_state up (`_fenced`)."""
        coordinator_epoch = self.coordinator_epoch(tid)
        marker = MarkerType.COMMIT if commit else MarkerType.ABORT
        left = dict.fromkeys(partitions)
        backoff = MARKER_BACKOFF_MIN_S
        last_error = ""
        with trio.move_on_after(self.settings.state_write_timeout_ms / 1000):
            while left:
                if (code := self.refusal(tid)) != NONE or self.coordinator_epoch(tid) != coordinator_epoch:
                    raise CoordinatorError(code or NOT_COORDINATOR, f"no longer the coordinator of {tid}: its markers stop")
                remote: dict[int, list[tuple[str, int]]] = {}
                local: list[tuple[tuple[str, int], Partition, int]] = []
                groups: list[tuple[str, int]] = []
                now = self.wall()
                for topic, index in list(left):
                    where = self._marker_destination(topic, index)
                    if where is None:
                        log.info("marker of producer %d for %s-%d dropped: the topic is gone", producer_id, topic, index)
                        del left[(topic, index)]
                    elif where != self.node.config.node_id:
                        remote.setdefault(where, []).append((topic, index))
                    elif topic == OFFSETS_TOPIC:
                        groups.append((topic, index))
                    else:
                        p = self.node.partition(topic, index)
                        if p is None:  # (placed, not here yet)
                            last_error = f"{topic}-{index} is not here yet"
                        elif p.failed:
                            last_error = f"{topic}-{index}: {p.failed}"
                        elif p.topic.mirrored and not p.led:
                            last_error = f"{topic}-{index} is led elsewhere"
                        elif p.txns.coordinator_fenced(producer_id, coordinator_epoch):
                            self._fenced(tid, coordinator_epoch, f"{topic}-{index}")
                        else:
                            local.append(
                                ((topic, index), p, self._admit_marker(p, marker, producer_id, epoch, coordinator_epoch, now))
                            )
                for key, p, base in local:
                    try:
                        await p.wait_durable(base)
                        del left[key]
                    except Exception as exc:
                        last_error = f"{key[0]}-{key[1]}: marker not durable: {exc}"
                for key in groups:
                    self._verified.pop((producer_id, *key), None)
                    code = await self.node.groups.complete_transaction(
                        producer_id, epoch, commit, key[1], coordinator_epoch
                    )
                    if code == NONE:
                        del left[key]
                    elif code == TRANSACTION_COORDINATOR_FENCED:
                        self._fenced(tid, coordinator_epoch, f"{key[0]}-{key[1]}")
                    else:
                        last_error = f"{key[0]}-{key[1]}: the group coordinator answered {code}"
                for broker, keys in remote.items():
                    acked, error, fenced = await self._markers_to(
                        broker, producer_id, epoch, commit, keys, coordinator_epoch
                    )
                    for key in acked:
                        left.pop(key, None)
                    if fenced:
                        self._fenced(tid, coordinator_epoch, f"{fenced[0][0]}-{fenced[0][1]} (broker {broker})")
                    if error:
                        last_error = error
                if left:
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, MARKER_BACKOFF_MAX_S)
        if left:
            raise CoordinatorError(
                REQUEST_TIMED_OUT,
                f"markers not acknowledged by {', '.join(f'{t}-{i}' for t, i in left)} in time ({last_error})",
            )

    def coordinator_epoch(self, tid: str) -> int:
        """The coordinator epoch this broker's markers for `tid` carry: alone a constant
        (`ALONE_COORDINATOR_EPOCH`); in a cluster the revision of the etcd record it
        claimed the id's partition of __transaction_state at (NOT_COORDINATOR when it
        does not serve it). etcd revisions only grow, so a later coordinator's is larger."""
        if self.sharded is None:
            return ALONE_COORDINATOR_EPOCH
        (revision,) = self._fence([tid]).values()
        if revision > 0x7FFFFFFF:  # (the field is an int32; etcd's revision an int64)
            raise CoordinatorError(COORDINATOR_NOT_AVAILABLE, f"coordinator epoch {revision} does not fit a marker")
        return revision

    def _fenced(self, tid: str, coordinator_epoch: int, where: str) -> None:
        """A partition refused our marker for `tid`: a coordinator of a newer epoch wrote
        one for this producer there. Stop completing (Kafka's TransactionMarkerChannelManager
        cancels the transaction's markers); in a cluster, give up the id's partition of
        __transaction_state if still held at that epoch (the newer coordinator serves it;
        should etcd still name us, `follow_shards` takes it over again at a new epoch).
        Alone there is no rival: the epoch came from an admin's WriteTxnMarkers, and `run`
        retries the completion."""
        log.warning("transaction %s: marker into %s refused: coordinator epoch %d is fenced", tid, where, coordinator_epoch)
        if self.sharded is not None:
            p = self.shard_of(tid)
            if self.shards.get(p) == coordinator_epoch:
                self.resign([p])
        raise CoordinatorError(
            TRANSACTION_COORDINATOR_FENCED, f"a newer transaction coordinator wrote markers of {tid} into {where}"
        )

    def _marker_destination(self, topic: str, index: int) -> int | None:
        """The broker that takes the marker for `topic`-`index` now: a partition of
        __consumer_offsets goes to its group coordinator, a data partition to its leader
        (the writer placement names, or the leader a failover recorded). None: the topic
        was deleted (placement no longer knows it), or no coordinator is named now
        (-1: ask again)."""
        cluster = self.node.cluster
        if topic == OFFSETS_TOPIC:
            owner = cluster.coordinator(OFFSETS_TOPIC, index)
            return -1 if owner is None else owner
        writer = cluster.placed_writer(topic)
        if writer is None or (writer == self.node.config.node_id and self.node.partition(topic, index) is None):
            return None
        leader = cluster.placed_leader(topic, index)
        return writer if leader is None else leader

    async def _markers_to(
        self,
        broker: int,
        producer_id: int,
        epoch: int,
        commit: bool,
        keys: Sequence[tuple[str, int]],
        coordinator_epoch: int,
    ) -> tuple[list[tuple[str, int]], str, list[tuple[str, int]]]:
        """One WriteTxnMarkers v1 to `broker` for `keys`: the partitions it acknowledged,
        why the others were not (empty when all were), and those that refused our
        coordinator epoch (TRANSACTION_COORDINATOR_FENCED)."""
        from broker.forwarding import forward_to  # (it imports the node, which imports us)
        from broker.node import TopicError

        if broker < 0 or not self.node.cluster.alive(broker):
            return [], f"broker {broker} is not alive", []
        by_topic: dict[str, list[int]] = {}
        for topic, index in keys:
            by_topic.setdefault(topic, []).append(index)
        body = {
            "markers": [
                {
                    "producer_id": producer_id,
                    "producer_epoch": epoch,
                    "transaction_result": commit,
                    "topics": [{"name": t, "partition_indexes": ps} for t, ps in by_topic.items()],
                    "coordinator_epoch": coordinator_epoch,
                }
            ]
        }
        try:
            resp = await forward_to(self.node.cluster, broker, 27, 1, "write_txn_markers", body)
        except TopicError as exc:
            return [], exc.message, []
        acked: list[tuple[str, int]] = []
        fenced: list[tuple[str, int]] = []
        errors: list[str] = []
        for m in resp.markers:
            for t in m.topics:
                for part in t.partitions:
                    if part.error_code in (NONE,):
                        acked.append((t.name, part.partition_index))
                    elif part.error_code == TRANSACTION_COORDINATOR_FENCED:
                        fenced.append((t.name, part.partition_index))
                    elif part.error_code == UNKNOWN_TOPIC_OR_PARTITION and self._marker_destination(t.name, part.partition_index) is None:
                        acked.append((t.name, part.partition_index))  # deleted meanwhile: dropped
                    else:
                        errors.append(f"{t.name}-{part.partition_index}: error {part.error_code} from broker {broker}")
        return acked, "; ".join(errors), fenced

    def _admit_marker(
        self, p: Partition, marker: MarkerType, producer_id: int, epoch: int, coordinator_epoch: int, now: int
    ) -> int:
        """Queue a marker of `producer_id`'s transaction into `p` (closing its open
        transaction there; the caller checked `coordinator_epoch` is not fenced there) and
        fence older producer epochs; its offset, to await durable."""
        self._verified.pop((producer_id, p.topic.name, p.index), None)
        base, _ = p.admit(control_batch(marker, producer_id, epoch, coordinator_epoch, now), 0)
        p.txns.on_marker(producer_id, marker, base, coordinator_epoch)
        p.producers.fence(producer_id, epoch)
        self.node.mark_dirty(p)
        return base

    async def write_markers(
        self,
        producer_id: int,
        producer_epoch: int,
        commit: bool,
        partitions: Sequence[tuple[str, int]],
        coordinator_epoch: int,
    ) -> dict[tuple[str, int], int]:
        """WriteTxnMarkers (`kafka-transactions abort`, Kafka's Admin.abortTransaction): a
        marker written into each partition as Kafka's broker writes one its coordinator
        sends, which closes a transaction there that no coordinator will (a hanging one);
        where the producer has no open transaction the answer is success and nothing is
        written, unless the coordinator epoch is newer than the producer's there (then a
        marker that closes nothing records it, as Kafka's).
        Also what a transaction coordinator on another broker sends (`_send_markers`) for
        the partitions this broker leads, and for a partition of __consumer_offsets whose
        groups it coordinates (their pending transactional offsets are committed or
        dropped: `GroupCoordinator.complete_transaction`). The error code of each
        partition: an epoch older than the producer's at the partition is refused
        INVALID_PRODUCER_EPOCH; a `coordinator_epoch` older than that of the producer's
        last marker there TRANSACTION_COORDINATOR_FENCED (Kafka's leaders: a stale
        coordinator's marker), writing nothing; a partition led elsewhere
        NOT_LEADER_OR_FOLLOWER; __transaction_state takes no marker
        (INVALID_TOPIC_EXCEPTION). `kafka-transactions abort --start-offset` sends the
        coordinator epoch DescribeProducers reports for the producer (0 when none), so it
        is never fenced by the markers already there."""
        codes: dict[tuple[str, int], int] = {}
        waits: list[tuple[tuple[str, int], Partition, int]] = []
        marker = MarkerType.COMMIT if commit else MarkerType.ABORT
        now = self.wall()
        for topic, index in partitions:
            if topic == OFFSETS_TOPIC:
                self._verified.pop((producer_id, topic, index), None)
                codes[(topic, index)] = await self.node.groups.complete_transaction(
                    producer_id, producer_epoch, commit, index, coordinator_epoch
                )
                continue
            p = self.node.partition(topic, index)
            if p is None:
                codes[(topic, index)] = UNKNOWN_TOPIC_OR_PARTITION
                continue
            if topic == TXN_TOPIC:
                codes[(topic, index)] = INVALID_TOPIC_EXCEPTION
                continue
            if p.topic.mirrored and not p.led:
                codes[(topic, index)] = NOT_LEADER_OR_FOLLOWER
                continue
            if p.failed:
                codes[(topic, index)] = p.failed_code
                continue
            entry = p.producers.entry(producer_id)
            if entry is not None and producer_epoch < entry.epoch:
                codes[(topic, index)] = INVALID_PRODUCER_EPOCH
                continue
            if p.txns.coordinator_fenced(producer_id, coordinator_epoch):
                codes[(topic, index)] = TRANSACTION_COORDINATOR_FENCED
                continue
            self._verified.pop((producer_id, topic, index), None)
            if producer_id not in p.txns.ongoing and coordinator_epoch <= p.txns.coordinator_epochs.get(producer_id, -1):
                # Nothing of this producer's is open here (never was, or a retried marker
                # already closed it) and its coordinator epoch is known: Kafka would still
                # append a marker that closes nothing; we sign nothing an outside request
                # asks for that changes nothing. A newer coordinator epoch is written (it
                # closes nothing) so that it fences the older coordinator's markers, a
                # restart included.
                codes[(topic, index)] = NONE
                continue
            log.debug(
                "WriteTxnMarkers: %s marker of producer %d epoch %d into %s-%d",
                marker.name, producer_id, producer_epoch, topic, index,
            )
            waits.append(
                ((topic, index), p, self._admit_marker(p, marker, producer_id, producer_epoch, coordinator_epoch, now))
            )
        with trio.move_on_after(self.settings.state_write_timeout_ms / 1000):
            for key, p, base in waits:
                try:
                    await p.wait_durable(base)
                    codes[key] = NONE
                except Exception as exc:
                    log.warning("WriteTxnMarkers: marker into %s-%d not durable: %s", *key, exc)
                    codes[key] = KAFKA_STORAGE_ERROR
        return {key: codes.get(key, REQUEST_TIMED_OUT) for key in partitions}  # in request order

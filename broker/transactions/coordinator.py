"""The transaction coordinator: transactional ids, their producer ids and epochs, and the
two-phase end of every transaction, persisted in the signed `__transaction_state` archive.

Theory of operation (Kafka's TransactionCoordinator and TransactionStateManager):

- InitProducerId(transactional id) gives a producer id the first time, and bumps the
  epoch every time after, which fences any older producer with that id (its requests
  then carry an old epoch: PRODUCER_FENCED, and its batches INVALID_PRODUCER_EPOCH at
  the partitions). A transaction still open is aborted first (with the bumped epoch) and
  the caller told CONCURRENT_TRANSACTIONS, so it retries once the abort is complete.
- AddPartitionsToTxn / AddOffsetsToTxn put partitions (the group's offsets partition for
  the latter) in the transaction: state Ongoing, the start time set at the first one.
  Produce accepts a transactional batch only for a partition of an Ongoing transaction of
  that producer id and epoch (KIP-890 part 1's verification: INVALID_TXN_STATE else).
- TxnOffsetCommit goes to the group's coordinator, which keeps the offsets pending in its
  own archive (broker/groups/coordinator.py `txn_offset_commit`), not yet visible; this
  coordinator only checks that the transaction holds the group's partition of
  ``__consumer_offsets`` (`verify_offsets`).
- EndTxn writes PrepareCommit or PrepareAbort; once a signed head covers it the outcome
  is decided and the answer given. Completing follows, as Kafka's
  TransactionMarkerChannelManager: a marker into every partition of the transaction,
  written here into those this broker leads and sent (WriteTxnMarkers v1) to the
  current leader of every other one, retried with backoff through leader moves and
  NOT_LEADER answers until each acknowledged; for a group's partition of
  ``__consumer_offsets`` the marker goes to that group's coordinator, which commits or
  drops the pending offsets (`GroupCoordinator.complete_transaction`). A partition whose
  topic was deleted takes no marker (dropped, as Kafka does). Every marker carries this
  coordinator's epoch (`coordinator_epoch`), and a partition refuses one older than the
  producer's last (TRANSACTION_COORDINATOR_FENCED): the fenced coordinator stops
  (`_fenced`). Only then CompleteCommit
  / CompleteAbort. A completion that fails (markers not all acknowledged in
  `state_write_timeout_ms`) is retried by `run`.
- A transaction Ongoing for longer than its timeout is aborted by `run` (every
  transaction.abort.timed.out.transaction.cleanup.interval.ms) with a bumped epoch, as
  Kafka does, so its producer is fenced.
- Every state change is one batch appended to the archive and awaited durable before it
  is acted on; while one is in flight the transactional id answers CONCURRENT_TRANSACTIONS.

Restart: replaying the archive restores every transactional id's last state. Prepare*
states are completed at once (their markers again: a marker without an open transaction
at a partition changes nothing); Ongoing ones time out by their start time and timeout
and are aborted, so a transaction is never half visible after a crash.

Where the coordinator lives, and how a broker takes over or gives up the transactional
ids of a partition of `__transaction_state` in a cluster: broker/transactions/shards.py.
The markers of the second phase, and WriteTxnMarkers: broker/transactions/markers.py.
`TxnCoordinator` is assembled from both (`MarkerSender` over `TxnShards`); this module
holds the state machine (requests, the archive, completion, timeouts and expiry).

Producer ids: a new producer id comes from this broker's own range (`Node.allocate_producer_id`:
``broker id << 40`` in a cluster, `Cluster.producer_id_base`), so ids stay unique across
brokers with no etcd allocation; a transactional id keeps its producer id when it moves
to another coordinator (the id is in its adopted state).

KIP-890 part 1 where another broker coordinates the producer's transactional id: a
partition leader asks the coordinator before it accepts a transactional batch, and a
group coordinator before it keeps transactional offsets (`verify_produce`, cached per
producer id, epoch and partition until that partition's marker).

Wall-clock times (`self.wall`) are replaceable for tests; timers use trio's clock only
for sleeping.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio

from broker.cluster import Cluster, signed_blocks
from broker.cluster.etcd import EtcdError
from broker.cluster.shards import TAKEOVER_ERRORS, follow_shards, place_shards
from broker.groups.offsets import read_records
from broker.transactions.codes import (
    CONCURRENT_TRANSACTIONS,
    COORDINATOR_LOAD_IN_PROGRESS,
    COORDINATOR_NOT_AVAILABLE,
    INVALID_PRODUCER_EPOCH,
    INVALID_PRODUCER_ID_MAPPING,
    INVALID_REQUEST,
    INVALID_TRANSACTION_TIMEOUT,
    INVALID_TXN_STATE,
    NONE,
    NOT_COORDINATOR,
    NOT_ENOUGH_REPLICAS,
    OPERATION_NOT_ATTEMPTED,
    PRODUCER_FENCED,
    REQUEST_TIMED_OUT,
    TRANSACTION_COORDINATOR_FENCED,
    TRANSACTIONAL_ID_NOT_FOUND,
    CoordinatorError,
)
from broker.transactions.markers import MarkerSender
from broker.transactions.records import (
    KEY_OFFSETS,
    RecordFormatError,
    Status,
    TxnOffset,
    TxnValue,
    build_state_batch,
    decode_key,
    decode_offsets,
    decode_value,
    encode_offsets,
    encode_value,
    offsets_key,
    state_key,
)
from broker.transactions.settings import TxnSettings
from broker.transactions.shards import (
    OFFSETS_TOPIC,
    TXN_TOPIC,
    TXN_TOPIC_CONFIGS,
    coordinator_node,
)

if TYPE_CHECKING:
    from broker.node import Node, Partition

# Names other modules import from here (the handlers, the node, tests).
__all__ = [
    "COORDINATOR_LOAD_IN_PROGRESS",
    "NOT_COORDINATOR",
    "OFFSETS_TOPIC",
    "OPERATION_NOT_ATTEMPTED",
    "PRODUCER_FENCED",
    "REQUEST_TIMED_OUT",
    "TRANSACTION_COORDINATOR_FENCED",
    "TXN_TOPIC",
    "CoordinatorError",
    "Txn",
    "TxnCoordinator",
    "coordinator_node",
]

log = logging.getLogger("hyperkafka.transactions")

MAX_EPOCH = 32767


@dataclass
class Txn:
    transactional_id: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    status: Status = Status.EMPTY
    partitions: dict[tuple[str, int], None] = field(default_factory=dict)  # ordered set
    update_ms: int = -1
    start_ms: int = -1
    pending: bool = False  # a state write is in flight
    pending_status: Status | None = None  # the state it moves to
    offsets: dict[tuple[str, str, int], TxnOffset] = field(default_factory=dict)

    def value(self) -> TxnValue:
        return TxnValue(
            self.producer_id,
            self.producer_epoch,
            self.timeout_ms,
            self.status,
            tuple(self.partitions),
            self.update_ms,
            self.start_ms,
        )


def wall_ms() -> int:
    return math.floor(time.time() * 1000)


def _check_id(tid: str) -> None:
    if not tid:
        raise CoordinatorError(INVALID_REQUEST, "The transactional id must not be empty")


class TxnCoordinator(MarkerSender):
    """Create with the node (replays the archive if it exists); run `run` in a nursery."""

    def __init__(self, node: Node, settings: TxnSettings | None = None) -> None:
        self.node = node
        self.settings = settings or TxnSettings.from_properties(node.config.static)
        self.wall: Callable[[], int] = wall_ms
        self.txns: dict[str, Txn] = {}
        self.by_pid: dict[int, str] = {}
        self._partition: Partition | None = None
        self._poke = trio.Event()
        # Transactional ids whose second phase a task is running: EndTxn's own call and
        # `sweep` must never both run it (markers twice, and the later Complete* written
        # over the producer's next transaction).
        self._completing: set[str] = set()
        # The etcd view whose partitions of __transaction_state this coordinator takes over
        # and serves (None alone: every transactional id is served from the start).
        self.sharded: Cluster | None = node.cluster if isinstance(node.cluster, Cluster) else None
        # Cluster mode: partitions of __transaction_state loaded and served here -> the
        # revision of their etcd record we claimed them at (every ack is fenced by it).
        self.shards: dict[int, int] = {}
        self.takeovers = 0
        # KIP-890 part 1 where another broker coordinates: (producer id, topic, partition)
        # -> the epoch the coordinator confirmed an Ongoing transaction holding it for.
        self._verified: dict[tuple[int, str, int], int] = {}
        if TXN_TOPIC in node.topics:
            self._partition = node.topics[TXN_TOPIC].partitions[0]
        if self.sharded is not None:
            # Every broker's archive exists from the start, so that every peer copies it
            # and a takeover can tell "caught up" from "nothing to copy".
            self._archive()
        elif self._partition is not None:
            self._replay()

    # ------------------------------------------------------------------ the archive

    def _archive(self) -> Partition:
        if self._partition is None:
            topic = self.node.create_topic(TXN_TOPIC, 1, -1, TXN_TOPIC_CONFIGS)
            assert topic is not None
            self._partition = topic.partitions[0]
        return self._partition

    def _replay(self, partitions: set[int] | None = None) -> None:
        """Load the archive's transactional ids (only those of these partitions of
        __transaction_state, when given: cluster mode's takeover)."""
        assert self._partition is not None
        offsets: dict[str, tuple[int, int, list[TxnOffset]]] = {}
        for _, _, key, value in read_records(self._partition.log, name=TXN_TOPIC):
            try:
                kind, tid = decode_key(key)
                if partitions is not None and self.shard_of(tid) not in partitions:
                    continue
                if kind == KEY_OFFSETS:
                    if value is None:
                        offsets.pop(tid, None)
                    else:
                        offsets[tid] = decode_offsets(value)
                    continue
                if value is None:
                    self._forget(tid)
                    continue
                v = decode_value(value)
            except RecordFormatError as exc:
                log.warning("%s: skipping a record that does not parse: %s", TXN_TOPIC, exc)
                continue
            self._forget(tid)
            txn = Txn(
                tid,
                v.producer_id,
                v.producer_epoch,
                v.timeout_ms,
                v.status,
                dict.fromkeys(v.partitions),
                v.update_ms,
                v.start_ms,
            )
            self.txns[tid] = txn
            self.by_pid[v.producer_id] = tid
        for tid, (pid, epoch, entries) in offsets.items():
            prepared = self.txns.get(tid)
            if (
                prepared is not None
                and prepared.status is Status.PREPARE_COMMIT
                and (prepared.producer_id, prepared.producer_epoch) == (pid, epoch)
            ):
                prepared.offsets = {(o.group, o.topic, o.partition): o for o in entries}
        log.info("%s replayed: %d transactional ids", TXN_TOPIC, len(self.txns))

    def _forget(self, tid: str) -> None:
        old = self.txns.pop(tid, None)
        if old is not None and self.by_pid.get(old.producer_id) == tid:
            del self.by_pid[old.producer_id]

    async def _persist(self, txn: Txn, extra: Sequence[tuple[bytes, bytes | None]] = ()) -> None:
        """Append the transaction's state (and `extra` records) as one batch and wait until a
        signed head covers it. Raises CoordinatorError on failure."""
        await self._append(
            [(state_key(txn.transactional_id), encode_value(txn.value())), *extra], [txn.transactional_id]
        )

    async def _append(self, records: Sequence[tuple[bytes, bytes | None]], tids: Iterable[str] = ()) -> None:
        """Append `records` to the archive as one batch and wait until a signed head covers
        it; in cluster mode also until the in-sync peers hold it (Kafka writes
        __transaction_state with acks=-1), and then only if etcd confirms that we still
        coordinate the partitions of `tids` at the revisions we claimed them at (else
        NOT_COORDINATOR, and they are given up). Raises CoordinatorError on failure."""
        fence = self._fence(tids)
        partition = self._archive()
        if partition.failed:
            raise CoordinatorError(COORDINATOR_NOT_AVAILABLE, partition.failed)
        try:
            _, last = partition.log.append(build_state_batch(records, self.wall()))
        except OSError as exc:
            raise CoordinatorError(
                COORDINATOR_NOT_AVAILABLE, f"cannot write {TXN_TOPIC}: {exc}"
            ) from exc
        self.node.mark_dirty(partition)
        with trio.move_on_after(self.settings.state_write_timeout_ms / 1000) as scope:
            try:
                await partition.wait_durable(last)
            except Exception as exc:
                raise CoordinatorError(
                    COORDINATOR_NOT_AVAILABLE, f"{TXN_TOPIC} not durable: {exc}"
                ) from exc
        if scope.cancelled_caught:
            raise CoordinatorError(REQUEST_TIMED_OUT, f"{TXN_TOPIC} write not durable in time")
        cluster = self.sharded
        if cluster is None:
            return
        plog = partition.log
        with trio.move_on_after(self.settings.state_write_timeout_ms / 1000) as scope:
            replicated = await cluster.wait_replicated(
                plog.key, signed_blocks(plog), partition.topic.min_insync_replicas
            )
        if scope.cancelled_caught:
            raise CoordinatorError(REQUEST_TIMED_OUT, f"{TXN_TOPIC} write not replicated in time")
        if not replicated:
            raise CoordinatorError(COORDINATOR_NOT_AVAILABLE, f"{TXN_TOPIC}: too few in-sync replicas")
        try:
            still = await cluster.check_fence(TXN_TOPIC, fence)
        except EtcdError as exc:
            raise CoordinatorError(
                COORDINATOR_NOT_AVAILABLE, f"cannot check the coordinator's epoch in etcd: {exc}"
            ) from exc
        if not still:
            self.resign([p for p, rev in fence.items() if self.shards.get(p) == rev])
            raise CoordinatorError(NOT_COORDINATOR, "This broker no longer coordinates this transactional id")

    async def _transition(
        self,
        txn: Txn,
        change: Callable[[Txn], None],
        extra: Sequence[tuple[bytes, bytes | None]] = (),
    ) -> None:
        """Apply `change` to a copy, persist it, then install it: memory never runs ahead of
        the archive. The id answers CONCURRENT_TRANSACTIONS meanwhile."""
        # (offsets are shared, not copied: TxnOffsetCommit may add to them while an
        # AddPartitionsToTxn is written; a change that drops them assigns a new dict)
        new = Txn(
            txn.transactional_id,
            txn.producer_id,
            txn.producer_epoch,
            txn.timeout_ms,
            txn.status,
            dict(txn.partitions),
            txn.update_ms,
            txn.start_ms,
            False,
            None,
            txn.offsets,
        )
        change(new)
        new.update_ms = self.wall()
        txn.pending, txn.pending_status = True, new.status
        try:
            await self._persist(new, extra)
        finally:
            txn.pending, txn.pending_status = False, None
        if self.by_pid.get(txn.producer_id) == txn.transactional_id:
            del self.by_pid[txn.producer_id]
        for name in (
            "producer_id",
            "producer_epoch",
            "timeout_ms",
            "status",
            "partitions",
            "update_ms",
            "start_ms",
            "offsets",
        ):
            setattr(txn, name, getattr(new, name))
        self.by_pid[txn.producer_id] = txn.transactional_id

    # ------------------------------------------------------------------ requests

    def _check(self, tid: str) -> None:
        _check_id(tid)
        if coordinator_node(self.node, tid) != self.node.config.node_id:
            # (another broker's partition of __transaction_state, or none placed)
            raise CoordinatorError(
                NOT_COORDINATOR, "This broker does not coordinate this transactional id"
            )
        code = self.refusal(tid)
        if code == COORDINATOR_LOAD_IN_PROGRESS:
            raise CoordinatorError(code, "This broker is loading this transactional id's partition")
        if code != NONE:
            raise CoordinatorError(code, "This broker does not coordinate this transactional id")

    def _new_producer_id(self) -> int:
        try:
            return self.node.allocate_producer_id()
        except OSError as exc:
            raise CoordinatorError(
                COORDINATOR_NOT_AVAILABLE, f"cannot reserve producer ids: {exc}"
            ) from exc

    async def init_producer_id(
        self, tid: str, timeout_ms: int, producer_id: int = -1, producer_epoch: int = -1
    ) -> tuple[int, int]:
        """(producer id, epoch) or CoordinatorError."""
        self._check(tid)
        if not 0 < timeout_ms <= self.settings.max_timeout_ms:
            raise CoordinatorError(
                INVALID_TRANSACTION_TIMEOUT,
                f"The transaction timeout {timeout_ms} ms is outside (0, transaction.max.timeout.ms="
                f"{self.settings.max_timeout_ms}]",
            )
        txn = self.txns.get(tid)
        if txn is None:
            txn = Txn(tid, self._new_producer_id(), -1, timeout_ms)
            self.txns[tid] = txn

            def first(t: Txn) -> None:
                t.producer_epoch, t.status = 0, Status.EMPTY

            try:
                await self._transition(txn, first)
            except CoordinatorError:
                if txn.producer_epoch < 0:
                    self.txns.pop(tid, None)
                raise
            return txn.producer_id, txn.producer_epoch
        if txn.pending:
            raise CoordinatorError(
                CONCURRENT_TRANSACTIONS, "A state change of this transactional id is in flight"
            )
        if producer_id >= 0 and (producer_id, producer_epoch) != (
            txn.producer_id,
            txn.producer_epoch,
        ):
            # KIP-360: a producer that names its id and epoch must be the current one.
            raise CoordinatorError(
                PRODUCER_FENCED, "There is a newer producer with the same transactional id"
            )
        if txn.status in (Status.PREPARE_COMMIT, Status.PREPARE_ABORT):
            raise CoordinatorError(
                CONCURRENT_TRANSACTIONS, "The previous transaction is being completed"
            )
        if txn.status is Status.ONGOING:
            # Fence the old producer: abort its transaction with a bumped epoch, and let the
            # caller retry once the abort is complete (Kafka's prepareAbortOrFenceTransaction).
            await self._abort(txn, bump=True)
            raise CoordinatorError(
                CONCURRENT_TRANSACTIONS, "The open transaction of the previous producer was aborted"
            )

        def bump(t: Txn) -> None:
            if t.producer_epoch >= MAX_EPOCH - 1:
                t.producer_id, t.producer_epoch = self._new_producer_id(), 0
            else:
                t.producer_epoch += 1
            t.timeout_ms, t.status, t.partitions, t.start_ms, t.offsets = (
                timeout_ms,
                Status.EMPTY,
                {},
                -1,
                {},
            )

        await self._transition(txn, bump)
        return txn.producer_id, txn.producer_epoch

    def _producer(self, tid: str, producer_id: int, producer_epoch: int) -> Txn:
        """The transactional id's state, when the caller is its current producer (the id
        and epoch checks every request of an open transaction starts with)."""
        txn = self.txns.get(tid)
        if txn is None or txn.producer_id != producer_id:
            raise CoordinatorError(
                INVALID_PRODUCER_ID_MAPPING,
                "The producer id does not belong to this transactional id",
            )
        if producer_epoch != txn.producer_epoch:
            raise CoordinatorError(
                PRODUCER_FENCED, "There is a newer producer with the same transactional id"
            )
        return txn

    def _current(self, tid: str, producer_id: int, producer_epoch: int) -> Txn:
        txn = self._producer(tid, producer_id, producer_epoch)
        if txn.pending or txn.status in (Status.PREPARE_COMMIT, Status.PREPARE_ABORT):
            raise CoordinatorError(
                CONCURRENT_TRANSACTIONS, "The previous transaction is being completed"
            )
        return txn

    async def add_partitions(
        self, tid: str, producer_id: int, producer_epoch: int, partitions: Iterable[tuple[str, int]]
    ) -> None:
        self._check(tid)
        txn = self._current(tid, producer_id, producer_epoch)
        if txn.status is Status.PREPARE_EPOCH_FENCE or txn.status is Status.DEAD:
            raise CoordinatorError(INVALID_TXN_STATE, f"The transaction is {txn.status.kafka_name}")
        wanted = list(partitions)
        if txn.status is Status.ONGOING and all(p in txn.partitions for p in wanted):
            return

        def add(t: Txn) -> None:
            if t.status is not Status.ONGOING:  # a new transaction: the last one's are done
                t.status, t.start_ms, t.partitions, t.offsets = Status.ONGOING, self.wall(), {}, {}
            t.partitions.update(dict.fromkeys(wanted))

        await self._transition(txn, add)
        self._poke.set()

    def verify_offsets(self, tid: str, producer_id: int, producer_epoch: int, partition: tuple[str, int]) -> None:
        """TxnOffsetCommit, checked here when this broker coordinates `tid`: the producer
        is current and its ongoing transaction holds the group's partition of
        __consumer_offsets (AddOffsetsToTxn). CoordinatorError else."""
        self._check(tid)
        txn = self._producer(tid, producer_id, producer_epoch)
        if txn.pending and txn.pending_status is not Status.ONGOING:
            raise CoordinatorError(CONCURRENT_TRANSACTIONS, "The transaction is being completed")
        if txn.status is not Status.ONGOING or partition not in txn.partitions:
            raise CoordinatorError(
                INVALID_TXN_STATE,
                "The group's offsets were not added to an ongoing transaction (AddOffsetsToTxn)",
            )

    async def end_txn(self, tid: str, producer_id: int, producer_epoch: int, commit: bool) -> None:
        self._check(tid)
        txn = self._producer(tid, producer_id, producer_epoch)
        if txn.pending:
            raise CoordinatorError(
                CONCURRENT_TRANSACTIONS, "A state change of this transactional id is in flight"
            )
        done, prepared = (
            (Status.COMPLETE_COMMIT, Status.PREPARE_COMMIT)
            if commit
            else (Status.COMPLETE_ABORT, Status.PREPARE_ABORT)
        )
        if txn.status is done:
            return  # a retry of an EndTxn already complete
        if txn.status is prepared:
            raise CoordinatorError(CONCURRENT_TRANSACTIONS, "The transaction is being completed")
        if txn.status is not Status.ONGOING:
            raise CoordinatorError(
                INVALID_TXN_STATE,
                f"Cannot {'commit' if commit else 'abort'} a transaction in state {txn.status.kafka_name}",
            )
        if commit:
            await self._prepare(txn, Status.PREPARE_COMMIT)
            await self._complete_logged(txn)
        else:
            await self._abort(txn, bump=False)

    async def _prepare(self, txn: Txn, status: Status, *, bump: bool = False) -> None:
        extra: list[tuple[bytes, bytes | None]] = []
        if status is Status.PREPARE_COMMIT and txn.offsets:
            extra.append(
                (
                    offsets_key(txn.transactional_id),
                    encode_offsets(txn.producer_id, txn.producer_epoch, list(txn.offsets.values())),
                )
            )

        def prepare(t: Txn) -> None:
            if bump:
                t.producer_epoch += 1
            t.status = status
            if status is Status.PREPARE_ABORT:
                t.offsets = {}

        await self._transition(txn, prepare, extra)

    async def _abort(self, txn: Txn, *, bump: bool) -> None:
        if bump and txn.producer_epoch >= MAX_EPOCH - 1:
            bump = False  # the next InitProducerId moves to a new producer id instead
        await self._prepare(txn, Status.PREPARE_ABORT, bump=bump)
        await self._complete_logged(txn)

    async def _complete_logged(self, txn: Txn) -> None:
        try:
            await self.complete(txn)
        except CoordinatorError as exc:
            # Decided and durable: `run` finishes it; the producer need not wait.
            log.warning("transaction %s: completion deferred: %s", txn.transactional_id, exc)
            self._poke.set()

    async def complete(self, txn: Txn) -> None:
        """Second phase of a prepared transaction: markers, offsets, then Complete*. One
        task at a time per transactional id: a call while another runs returns at once
        (that one finishes it, or leaves it prepared for `run` to retry)."""
        if txn.transactional_id in self._completing:
            return
        self._completing.add(txn.transactional_id)
        try:
            await self._complete(txn)
        finally:
            self._completing.discard(txn.transactional_id)

    async def _complete(self, txn: Txn) -> None:
        prepared = txn.status
        commit = prepared is Status.PREPARE_COMMIT
        assert commit or prepared is Status.PREPARE_ABORT
        await self._send_markers(
            txn.producer_id, txn.producer_epoch, commit, list(txn.partitions), txn.transactional_id
        )
        if commit and txn.offsets:
            by_group: dict[str, list[tuple[str, int, int, int, str]]] = {}
            for o in txn.offsets.values():
                by_group.setdefault(o.group, []).append(
                    (o.topic, o.partition, o.offset, o.leader_epoch, o.metadata)
                )
            for group, entries in by_group.items():
                code = await self.node.groups.commit_transactional(group, entries)
                if code != NONE:
                    raise CoordinatorError(code, f"offsets of group {group} not committed")
        extra: list[tuple[bytes, bytes | None]] = (
            [(offsets_key(txn.transactional_id), None)] if commit and txn.offsets else []
        )

        def finish(t: Txn) -> None:
            t.status = Status.COMPLETE_COMMIT if commit else Status.COMPLETE_ABORT
            t.offsets = {}

        if txn.status is not prepared:
            # Unreachable while requests get CONCURRENT_TRANSACTIONS in a prepared state and
            # `_completing` keeps this the only completion; never write Complete* over
            # whatever the id moved on to.
            log.error("transaction %s moved to %s while completing", txn.transactional_id, txn.status)
            return
        await self._transition(txn, finish, extra)

    def pending_offsets(self, group: str) -> set[tuple[str, int]]:
        """The (topic, partition)s of `group` with transactional offsets of an archive
        written before the group coordinator kept them (a PrepareCommit replayed with its
        offsets record) not yet committed: OffsetFetch with require_stable answers
        UNSTABLE_OFFSET_COMMIT for them, as for the group coordinator's own."""
        return {
            (topic, partition)
            for txn in self.txns.values()
            for g, topic, partition in txn.offsets
            if g == group
        }

    # ------------------------------------------------------------------ produce checks

    def describe_refusal(self, tid: str) -> int:
        """DescribeTransactions for `tid` here: NONE where this broker serves it, else
        NOT_COORDINATOR or COORDINATOR_LOAD_IN_PROGRESS, as Kafka answers."""
        if coordinator_node(self.node, tid) != self.node.config.node_id:
            return NOT_COORDINATOR
        return self.refusal(tid)

    async def verify_produce(
        self, tid: str, batches: Sequence[tuple[str, int, int, int]]
    ) -> dict[tuple[str, int], tuple[int, str]]:
        """KIP-890 part 1 at a partition leader that does not coordinate `tid` (cluster
        mode): the transactional batches ((topic, partition, producer id, epoch) each)
        are accepted only for partitions the coordinator has in the producer's Ongoing
        transaction. The coordinator is asked (a DescribeTransactions forwarded to it:
        the facts Kafka's brokers ask with AddPartitionsToTxn v4 verify_only, a version
        not served here) once per (producer id, epoch, partition); the answer is cached
        until that partition's marker (`_admit_marker`, `write_markers`). The refusals,
        by partition (`check_produce` accepts the rest)."""
        me = self.node.config.node_id
        unverified = (NOT_ENOUGH_REPLICAS, "The transaction coordinator cannot verify the transaction now")
        if self.sharded is None:
            return {}
        if coordinator_node(self.node, tid) == me:
            # checked here by `check_produce`, once loaded (retriable meanwhile)
            return {} if self.refusal(tid) == NONE else {(t, i): unverified for t, i, _, _ in batches}
        need = [(t, i, pid, ep) for t, i, pid, ep in batches if self._verified.get((pid, t, i)) != ep]
        if not need:
            return {}
        from broker.forwarding import forward_to  # (it imports the node, which imports us)
        from broker.node import TopicError

        where = coordinator_node(self.node, tid)
        if where is None:
            return {(t, i): unverified for t, i, _, _ in need}
        try:
            resp = await forward_to(self.node.cluster, where, 65, 0, "describe_transactions",
                                    {"transactional_ids": [tid]})
            (state,) = resp.transaction_states
        except (TopicError, ValueError):
            return {(t, i): unverified for t, i, _, _ in need}
        if state.error_code != NONE:
            if state.error_code == TRANSACTIONAL_ID_NOT_FOUND:
                code = (INVALID_PRODUCER_ID_MAPPING, f"No transactional id {tid}")
                return {(t, i): code for t, i, _, _ in need}
            return {(t, i): unverified for t, i, _, _ in need}
        held = {(t.topic, int(i)) for t in state.topics for i in t.partitions}
        refused: dict[tuple[str, int], tuple[int, str]] = {}
        for t, i, pid, ep in need:
            if pid != state.producer_id:
                refused[(t, i)] = (INVALID_PRODUCER_ID_MAPPING, f"Producer {pid} is not the producer of {tid}")
            elif ep < state.producer_epoch:
                refused[(t, i)] = (INVALID_PRODUCER_EPOCH, f"Producer {pid} epoch {ep} is older than {state.producer_epoch}")
            elif ep != state.producer_epoch or state.transaction_state != Status.ONGOING.kafka_name or (t, i) not in held:
                refused[(t, i)] = (INVALID_TXN_STATE, f"{t}-{i} is not part of an ongoing transaction of producer {pid}")
            else:
                self._verified[(pid, t, i)] = ep
        return refused

    def check_produce(
        self, producer_id: int, producer_epoch: int, topic: str, partition: int
    ) -> tuple[int, str] | None:
        """KIP-890 part 1: a transactional batch only for a partition of an Ongoing
        transaction of this producer (None: accepted). Where another broker coordinates
        the producer's transactional id, what `verify_produce` learnt from it."""
        tid = self.by_pid.get(producer_id)
        txn = None if tid is None else self.txns.get(tid)
        if txn is None and self.sharded is not None:
            if self._verified.get((producer_id, topic, partition)) == producer_epoch:
                return None
            return (
                INVALID_TXN_STATE,
                f"{topic}-{partition} is not part of a verified transaction of producer {producer_id}",
            )
        if txn is None:
            return (
                INVALID_PRODUCER_ID_MAPPING,
                f"Producer {producer_id} has no transactional id here",
            )
        if producer_epoch < txn.producer_epoch:
            return INVALID_PRODUCER_EPOCH, (
                f"Producer {producer_id} epoch {producer_epoch} is older than the current epoch {txn.producer_epoch}"
            )
        if (
            txn.status is not Status.ONGOING
            or (topic, partition) not in txn.partitions
            or producer_epoch != txn.producer_epoch
        ):
            log.debug(
                "refused transactional batch of %d/%d to %s-%d: %s %s",
                producer_id,
                producer_epoch,
                topic,
                partition,
                txn.status,
                list(txn.partitions),
            )
            return (
                INVALID_TXN_STATE,
                f"{topic}-{partition} is not part of an ongoing transaction of producer {producer_id}",
            )
        return None

    # ------------------------------------------------------------------ describe

    def describe(self, tid: str) -> Txn | None:
        return self.txns.get(tid)

    def listing(self) -> list[Txn]:
        return list(self.txns.values())

    # ------------------------------------------------------------------ background

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Complete prepared transactions (after a restart, or a failed completion) and abort
        those past their timeout; wakes every cleanup interval or when poked. Every
        transaction.remove.expired.transaction.cleanup.interval.ms, expires idle ids."""
        async with trio.open_nursery() as nursery:
            cluster = self.sharded
            if cluster is not None:
                nursery.start_soon(
                    partial(place_shards, legacy=False),
                    cluster.membership,
                    TXN_TOPIC,
                    self.settings.num_partitions,
                )
                from broker.node import TopicError  # (it imports us): our archive failed

                retriable = (*TAKEOVER_ERRORS, CoordinatorError, TopicError)
                nursery.start_soon(follow_shards, cluster, TXN_TOPIC, self, retriable)
            task_status.started()
            await self._sweep_forever()

    async def _sweep_forever(self) -> None:
        next_expiry = trio.current_time() + self.settings.expire_check_interval_ms / 1000
        while True:
            await self.sweep()
            if trio.current_time() >= next_expiry:
                try:
                    await self.expire()
                except CoordinatorError as exc:
                    log.warning("expiring transactional ids: %s", exc)
                next_expiry = trio.current_time() + self.settings.expire_check_interval_ms / 1000
            wait = min(
                self.settings.abort_check_interval_ms / 1000,
                max(0.0, next_expiry - trio.current_time()),
            )
            with trio.move_on_after(wait):
                await self._poke.wait()
            self._poke = trio.Event()

    async def expire(self) -> list[str]:
        """Kafka's removeExpiredTransactionalIds: forget every transactional id idle (Empty,
        CompleteCommit or CompleteAbort) for longer than transactional.id.expiration.ms,
        after a tombstone of its state is durable in __transaction_state (a replay forgets
        it too). A later InitProducerId with the id gets a new producer id. The ids expired."""
        if self._partition is None:
            return []
        now = self.wall()
        idle = (Status.EMPTY, Status.COMPLETE_COMMIT, Status.COMPLETE_ABORT)
        expired = [
            txn
            for txn in self.txns.values()
            if not txn.pending
            and txn.status in idle
            and txn.transactional_id not in self._completing
            and now - txn.update_ms > self.settings.id_expiration_ms
        ]
        if not expired:
            return []
        for txn in expired:  # requests meanwhile: CONCURRENT_TRANSACTIONS
            txn.pending, txn.pending_status = True, Status.DEAD
        try:
            await self._append(
                [(state_key(t.transactional_id), None) for t in expired], [t.transactional_id for t in expired]
            )
        finally:
            for txn in expired:
                txn.pending, txn.pending_status = False, None
        for txn in expired:
            if self.txns.get(txn.transactional_id) is txn:
                self._forget(txn.transactional_id)
        log.info("expired %d transactional ids idle for over %d ms", len(expired), self.settings.id_expiration_ms)
        return [t.transactional_id for t in expired]

    async def sweep(self) -> int:
        """One pass; how many transactions it moved on."""
        moved = 0
        now = self.wall()
        for txn in list(self.txns.values()):
            if txn.pending:
                continue
            try:
                if txn.status in (Status.PREPARE_COMMIT, Status.PREPARE_ABORT):
                    await self.complete(txn)
                    moved += 1
                elif txn.status is Status.ONGOING and now - txn.start_ms > txn.timeout_ms:
                    log.info(
                        "transaction %s timed out after %d ms: aborting",
                        txn.transactional_id,
                        txn.timeout_ms,
                    )
                    await self._abort(txn, bump=True)
                    moved += 1
            except CoordinatorError as exc:
                log.warning("transaction %s: %s", txn.transactional_id, exc)
        return moved

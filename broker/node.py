"""One broker node: its topics, partitions, group commit and producer ids.

Owns the state every handler shares and the two background loops that keep it moving:
`commit_loop` (group commit: one signed head per partition per round, fsync off the
event loop, then wake the produces and fetches waiting on it) and `retention_loop`.
Handlers never touch `storage` directly for writes; they call `Partition.admit` and
`Partition.wait_durable`. Imports `storage` and `broker.cluster` (the `ClusterView` interface: `Node.cluster`
is never None, a single broker's is a `NullCluster`), never the protocol
codec, the group coordinator, placement or the mirrors: broker/compose.py (the
composition root) builds the node with them and runs their background tasks.

The write path is a pipeline. `admit` runs on the event loop, never yields, and only
assigns offsets and queues the batch, so a connection's reader goes straight on to its
next request. A commit round then takes every partition's queue and, in one worker
thread, writes the batches (pwrite), hashes them, signs and writes the head (fsync when
the policy says so); back on the loop it publishes the heads, which acknowledges every
produce they cover. A quorum-signed partition's head waits for its replicas' signatures
(up to the signing timeout), so under `commit_loop` a round writes and hashes its batches
with the others' but leaves the signing and its head to a task of its own (`_sign_alone`),
which holds that partition (its lock; `Partition.signing`: rounds skip it, so its heads
stay in order) until the head is published or the partition failed. One partition whose
replicas do not sign thus never holds the others' acknowledgements, as in Kafka one
partition's ISR trouble delays no other partition's acks. A round with under
INLINE_ROUND_BYTES to write and no fsync due runs on the loop: that costs less than the two thread switches. The produces of one
received chunk are committed by the connection's reader right after the chunk
(`commit_after_chunk`) when their round is small, else by `commit_loop`. While a round runs, the next requests are admitted and form the
next round's group, so rounds grow with load instead of ticking.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import struct
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio

from broker.cleaner import Cleaner, compaction_policy
from broker.cluster import ClusterView, NullCluster, signed_blocks
from broker.cluster.signing import NotEnoughSigners
from broker.config import BrokerConfig, validate_topic_configs
from broker.idempotence import ProducerStates
from broker.metrics import BrokerMetrics, TopicStats
from broker.protocol.compression import topic_compression
from broker.transactions.coordinator import TxnCoordinator
from broker.transactions.partition import PartitionTxns, rebuild_txns
from storage import CommitJob, FsyncPolicy, PartitionLog, Store, TopicRecord, hash_jobs
from storage.compaction import CompactionPolicy
from storage.errors import NotQuorumSigned, RecoveryFailed, StorageError, TopicExists
from storage.handles import FdBudget
from storage.hypercore import Manifest

if TYPE_CHECKING:
    from broker.groups.coordinator import GroupCoordinator
    from broker.quorum_link import QuorumRole

log = logging.getLogger("hyperkafka.node")

OFFSETS_TOPIC = "__consumer_offsets"
TXN_TOPIC = "__transaction_state"
# Written by their coordinators alone, one archive per broker (never placed, produced to
# or deleted): the group offsets and the transaction states.
INTERNAL_TOPICS = frozenset({OFFSETS_TOPIC, TXN_TOPIC})
_LEGAL_TOPIC = re.compile(r"^[a-zA-Z0-9._-]+$")
MAX_TOPIC_LENGTH = 249
PRODUCER_ID_BLOCK = 1000
PRODUCER_ID_EXPIRATION_MS = 86_400_000
# A round writing less runs on the loop (no fsync due). Measured under the acks=all latency
# workload: at 64 KiB the rounds that grew under load went to a worker thread, and the hop
# (thread hand-off, GIL hand-back) cost more loop time than writing and hashing inline.
INLINE_ROUND_BYTES = 256 * 1024
COMMIT_TICK_S = 0.5  # below the default fsync interval (LogConfig.flush_interval_ms)
# How often partitions a disk error took offline are reopened (Node.retry_offline): a full
# disk that got room again takes produces within this long.
OFFLINE_RETRY_S = 5.0
OFFLINE_RETRY_MAX_S = 60.0  # the retry of one partition backs off to this while it fails
ENDED_GENERATIONS = 16  # a partition's last offline spells, kept for their waiters
# Worker threads for the quorum signatures `_sign_alone` waits for (each blocks its thread
# while its replicas sign): a limiter of their own, so partitions whose replicas do not
# answer never take the threads commit rounds need from trio's default limiter.
QUORUM_SIGNING_THREADS = 64


class TopicError(Exception):
    """A topic-level outcome with its Kafka error code (the handler puts it in the response)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Kafka error codes used by the node (the handlers map the rest).
UNKNOWN_TOPIC_OR_PARTITION = 3
LEADER_NOT_AVAILABLE = 5
NOT_LEADER_OR_FOLLOWER = 6
INVALID_TOPIC_EXCEPTION = 17
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REPLICATION_FACTOR = 38
INVALID_REPLICA_ASSIGNMENT = 39
INVALID_CONFIG = 40
NOT_CONTROLLER = 41
TOPIC_DELETION_DISABLED = 73
KAFKA_STORAGE_ERROR = 56
NOT_ENOUGH_REPLICAS = 19
NOT_ENOUGH_REPLICAS_AFTER_APPEND = 20
POLICY_VIOLATION = 44
INVALID_REQUEST = 42
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# As Kafka 4.0's controller (KAFKA-17870): one CreateTopics may not create more.
MAX_PARTITIONS_PER_REQUEST = 10_000


def check_topic_name(name: str) -> None:
    if not name or name in (".", ".."):
        raise TopicError(INVALID_TOPIC_EXCEPTION, f"Topic name {name!r} is illegal")
    if len(name) > MAX_TOPIC_LENGTH:
        raise TopicError(INVALID_TOPIC_EXCEPTION, f"Topic name is longer than {MAX_TOPIC_LENGTH} characters")
    if not _LEGAL_TOPIC.match(name):
        raise TopicError(
            INVALID_TOPIC_EXCEPTION,
            f"Topic name {name!r} is illegal, it contains a character other than ASCII alphanumerics, '.', '_' and '-'",
        )


@dataclass(eq=False)
class Partition:
    topic: Topic
    index: int
    log: PartitionLog
    producers: ProducerStates = field(default_factory=ProducerStates)
    txns: PartitionTxns = field(default_factory=PartitionTxns)  # open/aborted transactions, LSO
    failed: str | None = None  # set when a commit failed: the partition is offline
    # The Kafka error a produce to a failed partition gets (a deleted one: unknown).
    failed_code: int = 56  # KAFKA_STORAGE_ERROR
    retry: bool = False  # offline by a disk error: `Node.retry_offline` reopens it
    retry_at: float = 0.0  # (trio clock) not before; the delay doubles while it fails
    retry_delay: float = 0.0
    # Serialises what touches the log's files from more than one task: a commit round
    # (which writes and commits in a worker thread), retention, deletion. Admission does
    # not take it (it only queues, on the loop). Readers do not take it: they never look
    # past the high watermark, which only `publish` moves, on the loop. A semaphore, not a
    # trio.Lock (which only the task that took it may release): a round hands the hold of
    # a quorum-signed partition over to the task that signs its head (`Node._sign_alone`).
    lock: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(1, max_value=1))
    _changed: trio.Event = field(default_factory=trio.Event)
    # Admitted batches (bytearray or writable memoryview) not yet written, in admission
    # order, with the base offset each was given; the next commit round writes them.
    queued: list[tuple[Any, int]] = field(default_factory=list)
    writing: bool = False  # a round is writing an earlier queue in a worker thread
    # A quorum-signed partition's head waits for its replicas in a task of its own
    # (`Node._sign_alone`), which holds `lock`: commit rounds skip the partition meanwhile.
    signing: bool = False
    # A quorum-signed partition of a mirrored topic that a failover made this broker the
    # writer (leader) of (broker/takeover.py): it takes produces, the rest of the topic not.
    led: bool = False
    _end: int = 0  # the offset after the last admitted batch, while queued or writing
    # Bytes admitted and not yet covered by a published head, with (last offset, size)
    # of each such batch, oldest first: what `wait_room` bounds on a quorum-signed
    # partition, whose heads come as fast as its replicas sign them.
    unsigned_bytes: int = 0
    _unsigned: deque[tuple[int, int]] = field(default_factory=deque)
    # Bumped each time the partition goes offline (`Node.fail_partition`). A batch is
    # admitted in a generation; once that generation ended, what was not published by
    # then never will be (the reopen cuts the unsigned tail, and its offsets are given
    # again), so its waiter is answered at once from `_ended` instead of waiting on a
    # log that no longer holds it (or, worse, for other batches to reach its offsets).
    generation: int = 0
    # generation -> (high watermark when it ended, the Kafka error, why, the log end
    # then, the error of a batch written below it); the last few
    _ended: dict[int, tuple[int, int, str, int, int]] = field(default_factory=dict)

    @property
    def high_watermark(self) -> int:
        return self.log.high_watermark

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def admit(self, batch: bytearray | memoryview, last_offset_delta: int) -> tuple[int, int]:
        """Give a checked batch its offsets now and queue it for the next commit round;
        returns (base offset, last offset). On the loop, without yielding, so the
        caller's idempotence check and this are one atomic step. The batch must be
        writable (the log stamps its base offset into it) and stay untouched until the
        round wrote it.

        A partition is written either through `admit` (client topics) or by
        `log.append` on the loop (the broker's own offsets archive), never both."""
        if not self.queued and not self.writing:
            self._end = self.log.log_end_offset
        base = self._end
        self._end = base + last_offset_delta + 1
        self.queued.append((batch, base))
        self._unsigned.append((self._end - 1, len(batch)))
        self.unsigned_bytes += len(batch)
        return base, self._end - 1

    def settle_unsigned(self) -> None:
        """Forget the batches a published head covers now, and those no longer held
        (dropped unwritten when a generation ended, cut by a reopen): their offsets are
        given again."""
        hw = self.log.high_watermark
        end = self._end if (self.queued or self.writing) else self.log.log_end_offset
        q = self._unsigned
        while q and q[0][0] < hw:
            self.unsigned_bytes -= q.popleft()[1]
        while q and q[-1][0] >= end:
            self.unsigned_bytes -= q.pop()[1]

    def over_budget(self, max_unsigned: int) -> bool:
        """Whether a produce must wait before this partition admits more (`wait_room`):
        a quorum-signed partition holding `max_unsigned` bytes or more that no published
        head covers yet."""
        return self.unsigned_bytes >= max_unsigned and self.log.quorum_sign is not None

    async def wait_room(self, max_unsigned: int) -> None:
        """Back-pressure on unsigned data (a quorum-signed partition whose replicas sign
        slower than producers write): wait until fewer than `max_unsigned` bytes admitted
        here wait for a head, or the partition fails (the caller's admission then says
        why). The connection's reader waits in it, so it reads nothing more meanwhile, as
        Kafka mutes a channel: memory stays bounded and no admitted batch is dropped."""
        while self.over_budget(max_unsigned) and not self.failed:
            await self._changed.wait()

    def end_generation(self, code: int, reason: str, written_code: int | None = None) -> None:
        """The partition went offline: batches admitted so far and not yet published are
        answered `code` (those the log holds unsigned, `written_code` if given: a
        quorum-signed log keeps its unsigned tail for its next head), and waiters are
        woken to learn it."""
        log_end = self.log.log_end_offset
        self._ended[self.generation] = (
            self.log.high_watermark, code, reason, log_end, code if written_code is None else written_code
        )
        if len(self._ended) > ENDED_GENERATIONS:
            del self._ended[min(self._ended)]
        self.generation += 1
        self.queued.clear()  # admitted, not yet taken by a round: never written now
        self.settle_unsigned()
        self.notify()

    def durable(self, last_offset: int, generation: int | None = None) -> bool:
        """Whether a published head covers `last_offset` (admitted in `generation`; None:
        the current one); raises TopicError when it never will."""
        if generation is not None and generation != self.generation:
            hw, code, reason, log_end, written = self._ended.get(
                generation, (0, self.failed_code, self.failed or "the partition went offline", 0, 0))
            if last_offset < hw:
                return True
            if last_offset < log_end:
                code = written
            raise TopicError(code, f"The batch was not committed: {reason}")
        if self.failed:
            raise TopicError(self.failed_code, self.failed)
        return self.log.high_watermark > last_offset

    async def wait_durable(self, last_offset: int, generation: int | None = None) -> None:
        """Return once a published head covers `last_offset`, admitted in `generation`
        (the caller bounds the wait); TopicError when the partition failed, or went
        offline since `generation` before publishing it."""
        while not self.durable(last_offset, generation):
            await self._changed.wait()


@dataclass(eq=False)
class Topic:
    record: TopicRecord
    partitions: list[Partition] = field(default_factory=list)
    # Effective per-topic settings the produce path needs on every batch.
    max_message_bytes: int = 1048588
    log_append_time: bool = False
    timestamp_after_max_ms: int = 3600000
    timestamp_before_max_ms: int = 2**63 - 1
    min_insync_replicas: int = 1
    # compression.type: the codec the broker recompresses other batches to (None: producer)
    # and compression.<codec>.level for it.
    compression: int | None = None
    compression_level: int | None = None
    # cleanup.policy with compact: its compaction configs (broker/cleaner.py); else None.
    compaction: CompactionPolicy | None = None
    # Written by another node and mirrored here (broker/mirror.py): read-only for Kafka.
    mirrored: bool = False
    # Cluster mode: the broker id of the writer (the partitions' leader); None = this node.
    leader_id: int | None = None
    # A quorum-signed topic's configs as its etcd record holds them, which win over the
    # catalog's (broker/placed_topics.py); None: the catalog's.
    placed_configs: dict[str, str] | None = None
    stats: TopicStats = field(default_factory=TopicStats)  # Kafka's BrokerTopicMetrics (broker/metrics.py)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def topic_id(self) -> uuid.UUID:
        return self.record.topic_id

    @property
    def configs(self) -> Mapping[str, str]:
        """The topic's config overrides in effect."""
        return self.placed_configs if self.placed_configs is not None else self.record.configs


class TopicMaker(Protocol):
    """How topics come to exist: the one seam CreateTopics and auto-creation (Metadata,
    Produce) call. `LocalTopics` (below) makes them here, a single broker's way;
    `PlacedTopics` (broker/placement.py) has the controller place them in etcd, and their
    writer make them. broker/compose.py picks one with the cluster view."""

    def check_assignments(self, assignments: Sequence[tuple[int, Sequence[int]]]) -> str | None:
        """Why CreateTopics' replica assignment is refused (INVALID_REPLICA_ASSIGNMENT), or None."""
        ...

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
        """CreateTopics: the topic when it is written here, None when validating or when
        another broker writes it. NOT_CONTROLLER when this broker may not create it
        (the handler forwards it to the controller)."""
        ...

    async def auto_create(self, name: str) -> Topic:
        """Metadata's auto-creation: the topic, or a TopicError (LEADER_NOT_AVAILABLE while
        it is being made elsewhere: the client asks again)."""
        ...

    def auto_create_for_write(self, name: str) -> Topic:
        """Produce's auto-creation (on the loop, without yielding): the topic or a TopicError."""
        ...


class LocalTopics:
    """`TopicMaker` of a single broker: every topic is made here, at once."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def check_assignments(self, assignments: Sequence[tuple[int, Sequence[int]]]) -> str | None:
        me = self.node.config.node_id
        if any(list(ids) != [me] for _, ids in assignments):
            return f"Only broker {me} exists"
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
        return await self.node.create_topic_off_loop(name, partitions, replication_factor, configs,
                                                     validate_only=validate_only)

    async def auto_create(self, name: str) -> Topic:
        return self.auto_create_for_write(name)

    def auto_create_for_write(self, name: str) -> Topic:
        created = self.node.create_topic(name)
        assert created is not None
        return created


class Node:
    """The broker's shared state. Built by broker/compose.py (`open_node`), which also runs
    its background tasks (`run_node`)."""

    groups: GroupCoordinator  # set by broker/compose.py: it replays __consumer_offsets
    transactions: TxnCoordinator  # set by broker/compose.py: it replays __transaction_state
    topic_maker: TopicMaker  # LocalTopics, or broker/placement.py's PlacedTopics (compose)

    def __init__(self, config: BrokerConfig, store: Store, cluster: ClusterView | None = None) -> None:
        self.config = config
        self.cleaner = Cleaner(self)  # compacted topics (broker/cleaner.py)
        self.store = store
        self.topics: dict[str, Topic] = {}
        # Topic ids of quorum-signed topics deleted while this broker ran (`drop_topic`),
        # and whom to tell of such a deletion (its mirrors, broker/mirror.py: a topic id
        # to detach, or None: a name whose new topic may be attached now).
        self.dropped_ids: set[uuid.UUID] = set()
        self.topic_dropped: list[Callable[[str, uuid.UUID | None], None]] = []
        self._dirty: dict[int, Partition] = {}
        self._commit_lock = trio.Lock()
        self._commit_wanted = trio.Event()
        # commit_loop's nursery while it runs: quorum heads are signed in tasks of their
        # own there (`_sign_alone`); without it (a round run directly) the round waits.
        self._signing_tasks: trio.Nursery | None = None
        self._signing_limiter = trio.CapacityLimiter(QUORUM_SIGNING_THREADS)
        self._signing_count = 0  # those tasks under way
        self._signing_idle = trio.Event()
        # Set by a produce's `mark_dirty(wake=False)`: the reader owes `commit_after_chunk`.
        self.round_owed = False
        # Under `always` every round fsyncs in a worker thread: readers leave it to the loop.
        self._inline_ok = config.fsync is not FsyncPolicy.ALWAYS
        self._tick_due = False
        self._data_changed = trio.Event()
        self._pid_file = Path(config.data_dir) / "producer-ids"
        self._next_pid, self._pid_limit = 0, 0
        self._closed = False
        # Names whose deletion is under way: the topic has left `topics` but the catalog
        # still holds it until every partition's commit round let go (deletion yields).
        self._deleting: set[str] = set()
        # Partitions a full disk took offline, which `retry_offline` reopens.
        self._offline: dict[int, Partition] = {}
        self._offline_wake = trio.Event()  # `wake_offline`: look again before the tick
        self._creating: dict[str, int] = {}  # topic -> partitions, made in a worker thread
        # One topic's archives are made at a time: each holds a few descriptors while it is
        # made, outside the partition-file budget, and concurrent creations only contend
        # for the same disk.
        self._create_limiter = trio.CapacityLimiter(1)
        self.fd_budget: FdBudget | None = None  # set by broker/compose.py (storage/handles.py)
        # Set by the first FindCoordinator for a group: __consumer_offsets is then listed.
        self.offsets_topic_in_use = False
        # Set by broker.replication_server once it listens ("host:port", for DescribeConfigs).
        self.replication_address: str | None = None
        self.replication_connections = 0  # accepted on the replication port (broker/replication_server.py)
        # Mirrored topic -> (its writer's node key, our verified copy of the writer's catalog),
        # filled by broker/mirror.py: the explorer proves a topic's archive keys from it.
        self.writer_catalogs: dict[str, tuple[bytes, PartitionLog]] = {}
        self.metrics = BrokerMetrics()  # what /metrics shows (broker/metrics.py)
        self.started = time.monotonic()
        # The cluster (broker/cluster/view.py): membership, controller and placement, the
        # ISR and acks=all; in etcd (`Cluster`) or this broker alone (`NullCluster`, the
        # default: what tests and single brokers get).
        self.cluster: ClusterView = (
            cluster if cluster is not None else NullCluster.from_config(config, store.node_public_key)
        )
        self.cluster_id = self.cluster.cluster_id
        self.topic_maker = LocalTopics(self)
        # (topic, topic id, partitions) -> the manifests of its quorum-signed partitions,
        # or None for single-signer ones (broker/cluster/quorum.py sets it in a cluster).
        self.partition_manifests: Callable[[str, uuid.UUID, int], Sequence[Manifest] | None] = (
            lambda _name, _tid, _n: None
        )
        self.quorum: QuorumRole | None = None  # its replica and leader parts (compose)
        # every partition recovered in worker threads first (storage/store.py: preopen)
        store.preopen([(r.name, i, config.log_config(r.configs))
                       for r in store.topics().values() for i in range(r.partitions)])
        for record in store.topics().values():
            self._attach(record)

    def partition_count(self) -> int:
        """Partitions this node holds (written and mirrored) plus those being created."""
        return sum(len(t.partitions) for t in self.topics.values()) + sum(self._creating.values())

    def check_partition_limit(self, more: int) -> None:
        """Refuse partitions past max.broker.partitions (KIP-578's name): each costs
        memory for its index and producer state and time at every restart."""
        limit = self.config.max_broker_partitions
        have = self.partition_count()
        if have + more > limit:
            raise TopicError(POLICY_VIOLATION,
                             f"Creating {more} partition(s) would exceed this broker's limit of {limit} "
                             f"partitions (max.broker.partitions); it holds {have}.")

    async def create_topic_off_loop(
        self,
        name: str,
        partitions: int = -1,
        replication_factor: int = -1,
        configs: Mapping[str, str | None] | None = None,
        *,
        validate_only: bool = False,
        topic_id: uuid.UUID | None = None,
    ) -> Topic | None:
        """`create_topic` for CreateTopics: the archives (a directory, files and fsyncs per
        partition) are made in a worker thread, so thousands of partitions do not stall
        the event loop; the catalog records the topic once they all exist."""
        if name in self._creating:
            raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' is being created.")
        self.create_topic(name, partitions, replication_factor, configs, validate_only=True)
        if partitions == -1:
            partitions = self.config.num_partitions
        self.check_partition_limit(partitions)
        if validate_only:
            return None
        overrides = validate_topic_configs(configs or {})
        tid = topic_id or uuid.uuid4()  # (a quorum-signed topic's: chosen by the controller)
        self._creating[name] = partitions
        try:
            manifests = self.partition_manifests(name, tid, partitions)
            prepared = await trio.to_thread.run_sync(
                self.store.prepare_partitions, name, tid, partitions, self.config.log_config(overrides),
                manifests, limiter=self._create_limiter)
            # (not cancellable: the thread finished, and no checkpoint comes before the
            # catalog records the topic or the archives are discarded)
            try:
                topic = self.create_topic(name, partitions, replication_factor, configs,
                                          topic_id=tid, prepared=prepared, manifests=manifests)
            except BaseException:
                if self.store.topics().get(name) is None:
                    self.store.discard(name, prepared)
                raise
        except (StorageError, OSError) as exc:
            raise TopicError(KAFKA_STORAGE_ERROR, f"Cannot create topic '{name}': {exc}") from None
        finally:
            del self._creating[name]
        return topic

    # -- topics -------------------------------------------------------------------

    def _attach(self, record: TopicRecord) -> Topic:
        topic = Topic(record)
        self._apply_configs(topic)
        log_config = self.config.log_config(record.configs)
        for index in range(record.partitions):
            plog = self.store.log(record.name, index, log_config)
            partition = Partition(topic, index, plog)
            if isinstance(plog.damage, RecoveryFailed):
                # Recovery could not write (a full disk): serve what is signed, take no
                # writes, and reopen it once it can (`retry_offline`).
                self.fail_partition(partition, f"storage error: {plog.damage}",
                                    retry=_disk_full(plog.damage.cause))
            elif plog.damage is not None:
                # Signed history did not verify at open: serve what verifies, take no writes.
                self.fail_partition(partition, f"archive damaged: {plog.damage}")
            partition.producers.rebuild(producer_headers(plog))
            partition.txns = rebuild_txns(plog)
            topic.partitions.append(partition)
            self.cluster.published(plog.key, signed_blocks(plog))
        self.topics[record.name] = topic
        return topic

    def _apply_configs(self, topic: Topic) -> None:
        overrides = topic.configs
        eff = self.config.effective
        topic.max_message_bytes = int(eff(overrides, "max.message.bytes"))
        topic.log_append_time = eff(overrides, "message.timestamp.type") == "LogAppendTime"
        topic.timestamp_after_max_ms = int(eff(overrides, "message.timestamp.after.max.ms"))
        topic.min_insync_replicas = int(eff(overrides, "min.insync.replicas"))
        topic.timestamp_before_max_ms = int(eff(overrides, "message.timestamp.before.max.ms"))
        topic.compression, topic.compression_level = topic_compression(lambda name: eff(overrides, name))
        topic.compaction = compaction_policy(lambda name: eff(overrides, name))

    def _reconfigure(self, topic: Topic) -> None:
        """The topic's configs in effect changed: apply them to its produce path and to
        its partitions' logs."""
        self._apply_configs(topic)
        log_config = self.config.log_config(topic.configs)
        for p in topic.partitions:
            p.log.set_config(log_config)

    def attach_mirrored(self, record: TopicRecord, logs: list[PartitionLog],
                        leader_id: int | None = None) -> Topic:
        """Serve a topic another node writes from this node's verified copies (`logs`,
        follower archives): Metadata, ListOffsets and Fetch work, produces are refused.
        `leader_id`: the writer's broker id in cluster mode."""
        topic = Topic(record, mirrored=True, leader_id=leader_id)
        self._apply_configs(topic)
        topic.partitions = [Partition(topic, i, lg) for i, lg in enumerate(logs)]
        self.topics[record.name] = topic
        return topic

    def update_mirrored(self, record: TopicRecord, more: list[PartitionLog]) -> Topic:
        """A mirrored topic changed on its writer (broker/mirror.py): serve its new
        configs (`record`, verified in the writer's catalog) and its new partitions
        (`more`, follower archives of the partitions past the ones served)."""
        topic = self.topics[record.name]
        topic.record = record
        self._reconfigure(topic)
        for lg in more:
            topic.partitions.append(Partition(topic, len(topic.partitions), lg))
        self.notify_data()
        return topic

    def detach_mirrored(self, name: str) -> None:
        """Stop serving a mirrored topic (its writer deleted it; broker/mirror.py)."""
        topic = self.topics.get(name)
        if topic is None or not topic.mirrored:
            return
        del self.topics[name]
        for p in topic.partitions:
            p.failed = "topic deleted"
            p.notify()
        self.notify_data()

    def notify_data(self) -> None:
        """Wake Fetch long-polls: a high watermark moved outside the group commit."""
        self._data_changed.set()
        self._data_changed = trio.Event()

    def visible_topics(self) -> Iterator[Topic]:
        """The topics of an all-topics Metadata answer. Kafka lists its internal topic
        there once it exists, which is after the first FindCoordinator for a group; our
        archive always exists, so it is listed from that moment, or once it holds data."""
        offsets = self.topics.get(OFFSETS_TOPIC)
        if offsets is not None and not self.offsets_topic_in_use:
            self.offsets_topic_in_use = any(p.log.log_end_offset > 0 for p in offsets.partitions)
        return (
            t
            for name, t in self.topics.items()
            if not name.startswith("__") or (name == OFFSETS_TOPIC and self.offsets_topic_in_use)
        )

    def create_topic(
        self,
        name: str,
        partitions: int = -1,
        replication_factor: int = -1,
        configs: Mapping[str, str | None] | None = None,
        *,
        validate_only: bool = False,
        topic_id: uuid.UUID | None = None,
        prepared: list[PartitionLog] | None = None,
        manifests: Sequence[Manifest] | None = None,
    ) -> Topic | None:
        check_topic_name(name)
        if name in self.topics:
            raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists.")
        if name in self._deleting:  # as Kafka's "marked for deletion": retry once it is gone
            raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' is marked for deletion.")
        if prepared is None and name in self._creating:
            # auto-creation (Metadata, Produce) of a topic CreateTopics is making: it
            # shows up shortly, as a Kafka topic whose leaders are not elected yet
            raise TopicError(LEADER_NOT_AVAILABLE, f"Topic '{name}' is being created.")
        if partitions == -1:
            partitions = self.config.num_partitions
        if partitions <= 0:
            raise TopicError(INVALID_PARTITIONS, "Number of partitions must be larger than 0.")
        if partitions > 100_000:
            raise TopicError(INVALID_PARTITIONS, "Number of partitions is larger than 100000.")
        if replication_factor == -1:
            replication_factor = self.config.default_replication_factor
        # Every broker of the cluster mirrors every archive: any factor up to the number
        # of live brokers is met (with more copies than asked for below it).
        brokers = len(self.cluster.live_ids())
        if not 1 <= replication_factor <= brokers:
            raise TopicError(
                INVALID_REPLICATION_FACTOR,
                f"Unable to replicate the partition {replication_factor} time(s): The target replication factor "
                f"of {replication_factor} cannot be reached because only {brokers} broker(s) are registered.",
            )
        try:
            overrides = validate_topic_configs(configs or {})
        except ValueError as exc:
            raise TopicError(INVALID_CONFIG, str(exc)) from None
        if validate_only:
            return None
        if name not in INTERNAL_TOPICS:
            # Only the writer placement names makes a topic (broker/placement.py): one
            # name never has two writers. (Alone, this broker writes every topic.)
            writer = self.cluster.placed_writer(name)
            if writer is None:
                raise TopicError(NOT_CONTROLLER, f"Topic '{name}' is not placed yet: topics are created on the "
                                 f"controller (broker {self.cluster.controller_id}).")
            if writer != self.config.node_id:
                raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists (written by broker {writer}).")
        if prepared is None and name not in INTERNAL_TOPICS:
            self.check_partition_limit(partitions)
        # The partitions first, the catalog last (Store.prepare_partitions): a disk that
        # cannot take them answers KAFKA_STORAGE_ERROR and keeps nothing of the topic.
        # CreateTopics made them in a worker thread (`create_topic_off_loop`, which
        # discards them if this fails); auto-creation makes them here.
        own = prepared is None
        try:
            if prepared is None:
                topic_id = uuid.uuid4()
                manifests = self.partition_manifests(name, topic_id, partitions)
                prepared = self.store.prepare_partitions(name, topic_id, partitions,
                                                         self.config.log_config(overrides), manifests)
            try:
                record = self.store.create_topic(name, partitions, overrides, topic_id, manifests)
            except BaseException:
                if own and self.store.topics().get(name) is None:
                    self.store.discard(name, prepared)
                raise
        except TopicExists:
            raise TopicError(TOPIC_ALREADY_EXISTS, f"Topic '{name}' already exists.") from None
        except (StorageError, OSError) as exc:  # a full disk: nothing of it was kept
            log.error("cannot create topic %s: %s", name, exc)
            raise TopicError(KAFKA_STORAGE_ERROR, f"Cannot create topic {name}: {exc}") from None
        self.store.adopt(name, prepared)
        log.info("created topic %s with %d partition(s), id %s", name, partitions, record.topic_id)
        topic = self._attach(record)
        if self.quorum is not None and manifests:  # its signer from the first produce on
            self.quorum.lead_created(name, [(p.index, p.log) for p in topic.partitions])
        return topic

    async def add_partitions(self, topic: Topic, count: int) -> None:
        """CreatePartitions on a topic written here: the archives and the catalog change
        in a worker thread (as CreateTopics), then the partitions are served."""
        more = count - len(topic.partitions)
        self.check_partition_limit(more)
        name = topic.name
        if name in self._creating:
            raise TopicError(INVALID_REQUEST, f"Topic '{name}' is being created or grown; try again.")
        self._creating[name] = more
        try:
            logs = await trio.to_thread.run_sync(
                self.store.prepare_more_partitions, name, count, self.config.log_config(topic.configs),
                limiter=self._create_limiter)
            if self.topics.get(name) is not topic:  # deleted meanwhile
                self.store.discard_more(logs)
                raise TopicError(UNKNOWN_TOPIC_OR_PARTITION, f"Topic '{name}' was deleted.")
            try:
                topic.record = self.store.add_partitions(name, logs)
            except BaseException:
                self.store.discard_more(logs)
                raise
        except (StorageError, OSError) as exc:
            raise TopicError(KAFKA_STORAGE_ERROR, f"Cannot add partitions to '{name}': {exc}") from None
        finally:
            del self._creating[name]
        for plog in logs:
            topic.partitions.append(Partition(topic, len(topic.partitions), plog))
            self.cluster.published(plog.key, signed_blocks(plog))
        log.info("topic %s grown to %d partitions", name, count)
        self.notify_data()

    def set_topic_configs(self, topic: Topic, overrides: Mapping[str, str]) -> None:
        """AlterConfigs: record the topic's new overrides in the catalog (signed, durable
        before this returns) and apply them to the produce path and the logs."""
        try:
            topic.record = self.store.set_topic_configs(topic.name, overrides)
        except (StorageError, OSError) as exc:
            raise TopicError(KAFKA_STORAGE_ERROR, f"Cannot record configs of '{topic.name}': {exc}") from None
        self._reconfigure(topic)

    def set_placed_configs(self, topic: Topic, overrides: Mapping[str, str]) -> None:
        """A quorum-signed topic's configs as its etcd record holds them (validated by the
        controller that wrote them): applied to the produce path and the logs, in place of
        the catalog's (broker/placed_topics.py)."""
        before = dict(topic.configs)
        topic.placed_configs = dict(overrides)
        self._reconfigure(topic)
        if before != topic.placed_configs:
            log.info("topic %s: configs now %s (its etcd record)", topic.name, topic.placed_configs)

    async def drop_topic(self, topic: Topic) -> None:
        """A quorum-signed topic whose etcd record is gone (or names another topic id) is
        deleted here, written here or mirrored (broker/placed_topics.py decides, from etcd
        itself): no produce, fetch or commit goes on on it, its files are deleted (a
        mirrored topic's by its mirror, through `topic_dropped`), and its topic id is
        remembered so that no mirror attaches it again from a catalog that still lists it
        (its old writer's, until that one drops it too)."""
        name = topic.name
        if self.topics.get(name) is not topic:
            return
        self.dropped_ids.add(topic.topic_id)
        if not topic.mirrored:
            await self._remove_topic(name)
        else:
            for p in topic.partitions:
                async with p.lock:  # no commit is left running on its files
                    self._dirty.pop(id(p), None)
                    p.queued.clear()
                    p.failed = "topic deleted"
                    p.failed_code = UNKNOWN_TOPIC_OR_PARTITION
                p.notify()
            for hook in list(self.topic_dropped):
                hook(name, topic.topic_id)
            if self.topics.get(name) is topic:  # no mirror holds it: served no more anyway
                del self.topics[name]
        for hook in list(self.topic_dropped):
            hook(name, None)  # mirrors that skipped the name may attach a new topic of it
        self.notify_data()
        log.info("deleted topic %s (id %s): its etcd record is gone", name, topic.topic_id)

    async def delete_topic(self, name: str) -> None:
        if not self.config.delete_topic_enable:
            raise TopicError(TOPIC_DELETION_DISABLED, "Topic deletion is disabled.")
        if name in INTERNAL_TOPICS:
            raise TopicError(INVALID_TOPIC_EXCEPTION, f"Internal topic {name} cannot be deleted")
        written_here = name in self.topics and not self.topics[name].mirrored
        if not self.cluster.is_controller and not written_here:
            # (a topic this broker writes: the controller forwards its deletion here)
            raise TopicError(NOT_CONTROLLER, f"This is not the correct controller for this cluster: topics are deleted on broker {self.cluster.controller_id}.")
        if name in self.topics and self.topics[name].mirrored:
            raise TopicError(NOT_LEADER_OR_FOLLOWER, f"Topic {name} is mirrored from another node; delete it there")
        if name not in self.topics:
            raise TopicError(UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")
        await self._remove_topic(name)

    async def _remove_topic(self, name: str) -> None:
        """Delete topic `name`, written here: its partitions stop, the catalog records
        the deletion, its files go."""
        topic = self.topics.pop(name)
        self._deleting.add(name)
        before = [(p.failed, p.failed_code) for p in topic.partitions]
        try:
            for p in topic.partitions:
                async with p.lock:  # no append or commit is left running on its files
                    self._dirty.pop(id(p), None)
                    p.queued.clear()
                    p.failed = "topic deleted"
                    p.failed_code = UNKNOWN_TOPIC_OR_PARTITION
                p.notify()
            try:
                self.store.delete_topic(name)
            except (StorageError, OSError) as exc:
                if name not in self.store.topics():  # deleted; a directory is left (an orphan)
                    log.warning("deleted topic %s, but removing its files failed: %s", name, exc)
                else:  # the catalog could not record it (a full disk): the topic stays
                    for p, (failed, code) in zip(topic.partitions, before, strict=True):
                        p.failed, p.failed_code = failed, code
                    self.topics[name] = topic
                    raise TopicError(KAFKA_STORAGE_ERROR, f"Cannot delete topic {name}: {exc}") from None
        finally:
            self._deleting.discard(name)
        log.info("deleted topic %s", name)

    def creating(self, name: str) -> bool:
        """Whether CreateTopics is making `name` now (its archives, in a worker thread)."""
        return name in self._creating

    def topic_for_write(self, name: str) -> Topic:
        """The topic a client may produce to, auto-created when the broker allows it.
        Internal topics (the offsets archive) are written by the broker alone."""
        if name in INTERNAL_TOPICS:
            raise TopicError(INVALID_TOPIC_EXCEPTION, f"Cannot append to internal topic {name}")
        topic = self.topics.get(name)
        if topic is not None:
            if topic.mirrored and not any(p.led for p in topic.partitions):
                # this node holds no key for it: an error, never silent loss
                raise TopicError(NOT_LEADER_OR_FOLLOWER, f"Topic {name} is a read-only mirror; produce to its writer")
            return topic
        if not self.config.auto_create_topics:
            raise TopicError(UNKNOWN_TOPIC_OR_PARTITION, "This server does not host this topic-partition.")
        try:
            return self.topic_maker.auto_create_for_write(name)
        except TopicError as exc:
            if exc.code in (NOT_CONTROLLER, TOPIC_ALREADY_EXISTS):  # not yet here: retriable
                raise TopicError(UNKNOWN_TOPIC_OR_PARTITION, exc.message) from None
            raise

    def partition(self, topic: str, index: int) -> Partition | None:
        t = self.topics.get(topic)
        if t is None or not 0 <= index < len(t.partitions):
            return None
        return t.partitions[index]

    # -- producer ids -------------------------------------------------------------

    def allocate_producer_id(self) -> int:
        """A producer id never handed out before, also across restarts: ids are reserved
        in blocks, and the end of the current block is made durable before any is used."""
        if self._next_pid >= self._pid_limit:
            start = 0
            with contextlib.suppress(FileNotFoundError):
                start = int(self._pid_file.read_text().strip() or 0)
            limit = start + PRODUCER_ID_BLOCK
            tmp = self._pid_file.with_suffix(".tmp")
            with open(tmp, "w") as f:
                f.write(f"{limit}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._pid_file)
            self._next_pid, self._pid_limit = start, limit
        pid = self._next_pid
        self._next_pid += 1
        # (in a cluster, each broker hands out ids of its own range)
        return pid + self.cluster.producer_id_base

    # -- group commit -------------------------------------------------------------

    def mark_dirty(self, partition: Partition, *, wake: bool = True) -> None:
        """Queue a commit round for `partition`. `wake=False` (the produce handler): the
        connection's reader runs it after the chunk (`commit_after_chunk`)."""
        self._dirty[id(partition)] = partition
        if wake:
            self._commit_wanted.set()
        else:
            self.round_owed = True

    def wake_commit(self) -> None:
        """Hand an owed round to the commit loop (a reader that cannot run it)."""
        self.round_owed = False
        self._commit_wanted.set()

    async def commit_after_chunk(self) -> None:
        """The round for the produces of one received chunk, run by the connection's reader
        right after it admitted them, when the round is small and no round is running.

        Why here and not in `commit_loop`: the round is then over before the writer task
        looks at the answers, so the writer finds them ready and sends them at once,
        instead of waiting on a partition event and being woken again; and the commit
        loop's own wake-up is saved. A round that would need a worker thread (big, or an
        fsync under `always`) goes to `commit_loop` as before, so the reader goes on
        receiving the next requests while it runs, and they form the next group."""
        self.round_owed = False
        if self._inline_ok and not self._commit_lock.locked():
            queued = 0
            for p in self._dirty.values():
                for b, _ in p.queued:
                    queued += len(b)
            if queued < INLINE_ROUND_BYTES:
                await self.commit_round()
                return
        self._commit_wanted.set()

    async def wait_for_data(self) -> None:
        """Wait until any partition's high watermark moves (Fetch long-poll)."""
        await self._data_changed.wait()

    async def commit_loop(self) -> None:
        """Group commit: a round as soon as anything was appended, and every COMMIT_TICK_S
        one over every partition, so an idle log still reaches the disk within its fsync
        interval (storage decides what is due). The tick is a task of its own: a timeout
        around every wait would cost each round a cancel scope."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._tick_loop)
            self._signing_tasks = nursery
            try:
                while True:
                    await self._commit_wanted.wait()
                    self._commit_wanted = trio.Event()
                    tick, self._tick_due = self._tick_due, False
                    await self.commit_round(every_partition=tick)
            finally:
                self._signing_tasks = None

    async def _tick_loop(self) -> None:
        while True:
            await trio.sleep(COMMIT_TICK_S)
            self._tick_due = True
            self._commit_wanted.set()

    async def commit_round(self, *, every_partition: bool = False) -> None:
        """Sign and publish one head per partition with new data; fsync off the loop.

        Rounds never overlap (shutdown runs a last one while the loop may be in one), and
        a round, once started, finishes even if cancelled: a head that was written is
        always published, so nothing durable is left unacknowledged. A round that needs
        no thread runs without a checkpoint (locks are taken without waiting when free)."""
        await _acquire(self._commit_lock)
        try:
            # Every checkpoint inside is shielded (`_acquire_shielded`, the worker thread):
            # an inline round has none, and pays for no cancel scope.
            await self._commit_round(every_partition)
        finally:
            self._commit_lock.release()

    async def _commit_round(self, every_partition: bool) -> None:
        if every_partition:
            # The tick is for logs with an fsync or a background sync to finish; walking
            # (and locking) every idle partition twice a second cost 1,000 partitions a
            # third of a core.
            dirty = [
                p
                for t in self.topics.values()
                for p in t.partitions
                if p.queued or not p.log.quiescent
            ]
        else:
            dirty = list(self._dirty.values())
        self._dirty.clear()
        # The logs a round writes keep their files open (pinned) until it published them,
        # and open partition files are on a budget (storage/handles.py): a round over more
        # partitions than the budget holds runs in slices that fit it.
        # A partition whose quorum head is still being signed (`_sign_alone`) is left to
        # that task: it asks for a round when it is done and more was admitted meanwhile.
        dirty = [p for p in dirty if not p.signing]
        handles = self.store.handles
        step = handles.pin_slice() if handles is not None else max(1, len(dirty))
        for i in range(0, len(dirty), step):
            await self._commit_slice(dirty[i : i + step])

    async def _commit_slice(self, dirty: list[Partition]) -> None:
        # Every partition of the round stays locked until its head is published, so
        # retention and deletion never see the files while the worker writes them.
        # Nothing else holds two partition locks, so taking several cannot deadlock.
        # A quorum-signed partition's lock (and pin) goes to its `_sign_alone` task.
        locked: list[trio.Semaphore] = []
        pinned: list[PartitionLog] = []
        alone = self._signing_tasks is not None
        handed: list[_Share] = []
        done = False
        try:
            work: list[_Share] = []
            for p in dirty:
                await _acquire_shielded(p.lock)
                locked.append(p.lock)
                if p.failed:
                    p.queued.clear()
                    p.notify()  # anyone still waiting on a queued batch learns it failed
                    continue
                if p.queued:
                    try:
                        p.log.pin()  # the worker thread writes it: its files stay open
                    except StorageError as exc:
                        cause = exc.__cause__
                        if isinstance(cause, OSError) and cause.errno in _OUT_OF_DESCRIPTORS:
                            # the process is out of descriptors for now: the queue stays,
                            # and the next round (at the latest the tick) tries again
                            log.warning("partition %s-%d: %s; writing it later", p.topic.name, p.index, exc)
                            continue
                        self.fail_partition(p, f"cannot open its files: {exc}")
                        p.queued.clear()
                        p.notify()
                        continue
                    pinned.append(p.log)
                queued, p.queued = p.queued, []
                if queued:
                    # Written, then prepared, by `_write`: the loop does not touch this
                    # log's write side until the round publishes.
                    p.writing = True
                    work.append(_Share(p, queued, pinned=p.log,
                                       alone=alone and p.log.quorum_sign is not None))
                    continue
                try:
                    job = p.log.prepare_commit()
                except StorageError as exc:  # a damaged archive is read-only: it takes no writes
                    self.fail_partition(p, f"cannot commit: {exc}", retry=_disk_full(exc))
                    continue
                if job is not None:
                    work.append(_Share(p, [], job, alone=alone and p.log.quorum_sign is not None))
            if not work:
                return
            if sum(len(b) for share in work for b, _ in share.queued) < INLINE_ROUND_BYTES:
                # A small round costs less than the two thread switches that would carry
                # it (tens of microseconds of pwrite into the page cache and one
                # signature): it runs here unless an fsync is due.
                _write(work)
                # (a quorum-signed log's head is signed by its replicas, asked from the
                # loop while the job waits in a worker thread: never inline)
                if any(share.job is not None and not share.alone
                       and (share.job_syncs() or share.partition.log.quorum_sign)
                       for share in work):
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(_run, work)
                else:
                    _run(work)
            else:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_write_and_run, work)
            for share in work:
                if share.alone and share.job is not None and share.error is None:
                    # written and hashed with the round; signed and published by its task
                    share.partition.signing = True
                    handed.append(share)
                else:
                    self._finish(share)
            done = True
        finally:
            if not done:  # (a bug: the broker stops) nothing is left held
                for share in handed:
                    share.partition.signing = False
                handed.clear()
            if handed:  # their task releases them
                kept = {id(s.partition.lock) for s in handed}
                locked = [lock for lock in locked if id(lock) not in kept]
                kept = {id(s.pinned) for s in handed}
                pinned = [plog for plog in pinned if id(plog) not in kept]
            for plog in pinned:
                plog.unpin()
            for lock in locked:
                lock.release()
        for share in work:
            if not share.partition.signing:
                share.partition.notify()
        self._data_changed.set()
        self._data_changed = trio.Event()
        for share in handed:
            await self._start_signing(share)

    async def wait_signed(self) -> None:
        """Wait until no quorum head is being signed in a task of its own (`_sign_alone`):
        after a round, every head it prepared is then published (or its partition failed)."""
        while self._signing_count:
            await self._signing_idle.wait()

    async def _start_signing(self, share: _Share) -> None:
        """Hand a quorum-signed partition's prepared head to a task of its own in the
        commit loop's nursery; when that loop just ended (shutdown), sign it here."""
        self._signing_count += 1
        tasks = self._signing_tasks
        if tasks is not None:
            try:
                tasks.start_soon(self._sign_alone, share)
                return
            except RuntimeError:  # the nursery closed meanwhile
                pass
        await self._sign_alone(share)

    async def _sign_alone(self, share: _Share) -> None:
        """Run one quorum-signed partition's commit job (the round wrote and hashed its
        batches; its replicas sign here, within the signing timeout), publish its head or
        take the partition offline (NOT_ENOUGH_REPLICAS, as a round does), then let the
        partition go: the lock and pin the round handed over, and a round for what was
        admitted meanwhile. Finishes even if cancelled, as a round does."""
        p = share.partition
        share.alone = False
        try:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_run, [share], limiter=self._signing_limiter)
            self._finish(share)
        finally:
            p.signing = False
            if share.pinned is not None:
                share.pinned.unpin()
            p.lock.release()
            self._signing_count -= 1
            if not self._signing_count:
                self._signing_idle.set()
                self._signing_idle = trio.Event()
        p.notify()
        self.notify_data()
        if p.queued:
            self.mark_dirty(p)

    def _finish(self, share: _Share) -> None:
        """Publish one partition's new head, or take it offline when its commit failed."""
        p, job, error = share.partition, share.job, share.error
        p.writing = False
        if error is not None:
            if job is not None:
                p.log.abandon(job)
            # Too few replicas signed: the log keeps its unsigned tail (written, not
            # poisoned) and the partition is offline until a quorum of its replicas
            # is alive again (`retry_offline`), when the same leader asks for the
            # same head again, on the same fork. Its batches' producers are told
            # NOT_ENOUGH_REPLICAS_AFTER_APPEND (retriable: written, not yet
            # acknowledged, as Kafka's), produces meanwhile NOT_ENOUGH_REPLICAS.
            short = _quorum_short(error)
            kept = short and p.log.writable
            self.fail_partition(p, f"commit failed: {error}",
                                retry=_disk_full(error) or short,
                                code=NOT_ENOUGH_REPLICAS if short else KAFKA_STORAGE_ERROR,
                                ended_code=NOT_ENOUGH_REPLICAS_AFTER_APPEND if kept else None)
        elif job is not None and not p.failed:
            p.log.publish(job)
            p.settle_unsigned()
            self.cluster.published(p.log.key, signed_blocks(p.log))

    def fail_partition(self, p: Partition, reason: str, *, retry: bool = False,
                       code: int = KAFKA_STORAGE_ERROR, ended_code: int | None = None) -> None:
        """Take a partition offline: its produces get `code` (KAFKA_STORAGE_ERROR, or
        NOT_ENOUGH_REPLICAS when too few replicas signed), the broker lives.
        `retry`: the disk was full, `retry_offline` reopens it once it has room. Any other
        disk error (EIO) keeps it offline until a restart, as Kafka's offline log dir:
        after a failed write-back the page cache no longer tells what is on the disk
        (fsyncgate), and a reopen would sign what it reads there. Waiters of batches not
        published yet are answered `code` now, those its log holds `ended_code` if given
        (`Partition.end_generation`)."""
        p.failed = reason
        p.failed_code = code
        p.retry = retry
        p.end_generation(code, reason, ended_code)
        if retry:
            self._offline[id(p)] = p
        until = " until the broker restarts"
        if retry:
            until = " until its replicas sign again" if code == NOT_ENOUGH_REPLICAS else " until the disk has room"
        log.error("partition %s-%d is offline%s: %s", p.topic.name, p.index, until, reason)

    async def offline_retry_loop(self) -> None:
        while True:
            with trio.move_on_after(OFFLINE_RETRY_S):
                await self._offline_wake.wait()
            self._offline_wake = trio.Event()
            await self.retry_offline()

    def wake_offline(self) -> None:
        """Look at the offline partitions again now rather than at the next tick of
        `offline_retry_loop`: the cluster changed (a replica registered again in etcd),
        so a quorum-signed partition whose commit no quorum signed may take produces
        again (`_resume_signing`). A disk-full partition still waits for its `retry_at`."""
        if self._offline:
            self._offline_wake.set()

    async def retry_offline(self) -> int:
        """Reopen every partition a disk error took offline (a failed commit, retention,
        or recovery write): the reopen recovers it (cuts a torn tail, signs what was
        written but not signed) and, when that can write now, it takes produces again.
        Returns how many came back. The new log is opened in a worker thread; the
        partition stays offline (reads served by the old log) until it is swapped in."""
        back = 0
        for p in list(self._offline.values()):
            topic = p.topic
            if (
                not (p.failed and p.retry)
                or (topic.mirrored and not p.led)
                or self.topics.get(topic.name) is not topic
                or topic.partitions[p.index] is not p
            ):
                del self._offline[id(p)]  # back, no longer retried, deleted or replaced
                continue
            if trio.current_time() < p.retry_at:
                continue
            if p.failed_code == NOT_ENOUGH_REPLICAS and p.log.writable:
                if self._resume_signing(p):
                    back += 1
                continue
            if p.led:  # an elected leader's log is its mirror's copy: not reopened here
                del self._offline[id(p)]
                continue
            async with p.lock:
                if not (p.failed and p.retry) or self.topics.get(topic.name) is not topic:
                    continue
                old = p.log
                config = self.config.log_config(topic.configs)
                new: PartitionLog | None = None
                try:
                    new = await trio.to_thread.run_sync(self.store.open_fresh_log, topic.name, p.index, config)
                except (StorageError, OSError) as exc:
                    log.warning("partition %s-%d still offline: %s", topic.name, p.index, exc)
                if new is None or new.damage is not None:
                    if new is not None:
                        new.discard()
                        if not isinstance(new.damage, RecoveryFailed):  # not the disk: damage
                            self.fail_partition(p, f"archive damaged: {new.damage}")
                        elif not _disk_full(new.damage.cause):  # EIO: wait for a restart
                            self.fail_partition(p, f"storage error: {new.damage}")
                    # A disk that stays full: try less often, up to once a minute.
                    p.retry_delay = min(max(p.retry_delay * 2, OFFLINE_RETRY_S), OFFLINE_RETRY_MAX_S)
                    p.retry_at = trio.current_time() + p.retry_delay
                    continue
                self.store.swap_log(topic.name, p.index, new)
                p.log = new
                p.producers = ProducerStates()
                p.producers.rebuild(producer_headers(new))
                p.txns = rebuild_txns(new)
                p.failed, p.retry, p.retry_delay = None, False, 0.0
                p.settle_unsigned()
                del self._offline[id(p)]
                back += 1
                log.info("partition %s-%d is back online", topic.name, p.index)
            old.discard()  # the new log owns the files now: the old writes nothing
            p.notify()
        if back:
            self.notify_data()
        return back

    def _resume_signing(self, p: Partition) -> bool:
        """A quorum-signed partition whose head no quorum signed (its log kept the unsigned
        tail, not poisoned) takes produces again once a quorum of its replicas is alive
        (etcd's leases: `produce_refusal`), the same leader on the same fork: its next
        commit round asks for a head over the whole tail again. Whether it came back."""
        if self.cluster.produce_refusal(p.topic.name, p.index, p.log, 0) is not None:
            return False
        # batches admitted after the failed round's were dropped unwritten (their offsets
        # are given again): the producer and transaction state is the log's again
        p.producers = ProducerStates()
        p.producers.rebuild(producer_headers(p.log))
        p.txns = rebuild_txns(p.log)
        p.failed, p.retry, p.retry_delay = None, False, 0.0
        del self._offline[id(p)]
        self.mark_dirty(p)
        log.info("partition %s-%d: its replicas can sign again; committing its unsigned tail",
                 p.topic.name, p.index)
        p.notify()
        return True

    async def retention_loop(self) -> None:
        while True:
            await trio.sleep(self.config.log_retention_check_ms / 1000)
            await self.apply_retention()

    async def apply_retention(self) -> int:
        now = ms_now()
        dropped = 0
        for topic in list(self.topics.values()):
            for p in topic.partitions:
                async with p.lock:
                    if p.failed:
                        continue
                    try:
                        dropped += p.log.apply_retention(now)
                    except (StorageError, OSError) as exc:
                        # A failed fsync or unlink while forgetting old segments: as a
                        # failed commit, this partition goes offline, the broker lives.
                        self.fail_partition(p, f"retention failed: {exc}", retry=_disk_full(exc))
                    p.producers.expire(now, PRODUCER_ID_EXPIRATION_MS)
                    p.txns.forget_below(p.log.log_start_offset)
                p.notify()  # a drop commits pending appends first: wake their waiters
        return dropped

    def close(self) -> None:
        """Commit what is pending and close every file (after the server stopped)."""
        if not self._closed:
            self._closed = True
            self.store.close()


@dataclass(eq=False)
class _Share:
    """One partition's part of a commit round: batches to write, then its commit job."""

    partition: Partition
    queued: list[tuple[Any, int]]
    job: CommitJob | None = None
    error: BaseException | None = None
    pinned: PartitionLog | None = None  # the log the round pinned for it (`PartitionLog.pin`)
    # A quorum-signed partition in a commit loop's round: its job waits for its replicas'
    # signatures, so the round only writes (and hashes) it; `Node._sign_alone` runs it.
    alone: bool = False

    def job_syncs(self) -> bool:
        """Whether running the job waits for an fsync."""
        assert self.job is not None
        return self.job.waits_for_fsync()


async def _acquire(lock: trio.Lock | trio.Semaphore) -> None:
    """Take `lock`, without the checkpoint `Lock.acquire` makes when it is free."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


async def _acquire_shielded(lock: trio.Lock | trio.Semaphore) -> None:
    """`_acquire`, and a wait for it that cancellation does not interrupt."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        with trio.CancelScope(shield=True):
            await lock.acquire()


def _write(work: list[_Share]) -> None:
    """Append each partition's queued batches in order and prepare its commit job. One
    partition's disk error does not stop the others."""
    for share in work:
        if not share.queued:
            continue
        plog = share.partition.log
        try:
            for batch, base in share.queued:
                # PartitionLog.append only needs a writable buffer; a memoryview of the
                # request frame avoids copying the batch once more.
                got, _ = plog.append(cast(bytearray, batch))
                if got != base:
                    raise StorageError(f"batch admitted at offset {base} was written at {got}")
            share.job = plog.prepare_commit()
        except Exception as exc:
            share.error = exc


def _run(work: list[_Share]) -> None:
    """Run the prepared commit jobs (hash, index, tree, sign, head, fsync when due); the
    leaves of every partition's new batches are hashed first, all in one native call
    (also those of the jobs left to `Node._sign_alone`, which this does not run)."""
    hash_jobs([s.job for s in work if s.job is not None and s.error is None])
    for share in work:
        if share.job is not None and share.error is None and not share.alone:
            try:
                share.job.run()
            except Exception as exc:
                share.error = exc


def _write_and_run(work: list[_Share]) -> None:
    """Worker thread: a whole round. pwrite, BLAKE2b (above 2 KiB) and fsync release the
    GIL, so the loop keeps receiving the next requests meanwhile."""
    _write(work)
    _run(work)


# Storage failures a reopen may recover from: the call itself was refused, nothing written
# was lost. A full disk (ENOSPC, EDQUOT) and, while recovering, no descriptor left.
_RETRIABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE})


def _quorum_short(exc: BaseException | None) -> bool:
    """Whether a commit failed because too few replicas signed its head (or its signing
    is not set up: nobody asked them)."""
    while exc is not None:
        if isinstance(exc, (NotEnoughSigners, NotQuorumSigned)):
            return True
        exc = exc.__cause__
    return False


def _disk_full(exc: BaseException | None) -> bool:
    """Whether a storage failure was a full disk (or out of descriptors: `_RETRIABLE`),
    the kind `retry_offline` recovers from."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _RETRIABLE:
            return True
        exc = exc.__cause__
    return False


def producer_headers(plog: PartitionLog) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(producerId, epoch, baseSequence, lastOffsetDelta, baseOffset, maxTimestamp) of every
    stored batch that carries a producer id."""
    for header in plog.batch_headers(plog.log_start_offset):
        base_offset = struct.unpack_from(">q", header, 0)[0]
        last_delta = struct.unpack_from(">i", header, 23)[0]
        max_ts = struct.unpack_from(">q", header, 35)[0]
        pid, epoch, base_seq = struct.unpack_from(">qhi", header, 43)
        if pid >= 0:
            yield pid, epoch, base_seq, last_delta, base_offset, max_ts


def ms_now() -> int:
    return math.floor(time.time() * 1000)

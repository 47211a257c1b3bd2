"""The group coordinator's Trio driver: clock, timers, parked requests and persistence.

Wraps the pure `broker.groups.state.Groups`. Every entry point reads the clock once
(`trio.current_time()`, so tests run on an autojump clock), calls the machine, then
`_dispatch`es what it produced: answers for parked JoinGroup/SyncGroup requests (a
`Waiter` per request, awaited by the handler's `Deferred`) and `StoreGroup` effects (a
group metadata record appended to the offsets archive; the machine hears back once the
record is durable). One background task, `run`, sleeps until the earliest deadline of
any group (or until poked) and fires `tick`.

Offsets: OffsetCommit appends one batch of OffsetCommitValue records, waits until a
signed head covers it, then makes the offsets visible (a later record always wins, so
commits that overlap in flight land in log order). Replaying the archive on open
restores every committed offset and every group's last stored generation and members,
who then have one session timeout to heartbeat before they are dropped.

Cluster mode (broker/cluster/): groups are sharded as Kafka shards them. A group maps to a
partition of ``__consumer_offsets`` (`broker.cluster.shards.partition_for`, Kafka's hash,
over ``offsets.topic.num.partitions``); the controller names each partition's coordinator
in etcd (`broker.cluster.shards.place_shards`, started here), and that broker coordinates
the partition's groups. Every broker keeps one offsets archive (all the partitions it
coordinates write there) that every other broker copies. Commits, group metadata and
tombstones are answered once the in-sync peers hold them too (`_wait_stored`, Kafka's
acks=-1 for the offsets topic; refused before the append when the ISR is below the
topic's min.insync.replicas) and then only if a transaction in etcd confirms that the
partition's record still has the revision we claimed it at (its epoch; else
NOT_COORDINATOR, and this broker gives the partition up). `follow_shards`
(broker/cluster/shards.py) watches the records: this broker `take_over`s the partitions
newly named to it (waits for `Cluster.handed_over`, adopts their groups' state from its copy of the archive of the
partition's previous holder, `broker.groups.offsets.adopt`, by log order, never by clocks;
claims them in etcd, a new revision; loads; their groups' requests answer
COORDINATOR_LOAD_IN_PROGRESS meanwhile, `refusal`) and `resign`s those moved elsewhere.

Transactional offsets (Kafka's design): TxnOffsetCommit, sent to the group's coordinator,
keeps a producer's offsets pending, durable in the archive (`PendingKey` records,
broker/groups/records.py; adopted on a takeover like any other key) and not visible; the
transaction coordinator's marker for the group's partition of ``__consumer_offsets``
(WriteTxnMarkers, or a direct call when it is this broker) commits them, written as
OffsetCommitValues in the same batch as the pending record's tombstone, or drops them
(`complete_transaction`). Meanwhile OffsetFetch with require_stable answers
UNSTABLE_OFFSET_COMMIT for them (`pending_offsets`). Each marker carries its transaction
coordinator's epoch; the newest per partition and producer id is kept (a `MarkerKey`
record, written when it grows: replayed and adopted like any key), and a marker of an
older one (a coordinator that lost the transactional id meanwhile) is refused
TRANSACTION_COORDINATOR_FENCED, changing nothing, as Kafka's partition leaders do.

KIP-848 (`consumer_heartbeat`): the machine's consumer-group records (`Groups.records`)
are appended in the order it produced them, and a heartbeat is answered once the records
it caused are stored, as a commit is; so are the JoinGroup, SyncGroup, Heartbeat and
LeaveGroup of a consumer group's classic members (`_answer_when_stored`: those that wrote
nothing once everything appended before them is durable, as Kafka answers a coordinator
write once the log is committed up to it); records a timer produced (a member fenced) are
appended by `_dispatch` with nobody waiting. `_install` rebuilds consumer groups from
`Replayed.consumer_groups`.

Maintenance, a second background task (`maintain`): at start and every
`offsets.retention.check.interval.ms`, expire offsets as Kafka does (KIP-211, decided by
the pure `Groups.expire_offsets`) and write their tombstones; and whenever the archive
holds more superseded records than live ones (checked after every append), compact it
(`compact`; the design is in broker.groups.offsets). Wall-clock time (commit and state
timestamps, expiry) comes from `self.wall`, which tests replace.

Imports trio, the node's types (for typing only; its TopicError at run time, one of a
takeover's retriable errors), `broker.groups.*`; no protocol classes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from broker.cluster import Cluster, signed_blocks
from broker.cluster.etcd import EtcdError
from broker.cluster.shards import (
    TAKEOVER_ERRORS,
    TakeoverNotReady,
    follow_shards,
    named_here,
    partition_for,
    place_shards,
    still_named,
)
from broker.groups import codes, consumer_records
from broker.groups.consumer_group import ConsumerGroup, ConsumerSettings, Heartbeat, HeartbeatResult
from broker.groups.offsets import (
    OFFSETS_TOPIC,
    OffsetsArchive,
    Replayed,
    adopt,
    decode_any_key,
    last_words,
)
from broker.groups.records import (
    GroupValue,
    MarkerKey,
    MemberValue,
    OffsetValue,
    PendingOffset,
    PendingValue,
    RecordFormatError,
    decode_key,
    group_key,
    group_value,
    marker_key,
    marker_value,
    offset_key,
    offset_value,
    pending_key,
    pending_value,
)
from broker.groups.state import (
    CONSUMER_PROTOCOL,
    CommittedOffset,
    Expired,
    Group,
    Groups,
    GroupSettings,
    GroupSummary,
    JoinResult,
    Member,
    State,
    StoreGroup,
    SyncResult,
)

if TYPE_CHECKING:
    from broker.node import Node

log = logging.getLogger("hyperkafka.groups")



class Waiter:
    """One parked JoinGroup or SyncGroup: set once by the machine's outbox."""

    __slots__ = ("_event", "result")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.result: Any = None

    def set(self, result: Any) -> None:
        if not self._event.is_set():
            self.result = result
            self._event.set()

    async def wait(self) -> Any:
        await self._event.wait()
        return self.result


@dataclass
class CommitEntry:
    topic: str
    partition: int
    offset: int
    leader_epoch: int
    metadata: str | None
    error: int = codes.NONE


def wall_ms() -> int:
    return math.floor(time.time() * 1000)


class GroupCoordinator:
    """Create with the node (replays the archive, off the event loop); run `run` in a nursery."""

    def __init__(self, node: Node, settings: GroupSettings | None = None) -> None:
        self.node = node
        self.settings = settings or GroupSettings.from_properties(node.config.static)
        self.groups = Groups(self.settings, consumer_settings=ConsumerSettings.from_properties(node.config.static))
        self.wall: Callable[[], int] = wall_ms
        self.archive = OffsetsArchive(node)
        # The etcd view whose shards of __consumer_offsets this coordinator takes over and
        # serves; None alone, where every group is served from the start (a different way
        # to load, not a null case of taking over: the remaining mode branches below).
        self.sharded: Cluster | None = node.cluster if isinstance(node.cluster, Cluster) else None
        if self.sharded is not None:
            # Compaction keeps tombstones for the topic's delete.retention.ms, as Kafka's
            # cleaner does: a broker that was away may still hold the values they deleted.
            topic = self.archive.partition.topic
            self.archive.tombstone_retention_ms = int(node.config.effective(topic.record.configs, "delete.retention.ms"))
        self._replayed: Replayed | None = self.archive.replay()
        log.info(
            "offsets archive replayed: %d records, %d offsets, %d groups (%d records skipped)",
            self._replayed.records,
            len(self._replayed.offsets),
            len(self._replayed.groups),
            self._replayed.skipped,
        )
        self._wakeup = trio.Event()
        self._maintenance_wanted = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.compactions = 0
        # Cluster mode: the partitions of __consumer_offsets whose groups are in memory
        # and served here -> the revision of their etcd record we claimed them at (their
        # epoch: every ack is fenced by it; any other revision means taking over again).
        # Alone, every group is served from the start.
        self.shards: dict[int, int] = {}
        self.takeovers = 0
        # Transactional offsets (TxnOffsetCommit) awaiting their transaction's marker:
        # group -> producer id -> them, as the archive holds them (`PendingKey` records).
        self.pending: dict[str, dict[int, PendingValue]] = {}
        # The newest epoch a marker of each producer id came with: an older TxnOffsetCommit
        # arriving late would leave offsets pending that no marker will ever end.
        self._marker_epochs: dict[int, int] = {}
        # (partition of __consumer_offsets, producer id) -> the coordinator epoch of the
        # newest transaction marker taken for it (`MarkerKey` records in the archive).
        self.coordinator_epochs: dict[tuple[int, int], int] = {}

    # ------------------------------------------------------------------ driver

    @staticmethod
    def now() -> int:
        return math.floor(trio.current_time() * 1000)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            replayed, self._replayed = self._replayed, None
            if self.sharded is None:
                if replayed is not None:
                    self._install(replayed)
            else:
                membership = self.sharded.membership
                partitions = self.settings.offsets_topic_num_partitions
                nursery.start_soon(place_shards, membership, OFFSETS_TOPIC, partitions)
                from broker.node import TopicError  # (the node imports us): our archive failed

                retriable = (*TAKEOVER_ERRORS, TopicError)
                nursery.start_soon(follow_shards, self.sharded, OFFSETS_TOPIC, self, retriable)
            nursery.start_soon(self.maintain)
            task_status.started()
            try:
                while True:
                    deadline = self.groups.next_deadline()
                    with trio.move_on_at(math.inf if deadline is None else deadline / 1000):
                        await self._wakeup.wait()
                    self._wakeup = trio.Event()
                    self.groups.tick(self.now())
                    # Not a wake-up of our own: that would run this loop again at once,
                    # forever (the top of the loop already re-reads every deadline).
                    self._dispatch(wake=False)
            finally:
                self._nursery = None

    # ------------------------------------------------------------------ cluster mode

    @property
    def loaded(self) -> bool:
        """Whether this broker serves groups now (alone: always; in cluster mode: whether
        it coordinates at least one partition of __consumer_offsets)."""
        return self.sharded is None or bool(self.shards)

    def shard_of(self, group_id: str) -> int:
        """The partition of __consumer_offsets group `group_id` maps to (cluster mode:
        how many partitions etcd records; before any, the configured count). Alone it is
        0: the broker's one offsets archive, the one partition its Metadata lists (a
        transaction names it in DescribeTransactions and its markers go there)."""
        count = self.node.cluster.shard_count(OFFSETS_TOPIC)
        if count is None:
            return 0
        return partition_for(group_id, count or self.settings.offsets_topic_num_partitions)

    def coordinator_of(self, group_id: str) -> int | None:
        """Cluster mode: the broker etcd names coordinator of `group_id` (None: none yet)."""
        return self.node.cluster.coordinator(OFFSETS_TOPIC, self.shard_of(group_id))

    def refusal(self, group_id: str) -> int:
        """NONE when this broker serves group `group_id` now; else what a request for it
        answers: NOT_COORDINATOR on a broker that does not coordinate its partition of
        __consumer_offsets (the client asks FindCoordinator again),
        COORDINATOR_LOAD_IN_PROGRESS while this broker takes the partition over (both
        retriable)."""
        return self.partition_refusal(self.shard_of(group_id))

    def partition_refusal(self, p: int) -> int:
        """`refusal` for every group of partition `p` of __consumer_offsets (also what a
        transaction marker for that partition is answered)."""
        cluster = self.sharded
        if cluster is None:
            return codes.NONE
        record = cluster.membership.shards.get(OFFSETS_TOPIC, {}).get(p)
        if record is None or record.owner != cluster.me or not cluster.membership.lease_valid():
            if p in self.shards:
                self.resign([p])
            return codes.NOT_COORDINATOR
        if p in self.shards and self.shards[p] != record.revision:
            self.resign([p])  # moved away and back meanwhile: take it over again first
        return codes.NONE if p in self.shards else codes.COORDINATOR_LOAD_IN_PROGRESS

    def refusal_all(self) -> int:
        """ListGroups: COORDINATOR_LOAD_IN_PROGRESS while a partition named to this broker
        is not loaded yet, else NONE (it lists the groups of the partitions it serves)."""
        cluster = self.sharded
        if cluster is None:
            return codes.NONE
        mine = named_here(cluster, OFFSETS_TOPIC)
        return codes.COORDINATOR_LOAD_IN_PROGRESS if any(p not in self.shards for p in mine) else codes.NONE

    def resign(self, partitions: Iterable[int] | None = None) -> None:
        """Stop coordinating the groups of these partitions of __consumer_offsets (all:
        None): another broker coordinates them now (its archive, where it adopted our
        state when it took over, carries their offsets from here on)."""
        gone = set(self.shards) if partitions is None else set(partitions)
        for p in gone:
            self.shards.pop(p, None)
        for g in [g for g in self.pending if partitions is None or self.shard_of(g) in gone]:
            del self.pending[g]
        for k in [k for k in self.coordinator_epochs if partitions is None or k[0] in gone]:
            del self.coordinator_epochs[k]
        self.groups.unload([g for g in self.groups.groups if partitions is None or self.shard_of(g) in gone])
        self._dispatch()
        if gone:
            log.info("no longer the coordinator of %s partitions %s", OFFSETS_TOPIC, sorted(gone))

    def _in_shards(self, raw_key: bytes, partitions: Mapping[int, object]) -> bool:
        try:
            # every key of the archive: offsets, group metadata, pending transactional
            # offsets, the KIP-848 consumer group records, and the markers' coordinator
            # epochs (by partition)
            key = decode_any_key(raw_key)
            if isinstance(key, MarkerKey):
                return key.partition in partitions
            return self.shard_of(key.group_id) in partitions
        except RecordFormatError:
            return False

    async def take_over(self, cluster: Cluster, wanted: dict[int, int]) -> bool:
        """Become the coordinator of partitions `wanted` of __consumer_offsets (partition
        -> the revision of the record naming us): wait (at most a session timeout) until
        our copy of every live peer's offsets archive holds what that peer has; adopt
        from the archive of each partition's previous holder (its etcd record says who)
        every key of its groups whose last word differs from ours
        (`broker.groups.offsets.adopt`: its log order, no clocks), writing them into our
        own archive; then claim the partitions in etcd (one transaction comparing each
        record's revision: a new revision, their epoch) and load their groups. Their
        groups' requests answer COORDINATOR_LOAD_IN_PROGRESS meanwhile. Whether they
        were claimed (not: they were moved again meanwhile, or our lease is gone)."""
        started = trio.current_time()
        if not await cluster.wait_handed_over(cluster.session_s):
            log.warning("taking over groups with copies of the peers' offsets that may be behind")
        wanted, by_holder = still_named(cluster, OFFSETS_TOPIC, wanted)
        if not wanted:
            return False
        adopted = []
        own = {k: w for k, w in self.archive.words().items() if self._in_shards(w.key, wanted)}
        for holder, parts in sorted(by_holder.items()):
            copy = cluster.offsets_copies.get(holder)
            if copy is None:
                raise TakeoverNotReady(f"no copy of the offsets archive of broker {holder}, the previous coordinator")
            words = last_words(copy.log, name=f"{OFFSETS_TOPIC} of broker {holder}")
            theirs = {k: w for k, w in words.items() if self._in_shards(w.key, dict.fromkeys(parts))}
            adopted += adopt({k: w for k, w in own.items() if self._in_shards(w.key, dict.fromkeys(parts))}, theirs)
        if adopted:
            # Durable here is enough to serve them (as Kafka's load needs no acks): the
            # peers copy them from our archive as they copy everything else.
            span = self.archive.adopt(adopted)
            assert span is not None
            await self._wait_durable(span[1])
        revision = await cluster.membership.claim_shards(OFFSETS_TOPIC, wanted)
        if revision is None:
            return False  # fenced: moved again meanwhile (the loop looks again at the next change)
        replayed = self.archive.replay()
        self._install(replayed, set(wanted))
        self.shards.update(dict.fromkeys(wanted, revision))
        self._dispatch()
        self.takeovers += 1
        log.info("group coordinator of %s partitions %s now, revision %d (took over in %.2fs): "
                 "%d records adopted from brokers %s", OFFSETS_TOPIC, sorted(wanted), revision,
                 trio.current_time() - started, len(adopted), sorted(by_holder) or "-")
        return True

    async def _wait_durable(self, last: int) -> None:
        """Records the coordinator copies (compaction, records adopted from the peers):
        wait until a signed head covers them."""
        with trio.fail_after(max(self.settings.offset_commit_timeout_ms / 1000, 1) * 6):
            await self.archive.wait_durable(last)

    def _fence(self, group_ids: Iterable[str]) -> dict[int, int] | None:
        """Cluster mode: the partitions of these groups -> the revision we serve them at
        (what `_wait_stored` has etcd compare); None when one is not served here. Alone: {}."""
        if self.sharded is None:
            return {}
        fence: dict[int, int] = {}
        for g in group_ids:
            p = self.shard_of(g)
            revision = self.shards.get(p)
            if revision is None:
                return None
            fence[p] = revision
        return fence

    async def _wait_stored(self, last: int, fence: dict[int, int] | None) -> int:
        """Wait until a signed head covers offset `last` of the archive and, in cluster mode,
        every in-sync peer holds it (Kafka writes the offsets topic with acks=-1); the
        error to answer: NONE, REQUEST_TIMED_OUT, COORDINATOR_NOT_AVAILABLE (a storage
        failure, or fewer than min.insync.replicas copies: Kafka maps
        NOT_ENOUGH_REPLICAS(_AFTER_APPEND) to it for commits), or NOT_COORDINATOR when
        `fence` (`_fence`, taken before the append) no longer holds in etcd."""
        if fence is None:
            return codes.NOT_COORDINATOR
        with trio.move_on_after(self.settings.offset_commit_timeout_ms / 1000):
            try:
                await self.archive.wait_durable(last)
            except Exception as exc:
                log.error("%s not durable: %s", OFFSETS_TOPIC, exc)
                return codes.COORDINATOR_NOT_AVAILABLE
            cluster = self.node.cluster
            plog = self.archive.partition.log
            if not await cluster.wait_replicated(plog.key, signed_blocks(plog), self._min_insync):
                return codes.COORDINATOR_NOT_AVAILABLE
            # Fencing: answered only while the records of the partitions concerned still
            # have the revision we claimed them at, so a coordinator that was paused or
            # cut off acknowledges nothing once the controller moved them (it steps down).
            # (alone, nobody else acts: it always holds)
            try:
                still = await cluster.check_fence(OFFSETS_TOPIC, fence)
            except EtcdError as exc:
                log.warning("cannot check the coordinator's epoch in etcd: %s", exc)
                return codes.COORDINATOR_NOT_AVAILABLE
            if not still:
                self.resign([p for p, rev in fence.items() if self.shards.get(p) == rev])
                return codes.NOT_COORDINATOR
            return codes.NONE
        return codes.REQUEST_TIMED_OUT

    @property
    def _min_insync(self) -> int:
        # The offsets topic's min.insync.replicas: the broker default, as Kafka creates
        # __consumer_offsets without an override of it.
        return self.archive.partition.topic.min_insync_replicas

    def _append_replicated(self, records: Sequence[tuple[bytes, bytes | None]], now_wall: int) -> tuple[int, int]:
        """Append records that `_wait_stored` will wait for; (first, last) offsets. In
        cluster mode, raise (OSError) instead when our archive has fewer in-sync replicas
        than min.insync.replicas, as Kafka refuses such a write before appending it
        (NOT_ENOUGH_REPLICAS)."""
        if self.node.cluster.short_of_insync(self.archive.partition.log.key, self._min_insync) is not None:
            raise OSError(f"fewer in-sync replicas of {OFFSETS_TOPIC} than min.insync.replicas={self._min_insync}")
        span = self.archive.append(records, now_wall)
        self._check_compaction()
        return span

    def _install(self, replayed: Replayed, partitions: set[int] | None = None) -> None:
        """Load the groups of `replayed` (only those of these partitions of
        __consumer_offsets, when given: the others are served from memory or elsewhere)."""
        now = self.now()
        for group_id, value in replayed.groups.items():
            if partitions is not None and self.shard_of(group_id) not in partitions:
                continue
            protocol = value.protocol
            members = [
                Member(
                    m.member_id,
                    m.group_instance_id,
                    m.client_id,
                    m.client_host,
                    m.rebalance_timeout_ms,
                    m.session_timeout_ms,
                    value.protocol_type,
                    [(protocol, m.subscription)] if protocol is not None else [],
                    m.assignment,
                )
                for m in value.members
            ]
            group = self.groups.load_group(now, group_id, value.protocol_type, value.generation_id, protocol, value.leader, members)
            if group.is_(State.EMPTY) and value.current_state_timestamp >= 0:
                group.current_state_timestamp = value.current_state_timestamp
        for group_id, records in replayed.consumer_groups.items():
            if partitions is not None and self.shard_of(group_id) not in partitions:
                continue
            group = self.groups.get_or_create(group_id)
            if group.members:
                continue  # the classic record is the newer word here
            consumer = ConsumerGroup(group_id, self.groups.consumer_settings, self.groups.records)
            consumer.load(now, records, self._topic, self._topic_names)
            group.consumer, group.protocol_type = consumer, CONSUMER_PROTOCOL
        for (group_id, producer_id), pending in replayed.pending.items():
            if partitions is None or self.shard_of(group_id) in partitions:
                self.pending.setdefault(group_id, {})[producer_id] = pending
        for (p, producer_id), coordinator_epoch in replayed.marker_epochs.items():
            if partitions is None or p in partitions:
                self.coordinator_epochs[(p, producer_id)] = coordinator_epoch
        for (group_id, topic, partition), (v, record_offset) in replayed.offsets.items():
            if partitions is not None and self.shard_of(group_id) not in partitions:
                continue
            group = self.groups.get_or_create(group_id)
            group.offsets[(topic, partition)] = CommittedOffset(
                v.offset, v.leader_epoch, v.metadata, v.commit_timestamp, record_offset, v.expire_timestamp
            )

    def _dispatch(self, *, wake: bool = True) -> None:
        outbox, self.groups.outbox = self.groups.outbox, []
        for waiter, result in outbox:
            if isinstance(waiter, Waiter):
                waiter.set(result)
        effects, self.groups.effects = self.groups.effects, []
        for effect in effects:
            self._store_group(effect)
        if self.groups.records:
            # Consumer-group records a timer produced (a member fenced): nothing waits.
            try:
                self._flush_records()
            except Exception as exc:
                log.error("cannot store consumer group records: %s", exc)
        if wake:  # a handler changed the groups: their deadlines may have moved
            self._wakeup.set()

    def _store_group(self, effect: StoreGroup) -> None:
        group = self.groups.get(effect.group_id)
        if group is None:
            return
        now_wall = self.wall()
        if group.is_(State.EMPTY):
            group.current_state_timestamp = now_wall  # the record says the same (KIP-211)
        value = _group_value(group, effect.assignment, now_wall)
        fence = self._fence([effect.group_id])
        try:
            _, last = self._append_replicated([(group_key(group.group_id), group_value(value))], now_wall)
        except Exception as exc:
            log.error("cannot store group %s: %s", group.group_id, exc)
            self.groups.group_stored(self.now(), effect.group_id, effect.generation_id, effect.assignment, codes.COORDINATOR_NOT_AVAILABLE)
            return

        async def stored() -> None:
            error = await self._wait_stored(last, fence)
            if error != codes.NONE:
                log.error("group %s metadata not stored: error %d", effect.group_id, error)
            self.groups.group_stored(self.now(), effect.group_id, effect.generation_id, effect.assignment, error)
            self._dispatch()

        if self._nursery is None:
            raise RuntimeError("the group coordinator is not running (start GroupCoordinator.run)")
        self._nursery.start_soon(stored)

    def _flush_records(self) -> int | None:
        """Append the consumer-group records the machine produced; the last offset."""
        records, self.groups.records[:] = list(self.groups.records), []
        if not records:
            return None
        _, last = self._append_replicated(records, self.wall())
        return last

    # ------------------------------------------------------------------ KIP-848

    def _topic(self, name: str) -> tuple[uuid.UUID, int] | None:
        topic = self.node.topics.get(name)
        return None if topic is None else (topic.topic_id, len(topic.partitions))

    def _topic_names(self) -> list[str]:
        # Internal topics never match a subscription pattern (Kafka's either).
        return [name for name in self.node.topics if not name.startswith("__")]

    async def consumer_heartbeat(self, hb: Heartbeat) -> HeartbeatResult:
        """ConsumerGroupHeartbeat: run the machine, then answer once its records are
        stored (a signed head covers them; in a cluster, the in-sync peers hold them)."""
        fence = self._fence([hb.group_id])  # taken before the append, as a commit's
        result = self.groups.consumer_heartbeat(self.now(), hb, self._topic, self._topic_names)
        try:
            last = self._flush_records()
        except Exception as exc:
            log.error("cannot store consumer group %s: %s", hb.group_id, exc)
            last, error = None, codes.COORDINATOR_NOT_AVAILABLE
        else:
            error = codes.NONE
        self._dispatch()
        if error == codes.NONE and last is not None:
            error = await self._wait_stored(last, fence)
        if error != codes.NONE and result.error == codes.NONE:
            return HeartbeatResult(error, "The group's records could not be stored.")
        return result

    def consumer_group(self, group_id: str) -> ConsumerGroup | None:
        group = self.groups.get(group_id)
        return None if group is None else group.consumer

    # ------------------------------------------------------------------ membership

    def join(self, group_id: str, member_id: str, group_instance_id: str | None, protocol_type: str,
             protocols: list[tuple[str, bytes]], **kw: Any) -> JoinResult | Waiter:
        mixed = self._mixed(group_id)
        waiter = Waiter()
        result = self.groups.join(self.now(), group_id, member_id, group_instance_id, protocol_type, protocols, waiter,
                                  lookup=self._topic, names=self._topic_names, **kw)
        if mixed and result is not None:
            return self._answer_when_stored(group_id, result, lambda error: JoinResult(error, ""))
        self._dispatch()
        return waiter if result is None else result

    def sync(self, group_id: str, generation_id: int, member_id: str, group_instance_id: str | None,
             assignments: Mapping[str, bytes], **kw: Any) -> SyncResult | Waiter:
        mixed = self._mixed(group_id)
        waiter = Waiter()
        result = self.groups.sync(self.now(), group_id, generation_id, member_id, group_instance_id, assignments, waiter, **kw)
        if mixed and result is not None:
            return self._answer_when_stored(group_id, result, SyncResult)
        self._dispatch()
        return waiter if result is None else result

    def heartbeat(self, group_id: str, generation_id: int, member_id: str, group_instance_id: str | None) -> int | Waiter:
        mixed = self._mixed(group_id)
        error = self.groups.heartbeat(self.now(), group_id, generation_id, member_id, group_instance_id)
        if mixed:
            return self._answer_when_stored(group_id, error, lambda refused: refused)
        self._dispatch()
        return error

    def leave(self, group_id: str, members: Iterable[tuple[str, str | None]]) -> tuple[int, list[int]] | Waiter:
        mixed = self._mixed(group_id)
        result = self.groups.leave(self.now(), group_id, members)
        if mixed:
            return self._answer_when_stored(group_id, result, lambda error: (error, []))
        self._dispatch()
        return result

    def _mixed(self, group_id: str) -> bool:
        """Whether the classic requests of `group_id` are served by its consumer group
        (KIP-848's mixed group), whose answers wait for what they wrote."""
        group = self.groups.get(group_id)
        return group is not None and group.consumer is not None

    def _answer_when_stored(self, group_id: str, answer: Any, refused: Callable[[int], Any]) -> Waiter:
        """The answer to a classic member of a consumer group, given once the records its
        request caused, and everything appended before them, are stored (Kafka answers
        a coordinator's write once the log is committed up to it, whether it wrote
        records or not), so a crash after the answer loses nothing the member was told;
        else `refused(error)` with Kafka's mapping (a timeout is COORDINATOR_NOT_AVAILABLE)."""
        fence = self._fence([group_id])
        waiter = Waiter()
        try:
            last = self._flush_records()
        except Exception as exc:
            log.error("cannot store consumer group %s: %s", group_id, exc)
            self._dispatch()
            waiter.set(refused(codes.COORDINATOR_NOT_AVAILABLE))
            return waiter
        self._dispatch()
        if last is not None:
            # And what the dispatch appended after them (a downgrade's classic record).
            last = max(last, self.archive.partition.log.log_end_offset - 1)

        async def stored() -> None:
            error = await (self._wait_stored(last, fence) if last is not None else self._wait_caught_up())
            if error == codes.REQUEST_TIMED_OUT:
                error = codes.COORDINATOR_NOT_AVAILABLE
            waiter.set(answer if error == codes.NONE else refused(error))

        if self._nursery is None:
            raise RuntimeError("the group coordinator is not running (start GroupCoordinator.run)")
        self._nursery.start_soon(stored)
        return waiter

    async def _wait_caught_up(self) -> int:
        """Wait until everything appended to the archive so far is durable: NONE,
        REQUEST_TIMED_OUT, or COORDINATOR_NOT_AVAILABLE when the archive failed."""
        plog = self.archive.partition.log
        end = plog.log_end_offset - 1
        if end < plog.log_start_offset:
            return codes.NONE
        with trio.move_on_after(self.settings.offset_commit_timeout_ms / 1000):
            try:
                await self.archive.wait_durable(end)
            except Exception as exc:
                log.error("%s not durable: %s", OFFSETS_TOPIC, exc)
                return codes.COORDINATOR_NOT_AVAILABLE
            return codes.NONE
        return codes.REQUEST_TIMED_OUT

    def describe(self, group_id: str) -> GroupSummary:
        group = self.groups.get(group_id)
        if group is None:
            return GroupSummary(group_id, State.DEAD.value, "", "", ())
        return group.summary()

    def list_groups(self, states: Iterable[str] = (), types: Iterable[str] = ()) -> list[tuple[str, str, str]]:
        return self.groups.list_groups(states, types)

    # ------------------------------------------------------------------ offsets

    async def commit_offsets(self, group_id: str, generation_id: int, member_id: str,
                             group_instance_id: str | None, entries: Sequence[CommitEntry], *,
                             api_version: int = 8, retention_time_ms: int = -1) -> None:
        """Validate, append, wait until durable, then publish; fills each entry's `error`.
        `retention_time_ms` (OffsetCommit v2-v4; -1 = the broker's) gives the offsets an
        explicit expiry, as Kafka still honours for those versions."""
        group, error = self.groups.validate_offset_commit(self.now(), group_id, generation_id, member_id, group_instance_id, api_version)
        self._dispatch()
        if group is None:
            for e in entries:
                e.error = error
            return
        now_wall = self.wall()
        expire = None if retention_time_ms == -1 else now_wall + retention_time_ms
        to_write: list[CommitEntry] = []
        for e in entries:
            if e.error != codes.NONE:
                continue
            if e.metadata is not None and len(e.metadata.encode("utf-8")) > self.settings.offset_metadata_max_bytes:
                e.error = codes.OFFSET_METADATA_TOO_LARGE
            elif self.node.partition(e.topic, e.partition) is None:
                e.error = codes.UNKNOWN_TOPIC_OR_PARTITION
            else:
                to_write.append(e)
        if not to_write:
            return
        records = [
            (
                offset_key(group_id, e.topic, e.partition),
                offset_value(OffsetValue(e.offset, e.leader_epoch, e.metadata or "", now_wall, expire)),
            )
            for e in to_write
        ]
        partitions = [(e.topic, e.partition) for e in to_write]
        group.begin_offset_commit(partitions)  # not expired while in flight
        fence = self._fence([group_id])
        try:
            try:
                base, last = self._append_replicated(records, now_wall)
            except Exception as exc:
                log.error("cannot append offsets of group %s: %s", group_id, exc)
                for e in to_write:
                    e.error = codes.COORDINATOR_NOT_AVAILABLE
                return
            error = await self._wait_stored(last, fence)
            if error != codes.NONE:
                for e in to_write:
                    e.error = error
                return
        finally:
            group.end_offset_commit(partitions)
        if self.groups.get(group_id) is not group:
            # DeleteGroups ran meanwhile: its tombstones follow our records in the archive,
            # so a replay would not have these offsets; memory must not either (Kafka too
            # drops a commit whose group went Dead before the append completed).
            return
        live = group
        for i, e in enumerate(to_write):
            key = (e.topic, e.partition)
            current = live.offsets.get(key)
            record_offset = base + i
            if current is None or current.record_offset < record_offset:
                live.offsets[key] = CommittedOffset(e.offset, e.leader_epoch, e.metadata or "", now_wall, record_offset, expire)

    async def commit_transactional(self, group_id: str, offsets: Sequence[tuple[str, int, int, int, str]]) -> int:
        """Offsets of a committed transaction ((topic, partition, offset, leader epoch,
        metadata) each): appended, then visible once durable, like OffsetCommit's but
        without a member check (TxnOffsetCommit checked it; the transaction coordinator
        calls this when the commit is decided, broker/transactions). The error code."""
        if not offsets:
            return codes.NONE
        now_wall = self.wall()
        records = [(offset_key(group_id, t, p), offset_value(OffsetValue(o, e, m, now_wall, None))) for t, p, o, e, m in offsets]
        fence = self._fence([group_id])
        try:
            base, last = self._append_replicated(records, now_wall)
        except Exception as exc:
            log.error("cannot append transactional offsets of group %s: %s", group_id, exc)
            return codes.COORDINATOR_NOT_AVAILABLE
        error = await self._wait_stored(last, fence)
        if error != codes.NONE:
            return error
        group = self.groups.get_or_create(group_id)
        for i, (t, p, o, e, m) in enumerate(offsets):
            current = group.offsets.get((t, p))
            if current is None or current.record_offset < base + i:
                group.offsets[(t, p)] = CommittedOffset(o, e, m, now_wall, base + i, None)
        return codes.NONE

    # ------------------------------------------------------------------ transactional offsets

    def pending_offsets(self, group_id: str) -> set[tuple[str, int]]:
        """The (topic, partition)s of `group_id` with transactional offsets awaiting their
        transaction's marker: OffsetFetch with require_stable answers
        UNSTABLE_OFFSET_COMMIT for them, as Kafka's OffsetMetadataManager does."""
        return {(o.topic, o.partition) for v in self.pending.get(group_id, {}).values() for o in v.offsets}

    async def txn_offset_commit(self, group_id: str, producer_id: int, producer_epoch: int,
                                offsets: Sequence[PendingOffset]) -> int:
        """TxnOffsetCommit, at the group's coordinator (the caller checked the member and
        the transaction): the offsets are kept pending, durable in the archive (one
        `PendingKey` record per group and producer, merged with what this transaction
        committed before), until the transaction coordinator's marker for the group's
        partition of __consumer_offsets commits or drops them (`complete_transaction`).
        The error code."""
        error = self.refusal(group_id)
        if error != codes.NONE:
            return error
        by_pid = self.pending.get(group_id, {})
        current = by_pid.get(producer_id)
        if producer_epoch < self._marker_epochs.get(producer_id, -1) or (
            current is not None and producer_epoch < current.producer_epoch
        ):
            return codes.INVALID_PRODUCER_EPOCH
        merged = {} if current is None or current.producer_epoch != producer_epoch else {
            (o.topic, o.partition): o for o in current.offsets
        }
        merged.update(((o.topic, o.partition), o) for o in offsets)
        value = PendingValue(producer_epoch, tuple(merged.values()))
        fence = self._fence([group_id])
        try:
            _, last = self._append_replicated([(pending_key(group_id, producer_id), pending_value(value))], self.wall())
        except Exception as exc:
            log.error("cannot append transactional offsets of group %s: %s", group_id, exc)
            return codes.COORDINATOR_NOT_AVAILABLE
        # In memory at once, in log order: the next TxnOffsetCommit of this transaction
        # merges with this one even while it is in flight (the archive's last word wins
        # at a replay, and it is the newer record).
        self.pending.setdefault(group_id, {})[producer_id] = value
        return await self._wait_stored(last, fence)

    async def complete_transaction(
        self, producer_id: int, producer_epoch: int, commit: bool, partition: int, coordinator_epoch: int
    ) -> int:
        """A transaction marker (WriteTxnMarkers) for `partition` of __consumer_offsets:
        the pending offsets of `producer_id` in the groups of that partition are committed
        (written as OffsetCommitValues, their pending record tombstoned in the same batch)
        or dropped (tombstoned), and visible once stored as a commit is. Pending offsets
        of a newer epoch than the marker's are a later transaction's: kept. A marker whose
        `coordinator_epoch` is older than the last one taken for this producer and
        partition is refused TRANSACTION_COORDINATOR_FENCED and changes nothing; a newer
        one is recorded (`MarkerKey`) with whatever the marker writes. A marker that finds
        nothing (a retry) succeeds. The error code."""
        error = self.partition_refusal(partition)
        if error != codes.NONE:
            return error
        known = self.coordinator_epochs.get((partition, producer_id), -1)
        if coordinator_epoch < known:
            log.warning("transaction marker of producer %d for %s-%d refused: coordinator epoch %d, %d known",
                        producer_id, OFFSETS_TOPIC, partition, coordinator_epoch, known)
            return codes.TRANSACTION_COORDINATOR_FENCED
        if producer_epoch > self._marker_epochs.get(producer_id, -1):
            self._marker_epochs[producer_id] = producer_epoch
        ending = {
            g: v
            for g, by_pid in self.pending.items()
            if (v := by_pid.get(producer_id)) is not None
            and v.producer_epoch <= producer_epoch
            and self.shard_of(g) == partition
        }
        newer = coordinator_epoch > known
        if not ending and not newer:
            return codes.NONE
        now_wall = self.wall()
        records: list[tuple[bytes, bytes | None]] = []
        if newer:
            records.append((marker_key(partition, producer_id), marker_value(coordinator_epoch, producer_epoch)))
        written: list[tuple[str, PendingOffset, int]] = []  # (group, offset, index in the batch)
        for g, v in ending.items():
            if commit:
                for o in v.offsets:
                    written.append((g, o, len(records)))
                    records.append((offset_key(g, o.topic, o.partition),
                                    offset_value(OffsetValue(o.offset, o.leader_epoch, o.metadata, now_wall, None))))
            records.append((pending_key(g, producer_id), None))
        fence = self._fence(ending)
        if fence is not None and self.sharded is not None:
            revision = self.shards.get(partition)
            fence = None if revision is None else {**fence, partition: revision}
        try:
            base, last = self._append_replicated(records, now_wall)
        except Exception as exc:
            log.error("cannot append the transaction marker of producer %d: %s", producer_id, exc)
            return codes.COORDINATOR_NOT_AVAILABLE
        if newer:  # at once, in log order: a stale marker meanwhile is refused
            self.coordinator_epochs[(partition, producer_id)] = max(
                coordinator_epoch, self.coordinator_epochs.get((partition, producer_id), -1)
            )
        error = await self._wait_stored(last, fence)
        if error != codes.NONE:
            return error
        for g, v in ending.items():
            by_pid = self.pending.get(g, {})
            if by_pid.get(producer_id) is v:
                del by_pid[producer_id]
                if not by_pid:
                    del self.pending[g]
        for g, o, i in written:
            group = self.groups.get_or_create(g)
            current = group.offsets.get((o.topic, o.partition))
            if current is None or current.record_offset < base + i:
                group.offsets[(o.topic, o.partition)] = CommittedOffset(
                    o.offset, o.leader_epoch, o.metadata, now_wall, base + i, None)
        return codes.NONE

    def fetch_offsets(self, group_id: str, wanted: Sequence[tuple[str, Sequence[int]]] | None) -> dict[str, dict[int, CommittedOffset | None]]:
        """topic -> partition -> committed offset (None: nothing committed). `wanted` None
        means every partition the group committed."""
        group = self.groups.get(group_id)
        offsets = group.offsets if group is not None else {}
        out: dict[str, dict[int, CommittedOffset | None]] = {}
        if wanted is None:
            for (topic, partition), committed in sorted(offsets.items()):
                out.setdefault(topic, {})[partition] = committed
            return out
        for topic, partitions in wanted:
            parts = out.setdefault(topic, {})
            for p in partitions:
                parts[p] = offsets.get((topic, p))
        return out

    async def delete_groups(self, group_ids: Sequence[str]) -> dict[str, int]:
        groups = {gid: self.groups.get(gid) for gid in group_ids}
        results = self.groups.delete_groups(group_ids)
        tombstones: list[tuple[bytes, bytes | None]] = []
        for gid, error in results.items():
            group = groups.get(gid)
            if error == codes.NONE and group is not None:
                tombstones.extend((offset_key(gid, t, p), None) for t, p in group.offsets)
                tombstones.append((group_key(gid), None))
                if group.consumer is not None:
                    tombstones.extend(group.consumer.tombstones())
        self._dispatch()
        if tombstones:
            await self._write_tombstones(tombstones)
        return results

    async def delete_offsets(self, group_id: str, partitions: Sequence[tuple[str, int]]) -> tuple[int, dict[tuple[str, int], int]]:
        error, per_partition = self.groups.deletable_offsets(group_id, partitions)
        group = self.groups.get(group_id)
        if error != codes.NONE or group is None:
            return error, per_partition
        doomed = [tp for tp, e in per_partition.items() if e == codes.NONE and tp in group.offsets]
        for tp in doomed:
            del group.offsets[tp]
        if doomed:
            await self._write_tombstones([(offset_key(group_id, t, p), None) for t, p in doomed])
        return error, per_partition

    async def _write_tombstones(self, tombstones: list[tuple[bytes, bytes | None]]) -> None:
        groups = set()
        for raw_key, _ in tombstones:
            with contextlib.suppress(RecordFormatError):
                key = decode_key(raw_key)
                if not isinstance(key, MarkerKey):  # (only offset keys are given)
                    groups.add(key.group_id)
        fence = self._fence(groups)
        try:
            _, last = self.archive.append(tombstones, self.wall())
            self._check_compaction()
            error = await self._wait_stored(last, fence)
            if error != codes.NONE:
                log.error("%d tombstones not stored everywhere: error %d", len(tombstones), error)
        except Exception as exc:  # the in-memory delete stands; a restart may bring them back
            log.error("cannot write %d tombstones: %s", len(tombstones), exc)


    # ------------------------------------------------------------------ maintenance

    async def maintain(self) -> None:
        """Expire offsets at start and every check interval; compact when asked."""
        interval = self.settings.offsets_retention_check_interval_ms / 1000
        deadline = trio.current_time()
        compact_after = -math.inf  # after a compaction that freed nothing: wait an interval
        while True:
            with trio.move_on_at(deadline):
                await self._maintenance_wanted.wait()
            self._maintenance_wanted = trio.Event()
            now = trio.current_time()
            if now >= deadline:
                deadline = now + interval
                try:
                    await self.expire_offsets()
                except Exception:  # one failed pass must not end the coordinator
                    log.exception("offset expiry failed")
            if now >= compact_after and self.archive.needs_compaction(self.settings.offsets_compaction_min_dirty_records):
                dropped = 0
                try:
                    dropped = await self.compact()
                except Exception:
                    log.exception("offsets archive compaction failed")
                if not dropped:
                    # Another copy now would only add to the archive (nothing was dropped,
                    # or nothing is live): try again at the next check.
                    compact_after = trio.current_time() + interval

    async def expire_offsets(self) -> Expired:
        """One expiry pass: forget expired offsets and empty groups, write tombstones."""
        expired = self.groups.expire_offsets(self.wall())
        self._dispatch()
        tombstones: list[tuple[bytes, bytes | None]] = [
            (key, None) for g, t, p in expired.offsets if self.archive.holds(key := offset_key(g, t, p))
        ]
        tombstones += [(key, None) for g in expired.groups if self.archive.holds(key := group_key(g))]
        tombstones += [
            (key, None)
            for g in expired.groups
            for t in (consumer_records.TARGET_METADATA, consumer_records.GROUP_METADATA)
            if self.archive.holds(key := consumer_records.key(t, g))
        ]
        if tombstones:
            await self._write_tombstones(tombstones)
        return expired

    def _check_compaction(self) -> None:
        if self.archive.needs_compaction(self.settings.offsets_compaction_min_dirty_records):
            self._maintenance_wanted.set()

    async def compact(self, *, drop: bool = True) -> int:
        """Copy every live record forward and drop the segments below the copy (see
        broker.groups.offsets). Returns the segments dropped. `drop=False` stops after
        the copy is durable (tests: the crash window)."""
        span = await self.archive.write_snapshot(self.wall())
        if span is None:
            return 0
        first, last = span
        await self._wait_durable(last)
        if not drop:
            return 0
        dropped = await self.archive.drop_below(first)
        self.compactions += 1
        plog = self.archive.partition.log
        log.info("compacted %s: %d live records from offset %d, %d segments dropped, log start %d",
                 "__consumer_offsets", len(self.archive.live), first, dropped, plog.log_start_offset)
        return dropped


def _group_value(group: Group, assignment: Mapping[str, bytes] | None, now_wall: int) -> GroupValue:
    protocol = group.protocol_name
    members = tuple(
        MemberValue(
            m.member_id,
            m.group_instance_id,
            m.client_id,
            m.client_host,
            m.rebalance_timeout_ms,
            m.session_timeout_ms,
            m.metadata(protocol) if protocol is not None else b"",
            (assignment or {}).get(m.member_id, m.assignment),
        )
        for m in group.members.values()
    ) if group.state in (State.STABLE, State.COMPLETING_REBALANCE) else ()
    return GroupValue(group.protocol_type or "", group.generation_id, protocol, group.leader_id, now_wall, members)

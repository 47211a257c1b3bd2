"""The classic consumer-group protocol as a pure state machine (Kafka's GroupCoordinator).

Theory of operation. A group moves through Kafka's five states:

    Empty --join--> PreparingRebalance --all joined / timeout--> CompletingRebalance
      ^                  ^      |                                      |
      |                  |      +--no members left--> Empty            | leader's SyncGroup
      |                  +----member joins, leaves, dies, changes------+ (assignment stored)
      +----------------------------------------------------------- Stable
    (any) --DeleteGroups while Empty--> Dead

A JoinGroup or SyncGroup that cannot be answered yet is *parked*: the caller hands in an
opaque waiter, and the answer appears later in `Groups.outbox` as `(waiter, result)`.
Work the machine needs from the outside world (persist the group's metadata before the
assignment is handed out) appears in `Groups.effects`; the driver does it and calls back
(`group_stored`). Time is an argument (`now`, monotonic milliseconds): every timer is a
deadline the driver reads from `next_deadline()` and fires with `tick(now)`:

- a member's heartbeat deadline (session timeout; 5 minutes for a member still in its
  first join), Kafka's DelayedHeartbeat: a member parked in JoinGroup or SyncGroup is
  kept alive by the rebalance, anyone else is removed when it passes;
- a pending member's deadline (issued a member id by MEMBER_ID_REQUIRED, never came back);
- the join phase: `group.initial.rebalance.delay.ms` (extended while new members keep
  arriving, up to the rebalance timeout) when the group was Empty, else the rebalance
  timeout (the largest of the members'), after which members that did not rejoin are
  removed (InitialDelayedJoin / DelayedJoin);
- the sync phase: members that got their JoinGroup answer but never sent SyncGroup within
  the rebalance timeout are removed and the group rebalances again (DelayedSync).

Offsets expire in `expire_offsets(now_wall)` (KIP-211, Kafka's offsetExpirationCondition):
the only entry point that takes the wall clock, because commit timestamps and the time a
group became Empty (`Group.current_state_timestamp`, written into the group's record) are
wall-clock times that survive a restart; offsets with a commit in flight never expire.

Error semantics follow Kafka 3.x exactly (REBALANCE_IN_PROGRESS, UNKNOWN_MEMBER_ID,
ILLEGAL_GENERATION, FENCED_INSTANCE_ID ...). Where Kafka would leave a request unanswered
forever (a second JoinGroup replacing a parked one, a member removed while parked in
SyncGroup) we answer the abandoned request with an error instead, because here the
connection that sent it is not muted and later replies queue behind it.

A group of the KIP-848 consumer protocol is a `Group` holding a `ConsumerGroup`
(`Group.consumer`, broker.groups.consumer_group): the classic entry points serve its
classic members (KIP-848's mixed group, after an online upgrade: `Groups._upgrade`), and
the shared ones (offsets, listing, deletion, expiry, timers) defer to it.

Imports only the standard library, `broker.groups.codes` and the pure
`broker.groups.consumer_group`: no trio, no storage, no protocol classes.
"""

from __future__ import annotations

import enum
import logging
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from broker.groups import codes
from broker.groups.consumer_group import (
    ClassicMember,
    ConsumerGroup,
    ConsumerSettings,
    Heartbeat,
    HeartbeatError,
    HeartbeatResult,
    Records,
    TopicLookup,
)
from broker.groups.consumer_protocol import encode_assignment

log = logging.getLogger("hyperkafka.groups")

NO_GENERATION = -1
UNKNOWN_MEMBER = ""
NEW_MEMBER_JOIN_TIMEOUT_MS = 5 * 60 * 1000
CONSUMER_PROTOCOL = "consumer"


class State(enum.Enum):
    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


_VALID_PREVIOUS: dict[State, frozenset[State]] = {
    State.PREPARING_REBALANCE: frozenset({State.STABLE, State.COMPLETING_REBALANCE, State.EMPTY}),
    State.COMPLETING_REBALANCE: frozenset({State.PREPARING_REBALANCE}),
    State.STABLE: frozenset({State.COMPLETING_REBALANCE}),
    State.EMPTY: frozenset({State.PREPARING_REBALANCE}),
    State.DEAD: frozenset(State),
}


class IllegalTransition(Exception):
    """A bug: the machine tried a transition Kafka's state graph does not have."""


@dataclass(frozen=True)
class GroupSettings:
    """The coordinator's broker settings (Kafka's names in `from_properties`)."""

    initial_rebalance_delay_ms: int = 1000
    min_session_timeout_ms: int = 6000
    max_session_timeout_ms: int = 1_800_000
    max_size: int = 2**31 - 1
    offset_metadata_max_bytes: int = 4096
    offset_commit_timeout_ms: int = 5000
    offsets_retention_minutes: int = 10080  # KIP-186: 7 days
    offsets_retention_check_interval_ms: int = 600_000
    # hyperkafka's own: a retention below Kafka's 1-minute floor (tests, short-lived
    # clusters); -1 = use offsets.retention.minutes.
    offsets_retention_ms_override: int = -1
    # Compact the offsets archive once this many of its records are superseded and they
    # are at least half of it (Kafka's log.cleaner.min.cleanable.ratio = 0.5).
    offsets_compaction_min_dirty_records: int = 10_000
    # Cluster mode: partitions of __consumer_offsets, each coordinated by one broker
    # (groups map to them by Kafka's hash). Read once, when the controller first places them.
    offsets_topic_num_partitions: int = 50

    NAMES: ClassVar[dict[str, str]] = {
        "group.initial.rebalance.delay.ms": "initial_rebalance_delay_ms",
        "group.min.session.timeout.ms": "min_session_timeout_ms",
        "group.max.session.timeout.ms": "max_session_timeout_ms",
        "group.max.size": "max_size",
        "offset.metadata.max.bytes": "offset_metadata_max_bytes",
        "offsets.commit.timeout.ms": "offset_commit_timeout_ms",
        "offsets.retention.minutes": "offsets_retention_minutes",
        "offsets.retention.check.interval.ms": "offsets_retention_check_interval_ms",
        "hyperkafka.offsets.retention.ms": "offsets_retention_ms_override",
        "hyperkafka.offsets.compaction.min.dirty.records": "offsets_compaction_min_dirty_records",
        "offsets.topic.num.partitions": "offsets_topic_num_partitions",
    }
    _AT_LEAST_ONE: ClassVar[frozenset[str]] = frozenset(
        {"max_size", "offsets_retention_minutes", "offsets_retention_check_interval_ms", "offsets_compaction_min_dirty_records",
         "offsets_topic_num_partitions"}
    )

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> GroupSettings:
        values = {attr: int(props[name]) for name, attr in cls.NAMES.items() if name in props}
        for attr, value in values.items():
            if attr == "offsets_retention_ms_override" and value >= -1:
                continue
            if value < 0 or (attr in cls._AT_LEAST_ONE and value < 1):
                raise ValueError(f"{attr} out of range: {value}")
        return cls(**values)

    @property
    def offsets_retention_ms(self) -> int:
        if self.offsets_retention_ms_override >= 0:
            return self.offsets_retention_ms_override
        return self.offsets_retention_minutes * 60_000


@dataclass(eq=False)
class Member:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    rebalance_timeout_ms: int
    session_timeout_ms: int
    protocol_type: str
    protocols: list[tuple[str, bytes]]
    assignment: bytes = b""
    join_waiter: object | None = None
    sync_waiter: object | None = None
    is_new: bool = False
    heartbeat_deadline: int | None = None

    @property
    def awaiting_join(self) -> bool:
        return self.join_waiter is not None

    @property
    def awaiting_sync(self) -> bool:
        return self.sync_waiter is not None

    def matches(self, protocols: list[tuple[str, bytes]]) -> bool:
        return self.protocols == protocols

    def metadata(self, protocol: str) -> bytes:
        for name, data in self.protocols:
            if name == protocol:
                return data
        raise KeyError(protocol)

    def vote(self, candidates: set[str]) -> str:
        for name, _ in self.protocols:
            if name in candidates:
                return name
        raise IllegalTransition(f"member {self.member_id} supports none of {sorted(candidates)}")


@dataclass(frozen=True)
class JoinMember:
    member_id: str
    group_instance_id: str | None
    metadata: bytes


@dataclass(frozen=True)
class JoinResult:
    error: int
    member_id: str
    generation_id: int = NO_GENERATION
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    members: tuple[JoinMember, ...] = ()
    skip_assignment: bool = False


@dataclass(frozen=True)
class SyncResult:
    error: int
    assignment: bytes = b""
    protocol_type: str | None = None
    protocol_name: str | None = None


@dataclass(frozen=True)
class StoreGroup:
    """Persist the group's metadata (and these assignments); then call `Groups.group_stored`
    with the same generation. `assignment` is None when nothing waits for the outcome."""

    group_id: str
    generation_id: int
    assignment: dict[str, bytes] | None


@dataclass
class CommittedOffset:
    offset: int
    leader_epoch: int
    metadata: str
    commit_timestamp: int
    record_offset: int = -1  # where in the offsets archive this commit was written
    # Set by OffsetCommit v2-v4 with a retention_time (KIP-211 keeps their old semantics:
    # the offset expires at this wall-clock time, whatever the group's state).
    expire_timestamp: int | None = None

    def expired(self, now_wall: int, base_timestamp: int, retention_ms: int) -> bool:
        """OffsetExpirationConditionImpl.isOffsetExpired."""
        if self.expire_timestamp is not None:
            return now_wall >= self.expire_timestamp
        return now_wall - base_timestamp >= retention_ms


@dataclass(frozen=True)
class Expired:
    """What one expiry pass removed from memory: the driver writes their tombstones."""

    offsets: tuple[tuple[str, str, int], ...]  # (group, topic, partition)
    groups: tuple[str, ...]  # Empty groups left without offsets: now Dead and gone


@dataclass(frozen=True)
class MemberSummary:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    metadata: bytes
    assignment: bytes


@dataclass(frozen=True)
class GroupSummary:
    group_id: str
    state: str
    protocol_type: str
    protocol: str
    members: tuple[MemberSummary, ...]


class Group:
    """One group's membership, generation and committed offsets."""

    def __init__(self, owner: Groups, group_id: str) -> None:
        self.owner = owner
        self.group_id = group_id
        self.state = State.EMPTY
        self.generation_id = 0
        self.protocol_type: str | None = None
        self.protocol_name: str | None = None
        self.leader_id: str | None = None
        self.members: dict[str, Member] = {}
        self.static_members: dict[str, str] = {}  # group.instance.id -> member id
        self.pending_members: dict[str, int] = {}  # member id -> deadline (MEMBER_ID_REQUIRED)
        self.pending_sync: set[str] = set()
        self.join_deadline: int | None = None
        self.initial_join: bool = False  # the running join phase is the initial delayed one
        self.initial_remaining_ms = 0
        self.new_member_added = False
        self.sync_deadline: int | None = None
        self.offsets: dict[tuple[str, int], CommittedOffset] = {}
        # Commits written to the archive but not yet durable: never expired meanwhile, or
        # the tombstone would land after the commit and erase it at the next replay.
        self.pending_offset_commits: Counter[tuple[str, int]] = Counter()
        # Wall-clock ms the group last became Empty (the GroupMetadata record's
        # current_state_timestamp); None when unknown. Set by the driver, which writes
        # the same value into the record, so memory and archive agree.
        self.current_state_timestamp: int | None = None
        # Set when the group is of type consumer (KIP-848, broker.groups.consumer_group):
        # then it has no classic members, and the classic entry points refuse it.
        self.consumer: ConsumerGroup | None = None

    # ------------------------------------------------------------------ queries

    def is_(self, state: State) -> bool:
        return self.state is state

    def has(self, member_id: str) -> bool:
        return member_id in self.members

    def is_leader(self, member_id: str) -> bool:
        return self.leader_id == member_id

    @property
    def rebalance_timeout_ms(self) -> int:
        return max((m.rebalance_timeout_ms for m in self.members.values()), default=0)

    def all_joined(self) -> bool:
        return not self.pending_members and all(m.awaiting_join for m in self.members.values())

    def num_awaiting_join(self) -> int:
        return sum(1 for m in self.members.values() if m.awaiting_join)

    def candidate_protocols(self) -> set[str]:
        counts: Counter[str] = Counter()
        for m in self.members.values():
            counts.update({name for name, _ in m.protocols})
        return {name for name, n in counts.items() if n == len(self.members)}

    def supports_protocols(self, protocol_type: str, protocols: Iterable[str]) -> bool:
        names = set(protocols)
        if self.is_(State.EMPTY):
            return bool(protocol_type) and bool(names)
        return self.protocol_type == protocol_type and bool(names & self.candidate_protocols())

    def select_protocol(self) -> str:
        candidates = self.candidate_protocols()
        votes = Counter(m.vote(candidates) for m in self.members.values())
        # Most votes wins; ties go to the protocol listed first by the most members'
        # preference order, which Counter.most_common keeps (insertion order).
        return votes.most_common(1)[0][0]

    def can_rebalance(self) -> bool:
        return self.state in _VALID_PREVIOUS[State.PREPARING_REBALANCE]

    def subscribed_topics(self) -> set[str] | None:
        """Topics the members subscribe to (consumer protocol only); None when unknown."""
        if self.protocol_type != CONSUMER_PROTOCOL or self.protocol_name is None:
            return None
        topics: set[str] = set()
        for m in self.members.values():
            try:
                topics.update(parse_subscription_topics(m.metadata(self.protocol_name)))
            except (KeyError, ValueError):
                return None
        return topics

    def is_subscribed_to_topic(self, topic: str) -> bool:
        """ClassicGroup.isSubscribedToTopic: an Empty consumer group subscribes to nothing;
        when the subscriptions cannot be known, only a consumer group counts as subscribed."""
        if self.consumer is not None:
            return self.consumer.is_subscribed_to_topic(topic)
        if self.protocol_type == CONSUMER_PROTOCOL and not self.members:
            return False
        subscribed = self.subscribed_topics()
        if subscribed is None:
            return self.protocol_type == CONSUMER_PROTOCOL
        return topic in subscribed

    def begin_offset_commit(self, partitions: Iterable[tuple[str, int]]) -> None:
        self.pending_offset_commits.update(partitions)

    def end_offset_commit(self, partitions: Iterable[tuple[str, int]]) -> None:
        self.pending_offset_commits.subtract(partitions)
        for tp in [tp for tp, n in self.pending_offset_commits.items() if n <= 0]:
            del self.pending_offset_commits[tp]

    def expiry_base(self) -> Callable[[CommittedOffset], int] | None:
        """ClassicGroup.offsetExpirationCondition (KIP-211): from when an offset's retention
        counts, or None when this group's offsets do not expire now."""
        if self.consumer is not None:
            return lambda o: o.commit_timestamp  # ConsumerGroup's: topics no member subscribes to
        if self.protocol_type is None:
            return lambda o: o.commit_timestamp  # standalone consumer: offsets storage only
        if self.is_(State.EMPTY):
            ts = self.current_state_timestamp
            return (lambda o: o.commit_timestamp) if ts is None else (lambda o: ts)
        if self.protocol_type == CONSUMER_PROTOCOL and self.is_(State.STABLE) and self.subscribed_topics() is not None:
            return lambda o: o.commit_timestamp  # only topics no member subscribes to
        return None

    def current_member_metadata(self) -> tuple[JoinMember, ...]:
        assert self.protocol_name is not None
        return tuple(
            JoinMember(m.member_id, m.group_instance_id, m.metadata(self.protocol_name)) for m in self.members.values()
        )

    def summary(self) -> GroupSummary:
        if self.consumer is not None:
            # Kafka 4.3's DescribeGroups describes only classic groups: a consumer group
            # answers as a Dead one, no error (ConsumerGroupDescribe describes it).
            return GroupSummary(self.group_id, State.DEAD.value, "", "", ())
        if self.is_(State.STABLE):
            protocol = self.protocol_name or ""
            members = tuple(
                MemberSummary(m.member_id, m.group_instance_id, m.client_id, m.client_host, m.metadata(protocol), m.assignment)
                for m in self.members.values()
            )
            return GroupSummary(self.group_id, self.state.value, self.protocol_type or "", protocol, members)
        members = tuple(
            MemberSummary(m.member_id, m.group_instance_id, m.client_id, m.client_host, b"", b"") for m in self.members.values()
        )
        return GroupSummary(self.group_id, self.state.value, self.protocol_type or "", "", members)

    def next_deadline(self) -> int | None:
        if self.consumer is not None:
            return self.consumer.next_deadline()
        deadlines = [d for d in (self.join_deadline, self.sync_deadline) if d is not None]
        deadlines.extend(self.pending_members.values())
        deadlines.extend(m.heartbeat_deadline for m in self.members.values() if m.heartbeat_deadline is not None)
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ plumbing

    def transition(self, target: State) -> None:
        if self.state not in _VALID_PREVIOUS[target]:
            raise IllegalTransition(f"group {self.group_id}: {self.state.value} -> {target.value}")
        self.state = target

    def _answer_join(self, member: Member, result: JoinResult) -> None:
        if member.join_waiter is not None:
            self.owner.outbox.append((member.join_waiter, result))
            member.join_waiter = None

    def _answer_sync(self, member: Member, result: SyncResult) -> None:
        if member.sync_waiter is not None:
            self.owner.outbox.append((member.sync_waiter, result))
            member.sync_waiter = None

    def _schedule_heartbeat(self, member: Member, now: int, timeout_ms: int | None = None) -> None:
        member.heartbeat_deadline = now + (member.session_timeout_ms if timeout_ms is None else timeout_ms)

    def _join_result(self, member: Member, *, leader_view: bool, skip_assignment: bool = False, leader: str | None = None) -> JoinResult:
        return JoinResult(
            codes.NONE,
            member.member_id,
            self.generation_id,
            self.protocol_type,
            self.protocol_name,
            (self.leader_id or "") if leader is None else leader,
            self.current_member_metadata() if leader_view else (),
            skip_assignment,
        )

    def _add(self, member: Member) -> None:
        if member.group_instance_id is not None:
            if member.group_instance_id in self.static_members:
                raise IllegalTransition(f"static member {member.group_instance_id} added twice")
            self.static_members[member.group_instance_id] = member.member_id
        if not self.members:
            self.protocol_type = member.protocol_type
        if self.leader_id is None:
            self.leader_id = member.member_id
        self.members[member.member_id] = member
        self.pending_members.pop(member.member_id, None)

    def _remove(self, member_id: str) -> Member | None:
        member = self.members.pop(member_id, None)
        if member is not None and member.group_instance_id is not None:
            self.static_members.pop(member.group_instance_id, None)
        if self.leader_id == member_id:
            self.leader_id = next(iter(self.members), None)
        self.pending_members.pop(member_id, None)
        self.pending_sync.discard(member_id)
        return member

    # ------------------------------------------------------------------ rebalancing

    def maybe_prepare_rebalance(self, now: int) -> None:
        if self.can_rebalance():
            self.prepare_rebalance(now)

    def prepare_rebalance(self, now: int) -> None:
        if self.is_(State.COMPLETING_REBALANCE):
            self._reset_and_propagate_assignment_error(codes.REBALANCE_IN_PROGRESS)
        self.pending_sync.clear()
        self.sync_deadline = None
        if self.is_(State.EMPTY):
            delay = self.owner.settings.initial_rebalance_delay_ms
            self.initial_join = True
            self.join_deadline = now + delay
            self.initial_remaining_ms = max(self.rebalance_timeout_ms - delay, 0)
        else:
            self.initial_join = False
            self.join_deadline = now + self.rebalance_timeout_ms
        log.info("preparing to rebalance group %s (generation %d, %d members)", self.group_id, self.generation_id, len(self.members))
        self.transition(State.PREPARING_REBALANCE)
        self.try_complete_join(now)

    def try_complete_join(self, now: int) -> None:
        """DelayedJoin.tryComplete: the normal join phase ends as soon as everyone joined
        (the initial delayed one always waits its delay out)."""
        if self.is_(State.PREPARING_REBALANCE) and not self.initial_join and self.all_joined():
            self.complete_join(now)

    def _maybe_elect_new_joined_leader(self) -> bool:
        if self.leader_id is None:
            return False
        leader = self.members.get(self.leader_id)
        if leader is not None and leader.awaiting_join:
            return True
        for member_id, m in self.members.items():
            if m.awaiting_join:
                self.leader_id = member_id
                return True
        return False

    def complete_join(self, now: int) -> None:
        """onCompleteJoin: drop dynamic members that did not rejoin, start the next generation."""
        self.join_deadline = None
        for m in list(self.members.values()):
            if not m.awaiting_join and m.group_instance_id is None:
                self._remove(m.member_id)
        if self.is_(State.DEAD):
            return
        if not self._maybe_elect_new_joined_leader() and self.members:
            # Only static members that did not rejoin are left: wait another rebalance
            # timeout for them (or for their sessions to expire).
            self.initial_join = False
            self.join_deadline = now + self.rebalance_timeout_ms
            return
        self.generation_id += 1
        self.pending_sync.clear()
        if not self.members:
            self.protocol_name = None
            self.transition(State.EMPTY)
            self.owner.effects.append(StoreGroup(self.group_id, self.generation_id, None))
            return
        self.protocol_name = self.select_protocol()
        self.transition(State.COMPLETING_REBALANCE)
        log.info("group %s: generation %d with %d members, protocol %s", self.group_id, self.generation_id, len(self.members), self.protocol_name)
        for m in self.members.values():
            self._answer_join(m, self._join_result(m, leader_view=self.is_leader(m.member_id)))
            self._schedule_heartbeat(m, now)
            m.is_new = False
            self.pending_sync.add(m.member_id)
        self.sync_deadline = now + self.rebalance_timeout_ms

    def _reset_and_propagate_assignment_error(self, error: int) -> None:
        for m in self.members.values():
            m.assignment = b""
        self._propagate_assignment(error, None)

    def _propagate_assignment(self, error: int, now: int | None) -> None:
        ptype, pname = (self.protocol_type, self.protocol_name) if error == codes.NONE else (None, None)
        for m in self.members.values():
            if m.sync_waiter is not None:
                self._answer_sync(m, SyncResult(error, m.assignment if error == codes.NONE else b"", ptype, pname))
                if now is not None:
                    self._schedule_heartbeat(m, now)

    def _remove_member_and_update(self, member: Member, now: int) -> None:
        self._answer_join(member, JoinResult(codes.UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER))
        self._answer_sync(member, SyncResult(codes.UNKNOWN_MEMBER_ID))
        self._remove(member.member_id)
        if self.state in (State.STABLE, State.COMPLETING_REBALANCE):
            self.maybe_prepare_rebalance(now)
        elif self.is_(State.PREPARING_REBALANCE):
            self.try_complete_join(now)

    def _remove_pending_member(self, member_id: str, now: int) -> None:
        self.pending_members.pop(member_id, None)
        self.try_complete_join(now)

    def _update_member(self, member: Member, protocols: list[tuple[str, bytes]], rebalance_timeout_ms: int, session_timeout_ms: int, waiter: object | None) -> None:
        member.protocols = protocols
        member.rebalance_timeout_ms = rebalance_timeout_ms
        member.session_timeout_ms = session_timeout_ms
        if member.join_waiter is not None and member.join_waiter is not waiter and waiter is not None:
            # Kafka drops the first request silently; here its connection would stall.
            self._answer_join(member, JoinResult(codes.REBALANCE_IN_PROGRESS, member.member_id))
        member.join_waiter = waiter

    def _update_member_and_rebalance(self, member: Member, protocols: list[tuple[str, bytes]], rebalance_timeout_ms: int, session_timeout_ms: int, waiter: object, now: int) -> None:
        self._update_member(member, protocols, rebalance_timeout_ms, session_timeout_ms, waiter)
        self.maybe_prepare_rebalance(now)

    def _add_member_and_rebalance(self, now: int, member: Member, waiter: object) -> None:
        member.is_new = True
        if self.is_(State.PREPARING_REBALANCE) and self.generation_id == 0:
            self.new_member_added = True
        member.join_waiter = waiter
        self._add(member)
        # A new member cannot heartbeat before it has its id: bound its first join instead.
        self._schedule_heartbeat(member, now, NEW_MEMBER_JOIN_TIMEOUT_MS)
        self.maybe_prepare_rebalance(now)

    def validate_current_member(self, member_id: str, group_instance_id: str | None) -> int | None:
        if group_instance_id is not None:
            current = self.static_members.get(group_instance_id)
            if current is None:
                return codes.UNKNOWN_MEMBER_ID
            if current != member_id:
                return codes.FENCED_INSTANCE_ID
            return None
        return None if member_id in self.members else codes.UNKNOWN_MEMBER_ID

    # ------------------------------------------------------------------ timers

    def tick(self, now: int) -> None:
        if self.consumer is not None:
            self.consumer.tick(now)
            return
        for member_id, deadline in list(self.pending_members.items()):
            if deadline <= now:
                self._remove_pending_member(member_id, now)
        for m in list(self.members.values()):
            if m.heartbeat_deadline is None or m.heartbeat_deadline > now or self.members.get(m.member_id) is not m:
                continue
            if not m.is_new and (m.awaiting_join or m.awaiting_sync):
                m.heartbeat_deadline = None  # the rebalance keeps it; its timers rule now
            else:
                log.info("group %s: member %s expired (no heartbeat), removing it", self.group_id, m.member_id)
                self._remove_member_and_update(m, now)
        if self.join_deadline is not None and self.join_deadline <= now and self.is_(State.PREPARING_REBALANCE):
            if self.initial_join and self.new_member_added and self.initial_remaining_ms != 0:
                delay = self.owner.settings.initial_rebalance_delay_ms
                self.new_member_added = False
                self.join_deadline = now + min(delay, self.initial_remaining_ms)
                self.initial_remaining_ms = max(self.initial_remaining_ms - delay, 0)
            else:
                self.complete_join(now)
        if self.sync_deadline is not None and self.sync_deadline <= now:
            self.sync_deadline = None
            if self.state in (State.COMPLETING_REBALANCE, State.STABLE) and self.pending_sync:
                for member_id in list(self.pending_sync):
                    member = self._remove(member_id)
                    if member is not None:
                        self._answer_join(member, JoinResult(codes.UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER))
                self.prepare_rebalance(now)


class Groups:
    """Every group of this coordinator, with the entry points the handlers call."""

    def __init__(self, settings: GroupSettings | None = None, new_id: Callable[[], str] | None = None,
                 consumer_settings: ConsumerSettings | None = None) -> None:
        self.settings = settings or GroupSettings()
        self.consumer_settings = consumer_settings or ConsumerSettings()
        self.groups: dict[str, Group] = {}
        self.outbox: list[tuple[object, JoinResult | SyncResult]] = []
        self.effects: list[StoreGroup] = []
        # Records of consumer groups (KIP-848) for the driver to append, in order.
        self.records: Records = []
        self._new_id = new_id or (lambda: str(uuid.uuid4()))

    def get(self, group_id: str) -> Group | None:
        return self.groups.get(group_id)

    def get_or_create(self, group_id: str) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = Group(self, group_id)
        return group

    def next_deadline(self) -> int | None:
        return min((d for g in self.groups.values() if (d := g.next_deadline()) is not None), default=None)

    def unload(self, group_ids: Iterable[str] | None = None) -> None:
        """This broker stops coordinating these groups (all: None; Kafka's onResignation
        of a partition): parked JoinGroup and SyncGroup requests answer NOT_COORDINATOR,
        so their members look for the new coordinator, and the groups are forgotten."""
        for group_id in list(self.groups) if group_ids is None else list(group_ids):
            group = self.groups.pop(group_id, None)
            if group is None:
                continue
            for m in group.members.values():
                group._answer_join(m, JoinResult(codes.NOT_COORDINATOR, m.member_id))
                group._answer_sync(m, SyncResult(codes.NOT_COORDINATOR))

    def tick(self, now: int) -> None:
        for group in list(self.groups.values()):
            if group.consumer is None:
                group.tick(now)
                continue
            epoch, before = group.consumer.group_epoch, len(group.consumer.members)
            group.tick(now)
            if len(group.consumer.members) < before:  # a member expired or was fenced
                self._maybe_downgrade(now, group, epoch)

    # ------------------------------------------------------------------ ConsumerGroupHeartbeat

    def consumer_heartbeat(self, now: int, hb: Heartbeat, lookup: TopicLookup, names: Callable[[], Iterable[str]]) -> HeartbeatResult:
        """KIP-848: one heartbeat of a member of a consumer group (broker.groups.consumer_group).
        A new group id, or an empty classic group (offsets only), becomes a consumer group;
        a stable classic group with members is upgraded when the policy allows (`_upgrade`),
        else stays one (Kafka: GROUP_ID_NOT_FOUND)."""
        if not hb.group_id:
            return HeartbeatResult(codes.INVALID_REQUEST, "GroupId can't be empty.")
        group = self.groups.get(hb.group_id)
        created = group is None
        if group is None:
            group = self.get_or_create(hb.group_id)
        if group.consumer is None and group.members:
            if hb.member_epoch == 0:
                try:
                    ConsumerGroup.check_join(hb, self.consumer_settings)
                except HeartbeatError as exc:
                    return HeartbeatResult(exc.error, exc.message)
            if hb.member_epoch != 0 or not self._upgrade(now, group, lookup, names):
                return HeartbeatResult(codes.GROUP_ID_NOT_FOUND, f"Group {hb.group_id} is not a consumer group.")
        if group.consumer is None:
            if not group.is_(State.EMPTY) or group.members or group.pending_members:
                return HeartbeatResult(codes.GROUP_ID_NOT_FOUND, f"Group {hb.group_id} is not a consumer group.")
            if hb.member_epoch != 0:
                if created:
                    del self.groups[hb.group_id]
                return HeartbeatResult(codes.UNKNOWN_MEMBER_ID, f"Member {hb.member_id} is not a member of group {hb.group_id}.")
            group.consumer = ConsumerGroup(hb.group_id, self.consumer_settings, self.records)
            group.protocol_type = CONSUMER_PROTOCOL
        epoch = group.consumer.group_epoch
        result = group.consumer.heartbeat(now, hb, lookup, names)
        if created and not group.consumer.members:
            del self.groups[hb.group_id]  # a join that failed leaves nothing behind
        elif hb.member_epoch == -1:
            self._maybe_downgrade(now, group, epoch)
        return result

    def _maybe_downgrade(self, now: int, group: Group, epoch: int, *, replaced: bool = False) -> None:
        """Kafka's validateOnlineDowngrade + convertToClassicGroup: when the last member of
        the consumer protocol left (or was fenced) and classic members remain, the group
        becomes a classic group of those members at generation `epoch` (the group epoch
        before that member went, which the reconciled classic members hold), keeping their
        partitions, and rebalances: they rejoin and their leader assigns again. When a
        classic JoinGroup `replaced` it (its instance id: validateOnlineDowngradeWith-
        ReplacedMemberId), the classic group is stable at once, each member with its
        target partitions: nobody rebalances."""
        consumer = group.consumer
        if (
            consumer is None
            or not consumer.members
            or any(m.classic is None for m in consumer.members.values())
            or not self.consumer_settings.allows_downgrade()
        ):
            return
        if len(consumer.members) > self.settings.max_size:
            log.info("group %s: cannot downgrade to a classic group: more members than group.max.size", group.group_id)
            return
        by_id = {tid: name for name, (tid, _) in consumer.topic_metadata.items()}
        self.records.extend(consumer.tombstones())
        group.consumer = None
        group.protocol_type = CONSUMER_PROTOCOL
        group.generation_id = epoch
        group.members, group.static_members, group.pending_members = {}, {}, {}
        group.leader_id = None
        for cm in consumer.members.values():
            assert cm.classic is not None
            session_ms, protocols = cm.classic
            partitions = consumer.target.get(cm.member_id, cm.assigned) if replaced else cm.assigned
            named = {by_id[t]: ps for t, ps in partitions.items() if t in by_id}
            member = Member(
                cm.member_id, cm.instance_id, cm.client_id, cm.client_host, cm.rebalance_timeout_ms, session_ms,
                CONSUMER_PROTOCOL, list(protocols), encode_assignment(named),
            )
            group._add(member)
            group._schedule_heartbeat(member, now)
        group.protocol_name = group.select_protocol()
        group.state = State.STABLE
        log.info("group %s: consumer group of epoch %d downgraded to a classic group (%d members)", group.group_id, epoch, len(group.members))
        self.effects.append(StoreGroup(group.group_id, group.generation_id, None))
        if not replaced:
            group.prepare_rebalance(now)

    def _upgrade(self, now: int, group: Group, lookup: TopicLookup, names: Callable[[], Iterable[str]]) -> bool:
        """Kafka's validateOnlineUpgrade + convertToConsumerGroup: a stable classic group of
        the consumer protocol, joined by a consumer-protocol member, becomes a consumer
        group keeping its members (as classic members) and their partitions."""
        s = self.consumer_settings
        why = None
        if not s.allows_upgrade():
            why = "group.consumer.migration.policy does not allow it"
        elif group.protocol_type != CONSUMER_PROTOCOL or group.protocol_name is None:
            why = f"its protocol type is {group.protocol_type!r}"
        elif not group.is_(State.STABLE):
            why = f"it is {group.state.value}"  # rebalancing: try again once stable
        elif len(group.members) >= s.max_size:
            why = "the joining member would exceed group.consumer.max.size"
        protocol = group.protocol_name or ""
        if why is None:
            try:
                consumer = ConsumerGroup.from_classic(
                    now, group.group_id, s, self.records, group.generation_id,
                    [
                        ClassicMember(m.member_id, m.client_id, m.client_host, m.rebalance_timeout_ms, m.session_timeout_ms,
                                      tuple(m.protocols), m.metadata(protocol), m.assignment, m.group_instance_id)
                        for m in group.members.values()
                    ],
                    lookup, names,
                )
            except (ValueError, KeyError) as exc:
                why = f"a member's embedded consumer protocol cannot be read ({exc})"
        if why is not None:
            log.info("group %s: cannot upgrade the classic group to a consumer group: %s", group.group_id, why)
            return False
        # The classic group's record goes: at replay a group with classic members would
        # shadow its consumer records.
        self.records.append((_classic_group_key(group.group_id), None))
        group.consumer = consumer
        group.members, group.static_members, group.pending_members = {}, {}, {}
        group.pending_sync.clear()
        group.leader_id, group.protocol_name = None, None
        group.join_deadline = group.sync_deadline = None
        group.state = State.EMPTY
        group.protocol_type = CONSUMER_PROTOCOL
        return True

    def to_classic(self, group: Group) -> None:
        """An empty consumer group joined by a classic member becomes classic again
        (Kafka's downgrade of an empty group): its consumer records are deleted."""
        consumer = group.consumer
        if consumer is None:
            return
        group.consumer = None
        group.protocol_type = None
        self.records.extend(consumer.tombstones())

    # ------------------------------------------------------------------ JoinGroup

    def join(
        self,
        now: int,
        group_id: str,
        member_id: str,
        group_instance_id: str | None,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        waiter: object,
        *,
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        require_known_member_id: bool = False,
        supports_skip_assignment: bool = False,
        client_id: str = "",
        client_host: str = "",
        lookup: TopicLookup | None = None,
        names: Callable[[], Iterable[str]] = tuple,
    ) -> JoinResult | None:
        """The answer now, or None when it will come through `outbox` for `waiter`.
        `lookup`/`names` (the catalog) let a classic member into a consumer group."""
        if not group_id:
            return JoinResult(codes.INVALID_GROUP_ID, member_id)
        s = self.settings
        if not s.min_session_timeout_ms <= session_timeout_ms <= s.max_session_timeout_ms:
            return JoinResult(codes.INVALID_SESSION_TIMEOUT, member_id)
        unknown = member_id == UNKNOWN_MEMBER
        group = self.groups.get(group_id)
        if group is None:
            if not unknown:
                return JoinResult(codes.UNKNOWN_MEMBER_ID, member_id)
            group = self.get_or_create(group_id)
        if group.consumer is not None:
            if group.consumer.members:
                # A classic member in a consumer group (KIP-848's mixed group), checked in
                # Kafka's order: group full, protocols, MEMBER_ID_REQUIRED (dynamic
                # members only), then the member. Kafka answers its errors with no
                # member id.
                consumer = group.consumer
                if unknown:
                    member_id = _member_id(group_instance_id if group_instance_id is not None else client_id, self._new_id())
                refused = consumer.classic_protocols_refusal(member_id, protocol_type, protocols)
                if refused != codes.NONE or lookup is None:
                    return JoinResult(refused or codes.INCONSISTENT_GROUP_PROTOCOL, UNKNOWN_MEMBER)
                if unknown and group_instance_id is None and require_known_member_id:
                    return JoinResult(codes.MEMBER_ID_REQUIRED, member_id)
                holder = consumer.members.get(consumer.static_members.get(group_instance_id or "", ""))
                replacing = unknown and holder is not None and holder.classic is None
                joined, member_id, epoch, name = consumer.classic_join(
                    now, member_id, group_instance_id, unknown, protocols, session_timeout_ms, rebalance_timeout_ms,
                    client_id, client_host, lookup, names,
                )
                if joined != codes.NONE:
                    return JoinResult(joined, UNKNOWN_MEMBER)
                if replacing:
                    # It took the place of a consumer-protocol member: maybe the last one.
                    self._maybe_downgrade(now, group, consumer.group_epoch, replaced=True)
                # No leader: every classic member syncs as a follower and gets the
                # server-side assignment.
                return JoinResult(codes.NONE, member_id, epoch, CONSUMER_PROTOCOL, name, "", (), False)
            self.to_classic(group)
        if not self._accept_joining_member(group, member_id):
            group._remove(member_id)
            return JoinResult(codes.GROUP_MAX_SIZE_REACHED, UNKNOWN_MEMBER)
        args = (protocol_type, protocols, rebalance_timeout_ms, session_timeout_ms, client_id, client_host)
        if unknown:
            result = self._new_member_join(now, group, group_instance_id, require_known_member_id, supports_skip_assignment, waiter, *args)
        else:
            result = self._current_member_join(now, group, member_id, group_instance_id, waiter, *args)
        if group.is_(State.PREPARING_REBALANCE):
            group.try_complete_join(now)
        return result

    def _accept_joining_member(self, group: Group, member_id: str) -> bool:
        max_size = self.settings.max_size
        if group.state in (State.EMPTY, State.DEAD):
            return True
        if group.is_(State.PREPARING_REBALANCE):
            member = group.members.get(member_id)
            return (member is not None and member.awaiting_join) or group.num_awaiting_join() < max_size
        return member_id in group.members or len(group.members) < max_size

    def _new_member_join(
        self,
        now: int,
        group: Group,
        group_instance_id: str | None,
        require_known_member_id: bool,
        supports_skip_assignment: bool,
        waiter: object,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        rebalance_timeout_ms: int,
        session_timeout_ms: int,
        client_id: str,
        client_host: str,
    ) -> JoinResult | None:
        if group.is_(State.DEAD):
            return JoinResult(codes.COORDINATOR_NOT_AVAILABLE, UNKNOWN_MEMBER)
        if not group.supports_protocols(protocol_type, (name for name, _ in protocols)):
            return JoinResult(codes.INCONSISTENT_GROUP_PROTOCOL, UNKNOWN_MEMBER)
        new_id = _member_id(group_instance_id if group_instance_id is not None else client_id, self._new_id())
        if group_instance_id is not None:
            old_id = group.static_members.get(group_instance_id)
            if old_id is not None:
                return self._update_static_member(
                    now, group, old_id, new_id, group_instance_id, protocols, rebalance_timeout_ms, session_timeout_ms, waiter, supports_skip_assignment
                )
        elif require_known_member_id:
            group.pending_members[new_id] = now + session_timeout_ms
            return JoinResult(codes.MEMBER_ID_REQUIRED, new_id)
        member = Member(new_id, group_instance_id, client_id, client_host, rebalance_timeout_ms, session_timeout_ms, protocol_type, protocols)
        group._add_member_and_rebalance(now, member, waiter)
        return None

    def _update_static_member(
        self,
        now: int,
        group: Group,
        old_id: str,
        new_id: str,
        instance_id: str,
        protocols: list[tuple[str, bytes]],
        rebalance_timeout_ms: int,
        session_timeout_ms: int,
        waiter: object,
        supports_skip_assignment: bool,
    ) -> JoinResult | None:
        current_leader = group.leader_id or ""
        member = group.members.pop(old_id)
        # The old incarnation's parked requests are fenced (GroupMetadata.replaceStaticMember).
        group._answer_join(member, JoinResult(codes.FENCED_INSTANCE_ID, old_id))
        group._answer_sync(member, SyncResult(codes.FENCED_INSTANCE_ID))
        member.member_id = new_id
        group.members[new_id] = member
        group.static_members[instance_id] = new_id
        if group.leader_id == old_id:
            group.leader_id = new_id
        if old_id in group.pending_sync:
            group.pending_sync.discard(old_id)
            group.pending_sync.add(new_id)
        group._schedule_heartbeat(member, now)
        group._update_member(member, protocols, rebalance_timeout_ms, session_timeout_ms, waiter)
        if group.is_(State.STABLE):
            if group.protocol_name == group.select_protocol():
                # Same protocol: no rebalance; persist the new member id and answer at once.
                self.effects.append(StoreGroup(group.group_id, group.generation_id, None))
                if supports_skip_assignment:
                    leader = group.is_leader(new_id)
                    result = group._join_result(member, leader_view=leader, skip_assignment=leader)
                else:
                    # Older clients: name the old leader so the returning member does not
                    # run a trivial assignment a stable group would ignore.
                    result = group._join_result(member, leader_view=False, leader=current_leader)
                member.join_waiter = None
                return result
            group.maybe_prepare_rebalance(now)
        elif group.is_(State.COMPLETING_REBALANCE):
            group.prepare_rebalance(now)
        return None

    def _current_member_join(
        self,
        now: int,
        group: Group,
        member_id: str,
        group_instance_id: str | None,
        waiter: object,
        protocol_type: str,
        protocols: list[tuple[str, bytes]],
        rebalance_timeout_ms: int,
        session_timeout_ms: int,
        client_id: str,
        client_host: str,
    ) -> JoinResult | None:
        if group.is_(State.DEAD):
            return JoinResult(codes.COORDINATOR_NOT_AVAILABLE, member_id)
        if not group.supports_protocols(protocol_type, (name for name, _ in protocols)):
            return JoinResult(codes.INCONSISTENT_GROUP_PROTOCOL, member_id)
        if member_id in group.pending_members:
            if group_instance_id is not None:
                return JoinResult(codes.UNKNOWN_MEMBER_ID, member_id)  # a pending member is never static
            member = Member(member_id, None, client_id, client_host, rebalance_timeout_ms, session_timeout_ms, protocol_type, protocols)
            group._add_member_and_rebalance(now, member, waiter)
            return None
        error = group.validate_current_member(member_id, group_instance_id)
        if error is not None:
            return JoinResult(error, member_id)
        member = group.members[member_id]
        if group.is_(State.PREPARING_REBALANCE):
            group._update_member_and_rebalance(member, protocols, rebalance_timeout_ms, session_timeout_ms, waiter, now)
            return None
        if group.is_(State.COMPLETING_REBALANCE):
            if member.matches(protocols):
                # It lost the first answer: repeat the current generation's.
                return group._join_result(member, leader_view=group.is_leader(member_id))
            group._update_member_and_rebalance(member, protocols, rebalance_timeout_ms, session_timeout_ms, waiter, now)
            return None
        if group.is_(State.STABLE):
            if group.is_leader(member_id) or not member.matches(protocols):
                # The leader rejoining means it saw a metadata change: rebalance.
                group._update_member_and_rebalance(member, protocols, rebalance_timeout_ms, session_timeout_ms, waiter, now)
                return None
            return group._join_result(member, leader_view=False)
        return JoinResult(codes.UNKNOWN_MEMBER_ID, member_id)  # Empty: the member is stale

    # ------------------------------------------------------------------ SyncGroup

    def sync(
        self,
        now: int,
        group_id: str,
        generation_id: int,
        member_id: str,
        group_instance_id: str | None,
        assignments: Mapping[str, bytes],
        waiter: object,
        *,
        protocol_type: str | None = None,
        protocol_name: str | None = None,
    ) -> SyncResult | None:
        if not group_id:
            return SyncResult(codes.INVALID_GROUP_ID)
        group = self.groups.get(group_id)
        if group is not None and group.consumer is not None:
            synced, assignment = group.consumer.classic_sync(
                now, member_id, group_instance_id, generation_id, protocol_type, protocol_name
            )
            cm = group.consumer.members.get(member_id)
            name = cm.classic[1][0][0] if synced == codes.NONE and cm is not None and cm.classic else None
            return SyncResult(synced, assignment, CONSUMER_PROTOCOL if name else None, name)
        if group is None:
            return SyncResult(codes.UNKNOWN_MEMBER_ID)
        if group.is_(State.DEAD):
            return SyncResult(codes.COORDINATOR_NOT_AVAILABLE)
        error = group.validate_current_member(member_id, group_instance_id)
        if error is None and generation_id != group.generation_id:
            error = codes.ILLEGAL_GENERATION
        if error is None and protocol_type is not None and group.protocol_type != protocol_type:
            error = codes.INCONSISTENT_GROUP_PROTOCOL
        if error is None and protocol_name is not None and group.protocol_name != protocol_name:
            error = codes.INCONSISTENT_GROUP_PROTOCOL
        if error is not None:
            return SyncResult(error)
        if group.is_(State.EMPTY):
            return SyncResult(codes.UNKNOWN_MEMBER_ID)
        if group.is_(State.PREPARING_REBALANCE):
            return SyncResult(codes.REBALANCE_IN_PROGRESS)
        member = group.members[member_id]
        if group.is_(State.COMPLETING_REBALANCE):
            if member.sync_waiter is not None and member.sync_waiter is not waiter:
                group._answer_sync(member, SyncResult(codes.REBALANCE_IN_PROGRESS))
            member.sync_waiter = waiter
            group.pending_sync.discard(member_id)
            if group.is_leader(member_id):
                full = {m: assignments.get(m, b"") for m in group.members}
                self.effects.append(StoreGroup(group_id, group.generation_id, full))
            return None
        # Stable: hand out the current assignment again.
        group.pending_sync.discard(member_id)
        group._schedule_heartbeat(member, now)
        return SyncResult(codes.NONE, member.assignment, group.protocol_type, group.protocol_name)

    def group_stored(self, now: int, group_id: str, generation_id: int, assignment: Mapping[str, bytes] | None, error: int) -> None:
        """The driver persisted a `StoreGroup`; hand out the assignment (or the error)."""
        group = self.groups.get(group_id)
        if group is None or assignment is None:
            return
        if not group.is_(State.COMPLETING_REBALANCE) or group.generation_id != generation_id:
            return  # the group moved on while we were writing
        if error != codes.NONE:
            group._reset_and_propagate_assignment_error(error)
            group.maybe_prepare_rebalance(now)
            return
        for m in group.members.values():
            m.assignment = assignment.get(m.member_id, b"")
        group._propagate_assignment(codes.NONE, now)
        group.transition(State.STABLE)

    # ------------------------------------------------------------------ Heartbeat

    def heartbeat(self, now: int, group_id: str, generation_id: int, member_id: str, group_instance_id: str | None = None) -> int:
        if not group_id:
            return codes.INVALID_GROUP_ID
        group = self.groups.get(group_id)
        if group is not None and group.consumer is not None:
            return group.consumer.classic_heartbeat(now, member_id, group_instance_id, generation_id)
        if group is None:
            return codes.UNKNOWN_MEMBER_ID
        if group.is_(State.DEAD):
            return codes.COORDINATOR_NOT_AVAILABLE
        error = group.validate_current_member(member_id, group_instance_id)
        if error is not None:
            return error
        if generation_id != group.generation_id:
            return codes.ILLEGAL_GENERATION
        if group.is_(State.EMPTY):
            return codes.UNKNOWN_MEMBER_ID
        group._schedule_heartbeat(group.members[member_id], now)
        if group.is_(State.PREPARING_REBALANCE):
            return codes.REBALANCE_IN_PROGRESS
        return codes.NONE

    # ------------------------------------------------------------------ LeaveGroup

    def leave(self, now: int, group_id: str, leaving: Iterable[tuple[str, str | None]]) -> tuple[int, list[int]]:
        """(top-level error, one error per (member id, group instance id) leaving)."""
        leaving = list(leaving)
        if not group_id:
            return codes.INVALID_GROUP_ID, []
        group = self.groups.get(group_id)
        if group is not None and group.consumer is not None:
            return codes.NONE, [group.consumer.classic_leave(member_id, instance_id) for member_id, instance_id in leaving]
        if group is None:
            return codes.NONE, [codes.UNKNOWN_MEMBER_ID] * len(leaving)
        if group.is_(State.DEAD):
            return codes.COORDINATOR_NOT_AVAILABLE, []
        results = []
        for member_id, instance_id in leaving:
            if member_id == UNKNOWN_MEMBER:
                # Administrative removal by group.instance.id.
                current = group.static_members.get(instance_id) if instance_id is not None else None
                if current is None:
                    results.append(codes.UNKNOWN_MEMBER_ID)
                    continue
                group._remove_member_and_update(group.members[current], now)
                results.append(codes.NONE)
            elif member_id in group.pending_members:
                group._remove_pending_member(member_id, now)
                results.append(codes.NONE)
            else:
                error = group.validate_current_member(member_id, instance_id)
                if error is None:
                    group._remove_member_and_update(group.members[member_id], now)
                    results.append(codes.NONE)
                else:
                    results.append(error)
        return codes.NONE, results

    # ------------------------------------------------------------------ offsets

    def validate_offset_commit(
        self,
        now: int,
        group_id: str,
        generation_id: int,
        member_id: str,
        group_instance_id: str | None,
        api_version: int = 8,
        transactional: bool = False,
    ) -> tuple[Group | None, int]:
        """(the group to commit into, NONE) or (None, the error for every partition):
        OffsetMetadataManager.validateOffsetCommit + ClassicGroup.validateOffsetCommit.
        `transactional`: TxnOffsetCommit's check (KIP-447), whose versions are not
        OffsetCommit's."""
        group = self.groups.get(group_id)
        if group is None:
            if generation_id >= 0:
                # v9 names the real problem; older versions keep ILLEGAL_GENERATION.
                return None, codes.GROUP_ID_NOT_FOUND if api_version >= 9 else codes.ILLEGAL_GENERATION
            # A group that only stores offsets (no group management): create it.
            return self.get_or_create(group_id), codes.NONE
        if group.is_(State.DEAD):
            return None, codes.COORDINATOR_NOT_AVAILABLE
        if group.consumer is not None:
            refused = group.consumer.validate_offset_commit(member_id, generation_id, api_version, transactional)
            return (group, refused) if refused == codes.NONE else (None, refused)
        if generation_id < 0 and group.is_(State.EMPTY):
            return group, codes.NONE
        if generation_id >= 0 or member_id != UNKNOWN_MEMBER or group_instance_id is not None:
            error = group.validate_current_member(member_id, group_instance_id)
            if error is None and generation_id != group.generation_id:
                error = codes.ILLEGAL_GENERATION
            if error is not None:
                return None, error
        elif not group.is_(State.EMPTY):
            return None, codes.UNKNOWN_MEMBER_ID  # only members commit into a live group
        if group.is_(State.COMPLETING_REBALANCE):
            return None, codes.REBALANCE_IN_PROGRESS
        if group.state in (State.STABLE, State.PREPARING_REBALANCE):
            group._schedule_heartbeat(group.members[member_id], now)
        return group, codes.NONE

    def expire_offsets(self, now_wall: int) -> Expired:
        """One pass of GroupMetadataManager.cleanupGroupMetadata: drop expired offsets from
        memory, and Empty groups that have none left (their state becomes Dead)."""
        retention = self.settings.offsets_retention_ms
        expired: list[tuple[str, str, int]] = []
        dead: list[str] = []
        for group in list(self.groups.values()):
            base = group.expiry_base()
            if base is not None:
                for (topic, partition), committed in list(group.offsets.items()):
                    if group.is_subscribed_to_topic(topic) or group.pending_offset_commits[(topic, partition)]:
                        continue
                    if committed.expired(now_wall, base(committed), retention):
                        del group.offsets[(topic, partition)]
                        expired.append((group.group_id, topic, partition))
            # Kafka would also drop an Empty group holding members it just told
            # MEMBER_ID_REQUIRED; their second JoinGroup then fails with UNKNOWN_MEMBER_ID.
            # Keeping the group until they come back (or their deadline passes) spares that.
            if group.consumer is not None and group.consumer.members:
                continue
            if group.is_(State.EMPTY) and not group.offsets and not group.pending_offset_commits and not group.pending_members:
                group.transition(State.DEAD)
                del self.groups[group.group_id]
                dead.append(group.group_id)
        if expired or dead:
            log.info("expired %d offsets; removed %d empty groups", len(expired), len(dead))
        return Expired(tuple(expired), tuple(dead))

    def delete_groups(self, group_ids: Iterable[str]) -> dict[str, int]:
        results: dict[str, int] = {}
        for group_id in group_ids:
            group = self.groups.get(group_id)
            if group is None or group.is_(State.DEAD):
                results[group_id] = codes.GROUP_ID_NOT_FOUND
            elif group.consumer is not None and group.consumer.members:
                results[group_id] = codes.NON_EMPTY_GROUP
            elif group.is_(State.EMPTY):
                group.transition(State.DEAD)
                del self.groups[group_id]
                results[group_id] = codes.NONE
            else:
                results[group_id] = codes.NON_EMPTY_GROUP
        return results

    def deletable_offsets(self, group_id: str, partitions: Iterable[tuple[str, int]]) -> tuple[int, dict[tuple[str, int], int]]:
        """OffsetDelete: (group error, per-partition error); NONE partitions may be deleted."""
        group = self.groups.get(group_id)
        if group is None or group.is_(State.DEAD):
            return codes.GROUP_ID_NOT_FOUND, {}
        parts = list(partitions)
        if group.consumer is not None and group.consumer.members:
            return codes.NONE, {
                tp: codes.GROUP_SUBSCRIBED_TO_TOPIC if group.consumer.is_subscribed_to_topic(tp[0]) else codes.NONE for tp in parts
            }
        if group.is_(State.EMPTY):
            return codes.NONE, dict.fromkeys(parts, codes.NONE)
        if group.protocol_type != CONSUMER_PROTOCOL:
            return codes.NON_EMPTY_GROUP, {}
        subscribed = group.subscribed_topics()
        return codes.NONE, {
            tp: codes.GROUP_SUBSCRIBED_TO_TOPIC if subscribed is None or tp[0] in subscribed else codes.NONE for tp in parts
        }

    def list_groups(self, states: Iterable[str] = (), types: Iterable[str] = ()) -> list[tuple[str, str, str]]:
        """(group id, protocol type, state) of every group, filtered as ListGroups v4/v5 say."""
        wanted_states = {s.lower() for s in states}
        wanted_types = {t.lower() for t in types}
        out = []
        for g in self.groups.values():
            kind = "classic" if g.consumer is None else "consumer"
            state = g.state.value if g.consumer is None else g.consumer.state.value
            if (not wanted_types or kind in wanted_types) and (not wanted_states or state.lower() in wanted_states):
                out.append((g.group_id, g.protocol_type or "", state))
        return out

    def validate_offset_fetch(self, group_id: str, member_id: str | None, member_epoch: int) -> int:
        """OffsetFetch v9's member id and epoch: checked for consumer groups only."""
        group = self.groups.get(group_id)
        if group is None or group.consumer is None:
            return codes.NONE
        return group.consumer.validate_offset_fetch(member_id, member_epoch)

    def group_type(self, group_id: str) -> str:
        group = self.groups.get(group_id)
        return "consumer" if group is not None and group.consumer is not None else "classic"

    # ------------------------------------------------------------------ loading

    def load_group(
        self,
        now: int,
        group_id: str,
        protocol_type: str,
        generation_id: int,
        protocol_name: str | None,
        leader_id: str | None,
        members: Iterable[Member],
    ) -> Group:
        """Install a group read back from the offsets archive (GroupMetadataManager.loadGroup):
        Stable with its members if it had any, each given a fresh session to heartbeat in."""
        group = self.get_or_create(group_id)
        group.protocol_type = protocol_type or None
        group.generation_id = generation_id
        group.protocol_name = protocol_name
        group.members.clear()
        group.static_members.clear()
        for m in members:
            group.members[m.member_id] = m
            if m.group_instance_id is not None:
                group.static_members[m.group_instance_id] = m.member_id
            group._schedule_heartbeat(m, now)
        group.leader_id = leader_id if leader_id in group.members else next(iter(group.members), None)
        group.state = State.STABLE if group.members and protocol_name else State.EMPTY
        if group.is_(State.EMPTY):
            group.members.clear()
            group.static_members.clear()
            group.leader_id = None
        return group


def parse_subscription_topics(metadata: bytes) -> list[str]:
    """The topics of a ConsumerProtocolSubscription (any version: topics come first)."""
    try:
        (count,) = struct.unpack_from(">i", metadata, 2)
        pos = 6
        topics = []
        for _ in range(count):
            (n,) = struct.unpack_from(">h", metadata, pos)
            pos += 2
            if n < 0 or pos + n > len(metadata):
                raise ValueError("bad topic name length")
            topics.append(metadata[pos : pos + n].decode("utf-8"))
            pos += n
        return topics
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"not a consumer subscription: {exc}") from None


__all__ = [
    "CONSUMER_PROTOCOL",
    "NO_GENERATION",
    "UNKNOWN_MEMBER",
    "CommittedOffset",
    "Expired",
    "Group",
    "GroupSettings",
    "GroupSummary",
    "Groups",
    "IllegalTransition",
    "JoinMember",
    "JoinResult",
    "Member",
    "MemberSummary",
    "State",
    "StoreGroup",
    "SyncResult",
]


_MAX_MEMBER_ID_BYTES = 0x7FFF


def _classic_group_key(group_id: str) -> bytes:
    """broker.groups.records.group_key (GroupMetadataKey, type 2), kept here: this module
    does not import storage."""
    raw = group_id.encode("utf-8")
    return struct.pack(">hh", 2, len(raw)) + raw


def _member_id(prefix: str, unique: str) -> str:
    """Kafka's "<instance or client id>-<uuid>", its prefix cut so the id still fits the
    int16-length string every answer carries it in: one unencodable member id would
    break the JoinGroup and DescribeGroups answers of its whole group."""
    room = _MAX_MEMBER_ID_BYTES - len(unique.encode()) - 1
    raw = prefix.encode()
    if len(raw) > room:
        prefix = raw[: max(room, 0)].decode(errors="ignore")
    return f"{prefix}-{unique}"

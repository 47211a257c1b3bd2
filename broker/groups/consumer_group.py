"""The KIP-848 consumer group protocol as a pure state machine (Kafka 4.x's ConsumerGroup).

Theory of operation. The coordinator owns the assignment: members only heartbeat
(ConsumerGroupHeartbeat) with their subscription and the partitions they own, and each
answer carries the partitions they may own now. Three epochs order everything:

- the *group epoch* goes up whenever what the assignment depends on changes: a member
  joins, leaves or is fenced, a subscription or server assignor changes, or a subscribed
  topic appears or changes its partition count;
- the *assignment epoch* is the group epoch the current *target assignment* was computed
  for: when the group epoch is ahead, the next heartbeat runs the assignor (uniform or
  range, `broker.groups.assignors`) for every member;
- each *member epoch* says which target assignment a member has reconciled to.

Reconciliation (Kafka's CurrentAssignmentBuilder) moves one member toward its target:
partitions it owns but must give up are *revoked first*: it stays at its epoch in state
`UNREVOKED_PARTITIONS` until a heartbeat shows it no longer owns them (or its rebalance
timeout passes: then it is fenced); only then does it move to the target epoch and
receive new partitions, and only those no other member still holds (a partition's owner
is tracked in `partition_owners`; a member waiting for one is `UNRELEASED_PARTITIONS`).
So a partition never has two owners, whatever order the members heartbeat in.

A member whose heartbeat carries an epoch ahead of ours, or behind it (other than the
previous epoch with a subset of its partitions: our answer was lost), is fenced with
FENCED_MEMBER_EPOCH and rejoins with epoch 0. A member silent for its session timeout,
or revoking for longer than its rebalance timeout, is removed (the group epoch goes up).
Epoch -1 leaves; -2 is a static member's temporary leave (it keeps its partitions until
its session times out or its instance id comes back under a new member id).

Every change is written as Kafka's records (`broker.groups.consumer_records`) to
`Groups.records` for the driver to append to the offsets archive; `load` rebuilds the
group from the last word of each. Time is an argument (`now`, monotonic ms); deadlines
are read by the driver through the owning classic `Group`'s `next_deadline`/`tick`.

Imports the standard library and broker.groups' pure modules: no trio, no storage, no
protocol classes.
"""

from __future__ import annotations

import enum
import logging
import re
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from broker.groups import assignors, codes
from broker.groups import consumer_protocol as cp
from broker.groups import consumer_records as rec
from broker.groups.assignors import Assignment, AssignorMember

log = logging.getLogger("hyperkafka.groups")

FENCED_MEMBER_EPOCH = 110
UNRELEASED_INSTANCE_ID = 111
UNSUPPORTED_ASSIGNOR = 112
STALE_MEMBER_EPOCH = 113
INVALID_REGULAR_EXPRESSION = 128
MAX_REGEX_CHARS = 1000
LEAVE_EPOCH = -1
CONSUMER_PROTOCOL_TYPE = "consumer"  # the classic protocol type of Kafka's consumers
STATIC_LEAVE_EPOCH = -2

Records = list[tuple[bytes, bytes | None]]
# topic name -> (topic id, partition count), None when the topic does not exist
TopicLookup = Callable[[str], "tuple[uuid.UUID, int] | None"]


class MemberState(enum.IntEnum):
    STABLE = 1
    UNREVOKED_PARTITIONS = 2
    UNRELEASED_PARTITIONS = 3


class ConsumerGroupState(enum.Enum):
    EMPTY = "Empty"
    ASSIGNING = "Assigning"
    RECONCILING = "Reconciling"
    STABLE = "Stable"
    DEAD = "Dead"


@dataclass(frozen=True)
class ConsumerSettings:
    """The consumer protocol's broker settings (Kafka's names in `NAMES`)."""

    session_timeout_ms: int = 45_000
    heartbeat_interval_ms: int = 5_000
    min_session_timeout_ms: int = 45_000
    max_session_timeout_ms: int = 60_000
    max_size: int = 2**31 - 1
    assignors: tuple[str, ...] = ("uniform", "range")
    # group.consumer.migration.policy: which online conversions between a classic group
    # with members and a consumer group are allowed (Kafka 4's default: both ways).
    migration_policy: str = "bidirectional"

    NAMES: ClassVar[dict[str, str]] = {
        "group.consumer.session.timeout.ms": "session_timeout_ms",
        "group.consumer.heartbeat.interval.ms": "heartbeat_interval_ms",
        "group.consumer.min.session.timeout.ms": "min_session_timeout_ms",
        "group.consumer.max.session.timeout.ms": "max_session_timeout_ms",
        "group.consumer.max.size": "max_size",
        "group.consumer.assignors": "assignors",
        "group.consumer.migration.policy": "migration_policy",
    }

    def allows_upgrade(self) -> bool:
        return self.migration_policy in ("bidirectional", "upgrade")

    def allows_downgrade(self) -> bool:
        return self.migration_policy in ("bidirectional", "downgrade")

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> ConsumerSettings:
        values: dict[str, object] = {}
        for name, attr in cls.NAMES.items():
            if name not in props:
                continue
            if attr == "assignors":
                names = tuple(a.strip() for a in props[name].split(",") if a.strip())
                # Kafka also takes class names; only the two built-in assignors exist here.
                short = tuple(a.rsplit(".", 1)[-1].removesuffix("Assignor").lower() for a in names)
                unknown = [a for a in short if a not in assignors.ASSIGNORS]
                if not short or unknown:
                    raise ValueError(
                        f"group.consumer.assignors: unknown assignor(s) {unknown or names}"
                    )
                values[attr] = short
            elif attr == "migration_policy":
                policy = props[name].strip().lower()
                if policy not in ("disabled", "upgrade", "downgrade", "bidirectional"):
                    raise ValueError(f"{name}: unknown policy {props[name]!r}")
                values[attr] = policy
            else:
                value = int(props[name])
                if value < 1:
                    raise ValueError(f"{name} must be positive")
                values[attr] = value
        settings = cls(**values)  # type: ignore[arg-type]
        if (
            not settings.min_session_timeout_ms
            <= settings.session_timeout_ms
            <= settings.max_session_timeout_ms
        ):
            # Kafka requires the default inside the bounds; widen them rather than refuse
            # a lone group.consumer.session.timeout.ms (tests shorten it).
            settings = cls(
                **{
                    **settings.__dict__,
                    "min_session_timeout_ms": min(
                        settings.min_session_timeout_ms, settings.session_timeout_ms
                    ),
                    "max_session_timeout_ms": max(
                        settings.max_session_timeout_ms, settings.session_timeout_ms
                    ),
                }
            )
        both = (
            "group.consumer.session.timeout.ms" in props
            and "group.consumer.heartbeat.interval.ms" in props
        )
        if both and settings.heartbeat_interval_ms >= settings.session_timeout_ms:
            raise ValueError(
                "group.consumer.heartbeat.interval.ms must be below group.consumer.session.timeout.ms"
            )
        return settings


@dataclass
class ConsumerMember:
    member_id: str
    instance_id: str | None = None
    rack_id: str | None = None
    client_id: str = ""
    client_host: str = ""
    subscribed_topic_names: tuple[str, ...] = ()
    subscribed_topic_regex: str | None = None
    server_assignor: str | None = None
    rebalance_timeout_ms: int = 300_000
    member_epoch: int = 0
    previous_member_epoch: int = -1
    state: MemberState = MemberState.STABLE
    assigned: Assignment = field(default_factory=dict)
    pending_revocation: Assignment = field(default_factory=dict)
    session_deadline: int | None = None
    revocation_deadline: int | None = None
    # A member speaking the classic protocol (JoinGroup/SyncGroup/Heartbeat) in this
    # consumer group: (session timeout ms, its JoinGroup protocols); None otherwise.
    classic: tuple[int, tuple[tuple[str, bytes], ...]] | None = None

    def session_timeout_ms(self, settings: ConsumerSettings) -> int:
        return settings.session_timeout_ms if self.classic is None else self.classic[0]

    def metadata(self) -> rec.MemberMetadata:
        return rec.MemberMetadata(
            self.instance_id,
            self.rack_id,
            self.client_id,
            self.client_host,
            self.subscribed_topic_names,
            self.subscribed_topic_regex,
            self.rebalance_timeout_ms,
            self.server_assignor,
            self.classic,
        )

    def current(self) -> rec.CurrentAssignment:
        return rec.CurrentAssignment(
            self.member_epoch,
            self.previous_member_epoch,
            int(self.state),
            self.assigned,
            self.pending_revocation,
        )


@dataclass(frozen=True)
class ClassicMember:
    """A member of a stable classic group being converted (ConsumerGroup.fromClassicGroup)."""

    member_id: str
    client_id: str
    client_host: str
    rebalance_timeout_ms: int
    session_timeout_ms: int
    protocols: tuple[tuple[str, bytes], ...]
    subscription: bytes  # its metadata for the group's protocol
    assignment: bytes  # what the leader's SyncGroup gave it
    instance_id: str | None = None  # a static member's group.instance.id


@dataclass(frozen=True)
class Heartbeat:
    """One ConsumerGroupHeartbeat, version-agnostic. None = "unchanged since the last"."""

    group_id: str
    member_id: str
    member_epoch: int
    instance_id: str | None = None
    rack_id: str | None = None
    rebalance_timeout_ms: int = -1
    subscribed_topic_names: tuple[str, ...] | None = None
    subscribed_topic_regex: str | None = None
    server_assignor: str | None = None
    owned: Assignment | None = None
    client_id: str = ""
    client_host: str = ""
    version: int = 0


@dataclass(frozen=True)
class HeartbeatResult:
    error: int
    message: str | None = None
    member_id: str | None = None
    member_epoch: int = 0
    heartbeat_interval_ms: int = 0
    assignment: Assignment | None = None


class HeartbeatError(Exception):
    def __init__(self, error: int, message: str) -> None:
        super().__init__(message)
        self.error = error
        self.message = message


def _union(a: Assignment, b: Assignment) -> Assignment:
    out = dict(a)
    for t, ps in b.items():
        out[t] = out.get(t, frozenset()) | ps
    return {t: ps for t, ps in out.items() if ps}


def _minus(a: Assignment, b: Assignment) -> Assignment:
    out = {t: ps - b.get(t, frozenset()) for t, ps in a.items()}
    return {t: ps for t, ps in out.items() if ps}


def _intersect(a: Assignment, b: Assignment) -> Assignment:
    out = {t: ps & b.get(t, frozenset()) for t, ps in a.items()}
    return {t: ps for t, ps in out.items() if ps}


def _subset(a: Assignment, b: Assignment) -> bool:
    return all(ps <= b.get(t, frozenset()) for t, ps in a.items())


def _normal(a: Assignment) -> Assignment:
    return {t: frozenset(ps) for t, ps in a.items() if ps}


class ConsumerGroup:
    """One group of type consumer: members, epochs, target assignment and partition owners."""

    def __init__(self, group_id: str, settings: ConsumerSettings, records: Records) -> None:
        self.group_id = group_id
        self.settings = settings
        self.records = records  # the owner's list: every change is appended here
        self.group_epoch = 0
        self.assignment_epoch = 0
        self.members: dict[str, ConsumerMember] = {}
        self.static_members: dict[str, str] = {}  # instance id -> member id
        self.target: dict[str, Assignment] = {}
        # (topic id, partition) -> the member holding it (assigned or revoking); a
        # partition is given to another member only once it is out of here.
        self.partition_owners: dict[tuple[uuid.UUID, int], str] = {}
        # The subscribed topics as last seen: name -> (topic id, partitions)
        self.topic_metadata: dict[str, tuple[uuid.UUID, int]] = {}
        self.assignor_name = settings.assignors[0]

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> ConsumerGroupState:
        if not self.members:
            return ConsumerGroupState.EMPTY
        if self.group_epoch > self.assignment_epoch:
            return ConsumerGroupState.ASSIGNING
        if any(
            m.member_epoch != self.assignment_epoch or m.state is not MemberState.STABLE
            for m in self.members.values()
        ):
            return ConsumerGroupState.RECONCILING
        return ConsumerGroupState.STABLE

    def subscribed_names(self, names: Iterable[str] = ()) -> set[str]:
        """Every topic a member subscribes to by name, or by regex among `names`."""
        out: set[str] = set()
        regexes = set()
        for m in self.members.values():
            out.update(m.subscribed_topic_names)
            if m.subscribed_topic_regex:
                regexes.add(m.subscribed_topic_regex)
        for pattern in regexes:
            compiled = _compile(pattern)
            if compiled is not None:
                out.update(n for n in names if compiled.fullmatch(n))
        return out

    def is_subscribed_to_topic(self, topic: str) -> bool:
        return topic in self.topic_metadata or any(
            topic in m.subscribed_topic_names for m in self.members.values()
        )

    def tombstones(self) -> Records:
        """Deletes every record of this group (DeleteGroups, expiry, a classic takeover)."""
        out: Records = [
            (rec.key(t, self.group_id, m), None)
            for m in self.members
            for t in (rec.CURRENT_MEMBER, rec.TARGET_MEMBER, rec.MEMBER_METADATA)
        ]
        out += [
            (rec.key(rec.TARGET_METADATA, self.group_id), None),
            (rec.key(rec.GROUP_METADATA, self.group_id), None),
        ]
        return out

    def next_deadline(self) -> int | None:
        deadlines = [
            d
            for m in self.members.values()
            for d in (m.session_deadline, m.revocation_deadline)
            if d is not None
        ]
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(
        self, now: int, hb: Heartbeat, lookup: TopicLookup, names: Callable[[], Iterable[str]]
    ) -> HeartbeatResult:
        try:
            return self._heartbeat(now, hb, lookup, names)
        except HeartbeatError as exc:
            # Kafka answers an error with no member id and epoch 0, whatever was asked.
            return HeartbeatResult(exc.error, exc.message)

    def _heartbeat(
        self, now: int, hb: Heartbeat, lookup: TopicLookup, names: Callable[[], Iterable[str]]
    ) -> HeartbeatResult:
        if hb.subscribed_topic_regex:
            why = regex_refusal(hb.subscribed_topic_regex)
            if why is not None:
                raise HeartbeatError(
                    INVALID_REGULAR_EXPRESSION,
                    f"SubscribedTopicRegex `{hb.subscribed_topic_regex}` is not a valid regular expression: {why}.",
                )
        if hb.member_epoch in (LEAVE_EPOCH, STATIC_LEAVE_EPOCH):
            return self._leave(now, hb)
        member, is_new = self._member_for(now, hb)
        changed = is_new
        # Fields given update the member; a change of what the assignment depends on
        # bumps the group epoch.
        if hb.instance_id is not None:
            member.instance_id = hb.instance_id
        if hb.rack_id is not None:
            member.rack_id = hb.rack_id
        if hb.rebalance_timeout_ms != -1:
            member.rebalance_timeout_ms = hb.rebalance_timeout_ms
        member.client_id, member.client_host = hb.client_id, hb.client_host
        if (
            hb.subscribed_topic_names is not None
            and tuple(sorted(hb.subscribed_topic_names)) != member.subscribed_topic_names
        ):
            member.subscribed_topic_names = tuple(sorted(hb.subscribed_topic_names))
            changed = True
        if (
            hb.subscribed_topic_regex is not None
            and (hb.subscribed_topic_regex or None) != member.subscribed_topic_regex
        ):
            member.subscribed_topic_regex = hb.subscribed_topic_regex or None
            changed = True
        if hb.server_assignor is not None and hb.server_assignor != member.server_assignor:
            member.server_assignor = hb.server_assignor
            changed = True
        if changed:
            self._write_metadata(member)
        self._follow_subscriptions(changed, lookup, names)
        before = member.assigned
        self._reconcile(now, member, hb.owned)
        member.session_deadline = now + self.settings.session_timeout_ms
        full = hb.member_epoch == 0 or (
            hb.rebalance_timeout_ms != -1
            and (hb.subscribed_topic_names is not None or hb.subscribed_topic_regex is not None)
            and hb.owned is not None
        )
        return HeartbeatResult(
            codes.NONE,
            None,
            member.member_id,
            member.member_epoch,
            self.settings.heartbeat_interval_ms,
            member.assigned if full or member.assigned != before else None,
        )

    @staticmethod
    def check_join(hb: Heartbeat, settings: ConsumerSettings) -> None:
        """Raise the HeartbeatError a join (member epoch 0) is refused with, before any
        change (an online upgrade runs only for a join that will be accepted)."""
        if hb.subscribed_topic_regex:
            why = regex_refusal(hb.subscribed_topic_regex)
            if why is not None:
                raise HeartbeatError(
                    INVALID_REGULAR_EXPRESSION,
                    f"SubscribedTopicRegex `{hb.subscribed_topic_regex}` is not a valid regular expression: {why}.",
                )
        if (
            hb.rebalance_timeout_ms == -1
            or (hb.subscribed_topic_names is None and hb.subscribed_topic_regex is None)
            or hb.owned is None
        ):
            raise HeartbeatError(
                codes.INVALID_REQUEST,
                "A join (member epoch 0) must carry the rebalance timeout, the subscription and the owned partitions.",
            )
        if hb.server_assignor is not None and hb.server_assignor not in settings.assignors:
            raise HeartbeatError(
                UNSUPPORTED_ASSIGNOR,
                f"ServerAssignor {hb.server_assignor} is not supported. Supported assignors: {', '.join(settings.assignors)}.",
            )

    def _member_for(self, now: int, hb: Heartbeat) -> tuple[ConsumerMember, bool]:
        """The member this heartbeat is from (created on a join), its epoch checked."""
        if hb.member_epoch == 0:
            self.check_join(hb, self.settings)
            if hb.instance_id is not None:
                return self._static_join(now, hb)
            member_id = hb.member_id or str(uuid.uuid4())
            member = self.members.get(member_id)
            if member is not None:
                return member, False  # rejoining (fenced, or a lost answer): it keeps its state
            return self._add(ConsumerMember(member_id)), True
        if not hb.member_id:
            raise HeartbeatError(codes.INVALID_REQUEST, "MemberId can't be empty.")
        if hb.server_assignor is not None and hb.server_assignor not in self.settings.assignors:
            raise HeartbeatError(
                UNSUPPORTED_ASSIGNOR, f"ServerAssignor {hb.server_assignor} is not supported."
            )
        member = self.members.get(hb.member_id)
        if member is None:
            raise HeartbeatError(
                codes.UNKNOWN_MEMBER_ID,
                f"Member {hb.member_id} is not a member of group {self.group_id}.",
            )
        if hb.instance_id is not None and member.instance_id != hb.instance_id:
            raise HeartbeatError(
                codes.FENCED_INSTANCE_ID,
                f"Static member {hb.member_id} with instance id {hb.instance_id} is fenced.",
            )
        if hb.member_epoch > member.member_epoch:
            raise HeartbeatError(
                FENCED_MEMBER_EPOCH,
                f"The consumer group member has a greater member epoch ({hb.member_epoch}) than the one known by the group coordinator ({member.member_epoch}). The member must abandon all its partitions and rejoin.",
            )
        if hb.member_epoch < member.member_epoch and (
            hb.member_epoch != member.previous_member_epoch
            or hb.owned is None
            or not _subset(hb.owned, member.assigned)
        ):
            raise HeartbeatError(
                FENCED_MEMBER_EPOCH,
                f"The consumer group member has a smaller member epoch ({hb.member_epoch}) than the one known by the group coordinator ({member.member_epoch}). The member must abandon all its partitions and rejoin.",
            )
        return member, False

    def _static_join(self, now: int, hb: Heartbeat) -> tuple[ConsumerMember, bool]:
        assert hb.instance_id is not None
        member_id = hb.member_id or str(uuid.uuid4())
        old_id = self.static_members.get(hb.instance_id)
        if old_id is None:
            member = self._add(ConsumerMember(member_id, instance_id=hb.instance_id))
            return member, True
        old = self.members[old_id]
        if old_id == member_id:
            return old, False
        if old.member_epoch != STATIC_LEAVE_EPOCH:
            raise HeartbeatError(
                UNRELEASED_INSTANCE_ID,
                f"Static member {old_id} with instance id {hb.instance_id} is not released yet.",
            )
        # The same instance back under a new member id: it takes over the old one's
        # partitions and epoch, without a rebalance.
        self._tombstone_member(old_id)
        del self.members[old_id]
        self._release(old)
        old.member_id = member_id
        self._hold(old)
        old.member_epoch = old.previous_member_epoch
        self.members[member_id] = old
        self.static_members[hb.instance_id] = member_id
        if old_id in self.target:
            self.target[member_id] = self.target.pop(old_id)
            self.records.append(
                (
                    rec.key(rec.TARGET_MEMBER, self.group_id, member_id),
                    rec.target_member(self.target[member_id]),
                )
            )
        self._write_metadata(old)
        self._write_current(old)
        return old, False

    def _add(self, member: ConsumerMember) -> ConsumerMember:
        if len(self.members) >= self.settings.max_size:
            raise HeartbeatError(
                codes.GROUP_MAX_SIZE_REACHED,
                f"The consumer group has reached its maximum capacity of {self.settings.max_size} members.",
            )
        self.members[member.member_id] = member
        if member.instance_id is not None:
            self.static_members[member.instance_id] = member.member_id
        log.info("group %s: member %s joins", self.group_id, member.member_id)
        return member

    def _leave(self, now: int, hb: Heartbeat) -> HeartbeatResult:
        member = self.members.get(hb.member_id)
        if member is None:
            if hb.instance_id is not None and hb.instance_id in self.static_members:
                raise HeartbeatError(
                    codes.FENCED_INSTANCE_ID,
                    f"Instance id {hb.instance_id} belongs to another member.",
                )
            raise HeartbeatError(
                codes.UNKNOWN_MEMBER_ID,
                f"Member {hb.member_id} is not a member of group {self.group_id}.",
            )
        if hb.member_epoch == STATIC_LEAVE_EPOCH and member.instance_id is not None:
            # Kept, partitions and all, for its session timeout: its instance may return.
            member.previous_member_epoch = member.member_epoch
            member.member_epoch = STATIC_LEAVE_EPOCH
            member.revocation_deadline = None
            self._write_current(member)
            log.info(
                "group %s: static member %s (%s) leaves for now",
                self.group_id,
                member.member_id,
                member.instance_id,
            )
            return HeartbeatResult(codes.NONE, None, member.member_id, STATIC_LEAVE_EPOCH, 0)
        self.remove(member.member_id, "left")
        return HeartbeatResult(codes.NONE, None, member.member_id, LEAVE_EPOCH, 0)

    def remove(self, member_id: str, why: str) -> None:
        """The member leaves or is fenced: its partitions are free, the group rebalances."""
        member = self.members.pop(member_id, None)
        if member is None:
            return
        if (
            member.instance_id is not None
            and self.static_members.get(member.instance_id) == member_id
        ):
            del self.static_members[member.instance_id]
        self._release(member)
        self.target.pop(member_id, None)
        self._tombstone_member(member_id)
        log.info("group %s: member %s %s", self.group_id, member_id, why)
        self._bump_group_epoch()

    def _tombstone_member(self, member_id: str) -> None:
        for record_type in (rec.CURRENT_MEMBER, rec.TARGET_MEMBER, rec.MEMBER_METADATA):
            self.records.append((rec.key(record_type, self.group_id, member_id), None))

    def _bump_group_epoch(self) -> None:
        self.group_epoch += 1
        self.records.append(
            (rec.key(rec.GROUP_METADATA, self.group_id), rec.group_metadata(self.group_epoch))
        )

    def _topic_metadata(
        self, lookup: TopicLookup, names: Callable[[], Iterable[str]]
    ) -> dict[str, tuple[uuid.UUID, int]]:
        regex = any(m.subscribed_topic_regex for m in self.members.values())
        out = {}
        for name in self.subscribed_names(names() if regex else ()):
            found = lookup(name)
            if found is not None:
                out[name] = found
        return out

    # ------------------------------------------------------------------ assignment

    def preferred_assignor(self) -> str:
        """Kafka: the server assignor most members name, else the first configured."""
        votes = Counter(m.server_assignor for m in self.members.values() if m.server_assignor)
        return votes.most_common(1)[0][0] if votes else self.settings.assignors[0]

    def _compute_target(self) -> None:
        self.assignor_name = self.preferred_assignor()
        topics = {tid: n for tid, n in self.topic_metadata.values()}
        regexes = {
            m.subscribed_topic_regex for m in self.members.values() if m.subscribed_topic_regex
        }
        compiled = {p: _compile(p) for p in regexes}
        inputs = []
        for m in self.members.values():
            names = set(m.subscribed_topic_names)
            rx = compiled.get(m.subscribed_topic_regex or "")
            if rx is not None:
                names.update(n for n in self.topic_metadata if rx.fullmatch(n))
            subscribed = frozenset(
                self.topic_metadata[n][0] for n in names if n in self.topic_metadata
            )
            inputs.append(AssignorMember(m.member_id, subscribed, self.target.get(m.member_id, {})))
        new = assignors.assign(self.assignor_name, inputs, topics)
        for member_id, assignment in new.items():
            assignment = _normal(assignment)
            if self.target.get(member_id) != assignment:
                self.target[member_id] = assignment
                self.records.append(
                    (
                        rec.key(rec.TARGET_MEMBER, self.group_id, member_id),
                        rec.target_member(assignment),
                    )
                )
        self.assignment_epoch = self.group_epoch
        self.records.append(
            (
                rec.key(rec.TARGET_METADATA, self.group_id),
                rec.target_metadata(self.assignment_epoch),
            )
        )
        log.info(
            "group %s: target assignment of epoch %d computed by %s for %d members",
            self.group_id,
            self.assignment_epoch,
            self.assignor_name,
            len(self.members),
        )

    def _reconcile(self, now: int, member: ConsumerMember, owned: Assignment | None) -> None:
        """CurrentAssignmentBuilder: one step of `member` toward its target assignment."""
        if member.state is MemberState.UNREVOKED_PARTITIONS:
            # Still revoking unless the member's owned partitions show it let them go.
            if owned is None or any(_intersect(owned, member.pending_revocation)):
                return
        elif member.state is MemberState.STABLE and member.member_epoch == self.assignment_epoch:
            return
        target = self.target.get(member.member_id, {})
        keep = _intersect(member.assigned, target)
        revoke = _minus(member.assigned, target)
        wanted = _minus(target, member.assigned)
        free: dict[uuid.UUID, frozenset[int]] = {}
        unreleased = False
        for t, ps in wanted.items():
            ok = frozenset(p for p in ps if (t, p) not in self.partition_owners)
            unreleased |= ok != ps
            if ok:
                free[t] = ok
        old = (member.member_epoch, member.state, member.assigned, member.pending_revocation)
        self._release(member)
        if revoke:
            # Revocation first: the member keeps its epoch until it gives them up.
            member.state = MemberState.UNREVOKED_PARTITIONS
            member.assigned, member.pending_revocation = keep, revoke
            if member.revocation_deadline is None:
                member.revocation_deadline = now + member.rebalance_timeout_ms
        else:
            member.state = MemberState.UNRELEASED_PARTITIONS if unreleased else MemberState.STABLE
            if member.member_epoch != self.assignment_epoch:
                member.previous_member_epoch = member.member_epoch
                member.member_epoch = self.assignment_epoch
            member.assigned, member.pending_revocation = _union(keep, free), {}
            member.revocation_deadline = None
        self._hold(member)
        if (member.member_epoch, member.state, member.assigned, member.pending_revocation) != old:
            self._write_current(member)

    def _release(self, member: ConsumerMember) -> None:
        for t, ps in _union(member.assigned, member.pending_revocation).items():
            for p in ps:
                if self.partition_owners.get((t, p)) == member.member_id:
                    del self.partition_owners[(t, p)]

    def _hold(self, member: ConsumerMember) -> None:
        for t, ps in _union(member.assigned, member.pending_revocation).items():
            for p in ps:
                self.partition_owners[(t, p)] = member.member_id

    def _write_metadata(self, member: ConsumerMember) -> None:
        self.records.append(
            (
                rec.key(rec.MEMBER_METADATA, self.group_id, member.member_id),
                rec.member_metadata(member.metadata()),
            )
        )

    def _follow_subscriptions(
        self, changed: bool, lookup: TopicLookup, names: Callable[[], Iterable[str]]
    ) -> None:
        """A member's subscription `changed`, or the subscribed topics did: a new group
        epoch, and a new target assignment for it."""
        metadata = self._topic_metadata(lookup, names)
        if changed or metadata != self.topic_metadata:
            self.topic_metadata = metadata
            self._bump_group_epoch()
        if self.group_epoch > self.assignment_epoch:
            self._compute_target()

    def _write_current(self, member: ConsumerMember) -> None:
        self.records.append(
            (
                rec.key(rec.CURRENT_MEMBER, self.group_id, member.member_id),
                rec.current_member(member.current()),
            )
        )

    # ------------------------------------------------------------------ classic members

    @classmethod
    def from_classic(
        cls,
        now: int,
        group_id: str,
        settings: ConsumerSettings,
        records: Records,
        generation: int,
        members: Iterable[ClassicMember],
        lookup: TopicLookup,
        names: Callable[[], Iterable[str]],
    ) -> ConsumerGroup:
        """Kafka's convertToConsumerGroup: a stable classic group of the consumer protocol
        as a consumer group whose group and assignment epochs are its generation, each
        member keeping the partitions its assignment named as its target and current
        assignment, and a static member its instance id. ValueError when a member's
        embedded protocol cannot be read."""
        group = cls(group_id, settings, records)
        group.group_epoch = group.assignment_epoch = generation
        staged = []
        for c in members:
            sub = cp.decode_subscription(c.subscription)
            assigned: Assignment = {}
            for topic, parts in cp.decode_assignment(c.assignment).items():
                found = lookup(topic)
                if found is not None:
                    assigned[found[0]] = frozenset(p for p in parts if 0 <= p < found[1])
            member = ConsumerMember(
                c.member_id,
                instance_id=c.instance_id,
                client_id=c.client_id,
                client_host=c.client_host,
                subscribed_topic_names=tuple(sorted(set(sub.topics))),
                rebalance_timeout_ms=c.rebalance_timeout_ms,
                member_epoch=generation,
                previous_member_epoch=generation,
                assigned=_normal(assigned),
                classic=(c.session_timeout_ms, c.protocols),
            )
            member.session_deadline = now + c.session_timeout_ms
            staged.append(member)
        records.append((rec.key(rec.GROUP_METADATA, group_id), rec.group_metadata(generation)))
        for member in staged:
            group.members[member.member_id] = member
            if member.instance_id is not None:
                group.static_members[member.instance_id] = member.member_id
            group.target[member.member_id] = member.assigned
            group._hold(member)
            records.append(
                (
                    rec.key(rec.MEMBER_METADATA, group_id, member.member_id),
                    rec.member_metadata(member.metadata()),
                )
            )
            records.append(
                (
                    rec.key(rec.TARGET_MEMBER, group_id, member.member_id),
                    rec.target_member(member.assigned),
                )
            )
        records.append((rec.key(rec.TARGET_METADATA, group_id), rec.target_metadata(generation)))
        for member in staged:
            group._write_current(member)
        group.topic_metadata = group._topic_metadata(lookup, names)
        log.info(
            "group %s: classic group of generation %d upgraded to a consumer group (%d members)",
            group_id,
            generation,
            len(staged),
        )
        return group

    def classic_protocols_refusal(
        self, member_id: str, protocol_type: str, protocols: list[tuple[str, bytes]]
    ) -> int:
        """What a classic JoinGroup is refused with before anything else is looked at
        (throwIfConsumerGroupIsFull, then ConsumerGroup.supportsClassicProtocols): the
        group is full and `member_id` is not in it; the protocol type is not "consumer";
        or none of its protocols is supported by every classic member (with none, any
        named protocol goes). NONE when it may go on."""
        if len(self.members) >= self.settings.max_size and member_id not in self.members:
            return codes.GROUP_MAX_SIZE_REACHED
        names = {name for name, _ in protocols}
        if protocol_type != CONSUMER_PROTOCOL_TYPE or not names:
            return codes.INCONSISTENT_GROUP_PROTOCOL
        classic = [m.classic[1] for m in self.members.values() if m.classic is not None]
        if not any(all(any(n == name for n, _ in ps) for ps in classic) for name in names):
            return codes.INCONSISTENT_GROUP_PROTOCOL
        return codes.NONE

    def classic_join(
        self,
        now: int,
        member_id: str,
        instance_id: str | None,
        is_new: bool,
        protocols: list[tuple[str, bytes]],
        session_timeout_ms: int,
        rebalance_timeout_ms: int,
        client_id: str,
        client_host: str,
        lookup: TopicLookup,
        names: Callable[[], Iterable[str]],
    ) -> tuple[int, str, int, str]:
        """JoinGroup of a classic member (classicGroupJoinToConsumerGroup), after
        `classic_protocols_refusal`: its subscription and owned partitions come from the
        join metadata, and it is reconciled toward its target at once. `is_new`: the
        request named no member id (`member_id` is the one made for it). A static member
        (`instance_id`) joining anew replaces the member holding its instance id, which
        keeps its partitions and target under the new id and epoch: no rebalance (Kafka
        does not wait for a classic instance id to be released); rejoining with a known
        id, the instance id must still be its own (else UNKNOWN_MEMBER_ID, or
        FENCED_INSTANCE_ID when another member holds it). An embedded subscription that
        cannot be read is UNKNOWN_SERVER_ERROR, as Kafka's IllegalStateException, and
        changes nothing. (error, member id, generation = its member epoch, protocol name)."""
        try:
            sub: cp.Subscription | None = cp.decode_subscription(protocols[0][1])
        except ValueError:
            sub = None
        replaced: ConsumerMember | None = None
        if instance_id is None:
            member = self.members.get(member_id)
        else:
            holder = self.static_members.get(instance_id)
            if not is_new:
                if holder is None:
                    return codes.UNKNOWN_MEMBER_ID, member_id, -1, ""
                if holder != member_id:
                    log.info(
                        "group %s: static member %s with instance id %s is fenced by member %s",
                        self.group_id,
                        member_id,
                        instance_id,
                        holder,
                    )
                    return codes.FENCED_INSTANCE_ID, member_id, -1, ""
            member = self.members.get(member_id)
            if is_new and holder is not None:
                replaced = self.members[holder]
        if member is not None and member.classic is None:
            return codes.UNKNOWN_MEMBER_ID, member_id, -1, ""  # a consumer-protocol member's id
        if sub is None:
            return codes.UNKNOWN_SERVER_ERROR, member_id, -1, ""
        name = protocols[0][0]
        changed = False
        if replaced is not None:
            member = self._replace(replaced, member_id)
        elif member is None:
            try:
                member = self._add(ConsumerMember(member_id, instance_id=instance_id))
            except HeartbeatError as exc:
                return exc.error, member_id, -1, ""
            changed = True
        member.classic = (session_timeout_ms, tuple(protocols))
        member.rebalance_timeout_ms = rebalance_timeout_ms
        member.client_id, member.client_host = client_id, client_host
        topics = tuple(sorted(set(sub.topics)))
        changed |= topics != member.subscribed_topic_names
        member.subscribed_topic_names = topics
        self._write_metadata(member)
        self._follow_subscriptions(changed, lookup, names)
        owned: Assignment = {}
        for topic, parts in sub.owned.items():
            if topic in self.topic_metadata:
                owned[self.topic_metadata[topic][0]] = parts
        self._reconcile(now, member, owned)
        if member.state is MemberState.UNREVOKED_PARTITIONS:
            self._reconcile(now, member, owned)  # the join showed them given up already
        member.session_deadline = now + session_timeout_ms
        return codes.NONE, member.member_id, member.member_epoch, name

    def _replace(self, old: ConsumerMember, member_id: str) -> ConsumerMember:
        """Kafka's replaceMember for a static member back under `member_id`: the old id's
        records are deleted and the member, its partitions and its target assignment are
        written again under the new id at epoch 0, which the next reconciliation brings
        to the assignment epoch with the same partitions."""
        log.info(
            "group %s: static member with instance id %s rejoins as %s, replacing %s",
            self.group_id,
            old.instance_id,
            member_id,
            old.member_id,
        )
        self._tombstone_member(old.member_id)
        del self.members[old.member_id]
        self._release(old)
        target = self.target.pop(old.member_id, {})
        old.member_id = member_id
        old.member_epoch = old.previous_member_epoch = 0
        self.members[member_id] = old
        if old.instance_id is not None:
            self.static_members[old.instance_id] = member_id
        self.target[member_id] = target
        self._hold(old)
        self._write_metadata(old)
        self.records.append(
            (rec.key(rec.TARGET_MEMBER, self.group_id, member_id), rec.target_member(target))
        )
        self._write_current(old)
        return old

    def _classic_member(
        self, member_id: str, instance_id: str | None, generation: int
    ) -> ConsumerMember | int:
        """validateConsumerGroupMember, throwIfMemberDoesNotUseClassicProtocol and
        throwIfGenerationIdUnmatched: the classic member a request is from, or its error."""
        if instance_id is not None:
            holder = self.static_members.get(instance_id)
            if holder is None:
                return codes.UNKNOWN_MEMBER_ID
            if holder != member_id:
                return codes.FENCED_INSTANCE_ID
        member = self.members.get(member_id)
        if member is None or member.classic is None:
            return codes.UNKNOWN_MEMBER_ID
        if generation != member.member_epoch:
            return codes.ILLEGAL_GENERATION
        return member

    def classic_sync(
        self,
        now: int,
        member_id: str,
        instance_id: str | None,
        generation: int,
        protocol_type: str | None = None,
        protocol_name: str | None = None,
    ) -> tuple[int, bytes]:
        """SyncGroup of a classic member (classicGroupSyncToConsumerGroup): the
        server-side assignment it reconciled to, as a ConsumerProtocolAssignment. The
        protocol type and name, when the request has them, must be "consumer" and the
        one its join was answered with (INCONSISTENT_GROUP_PROTOCOL); a member behind the
        group epoch, unless it is revoking, must rejoin first (REBALANCE_IN_PROGRESS)."""
        member = self._classic_member(member_id, instance_id, generation)
        if isinstance(member, int):
            return member, b""
        assert member.classic is not None
        if protocol_type is not None and protocol_type != CONSUMER_PROTOCOL_TYPE:
            return codes.INCONSISTENT_GROUP_PROTOCOL, b""
        if protocol_name is not None and protocol_name != member.classic[1][0][0]:
            return codes.INCONSISTENT_GROUP_PROTOCOL, b""
        if (
            self.group_epoch > member.member_epoch
            and member.state is not MemberState.UNREVOKED_PARTITIONS
        ):
            return codes.REBALANCE_IN_PROGRESS, b""
        member.session_deadline = now + member.classic[0]
        by_id = {tid: name for name, (tid, _) in self.topic_metadata.items()}
        named = {by_id[t]: ps for t, ps in member.assigned.items() if t in by_id}
        return codes.NONE, cp.encode_assignment(named)

    def classic_heartbeat(
        self, now: int, member_id: str, instance_id: str | None, generation: int
    ) -> int:
        """Heartbeat of a classic member (classicGroupHeartbeatToConsumerGroup):
        REBALANCE_IN_PROGRESS when it must rejoin to be reconciled: it is behind the
        group epoch, it has partitions to revoke, or the partitions it waited for are
        free now (while another member still holds one, it waits: NONE)."""
        member = self._classic_member(member_id, instance_id, generation)
        if isinstance(member, int):
            return member
        assert member.classic is not None
        member.session_deadline = now + member.classic[0]
        if (
            member.member_epoch < self.group_epoch
            or member.state is MemberState.UNREVOKED_PARTITIONS
            or (
                member.state is MemberState.UNRELEASED_PARTITIONS
                and not self._waiting_on_unreleased(member)
            )
        ):
            return codes.REBALANCE_IN_PROGRESS
        return codes.NONE

    def _waiting_on_unreleased(self, member: ConsumerMember) -> bool:
        """ConsumerGroup.waitingOnUnreleasedPartition: a partition of its target that it
        does not have is still held by another member."""
        for t, ps in self.target.get(member.member_id, {}).items():
            mine = member.assigned.get(t, frozenset())
            if any(p not in mine and (t, p) in self.partition_owners for p in ps):
                return True
        return False

    def classic_leave(self, member_id: str, instance_id: str | None) -> int:
        """One member of a LeaveGroup (classicGroupLeaveToConsumerGroup): by member id, or
        by instance id, where an empty member id is an administrative removal and any
        other must be the instance's holder (FENCED_INSTANCE_ID). Only classic members
        leave this way (else UNKNOWN_MEMBER_ID)."""
        if instance_id is not None:
            holder = self.static_members.get(instance_id)
            if holder is None:
                return codes.UNKNOWN_MEMBER_ID
            if member_id and holder != member_id:
                return codes.FENCED_INSTANCE_ID
            member_id = holder
        member = self.members.get(member_id)
        if member is None or member.classic is None:
            return codes.UNKNOWN_MEMBER_ID
        self.remove(member_id, "left (LeaveGroup)")
        return codes.NONE

    # ------------------------------------------------------------------ timers

    def tick(self, now: int) -> None:
        for m in list(self.members.values()):
            if m.session_deadline is not None and m.session_deadline <= now:
                self.remove(m.member_id, "expired (no heartbeat within the session timeout)")
            elif (
                m.revocation_deadline is not None
                and m.revocation_deadline <= now
                and m.state is MemberState.UNREVOKED_PARTITIONS
            ):
                self.remove(
                    m.member_id,
                    "fenced (did not revoke its partitions within the rebalance timeout)",
                )

    # ------------------------------------------------------------------ offsets

    def validate_offset_commit(
        self, member_id: str, member_epoch: int, api_version: int, transactional: bool = False
    ) -> int:
        """ConsumerGroup.validateOffsetCommit: NONE or the error of every partition.
        `api_version` is OffsetCommit's; TxnOffsetCommit (`transactional`) has no v9
        and is checked on the member and its epoch only."""
        if member_epoch < 0 and not self.members:
            return codes.NONE  # the admin client, or a consumer without group management
        member = self.members.get(member_id)
        if member is None:
            return codes.UNKNOWN_MEMBER_ID
        if member.classic is not None:
            # A classic member commits with its generation: its member epoch.
            return codes.NONE if member_epoch == member.member_epoch else codes.ILLEGAL_GENERATION
        if api_version < 9 and not transactional:
            return codes.UNSUPPORTED_VERSION  # members of the consumer protocol commit with v9+
        if member_epoch != member.member_epoch:
            return STALE_MEMBER_EPOCH
        return codes.NONE

    def validate_offset_fetch(self, member_id: str | None, member_epoch: int) -> int:
        if member_epoch < 0 and not member_id:
            return codes.NONE
        member = self.members.get(member_id or "")
        if member is None:
            return codes.UNKNOWN_MEMBER_ID
        if member_epoch != member.member_epoch:
            return STALE_MEMBER_EPOCH
        return codes.NONE

    # ------------------------------------------------------------------ loading

    def load(
        self,
        now: int,
        records: Mapping[tuple[int, str], bytes],
        lookup: TopicLookup | None = None,
        names: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        """Install the last word of each record of this group read back from the archive
        (tombstones already applied); every member gets a fresh session. The subscribed
        topics' metadata is taken from the catalog as it is now (`lookup`), so a topic
        that changed while the broker was down is noticed only at its next change
        (Kafka 4.0 keeps a ConsumerGroupPartitionMetadata record for that; not written here)."""
        for (record_type, member_id), value in records.items():
            if record_type == rec.GROUP_METADATA:
                self.group_epoch = rec.decode_epoch(value)
            elif record_type == rec.TARGET_METADATA:
                self.assignment_epoch = rec.decode_epoch(value)
            elif record_type == rec.MEMBER_METADATA:
                md = rec.decode_member_metadata(value)
                m = self.members.setdefault(member_id, ConsumerMember(member_id))
                m.instance_id, m.rack_id, m.client_id, m.client_host = (
                    md.instance_id,
                    md.rack_id,
                    md.client_id,
                    md.client_host,
                )
                m.subscribed_topic_names, m.subscribed_topic_regex = (
                    md.subscribed_topic_names,
                    md.subscribed_topic_regex,
                )
                m.rebalance_timeout_ms, m.server_assignor = (
                    md.rebalance_timeout_ms,
                    md.server_assignor,
                )
                m.classic = md.classic
        for (record_type, member_id), value in records.items():
            if record_type == rec.TARGET_MEMBER and member_id in self.members:
                self.target[member_id] = _normal(rec.decode_target_member(value))
            elif record_type == rec.CURRENT_MEMBER and member_id in self.members:
                c = rec.decode_current_member(value)
                m = self.members[member_id]
                m.member_epoch, m.previous_member_epoch = c.member_epoch, c.previous_member_epoch
                m.state = (
                    MemberState(c.state)
                    if c.state in MemberState._value2member_map_
                    else MemberState.STABLE
                )
                m.assigned, m.pending_revocation = (
                    _normal(dict(c.assigned)),
                    _normal(dict(c.pending_revocation)),
                )
        for m in self.members.values():
            if m.instance_id is not None:
                self.static_members[m.instance_id] = m.member_id
            m.session_deadline = now + m.session_timeout_ms(self.settings)
            if m.state is MemberState.UNREVOKED_PARTITIONS:
                m.revocation_deadline = now + m.rebalance_timeout_ms
            self._hold(m)
        self.assignor_name = self.preferred_assignor()
        if lookup is not None:
            self.topic_metadata = self._topic_metadata(lookup, names)


def _compile(pattern: str) -> re.Pattern[str] | None:
    if regex_refusal(pattern) is not None:
        return None
    return re.compile(pattern)


_REPEATS = frozenset({"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"})
_NOT_RE2 = frozenset({"GROUPREF", "GROUPREF_EXISTS", "ASSERT", "ASSERT_NOT"})


def regex_refusal(pattern: str) -> str | None:
    """Why a subscription pattern is refused (INVALID_REGULAR_EXPRESSION), or None.

    Kafka matches with RE2/J, in linear time; Python's `re` backtracks, so a hostile
    pattern such as ``(a+)+$`` could stall the coordinator on a long topic name. What RE2
    does not have is refused as RE2/J refuses it (backreferences, lookaround), and so is
    what makes backtracking exponential: a repetition of something that itself repeats or
    branches (``(a+)+``, ``(a|aa)*``)."""
    if len(pattern) > MAX_REGEX_CHARS:
        return f"longer than {MAX_REGEX_CHARS} characters"
    try:
        tree = re._parser.parse(pattern)  # type: ignore[attr-defined]
    except re.error as exc:
        return str(exc)

    def walk(items: Any, inside_repeat: bool) -> str | None:
        for op, arg in items:
            name = str(op)
            if name in _NOT_RE2:
                return "backreferences and lookaround are not supported"
            if name in _REPEATS:
                if inside_repeat:
                    return "a repetition inside a repetition"
                if (why := walk(arg[2], True)) is not None:
                    return why
            elif name == "BRANCH":
                if inside_repeat:
                    return "an alternation inside a repetition"
                for branch in arg[1]:
                    if (why := walk(branch, inside_repeat)) is not None:
                        return why
            elif name == "SUBPATTERN" and (why := walk(arg[3], inside_repeat)) is not None:
                return why
        return None

    return walk(tree, False)

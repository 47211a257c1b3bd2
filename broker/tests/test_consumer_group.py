"""KIP-848: the server-side assignors and the consumer group's reconciliation machine."""

from __future__ import annotations

import uuid

import pytest

from broker.groups import assignors, codes
from broker.groups import consumer_records as rec
from broker.groups.assignors import AssignorMember
from broker.groups.consumer_group import (
    FENCED_MEMBER_EPOCH,
    INVALID_REGULAR_EXPRESSION,
    STALE_MEMBER_EPOCH,
    UNRELEASED_INSTANCE_ID,
    UNSUPPORTED_ASSIGNOR,
    ConsumerGroup,
    ConsumerGroupState,
    ConsumerSettings,
    Heartbeat,
    HeartbeatResult,
    MemberState,
    regex_refusal,
)
from broker.groups.records import RecordFormatError

T1, T2 = uuid.UUID(int=1), uuid.UUID(int=2)


def counts(result: dict[str, assignors.Assignment]) -> dict[str, int]:
    return {m: sum(len(ps) for ps in a.values()) for m, a in result.items()}


def size(a: assignors.Assignment | None) -> int:
    assert a is not None
    return sum(len(ps) for ps in a.values())


def all_partitions(result: dict[str, assignors.Assignment]) -> list[tuple[uuid.UUID, int]]:
    return sorted(((t, p) for a in result.values() for t, ps in a.items() for p in ps), key=str)


# ---------------------------------------------------------------- assignors


def test_uniform_balances_and_covers_every_partition_once() -> None:
    members = [AssignorMember(f"m{i}", frozenset({T1, T2}), {}) for i in range(3)]
    result = assignors.uniform(members, {T1: 5, T2: 3})
    assert sorted(counts(result).values()) == [2, 3, 3]
    assert all_partitions(result) == sorted(
        [(T1, p) for p in range(5)] + [(T2, p) for p in range(3)], key=str
    )


def test_uniform_is_sticky_when_a_member_joins() -> None:
    two = [AssignorMember(f"m{i}", frozenset({T1}), {}) for i in range(2)]
    first = assignors.uniform(two, {T1: 6})
    three = [AssignorMember(m, frozenset({T1}), first[m]) for m in first] + [
        AssignorMember("m9", frozenset({T1}), {})
    ]
    second = assignors.uniform(three, {T1: 6})
    assert counts(second) == {"m0": 2, "m1": 2, "m9": 2}
    for m in ("m0", "m1"):  # they only gave partitions up, never swapped
        assert second[m][T1] <= first[m][T1]


def test_uniform_heterogeneous_subscriptions_only_subscribed() -> None:
    members = [
        AssignorMember("a", frozenset({T1}), {}),
        AssignorMember("b", frozenset({T1, T2}), {}),
    ]
    result = assignors.uniform(members, {T1: 2, T2: 2})
    assert T2 not in result["a"]
    assert counts(result) == {"a": 2, "b": 2}


def test_range_gives_contiguous_ranges_and_copartitions() -> None:
    members = [AssignorMember(m, frozenset({T1, T2}), {}) for m in ("b", "a")]
    result = assignors.range_(members, {T1: 5, T2: 5})
    assert result["a"] == {T1: frozenset({0, 1, 2}), T2: frozenset({0, 1, 2})}
    assert result["b"] == {T1: frozenset({3, 4}), T2: frozenset({3, 4})}


def test_unknown_assignor() -> None:
    with pytest.raises(assignors.UnknownAssignor):
        assignors.assign("sticky", [], {})


# ---------------------------------------------------------------- the machine


class World:
    def __init__(self, topics: dict[str, int], settings: ConsumerSettings | None = None) -> None:
        self.topics = {
            name: (uuid.UUID(int=i + 1), n) for i, (name, n) in enumerate(sorted(topics.items()))
        }
        self.records: list[tuple[bytes, bytes | None]] = []
        self.group = ConsumerGroup("g", settings or ConsumerSettings(), self.records)
        self.owned: dict[str, assignors.Assignment] = {}
        self.epochs: dict[str, int] = {}

    def tid(self, name: str) -> uuid.UUID:
        return self.topics[name][0]

    def hb(
        self,
        now: int,
        member: str,
        *,
        epoch: int | None = None,
        topics: tuple[str, ...] | None = None,
        owned: assignors.Assignment | None = None,
        assignor: str | None = None,
        instance: str | None = None,
        regex: str | None = None,
    ) -> HeartbeatResult:
        """One heartbeat as a well-behaved client sends it: it owns what it was given."""
        e = self.epochs.get(member, 0) if epoch is None else epoch
        join = e == 0
        result = self.group.heartbeat(
            now,
            Heartbeat(
                "g",
                member,
                e,
                instance_id=instance,
                rebalance_timeout_ms=30_000 if join else -1,
                subscribed_topic_names=topics
                if topics is not None
                else (("t",) if join and regex is None else None),
                subscribed_topic_regex=regex,
                server_assignor=assignor,
                owned=self.owned.get(member, {}) if owned is None else owned,
                version=1,
            ),
            lambda name: self.topics.get(name),
            lambda: list(self.topics),
        )
        if result.error == codes.NONE:
            self.epochs[member] = result.member_epoch
            if result.assignment is not None:
                self.owned[member] = result.assignment
        return result

    def settle(self, now: int, members: list[str], rounds: int = 6) -> None:
        for _ in range(rounds):
            for m in members:
                assert self.hb(now, m).error == codes.NONE

    def owners(self) -> dict[tuple[uuid.UUID, int], list[str]]:
        out: dict[tuple[uuid.UUID, int], list[str]] = {}
        for m, a in self.owned.items():
            for t, ps in a.items():
                for p in ps:
                    out.setdefault((t, p), []).append(m)
        return out


def test_join_assigns_everything_to_the_first_member() -> None:
    w = World({"t": 4})
    r = w.hb(0, "a")
    assert r.error == codes.NONE and r.member_epoch == 1
    assert r.assignment == {w.tid("t"): frozenset(range(4))}
    assert w.group.state is ConsumerGroupState.STABLE


def test_second_member_waits_until_the_first_revokes() -> None:
    w = World({"t": 4})
    w.hb(0, "a")
    r = w.hb(1, "b")
    # b is at the new epoch but may not have a's partitions until a gives them up.
    assert r.member_epoch == 2 and r.assignment == {}
    assert w.group.members["b"].state is MemberState.UNRELEASED_PARTITIONS
    ra = w.hb(2, "a")
    assert w.group.members["a"].state is MemberState.UNREVOKED_PARTITIONS
    assert ra.member_epoch == 1  # stays at its epoch while revoking
    assert size(ra.assignment) == 2
    # Until a's next heartbeat shows the revocation, b still gets nothing.
    assert w.hb(3, "b").assignment is None
    w.hb(4, "a")
    assert w.group.members["a"].member_epoch == 2
    rb = w.hb(5, "b")
    assert size(rb.assignment) == 2
    assert w.group.state is ConsumerGroupState.STABLE
    assert all(len(v) == 1 for v in w.owners().values()) and len(w.owners()) == 4


def test_no_partition_ever_has_two_owners_while_members_come_and_go() -> None:
    w = World({"t": 12})
    now = 0
    live = ["a"]
    w.hb(now, "a")
    order = ["b", "c", "d"]
    for step in range(40):
        now += 10
        if step in (3, 7, 11):
            live.append(order.pop(0))
        if step == 20:  # a member leaves mid-rebalance
            assert w.hb(now, "b", epoch=-1).member_epoch == -1
            live.remove("b")
            w.owned.pop("b")
        for m in live:
            assert w.hb(now, m).error == codes.NONE
            assert all(len(v) == 1 for v in w.owners().values()), f"step {step}: {w.owners()}"
    assert w.group.state is ConsumerGroupState.STABLE
    assert sorted(len(ps) for m in live for ps in w.owned[m].values()) == [4, 4, 4]
    assert len(w.owners()) == 12


def test_epoch_fencing() -> None:
    w = World({"t": 2})
    w.hb(0, "a")
    assert w.hb(1, "a", epoch=5).error == FENCED_MEMBER_EPOCH
    w.hb(2, "b")
    w.settle(3, ["a", "b"])
    epoch = w.epochs["a"]
    prev = w.group.members["a"].previous_member_epoch
    # The previous epoch with a subset of the partitions: a lost answer, accepted.
    assert w.hb(4, "a", epoch=prev, owned={}).error == codes.NONE
    # The previous epoch with more than it holds now: fenced.
    assert (
        w.hb(5, "a", epoch=prev, owned={w.tid("t"): frozenset({0, 1})}).error == FENCED_MEMBER_EPOCH
    )
    assert w.epochs["a"] == epoch
    assert w.hb(6, "zzz", epoch=3).error == codes.UNKNOWN_MEMBER_ID


def test_session_timeout_removes_the_member_and_rebalances() -> None:
    s = ConsumerSettings(
        session_timeout_ms=1000, heartbeat_interval_ms=100, min_session_timeout_ms=1000
    )
    w = World({"t": 4}, s)
    w.hb(0, "a")
    w.hb(0, "b")
    w.settle(10, ["a", "b"])
    epoch = w.group.group_epoch
    w.hb(900, "a")
    assert w.group.next_deadline() == 1010
    w.group.tick(1010)  # b went silent
    assert list(w.group.members) == ["a"] and w.group.group_epoch == epoch + 1
    w.settle(1020, ["a"])
    assert w.owned["a"] == {w.tid("t"): frozenset(range(4))}


def test_revocation_timeout_fences_the_member() -> None:
    w = World({"t": 2})
    w.hb(0, "a")
    w.hb(1, "b")
    w.hb(2, "a")  # told to revoke
    assert w.group.members["a"].state is MemberState.UNREVOKED_PARTITIONS
    w.hb(3, "a", owned=w.owned["a"] | {w.tid("t"): frozenset({0, 1})})  # still owns them
    w.group.tick(2 + 30_000)
    assert "a" not in w.group.members


def test_assignor_choice_and_unsupported() -> None:
    w = World({"t": 4})
    assert w.hb(0, "a", assignor="sticky").error == UNSUPPORTED_ASSIGNOR
    w.hb(0, "a", assignor="range")
    assert w.group.assignor_name == "range"


def test_regex_subscription_follows_new_topics() -> None:
    w = World({"orders-1": 1, "other": 1})
    w.hb(0, "a", regex="orders-.*")
    assert w.owned["a"] == {w.tid("orders-1"): frozenset({0})}
    w.topics["orders-2"] = (uuid.UUID(int=99), 2)
    w.hb(1, "a")
    assert w.owned["a"][uuid.UUID(int=99)] == frozenset({0, 1})


def test_static_member_leaves_for_now_and_comes_back() -> None:
    w = World({"t": 2})
    w.hb(0, "a1", instance="i")
    assert w.hb(1, "a1", epoch=-2, instance="i").member_epoch == -2
    assert w.group.group_epoch == 1  # no rebalance
    r = w.hb(2, "a2", instance="i")
    assert (
        r.error == codes.NONE
        and r.member_epoch == 1
        and r.assignment == {w.tid("t"): frozenset({0, 1})}
    )
    assert w.hb(3, "a3", instance="i").error == UNRELEASED_INSTANCE_ID


def test_offset_commit_checks_member_epoch() -> None:
    w = World({"t": 2})
    w.hb(0, "a")
    assert w.group.validate_offset_commit("a", 1, 9) == codes.NONE
    assert w.group.validate_offset_commit("a", 0, 9) == STALE_MEMBER_EPOCH
    assert w.group.validate_offset_commit("x", 1, 9) == codes.UNKNOWN_MEMBER_ID
    assert w.group.validate_offset_commit("a", 1, 8) == codes.UNSUPPORTED_VERSION
    # TxnOffsetCommit (KIP-447) has no v9: the member and its epoch are what count.
    assert w.group.validate_offset_commit("a", 1, 3, transactional=True) == codes.NONE
    assert w.group.validate_offset_commit("a", 0, 3, transactional=True) == STALE_MEMBER_EPOCH


def test_records_rebuild_the_group() -> None:
    w = World({"t": 6})
    for m in ("a", "b", "c"):
        w.hb(0, m)
    w.hb(1, "a")  # a mid-revocation when we "crash"
    last: dict[tuple[int, str], bytes] = {}
    for key, value in w.records:
        k = rec.decode_key(key)
        if value is None:
            last.pop((k.record_type, k.member_id), None)
        else:
            last[(k.record_type, k.member_id)] = value
    g = ConsumerGroup("g", ConsumerSettings(), [])
    g.load(100, last)
    assert g.group_epoch == w.group.group_epoch and g.assignment_epoch == w.group.assignment_epoch
    assert g.target == w.group.target
    for m, orig in w.group.members.items():
        got = g.members[m]
        assert (got.member_epoch, got.state, got.assigned, got.pending_revocation) == (
            orig.member_epoch,
            orig.state,
            orig.assigned,
            orig.pending_revocation,
        )
    assert g.partition_owners == w.group.partition_owners


def test_record_formats_round_trip_and_refuse_garbage() -> None:
    md = rec.MemberMetadata("i", None, "client", "/1.2.3.4", ("a", "b"), "x.*", 5000, "uniform")
    assert rec.decode_member_metadata(rec.member_metadata(md)) == md
    cur = rec.CurrentAssignment(3, 2, 2, {T1: frozenset({1, 2})}, {T2: frozenset({0})})
    assert rec.decode_current_member(rec.current_member(cur)) == cur
    assert rec.decode_key(rec.key(rec.CURRENT_MEMBER, "g", "m")) == rec.ConsumerGroupKey(
        rec.CURRENT_MEMBER, "g", "m"
    )
    data = rec.current_member(cur)
    for cut in range(len(data)):
        with pytest.raises(RecordFormatError):
            rec.decode_current_member(data[:cut])


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [
        ("orders-.*", False),
        ("(orders|payments)-[0-9]+", False),
        ("[", True),  # does not compile (Kafka's own test)
        ("(a+)+$", True),  # exponential backtracking in Python's re
        ("(a|aa)*b", True),
        ("(x)\\1", True),  # RE2 has no backreferences
        ("(?=x)x", True),  # nor lookaround
        ("x" * 1001, True),
    ],
)
def test_subscription_regex_is_checked_before_it_is_used(pattern: str, refused: bool) -> None:
    assert (regex_refusal(pattern) is not None) is refused
    w = World({"t": 1})
    r = w.hb(0, "a", regex=pattern)
    assert r.error == (INVALID_REGULAR_EXPRESSION if refused else codes.NONE)
    assert ("a" in w.group.members) is not refused

"""The pure group state machine: Kafka's classic-protocol transitions, errors and timers.

No trio, no sockets: time is a number we move by hand, parked requests are plain
objects whose answers we collect from the outbox, and StoreGroup effects are acknowledged
by the test (as the driver does once the record is durable).
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.groups import codes
from broker.groups import records as records_module
from broker.groups.records import (
    OffsetValue,
    RecordFormatError,
    decode_key,
    decode_offset_value,
    group_key,
    offset_key,
    offset_value,
)
from broker.groups.state import (
    CommittedOffset,
    Expired,
    Groups,
    GroupSettings,
    JoinResult,
    State,
    SyncResult,
)

SESSION = 10_000
REBALANCE = 30_000
DELAY = 3_000


def subscription(*topics: str) -> bytes:
    out = struct.pack(">hi", 0, len(topics))
    for t in topics:
        out += struct.pack(">h", len(t)) + t.encode()
    return out + struct.pack(">i", -1)


PROTOCOLS = [("range", subscription("t")), ("roundrobin", subscription("t"))]


class Waiter:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Waiter({self.name})"


class Harness:
    def __init__(self, delay: int = DELAY, auto_store: bool = True, **kw: Any) -> None:
        ids = itertools.count(1)
        self.g = Groups(GroupSettings(initial_rebalance_delay_ms=delay, **kw), new_id=lambda: f"id{next(ids)}")
        self.now = 0
        self.answers: dict[Waiter, list[Any]] = {}
        self.auto_store = auto_store
        self._n = itertools.count()

    def waiter(self, name: str) -> Waiter:
        w = Waiter(f"{name}#{next(self._n)}")
        self.answers[w] = []
        return w

    def drain(self) -> None:
        outbox, self.g.outbox = self.g.outbox, []
        for w, result in outbox:
            assert isinstance(w, Waiter)
            self.answers[w].append(result)
            assert len(self.answers[w]) == 1, f"{w} answered twice"
        if self.auto_store:
            effects, self.g.effects = self.g.effects, []
            for e in effects:
                self.g.group_stored(self.now, e.group_id, e.generation_id, e.assignment, codes.NONE)
            if effects:
                self.drain()

    def answer(self, w: Waiter) -> Any:
        self.drain()
        got = self.answers[w]
        return got[0] if got else None

    def advance(self, ms: int) -> None:
        """Move time forward, firing every deadline on the way, in order."""
        target = self.now + ms
        while True:
            d = self.g.next_deadline()
            if d is None or d > target:
                break
            self.now = max(self.now, d)
            self.tick()
        self.now = target
        self.tick()

    def tick(self) -> None:
        self.g.tick(self.now)
        # A deadline tick leaves in the past would wake the coordinator's timer loop at
        # once, forever: a busy loop on the broker.
        d = self.g.next_deadline()
        assert d is None or d > self.now, f"deadline {d} still due after tick at {self.now}"
        self.drain()

    def join(self, group: str, member_id: str = "", *, instance: str | None = None, protocols: list[tuple[str, bytes]] | None = None,
             v4: bool = True, session: int = SESSION, rebalance: int = REBALANCE, skip: bool = False) -> tuple[Waiter, Any]:
        w = self.waiter(f"join-{member_id or 'new'}")
        r = self.g.join(
            self.now, group, member_id, instance, "consumer", protocols or PROTOCOLS, w,
            session_timeout_ms=session, rebalance_timeout_ms=rebalance,
            require_known_member_id=v4 and instance is None, supports_skip_assignment=skip, client_id="cli", client_host="/127.0.0.1",
        )
        self.drain()
        return w, r

    def join_new(self, group: str, **kw: Any) -> Waiter:
        """A v4+ dynamic join: MEMBER_ID_REQUIRED, then the real join (parked)."""
        _, r = self.join(group, **kw)
        assert isinstance(r, JoinResult) and r.error == codes.MEMBER_ID_REQUIRED, r
        w, r2 = self.join(group, r.member_id, **kw)
        assert r2 is None
        return w

    def sync(self, group: str, gen: int, member: str, assignments: dict[str, bytes] | None = None, instance: str | None = None) -> tuple[Waiter, Any]:
        w = self.waiter(f"sync-{member}")
        r = self.g.sync(self.now, group, gen, member, instance, assignments or {}, w)
        self.drain()
        return w, r

    def hb(self, group: str, gen: int, member: str, instance: str | None = None) -> int:
        return self.g.heartbeat(self.now, group, gen, member, instance)


def stable_group_of(h: Harness, n: int, group: str = "g") -> list[str]:
    """n dynamic members joined together into generation 1, synced, Stable."""
    waiters = [h.join_new(group) for _ in range(n)]
    h.advance(2 * DELAY)  # members after the first extend the initial delay once
    results = [h.answer(w) for w in waiters]
    assert all(r is not None and r.error == codes.NONE for r in results), results
    leader = results[0].leader
    ids = [r.member_id for r in results]
    syncs = []
    for r in results:
        assignments = {m: f"a-{m}".encode() for m in ids} if r.member_id == leader else {}
        syncs.append(h.sync(group, r.generation_id, r.member_id, assignments))
    assert all((r if r is not None else h.answer(w)).error == codes.NONE for w, r in syncs)
    assert h.g.get(group).state is State.STABLE  # type: ignore[union-attr]
    return ids


def test_member_id_required_then_join_waits_for_the_initial_delay() -> None:
    h = Harness()
    _, r = h.join("g")
    assert r.error == codes.MEMBER_ID_REQUIRED and r.member_id.startswith("cli-")
    w, r2 = h.join("g", r.member_id)
    assert r2 is None
    h.advance(DELAY - 1)
    assert h.answer(w) is None  # the initial delay always runs out, even with everyone in
    h.advance(1)
    res = h.answer(w)
    assert (res.error, res.generation_id, res.leader, res.member_id) == (codes.NONE, 1, r.member_id, r.member_id)
    assert res.protocol_type == "consumer" and res.protocol_name == "range"
    assert [m.member_id for m in res.members] == [r.member_id]


def test_initial_delay_extends_while_members_keep_arriving_but_not_past_rebalance_timeout() -> None:
    h = Harness(delay=3000)
    w1 = h.join_new("g", rebalance=7000)
    h.advance(2000)
    w2 = h.join_new("g", rebalance=7000)  # a new member during the delay: extend by min(3000, 4000)
    h.advance(1000)
    assert h.answer(w1) is None
    h.advance(2999)
    assert h.answer(w1) is None
    h.advance(1)
    r1, r2 = h.answer(w1), h.answer(w2)
    assert r1.generation_id == r2.generation_id == 1 and h.now == 6000
    assert len(r1.members) == 2 and r2.members == ()


def test_old_style_join_without_member_id_required() -> None:
    h = Harness(delay=0)
    w, r = h.join("g", v4=False)
    assert r is None
    h.advance(0)
    assert h.answer(w).error == codes.NONE


def test_follower_sync_waits_for_the_leader_and_one_left_out_gets_empty_bytes() -> None:
    h = Harness()
    a, b = h.join_new("g"), h.join_new("g")
    h.advance(2 * DELAY)
    ra, rb = h.answer(a), h.answer(b)
    leader, follower = (ra, rb) if ra.member_id == ra.leader else (rb, ra)
    assert follower.members == () and len(leader.members) == 2
    wf, r = h.sync("g", 1, follower.member_id)
    assert r is None and h.answer(wf) is None
    assert h.hb("g", 1, follower.member_id) == codes.NONE  # heartbeats during CompletingRebalance are fine
    # The leader leaves the follower out: it gets empty bytes, as Kafka answers (the oracle compares it).
    wl, _ = h.sync("g", 1, leader.member_id, {leader.member_id: b"mine"})
    assert h.answer(wl) == SyncResult(codes.NONE, b"mine", "consumer", "range")
    assert h.answer(wf).assignment == b""
    assert h.hb("g", 1, follower.member_id) == codes.NONE
    # SyncGroup again in Stable returns the stored assignment at once.
    _, again = h.sync("g", 1, leader.member_id)
    assert again.assignment == b"mine"


def test_heartbeat_errors_are_kafkas() -> None:
    h = Harness()
    a, b = stable_group_of(h, 2)
    assert h.hb("nope", 1, a) == codes.UNKNOWN_MEMBER_ID
    assert h.hb("g", 1, "stranger") == codes.UNKNOWN_MEMBER_ID
    assert h.hb("g", 7, a) == codes.ILLEGAL_GENERATION
    assert h.hb("", 1, a) == codes.INVALID_GROUP_ID
    assert h.hb("g", 1, a) == codes.NONE
    # A third member arrives: the group prepares a rebalance and heartbeats say so.
    h.join_new("g")
    assert h.g.get("g").state is State.PREPARING_REBALANCE  # type: ignore[union-attr]
    assert h.hb("g", 1, a) == codes.REBALANCE_IN_PROGRESS
    _, r = h.sync("g", 1, b)
    assert r.error == codes.REBALANCE_IN_PROGRESS


def test_rebalance_completes_as_soon_as_everyone_rejoined() -> None:
    h = Harness()
    a, b = stable_group_of(h, 2)
    wc = h.join_new("g")
    wa, _ = h.join("g", a)
    assert h.answer(wa) is None
    wb, _ = h.join("g", b)
    ra, rb, rc = h.answer(wa), h.answer(wb), h.answer(wc)
    assert ra.generation_id == rb.generation_id == rc.generation_id == 2
    assert sum(1 for r in (ra, rb, rc) if r.members) == 1


def test_dead_member_is_evicted_after_its_session_and_survivors_rebalance() -> None:
    h = Harness()
    a, b, c = stable_group_of(h, 3)
    t0 = h.now
    # a and b keep heartbeating every second; c is gone.
    for _ in range(SESSION // 1000 - 1):
        h.advance(1000)
        assert h.hb("g", 1, a) == codes.NONE and h.hb("g", 1, b) == codes.NONE
    assert h.g.get("g").has(c)  # type: ignore[union-attr]
    h.advance(1000)
    group = h.g.get("g")
    assert group is not None and not group.has(c) and group.state is State.PREPARING_REBALANCE
    assert h.now - t0 == SESSION
    assert h.hb("g", 1, a) == codes.REBALANCE_IN_PROGRESS
    wa, _ = h.join("g", a)
    wb, _ = h.join("g", b)
    ra = h.answer(wa)
    assert ra.generation_id == 2 and {m.member_id for m in (ra.members or h.answer(wb).members)} == {a, b}
    # The dead member learns it is gone when it comes back.
    assert h.hb("g", 2, c) == codes.UNKNOWN_MEMBER_ID
    _, r = h.join("g", c)
    assert r.error == codes.UNKNOWN_MEMBER_ID


def test_member_that_does_not_rejoin_is_dropped_after_the_rebalance_timeout() -> None:
    h = Harness()
    a, b = stable_group_of(h, 2)
    wa, _ = h.join("g", a)  # a (leader or not) triggers a rebalance by changing metadata
    if h.g.get("g").state is not State.PREPARING_REBALANCE:  # type: ignore[union-attr]
        wa, _ = h.join("g", a, protocols=[("range", subscription("t", "u"))])
    # b stays alive (heartbeats, told REBALANCE_IN_PROGRESS) but never rejoins.
    for _ in range(REBALANCE // 5000 - 1):
        h.advance(5000)
        assert h.hb("g", 1, b) == codes.REBALANCE_IN_PROGRESS
    h.advance(4999)
    assert h.answer(wa) is None
    h.advance(1)
    ra = h.answer(wa)
    assert ra.error == codes.NONE and ra.leader == a and [m.member_id for m in ra.members] == [a]
    assert not h.g.get("g").has(b)  # type: ignore[union-attr]


def test_member_that_never_syncs_is_removed_after_the_rebalance_timeout() -> None:
    h = Harness()
    a, b = h.join_new("g"), h.join_new("g")
    h.advance(2 * DELAY)
    ra, rb = h.answer(a), h.answer(b)
    # Only the first member syncs (as leader or follower); the other vanishes.
    h.sync("g", 1, ra.member_id, {ra.member_id: b"x", rb.member_id: b"y"} if ra.leader == ra.member_id else {})
    # Both stay alive, but the second never sends SyncGroup.
    for _ in range(REBALANCE // 5000):
        h.advance(5000)
        h.hb("g", 1, ra.member_id)
        h.hb("g", 1, rb.member_id)
    group = h.g.get("g")
    assert group is not None and not group.has(rb.member_id)
    assert group.state in (State.PREPARING_REBALANCE, State.COMPLETING_REBALANCE)


def test_pending_member_that_never_returns_expires() -> None:
    h = Harness()
    _, r = h.join("g")
    group = h.g.get("g")
    assert group is not None and r.member_id in group.pending_members
    h.advance(SESSION)
    assert r.member_id not in group.pending_members
    _, r2 = h.join("g", r.member_id)
    assert r2.error == codes.UNKNOWN_MEMBER_ID


def test_leave_triggers_a_rebalance_and_the_last_leave_empties_the_group() -> None:
    h = Harness()
    a, b = stable_group_of(h, 2)
    top, per = h.g.leave(h.now, "g", [(a, None), ("ghost", None)])
    assert (top, per) == (codes.NONE, [codes.NONE, codes.UNKNOWN_MEMBER_ID])
    group = h.g.get("g")
    assert group is not None and group.state is State.PREPARING_REBALANCE
    h.g.leave(h.now, "g", [(b, None)])
    h.drain()
    assert group.state is State.EMPTY and group.generation_id == 2 and group.leader_id is None
    assert h.g.leave(h.now, "other", [(a, None)]) == (codes.NONE, [codes.UNKNOWN_MEMBER_ID])


def test_leave_while_parked_in_join_answers_the_join() -> None:
    h = Harness()
    a, _b = stable_group_of(h, 2)
    wa, _ = h.join("g", a, protocols=[("range", subscription("x"))])
    h.g.leave(h.now, "g", [(a, None)])
    assert h.answer(wa).error == codes.UNKNOWN_MEMBER_ID


def test_static_member_returns_with_a_new_id_without_a_rebalance_and_fences_the_old() -> None:
    h = Harness()
    w1, r = h.join("g", instance="i1")
    assert r is None  # static members skip MEMBER_ID_REQUIRED
    w2, _ = h.join("g", instance="i2")
    h.advance(2 * DELAY)
    r1, r2 = h.answer(w1), h.answer(w2)
    leader = r1 if r1.leader == r1.member_id else r2
    for r in (r1, r2):
        h.sync("g", 1, r.member_id, {r1.member_id: b"a1", r2.member_id: b"a2"} if r is leader else {}, instance="i1" if r is r1 else "i2")
    group = h.g.get("g")
    assert group is not None and group.state is State.STABLE
    # i2 restarts (lost its member id): same protocols, so no rebalance.
    _w, again = h.join("g", instance="i2", skip=True)
    assert again is not None and again.error == codes.NONE and again.generation_id == 1
    assert again.member_id != r2.member_id and group.state is State.STABLE
    assert h.hb("g", 1, r2.member_id, "i2") == codes.FENCED_INSTANCE_ID
    assert h.hb("g", 1, again.member_id, "i2") == codes.NONE
    _, s = h.sync("g", 1, again.member_id, instance="i2")
    assert s.assignment == b"a2"
    # Static members that stop heartbeating are removed after their session like others.
    h.advance(SESSION)
    assert not group.members


def test_static_member_that_misses_a_rebalance_keeps_its_place() -> None:
    h = Harness()
    w1, _ = h.join("g", instance="i1")
    w2, _ = h.join("g", instance="i2")
    h.advance(2 * DELAY)
    r1, r2 = h.answer(w1), h.answer(w2)
    for r, i in ((r1, "i1"), (r2, "i2")):
        h.sync("g", 1, r.member_id, {r1.member_id: b"a", r2.member_id: b"b"} if r.leader == r.member_id else {}, instance=i)
    w, _ = h.join("g", r1.member_id, instance="i1", protocols=[("range", subscription("z"))])
    for _ in range(REBALANCE // 5000):
        h.advance(5_000)
        assert h.hb("g", 1, r2.member_id, "i2") in (codes.REBALANCE_IN_PROGRESS, codes.ILLEGAL_GENERATION)
    # i2 did not rejoin but is static: not removed, the join completes without it.
    res = h.answer(w)
    assert res is not None and res.error == codes.NONE and res.generation_id == 2
    assert h.g.get("g").has(r2.member_id)  # type: ignore[union-attr]


def test_sync_validation_order() -> None:
    h = Harness()
    a, _ = stable_group_of(h, 2)
    assert h.sync("nope", 1, a)[1].error == codes.UNKNOWN_MEMBER_ID
    assert h.sync("g", 1, "x")[1].error == codes.UNKNOWN_MEMBER_ID
    assert h.sync("g", 2, a)[1].error == codes.ILLEGAL_GENERATION
    w = h.waiter("s")
    r = h.g.sync(h.now, "g", 1, a, None, {}, w, protocol_type="connect")
    assert r is not None and r.error == codes.INCONSISTENT_GROUP_PROTOCOL
    r = h.g.sync(h.now, "g", 1, a, None, {}, w, protocol_name="sticky")
    assert r is not None and r.error == codes.INCONSISTENT_GROUP_PROTOCOL


def test_join_validation() -> None:
    h = Harness()
    assert h.join("", "")[1].error == codes.INVALID_GROUP_ID
    assert h.join("g", session=10)[1].error == codes.INVALID_SESSION_TIMEOUT
    assert h.join("g", "someone")[1].error == codes.UNKNOWN_MEMBER_ID
    stable_group_of(h, 1)
    _, r = h.join("g", protocols=[("other", b"")])
    assert r.error == codes.INCONSISTENT_GROUP_PROTOCOL
    w = h.waiter("j")
    r = h.g.join(h.now, "g", "", None, "connect", PROTOCOLS, w, session_timeout_ms=SESSION, rebalance_timeout_ms=REBALANCE)
    assert r is not None and r.error == codes.INCONSISTENT_GROUP_PROTOCOL


def test_group_max_size() -> None:
    h = Harness(max_size=1)
    stable_group_of(h, 1)
    _, r = h.join("g", v4=False)
    assert r.error == codes.GROUP_MAX_SIZE_REACHED


def test_protocol_is_the_one_most_members_prefer_among_those_all_support() -> None:
    h = Harness()
    w1 = h.join_new("g", protocols=[("roundrobin", b"1"), ("range", b"1")])
    w2 = h.join_new("g", protocols=[("range", b"2"), ("roundrobin", b"2")])
    w3 = h.join_new("g", protocols=[("range", b"3"), ("sticky", b"3")])
    h.advance(2 * DELAY)
    assert {h.answer(w).protocol_name for w in (w1, w2, w3)} == {"range"}


def test_rejoin_in_completing_rebalance_with_same_metadata_repeats_the_answer() -> None:
    h = Harness()
    a = h.join_new("g")
    h.advance(DELAY)
    ra = h.answer(a)
    _, again = h.join("g", ra.member_id)
    assert again == ra


def test_offset_commit_validation() -> None:
    h = Harness()
    assert h.g.validate_offset_commit(h.now, "new", 3, "m", None) == (None, codes.ILLEGAL_GENERATION)
    group, err = h.g.validate_offset_commit(h.now, "simple", -1, "", None)
    assert err == codes.NONE and group is not None and group.state is State.EMPTY
    a, _ = stable_group_of(h, 2)
    assert h.g.validate_offset_commit(h.now, "g", -1, "", None)[1] == codes.UNKNOWN_MEMBER_ID
    assert h.g.validate_offset_commit(h.now, "g", 1, "x", None)[1] == codes.UNKNOWN_MEMBER_ID
    assert h.g.validate_offset_commit(h.now, "g", 0, a, None)[1] == codes.ILLEGAL_GENERATION
    assert h.g.validate_offset_commit(h.now, "g", 1, a, None)[1] == codes.NONE
    h.join_new("g")  # PreparingRebalance: commits still allowed
    assert h.g.validate_offset_commit(h.now, "g", 1, a, None)[1] == codes.NONE


def test_offset_commit_during_completing_rebalance_is_rebalance_in_progress() -> None:
    h = Harness()
    w = h.join_new("g")
    h.advance(DELAY)
    r = h.answer(w)
    assert h.g.validate_offset_commit(h.now, "g", 1, r.member_id, None)[1] == codes.REBALANCE_IN_PROGRESS


def test_delete_groups_and_offset_delete() -> None:
    h = Harness()
    stable_group_of(h, 1)
    h.g.validate_offset_commit(h.now, "simple", -1, "", None)
    assert h.g.delete_groups(["g", "simple", "none"]) == {
        "g": codes.NON_EMPTY_GROUP,
        "simple": codes.NONE,
        "none": codes.GROUP_ID_NOT_FOUND,
    }
    assert h.g.get("simple") is None
    error, per = h.g.deletable_offsets("g", [("t", 0), ("other", 1)])
    assert error == codes.NONE and per == {("t", 0): codes.GROUP_SUBSCRIBED_TO_TOPIC, ("other", 1): codes.NONE}
    assert h.g.deletable_offsets("none", [("t", 0)])[0] == codes.GROUP_ID_NOT_FOUND


def test_list_and_describe() -> None:
    h = Harness()
    a, b = stable_group_of(h, 2)
    h.g.validate_offset_commit(h.now, "simple", -1, "", None)
    assert sorted(h.g.list_groups()) == [("g", "consumer", "Stable"), ("simple", "", "Empty")]
    assert h.g.list_groups(states=["stable"]) == [("g", "consumer", "Stable")]
    assert h.g.list_groups(types=["consumer"]) == []
    s = h.g.get("g").summary()  # type: ignore[union-attr]
    assert (s.state, s.protocol_type, s.protocol) == ("Stable", "consumer", "range")
    assert {m.member_id: m.assignment for m in s.members} == {a: f"a-{a}".encode(), b: f"a-{b}".encode()}
    h.join_new("g")
    s = h.g.get("g").summary()  # type: ignore[union-attr]
    assert s.state == "PreparingRebalance" and s.protocol == "" and all(m.metadata == b"" for m in s.members)


def test_store_failure_sends_the_error_and_rebalances() -> None:
    h = Harness(auto_store=False)
    w = h.join_new("g")
    h.advance(DELAY)
    r = h.answer(w)
    ws, _ = h.sync("g", 1, r.member_id, {r.member_id: b"x"})
    (effect,) = h.g.effects
    h.g.effects.clear()
    h.g.group_stored(h.now, effect.group_id, effect.generation_id, effect.assignment, codes.COORDINATOR_NOT_AVAILABLE)
    assert h.answer(ws).error == codes.COORDINATOR_NOT_AVAILABLE
    assert h.g.get("g").state is State.PREPARING_REBALANCE  # type: ignore[union-attr]


def test_loaded_group_resumes_stable_and_expires_silent_members() -> None:
    from broker.groups.state import Member

    h = Harness()
    m = Member("m1", None, "c", "/h", REBALANCE, SESSION, "consumer", [("range", PROTOCOLS[0][1])], b"asg")
    h.g.load_group(h.now, "g", "consumer", 4, "range", "m1", [m])
    assert h.hb("g", 4, "m1") == codes.NONE
    _, s = h.sync("g", 4, "m1")
    assert s.assignment == b"asg"
    h.advance(SESSION)
    group = h.g.get("g")
    assert group is not None and not group.members
    h.advance(0)
    assert group.state is State.EMPTY and group.generation_id == 5


# ------------------------------------------------------------------ Hypothesis

ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 3)),
        st.tuples(st.just("sync"), st.integers(0, 3)),
        st.tuples(st.just("hb"), st.integers(0, 3)),
        st.tuples(st.just("leave"), st.integers(0, 3)),
        st.tuples(st.just("advance"), st.sampled_from([0, 1, 500, 2999, 3000, 6000, 10_000, 30_000])),
        st.tuples(st.just("static"), st.integers(0, 3)),
        st.tuples(st.just("expire"), st.integers(0, 3)),
    ),
    max_size=60,
)


class Client:
    """A member as a well-behaved client would act on its answers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.member_id = ""
        self.generation = -1
        self.instance: str | None = None
        self.join_w: Any = None
        self.sync_w: Any = None
        self.leader = False
        self.peers: list[str] = []


def check_invariants(h: Harness) -> None:
    for group in h.g.groups.values():
        if group.members:
            assert group.leader_id in group.members
        else:
            assert group.leader_id is None or group.state is State.PREPARING_REBALANCE
        for instance, member_id in group.static_members.items():
            assert group.members[member_id].group_instance_id == instance
        if group.state in (State.STABLE, State.COMPLETING_REBALANCE):
            assert not any(m.awaiting_join for m in group.members.values()), "parked join outside the join phase"
            assert group.protocol_name is not None
        if group.state is not State.COMPLETING_REBALANCE:
            assert not any(m.awaiting_sync for m in group.members.values()), "parked sync outside CompletingRebalance"
        if group.state is State.PREPARING_REBALANCE:
            assert group.join_deadline is not None, "a join phase with no deadline never ends"
        if group.state is State.STABLE:
            assert all(m.assignment for m in group.members.values()), "a member without a decodable assignment"
        if group.state is State.EMPTY:
            assert not group.members


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_histories_keep_the_invariants(history: list[tuple[str, int]]) -> None:
    h = Harness()
    clients = [Client(i) for i in range(4)]
    generations: list[int] = []

    def settle(c: Client) -> None:
        if c.join_w is not None:
            r = h.answer(c.join_w)
            if r is not None:
                c.join_w = None
                if r.error == codes.NONE:
                    c.member_id, c.generation = r.member_id, r.generation_id
                    c.leader = r.leader == r.member_id
                    c.peers = [m.member_id for m in r.members]
                elif r.error == codes.UNKNOWN_MEMBER_ID:
                    c.member_id, c.generation = "", -1
        if c.sync_w is not None:
            r = h.answer(c.sync_w)
            if r is not None:
                c.sync_w = None
                assert r.error != codes.NONE or r.assignment, "successful sync with empty bytes"

    for op, arg in history:
        if op == "advance":
            h.advance(arg)
        elif op == "expire":
            # Far in the future: whatever may expire does; a group with anyone in it stays.
            before = h.g.get("g")
            busy = before is not None and (before.members or before.pending_members or before.state is not State.EMPTY)
            expired = h.g.expire_offsets(10**15)
            assert not (busy and "g" in expired.groups), "expiry removed a live group"
            if "g" in expired.groups:
                generations.clear()  # a new group of the same name starts again at 0
        else:
            c = clients[arg]
            if op == "static" and c.member_id == "" and c.join_w is None:
                c.instance = f"inst{c.n}"
                op = "join"
            if op == "join" and c.join_w is None:
                w, r = h.join("g", c.member_id, instance=c.instance)
                if r is None:
                    c.join_w = w
                elif r.error == codes.MEMBER_ID_REQUIRED:
                    c.member_id = r.member_id
                elif r.error == codes.NONE:
                    c.generation, c.leader = r.generation_id, r.leader == r.member_id
                elif r.error in (codes.UNKNOWN_MEMBER_ID, codes.FENCED_INSTANCE_ID):
                    c.member_id, c.generation = "", -1
            elif op == "sync" and c.member_id and c.sync_w is None:
                assignments = {p: b"x" for p in c.peers} if c.leader else {}
                w, r = h.sync("g", c.generation, c.member_id, assignments, instance=c.instance)
                if r is None:
                    c.sync_w = w
                else:
                    assert r.error != codes.NONE or r.assignment
            elif op == "hb" and c.member_id:
                err = h.hb("g", c.generation, c.member_id, c.instance)
                assert err in (codes.NONE, codes.REBALANCE_IN_PROGRESS, codes.UNKNOWN_MEMBER_ID, codes.ILLEGAL_GENERATION, codes.FENCED_INSTANCE_ID)
                if err == codes.UNKNOWN_MEMBER_ID:
                    c.member_id, c.generation = "", -1
            elif op == "leave" and c.member_id:
                h.g.leave(h.now, "g", [(c.member_id, c.instance)])
                c.member_id, c.generation = "", -1
                h.drain()
        for c in clients:
            settle(c)
        check_invariants(h)
        group = h.g.get("g")
        if group is not None:
            generations.append(group.generation_id)
    assert generations == sorted(generations), "generation went backwards"
    # Liveness: with no one acting, every parked request is answered within the timeouts.
    h.advance(NEW_MEMBER_TIMEOUT + 2 * REBALANCE)
    for c in clients:
        settle(c)
        if c.join_w is not None or c.sync_w is not None:
            group = h.g.get("g")
            pytest.fail(f"client {c.n} still parked; group {group and group.state}")


NEW_MEMBER_TIMEOUT = 5 * 60 * 1000


# ---------------------------------------------------------------- offsets expiry (KIP-211)

RETENTION = 60_000


def commit(h: Harness, group: str, topic: str, partition: int, at_wall: int, *, generation: int = -1, member: str = "", expire: int | None = None) -> None:
    g, err = h.g.validate_offset_commit(h.now, group, generation, member, None)
    assert err == codes.NONE and g is not None
    g.offsets[(topic, partition)] = CommittedOffset(7, -1, "", at_wall, expire_timestamp=expire)


def test_standalone_offsets_expire_from_their_commit_time_then_the_group_goes() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    commit(h, "simple", "t", 0, at_wall=1_000)
    commit(h, "simple", "t", 1, at_wall=5_000)
    assert h.g.expire_offsets(1_000 + RETENTION - 1) == Expired((), ())
    assert h.g.expire_offsets(1_000 + RETENTION) == Expired((("simple", "t", 0),), ())
    assert set(h.g.get("simple").offsets) == {("t", 1)}  # type: ignore[union-attr]
    assert h.g.expire_offsets(5_000 + RETENTION) == Expired((("simple", "t", 1),), ("simple",))
    assert h.g.get("simple") is None


def test_explicit_expire_timestamp_of_old_commit_versions_wins() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    commit(h, "simple", "t", 0, at_wall=1_000, expire=3_000)
    assert h.g.expire_offsets(2_999).offsets == ()
    assert h.g.expire_offsets(3_000).offsets == (("simple", "t", 0),)


def test_a_live_consumer_group_keeps_the_offsets_of_topics_it_subscribes_to() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    a, _ = stable_group_of(h, 2)  # subscribed to "t"
    commit(h, "g", "t", 0, at_wall=0, generation=1, member=a)
    commit(h, "g", "gone", 0, at_wall=0, generation=1, member=a)
    # Stable: only the topic nobody subscribes to expires, by its commit time.
    assert h.g.expire_offsets(10 * RETENTION) == Expired((("g", "gone", 0),), ())
    # During a rebalance nothing expires (Kafka has no condition for those states).
    commit(h, "g", "gone", 1, at_wall=0, generation=1, member=a)
    h.join_new("g")
    assert h.g.get("g").state is State.PREPARING_REBALANCE  # type: ignore[union-attr]
    assert h.g.expire_offsets(10 * RETENTION) == Expired((), ())


def test_empty_group_offsets_expire_from_when_it_became_empty() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    a, b = stable_group_of(h, 2)
    commit(h, "g", "t", 0, at_wall=0, generation=1, member=a)
    h.g.leave(h.now, "g", [(a, None), (b, None)])
    h.drain()
    group = h.g.get("g")
    assert group is not None and group.state is State.EMPTY
    group.current_state_timestamp = 5 * RETENTION  # the driver sets it when it stores the group
    # The commit is long past its retention, but the clock starts when the group emptied.
    assert h.g.expire_offsets(6 * RETENTION - 1) == Expired((), ())
    assert h.g.expire_offsets(6 * RETENTION) == Expired((("g", "t", 0),), ("g",))
    assert h.g.get("g") is None


def test_empty_group_without_a_state_timestamp_falls_back_to_commit_time() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    a, b = stable_group_of(h, 2)
    commit(h, "g", "t", 0, at_wall=100, generation=1, member=a)
    h.g.leave(h.now, "g", [(a, None), (b, None)])
    h.drain()
    assert h.g.expire_offsets(100 + RETENTION).offsets == (("g", "t", 0),)


def test_offsets_with_a_commit_in_flight_do_not_expire_and_keep_the_group() -> None:
    h = Harness(offsets_retention_ms_override=RETENTION)
    commit(h, "simple", "t", 0, at_wall=0)
    group = h.g.get("simple")
    assert group is not None
    group.begin_offset_commit([("t", 0)])
    assert h.g.expire_offsets(10 * RETENTION) == Expired((), ())
    group.end_offset_commit([("t", 0)])
    assert not group.pending_offset_commits
    assert h.g.expire_offsets(10 * RETENTION) == Expired((("simple", "t", 0),), ("simple",))


def test_retention_settings_follow_kafka_names_and_floors() -> None:
    assert GroupSettings().offsets_retention_ms == 10080 * 60_000
    s = GroupSettings.from_properties({"offsets.retention.minutes": "2", "offsets.retention.check.interval.ms": "50"})
    assert (s.offsets_retention_ms, s.offsets_retention_check_interval_ms) == (120_000, 50)
    assert GroupSettings.from_properties({"offsets.retention.minutes": "2", "hyperkafka.offsets.retention.ms": "1500"}).offsets_retention_ms == 1500
    for bad in ({"offsets.retention.minutes": "0"}, {"offsets.retention.check.interval.ms": "0"}, {"hyperkafka.offsets.retention.ms": "-2"}):
        with pytest.raises(ValueError):
            GroupSettings.from_properties(bad)


# ---------------------------------------------------------------- OffsetCommit parity


def test_offset_commit_member_checks_follow_kafka_per_version() -> None:
    h = Harness()
    # An unknown group with a generation: v9 says so, older versions ILLEGAL_GENERATION.
    assert h.g.validate_offset_commit(h.now, "new", 1, "m", None, api_version=9) == (None, codes.GROUP_ID_NOT_FOUND)
    assert h.g.validate_offset_commit(h.now, "new", 1, "m", None, api_version=8) == (None, codes.ILLEGAL_GENERATION)
    w1, _ = h.join("g", instance="i1")
    h.advance(DELAY)
    r1 = h.answer(w1)
    # CompletingRebalance: a valid member gets REBALANCE_IN_PROGRESS.
    assert h.g.validate_offset_commit(h.now, "g", 1, r1.member_id, "i1")[1] == codes.REBALANCE_IN_PROGRESS
    h.sync("g", 1, r1.member_id, {r1.member_id: b"x"}, instance="i1")
    assert h.g.get("g").state is State.STABLE  # type: ignore[union-attr]
    assert h.g.validate_offset_commit(h.now, "g", 1, r1.member_id, "i1")[1] == codes.NONE
    # Static member checks come first: an old incarnation is fenced, an unknown instance unknown.
    assert h.g.validate_offset_commit(h.now, "g", 1, "old-id", "i1")[1] == codes.FENCED_INSTANCE_ID
    assert h.g.validate_offset_commit(h.now, "g", 1, r1.member_id, "i9")[1] == codes.UNKNOWN_MEMBER_ID
    assert h.g.validate_offset_commit(h.now, "g", 2, r1.member_id, "i1")[1] == codes.ILLEGAL_GENERATION
    # No generation, no member: only an Empty group takes it.
    assert h.g.validate_offset_commit(h.now, "g", -1, "", None)[1] == codes.UNKNOWN_MEMBER_ID


def test_offset_values_with_an_explicit_expiry_are_kafkas_v1() -> None:
    plain = OffsetValue(12, 3, "meta", 1000)
    assert offset_value(plain)[:2] == b"\x00\x03" and decode_offset_value(offset_value(plain)) == plain
    old = OffsetValue(12, -1, "meta", 1000, 5000)
    data = offset_value(old)
    assert data == b"\x00\x01" + struct.pack(">q", 12) + b"\x00\x04meta" + struct.pack(">qq", 1000, 5000)
    assert decode_offset_value(data) == old
    # A v1 value whose expire timestamp is -1 (Kafka's DEFAULT_TIMESTAMP) has no expiry.
    assert decode_offset_value(data[:-8] + struct.pack(">q", -1)).expire_timestamp is None


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.builds(lambda g, t, p, v, tail: struct.pack(">h", v) + offset_key(g, t, p)[2:] + tail,
                  st.text(max_size=8), st.text(max_size=8), st.integers(-(2**31), 2**31 - 1), st.integers(0, 3), st.binary(max_size=2)),
        st.builds(lambda g, tail: group_key(g) + tail, st.text(max_size=8), st.binary(max_size=2)),
    )
)
def test_fast_key_decoding_agrees_with_the_checked_decoder(data: bytes) -> None:
    def outcome(f: Any) -> Any:
        try:
            return f(data)
        except RecordFormatError:
            return "error"

    assert outcome(decode_key) == outcome(records_module._decode_key_checked)


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.builds(lambda o, e, m, c, tail: offset_value(OffsetValue(o, e, m, c)) + tail,
                  st.integers(-(2**63), 2**63 - 1), st.integers(-(2**31), 2**31 - 1), st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.binary(max_size=2)),
    )
)
def test_fast_offset_value_decoding_agrees_with_the_checked_decoder(data: bytes) -> None:
    def outcome(f: Any) -> Any:
        try:
            return f(data)
        except RecordFormatError:
            return "error"

    assert outcome(decode_offset_value) == outcome(records_module._decode_offset_value_checked)


@pytest.mark.parametrize("instance", [None, "i" * 0x7FFF, "é" * 0x3FFF])
def test_member_ids_always_fit_an_int16_string(instance: str | None) -> None:
    # Member ids are "<instance or client id>-<uuid>": a 32,767-byte prefix once made an id
    # no answer could carry, and the group's JoinGroup/DescribeGroups answers all failed.
    h = Harness()
    w, r = h.join("g", instance=instance, v4=False)
    result = r if r is not None else h.answer(w)
    h.advance(2 * DELAY)
    result = result if result is not None else h.answer(w)
    member_ids = list(h.g.get("g").members)  # type: ignore[union-attr]
    assert member_ids, result
    for member_id in member_ids:
        assert len(member_id.encode()) <= 0x7FFF
        if instance is not None:
            assert member_id.startswith(instance[:100])

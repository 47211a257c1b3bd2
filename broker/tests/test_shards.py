"""Sharded coordinators (broker/cluster/shards.py): Kafka's mapping of a key to a partition
of an internal topic, the controller's placement of those partitions, and the fencing of a
coordinator by its partition's record revision, against a real etcd; the coordinators'
loop that follows the records (`follow_shards`), against a fake view of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import trio
import trio.testing

from broker.cluster.etcd import Etcd, EtcdError
from broker.cluster.shards import (
    TAKEOVER_RETRY_S,
    UNEXPECTED_RETRY_S,
    Shard,
    TakeoverNotReady,
    follow_shards,
    java_string_hash,
    partition_for,
    place_shards,
    plan,
)
from broker.tests.test_membership import _members, _until
from compat_tests.etcd import EtcdServer

# (key, String.hashCode, abs % 50, abs % 3), as Java 17 computes them (jshell): ASCII,
# empty, Integer.MIN_VALUE (Utils.abs maps it to 0), negative hashes, non-ASCII and a
# character outside the BMP (two UTF-16 code units).
JAVA = [
    ("hello", 99162322, 22, None),
    ("", 0, 0, 0),
    ("polygenelubricants", -(2**31), 0, 0),
    ("console-consumer-12345", 158455506, 6, None),
    ("consumer-group-1", 147483020, 20, 2),
    ("zzzzzzzzzz", -1580979136, 36, 1),
    ("orders", -1008770331, 31, 0),
    ("\u00e9t\u00e9", 227742, 42, None),
    ("\U0001f600x", 54959989, 39, None),
]


def test_the_mapping_is_kafkas() -> None:
    for key, hashed, mod50, mod3 in JAVA:
        assert java_string_hash(key) == hashed, key
        assert partition_for(key, 50) == mod50, key
        if mod3 is not None:
            assert partition_for(key, 3) == mod3, key
    assert {partition_for(f"g{i}", 7) for i in range(200)} == set(range(7))


def _shards(owners: dict[int, int]) -> dict[int, Shard]:
    return {p: Shard("__consumer_offsets", p, o, o, 10 + p) for p, o in owners.items()}


def test_plan_places_every_partition_and_moves_only_what_must_move() -> None:
    # nothing placed: each partition on its preferred broker
    assert plan({}, 6, [1, 2, 3], [1, 2, 3]) == {p: ([1, 2, 3][p % 3], None) for p in range(6)}
    placed = _shards({p: [1, 2, 3][p % 3] for p in range(6)})
    assert plan(placed, 6, [1, 2, 3], [1, 2, 3]) == {}
    # broker 2 dies: its partitions go to the least loaded live brokers, the holder kept
    moves = plan(placed, 6, [1, 2, 3], [1, 3])
    assert sorted(moves) == [1, 4]
    assert sorted(o for o, _ in moves.values()) == [1, 3]
    assert all(holder == 2 for _, holder in moves.values())
    # it comes back: they move back to it (the preferred replica)
    moved = {
        **placed,
        **{p: Shard("__consumer_offsets", p, o, 2, 99) for p, (o, _) in moves.items()},
    }
    assert plan(moved, 6, [1, 2, 3], [1, 2, 3]) == {1: (2, 2), 4: (2, 2)}
    # a cluster upgraded from unsharded groups: every partition starts from the archive
    # of the broker that coordinated them all
    assert plan({}, 2, [1, 2], [1, 2], first_holder=2) == {0: (1, 2), 1: (2, 2)}
    # nobody alive: nothing to do
    assert plan(placed, 6, [1, 2, 3], []) == {}


async def test_the_controller_places_and_moves_partitions_and_a_moved_coordinator_is_fenced(
    etcd: EtcdServer,
) -> None:
    topic = "__consumer_offsets"
    with trio.fail_after(40):
        async with _members(etcd, 1, 2) as ms, trio.open_nursery() as nursery:
            for m in ms:
                nursery.start_soon(place_shards, m, topic, 4)
            await _until(
                lambda: all(
                    len(m.shards.get(topic, {})) == 4
                    and {s.owner for s in m.shards[topic].values()} == {1, 2}
                    for m in ms
                )
            )
            assert ms[0].shards[topic] == ms[1].shards[topic]  # every broker sees the same
            ctl = next(m for m in ms if m.is_controller)
            other = next(m for m in ms if m is not ctl)
            mine = {
                p: s.revision for p, s in other.shards[topic].items() if s.owner == other.me.node_id
            }
            assert mine
            # the coordinator claims its partitions: a new revision, itself the holder
            claimed = await other.claim_shards(topic, mine)
            assert claimed is not None
            fence = dict.fromkeys(mine, claimed)
            assert await other.check_shards(topic, fence)
            # claiming at a revision that is no longer current fails
            assert await other.claim_shards(topic, mine) is None
            # its lease goes (a pause past the TTL): the controller moves its partitions,
            # keeping it as the holder to adopt from, and its acts are fenced for good
            await Etcd([etcd.endpoint]).revoke(other.lease)
            await _until(lambda: all(ctl.shards[topic][p].revision > claimed for p in mine))
            # (it may be back already, registered again: then they move back to it)
            assert all(ctl.shards[topic][p].holder == other.me.node_id for p in mine)
            assert not await other.check_shards(topic, fence)
            nursery.cancel_scope.cancel()


class _FollowedMembership:
    """What `follow_shards` reads of a cluster's membership: the records and a change event."""

    def __init__(self, records: dict[int, Shard]) -> None:
        self.shards = {"__transaction_state": records}
        self.changed = trio.Event()

    def lease_valid(self) -> bool:
        return True


class _FollowedCluster:
    def __init__(self, records: dict[int, Shard]) -> None:
        self.me = 1
        self.membership = _FollowedMembership(records)


class _Holder:
    """A coordinator whose takeovers fail with the errors given, in turn, then succeed."""

    def __init__(self, failures: list[Exception]) -> None:
        self.shards: dict[int, int] = {}
        self.failures = failures
        self.attempts = 0
        self.resigned: list[list[int]] = []

    def resign(self, partitions: Iterable[int] | None = None) -> None:
        gone = list(self.shards) if partitions is None else list(partitions)
        self.resigned.append(sorted(gone))
        for p in gone:
            self.shards.pop(p, None)

    async def take_over(self, cluster: Any, wanted: dict[int, int]) -> bool:
        self.attempts += 1
        if self.failures:
            raise self.failures.pop(0)
        self.shards.update(wanted)
        return True


def _txn_shards(owners: dict[int, int]) -> dict[int, Shard]:
    return {p: Shard("__transaction_state", p, o, o, 10 + p) for p, o in owners.items()}


async def test_follow_shards_retries_expected_errors_and_resigns_what_moved(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The coordinators' shared loop: a takeover failing with a retriable error (no copy of
    the previous holder's archive yet, etcd away, the archive failing) is tried again
    after TAKEOVER_RETRY_S, then the partitions named here are served; one moved away is
    given up at the next change."""
    cluster = _FollowedCluster(_txn_shards({0: 1, 1: 2, 2: 1}))
    holder = _Holder([TakeoverNotReady("no copy yet"), EtcdError("etcd away"), OSError("disk")])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_shards, cluster, "__transaction_state", holder)  # type: ignore[arg-type]
        with trio.fail_after(10):
            await _until(lambda: holder.shards == {0: 10, 2: 12})
        assert holder.attempts == 4
        assert trio.current_time() >= 3 * TAKEOVER_RETRY_S
        cluster.membership.shards["__transaction_state"][2] = Shard("__transaction_state", 2, 2, 1, 20)
        changed, cluster.membership.changed = cluster.membership.changed, trio.Event()
        changed.set()
        with trio.fail_after(10):
            await _until(lambda: holder.shards == {0: 10})
        assert holder.resigned == [[2]]
        nursery.cancel_scope.cancel()


async def test_follow_shards_logs_an_unexpected_error_and_tries_again_slowly(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Anything but the retriable errors is a bug or state nobody foresaw: logged with its
    traceback (an ERROR) and tried again after UNEXPECTED_RETRY_S, never the broker's end
    (every broker named after it would take the same partitions over and die too)."""
    cluster = _FollowedCluster(_txn_shards({0: 1}))
    holder = _Holder([KeyError("a bug")])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow_shards, cluster, "__transaction_state", holder)  # type: ignore[arg-type]
        with trio.fail_after(UNEXPECTED_RETRY_S + 5):
            await _until(lambda: holder.shards == {0: 10})
        assert trio.current_time() >= UNEXPECTED_RETRY_S
        assert holder.attempts == 2
        nursery.cancel_scope.cancel()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is not None
    assert "a bug" in caplog.text

"""Cluster mode's offsets takeover, below the cluster: the merge rule across brokers'
offsets archives (`broker.groups.offsets.merge`), records adopted from another archive
(they keep their time and survive a restart), compaction keeping record times, and a
resigning coordinator answering its parked requests.

The whole takeover with real brokers (catch-up, COORDINATOR_LOAD_IN_PROGRESS, a returning
controller) is in broker/tests/test_cluster.py and compat_tests/test_cluster.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from broker.cluster import PeerCopy
from broker.config import BrokerConfig, apply_properties
from broker.groups import codes
from broker.groups.coordinator import Waiter
from broker.groups.offsets import Word, last_words, merge, normal_key
from broker.groups.records import OffsetValue, offset_key, offset_value
from broker.groups.state import JoinResult
from broker.tests.test_groups_maintenance import T0, Clock, commit, eventually, fetched, running


def _offset(group: str, offset: int, at: int) -> Word:
    return Word(at, offset_key(group, "t", 0), offset_value(OffsetValue(offset, -1, "", at)))


def _tombstone(group: str, at: int) -> Word:
    return Word(at, offset_key(group, "t", 0), None)


def _words(*words: Word) -> dict[bytes, Word]:
    return {normal_key(w.key): w for w in words}


def test_the_later_record_wins_whichever_archive_holds_it() -> None:
    own = _words(_offset("a", 5, T0), _offset("b", 7, T0 + 10))
    peer = _words(_offset("a", 9, T0 + 1), _offset("b", 3, T0 + 9), _offset("c", 1, T0))
    adopted = merge(own, [peer])
    # a: the peer's commit is newer; b: ours is; c: only the peer has it
    assert sorted(adopted, key=lambda w: w.key) == sorted([peer[normal_key(offset_key("a", "t", 0))],
                                                           peer[normal_key(offset_key("c", "t", 0))]],
                                                          key=lambda w: w.key)


def test_a_returning_coordinator_adopts_what_was_committed_while_it_was_away() -> None:
    # Broker 1 committed 50 at T0 and died; broker 2 took over (its archive holds a copy of
    # that commit, same time) and committed 150. Broker 1 back: its stale 50 loses.
    mine = _words(_offset("g", 50, T0))
    theirs = _words(_offset("g", 150, T0 + 20_000))
    assert merge(mine, [theirs]) == list(theirs.values())
    # and the copy of our own record, same time: nothing to adopt
    assert merge(mine, [_words(_offset("g", 50, T0))]) == []


def test_ties_go_to_our_own_record_then_the_lowest_broker() -> None:
    own = _words(_offset("g", 1, T0))
    assert merge(own, [_words(_offset("g", 2, T0))]) == []
    first, second = _words(_offset("h", 2, T0)), _words(_offset("h", 3, T0))
    assert merge({}, [first, second]) == list(first.values())


def test_tombstones_order_like_commits() -> None:
    # a later DeleteGroups/OffsetDelete/expiry tombstone deletes our older commit
    own = _words(_offset("g", 5, T0))
    assert merge(own, [_words(_tombstone("g", T0 + 1))]) == [_tombstone("g", T0 + 1)]
    # an older tombstone does not delete a newer commit
    assert merge(_words(_offset("g", 6, T0 + 2)), [_words(_tombstone("g", T0 + 1))]) == []
    # a commit newer than our tombstone comes back; an older one does not
    assert merge(_words(_tombstone("g", T0 + 1)), [_words(_offset("g", 7, T0 + 2))]) == [_offset("g", 7, T0 + 2)]
    assert merge(_words(_tombstone("g", T0 + 3)), [_words(_offset("g", 7, T0 + 2))]) == []
    # deleting what we do not hold: nothing to write
    assert merge({}, [_words(_tombstone("g", T0))]) == []
    # the latest among several peers decides: a commit, then a later tombstone elsewhere
    assert merge(own, [_words(_offset("g", 8, T0 + 1)), _words(_tombstone("g", T0 + 2))]) == [_tombstone("g", T0 + 2)]


async def test_adopted_records_keep_their_time_and_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    a_config = BrokerConfig(data_dir=tmp_path / "a", listen_port=0)
    b_config = BrokerConfig(data_dir=tmp_path / "b", listen_port=0)
    async with running(b_config, clock) as b:
        b.create_topic("t", 1)
        clock.now = T0 + 1_000
        await commit(b.groups, "g", {("t", 0): 150})
        await commit(b.groups, "only-b", {("t", 0): 4})
        theirs = last_words(b.groups.archive.partition.log)
    async with running(a_config, clock) as a:
        a.create_topic("t", 1)
        clock.now = T0
        await commit(a.groups, "g", {("t", 0): 50})
        clock.now = T0 + 2_000
        await commit(a.groups, "only-a", {("t", 0): 9})
        adopted = merge(a.groups.archive.words(), [theirs])
        assert sorted(w.timestamp for w in adopted) == [T0 + 1_000, T0 + 1_000]
        span = a.groups.archive.adopt(adopted)
        assert span is not None
        with trio.fail_after(10):
            await a.groups.archive.wait_durable(span[1])
        # what was copied carries the time of the commit it copies, not of the copy
        words = last_words(a.groups.archive.partition.log)
        assert words[normal_key(offset_key("g", "t", 0))].timestamp == T0 + 1_000
    async with running(a_config, clock) as a:  # the archive alone carries them now
        assert fetched(a.groups, "g") == {("t", 0): 150}
        assert fetched(a.groups, "only-b") == {("t", 0): 4}
        assert fetched(a.groups, "only-a") == {("t", 0): 9}


async def test_compaction_keeps_each_record_time(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0)
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 1)
        for i in range(5):
            clock.now = T0 + i
            await commit(node.groups, f"g{i}", {("t", 0): i})
            await commit(node.groups, f"g{i}", {("t", 0): 10 + i})  # superseded records to compact
        clock.now = T0 + 1_000_000
        assert await node.groups.compact() > 0
        plog = node.groups.archive.partition.log
        assert plog.log_start_offset > 0
        words = last_words(plog)
        # a copy made by compaction must not look newer than another broker's later commit
        assert {w.timestamp for w in words.values()} == {T0 + i for i in range(5)}


async def test_a_resigning_coordinator_sends_parked_members_to_the_new_one(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0)
    async with running(config, Clock()) as node:
        c = node.groups
        joining = c.join("g", "", None, "consumer", [("range", b"")], session_timeout_ms=10_000,
                         rebalance_timeout_ms=10_000)
        assert isinstance(joining, Waiter)
        c.resign()
        with trio.fail_after(5):
            r: JoinResult = await joining.wait()
        assert r.error == codes.NOT_COORDINATOR
        assert c.groups.get("g") is None and not c.loaded


@dataclass
class _Channel:
    """What `PeerCopy.caught_up` reads of a live follower channel."""

    remote_length: int | None
    done: bool = False


async def test_a_new_coordinator_waits_for_the_handover_then_merges_and_adopts_late_commits(tmp_path: Path) -> None:
    """Broker 1 of a two-broker cluster (no network: broker 2's archive is handed to it as
    its copy) loads only once broker 2 named it controller and the copy caught up; it takes
    broker 2's newer commits, keeps its own newer ones, and adopts a commit broker 2 wrote
    after the takeover."""
    clock = Clock()
    b_config = BrokerConfig(data_dir=tmp_path / "b", listen_port=0)
    a_config = apply_properties(BrokerConfig(data_dir=tmp_path / "a", listen_port=0),
                                {"node.id": "1", "hyperkafka.cluster.brokers": "1@127.0.0.1:1,2@127.0.0.1:2"})
    async with running(b_config, clock) as b, running(a_config, clock) as a:
        cluster = a.cluster
        assert cluster is not None and cluster.is_controller
        cluster.take_metadata(2, [], controller=2)  # broker 2 still thinks it coordinates
        b.create_topic("t", 1)
        a.create_topic("t", 1)
        peer_log = b.groups.archive.partition.log
        await commit(b.groups, "theirs", {("t", 0): 150})
        clock.now = T0 + 10
        await commit(b.groups, "both", {("t", 0): 1})
        copy = PeerCopy(peer_log, _Channel(peer_log.high_watermark))  # type: ignore[arg-type]
        cluster.offsets_copies[2] = copy
        cluster.copy_changed()
        await trio.sleep(0.3)
        assert not a.groups.loaded and a.groups.refusal() == codes.COORDINATOR_LOAD_IN_PROGRESS
        copy.channel = _Channel(peer_log.high_watermark + 1)  # type: ignore[assignment]
        cluster.take_metadata(2, [], controller=1)
        await trio.sleep(0.3)
        assert not a.groups.loaded  # the copy is behind what broker 2 said it has
        copy.channel = _Channel(peer_log.high_watermark)  # type: ignore[assignment]
        cluster.copy_changed()
        with trio.fail_after(10):
            await eventually(lambda: a.groups.loaded)
        assert a.groups.refusal() == codes.NONE and a.groups.takeovers == 1
        assert fetched(a.groups, "theirs") == {("t", 0): 150}
        assert fetched(a.groups, "both") == {("t", 0): 1}
        clock.now = T0 + 20
        await commit(a.groups, "both", {("t", 0): 3})  # ours now, newer than broker 2's
        # broker 2 accepts commits a little longer (it has not heard of broker 1 yet)
        clock.now = T0 + 30
        await commit(b.groups, "theirs", {("t", 0): 170})
        clock.now = T0 + 15
        await commit(b.groups, "both", {("t", 0): 9})  # older than ours: not taken
        cluster.copy_changed()  # the copy grew
        with trio.fail_after(10):
            await eventually(lambda: fetched(a.groups, "theirs") == {("t", 0): 170})
        assert fetched(a.groups, "both") == {("t", 0): 3}
    async with running(a_config, clock) as a:  # its own archive carries the merge
        cluster = a.cluster
        assert cluster is not None
        cluster.take_metadata(2, [], controller=1)
        peer = running(b_config, clock)
        async with peer as b:
            log_b = b.groups.archive.partition.log
            cluster.offsets_copies[2] = PeerCopy(log_b, _Channel(log_b.high_watermark))  # type: ignore[arg-type]
            cluster.copy_changed()
            with trio.fail_after(10):
                await eventually(lambda: a.groups.loaded)
            assert fetched(a.groups, "theirs") == {("t", 0): 170}
            assert fetched(a.groups, "both") == {("t", 0): 3}


async def test_cluster_compaction_keeps_young_tombstones(tmp_path: Path) -> None:
    """In cluster mode compaction copies tombstones younger than delete.retention.ms (a
    day by default), so a peer's older value of a deleted group does not come back;
    older tombstones are dropped, as Kafka's cleaner drops them."""
    day = 86_400_000
    clock = Clock()
    config = apply_properties(BrokerConfig(data_dir=tmp_path / "a", listen_port=0),
                              {"node.id": "1", "hyperkafka.cluster.brokers": "1@127.0.0.1:1,2@127.0.0.1:2"})
    stale = _words(_offset("old", 5, T0 - 1), _offset("young", 6, T0 - 1))  # a peer's archive
    async with running(config, clock) as node:
        assert node.cluster is not None
        node.cluster.take_metadata(2, [], controller=2)
        node.create_topic("t", 1)
        c = node.groups
        for g in ("old", "young", "kept"):
            await commit(c, g, {("t", 0): 1})
        assert await c.delete_groups(["old"]) == {"old": codes.NONE}
        clock.now = T0 + 10
        assert await c.delete_groups(["young"]) == {"young": codes.NONE}
        clock.now = T0 + day + 5  # "old" was deleted more than a day ago, "young" not
        assert await c.compact() > 0
        words = last_words(c.archive.partition.log)
        young, old = normal_key(offset_key("young", "t", 0)), normal_key(offset_key("old", "t", 0))
        assert words[young] == Word(T0 + 10, offset_key("young", "t", 0), None)
        assert old not in words and normal_key(offset_key("kept", "t", 0)) in words
        assert c.archive.dirty_records == 0  # kept tombstones are not garbage: no churn
        # the peer's older value of "young" stays deleted; "old" is past the retention
        assert merge(c.archive.words(), [stale]) == [stale[old]]
    async with running(config, clock) as node:  # and after a restart (replay)
        assert young in node.groups.archive.tombstones and old not in node.groups.archive.tombstones

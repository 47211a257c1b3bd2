"""Cluster mode's offsets takeover, below the cluster: the adoption rule (the previous
coordinator's archive, by log order: `broker.groups.offsets.adopt`), fencing of commits by
the controller epoch in etcd, records adopted from another archive
(they keep their time and survive a restart), compaction keeping record times, and a
resigning coordinator answering its parked requests.

The whole takeover with real brokers (catch-up, COORDINATOR_LOAD_IN_PROGRESS, a returning
controller) is in broker/tests/test_cluster.py and compat_tests/test_cluster.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from broker.cluster import Cluster, PeerCopy
from broker.cluster.etcd import Etcd
from broker.cluster.membership import Member
from broker.config import BrokerConfig, apply_properties
from broker.groups import codes
from broker.groups.consumer_group import Heartbeat
from broker.groups.coordinator import CommitEntry, Waiter
from broker.groups.offsets import Word, adopt, last_words, normal_key
from broker.groups.records import OffsetValue, offset_key, offset_value
from broker.groups.state import JoinResult
from broker.placement import create_placed
from broker.tests.test_groups_maintenance import T0, Clock, commit, eventually, fetched, running
from compat_tests.etcd import EtcdServer


def _offset(group: str, offset: int, at: int) -> Word:
    return Word(at, offset_key(group, "t", 0), offset_value(OffsetValue(offset, -1, "", at)))


def _tombstone(group: str, at: int) -> Word:
    return Word(at, offset_key(group, "t", 0), None)


def _words(*words: Word) -> dict[bytes, Word]:
    return {normal_key(w.key): w for w in words}


def test_the_previous_coordinators_last_word_wins_whatever_the_clocks() -> None:
    # Our record of "a" carries a later wall-clock time than the previous coordinator's,
    # but the previous coordinator wrote after us (a later epoch): its word wins. The
    # old rule (the later timestamp wins) kept our stale 5 and moved "a" backwards.
    own = _words(_offset("a", 5, T0 + 10_000), _offset("b", 7, T0))
    previous = _words(_offset("a", 3, T0), _offset("b", 7, T0), _offset("c", 1, T0))
    adopted = adopt(own, previous)
    # a: differs, taken; b: the same word, nothing to write; c: only the previous has it
    assert adopted == [previous[normal_key(offset_key("a", "t", 0))], previous[normal_key(offset_key("c", "t", 0))]]
    assert adopt(previous, previous) == []


def test_tombstones_are_taken_like_commits() -> None:
    own = _words(_offset("g", 5, T0 + 9))
    # a tombstone deletes our commit, whatever the times
    assert adopt(own, _words(_tombstone("g", T0))) == [_tombstone("g", T0)]
    # a commit over our tombstone comes back
    assert adopt(_words(_tombstone("g", T0 + 3)), _words(_offset("g", 7, T0))) == [_offset("g", 7, T0)]
    # deleting what we do not hold: nothing to write
    assert adopt({}, _words(_tombstone("g", T0))) == []
    assert adopt(_words(_tombstone("g", T0)), _words(_tombstone("g", T0 + 1))) == []


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
        adopted = adopt(a.groups.archive.words(), theirs)
        assert sorted(w.timestamp for w in adopted) == [T0 + 1_000, T0 + 1_000]  # g and only-b
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
        assert c.groups.get("g") is None


@dataclass
class _Channel:
    """What `PeerCopy.caught_up` reads of a live follower channel."""

    remote_length: int | None
    done: bool = False


def _cluster_config(path: Path, etcd: EtcdServer) -> BrokerConfig:
    return apply_properties(BrokerConfig(data_dir=path, listen_port=0),
                            {"node.id": "1", "hyperkafka.cluster.etcd.endpoints": etcd.endpoint,
                             "hyperkafka.cluster.name": "test", "broker.session.timeout.ms": "2000",
                             "offsets.topic.num.partitions": "1"})


SHARD_KEY = b"/test/internal/__consumer_offsets/0"


async def _peer_registered(etcd: EtcdServer, coordinated: bool, legacy: bool = False) -> Etcd:
    """Broker 2, as etcd shows it: registered (with no lease: it never expires here) and,
    if `coordinated`, the coordinator and holder of the one partition of
    __consumer_offsets (the controller, broker 1, moves it to itself: its preferred);
    `legacy`: instead, the coordinator of every group as the version before sharded
    groups recorded it (``groups/coordinator``)."""
    client = Etcd([etcd.endpoint])
    await client.put(b"/test/brokers/2", Member(2, "127.0.0.1", 1).encode())
    await client.put(b"/test/members/2", Member(2, "127.0.0.1", 1).encode())
    if coordinated and legacy:
        await client.put(b"/test/groups/coordinator", json.dumps({"id": 2, "epoch": 1}).encode())
    elif coordinated:
        await client.put(SHARD_KEY, json.dumps({"id": 2, "holder": 2}).encode())
    return client


@pytest.mark.parametrize("legacy", [False, True])
async def test_a_new_coordinator_waits_for_the_handover_then_adopts_the_previous_coordinators_state(
        tmp_path: Path, etcd: EtcdServer, legacy: bool) -> None:
    """Broker 1 (no network: broker 2's archive is handed to it as its copy), named
    coordinator of the partition broker 2 held, loads only once the copy caught up; it
    takes broker 2's state over its own older records even when their clock says
    otherwise; then it claims the partition in etcd (itself the holder). `legacy`: a
    cluster upgraded from unsharded groups, whose coordinator was broker 2: the same."""
    clock = Clock()
    b_config = BrokerConfig(data_dir=tmp_path / "b", listen_port=0)
    async with running(BrokerConfig(data_dir=tmp_path / "a", listen_port=0), clock) as a:
        a.create_topic("t", 1)
        clock.now = T0 + 60_000  # broker 1's clock runs a minute ahead
        await commit(a.groups, "both", {("t", 0): 99})  # then it stopped coordinating
    client = await _peer_registered(etcd, coordinated=True, legacy=legacy)
    async with running(b_config, clock) as b, running(_cluster_config(tmp_path / "a", etcd), clock) as a:
        cluster = a.cluster
        assert isinstance(cluster, Cluster)
        b.create_topic("t", 1)
        peer_log = b.groups.archive.partition.log
        clock.now = T0
        await commit(b.groups, "theirs", {("t", 0): 150})
        await commit(b.groups, "both", {("t", 0): 1})  # later than 99 by the log, not by the clock
        # a KIP-848 consumer group broker 2 coordinates: its records are adopted too
        hb = await b.groups.consumer_heartbeat(
            Heartbeat("kip848", "m1", 0, rebalance_timeout_ms=30_000, subscribed_topic_names=("t",), owned={}))
        assert hb.error == 0
        copy = PeerCopy(peer_log, _Channel(peer_log.high_watermark + 1))  # type: ignore[arg-type]
        cluster.offsets_copies[2] = copy
        cluster.copy_changed()
        with trio.fail_after(10):
            await eventually(lambda: a.groups.coordinator_of("both") == 1)
        await trio.sleep(0.3)
        assert not a.groups.loaded  # the copy is behind what broker 2 said it has
        assert a.groups.refusal("both") == codes.COORDINATOR_LOAD_IN_PROGRESS
        copy.channel = _Channel(peer_log.high_watermark)  # type: ignore[assignment]
        cluster.copy_changed()
        with trio.fail_after(10):
            await eventually(lambda: a.groups.loaded)
        assert a.groups.refusal("both") == codes.NONE and a.groups.takeovers == 1
        assert fetched(a.groups, "theirs") == {("t", 0): 150}
        assert fetched(a.groups, "both") == {("t", 0): 1}
        adopted = a.groups.consumer_group("kip848")
        assert adopted is not None and list(adopted.members) == ["m1"]
        kvs, _ = await client.get(SHARD_KEY)
        assert json.loads(kvs[0].value) == {"id": 1, "holder": 1}
        assert a.groups.shards == {0: kvs[0].mod_revision}
        await commit(a.groups, "both", {("t", 0): 3})
    async with running(BrokerConfig(data_dir=tmp_path / "a", listen_port=0), clock) as a:
        # its own archive carries what it adopted
        assert fetched(a.groups, "theirs") == {("t", 0): 150}
        assert fetched(a.groups, "both") == {("t", 0): 3}


async def test_a_coordinator_whose_partition_moved_acknowledges_nothing(tmp_path: Path, etcd: EtcdServer) -> None:
    """Fencing: once the record of its partition of __consumer_offsets has another
    revision (the controller moved it: here it is written by hand, as a controller
    would), a commit is not acknowledged (NOT_COORDINATOR) and the partition is given
    up; named again, the broker takes it over again before it serves."""
    clock = Clock()
    client = await _peer_registered(etcd, coordinated=False)
    async with running(_cluster_config(tmp_path / "a", etcd), clock) as a:
        cluster = a.cluster
        assert isinstance(cluster, Cluster)
        with trio.fail_after(10):
            await eventually(lambda: a.groups.loaded)  # named coordinator, nobody to hand over from
        first = a.groups.shards[0]
        await create_placed(a, cluster, "t", 1)
        await commit(a.groups, "g", {("t", 0): 5})
        fence = a.groups._fence(["g"])
        assert fence == {0: first}
        await client.put(SHARD_KEY, json.dumps({"id": 2, "holder": 1}).encode())
        assert not await cluster.membership.check_shards("__consumer_offsets", fence)
        # a commit appended under the old revision (the coordinator's view may still say
        # it is ours: a pause, a slow watch) is refused by etcd's comparison itself
        _, last = a.groups.archive.append([(offset_key("g", "t", 0), offset_value(OffsetValue(6, -1, "", T0)))], T0)
        with trio.fail_after(10):
            assert await a.groups._wait_stored(last, fence) == codes.NOT_COORDINATOR
        entries = [CommitEntry("t", 0, 6, -1, None)]
        with trio.fail_after(10):
            await a.groups.commit_offsets("g", -1, "", None, entries)
        assert entries[0].error == codes.NOT_COORDINATOR
        with trio.fail_after(20):  # the controller moves it back (its preferred broker)
            await eventually(lambda: a.groups.shards.get(0, first) > first)
        assert a.groups.takeovers == 2
        assert fetched(a.groups, "g") in ({("t", 0): 5}, {("t", 0): 6})
        await commit(a.groups, "g", {("t", 0): 7})
        assert fetched(a.groups, "g") == {("t", 0): 7}


async def test_cluster_compaction_keeps_young_tombstones(tmp_path: Path, etcd: EtcdServer) -> None:
    """In cluster mode compaction copies tombstones younger than delete.retention.ms (a
    day by default), so a peer's older value of a deleted group does not come back;
    older tombstones are dropped, as Kafka's cleaner drops them."""
    day = 86_400_000
    clock = Clock()
    config = _cluster_config(tmp_path / "a", etcd)
    await _peer_registered(etcd, coordinated=False)
    stale = _words(_offset("old", 5, T0 - 1), _offset("young", 6, T0 - 1))  # a peer's archive
    async with running(config, clock) as node:
        assert isinstance(node.cluster, Cluster)
        with trio.fail_after(10):
            await eventually(lambda: node.groups.loaded)
        assert isinstance(node.cluster, Cluster)
        await create_placed(node, node.cluster, "t", 1)
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
        # a broker holding older values that takes over from us deletes "young" too; "old"
        # is past the retention (as Kafka's cleaner, its tombstone is gone)
        adopted = {normal_key(w.key): w for w in adopt(stale, c.archive.words())}
        assert adopted[young].value is None and old not in adopted
    async with running(config, clock) as node:  # and after a restart (replay)
        assert young in node.groups.archive.tombstones and old not in node.groups.archive.tombstones

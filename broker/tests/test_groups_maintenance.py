"""The coordinator's maintenance over a real node and offsets archive: offsets expiry
writes tombstones that survive a reopen, compaction keeps every committed offset (also
when the process dies between the copy and the segment drop), and a returning static
member is answered without waiting on the archive.

Wall-clock time is the coordinator's `wall` attribute, set by hand; nothing sleeps for
retention to pass.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from broker.compose import open_node, run_node
from broker.config import BrokerConfig
from broker.groups import codes
from broker.groups import offsets as offsets_module
from broker.groups.coordinator import CommitEntry, GroupCoordinator, Waiter
from broker.groups.offsets import OFFSETS_TOPIC
from broker.groups.state import JoinResult, State, SyncResult
from broker.node import Node
from storage.verify import verify_partition

RETENTION = 60_000
T0 = 1_700_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0)
    config.static.update(
        {
            "group.initial.rebalance.delay.ms": "0",
            "group.min.session.timeout.ms": "100",
            "hyperkafka.offsets.retention.ms": str(RETENTION),
            "hyperkafka.offsets.compaction.min.dirty.records": "20",
        }
    )
    return config


@asynccontextmanager
async def running(config: BrokerConfig, clock: Clock, *, close: bool = True) -> AsyncIterator[Node]:
    """A node with its background loops; `close=False` leaves like a killed process
    (nothing flushed or marked clean beyond what the commit loop already did)."""
    node = open_node(config)
    node.groups.wall = clock
    async with trio.open_nursery() as nursery:
        await nursery.start(run_node, node)
        try:
            yield node
        finally:
            nursery.cancel_scope.cancel()
    if close:
        node.close()


async def commit(c: GroupCoordinator, group: str, offsets: dict[tuple[str, int], int], *, generation: int = -1, member: str = "") -> None:
    entries = [CommitEntry(t, p, o, -1, f"m{o}") for (t, p), o in offsets.items()]
    with trio.fail_after(10):
        await c.commit_offsets(group, generation, member, None, entries)
    assert all(e.error == codes.NONE for e in entries), [e.error for e in entries]


async def eventually(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


def fetched(c: GroupCoordinator, group: str) -> dict[tuple[str, int], int]:
    return {(t, p): o.offset for t, parts in c.fetch_offsets(group, None).items() for p, o in parts.items() if o is not None}


def segment_files(config: BrokerConfig) -> list[str]:
    return sorted(n for n in os.listdir(config.data_dir / f"{OFFSETS_TOPIC}-0") if n.endswith(".log"))


async def test_expired_offsets_are_tombstoned_and_stay_gone_after_reopen(config: BrokerConfig) -> None:
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 2)
        await commit(node.groups, "old", {("t", 0): 5})
        clock.now += RETENTION // 2
        await commit(node.groups, "young", {("t", 1): 9})
        clock.now += RETENTION // 2
        expired = await node.groups.expire_offsets()
        assert expired.offsets == (("old", "t", 0),) and expired.groups == ("old",)
        assert fetched(node.groups, "old") == {} and fetched(node.groups, "young") == {("t", 1): 9}
    # The tombstones are in the archive: a replay does not bring the offset back, even
    # with expiry far away in the reopened broker's clock.
    clock.now = T0
    async with running(config, clock) as node:
        assert fetched(node.groups, "old") == {} and node.groups.groups.get("old") is None
        assert fetched(node.groups, "young") == {("t", 1): 9}


async def test_empty_group_expiry_counts_from_the_stored_empty_time_across_a_restart(config: BrokerConfig) -> None:
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 1)
        c = node.groups
        joined = c.join("g", "", None, "consumer", [("range", b"\x00\x00\x00\x00\x00\x01\x00\x01t\xff\xff\xff\xff")],
                        session_timeout_ms=10_000, rebalance_timeout_ms=10_000)
        assert isinstance(joined, Waiter)
        with trio.fail_after(10):
            r: JoinResult = await joined.wait()
            synced = c.sync("g", r.generation_id, r.member_id, None, {r.member_id: b"a"})
            assert isinstance(synced, Waiter)
            s: SyncResult = await synced.wait()
        assert s.error == codes.NONE
        await commit(c, "g", {("t", 0): 3}, generation=r.generation_id, member=r.member_id)
        clock.now += 10 * RETENTION  # a live group keeps the offsets of its topics
        assert (await c.expire_offsets()).offsets == ()
        c.leave("g", [(r.member_id, None)])
        emptied_at = clock.now
        plog = c.archive.partition.log
        await eventually(lambda: plog.high_watermark >= plog.log_end_offset)  # the Empty record is durable
        group = c.groups.get("g")
        assert group is not None and group.is_(State.EMPTY) and group.current_state_timestamp == emptied_at
    clock.now = emptied_at + RETENTION - 1
    async with running(config, clock) as node:
        group = node.groups.groups.get("g")
        assert group is not None and group.current_state_timestamp == emptied_at
        assert (await node.groups.expire_offsets()).offsets == ()
        clock.now += 1
        assert (await node.groups.expire_offsets()).offsets == (("g", "t", 0),)


async def test_the_maintenance_loop_expires_on_its_interval(config: BrokerConfig) -> None:
    config.static["offsets.retention.check.interval.ms"] = "20"
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 1)
        await commit(node.groups, "s", {("t", 0): 1})
        await trio.sleep(0.1)
        assert fetched(node.groups, "s") == {("t", 0): 1}
        clock.now += RETENTION
        await eventually(lambda: not fetched(node.groups, "s"))


async def test_compaction_keeps_every_committed_offset_and_drops_old_segments(config: BrokerConfig) -> None:
    clock = Clock()
    expected: dict[str, dict[tuple[str, int], int]] = {}
    async with running(config, clock) as node:
        node.create_topic("t", 4)
        c = node.groups
        for i in range(60):  # superseded commits pile up until they outnumber the live ones
            group = f"g{i % 3}"
            offsets = {("t", i % 4): i, ("t", (i + 1) % 4): i + 1}
            await commit(c, group, offsets)
            expected.setdefault(group, {}).update(offsets)
        await eventually(lambda: c.compactions > 0)
        plog = c.archive.partition.log
        assert plog.log_start_offset > 0
        assert c.archive.dirty_records < len(c.archive.live) + 20
        assert {g: fetched(c, g) for g in expected} == expected
    async with running(config, clock) as node:
        replayed_from = node.groups.archive.partition.log.log_start_offset
        assert replayed_from > 0
        assert {g: fetched(node.groups, g) for g in expected} == expected


async def test_a_crash_between_the_copy_and_the_drop_loses_no_offset(config: BrokerConfig) -> None:
    config.static["hyperkafka.offsets.compaction.min.dirty.records"] = "1000000"  # only by hand
    clock = Clock()
    expected: dict[tuple[str, int], int] = {}
    async with running(config, clock, close=False) as node:
        node.create_topic("t", 4)
        c = node.groups
        for i in range(40):
            await commit(c, "g", {("t", i % 4): i})
            expected[("t", i % 4)] = i
        await commit(c, "doomed", {("t", 0): 1})
        await c.delete_groups(["doomed"])  # a tombstone: the copy must not revive it
        stamps = {tp: o.commit_timestamp for tp, o in c.groups.get("g").offsets.items()}  # type: ignore[union-attr]
        clock.now += 1000  # a copy must not restart any retention clock
        before = segment_files(config)
        await c.compact(drop=False)  # the copy is durable; the process dies here
        assert len(segment_files(config)) == len(before) + 1
        # Killed: nothing closes the logs, no clean head is written (the descriptors stay
        # open until the test process exits, as the page cache outlives a killed process).
    async with running(config, clock) as node:
        c = node.groups
        assert fetched(c, "g") == expected and fetched(c, "doomed") == {}
        assert c.archive.partition.log.log_start_offset == 0  # nothing was dropped
        assert await c.compact() >= 1
        assert fetched(c, "g") == expected
        public_key = c.archive.partition.log.public_key
    async with running(config, clock) as node:
        assert node.groups.archive.partition.log.log_start_offset > 0
        assert fetched(node.groups, "g") == expected and fetched(node.groups, "doomed") == {}
        assert {tp: o.commit_timestamp for tp, o in node.groups.groups.get("g").offsets.items()} == stamps  # type: ignore[union-attr]
    # Still one signed archive: what is left verifies against the tree it always had.
    assert verify_partition(str(config.data_dir / f"{OFFSETS_TOPIC}-0"), public_key).ok


async def test_a_returning_static_member_is_answered_without_waiting_on_the_archive(config: BrokerConfig) -> None:
    clock = Clock()
    async with running(config, clock) as node:
        c = node.groups
        meta = b"\x00\x00\x00\x00\x00\x01\x00\x01t\xff\xff\xff\xff"
        first = c.join("gs", "", "inst", "consumer", [("range", meta)], session_timeout_ms=10_000, rebalance_timeout_ms=10_000)
        assert isinstance(first, Waiter)
        with trio.fail_after(10):
            r: JoinResult = await first.wait()
            synced = c.sync("gs", 1, r.member_id, "inst", {r.member_id: b"mine"})
            assert isinstance(synced, Waiter)
            assert (await synced.wait()).assignment == b"mine"

        async def never(last_offset: int) -> None:
            await trio.sleep_forever()

        c.archive.wait_durable = never  # type: ignore[method-assign]  # the archive stalls
        again = c.join("gs", "", "inst", "consumer", [("range", meta)], session_timeout_ms=10_000, rebalance_timeout_ms=10_000,
                       supports_skip_assignment=True)
        assert isinstance(again, JoinResult), "a returning static member must not wait on the store"
        assert again.error == codes.NONE and again.generation_id == 1 and again.member_id != r.member_id
        assert c.heartbeat("gs", 1, again.member_id, "inst") == codes.NONE
        assert c.heartbeat("gs", 1, r.member_id, "inst") == codes.FENCED_INSTANCE_ID
        s = c.sync("gs", 1, again.member_id, "inst", {})
        assert isinstance(s, SyncResult) and s.assignment == b"mine"


async def test_a_commit_whose_group_is_deleted_in_flight_is_not_resurrected(config: BrokerConfig) -> None:
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 1)
        c = node.groups
        await commit(c, "d", {("t", 0): 1})
        release = trio.Event()
        real_wait = c.archive.wait_durable

        async def slow(last_offset: int) -> None:
            await release.wait()
            await real_wait(last_offset)

        c.archive.wait_durable = slow  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(commit, c, "d", {("t", 0): 2})
            await trio.sleep(0.05)  # the second commit is appended, not yet durable
            c.archive.wait_durable = real_wait  # type: ignore[method-assign]
            assert await c.delete_groups(["d"]) == {"d": codes.NONE}
            release.set()
        assert fetched(c, "d") == {}
    async with running(config, clock) as node:
        assert fetched(node.groups, "d") == {}  # memory and archive agree


async def test_commits_and_deletes_between_snapshot_batches_survive_compaction(config: BrokerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    config.static["hyperkafka.offsets.compaction.min.dirty.records"] = "1000000"  # only by hand
    monkeypatch.setattr(offsets_module, "SNAPSHOT_BATCH_RECORDS", 2)  # many yields inside the copy
    clock = Clock()
    expected: dict[str, dict[tuple[str, int], int]] = {}
    async with running(config, clock) as node:
        node.create_topic("t", 8)
        c = node.groups
        for g in range(6):
            offsets = {("t", p): 100 * g + p for p in range(8)}
            await commit(c, f"g{g}", offsets)
            expected[f"g{g}"] = offsets
        await commit(c, "gone", {("t", 0): 1})

        copying = trio.Event()
        real_append = c.archive.append

        def append(entries: list[tuple[bytes, bytes | None]], timestamp_ms: int,
                   timestamps: list[int] | None = None) -> tuple[int, int]:
            span = real_append(entries, timestamp_ms, timestamps)
            if c.archive.partition.log.log_start_offset == 0 and span[0] > 0 and not copying.is_set() and snapshot_started:
                copying.set()  # the copy's first batch is written: let the others in
            return span

        snapshot_started = False
        c.archive.append = append  # type: ignore[method-assign]

        async def one_group(g: int, round_: int) -> None:
            offsets = {("t", p): 10_000 * round_ + 100 * g + p for p in range(0, 8, 3)}
            await commit(c, f"g{g}", offsets)
            expected[f"g{g}"].update(offsets)

        async def meanwhile() -> None:
            # Wakes once the copy has begun: these commits land between its batches, for
            # keys copied before them and keys still to be copied, then a deletion.
            await copying.wait()
            async with trio.open_nursery() as inner:
                for g in range(6):
                    inner.start_soon(one_group, g, 1)
            assert await c.delete_groups(["gone"]) == {"gone": codes.NONE}

        async with trio.open_nursery() as nursery:
            nursery.start_soon(meanwhile)
            snapshot_started = True
            assert await c.compact() >= 1
        assert copying.is_set()
        assert {g: fetched(c, g) for g in expected} == expected
    async with running(config, clock) as node:
        assert node.groups.archive.partition.log.log_start_offset > 0
        assert {g: fetched(node.groups, g) for g in expected} == expected
        assert fetched(node.groups, "gone") == {}


async def test_a_compaction_that_frees_nothing_is_not_repeated_until_the_next_check(config: BrokerConfig) -> None:
    clock = Clock()
    async with running(config, clock) as node:
        node.create_topic("t", 1)
        c = node.groups

        async def stuck(offset: int) -> int:
            return 0  # as if a commit job were always in flight

        c.archive.drop_below = stuck  # type: ignore[method-assign]
        for i in range(60):
            await commit(c, "g", {("t", 0): i})
        await trio.sleep(0.1)
        # Without the pause every later commit would copy the live set once more.
        assert c.compactions == 1

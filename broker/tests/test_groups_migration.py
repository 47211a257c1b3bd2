"""KIP-848's online migration over a real socket: a stable classic group joined by a
consumer-protocol member becomes a consumer group keeping its classic members, which
are then served through JoinGroup/SyncGroup/Heartbeat/LeaveGroup with the server-side
assignment; the mixed group survives a restart."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig
from broker.groups import codes
from broker.groups import consumer_protocol as cp
from broker.groups import consumer_records as rec
from broker.groups.consumer_group import UNSUPPORTED_ASSIGNOR
from broker.server import run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_consumer_group_handlers import hb_body, owned_of
from broker.tests.test_groups_handlers import create, join, join_body


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update(
        {"group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "100"}
    )
    return config


def assignment(parts: dict[str, list[int]]) -> bytes:
    return cp.encode_assignment({t: frozenset(ps) for t, ps in parts.items()})


def parts_of(data: bytes) -> set[int]:
    return {p for ps in cp.decode_assignment(data).values() for p in ps}


async def sync(c: RawClient, group: str, generation: int, member: str, given: bytes | None = None) -> Any:
    return await c.call(
        "sync_group",
        5,
        {
            "group_id": group,
            "generation_id": generation,
            "member_id": member,
            "group_instance_id": None,
            "protocol_type": "consumer",
            "protocol_name": "range",
            "assignments": [] if given is None else [{"member_id": member, "assignment": given}],
        },
    )


async def heartbeat(c: RawClient, group: str, generation: int, member: str) -> int:
    r = await c.call(
        "heartbeat",
        4,
        {"group_id": group, "generation_id": generation, "member_id": member, "group_instance_id": None},
    )
    return int(r.error_code)


async def commit(c: RawClient, group: str, generation: int, member: str, offset: int) -> int:
    r = await c.call(
        "offset_commit",
        8,
        {
            "group_id": group,
            "generation_id_or_member_epoch": generation,
            "member_id": member,
            "group_instance_id": None,
            "topics": [
                {
                    "name": "t",
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": offset,
                            "committed_leader_epoch": -1,
                            "committed_metadata": "",
                        }
                    ],
                }
            ],
        },
    )
    return int(r.topics[0].partitions[0].error_code)


async def describe(c: RawClient, group: str) -> Any:
    d = await c.call(
        "consumer_group_describe", 1, {"group_ids": [group], "include_authorized_operations": False}
    )
    return d.groups[0]


async def start(nursery: trio.Nursery, config: BrokerConfig) -> RawClient:
    config.listen_port = 0
    listeners = await nursery.start(run, config)
    return await Broker(config, listeners[0].socket.getsockname()[1]).connect()


async def test_a_stable_classic_group_is_upgraded_and_serves_its_classic_member(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        # A stable classic group: one member, which assigned itself every partition.
        j = await join(c, "mixed")
        classic, gen = j.member_id, j.generation_id
        assert (j.error_code, gen, j.leader) == (0, 1, classic)
        s = await sync(c, "mixed", gen, classic, assignment({"t": [0, 1, 2, 3]}))
        assert s.error_code == 0
        # A consumer-protocol member joins: the group is upgraded, the classic member
        # keeps its partitions, so the new one gets nothing yet (they are not released).
        r = await c.call("consumer_group_heartbeat", 1, hb_body("mixed", "new", 0))
        assert (r.error_code, r.member_epoch) == (0, gen + 1), r
        assert owned_of(r) == []
        d = await describe(c, "mixed")
        assert d.error_code == 0 and d.group_epoch == gen + 1
        kinds = {m.member_id: (m.member_type, m.member_epoch) for m in d.members}
        assert kinds == {classic: (0, gen), "new": (1, gen + 1)}
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": []})
        assert {(g.group_id, g.group_type) for g in listed.groups} >= {("mixed", "consumer")}
        # The classic member commits with its generation and learns it must rejoin.
        assert await commit(c, "mixed", gen, classic, 5) == 0
        assert await heartbeat(c, "mixed", gen, classic) == codes.REBALANCE_IN_PROGRESS
        rj = await c.call("join_group", 9, join_body("mixed", classic))
        assert (rj.error_code, rj.generation_id, rj.protocol_name) == (0, gen + 1, "range")
        assert rj.leader != classic and list(rj.members) == []  # a follower: no assignment to run
        assert await commit(c, "mixed", gen, classic, 6) == codes.ILLEGAL_GENERATION
        sj = await sync(c, "mixed", gen + 1, classic)
        assert (sj.error_code, sj.protocol_type, sj.protocol_name) == (0, "consumer", "range")
        mine = parts_of(sj.assignment)
        assert len(mine) == 2
        assert await heartbeat(c, "mixed", gen + 1, classic) == 0
        # The released partitions go to the consumer-protocol member.
        r2 = await c.call("consumer_group_heartbeat", 1, hb_body("mixed", "new", r.member_epoch, owned=[]))
        theirs = {p for t in owned_of(r2) for p in t["partitions"]}
        assert mine | theirs == {0, 1, 2, 3} and not mine & theirs
        nursery.cancel_scope.cancel()
    # The mixed group replays: the classic member is still one, at its generation.
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        d = await describe(c, "mixed")
        assert {m.member_id: (m.member_type, m.member_epoch) for m in d.members} == {
            classic: (0, gen + 1),
            "new": (1, gen + 1),
        }
        assert await heartbeat(c, "mixed", gen + 1, classic) == 0
        sj = await sync(c, "mixed", gen + 1, classic)
        assert parts_of(sj.assignment) == mine
        # LeaveGroup removes it: its partitions go to the other member.
        lv = await c.call(
            "leave_group", 3, {"group_id": "mixed", "members": [{"member_id": classic, "group_instance_id": None}]}
        )
        assert [m.error_code for m in lv.members] == [0]
        r3 = await c.call("consumer_group_heartbeat", 1, hb_body("mixed", "new", gen + 1, owned=owned_of(r2)))
        assert r3.error_code == 0
        assert {p for t in owned_of(r3) for p in t["partitions"]} == {0, 1, 2, 3}
        nursery.cancel_scope.cancel()


async def test_a_classic_member_joins_a_consumer_group_with_members(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "t", 2)
    r = await c.call("consumer_group_heartbeat", 1, hb_body("cg", "c1", 0))
    assert (r.error_code, r.member_epoch) == (0, 1)
    j = await join(c, "cg")  # MEMBER_ID_REQUIRED first, as from a classic group
    assert j.error_code == 0 and j.generation_id == 2 and j.protocol_type == "consumer"
    # c1 still owns both partitions: nothing for the classic member until it revokes one.
    assert parts_of((await sync(c, "cg", 2, j.member_id)).assignment) == set()
    # Waiting for a partition another member still holds: nothing to rejoin for yet
    # (Kafka's classicGroupHeartbeatToConsumerGroup, waitingOnUnreleasedPartition).
    assert await heartbeat(c, "cg", 2, j.member_id) == 0
    r2 = await c.call("consumer_group_heartbeat", 1, hb_body("cg", "c1", 1, owned=owned_of(r)))
    kept = owned_of(r2)
    r3 = await c.call("consumer_group_heartbeat", 1, hb_body("cg", "c1", 1, owned=kept))
    assert r3.member_epoch == 2
    # Released now: the classic member rejoins to take it.
    assert await heartbeat(c, "cg", 2, j.member_id) == codes.REBALANCE_IN_PROGRESS
    j2 = await c.call("join_group", 9, join_body("cg", j.member_id))
    assert (j2.error_code, j2.generation_id) == (0, 2)
    mine = parts_of((await sync(c, "cg", 2, j.member_id)).assignment)
    assert mine | {p for t in kept for p in t["partitions"]} == {0, 1} and len(mine) == 1
    assert await heartbeat(c, "cg", 2, j.member_id) == 0
    # Not the consumer embedded protocol: refused as before.
    other = {**join_body("cg"), "protocol_type": "connect"}
    assert (await c.call("join_group", 9, other)).error_code == codes.INCONSISTENT_GROUP_PROTOCOL


async def test_no_upgrade_while_rebalancing_or_when_the_policy_says_no(
    broker_config: BrokerConfig,
) -> None:
    broker_config.static["group.consumer.migration.policy"] = "downgrade"
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 2)
        j = await join(c, "g")
        assert (await sync(c, "g", 1, j.member_id, assignment({"t": [0, 1]}))).error_code == 0
        r = await c.call("consumer_group_heartbeat", 1, hb_body("g", "new", 0))
        assert r.error_code == codes.GROUP_ID_NOT_FOUND
        nursery.cancel_scope.cancel()
    broker_config.static["group.consumer.migration.policy"] = "bidirectional"
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        j = await join(c, "g2")  # joined, not synced: CompletingRebalance
        assert j.error_code == 0
        r = await c.call("consumer_group_heartbeat", 1, hb_body("g2", "new", 0))
        assert r.error_code == codes.GROUP_ID_NOT_FOUND
        # A join the consumer group would refuse does not upgrade a stable group.
        assert (await sync(c, "g2", 1, j.member_id, assignment({"t": [0, 1]}))).error_code == 0
        bad = {**hb_body("g2", "new", 0), "server_assignor": "nope"}
        r = await c.call("consumer_group_heartbeat", 1, bad)
        assert r.error_code == UNSUPPORTED_ASSIGNOR
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": []})
        assert [(g.group_type, g.group_state) for g in listed.groups if g.group_id == "g2"] == [
            ("classic", "Stable")
        ]
        r = await c.call("consumer_group_heartbeat", 1, hb_body("g2", "new", 0))
        assert r.error_code == 0
        nursery.cancel_scope.cancel()


def test_classic_member_metadata_round_trips() -> None:
    md = rec.MemberMetadata(
        None, None, "cid", "/1.2.3.4", ("a", "b"), None, 30_000, None, (10_000, (("range", b"\x00\x01"), ("rr", b"")))
    )
    assert rec.decode_member_metadata(rec.member_metadata(md)) == md
    plain = rec.MemberMetadata(None, "r", "cid", "h", ("a",), "x.*", 1, "uniform")
    assert rec.decode_member_metadata(rec.member_metadata(plain)) == plain
    # An unknown tagged field is skipped.
    raw = rec.member_metadata(plain)[:-1] + b"\x01\x05\x02ab"
    assert rec.decode_member_metadata(raw) == plain
    assert struct.unpack(">h", cp.encode_assignment({})[:2]) == (0,)


async def upgraded(c: RawClient, group: str) -> tuple[str, int, Any]:
    """A classic member and a consumer-protocol member reconciled in `group`, upgraded from
    a stable classic group: (the classic member's id, its generation, the other's answer)."""
    j = await join(c, group)
    assert (await sync(c, group, 1, j.member_id, assignment({"t": [0, 1, 2, 3]}))).error_code == 0
    r = await c.call("consumer_group_heartbeat", 1, hb_body(group, "new", 0))
    assert r.error_code == 0
    rj = await c.call("join_group", 9, join_body(group, j.member_id))
    assert (rj.error_code, rj.generation_id) == (0, 2)
    assert (await sync(c, group, 2, j.member_id)).error_code == 0
    r2 = await c.call("consumer_group_heartbeat", 1, hb_body(group, "new", 2, owned=[]))
    assert r2.error_code == 0 and owned_of(r2)
    return j.member_id, 2, r2


async def test_the_last_consumer_member_leaving_downgrades_the_group(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        classic, gen, _ = await upgraded(c, "down")
        left = await c.call("consumer_group_heartbeat", 1, hb_body("down", "new", -1, topics=None))
        assert (left.error_code, left.member_epoch) == (0, -1)
        # A classic group again, rebalancing: its member is told to rejoin, then leads.
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": []})
        assert [(g.group_type, g.group_state) for g in listed.groups if g.group_id == "down"] == [
            ("classic", "PreparingRebalance")
        ]
        assert (await describe(c, "down")).error_code == codes.GROUP_ID_NOT_FOUND
        assert await heartbeat(c, "down", gen, classic) == codes.REBALANCE_IN_PROGRESS
        rj = await c.call("join_group", 9, join_body("down", classic))
        assert (rj.error_code, rj.generation_id, rj.leader) == (0, gen + 1, classic)
        assert [m.member_id for m in rj.members] == [classic]
        s = await sync(c, "down", gen + 1, classic, assignment({"t": [0, 1, 2, 3]}))
        assert s.error_code == 0 and parts_of(s.assignment) == {0, 1, 2, 3}
        assert await commit(c, "down", gen + 1, classic, 9) == 0
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        dg = await c.call("describe_groups", 5, {"groups": ["down"], "include_authorized_operations": False})
        g = dg.groups[0]
        assert (g.group_state, g.protocol_type, [m.member_id for m in g.members]) == (
            "Stable",
            "consumer",
            [classic],
        )
        assert await heartbeat(c, "down", gen + 1, classic) == 0
        assert (await describe(c, "down")).error_code == codes.GROUP_ID_NOT_FOUND
        nursery.cancel_scope.cancel()


async def test_no_downgrade_when_the_policy_says_no(broker_config: BrokerConfig) -> None:
    broker_config.static["group.consumer.migration.policy"] = "upgrade"
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        classic, gen, _ = await upgraded(c, "up")
        left = await c.call("consumer_group_heartbeat", 1, hb_body("up", "new", -1, topics=None))
        assert left.error_code == 0
        # Still a consumer group, serving its classic member, which now gets everything.
        d = await describe(c, "up")
        assert d.error_code == 0 and [m.member_id for m in d.members] == [classic]
        assert await heartbeat(c, "up", gen, classic) == codes.REBALANCE_IN_PROGRESS
        rj = await c.call("join_group", 9, join_body("up", classic))
        assert rj.error_code == 0
        s = await sync(c, "up", rj.generation_id, classic)
        assert parts_of(s.assignment) == {0, 1, 2, 3}
        nursery.cancel_scope.cancel()


async def test_a_consumer_member_expiring_downgrades_the_group(broker_config: BrokerConfig) -> None:
    broker_config.static.update(
        {"group.consumer.session.timeout.ms": "600", "group.consumer.heartbeat.interval.ms": "100"}
    )
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        classic, gen, _ = await upgraded(c, "exp")
        with trio.fail_after(10):
            while True:  # the classic member heartbeats on; the other one is silent
                error = await heartbeat(c, "exp", gen, classic)
                if error != 0:
                    break
                await trio.sleep(0.1)
        assert error == codes.REBALANCE_IN_PROGRESS
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": ["classic"]})
        assert [g.group_id for g in listed.groups] == ["exp"]
        nursery.cancel_scope.cancel()

"""Classic members inside a consumer group (KIP-848's mixed group) as Kafka 4's
GroupMetadataManager serves them: static members (group.instance.id) that restart, are
fenced by a newer incarnation and leave by instance id; the protocol check a classic
JoinGroup passes; and answers that wait until the records they caused are stored."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.compose import open_node, run_node
from broker.config import BrokerConfig
from broker.groups import codes
from broker.groups import consumer_protocol as cp
from broker.groups.consumer_group import Heartbeat
from broker.groups.coordinator import Waiter
from broker.groups.state import JoinResult, SyncResult
from broker.server import run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_consumer_group_handlers import hb_body, owned_of
from broker.tests.test_groups_handlers import create, join_body, subscription


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update({"group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "100"})
    return config


async def start(nursery: trio.Nursery, config: BrokerConfig) -> RawClient:
    config.listen_port = 0
    listeners = await nursery.start(run, config)
    return await Broker(config, listeners[0].socket.getsockname()[1]).connect()


def parts_of(data: bytes) -> set[int]:
    return {p for ps in cp.decode_assignment(data).values() for p in ps}


async def join(c: RawClient, group: str, member: str = "", instance: str | None = None, **kw: Any) -> Any:
    return await c.call("join_group", 9, {**join_body(group, member, instance=instance), **kw})


async def sync(c: RawClient, group: str, generation: int, member: str, instance: str | None = None) -> Any:
    body = {
        "group_id": group,
        "generation_id": generation,
        "member_id": member,
        "group_instance_id": instance,
        "protocol_type": "consumer",
        "protocol_name": "range",
        "assignments": [],
    }
    return await c.call("sync_group", 5, body)


async def heartbeat(c: RawClient, group: str, generation: int, member: str, instance: str | None = None) -> int:
    body = {"group_id": group, "generation_id": generation, "member_id": member, "group_instance_id": instance}
    return int((await c.call("heartbeat", 4, body)).error_code)


async def leave(c: RawClient, group: str, member: str, instance: str | None) -> int:
    body = {"group_id": group, "members": [{"member_id": member, "group_instance_id": instance, "reason": None}]}
    r = await c.call("leave_group", 5, body)
    assert r.error_code == 0
    return int(r.members[0].error_code)


async def describe(c: RawClient, group: str) -> Any:
    d = await c.call("consumer_group_describe", 1, {"group_ids": [group], "include_authorized_operations": False})
    return d.groups[0]


async def mixed_with_static(c: RawClient, group: str) -> tuple[str, int, set[int], list[dict[str, Any]]]:
    """A consumer-protocol member "c1" and a static classic member "i1", reconciled over
    topic t's 4 partitions: (the classic member's id, its generation, its partitions,
    c1's partitions)."""
    r = await c.call("consumer_group_heartbeat", 1, hb_body(group, "c1", 0))
    assert (r.error_code, r.member_epoch) == (0, 1)
    # A static member needs no MEMBER_ID_REQUIRED round (Kafka: only dynamic members do).
    j = await join(c, group, instance="i1")
    assert (j.error_code, j.generation_id, j.protocol_type) == (0, 2, "consumer"), j
    member = j.member_id
    assert parts_of((await sync(c, group, 2, member, "i1")).assignment) == set()
    r2 = await c.call("consumer_group_heartbeat", 1, hb_body(group, "c1", 1, owned=owned_of(r)))
    kept = owned_of(r2)
    r3 = await c.call("consumer_group_heartbeat", 1, hb_body(group, "c1", 1, owned=kept))
    assert r3.member_epoch == 2
    assert (await join(c, group, member, "i1")).generation_id == 2
    mine = parts_of((await sync(c, group, 2, member, "i1")).assignment)
    assert len(mine) == 2
    assert await heartbeat(c, group, 2, member, "i1") == 0
    return member, 2, mine, kept


async def test_a_static_classic_member_restarts_into_its_partitions_and_fences_the_old_one(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        old, gen, mine, kept = await mixed_with_static(c, "mx")
        epoch = (await describe(c, "mx")).group_epoch
        # The process restarts: it joins with its instance id and no member id. It gets a
        # new member id, the same generation and the same partitions, without a rebalance.
        j = await join(c, "mx", instance="i1")
        assert (j.error_code, j.generation_id) == (0, gen) and j.member_id not in ("", old)
        new = j.member_id
        assert parts_of((await sync(c, "mx", gen, new, "i1")).assignment) == mine
        assert await heartbeat(c, "mx", gen, new, "i1") == 0
        d = await describe(c, "mx")
        assert d.group_epoch == epoch
        assert {m.member_id: (m.instance_id, m.member_epoch) for m in d.members} == {
            "c1": (None, gen),
            new: ("i1", gen),
        }
        r = await c.call("consumer_group_heartbeat", 1, hb_body("mx", "c1", gen, owned=kept))
        assert (r.error_code, r.member_epoch) == (0, gen)  # c1 is not asked to change anything
        # The old incarnation is fenced wherever it shows its instance id.
        assert await heartbeat(c, "mx", gen, old, "i1") == codes.FENCED_INSTANCE_ID
        assert (await sync(c, "mx", gen, old, "i1")).error_code == codes.FENCED_INSTANCE_ID
        assert (await join(c, "mx", old, "i1")).error_code == codes.FENCED_INSTANCE_ID
        assert await leave(c, "mx", old, "i1") == codes.FENCED_INSTANCE_ID
        assert await heartbeat(c, "mx", gen, old) == codes.UNKNOWN_MEMBER_ID
        assert await heartbeat(c, "mx", gen, new, "other") == codes.UNKNOWN_MEMBER_ID
        nursery.cancel_scope.cancel()
    # After a broker restart the instance id still names the new incarnation.
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        assert await heartbeat(c, "mx", gen, new, "i1") == 0
        assert await heartbeat(c, "mx", gen, old, "i1") == codes.FENCED_INSTANCE_ID
        # LeaveGroup by instance id alone (administrative removal) removes it: a rebalance.
        assert await leave(c, "mx", "", "i1") == 0
        d = await describe(c, "mx")
        assert [m.member_id for m in d.members] == ["c1"] and d.group_epoch == epoch + 1
        assert await leave(c, "mx", "", "i1") == codes.UNKNOWN_MEMBER_ID
        assert await heartbeat(c, "mx", gen, new, "i1") == codes.UNKNOWN_MEMBER_ID
        # A consumer-protocol member is not removed through the classic LeaveGroup.
        assert await leave(c, "mx", "c1", None) == codes.UNKNOWN_MEMBER_ID
        nursery.cancel_scope.cancel()


async def test_a_second_static_classic_member_with_the_same_instance_id_takes_over(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "t", 4)
    old, gen, mine, _ = await mixed_with_static(c, "mx2")
    # Another process with the same instance id while the first is still alive: Kafka
    # replaces the classic member (no UNRELEASED_INSTANCE_ID: that is for the consumer
    # protocol only) and the first learns it is fenced at its next request.
    j = await join(c, "mx2", instance="i1")
    assert (j.error_code, j.generation_id) == (0, gen)
    assert parts_of((await sync(c, "mx2", gen, j.member_id, "i1")).assignment) == mine
    assert await heartbeat(c, "mx2", gen, old, "i1") == codes.FENCED_INSTANCE_ID
    assert await leave(c, "mx2", j.member_id, "i1") == 0
    assert [m.member_id for m in (await describe(c, "mx2")).members] == ["c1"]


async def test_a_static_classic_group_is_upgraded_and_downgraded_with_its_instance_ids(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, broker_config)
        await create(c, "t", 4)
        j = await join(c, "up", instance="s1")
        assert (j.error_code, j.generation_id) == (0, 1)
        body = {
            "group_id": "up",
            "generation_id": 1,
            "member_id": j.member_id,
            "group_instance_id": "s1",
            "protocol_type": "consumer",
            "protocol_name": "range",
            "assignments": [{"member_id": j.member_id, "assignment": cp.encode_assignment({"t": frozenset(range(4))})}],
        }
        assert (await c.call("sync_group", 5, body)).error_code == 0
        # Kafka's ConsumerGroup.fromClassicGroup keeps the instance id of each member.
        r = await c.call("consumer_group_heartbeat", 1, hb_body("up", "new", 0))
        assert r.error_code == 0, r
        d = await describe(c, "up")
        assert {m.member_id: m.instance_id for m in d.members} == {j.member_id: "s1", "new": None}
        assert await heartbeat(c, "up", 1, j.member_id, "s1") == codes.REBALANCE_IN_PROGRESS
        # Its restart takes its place, as in any consumer group.
        again = await join(c, "up", instance="s1")
        assert (again.error_code, again.generation_id) == (0, 2)
        assert await heartbeat(c, "up", 1, j.member_id, "s1") == codes.FENCED_INSTANCE_ID
        # The consumer-protocol member leaves: back to a classic group, still static.
        left = await c.call("consumer_group_heartbeat", 1, hb_body("up", "new", -1))
        assert left.error_code == 0
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": []})
        assert [g.group_type for g in listed.groups if g.group_id == "up"] == ["classic"]
        rejoin = await join(c, "up", again.member_id, "s1")
        assert rejoin.error_code == 0 and rejoin.members[0].group_instance_id == "s1"
        assert (await join(c, "up", j.member_id, "s1")).error_code == codes.FENCED_INSTANCE_ID
        nursery.cancel_scope.cancel()


def meta_v(version: int, *topics: str) -> bytes:
    """A ConsumerProtocolSubscription of `version` (v0 is the handlers' helper)."""
    body = subscription(*topics)[2:]
    return struct.pack(">h", version) + body + (struct.pack(">i", 0) if version >= 1 else b"")


async def test_a_classic_join_must_share_a_protocol_with_the_classic_members(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "t", 2)
    assert (await c.call("consumer_group_heartbeat", 1, hb_body("pm", "c1", 0))).error_code == 0
    # Kafka's ConsumerGroup.supportsClassicProtocols: the protocol type must be "consumer"
    # and, with no classic member yet, any named protocol goes.
    assert (await join(c, "pm", instance="a", protocol_type="connect")).error_code == codes.INCONSISTENT_GROUP_PROTOCOL
    assert (await join(c, "pm", instance="a", protocols=[])).error_code == codes.INCONSISTENT_GROUP_PROTOCOL
    a = await join(c, "pm", instance="a", protocols=[{"name": "range", "metadata": meta_v(1, "t")}])
    assert a.error_code == 0 and a.protocol_name == "range"
    # Now a protocol must be one every classic member supports.
    rr = [{"name": "roundrobin", "metadata": meta_v(1, "t")}]
    refused = await join(c, "pm", instance="b", protocols=rr)
    assert refused.error_code == codes.INCONSISTENT_GROUP_PROTOCOL
    # The check comes before MEMBER_ID_REQUIRED, as in Kafka.
    assert (await join(c, "pm", protocols=rr)).error_code == codes.INCONSISTENT_GROUP_PROTOCOL
    both = [*rr, {"name": "range", "metadata": meta_v(1, "t")}]
    b = await join(c, "pm", instance="b", protocols=both)
    assert b.error_code == 0 and b.protocol_name == "roundrobin"  # its first choice is named
    # SyncGroup names the protocol its join was answered with (throwIfClassicProtocolUnmatched),
    # and a member behind the group epoch rejoins first (throwIfRebalanceInProgress).
    assert (await sync(c, "pm", b.generation_id, b.member_id, "b")).error_code == codes.INCONSISTENT_GROUP_PROTOCOL
    assert b.generation_id > a.generation_id
    assert (await sync(c, "pm", a.generation_id, a.member_id, "a")).error_code == codes.REBALANCE_IN_PROGRESS
    # An embedded subscription that cannot be read: Kafka's deserializeSubscription throws
    # IllegalStateException, answered UNKNOWN_SERVER_ERROR, and nothing changes.
    bad = await join(c, "pm", instance="c", protocols=[{"name": "range", "metadata": b"\x00\x01\x00"}])
    assert bad.error_code == codes.UNKNOWN_SERVER_ERROR
    assert {m.instance_id for m in (await describe(c, "pm")).members} == {None, "a", "b"}
    # A member rejoining with a protocol that is no longer shared is refused too.
    assert (await join(c, "pm", a.member_id, "a", protocols=rr)).error_code == codes.INCONSISTENT_GROUP_PROTOCOL


# ------------------------------------------------------------------ answers after storing


async def test_classic_answers_in_a_mixed_group_wait_until_their_records_are_stored(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0)
    config.static.update({"group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "100"})
    node = open_node(config)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_node, node)
        node.create_topic("t", 2)
        node.create_topic("u", 1)
        c = node.groups
        with trio.fail_after(10):
            first = await c.consumer_heartbeat(
                Heartbeat("wg", "c1", 0, rebalance_timeout_ms=30_000, subscribed_topic_names=("u",), owned={})
            )
        assert first.error == 0
        real_wait = c.archive.wait_durable
        gate = trio.Event()
        waited: list[int] = []

        async def gated(last_offset: int) -> None:
            waited.append(last_offset)
            await gate.wait()
            await real_wait(last_offset)

        c.archive.wait_durable = gated  # type: ignore[method-assign]  # the archive is slow
        joined = c.join("wg", "", "s", "consumer", [("range", meta_v(1, "t"))], session_timeout_ms=10_000, rebalance_timeout_ms=10_000)
        assert isinstance(joined, Waiter), "a classic join into a consumer group must wait for its records"
        # Sync and heartbeat cause no records here, but the join's must be stored before
        # they are answered (Kafka answers once the log is committed up to its end).
        consumer = c.consumer_group("wg")
        assert consumer is not None
        member_id = consumer.static_members["s"]
        synced = c.sync("wg", 2, member_id, "s", {})
        beat = c.heartbeat("wg", 2, member_id, "s")
        assert isinstance(synced, Waiter) and isinstance(beat, Waiter)
        with trio.move_on_after(0.3):
            await joined.wait()
        assert (joined.result, synced.result, beat.result) == (None, None, None) and waited
        gate.set()
        with trio.fail_after(10):
            result: JoinResult = await joined.wait()
            s: SyncResult = await synced.wait()
            assert await beat.wait() == codes.NONE
        assert (result.error, result.member_id, result.generation_id) == (0, member_id, 2)
        assert s.error == 0 and parts_of(s.assignment) == {0, 1}
        gate = trio.Event()
        left = c.leave("wg", [("", "s")])
        assert isinstance(left, Waiter)
        with trio.move_on_after(0.3):
            await left.wait()
        assert left.result is None, "a leave answered before its tombstones were stored"
        gate.set()
        with trio.fail_after(10):
            assert await left.wait() == (codes.NONE, [codes.NONE])
        nursery.cancel_scope.cancel()
    node.close()


async def test_a_classic_member_replacing_the_last_consumer_protocol_member_downgrades_the_group(
    broker: Broker,
) -> None:
    """Kafka's validateOnlineDowngradeWithReplacedMemberId: when a classic JoinGroup takes
    the instance id of the last member of the consumer protocol, the group becomes a
    classic group at once, stable, each member keeping its target partitions (the new
    one those of the member it replaced): nobody rebalances."""
    c = await broker.connect()
    await create(c, "t", 4)
    r = await c.call("consumer_group_heartbeat", 1, {**hb_body("dg", "c1", 0), "instance_id": "i1"})
    assert (r.error_code, r.member_epoch) == (0, 1)
    j = await join(c, "dg", instance="k")
    gen = j.generation_id
    r2 = await c.call("consumer_group_heartbeat", 1, {**hb_body("dg", "c1", 1, owned=owned_of(r)), "instance_id": "i1"})
    r3 = await c.call("consumer_group_heartbeat", 1, {**hb_body("dg", "c1", 1, owned=owned_of(r2)), "instance_id": "i1"})
    assert r3.member_epoch == gen
    kept = owned_of(r2)
    theirs = {p for t in kept for p in t["partitions"]}
    assert (await join(c, "dg", j.member_id, "k")).generation_id == gen
    mine = parts_of((await sync(c, "dg", gen, j.member_id, "k")).assignment)
    assert mine | theirs == {0, 1, 2, 3} and len(mine) == 2
    # The consumer-protocol instance comes back as a classic consumer.
    back = await join(c, "dg", instance="i1")
    assert (back.error_code, back.generation_id) == (0, gen)
    listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": []})
    assert [(g.group_type, g.group_state) for g in listed.groups if g.group_id == "dg"] == [("classic", "Stable")]
    assert parts_of((await sync(c, "dg", gen, back.member_id, "i1")).assignment) == theirs
    assert parts_of((await sync(c, "dg", gen, j.member_id, "k")).assignment) == mine
    assert await heartbeat(c, "dg", gen, j.member_id, "k") == 0
    assert await heartbeat(c, "dg", gen, back.member_id, "i1") == 0
    beat = await c.call("consumer_group_heartbeat", 1, {**hb_body("dg", "c1", gen, owned=kept), "instance_id": "i1"})
    assert beat.error_code == codes.GROUP_ID_NOT_FOUND  # a classic group now

"""KIP-848 end to end over a real socket: ConsumerGroupHeartbeat, ConsumerGroupDescribe,
the shared group APIs for a consumer group, and the group surviving a restart."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig
from broker.groups import codes
from broker.groups.consumer_group import FENCED_MEMBER_EPOCH, STALE_MEMBER_EPOCH
from broker.server import run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_groups_handlers import create, join, join_body


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update(
        {"group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "100"}
    )
    return config


def hb_body(
    group: str,
    member: str,
    epoch: int,
    *,
    topics: tuple[str, ...] | None = ("t",),
    owned: list[dict[str, Any]] | None = None,
    regex: str | None = None,
) -> dict[str, Any]:
    join = epoch == 0
    return {
        "group_id": group,
        "member_id": member,
        "member_epoch": epoch,
        "instance_id": None,
        "rack_id": None,
        "rebalance_timeout": 30_000 if join else -1,
        "subscribed_topic_names": topics if join or topics != ("t",) else None,
        "subscribed_topic_regex": regex,
        "server_assignor": None,
        "topic_partitions": ([] if join else None) if owned is None else owned,
    }


def owned_of(r: Any) -> list[dict[str, Any]]:
    return [
        {"topic_id": t.topic_id, "partitions": list(t.partitions)}
        for t in r.assignment.topic_partitions
    ]


async def topic_id(c: RawClient, name: str) -> uuid.UUID:
    m = await c.call(
        "metadata",
        12,
        {
            "topics": [{"name": name, "topic_id": None}],
            "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False,
        },
    )
    return uuid.UUID(str(m.topics[0].topic_id))


async def test_heartbeat_assigns_commits_describes_and_survives_a_restart(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await b.connect()
        versions = await c.call(
            "api_versions", 3, {"client_software_name": "t", "client_software_version": "1"}
        )
        assert {(k.api_key, k.min_version, k.max_version) for k in versions.api_keys} >= {
            (68, 0, 1),
            (69, 0, 1),
        }
        await create(c, "t", 3)
        tid = await topic_id(c, "t")
        r = await c.call("consumer_group_heartbeat", 1, hb_body("g", "m1", 0))
        assert (r.error_code, r.member_id, r.member_epoch) == (0, "m1", 1)
        assert [(t.topic_id, sorted(t.partitions)) for t in r.assignment.topic_partitions] == [
            (tid, [0, 1, 2])
        ]
        # Unchanged and acknowledged: no assignment in the answer.
        r2 = await c.call("consumer_group_heartbeat", 1, hb_body("g", "m1", 1, owned=owned_of(r)))
        assert r2.error_code == 0 and r2.assignment is None
        assert (
            await c.call("consumer_group_heartbeat", 1, hb_body("g", "m1", 7))
        ).error_code == FENCED_MEMBER_EPOCH
        assert (
            await c.call("consumer_group_heartbeat", 1, hb_body("g", "", 0))
        ).error_code == codes.INVALID_REQUEST
        # v0: the coordinator names the member.
        r0 = await c.call("consumer_group_heartbeat", 0, hb_body("g0", "", 0))
        assert r0.error_code == 0 and r0.member_id
        commit = {
            "group_id": "g",
            "generation_id_or_member_epoch": 1,
            "member_id": "m1",
            "group_instance_id": None,
            "topics": [
                {
                    "name": "t",
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": 42,
                            "committed_leader_epoch": -1,
                            "committed_metadata": "",
                        }
                    ],
                }
            ],
        }
        assert (await c.call("offset_commit", 9, commit)).topics[0].partitions[0].error_code == 0
        stale = {**commit, "generation_id_or_member_epoch": 0}
        assert (await c.call("offset_commit", 9, stale)).topics[0].partitions[
            0
        ].error_code == STALE_MEMBER_EPOCH
        f = await c.call(
            "offset_fetch",
            9,
            {
                "groups": [{"group_id": "g", "member_id": "m1", "member_epoch": 0, "topics": None}],
                "require_stable": False,
            },
        )
        assert f.groups[0].error_code == STALE_MEMBER_EPOCH
        d = await c.call(
            "consumer_group_describe",
            0,
            {"group_ids": ["g", "nope"], "include_authorized_operations": False},
        )
        g, nope = d.groups
        assert (
            g.error_code,
            g.group_state,
            g.group_epoch,
            g.assignment_epoch,
            g.assignor_name,
        ) == (0, "Stable", 1, 1, "uniform")
        assert [
            (m.member_id, m.member_epoch, [tp.topic_name for tp in m.assignment.topic_partitions])
            for m in g.members
        ] == [("m1", 1, ["t"])]
        assert nope.error_code == codes.GROUP_ID_NOT_FOUND
        listed = await c.call("list_groups", 5, {"states_filter": [], "types_filter": ["consumer"]})
        assert sorted((x.group_id, x.group_type, x.group_state) for x in listed.groups) == [
            ("g", "consumer", "Stable"),
            ("g0", "consumer", "Stable"),
        ]
        dg = await c.call(
            "describe_groups", 5, {"groups": ["g"], "include_authorized_operations": False}
        )
        # As Kafka 4.3: DescribeGroups describes classic groups only; a consumer group is Dead.
        assert (dg.groups[0].error_code, dg.groups[0].group_state, dg.groups[0].members) == (
            0,
            "Dead",
            (),
        )
        # A classic member of another protocol type cannot join the live consumer group
        # (one of the consumer protocol can: test_groups_migration); DeleteGroups refuses it.
        assert (
            await c.call("join_group", 9, {**join_body("g"), "protocol_type": "connect"})
        ).error_code == codes.INCONSISTENT_GROUP_PROTOCOL
        deleted = await c.call("delete_groups", 2, {"groups_names": ["g"]})
        assert deleted.results[0].error_code == codes.NON_EMPTY_GROUP
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await b.connect()
        # The member kept its epoch and partitions: its next heartbeat just goes on.
        r = await c.call(
            "consumer_group_heartbeat",
            1,
            hb_body("g", "m1", 1, owned=[{"topic_id": tid, "partitions": [0, 1, 2]}]),
        )
        assert (r.error_code, r.member_epoch) == (0, 1)
        d = await c.call(
            "consumer_group_describe",
            1,
            {"group_ids": ["g"], "include_authorized_operations": False},
        )
        assert d.groups[0].group_epoch == 1 and [m.member_id for m in d.groups[0].members] == ["m1"]
        f = await c.call(
            "offset_fetch",
            9,
            {
                "groups": [{"group_id": "g", "member_id": "m1", "member_epoch": 1, "topics": None}],
                "require_stable": False,
            },
        )
        assert f.groups[0].topics[0].partitions[0].committed_offset == 42
        # Leaving empties the group; then it can be deleted, and stays deleted.
        left = await c.call("consumer_group_heartbeat", 1, hb_body("g", "m1", -1, topics=None))
        assert (left.error_code, left.member_epoch) == (0, -1)
        assert (await c.call("delete_groups", 2, {"groups_names": ["g"]})).results[
            0
        ].error_code == 0
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await b.connect()
        d = await c.call(
            "consumer_group_describe",
            1,
            {"group_ids": ["g"], "include_authorized_operations": False},
        )
        assert d.groups[0].error_code == codes.GROUP_ID_NOT_FOUND
        nursery.cancel_scope.cancel()


async def test_two_members_reconcile_over_the_wire(broker_config: BrokerConfig) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await b.connect()
        await create(c, "t", 4)
        a = await c.call("consumer_group_heartbeat", 1, hb_body("g", "a", 0))
        owned_a = owned_of(a)
        bb = await c.call("consumer_group_heartbeat", 1, hb_body("g", "b", 0))
        assert bb.member_epoch == 2 and owned_of(bb) == []
        a2 = await c.call("consumer_group_heartbeat", 1, hb_body("g", "a", 1, owned=owned_a))
        assert (
            a2.member_epoch == 1 and sum(len(t["partitions"]) for t in owned_of(a2)) == 2
        )  # revoke two first
        a3 = await c.call("consumer_group_heartbeat", 1, hb_body("g", "a", 1, owned=owned_of(a2)))
        assert a3.member_epoch == 2
        b2 = await c.call("consumer_group_heartbeat", 1, hb_body("g", "b", 2, owned=[]))
        got_a = {p for t in owned_of(a2) for p in t["partitions"]}
        got_b = {p for t in owned_of(b2) for p in t["partitions"]}
        assert got_a | got_b == {0, 1, 2, 3} and not got_a & got_b
        nursery.cancel_scope.cancel()


async def test_a_classic_group_with_members_is_not_a_consumer_group(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "t")
    assert (await join(c, "classic")).error_code == 0
    r = await c.call("consumer_group_heartbeat", 1, hb_body("classic", "m", 0))
    assert r.error_code == codes.GROUP_ID_NOT_FOUND
    d = await c.call(
        "consumer_group_describe",
        0,
        {"group_ids": ["classic"], "include_authorized_operations": False},
    )
    assert d.groups[0].error_code == codes.GROUP_ID_NOT_FOUND


async def test_metadata_v12_describes_topics_by_id(broker: Broker) -> None:
    """KIP-848 clients (librdkafka) learn the names of their assigned topics by id."""
    c = await broker.connect()
    await create(c, "byid", 2)
    tid = await topic_id(c, "byid")
    body = {"allow_auto_topic_creation": False, "include_topic_authorized_operations": False}
    m = await c.call(
        "metadata",
        12,
        {
            **body,
            "topics": [{"name": None, "topic_id": tid}, {"name": None, "topic_id": uuid.uuid4()}],
        },
    )
    known, unknown = m.topics
    assert (known.error_code, known.name, len(known.partitions)) == (0, "byid", 2)
    assert unknown.error_code == 100 and unknown.name is None  # UNKNOWN_TOPIC_ID

"""Answers the differential oracle (compat_tests/test_oracle_diff.py) found different from
Apache Kafka 4.3's, pinned here without a JVM: authorized operations on an open node, the
order of OffsetCommit's checks, and what a member the leader left out receives."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from broker.tests.conftest import Broker
from broker.tests.test_server import create

pytestmark = pytest.mark.usefixtures("broker")

INT32_MIN = -(2**31)
# What Kafka 4.3 answers with no authorizer (the oracle's run): every operation it
# defines for topics, groups and the cluster.
KAFKA_OPEN_TOPIC_OPS, KAFKA_OPEN_GROUP_OPS, KAFKA_OPEN_CLUSTER_OPS = 3576, 3400, 8096


def metadata_body(names: list[str], ops: bool) -> dict[str, Any]:
    return {
        "topics": [{"name": n} for n in names],
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": ops,
        "include_cluster_authorized_operations": ops,
    }


async def test_authorized_operations_when_asked_on_an_open_node(broker: Broker) -> None:
    await create(broker, "ops")
    c = await broker.connect()
    r = await c.call("metadata", 9, metadata_body(["ops", "ops-missing"], True))
    assert [(t.name, t.topic_authorized_operations) for t in r.topics] == [
        ("ops", KAFKA_OPEN_TOPIC_OPS),
        ("ops-missing", KAFKA_OPEN_TOPIC_OPS),
    ]
    assert r.cluster_authorized_operations == KAFKA_OPEN_CLUSTER_OPS
    # Not asked: the schema's "not requested" value.
    r = await c.call("metadata", 9, metadata_body(["ops"], False))
    assert (r.topics[0].topic_authorized_operations, r.cluster_authorized_operations) == (
        INT32_MIN,
        INT32_MIN,
    )
    d = await c.call("describe_cluster", 0, {"include_cluster_authorized_operations": True})
    assert d.cluster_authorized_operations == KAFKA_OPEN_CLUSTER_OPS
    d = await c.call("describe_cluster", 0, {"include_cluster_authorized_operations": False})
    assert d.cluster_authorized_operations == INT32_MIN
    g = await c.call(
        "describe_groups", 5, {"groups": ["nobody-here"], "include_authorized_operations": True}
    )
    assert g.groups[0].authorized_operations == KAFKA_OPEN_GROUP_OPS


async def test_offset_commit_refuses_an_unknown_topic_before_asking_the_group(
    broker: Broker,
) -> None:
    """Kafka's KafkaApis answers UNKNOWN_TOPIC_OR_PARTITION for a topic it does not know
    before the coordinator sees the commit, so a commit the group refuses (here a member
    that does not exist) still says that of the unknown topic."""
    await create(broker, "oc")
    c = await broker.connect()
    body = {
        "group_id": "oc-group",
        "generation_id_or_member_epoch": 3,
        "member_id": "nobody",
        "group_instance_id": None,
        "retention_time": -1,
        "topics": [
            {
                "name": "oc",
                "partitions": [
                    {"partition_index": 0, "committed_offset": 1, "committed_metadata": None}
                ],
            },
            {
                "name": "oc-missing",
                "partitions": [
                    {"partition_index": 0, "committed_offset": 1, "committed_metadata": None}
                ],
            },
        ],
    }
    with trio.fail_after(10):
        for version in (2, 9):
            r = await c.call("offset_commit", version, body)
            got = {t.name: t.partitions[0].error_code for t in r.topics}
            assert got["oc-missing"] == 3, (version, got)  # UNKNOWN_TOPIC_OR_PARTITION
            assert got["oc"] != 0, (version, got)  # the group refuses this member


def subscription(topic: str) -> bytes:
    name = topic.encode()
    return (
        b"\x00\x00"
        + b"\x00\x00\x00\x01"
        + len(name).to_bytes(2, "big")
        + name
        + b"\xff\xff\xff\xff"
    )


async def test_a_member_the_leader_leaves_out_gets_empty_bytes_as_kafka(broker: Broker) -> None:
    """Kafka's GroupCoordinator fills a member missing from the leader's SyncGroup with an
    empty assignment; hyperkafka used to invent an encoded empty ConsumerProtocol one."""
    a, b = await broker.connect(), await broker.connect()

    def join(member: str) -> dict[str, Any]:
        return {"group_id": "left-out", "session_timeout": 10_000, "rebalance_timeout": 10_000, "member_id": member,
                "group_instance_id": None, "protocol_type": "consumer",
                "protocols": [{"name": "range", "metadata": subscription("t")}]}  # fmt: skip

    def sync(gen: int, member: str, given: dict[str, bytes]) -> dict[str, Any]:
        return {"group_id": "left-out", "generation_id": gen, "member_id": member, "group_instance_id": None,
                "protocol_type": "consumer", "protocol_name": "range",
                "assignments": [{"member_id": m, "assignment": x} for m, x in given.items()]}  # fmt: skip

    with trio.fail_after(20):
        ra = await a.call("join_group", 5, join(""))
        ra = await a.call("join_group", 5, join(ra.member_id))
        rb = await b.call("join_group", 5, join(""))
        pending = await b.send("join_group", 5, join(rb.member_id))
        hb = {
            "group_id": "left-out",
            "generation_id": ra.generation_id,
            "member_id": ra.member_id,
            "group_instance_id": None,
        }
        for _ in range(200):  # until the broker has read b's join: REBALANCE_IN_PROGRESS
            if (await a.call("heartbeat", 4, hb)).error_code == 27:
                break
            await trio.sleep(0.05)
        ra = await a.call("join_group", 5, join(ra.member_id))
        rb = await b.receive(pending)
        leader, follower = (a, b) if ra.leader == ra.member_id else (b, a)
        lm, fm = (ra.member_id, rb.member_id) if leader is a else (rb.member_id, ra.member_id)
        gen = ra.generation_id
        sl = await leader.call("sync_group", 5, sync(gen, lm, {lm: b"mine"}))
        sf = await follower.call("sync_group", 5, sync(gen, fm, {}))
        assert (sl.error_code, sl.assignment) == (0, b"mine")
        assert (sf.error_code, sf.assignment) == (0, b"")
        d = await a.call(
            "describe_groups", 5, {"groups": ["left-out"], "include_authorized_operations": False}
        )
        assert sorted(m.member_assignment for m in d.groups[0].members) == [b"", b"mine"]

"""Group and offset APIs end to end over a real socket, with raw protocol messages.

Pins what clients only show indirectly: which version carries which field, the exact
error codes, parked JoinGroup/SyncGroup answered in request order while the connection
keeps serving, and committed offsets and group generations surviving a restart.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig
from broker.groups import codes
from broker.server import run
from broker.tests.conftest import Broker, RawClient

pytestmark = pytest.mark.usefixtures("broker")


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update({"group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "100"})
    return config


def subscription(*topics: str) -> bytes:
    out = struct.pack(">hi", 0, len(topics))
    for t in topics:
        out += struct.pack(">h", len(t)) + t.encode()
    return out + struct.pack(">i", -1)


async def create(c: RawClient, name: str, partitions: int = 4) -> None:
    r = await c.call(
        "create_topics",
        7,
        {"topics": [{"name": name, "num_partitions": partitions, "replication_factor": 1, "assignments": [], "configs": []}], "timeout": 5000, "validate_only": False},
    )
    assert r.topics[0].error_code == 0


def join_body(group: str, member_id: str = "", *, session: int = 5000, instance: str | None = None, topics: tuple[str, ...] = ("t",)) -> dict[str, Any]:
    return {
        "group_id": group,
        "session_timeout": session,
        "rebalance_timeout": 5000,
        "member_id": member_id,
        "group_instance_id": instance,
        "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": subscription(*topics)}],
        "reason": None,
    }


async def join(c: RawClient, group: str, version: int = 9, **kw: Any) -> Any:
    """A full dynamic join: MEMBER_ID_REQUIRED first from v4, then the real one."""
    r = await c.call("join_group", version, join_body(group, **kw))
    if version >= 4 and kw.get("instance") is None and not kw.get("member_id"):
        assert r.error_code == codes.MEMBER_ID_REQUIRED and r.member_id
        r = await c.call("join_group", version, join_body(group, r.member_id, **{k: v for k, v in kw.items() if k != "member_id"}))
    return r


async def test_find_coordinator_all_versions(broker: Broker) -> None:
    c = await broker.connect()
    r0 = await c.call("find_coordinator", 0, {"key": "g"})
    assert (r0.error_code, r0.node_id, r0.port) == (0, 0, broker.port)
    r3 = await c.call("find_coordinator", 3, {"key": "g", "key_type": 0})
    assert (r3.error_code, r3.host, r3.port) == (0, "127.0.0.1", broker.port)
    r1 = await c.call("find_coordinator", 1, {"key": "txn", "key_type": 1})  # this node coordinates transactions too
    assert (r1.error_code, r1.node_id, r1.port) == (0, 0, broker.port)
    r4 = await c.call("find_coordinator", 4, {"key_type": 0, "coordinator_keys": ["a", "b"]})
    assert [(x.key, x.error_code, x.port) for x in r4.coordinators] == [("a", 0, broker.port), ("b", 0, broker.port)]
    r6 = await c.call("find_coordinator", 6, {"key_type": 1, "coordinator_keys": ["t1"]})
    assert (r6.coordinators[0].error_code, r6.coordinators[0].port) == (0, broker.port)


async def test_offsets_topic_is_listed_once_a_group_found_its_coordinator(broker: Broker) -> None:
    # Kafka creates __consumer_offsets on the first FindCoordinator for a group and then
    # lists it, marked internal, in all-topics Metadata (franz-go's regex consumer relies
    # on seeing it there to skip it).
    c = await broker.connect()
    await create(c, "visible", 1)
    all_topics = {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False}
    before = await c.call("metadata", 12, all_topics)
    assert [t.name for t in before.topics] == ["visible"]
    await c.call("find_coordinator", 1, {"key": "txn", "key_type": 1})
    assert [t.name for t in (await c.call("metadata", 12, all_topics)).topics] == ["visible"]
    await c.call("find_coordinator", 3, {"key": "g", "key_type": 0})
    after = await c.call("metadata", 12, all_topics)
    assert {(t.name, t.is_internal) for t in after.topics} == {("visible", False), ("__consumer_offsets", True)}


async def test_api_versions_advertise_the_group_apis(broker: Broker) -> None:
    c = await broker.connect()
    r = await c.call("api_versions", 3, {"client_software_name": "raw-test", "client_software_version": "1.0"})
    ranges = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
    expected = {8: (2, 9), 9: (1, 9), 10: (0, 6), 11: (0, 9), 12: (0, 4), 13: (0, 5), 14: (0, 5), 15: (0, 5), 16: (0, 5), 42: (0, 2), 47: (0, 0),
                68: (0, 1), 69: (0, 1)}  # KIP-848: broker.handlers.consumer_groups
    assert {k: ranges[k] for k in expected} == expected


async def test_two_members_join_sync_heartbeat_commit_fetch_leave(broker: Broker) -> None:
    admin = await broker.connect()
    await create(admin, "t")
    a, b = await broker.connect(), await broker.connect()
    with trio.fail_after(10):
        ra = await join(a, "g1")
        assert ra.error_code == 0 and ra.generation_id == 1 and ra.leader == ra.member_id
        assert (ra.protocol_type, ra.protocol_name) == ("consumer", "range")  # echoed from v7
        # b joins: a learns of the rebalance from its heartbeat, and both rejoin.
        first = await b.call("join_group", 9, join_body("g1"))
        assert first.error_code == codes.MEMBER_ID_REQUIRED
        sent_b = await b.send("join_group", 9, join_body("g1", first.member_id))
        hb = await a.call("heartbeat", 4, {"group_id": "g1", "generation_id": 1, "member_id": ra.member_id, "group_instance_id": None})
        assert hb.error_code == codes.REBALANCE_IN_PROGRESS
        ra2 = await a.call("join_group", 9, join_body("g1", ra.member_id))
        rb = await b.receive(sent_b)
        assert ra2.generation_id == rb.generation_id == 2
        leader, follower = (a, b) if ra2.leader == ra2.member_id else (b, a)
        lr, fr = (ra2, rb) if leader is a else (rb, ra2)
        assert len(lr.members) == 2 and fr.members == ()
        # The follower's SyncGroup waits for the leader's; its connection keeps serving.
        sent_f = await follower.send("sync_group", 5, {"group_id": "g1", "generation_id": 2, "member_id": fr.member_id, "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range", "assignments": []})
        sl = await leader.call("sync_group", 5, {"group_id": "g1", "generation_id": 2, "member_id": lr.member_id, "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range", "assignments": [{"member_id": lr.member_id, "assignment": b"leader-bytes"}]})
        sf = await follower.receive(sent_f)
        assert (sl.error_code, sl.assignment, sl.protocol_name) == (0, b"leader-bytes", "range")
        assert (sf.error_code, sf.assignment) == (0, b"")  # left out: empty, as Kafka
        for conn, member in ((a, ra2.member_id), (b, rb.member_id)):
            hb = await conn.call("heartbeat", 0, {"group_id": "g1", "generation_id": 2, "member_id": member})
            assert hb.error_code == 0
        bad = await a.call("heartbeat", 4, {"group_id": "g1", "generation_id": 1, "member_id": ra2.member_id, "group_instance_id": None})
        assert bad.error_code == codes.ILLEGAL_GENERATION
        unknown = await a.call("heartbeat", 4, {"group_id": "g1", "generation_id": 2, "member_id": "nobody", "group_instance_id": None})
        assert unknown.error_code == codes.UNKNOWN_MEMBER_ID

        commit = await a.call(
            "offset_commit",
            9,
            {"group_id": "g1", "generation_id_or_member_epoch": 2, "member_id": ra2.member_id, "group_instance_id": None,
             "topics": [{"name": "t", "partitions": [
                 {"partition_index": 0, "committed_offset": 42, "committed_leader_epoch": 0, "committed_metadata": "meta-0"},
                 {"partition_index": 9, "committed_offset": 1, "committed_leader_epoch": -1, "committed_metadata": None},
                 {"partition_index": 1, "committed_offset": 7, "committed_leader_epoch": -1, "committed_metadata": "x" * 5000},
             ]}]},
        )
        assert [(p.partition_index, p.error_code) for p in commit.topics[0].partitions] == [
            (0, 0), (9, codes.UNKNOWN_TOPIC_OR_PARTITION), (1, codes.OFFSET_METADATA_TOO_LARGE)
        ]
        stale = await b.call("offset_commit", 2, {"group_id": "g1", "generation_id_or_member_epoch": 1, "member_id": rb.member_id, "retention_time": -1,
                                                  "topics": [{"name": "t", "partitions": [{"partition_index": 0, "committed_offset": 1, "committed_metadata": ""}]}]})
        assert stale.topics[0].partitions[0].error_code == codes.ILLEGAL_GENERATION

        f1 = await admin.call("offset_fetch", 1, {"group_id": "g1", "topics": [{"name": "t", "partition_indexes": [0, 1]}]})
        assert [(p.partition_index, p.committed_offset, p.metadata) for p in f1.topics[0].partitions] == [(0, 42, "meta-0"), (1, -1, "")]
        f7 = await admin.call("offset_fetch", 7, {"group_id": "g1", "topics": None, "require_stable": True})
        assert [(t.name, [(p.partition_index, p.committed_offset, p.committed_leader_epoch) for p in t.partitions]) for t in f7.topics] == [("t", [(0, 42, 0)])]
        f8 = await admin.call("offset_fetch", 8, {"groups": [{"group_id": "g1", "topics": None}, {"group_id": "nope", "topics": [{"name": "t", "partition_indexes": [3]}]}], "require_stable": False})
        assert [g.group_id for g in f8.groups] == ["g1", "nope"]
        assert f8.groups[0].topics[0].partitions[0].committed_offset == 42
        assert f8.groups[1].topics[0].partitions[0].committed_offset == -1

        d = await admin.call("describe_groups", 5, {"groups": ["g1", "missing"], "include_authorized_operations": False})
        g1, missing = d.groups
        assert (g1.group_state, g1.protocol_type, g1.protocol_data) == ("Stable", "consumer", "range")
        assert sorted(m.member_assignment for m in g1.members) == sorted([b"leader-bytes", b""])
        assert (missing.error_code, missing.group_state) == (0, "Dead")
        lg = await admin.call("list_groups", 5, {"states_filter": [], "types_filter": []})
        assert ("g1", "consumer", "Stable", "classic") in [(g.group_id, g.protocol_type, g.group_state, g.group_type) for g in lg.groups]
        lg0 = await admin.call("list_groups", 0, {})
        assert "g1" in [g.group_id for g in lg0.groups]

        busy = await admin.call("delete_groups", 2, {"groups_names": ["g1", "never"]})
        assert [(r.group_id, r.error_code) for r in busy.results] == [("g1", codes.NON_EMPTY_GROUP), ("never", codes.GROUP_ID_NOT_FOUND)]
        od = await admin.call("offset_delete", 0, {"group_id": "g1", "topics": [{"name": "t", "partitions": [{"partition_index": 0}]}]})
        assert od.topics[0].partitions[0].error_code == codes.GROUP_SUBSCRIBED_TO_TOPIC

        # Batch leave (v3+): both at once, and a stranger.
        lv = await admin.call("leave_group", 5, {"group_id": "g1", "members": [
            {"member_id": ra2.member_id, "group_instance_id": None, "reason": "bye"},
            {"member_id": rb.member_id, "group_instance_id": None, "reason": None},
            {"member_id": "ghost", "group_instance_id": None, "reason": None},
        ]})
        assert [m.error_code for m in lv.members] == [0, 0, codes.UNKNOWN_MEMBER_ID]
        d = await admin.call("describe_groups", 0, {"groups": ["g1"]})
        assert d.groups[0].group_state == "Empty"
        od = await admin.call("offset_delete", 0, {"group_id": "g1", "topics": [{"name": "t", "partitions": [{"partition_index": 0}]}]})
        assert od.error_code == 0 and od.topics[0].partitions[0].error_code == 0
        gone = await admin.call("offset_fetch", 6, {"group_id": "g1", "topics": [{"name": "t", "partition_indexes": [0]}], })
        assert gone.topics[0].partitions[0].committed_offset == -1
        deleted = await admin.call("delete_groups", 0, {"groups_names": ["g1"]})
        assert deleted.results[0].error_code == 0
        d = await admin.call("describe_groups", 0, {"groups": ["g1"]})
        assert d.groups[0].group_state == "Dead"


async def test_old_versions_join_without_member_id_required_and_single_leave(broker: Broker) -> None:
    c = await broker.connect()
    with trio.fail_after(10):
        r = await c.call("join_group", 0, {"group_id": "old", "session_timeout": 5000, "member_id": "", "protocol_type": "consumer",
                                           "protocols": [{"name": "range", "metadata": subscription("t")}]})
        assert r.error_code == 0 and r.generation_id == 1 and r.protocol_name == "range"
        s = await c.call("sync_group", 0, {"group_id": "old", "generation_id": 1, "member_id": r.member_id, "assignments": []})
        assert s.error_code == 0 and s.assignment == b""
        lv = await c.call("leave_group", 0, {"group_id": "old", "member_id": r.member_id})
        assert lv.error_code == 0
        lv = await c.call("leave_group", 1, {"group_id": "old", "member_id": r.member_id})
        assert lv.error_code == codes.UNKNOWN_MEMBER_ID


async def test_join_error_answers_per_version(broker: Broker) -> None:
    c = await broker.connect()
    bad = await c.call("join_group", 2, {"group_id": "x", "session_timeout": 10, "rebalance_timeout": 100, "member_id": "", "protocol_type": "consumer",
                                         "protocols": [{"name": "range", "metadata": b""}]})
    assert bad.error_code == codes.INVALID_SESSION_TIMEOUT and bad.protocol_name == ""
    bad = await c.call("join_group", 9, join_body("", ""))
    assert bad.error_code == codes.INVALID_GROUP_ID and bad.protocol_name is None
    bad = await c.call("join_group", 5, join_body("x", "stranger"))
    assert bad.error_code == codes.UNKNOWN_MEMBER_ID


async def test_dead_member_is_evicted_within_its_session_timeout(broker: Broker) -> None:
    admin = await broker.connect()
    await create(admin, "ev")
    a, b = await broker.connect(), await broker.connect()
    with trio.fail_after(15):
        ra = await join(a, "gev", session=800)
        sb = await b.send("join_group", 9, join_body("gev", (await b.call("join_group", 9, join_body("gev", session=800))).member_id, session=800))
        ra2 = await a.call("join_group", 9, join_body("gev", ra.member_id, session=800))
        rb = await b.receive(sb)
        assert ra2.generation_id == rb.generation_id == 2
        sent = {}
        for conn, r in ((a, ra2), (b, rb)):
            assignments = [{"member_id": ra2.member_id, "assignment": b"A"}, {"member_id": rb.member_id, "assignment": b"B"}] if r.leader == r.member_id else []
            sent[r.member_id] = await conn.send("sync_group", 3, {"group_id": "gev", "generation_id": 2, "member_id": r.member_id, "group_instance_id": None, "assignments": assignments})
        for conn, r in ((a, ra2), (b, rb)):
            assert (await conn.receive(sent[r.member_id])).error_code == 0
        # b dies silently; a heartbeats until told to rejoin.
        start = trio.current_time()
        while True:
            hb = await a.call("heartbeat", 4, {"group_id": "gev", "generation_id": 2, "member_id": ra2.member_id, "group_instance_id": None})
            if hb.error_code == codes.REBALANCE_IN_PROGRESS:
                break
            assert hb.error_code == 0
            await trio.sleep(0.1)
        waited = trio.current_time() - start
        assert 0.6 < waited < 1.6, waited
        r3 = await a.call("join_group", 9, join_body("gev", ra2.member_id, session=800))
        assert r3.generation_id == 3 and [m.member_id for m in r3.members] == [ra2.member_id]
        gone = await b.call("heartbeat", 4, {"group_id": "gev", "generation_id": 2, "member_id": rb.member_id, "group_instance_id": None})
        assert gone.error_code == codes.UNKNOWN_MEMBER_ID


async def test_static_member_rejoins_without_rebalance(broker: Broker) -> None:
    c = await broker.connect()
    with trio.fail_after(10):
        r = await c.call("join_group", 9, join_body("gs", instance="inst-1"))
        assert r.error_code == 0 and r.member_id.startswith("inst-1-")
        s = await c.call("sync_group", 5, {"group_id": "gs", "generation_id": 1, "member_id": r.member_id, "group_instance_id": "inst-1", "protocol_type": "consumer", "protocol_name": "range",
                                           "assignments": [{"member_id": r.member_id, "assignment": b"mine"}]})
        assert s.assignment == b"mine"
        again = await c.call("join_group", 9, join_body("gs", instance="inst-1"))
        assert again.error_code == 0 and again.generation_id == 1 and again.member_id != r.member_id
        assert again.skip_assignment and again.leader == again.member_id  # v9: leader, but skip the assignor
        fenced = await c.call("heartbeat", 4, {"group_id": "gs", "generation_id": 1, "member_id": r.member_id, "group_instance_id": "inst-1"})
        assert fenced.error_code == codes.FENCED_INSTANCE_ID
        s2 = await c.call("sync_group", 5, {"group_id": "gs", "generation_id": 1, "member_id": again.member_id, "group_instance_id": "inst-1", "protocol_type": "consumer", "protocol_name": "range", "assignments": []})
        assert s2.assignment == b"mine"
        lv = await c.call("leave_group", 4, {"group_id": "gs", "members": [{"member_id": "", "group_instance_id": "inst-1"}]})
        assert lv.members[0].error_code == 0


async def test_internal_topic_is_hidden_unless_named(broker: Broker) -> None:
    c = await broker.connect()
    everything = await c.call("metadata", 12, {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    assert "__consumer_offsets" not in [t.name for t in everything.topics]
    named = await c.call("metadata", 12, {"topics": [{"name": "__consumer_offsets", "topic_id": None}], "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    assert named.topics[0].error_code == 0 and named.topics[0].is_internal


async def test_commits_and_generation_survive_a_restart(broker_config: BrokerConfig) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        first = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await first.connect()
        await create(c, "rt")
        r = await join(c, "gr")
        s = await c.call("sync_group", 5, {"group_id": "gr", "generation_id": 1, "member_id": r.member_id, "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range",
                                           "assignments": [{"member_id": r.member_id, "assignment": b"asg"}]})
        assert s.error_code == 0
        commit = await c.call("offset_commit", 8, {"group_id": "gr", "generation_id_or_member_epoch": 1, "member_id": r.member_id, "group_instance_id": None,
                                                    "topics": [{"name": "rt", "partitions": [{"partition_index": p, "committed_offset": 10 + p, "committed_leader_epoch": -1, "committed_metadata": f"m{p}"} for p in range(4)]}]})
        assert all(p.error_code == 0 for p in commit.topics[0].partitions)
        simple = await c.call("offset_commit", 2, {"group_id": "simple", "generation_id_or_member_epoch": -1, "member_id": "", "retention_time": -1,
                                                    "topics": [{"name": "rt", "partitions": [{"partition_index": 1, "committed_offset": 5, "committed_metadata": ""}]}]})
        assert simple.topics[0].partitions[0].error_code == 0
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    broker_config.advertised_port = None
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        second = Broker(broker_config, listeners[0].socket.getsockname()[1])
        c = await second.connect()
        f = await c.call("offset_fetch", 5, {"group_id": "gr", "topics": None})
        assert [(p.partition_index, p.committed_offset, p.metadata) for p in f.topics[0].partitions] == [(p, 10 + p, f"m{p}") for p in range(4)]
        f = await c.call("offset_fetch", 8, {"groups": [{"group_id": "simple", "topics": None}], "require_stable": False})
        assert f.groups[0].topics[0].partitions[0].committed_offset == 5
        # The member kept its place: same generation, heartbeats go on, no rebalance.
        hb = await c.call("heartbeat", 4, {"group_id": "gr", "generation_id": 1, "member_id": r.member_id, "group_instance_id": None})
        assert hb.error_code == 0
        again = await c.call("sync_group", 5, {"group_id": "gr", "generation_id": 1, "member_id": r.member_id, "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range", "assignments": []})
        assert again.assignment == b"asg"
        d = await c.call("describe_groups", 5, {"groups": ["gr"], "include_authorized_operations": True})
        assert d.groups[0].group_state == "Stable" and d.groups[0].authorized_operations > 0
        nursery.cancel_scope.cancel()


async def test_v9_commit_to_an_unknown_group_and_fetch_with_member_fields(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "v9")
    body = {"group_id": "nobody", "generation_id_or_member_epoch": 3, "member_id": "m", "group_instance_id": None,
            "topics": [{"name": "v9", "partitions": [{"partition_index": 0, "committed_offset": 1, "committed_leader_epoch": -1, "committed_metadata": ""}]}]}
    assert (await c.call("offset_commit", 9, body)).topics[0].partitions[0].error_code == codes.GROUP_ID_NOT_FOUND
    assert (await c.call("offset_commit", 8, body)).topics[0].partitions[0].error_code == codes.ILLEGAL_GENERATION
    simple = dict(body, group_id="classic", generation_id_or_member_epoch=-1, member_id="")
    assert (await c.call("offset_commit", 9, simple)).topics[0].partitions[0].error_code == codes.NONE
    # KIP-848 member fields are for consumer-protocol groups; a classic group ignores them.
    f = await c.call("offset_fetch", 9, {"groups": [{"group_id": "classic", "member_id": "someone", "member_epoch": 42, "topics": None}], "require_stable": False})
    assert f.groups[0].error_code == 0 and f.groups[0].topics[0].partitions[0].committed_offset == 1
    f = await c.call("offset_fetch", 9, {"groups": [{"group_id": "nobody", "member_id": None, "member_epoch": -1, "topics": [{"name": "v9", "partition_indexes": [0]}]}], "require_stable": False})
    assert f.groups[0].error_code == 0 and f.groups[0].topics[0].partitions[0].committed_offset == -1


async def test_retention_time_of_old_commits_and_offset_delete_leave_tombstones(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update({"offsets.retention.check.interval.ms": "20"})
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, config)
        c = await Broker(config, listeners[0].socket.getsockname()[1]).connect()
        await create(c, "rt2")

        def commit_body(group: str, retention_ms: int) -> dict[str, Any]:
            return {"group_id": group, "generation_id_or_member_epoch": -1, "member_id": "", "retention_time": retention_ms,
                    "topics": [{"name": "rt2", "partitions": [{"partition_index": p, "committed_offset": 40 + p, "committed_metadata": ""} for p in range(2)]}]}

        # v2-v4 may give a commit its own retention (KIP-211 keeps that): gone after it.
        assert (await c.call("offset_commit", 2, commit_body("short", 150))).topics[0].partitions[0].error_code == 0
        assert (await c.call("offset_commit", 2, commit_body("kept", -1))).topics[0].partitions[0].error_code == 0
        od = await c.call("offset_delete", 0, {"group_id": "kept", "topics": [{"name": "rt2", "partitions": [{"partition_index": 1}]}]})
        assert od.error_code == 0 and od.topics[0].partitions[0].error_code == 0
        with trio.fail_after(10):
            while True:
                f = await c.call("offset_fetch", 5, {"group_id": "short", "topics": None})
                if not f.topics:
                    break
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, config)
        c = await Broker(config, listeners[0].socket.getsockname()[1]).connect()
        assert not (await c.call("offset_fetch", 5, {"group_id": "short", "topics": None})).topics
        kept = await c.call("offset_fetch", 5, {"group_id": "kept", "topics": None})
        assert [(p.partition_index, p.committed_offset) for p in kept.topics[0].partitions] == [(0, 40)]
        nursery.cancel_scope.cancel()

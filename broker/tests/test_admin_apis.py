"""The admin APIs tools and UIs call, over a real socket: AlterConfigs and
IncrementalAlterConfigs, CreatePartitions, DeleteRecords, DescribeLogDirs,
DescribeProducers, ListPartitionReassignments and the ACL APIs; every change that
persists is checked again after a restart of the broker on the same data dir."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig
from broker.server import run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_security_server import Secured, authenticate
from broker.tests.test_security_server import secured as secured  # the fixture
from broker.tests.test_server import batch, create, fetch, produce
from storage.batch import build_batch

Start = Callable[[], AbstractAsyncContextManager[Broker]]


@pytest.fixture
def start(tmp_path: Path) -> Start:
    @asynccontextmanager
    async def started() -> AsyncIterator[Broker]:
        config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(run, config)
            yield Broker(config, listeners[0].socket.getsockname()[1])
            nursery.cancel_scope.cancel()

    return started


async def describe_topic_configs(c: RawClient, name: str) -> dict[str, tuple[str, int]]:
    r = await c.call(
        "describe_configs",
        4,
        {
            "resources": [{"resource_type": 2, "resource_name": name, "configuration_keys": None}],
            "include_synonyms": False,
            "include_documentation": False,
        },
    )
    assert r.results[0].error_code == 0, r
    return {e.name: (e.value, e.config_source) for e in r.results[0].configs}


async def incremental(
    c: RawClient, name: str, ops: list[tuple[str, int, str | None]], *, resource_type: int = 2
) -> Any:
    r = await c.call(
        "incremental_alter_configs",
        1,
        {
            "resources": [
                {
                    "resource_type": resource_type,
                    "resource_name": name,
                    "configs": [
                        {"name": n, "config_operation": op, "value": v} for n, op, v in ops
                    ],
                }
            ],
            "validate_only": False,
        },
    )
    return r.responses[0]


async def alter_configs(c: RawClient, name: str, configs: dict[str, str]) -> int:
    """AlterConfigs v2 (the whole set of overrides) of topic `name`: its error code."""
    r = await c.call(
        "alter_configs",
        2,
        {
            "resources": [
                {
                    "resource_type": 2,
                    "resource_name": name,
                    "configs": [{"name": k, "value": v} for k, v in configs.items()],
                }
            ],
            "validate_only": False,
        },
    )
    return int(r.responses[0].error_code)


async def test_alter_configs_persist_and_take_effect(start: Start) -> None:
    async with start() as broker:
        await create(broker, "cfg")
        c = await broker.connect()
        r = await incremental(
            c, "cfg", [("retention.ms", 0, "1234"), ("max.message.bytes", 0, "200")]
        )
        assert r.error_code == 0, r
        configs = await describe_topic_configs(c, "cfg")
        assert configs["retention.ms"] == ("1234", 1)  # DYNAMIC_TOPIC_CONFIG
        # in effect at once: a batch above the new max.message.bytes is refused
        assert (await produce(c, "cfg", batch([b"x" * 300]))).error_code == 10
        # refused configs are named, and nothing of the resource changes
        r = await incremental(
            c, "cfg", [("retention.ms", 0, "99"), ("cleanup.policy", 0, "compact,shred")]
        )
        assert r.error_code == 40 and "cleanup.policy" in r.error_message
        r = await incremental(c, "cfg", [("no.such.config", 0, "1")])
        assert r.error_code == 40 and "no.such.config" in r.error_message
        assert (await describe_topic_configs(c, "cfg"))["retention.ms"] == ("1234", 1)
        r = await incremental(
            c, "cfg", [("max.message.bytes", 1, None)]
        )  # DELETE: back to the default
        assert r.error_code == 0
        assert (
            await incremental(c, "", [("log.retention.ms", 0, "1")], resource_type=4)
        ).error_code == 42
        assert (await incremental(c, "nope", [("retention.ms", 0, "1")])).error_code == 3
    async with start() as broker:
        c = await broker.connect()
        configs = await describe_topic_configs(c, "cfg")
        assert configs["retention.ms"] == ("1234", 1)
        assert configs["max.message.bytes"][1] == 5  # DEFAULT_CONFIG again
        # AlterConfigs (not incremental) replaces the whole set of overrides
        assert await alter_configs(c, "cfg", {"segment.bytes": "1048576"}) == 0
        configs = await describe_topic_configs(c, "cfg")
        assert configs["segment.bytes"] == ("1048576", 1) and configs["retention.ms"][1] == 5


async def test_create_partitions_persists(start: Start) -> None:
    async with start() as broker:
        await create(broker, "grow", partitions=1)
        c = await broker.connect()

        async def grow(count: int, validate_only: bool = False) -> Any:
            r = await c.call(
                "create_partitions",
                3,
                {
                    "topics": [{"name": "grow", "count": count, "assignments": None}],
                    "timeout": 5000,
                    "validate_only": validate_only,
                },
            )
            return r.results[0]

        assert (await grow(3, validate_only=True)).error_code == 0
        assert (await grow(3)).error_code == 0
        r = await grow(2)
        assert r.error_code == 37 and "higher than the requested 2" in r.error_message
        assert (await produce(c, "grow", batch([b"p2"]), partition=2)).error_code == 0
    async with start() as broker:
        c = await broker.connect()
        md = await c.call(
            "metadata",
            12,
            {
                "topics": [{"name": "grow", "topic_id": None}],
                "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False,
            },
        )
        assert len(md.topics[0].partitions) == 3
        r = await c.call(
            "list_offsets",
            7,
            {
                "replica_id": -1,
                "isolation_level": 0,
                "topics": [
                    {"name": "grow", "partitions": [{"partition_index": 2, "timestamp": -1}]}
                ],
            },
        )
        assert r.topics[0].partitions[0].offset == 1


async def list_offset(c: RawClient, name: str, ts: int) -> int:
    r = await c.call(
        "list_offsets",
        7,
        {
            "replica_id": -1,
            "isolation_level": 0,
            "topics": [{"name": name, "partitions": [{"partition_index": 0, "timestamp": ts}]}],
        },
    )
    return int(r.topics[0].partitions[0].offset)


async def delete_records(c: RawClient, name: str, offset: int) -> Any:
    r = await c.call(
        "delete_records",
        2,
        {
            "topics": [{"name": name, "partitions": [{"partition_index": 0, "offset": offset}]}],
            "timeout": 5000,
        },
    )
    return r.topics[0].partitions[0]


async def test_delete_records_moves_the_log_start_and_persists(start: Start) -> None:
    async with start() as broker:
        await create(broker, "dr", configs={"segment.bytes": "200"})  # a segment per batch or two
        c = await broker.connect()
        for i in range(6):
            assert (
                await produce(c, "dr", bytes(build_batch([b"v%d" % i, b"w%d" % i])))
            ).error_code == 0
        assert await list_offset(c, "dr", -1) == 12
        r = await delete_records(c, "dr", 5)  # inside a batch and a segment
        assert (r.error_code, r.low_watermark) == (0, 5)
        assert await list_offset(c, "dr", -2) == 5
        assert (await fetch(c, "dr", 3)).error_code == 1  # OFFSET_OUT_OF_RANGE below the start
        got = await fetch(c, "dr", 5)
        assert got.error_code == 0 and got.log_start_offset == 5
        assert (await delete_records(c, "dr", 13)).error_code == 1  # above the high watermark
        r = await delete_records(c, "dr", 2)  # below the start: nothing moves back
        assert (r.error_code, r.low_watermark) == (0, 5)
    async with start() as broker:
        c = await broker.connect()
        assert await list_offset(c, "dr", -2) == 5
        r = await delete_records(c, "dr", -1)  # -1: up to the high watermark
        assert (r.error_code, r.low_watermark) == (0, 12)
        assert (await produce(c, "dr", batch([b"after"]))).error_code == 0
        assert (await fetch(c, "dr", 12)).error_code == 0
    async with start() as broker:
        c = await broker.connect()
        assert await list_offset(c, "dr", -2) == 12
        assert await list_offset(c, "dr", -1) == 13


async def test_describe_log_dirs_producers_and_reassignments(start: Start) -> None:
    async with start() as broker:
        await create(broker, "ld", partitions=2)
        c = await broker.connect()
        data = batch([b"a"], producer_id=7, producer_epoch=0, base_sequence=0)
        assert (await produce(c, "ld", data)).error_code == 0
        r = await c.call("describe_log_dirs", 4, {"topics": None})
        assert r.error_code == 0 and r.results[0].error_code == 0
        sizes = {
            (t.name, p.partition_index): p.partition_size
            for t in r.results[0].topics
            for p in t.partitions
        }
        assert sizes[("ld", 0)] == len(data) and sizes[("ld", 1)] == 0
        assert r.results[0].total_bytes > 0
        r1 = await c.call("describe_log_dirs", 1, {"topics": [{"topic": "ld", "partitions": [1]}]})
        assert [
            (t.name, [p.partition_index for p in t.partitions]) for t in r1.results[0].topics
        ] == [("ld", [1])]
        r = await c.call(
            "describe_producers", 0, {"topics": [{"name": "ld", "partition_indexes": [0, 9]}]}
        )
        p0, p9 = r.topics[0].partitions
        assert p0.error_code == 0 and [
            (s.producer_id, s.last_sequence) for s in p0.active_producers
        ] == [(7, 0)]
        assert p9.error_code == 3
        r = await c.call("list_partition_reassignments", 0, {"timeout": 5000, "topics": None})
        assert r.error_code == 0 and r.topics == ()


async def test_acls_without_security(start: Start) -> None:
    async with start() as broker:
        c = await broker.connect()
        f = {
            "resource_type_filter": 1,
            "resource_name_filter": None,
            "pattern_type_filter": 1,
            "principal_filter": None,
            "host_filter": None,
            "operation": 1,
            "permission_type": 1,
        }
        assert (await c.call("describe_acls", 3, f)).error_code == 54  # SECURITY_DISABLED
        r = await c.call(
            "create_acls",
            3,
            {
                "creations": [
                    {
                        "resource_type": 2,
                        "resource_name": "t",
                        "resource_pattern_type": 3,
                        "principal": "User:a",
                        "host": "*",
                        "operation": 3,
                        "permission_type": 3,
                    }
                ]
            },
        )
        assert r.results[0].error_code == 54
        r = await c.call("delete_acls", 3, {"filters": [f]})
        assert r.filter_results[0].error_code == 54


@pytest.mark.parametrize("secured", [{"super.users": "User:writer"}], indirect=True)
async def test_describe_acls_shows_the_static_rules(secured: Secured) -> None:
    anonymous = await secured.connect("PLAINTEXT")
    c = await secured.connect("SASL_PLAINTEXT")
    assert (await authenticate(c, "SCRAM-SHA-256", "writer", "w-pw")).error_code == 0  # type: ignore[attr-defined]
    f = {
        "resource_type_filter": 1,
        "resource_name_filter": None,
        "pattern_type_filter": 1,
        "principal_filter": None,
        "host_filter": None,
        "operation": 1,
        "permission_type": 1,
    }
    assert (
        await anonymous.call("describe_acls", 3, f)
    ).error_code == 31  # only super.users see the rules
    r = await c.call("describe_acls", 3, f)
    assert r.error_code == 0
    got = {
        (
            res.resource_type,
            res.resource_name,
            res.pattern_type,
            a.principal,
            a.operation,
            a.permission_type,
        )
        for res in r.resources
        for a in res.acls
    }
    # topic.*.write+create = User:writer; topic.private-*.read = User:writer
    assert got == {
        (2, "*", 3, "User:writer", 4, 3),
        (2, "*", 3, "User:writer", 5, 3),
        (2, "private-", 4, "User:writer", 3, 3),
    }
    r = await c.call(
        "describe_acls",
        3,
        {**f, "resource_name_filter": "private-x", "pattern_type_filter": 2, "operation": 3},
    )
    assert [(res.resource_name, res.pattern_type) for res in r.resources] == [("private-", 4)]
    r = await c.call(
        "create_acls",
        3,
        {
            "creations": [
                {
                    "resource_type": 2,
                    "resource_name": "t",
                    "resource_pattern_type": 3,
                    "principal": "User:a",
                    "host": "*",
                    "operation": 3,
                    "permission_type": 3,
                }
            ]
        },
    )
    assert r.results[0].error_code == 31 and "hyperkafka.acl" in r.results[0].error_message


async def test_configs_are_validated_before_the_topic_is_looked_up(start: Start) -> None:
    """As Kafka's controller (the differential oracle's admin-alter-configs-v2-refused): a
    bad config on a missing topic is INVALID_CONFIG, a good one UNKNOWN_TOPIC_OR_PARTITION."""
    async with start() as broker:
        c = await broker.connect()
        assert await alter_configs(c, "nope", {"retention.ms": "abc"}) == 40
        assert await alter_configs(c, "nope", {"retention.ms": "1000"}) == 3
        assert (await incremental(c, "nope", [("retention.ms", 0, "abc")])).error_code == 40
        assert (await incremental(c, "nope", [("no.such.config", 0, "1")])).error_code == 40
        assert (await incremental(c, "nope", [("retention.ms", 0, "1000")])).error_code == 3


async def test_create_partitions_answers_a_duplicate_topic_once_and_first(start: Start) -> None:
    """As Kafka's ControllerApis (the oracle's admin-create-partitions-v2-fewer-and-duplicate)."""
    async with start() as broker:
        await create(broker, "one", partitions=1)
        await create(broker, "dup", partitions=1)
        c = await broker.connect()
        topics = [
            {"name": n, "count": k, "assignments": None}
            for n, k in (("one", 2), ("dup", 3), ("dup", 4))
        ]
        r = await c.call(
            "create_partitions", 3, {"topics": topics, "timeout": 5000, "validate_only": False}
        )
        assert [(x.name, x.error_code) for x in r.results] == [("dup", 42), ("one", 0)]
        md = await c.call(
            "metadata",
            12,
            {
                "topics": [{"name": "dup", "topic_id": None}],
                "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False,
            },
        )
        assert len(md.topics[0].partitions) == 1  # the duplicate was not grown


async def test_list_offsets_by_time_skips_what_delete_records_removed(start: Start) -> None:
    """As Kafka (the oracle's admin-delete-records-list-offsets-by-time-deleted): the first
    record at or after the time *and* the log start, not a storage error on the batch
    DeleteRecords cut through or wholly removed."""
    async with start() as broker:
        await create(broker, "drt")
        c = await broker.connect()
        for base in (1000, 2000, 3000):  # offsets 0-1, 2-3, 4-5
            b = bytes(build_batch([b"a", b"b"], timestamps=[base, base + 10]))
            assert (await produce(c, "drt", b)).error_code == 0
        assert (await delete_records(c, "drt", 3)).low_watermark == 3
        assert await list_offset(c, "drt", 0) == 3  # 0-1 gone, 2 below the start
        assert await list_offset(c, "drt", 2000) == 3
        assert await list_offset(c, "drt", 3005) == 5
        assert await list_offset(c, "drt", -3) == 5
        assert (await delete_records(c, "drt", 5)).low_watermark == 5
        assert await list_offset(c, "drt", 0) == 5
        assert await list_offset(c, "drt", -3) == 5

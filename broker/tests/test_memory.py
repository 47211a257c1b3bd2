"""Memory budgets against a broker served in-process: Fetch limits, duplicate partitions,
the request memory pool, and connections that pipeline without reading."""

from __future__ import annotations

from typing import Any

import pytest

from broker.tests.conftest import Broker
from broker.tests.test_server import batch, create, fetch_body, produce

pytestmark = pytest.mark.usefixtures("broker")


def fetch_of(
    partitions: list[tuple[str, int, int, int]], max_bytes: int = 100 << 20
) -> dict[str, Any]:
    """A Fetch v12 body naming (topic, partition, offset, partition_max_bytes) in order, one
    topic entry per item (so a partition may be named many times)."""
    body = fetch_body("unused", 0, max_bytes=max_bytes)
    body["topics"] = [
        {
            "topic": t,
            "partitions": [
                {
                    "partition": p,
                    "fetch_offset": o,
                    "partition_max_bytes": m,
                    "log_start_offset": -1,
                }
            ],
        }
        for t, p, o, m in partitions
    ]
    return body


async def test_a_partition_named_many_times_is_served_once(broker: Broker) -> None:
    await create(broker, "dup", partitions=2)
    c = await broker.connect()
    data = batch([b"v" * 1000])
    for part in (0, 1):
        await produce(c, "dup", data, partition=part)
        await produce(c, "dup", data, partition=part)
    # Partition 0 named 2,000 times (offset 0), then partition 1, then 0 once more at
    # offset 1: as Kafka's LinkedHashMap, the last entry wins at the first one's place.
    named = [("dup", 0, 0, 1 << 20)] * 2000 + [("dup", 1, 0, 1 << 20), ("dup", 0, 1, 1 << 20)]
    r = await c.call("fetch", 12, fetch_of(named))
    assert r.error_code == 0
    got = [
        (t.topic, p.partition_index, len(p.records or b""))
        for t in r.responses
        for p in t.partitions
    ]
    assert got == [("dup", 0, len(data)), ("dup", 1, 2 * len(data))]


async def test_duplicates_across_topics_keep_kafkas_grouping(broker: Broker) -> None:
    await create(broker, "ga")
    await create(broker, "gb")
    c = await broker.connect()
    named = [("ga", 0, 0, 1000), ("gb", 0, 0, 1000), ("ga", 0, 0, 1000), ("ga", 5, 0, 1000)]
    r = await c.call("fetch", 12, fetch_of(named))
    got = [
        (t.topic, [(p.partition_index, p.error_code) for p in t.partitions]) for t in r.responses
    ]
    # ga-0 keeps its first place; ga-5 (unknown partition) follows gb in a topic entry of its own.
    assert got == [("ga", [(0, 0)]), ("gb", [(0, 0)]), ("ga", [(5, 3)])]


async def test_broker_fetch_max_bytes_caps_what_the_client_asks(broker: Broker) -> None:
    broker.config.fetch_max_bytes = 12_000
    await create(broker, "cap", partitions=4)
    c = await broker.connect()
    data = batch([b"c" * 5000])
    for part in range(4):
        for _ in range(3):
            await produce(c, "cap", data, partition=part)
    named = [("cap", p, 0, 100 << 20) for p in range(4)]
    r = await c.call("fetch", 12, fetch_of(named, max_bytes=100 << 20))
    sizes = [len(p.records or b"") for t in r.responses for p in t.partitions]
    assert sum(sizes) <= 12_000
    assert sizes == [2 * len(data), 0, 0, 0]  # whole batches only; the third does not fit
    # The first partition with data still gets one whole batch above the cap (KIP-74).
    broker.config.fetch_max_bytes = 1024
    r = await c.call("fetch", 12, fetch_of(named, max_bytes=100 << 20))
    sizes = [len(p.records or b"") for t in r.responses for p in t.partitions]
    assert sizes == [len(data), 0, 0, 0]


async def test_partition_max_bytes_holds_after_the_first_partition(broker: Broker) -> None:
    await create(broker, "pmax", partitions=3)
    c = await broker.connect()
    big, small = batch([b"b" * 5000]), batch([b"s" * 100])
    await produce(c, "pmax", big, partition=0)
    await produce(c, "pmax", big, partition=1)
    await produce(c, "pmax", small, partition=2)
    named = [("pmax", p, 0, 1000) for p in range(3)]
    r = await c.call("fetch", 12, fetch_of(named))
    sizes = [len(p.records or b"") for t in r.responses for p in t.partitions]
    # First partition: one batch above its limit (KIP-74); second: its batch is above its
    # partition_max_bytes, so nothing; third fits.
    assert sizes == [len(big), 0, len(small)]


async def test_metadata_describes_a_topic_named_many_times_once(broker: Broker) -> None:
    await create(broker, "meta-dup", partitions=50)
    c = await broker.connect()
    r = await c.call(
        "metadata",
        12,
        {
            "topics": [{"name": "meta-dup", "topic_id": None}] * 5000,
            "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False,
        },
    )
    assert [(t.name, len(t.partitions)) for t in r.topics] == [("meta-dup", 50)]


async def test_list_offsets_refuses_a_partition_named_twice_as_kafka(broker: Broker) -> None:
    await create(broker, "lo-dup", partitions=2)
    c = await broker.connect()
    await produce(c, "lo-dup", batch([b"x"]))
    part = {"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}
    other = {"partition_index": 1, "current_leader_epoch": -1, "timestamp": -1}
    r = await c.call(
        "list_offsets",
        7,
        {
            "replica_id": -1,
            "isolation_level": 0,
            "topics": [{"name": "lo-dup", "partitions": [part, other, part]}],
        },
    )
    got = [(p.partition_index, p.error_code, p.offset) for p in r.topics[0].partitions]
    # One INVALID_REQUEST for the partition, as Kafka answers from a map keyed by partition
    # (the differential oracle's list-offsets-duplicate-partition step).
    assert got == [(0, 42, -1), (1, 0, 0)]


async def test_describe_configs_describes_a_resource_once(broker: Broker) -> None:
    await create(broker, "dc-dup")
    c = await broker.connect()
    res = {"resource_type": 2, "resource_name": "dc-dup", "configuration_keys": None}
    r = await c.call(
        "describe_configs",
        4,
        {"resources": [res] * 1000, "include_synonyms": True, "include_documentation": True},
    )
    assert r.results[0].error_code == 0 and len(r.results[0].configs) > 10
    assert all(x.error_code == 42 and not x.configs for x in r.results[1:])

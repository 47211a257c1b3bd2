"""Topic administration raced against itself and against the data path, over real sockets.

Deleting a topic yields (it waits for each partition's commit round), so requests on other
connections run in the middle of it: a create of the same name, a second delete, a
produce that auto-creates it, a fetch, an offset commit. Each must get a Kafka error
code in its answer, never an internal error that closes its connection.
"""

from __future__ import annotations

import random

import trio

from broker.tests.conftest import Broker, RawClient
from broker.tests.test_server import batch, fetch_body

NAME = "race"
PARTITIONS = 3


def _create_body(name: str) -> dict[str, object]:
    return {
        "topics": [
            {
                "name": name,
                "num_partitions": PARTITIONS,
                "replication_factor": 1,
                "assignments": [],
                "configs": [],
            }
        ],
        "timeout": 5000,
        "validate_only": False,
    }


async def _create(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call("create_topics", 7, _create_body(NAME))
    codes.append(("create", r.topics[0].error_code))


async def _delete(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "delete_topics", 6, {"topics": [{"name": NAME, "topic_id": None}], "timeout": 5000}
    )
    codes.append(("delete", r.responses[0].error_code))


async def _produce(c: RawClient, codes: list[tuple[str, int]]) -> None:
    body = {
        "acks": -1,
        "timeout": 5000,
        "topic_data": [
            {
                "name": NAME,
                "partition_data": [
                    {"index": i, "records": batch([b"x"])} for i in range(PARTITIONS)
                ],
            }
        ],
    }
    r = await c.call("produce", 9, body)
    for p in r.responses[0].partition_responses:
        codes.append(("produce", p.error_code))


async def _fetch(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call("fetch", 12, fetch_body(NAME, 0, max_wait=50))
    codes.append(("fetch", r.responses[0].partitions[0].error_code))


async def _metadata(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "metadata",
        9,
        {
            "topics": [{"name": NAME}],
            "allow_auto_topic_creation": True,
            "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False,
        },
    )
    codes.append(("metadata", r.topics[0].error_code))


async def _commit(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "offset_commit",
        2,
        {
            "group_id": "race-group",
            "generation_id_or_member_epoch": -1,
            "member_id": "",
            "retention_time_ms": -1,
            "topics": [
                {
                    "name": NAME,
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": 1,
                            "committed_leader_epoch": -1,
                            "committed_metadata": "",
                        }
                    ],
                }
            ],
        },
    )
    codes.append(("commit", r.topics[0].partitions[0].error_code))


async def _long_fetch(c: RawClient, codes: list[tuple[str, int]]) -> None:
    # a long poll for more than there is: waits, and the topic may go away (or come back) meanwhile
    r = await c.call("fetch", 12, fetch_body(NAME, 0, max_wait=30, min_bytes=1 << 20))
    codes.append(("fetch", r.responses[0].partitions[0].error_code))


async def _list_offsets(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "list_offsets",
        7,
        {
            "replica_id": -1,
            "isolation_level": 0,
            "topics": [
                {
                    "name": NAME,
                    "partitions": [
                        {"partition_index": i, "timestamp": -1} for i in range(PARTITIONS)
                    ],
                }
            ],
        },
    )
    for p in r.topics[0].partitions:
        codes.append(("list_offsets", p.error_code))


async def _epochs(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "offset_for_leader_epoch",
        4,
        {
            "replica_id": -1,
            "topics": [
                {
                    "topic": NAME,
                    "partitions": [{"partition": 0, "current_leader_epoch": -1, "leader_epoch": 0}],
                }
            ],
        },
    )
    codes.append(("epochs", r.topics[0].partitions[0].error_code))


async def _describe(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "describe_configs",
        4,
        {
            "resources": [{"resource_type": 2, "resource_name": NAME, "configuration_keys": None}],
            "include_synonyms": False,
            "include_documentation": False,
        },
    )
    codes.append(("describe", r.results[0].error_code))


async def _offset_fetch(c: RawClient, codes: list[tuple[str, int]]) -> None:
    r = await c.call(
        "offset_fetch",
        7,
        {
            "group_id": "race-group",
            "require_stable": False,
            "topics": [{"name": NAME, "partition_indexes": [0]}],
        },
    )
    codes.append(("offset_fetch", r.error_code))
    for t in r.topics:
        for p in t.partitions:
            codes.append(("offset_fetch", p.error_code))


# Kafka's answers for each race: success, or the outcome of the other side having won.
ALLOWED = {
    "create": {0, 36},  # TOPIC_ALREADY_EXISTS (also while the name is being deleted)
    "delete": {0, 3},  # UNKNOWN_TOPIC_OR_PARTITION
    # the topic went away under the produce (NOT_LEADER: retry), or CreateTopics is still
    # making it off the loop when the produce would auto-create it (LEADER_NOT_AVAILABLE)
    "produce": {0, 3, 5, 6},
    "fetch": {0, 3, 6},
    "metadata": {0, 3, 5},  # 5: LEADER_NOT_AVAILABLE while auto-created
    "commit": {0, 3},
    "list_offsets": {0, 3},
    "epochs": {0, 3},
    "describe": {0, 3},
    "offset_fetch": {0, 3},
}


async def test_concurrent_create_delete_produce_fetch_commit_answer_kafka_errors(
    broker: Broker,
) -> None:
    ops = [
        _create,
        _delete,
        _create,
        _delete,
        _produce,
        _fetch,
        _metadata,
        _commit,
        _long_fetch,
        _list_offsets,
        _epochs,
        _describe,
        _offset_fetch,
        _produce,
    ]
    clients = [await broker.connect() for _ in ops]
    rng = random.Random(15)
    codes: list[tuple[str, int]] = []
    with trio.fail_after(60):
        await _create(clients[0], codes)
        for _ in range(40):
            order = list(range(len(ops)))
            rng.shuffle(order)
            async with trio.open_nursery() as nursery:
                for i in order:
                    nursery.start_soon(ops[i], clients[i], codes)
                    if rng.random() < 0.5:
                        await trio.lowlevel.checkpoint()
    bad = [(what, code) for what, code in codes if code not in ALLOWED[what]]
    assert not bad, bad
    seen = {(what, code) for what, code in codes}
    # the races were really run: creates met existing topics and deletes met missing ones
    assert ("create", 36) in seen and ("delete", 3) in seen and ("delete", 0) in seen
    for c in clients:  # every connection is still open and answering
        r = await c.call(
            "api_versions", 3, {"client_software_name": "t", "client_software_version": "1"}
        )
        assert r.error_code == 0


async def test_a_topic_named_twice_in_one_delete_is_refused_both_times(broker: Broker) -> None:
    c = await broker.connect()
    codes: list[tuple[str, int]] = []
    await _create(c, codes)
    assert codes == [("create", 0)]
    r = await c.call(
        "delete_topics", 6, {"topics": [{"name": NAME, "topic_id": None}] * 2, "timeout": 5000}
    )
    assert [x.error_code for x in r.responses] == [42, 42]
    r = await c.call(
        "delete_topics", 6, {"topics": [{"name": NAME, "topic_id": None}], "timeout": 5000}
    )
    assert r.responses[0].error_code == 0

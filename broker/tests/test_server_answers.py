"""Answers the broker cannot encode, and requests whose answers could not be encoded.

An answer that fails to encode is logged once as an internal error and becomes
UNKNOWN_SERVER_ERROR where the response has a top-level error code, else the connection
closes; the broker and its other connections carry on. Strings a request may carry are
bounded at the door so that handlers never build such an answer from them.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from typing import Any

import pytest

from broker.api import REGISTRY, RequestContext
from broker.tests.conftest import Broker

pytestmark = pytest.mark.usefixtures("broker")


def _replace_handler(monkeypatch: pytest.MonkeyPatch, key: int, answer: dict[str, Any]) -> None:
    async def handler(ctx: RequestContext, request: Any) -> dict[str, Any]:
        return answer

    monkeypatch.setitem(REGISTRY, key, dataclasses.replace(REGISTRY[key], handler=handler))


async def test_unencodable_answer_with_an_error_field_becomes_unknown_server_error(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # FindCoordinator v0 writes host as an int16-length string: 40,000 bytes do not fit.
    _replace_handler(
        monkeypatch, 10, {"error_code": 0, "node_id": 1, "host": "h" * 40_000, "port": 9092}
    )
    c = await broker.connect()
    with caplog.at_level(logging.ERROR, logger="hyperkafka.server"):
        r = await c.call("find_coordinator", 0, {"key": "g"})
    assert r.error_code == -1  # UNKNOWN_SERVER_ERROR
    errors = [rec for rec in caplog.records if "cannot encode" in rec.getMessage()]
    assert len(errors) == 1
    assert (await c.call("api_versions", 0, {})).error_code == 0  # the connection lives on


async def test_unencodable_answer_without_an_error_field_closes_only_that_connection(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = {"error_code": 0, "name": "t" * 40_000, "is_internal": False, "partitions": []}
    _replace_handler(monkeypatch, 3, {"brokers": [], "controller_id": 1, "topics": [topic]})
    c = await broker.connect()
    await c.send("metadata", 1, {"topics": None})
    assert await c.closed()
    other = await broker.connect()
    assert (await other.call("api_versions", 0, {})).error_code == 0


async def test_error_message_quoting_a_long_name_is_cut_to_fit(broker: Broker) -> None:
    # CreateTopics v4 (int16 strings) names one 32,767-byte topic twice: Kafka's message
    # "... contains a duplicate topic <name>" is longer than any int16 string.
    name = "a" * 0x7FFF
    topic = {
        "name": name,
        "num_partitions": 1,
        "replication_factor": 1,
        "assignments": [],
        "configs": [],
    }
    c = await broker.connect()
    r = await c.call(
        "create_topics", 4, {"topics": [topic, topic], "timeout": 1000, "validate_only": True}
    )
    assert r.topics[1].error_code == 42  # INVALID_REQUEST: the duplicate
    assert 0x7F00 < len(r.topics[1].error_message.encode()) <= 0x7FFF


async def test_long_client_id_is_refused_and_the_group_keeps_working(broker: Broker) -> None:
    c = await broker.connect()
    client_id = b"c" * 0x7FFF
    payload = struct.pack(">hhih", 11, 5, 9, len(client_id)) + client_id
    payload += b"\x00\x01g" + struct.pack(">ii", 10_000, 10_000) + b"\x00\x00" + b"\xff\xff"
    payload += b"\x00\x08consumer" + struct.pack(">i", 1) + b"\x00\x05range" + struct.pack(">i", 0)
    await c.stream.send_all(struct.pack(">i", len(payload)) + payload)
    assert await c.closed()
    good = await broker.connect()
    r = await good.call(
        "join_group",
        3,
        {
            "group_id": "g",
            "session_timeout": 10_000,
            "rebalance_timeout": 10_000,
            "member_id": "",
            "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b""}],
        },
    )
    assert r.error_code == 0
    d = await good.call("describe_groups", 4, {"groups": ["g"]})
    assert d.groups[0].error_code == 0 and len(d.groups[0].members) == 1


@pytest.mark.parametrize("version", [10, 11])
async def test_metadata_v10_v11_by_topic_id_is_an_invalid_request(
    broker: Broker, caplog: pytest.LogCaptureFixture, version: int
) -> None:
    # v10-11 carry a topic id and a nullable name, but the answer's name is not nullable
    # before v12: Kafka refuses ids and null names there (INVALID_REQUEST for each topic,
    # a null name answered as ""). Found by the attack suite's fuzzer: "cannot encode".
    some_id = __import__("uuid").UUID(int=7)
    c = await broker.connect()
    with caplog.at_level(logging.ERROR, logger="hyperkafka.server"):
        r = await c.call(
            "metadata",
            version,
            {
                "topics": [{"topic_id": some_id, "name": None}, {"topic_id": some_id, "name": "t"}],
                "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False,
            },
        )
    assert [(t.error_code, t.name, t.topic_id) for t in r.topics] == [
        (42, "", some_id),
        (42, "t", some_id),
    ]
    assert r.brokers == ()
    # By name with the zero id (what every client sends there): answered as usual.
    r = await c.call(
        "metadata",
        version,
        {
            "topics": [{"topic_id": None, "name": "by-name"}],
            "allow_auto_topic_creation": False,
            "include_topic_authorized_operations": False,
        },
    )
    assert [(t.error_code, t.name) for t in r.topics] == [
        (3, "by-name")
    ]  # UNKNOWN_TOPIC_OR_PARTITION
    assert r.brokers
    assert not [rec for rec in caplog.records if "internal error" in rec.getMessage()]
    assert (await c.call("api_versions", 0, {})).error_code == 0

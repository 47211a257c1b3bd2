"""Group administration through each client's own admin API: list, describe, committed offsets.

For each client with an admin API that covers groups (kafka-python's KafkaAdminClient,
confluent-kafka's AdminClient, aiokafka's AIOKafkaAdminClient, kafkajs's admin, franz-go's
kadm, sarama's ClusterAdmin), two members of
that client share a 4-partition topic (the workers of test_groups.py). While they run, the
client's admin must list the group as a "consumer" group and describe it as Stable with two
members whose assignments split the partitions between them, the same split the members
report themselves. After they leave, it must describe the group as Empty without members
and fetch the offsets they committed (50 per partition). (kafka-consumer-groups --describe
and --reset-offsets for the Java tools live in test_java_tools.py.)

Imports the standard library, pytest and the compat_tests modules; each client's package
only inside its adapter.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from compat_tests.clients import CLIENTS, GO_CLIENTS, client_admin, create_topic
from compat_tests.harness import Broker
from compat_tests.test_groups import PARTITIONS, last_split, members, produce, stop_all, wait_for

ADMIN_CLIENTS = ["kafka-python", "confluent", "aiokafka", "kafkajs", "franz-go", "sarama"]
# Driven through clients.client_admin (the Go driver, workers/pyadmin.py, js/admin.js), which
# answer in one shape; kafka-python and confluent run in this process.
CLI_ADMIN = (*GO_CLIENTS, "aiokafka", "kafkajs")


# Each adapter answers in one shape: list -> {group: protocol_type}; describe ->
# {"state": str, "members": sorted list of sorted partition lists}; offsets -> {p: offset}.


def _kp_admin(broker: Broker) -> Any:
    from kafka.admin import KafkaAdminClient

    return KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=20_000)


def _kp_list(broker: Broker) -> dict[str, str]:
    a = _kp_admin(broker)
    try:
        return {g["group_id"]: g["protocol_type"] for g in a.list_groups()}
    finally:
        a.close()


def _kp_describe(broker: Broker, group: str, topic: str) -> dict[str, Any]:
    a = _kp_admin(broker)
    try:
        d = a.describe_groups([group])[group]
    finally:
        a.close()
    parts = []
    for m in d["members"]:
        assignment = m.get("member_assignment") or {}
        owned: list[int] = []
        for t in assignment.get("assigned_partitions") or assignment.get("topics") or []:
            if t.get("topic") == topic:
                owned += t.get("partitions", [])
        parts.append(sorted(owned))
    return {"state": d["group_state"], "members": sorted(parts), "protocol_type": d["protocol_type"]}


def _kp_offsets(broker: Broker, group: str, topic: str) -> dict[int, int]:
    a = _kp_admin(broker)
    try:
        got = a.list_group_offsets({group: None})[group]
    finally:
        a.close()
    return {tp.partition: om.offset for tp, om in got.items() if tp.topic == topic}


def _ck_admin(broker: Broker) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": broker.bootstrap})


def _ck_list(broker: Broker) -> dict[str, str]:
    a = _ck_admin(broker)  # kept alive until the result is in: its handle owns the request
    res = a.list_consumer_groups(request_timeout=20).result()
    assert not res.errors, res.errors
    # librdkafka's listing has no protocol type; a non-simple group is a "consumer" one.
    return {g.group_id: ("" if g.is_simple_consumer_group else "consumer") for g in res.valid}


def _ck_describe(broker: Broker, group: str, topic: str) -> dict[str, Any]:
    a = _ck_admin(broker)
    d = a.describe_consumer_groups([group], request_timeout=20)[group].result()
    parts = sorted(
        sorted(tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic)
        for m in d.members
    )
    state = d.state.name.title().replace("_", "")  # ConsumerGroupState.STABLE -> "Stable"
    return {"state": state, "members": parts, "protocol_type": "" if d.is_simple_consumer_group else "consumer"}


def _ck_offsets(broker: Broker, group: str, topic: str) -> dict[int, int]:
    from confluent_kafka import ConsumerGroupTopicPartitions

    a = _ck_admin(broker)
    got = a.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)], request_timeout=20)[group].result()
    return {tp.partition: tp.offset for tp in got.topic_partitions if tp.topic == topic}


def _cli_list(client: str, broker: Broker) -> dict[str, str]:
    return {g: d["protocol_type"] for g, d in client_admin(client, "list-groups", broker)["groups"].items()}


def _cli_describe(client: str, broker: Broker, group: str, topic: str) -> dict[str, Any]:
    d = client_admin(client, "describe-groups", broker, "--group", group)["groups"][group]
    assert d["error_code"] == 0, d
    parts = sorted(sorted(m["assigned"].get(topic) or []) for m in d["members"])
    return {"state": d["state"], "members": parts, "protocol_type": d["protocol_type"]}


def _cli_offsets(client: str, broker: Broker, group: str, topic: str) -> dict[int, int]:
    got = client_admin(client, "offsets", broker, "--group", group, "--topic", topic)["offsets"]
    return {int(p): int(o) for p, o in got.items()}


def list_groups(client: str, broker: Broker) -> dict[str, str]:
    if client in CLI_ADMIN:
        return _cli_list(client, broker)
    return _kp_list(broker) if client == "kafka-python" else _ck_list(broker)


def describe_group(client: str, broker: Broker, group: str, topic: str) -> dict[str, Any]:
    if client in CLI_ADMIN:
        return _cli_describe(client, broker, group, topic)
    return _kp_describe(broker, group, topic) if client == "kafka-python" else _ck_describe(broker, group, topic)


def group_offsets(client: str, broker: Broker, group: str, topic: str) -> dict[int, int]:
    if client in CLI_ADMIN:
        return _cli_offsets(client, broker, group, topic)
    return _kp_offsets(broker, group, topic) if client == "kafka-python" else _ck_offsets(broker, group, topic)


@pytest.mark.timeout(180)
@pytest.mark.matrix("group-admin list/describe/offsets")
@pytest.mark.parametrize("client", ADMIN_CLIENTS)
def test_admin_lists_and_describes_a_live_group(broker: Broker, workdir: Path, client: str) -> None:
    CLIENTS[client].require()
    tag = uuid.uuid4().hex[:8]
    topic, group = f"gadmin-{client}-{tag}", f"ga-{client}-{tag}"
    create_topic(broker, topic, PARTITIONS)
    stop = workdir / "stop"
    with members(client, broker, topic, group, 2, workdir, ["--stop-file", str(stop)]) as ms:
        wait_for(
            "two members sharing the topic",
            lambda: all(last_split(ms)) and sorted(p for s in last_split(ms) for p in s) == list(range(PARTITIONS)),
            90,
            ms,
        )
        listed = list_groups(client, broker)
        assert listed.get(group) == "consumer", f"{group} not listed as a consumer group: {listed}"
        # The members' own view and the coordinator's must agree once the group is Stable.
        want = sorted(sorted(s) for s in last_split(ms))
        seen: dict[str, Any] = {}

        def described() -> bool:
            seen.update(describe_group(client, broker, group, topic))
            return seen["state"] == "Stable" and seen["members"] == want

        wait_for(f"DescribeGroups to show a Stable group split as {want}", described, 30, ms)
        assert seen["protocol_type"] == "consumer", seen
        produced = produce(broker, topic, 200, tag)
        wait_for("every record to be read", lambda: produced <= {r["v"] for m in ms for r in m.records()}, 60, ms)
        stop_all(ms, stop)

    after = describe_group(client, broker, group, topic)
    assert after["state"] == "Empty" and after["members"] == [], after
    assert group_offsets(client, broker, group, topic) == dict.fromkeys(range(PARTITIONS), 50)

"""Metadata listing with kcat -L, topic administration and describe configs, auto-creation.

kcat -L (both librdkafkas) must list our broker at its advertised host:port and a topic
with its partitions. Every client with an admin API (kafka-python's KafkaAdminClient,
confluent-kafka's AdminClient, aiokafka's AIOKafkaAdminClient, kafkajs's admin, franz-go's
kadm, sarama's ClusterAdmin) must create, list, describe and delete topics with the right
errors for duplicates and unknown names (admin-topics), and describe a topic's configs
with their values and sources (describe-configs). kafka-python's topic admin runs in this
process, the others through `clients.client_admin` (compat_tests/workers/pyadmin.py,
compat_tests/js/admin.js and the Go driver), which answer in one shape. Auto-creation of
topics on first produce is tested here and only here: every other test creates its topics
through the admin API, so a broker (like tansu) without auto-creation fails this test alone.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.clients import ADMIN_CLIENTS, CLIENTS, admin, client_admin, create_topic
from compat_tests.harness import Broker
from compat_tests.records import MAX_MESSAGE_BYTES, assert_same, generate

TOPIC_ALREADY_EXISTS = 36
UNKNOWN_TOPIC_OR_PARTITION = 3


@pytest.mark.timeout(90)
@pytest.mark.matrix("metadata-list")
@pytest.mark.parametrize("client", ["kcat-old", "kcat-new"])
def test_kcat_lists_brokers_and_topics(broker: Broker, client: str) -> None:
    CLIENTS[client].require()
    kc, _ = harness.find_kcat(client.split("-")[1])
    assert kc is not None
    topic = f"meta-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic, partitions=3)

    proc = kc.run(["-b", broker.bootstrap, "-L", "-J", "-m", "20"], timeout=60)
    meta = json.loads(proc.stdout)
    names = {b["name"]: b["id"] for b in meta["brokers"]}
    assert broker.bootstrap in names, f"advertised {broker.bootstrap} not in {meta['brokers']}"
    node_id = names[broker.bootstrap]
    topics = {t["topic"]: t for t in meta["topics"]}
    assert topic in topics, f"{topic} missing from kcat -L: {sorted(topics)}"
    parts = topics[topic]["partitions"]
    assert sorted(p["partition"] for p in parts) == [0, 1, 2]
    assert all(p["leader"] == node_id for p in parts), parts
    assert "error" not in topics[topic] or not topics[topic]["error"], topics[topic]

    # The plain-text listing too: that is what people paste into bug reports.
    text = kc.run(["-b", broker.bootstrap, "-L", "-t", topic, "-m", "20"], timeout=60).stdout
    assert f'topic "{topic}" with 3 partitions'.encode() in text, text.decode("utf-8", "replace")
    assert f"at {broker.bootstrap}".encode() in text


@pytest.mark.timeout(120)
@pytest.mark.matrix("admin-topics", client="kafka-python")
def test_kafka_python_admin_create_list_delete(broker: Broker) -> None:
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError, UnknownTopicOrPartitionError

    a = admin(broker)
    try:
        one, four = (f"admin-{n}-{uuid.uuid4().hex[:8]}" for n in ("one", "four"))
        a.create_topics(
            [
                NewTopic(one, num_partitions=1, replication_factor=1),
                NewTopic(four, num_partitions=4, replication_factor=1),
            ],
            timeout_ms=20_000,
        )
        _wait(lambda: {one, four} <= set(a.list_topics()), "created topics listed")
        described = {t["name"]: t for t in a.describe_topics([one, four])}
        assert len(described[one]["partitions"]) == 1, described[one]
        assert len(described[four]["partitions"]) == 4, described[four]
        assert all(t["error_code"] == 0 for t in described.values()), described

        with pytest.raises(TopicAlreadyExistsError):
            a.create_topics(
                [NewTopic(one, num_partitions=1, replication_factor=1)],
                timeout_ms=20_000,
                raise_errors=True,
            )

        a.delete_topics([one, four], timeout_ms=20_000)
        _wait(lambda: not ({one, four} & set(a.list_topics())), "deleted topics gone")

        with pytest.raises(UnknownTopicOrPartitionError):
            a.delete_topics([f"never-{uuid.uuid4().hex[:8]}"], timeout_ms=20_000, raise_errors=True)
    finally:
        a.close()


@pytest.mark.timeout(120)
@pytest.mark.matrix("admin-topics")
@pytest.mark.parametrize("client", ADMIN_CLIENTS)
def test_admin_create_list_describe_delete(broker: Broker, client: str) -> None:
    CLIENTS[client].require()
    tag = uuid.uuid4().hex[:8]
    one, four = f"adm-{client}-one-{tag}", f"adm-{client}-four-{tag}"

    got = client_admin(client, "create", broker, "--topic", one, "--partitions", "1")
    assert got["topics"][one]["error_code"] == 0, got
    got = client_admin(client, "create", broker, "--topic", four, "--partitions", "4")
    assert got["topics"][four]["error_code"] == 0, got
    _wait(lambda: {one, four} <= set(client_admin(client, "list", broker)["topics"]), "created topics listed")

    described = client_admin(client, "describe", broker, "--topic", one, "--topic", four)["topics"]
    for name, n in ((one, 1), (four, 4)):
        t = described[name]
        assert t["error_code"] == 0, t
        assert [p["partition"] for p in t["partitions"]] == list(range(n)), t
        for p in t["partitions"]:
            assert p["error_code"] == 0 and p["leader"] >= 0, p
            assert p["replicas"] == [p["leader"]] and p["isr"] == [p["leader"]], p

    again = client_admin(client, "create", broker, "--topic", one, "--partitions", "1")
    assert again["topics"][one]["error_code"] == TOPIC_ALREADY_EXISTS, again

    gone = client_admin(client, "delete", broker, "--topic", one, "--topic", four)["topics"]
    assert gone[one]["error_code"] == 0 and gone[four]["error_code"] == 0, gone
    _wait(lambda: not ({one, four} & set(client_admin(client, "list", broker)["topics"])), "deleted topics gone")

    missing = f"never-{tag}"
    got = client_admin(client, "delete", broker, "--topic", missing)
    assert got["topics"][missing]["error_code"] == UNKNOWN_TOPIC_OR_PARTITION, got


@pytest.mark.timeout(90)
@pytest.mark.matrix("describe-configs")
@pytest.mark.parametrize("client", [*ADMIN_CLIENTS, "kafka-python"])
def test_admin_describe_topic_configs(broker: Broker, client: str) -> None:
    CLIENTS[client].require()
    topic = f"cfg-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    got = client_admin(client, "configs", broker, "--topic", topic)["topics"][topic]
    # kafka-python 3.0.12's describe_configs drops each resource's error code (null here).
    assert got["error_code"] == (None if client == "kafka-python" else 0), got
    configs = got["configs"]
    assert configs["max.message.bytes"]["value"] == str(MAX_MESSAGE_BYTES), configs["max.message.bytes"]
    assert configs["cleanup.policy"]["value"] == "delete", configs.get("cleanup.policy")
    assert configs["retention.ms"]["value"] == "604800000", configs.get("retention.ms")
    # Nothing was set on the topic: every value is a default of some kind.
    sources = {name: c["source"] for name, c in configs.items()}
    assert not [n for n, s in sources.items() if "TOPIC" in s.upper()], sources

    missing = f"never-{uuid.uuid4().hex[:8]}"
    got = client_admin(client, "configs", broker, "--topic", missing)["topics"][missing]
    if client == "kafka-python":
        # All kafka-python surfaces for a missing topic is a topic without configs.
        assert got == {"error_code": None, "configs": {}}, got
    else:
        assert got["error_code"] == UNKNOWN_TOPIC_OR_PARTITION, got


def _wait(pred: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.2)


# The worker flag that makes a client's producer ask for auto-creation, where asking is not
# its default (franz-go: kgo.AllowAutoTopicCreation; kafkajs: allowAutoTopicCreation).
AUTO_CREATE_FLAG: dict[str, tuple[str, ...]] = {"franz-go": ("--auto-create",), "kafkajs": ("--auto-create",), "sarama": ("--auto-create",)}


@pytest.mark.timeout(120)
@pytest.mark.matrix("auto-create")
@pytest.mark.parametrize("client", list(CLIENTS))
def test_produce_auto_creates_topic(broker: Broker, workdir: Path, client: str) -> None:
    """A producer's Metadata request (AllowAutoTopicCreation) creates an unknown topic."""
    c = CLIENTS[client]
    c.require()
    topic = f"auto-{client}-{uuid.uuid4().hex[:8]}"
    records = generate(500, c.profile, seed=7)
    c.produce(broker, topic, records, workdir, timeout=90, extra=AUTO_CREATE_FLAG.get(client, ()))
    a = admin(broker)
    try:
        assert topic in a.list_topics()
    finally:
        a.close()
    consumed, _ = c.consume(broker, topic, len(records), workdir, timeout=90)
    assert_same(records, consumed)

"""Metadata listing with kcat -L, topic administration with kafka-python, auto-creation.

kcat -L (both librdkafkas) must list our broker at its advertised host:port and a topic
with its partitions; kafka-python's admin client must create, list, describe and delete
topics with the right errors for duplicates and unknown names. Auto-creation of topics on
first produce is tested here and only here: every other test creates its topics through
the admin API, so a broker (like tansu) without auto-creation fails this test alone.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.clients import CLIENTS, admin, create_topic
from compat_tests.harness import Broker
from compat_tests.records import Profile, assert_same, generate


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


def _wait(pred, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.2)


@pytest.mark.timeout(120)
@pytest.mark.matrix("auto-create")
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_produce_auto_creates_topic(broker: Broker, workdir: Path, client: str) -> None:
    """A producer's Metadata request (AllowAutoTopicCreation) creates an unknown topic."""
    c = CLIENTS[client]
    c.require()
    topic = f"auto-{client}-{uuid.uuid4().hex[:8]}"
    records = generate(500, Profile(null_both=False), seed=7)
    c.produce(broker, topic, records, workdir, timeout=90)
    a = admin(broker)
    try:
        assert topic in a.list_topics()
    finally:
        a.close()
    consumed, _ = c.consume(broker, topic, len(records), workdir, timeout=90)
    assert_same(records, consumed)

"""Fetch answers within the consumer's limits, as librdkafka holds a broker to them.

librdkafka refuses any answer larger than `receive.message.max.bytes` ("Invalid response
size ... increase receive.message.max.bytes"), drops the connection and fetches the same
thing again: a broker that answers past the request's max_bytes stalls it for good. The
scenario is librdkafka's own test 0082-fetch_max_bytes: partitions of batches just under
1 MB, a consumer asking for 20 MB per partition but 1 MB in all, and a receive limit of
1 MB + 512 bytes. A second case checks the one exception Kafka makes (KIP-74): a batch
larger than fetch.max.bytes still comes, alone, so the consumer makes progress.

Imports pytest, confluent_kafka and the compat_tests modules.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from compat_tests.harness import Broker

RECORD = 900 * 1024  # as 0082: under 1 MB once batch overhead is added
PER_PARTITION = 6
PARTITIONS = 3


def _create(bootstrap: str, topic: str, configs: dict[str, str] | None = None) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    a = AdminClient({"bootstrap.servers": bootstrap})
    a.create_topics([NewTopic(topic, PARTITIONS, 1, config=configs or {})])[topic].result(30)


def _produce(bootstrap: str, topic: str, values: list[tuple[int, bytes]], **conf: object) -> None:
    from confluent_kafka import Producer

    errors: list[str] = []
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, **conf})
    for partition, value in values:
        p.produce(topic, value, partition=partition,
                  on_delivery=lambda err, _m: errors.append(str(err)) if err else None)  # fmt: skip
        p.poll(0)
    assert p.flush(60) == 0
    assert not errors, errors[:3]


def _consume(
    bootstrap: str, topic: str, want: int, conf: dict[str, object], seconds: float = 60
) -> list[bytes]:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            **conf,
        }
    )
    got: list[bytes] = []
    errors: list[str] = []
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + seconds
        while len(got) < want and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                errors.append(str(m.error()))
                continue
            got.append(m.value() or b"")
    finally:
        c.close()
    assert len(got) == want, f"consumed {len(got)} of {want} in {seconds}s; errors: {errors[:3]}"
    return got


@pytest.mark.timeout(180)
def test_librdkafka_fetch_max_bytes_is_never_exceeded(broker: Broker) -> None:
    """librdkafka 0082: every record arrives; with one answer past 1 MB + 512 none would."""
    topic = f"fmax-{uuid.uuid4().hex[:8]}"
    _create(broker.bootstrap, topic)
    values = [(p, os.urandom(RECORD)) for p in range(PARTITIONS) for _ in range(PER_PARTITION)]
    _produce(broker.bootstrap, topic, values)
    got = _consume(
        broker.bootstrap,
        topic,
        len(values),
        {
            "max.partition.fetch.bytes": 20_000_000,
            "fetch.max.bytes": 1_000_000,
            "receive.message.max.bytes": 1_000_512,
        },
    )
    assert sorted(got) == sorted(v for _, v in values)


@pytest.mark.timeout(180)
def test_a_batch_above_fetch_max_bytes_still_comes_alone(broker: Broker) -> None:
    """KIP-74: a 1.5 MB record on a topic that allows it reaches a consumer whose
    fetch.max.bytes is 1 MB (its receive limit 2 MB); the small records around it too."""
    topic = f"fbig-{uuid.uuid4().hex[:8]}"
    _create(broker.bootstrap, topic, {"max.message.bytes": "3000000"})
    big = os.urandom(1_500_000)
    values = [(0, b"s" * 1000), (0, big), (0, b"t" * 1000)]
    values += [(p, os.urandom(RECORD)) for p in (1, 2) for _ in range(2)]
    _produce(broker.bootstrap, topic, values, **{"message.max.bytes": 4_000_000})
    got = _consume(
        broker.bootstrap,
        topic,
        len(values),
        {
            "fetch.max.bytes": 1_000_000,
            "max.partition.fetch.bytes": 1_000_000,
            "receive.message.max.bytes": 2_000_000,
        },
    )
    assert sorted(got) == sorted(v for _, v in values)

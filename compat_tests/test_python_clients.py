"""ListOffsets by time and high watermarks (kafka-python's idempotent default is in
test_idempotence.py).

- offsets_for_times: the first offset whose timestamp is >= t, None past the end.
- The high watermark (ListOffsets latest) and log start (earliest) as kafka-python and
  confluent-kafka read them, after batches of several sizes.
"""

from __future__ import annotations

import uuid

import pytest

from compat_tests.clients import CLIENTS, create_topic
from compat_tests.harness import Broker


@pytest.mark.timeout(120)
@pytest.mark.matrix("offsets-for-times", client="kafka-python")
def test_kafka_python_offsets_for_times(broker: Broker) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = f"times-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    base = 1_700_000_000_000
    n = 1000
    p = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=5, batch_size=16 * 1024)
    try:
        for i in range(n):
            p.send(topic, value=b"t%d" % i, partition=0, timestamp_ms=base + 10 * i)
        p.flush(timeout=60)
    finally:
        p.close(timeout=10)

    tp = TopicPartition(topic, 0)
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, enable_auto_commit=False)
    try:

        def offset_at(ts: int) -> int | None:
            got = c.offsets_for_times({tp: ts})[tp]
            return None if got is None else got.offset

        assert offset_at(0) == 0
        assert offset_at(base) == 0
        assert offset_at(base + 1) == 1  # first timestamp >= t, not the nearest
        assert offset_at(base + 10 * 500) == 500
        assert offset_at(base + 10 * 999) == 999
        assert offset_at(base + 10 * 999 + 1) is None
        got = c.offsets_for_times({tp: base + 10 * 321})[tp]
        assert got is not None and got.timestamp == base + 10 * 321, got
        # And the consumer sees the producer's CreateTime timestamps.
        c.assign([tp])
        c.seek(tp, 995)
        seen: list[tuple[int, int]] = []
        while len(seen) < 5:
            for msgs in c.poll(timeout_ms=1000).values():
                seen += [(m.offset, m.timestamp) for m in msgs]
        assert seen[:5] == [(o, base + 10 * o) for o in range(995, 1000)]
    finally:
        c.close()


@pytest.mark.timeout(120)
@pytest.mark.matrix("list-offsets")
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_list_offsets_high_watermark(broker: Broker, client: str) -> None:
    """After batches of 1, 7 and 300 records the high watermark is 1, 8, 308; start is 0."""
    from kafka import KafkaProducer

    CLIENTS[client].require()
    topic = f"lo-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    query = _watermarks_kafka_python if client == "kafka-python" else _watermarks_confluent
    assert query(broker, topic) == (0, 0)
    p = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=50, batch_size=1 << 20)
    total = 0
    try:
        for size in (1, 7, 300):
            for i in range(size):
                p.send(topic, value=b"x%d" % i, partition=0)
            p.flush(timeout=30)
            total += size
            assert query(broker, topic) == (0, total), f"after a batch of {size}"
    finally:
        p.close(timeout=10)


def _watermarks_kafka_python(broker: Broker, topic: str) -> tuple[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 0)
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, enable_auto_commit=False)
    try:
        return c.beginning_offsets([tp])[tp], c.end_offsets([tp])[tp]
    finally:
        c.close()


def _watermarks_confluent(broker: Broker, topic: str) -> tuple[int, int]:
    import confluent_kafka as ck

    c = ck.Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "hk-compat-lo"})
    try:
        low, high = c.get_watermark_offsets(ck.TopicPartition(topic, 0), timeout=10)
        return int(low), int(high)
    finally:
        c.close()

"""kafka-python's offsets_for_times in depth (kafka-python's idempotent default is in
test_idempotence.py; every client's ListOffsets is in test_list_offsets.py).

- offsets_for_times: the first offset whose timestamp is >= t, None past the end, with the
  record's own timestamp; and the consumer sees the producer's CreateTime timestamps.
"""

from __future__ import annotations

import uuid

import pytest

from compat_tests.clients import create_topic
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

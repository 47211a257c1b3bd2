"""Lying record batches against a real broker process, while a stock producer writes.

Each hostile batch (a record count that lies, offset deltas that repeat, a length past
the end, a batch nested in a compressed wrapper, a compression bomb) must get Kafka's
error for the partition and leave no trace: the high watermark does not move, and a
stock consumer reading afterwards sees exactly the well-behaved producer's records, in
order. The producer (kafka-python, acks=all, idempotent) keeps working throughout.
"""

from __future__ import annotations

import time
import uuid

import zstandard

from broker.tests.test_record_validation import batch as raw_batch
from broker.tests.test_record_validation import record
from compat_tests.clients import create_topic
from compat_tests.harness import Broker
from compat_tests.oracle import RawClient, _produce_body


def _hostile(now: int) -> dict[str, tuple[bytes, set[int]]]:
    def b(section: bytes, count: int, codec: int = 0) -> bytes:
        return raw_batch(section, count, codec=codec, base_ts=now, max_ts=now)

    bomb = b"".join(record(i, value=b"\x00" * 100_000) for i in range(1000))  # 100 MB
    nested = b(record(0) + record(1), 2)
    return {
        "count 2^31-1": (b(record(0), 2**31 - 1), {87}),
        "offset deltas repeat": (b(record(0) + record(0) + record(0), 3), {87}),
        "length past the end": (b(record(0) + b"\x7f\x00\x00", 2), {87}),
        "batch nested in zstd": (b(zstandard.ZstdCompressor().compress(nested), 2, codec=4), {87}),
        "zstd bomb": (b(zstandard.ZstdCompressor(level=3).compress(bomb), 1000, codec=4), {87}),
        "truncated zstd": (b(zstandard.ZstdCompressor().compress(record(0))[:-2], 1, codec=4), {2}),
    }


def _end_offset(c: RawClient, topic: str) -> int:
    r = c.call(
        "list_offsets",
        5,
        {
            "replica_id": -1,
            "isolation_level": 0,
            "topics": [
                {
                    "name": topic,
                    "partitions": [
                        {"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}
                    ],
                }
            ],
        },
    )
    p = r.topics[0].partitions[0]
    assert p.error_code == 0, p
    return int(p.offset)


def test_lying_batches_are_refused_and_stock_clients_see_only_good_records(broker: Broker) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    topic = f"lies-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    producer = KafkaProducer(
        bootstrap_servers=broker.bootstrap, acks="all", enable_idempotence=True, linger_ms=0
    )
    sent: list[bytes] = []

    def send(n: int) -> None:
        for _ in range(n):
            value = f"good-{len(sent)}".encode()
            producer.send(topic, value=value, partition=0).get(timeout=30)
            sent.append(value)

    send(20)
    with RawClient(broker.host, broker.port) as c:
        for name, (data, codes) in _hostile(int(time.time() * 1000)).items():
            before = _end_offset(c, topic)
            r = c.call("produce", 9, _produce_body(topic, 0, data))
            p = r.responses[0].partition_responses[0]
            assert p.error_code in codes, (name, p)
            assert p.error_message, name
            assert _end_offset(c, topic) == before, f"{name} moved the high watermark"
            send(5)  # the well-behaved producer keeps working between attacks
    producer.close(timeout=30)

    consumer = KafkaConsumer(
        bootstrap_servers=broker.bootstrap, group_id=None, auto_offset_reset="earliest",
        enable_auto_commit=False, consumer_timeout_ms=10_000,
    )  # fmt: skip
    from kafka import TopicPartition

    consumer.assign([TopicPartition(topic, 0)])
    got = []
    for msg in consumer:
        got.append((msg.offset, msg.value))
        if len(got) == len(sent):
            break
    consumer.close()
    assert got == list(enumerate(sent))
    with RawClient(broker.host, broker.port) as c:
        assert _end_offset(c, topic) == len(sent)

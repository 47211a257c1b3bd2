"""A topic's compression.type through real clients: the broker recompresses what they send.

A topic created with compression.type=zstd (lz4, snappy, gzip) through confluent-kafka's admin client
receives uncompressed batches from confluent-kafka and gzip batches from kafka-python;
the broker stores every batch in the topic's codec (read back from the segment files when
the broker runs here), and both clients consume every value byte for byte. DescribeConfigs
reports the override as a dynamic topic config, as Kafka does.

Imports the standard library, pytest, the clients and the compat_tests modules.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from pathlib import Path

import pytest

from compat_tests.harness import Broker

CODEC_IDS = {"zstd": 4, "lz4": 3, "gzip": 1, "snappy": 2, "uncompressed": 0}


def _create(broker: Broker, topic: str, configs: dict[str, str]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    a = AdminClient({"bootstrap.servers": broker.bootstrap})
    futures = a.create_topics([NewTopic(topic, 1, 1, config=configs)], operation_timeout=20)
    futures[topic].result(timeout=30)


def _values(seed: int, n: int) -> list[bytes]:
    rnd = random.Random(seed)
    # compressible text with random bytes mixed in: every codec shrinks it, none by accident
    return [
        b"record %d " % i * rnd.randint(1, 40) + rnd.randbytes(rnd.randint(0, 200))
        for i in range(n)
    ]


def _stored_codecs(broker: Broker, topic: str) -> list[int]:
    from broker.protocol import records

    assert broker.data_dir is not None
    part = Path(broker.data_dir) / f"{topic}-0"
    codecs = []
    for name in sorted(os.listdir(part)):
        if name.endswith(".log"):
            for b in records.split_batches((part / name).read_bytes()):
                codecs.append(records.parse_batch_header(b).compression)
    return codecs


def _consume_confluent(broker: Broker, topic: str, n: int) -> list[bytes]:
    import confluent_kafka as ck

    c = ck.Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": f"hk-compress-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    out: list[bytes] = []
    try:
        c.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(out) < n and time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None:
                continue
            assert m.error() is None, m.error()
            out.append(bytes(m.value()))
    finally:
        c.close()
    return out


def _consume_kafka_python(broker: Broker, topic: str, n: int) -> list[bytes]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        c.seek_to_beginning(tp)
        out: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(out) < n and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=200).values():
                out.extend(bytes(m.value) for m in msgs)
        return out
    finally:
        c.close()


@pytest.mark.timeout(120)
@pytest.mark.matrix("topic-compression-{codec}", client="confluent+kafka-python")
@pytest.mark.parametrize("codec", ["zstd", "lz4", "snappy", "gzip"])
def test_topic_codec_recompresses_client_batches(broker: Broker, codec: str) -> None:
    import confluent_kafka as ck
    from confluent_kafka.admin import AdminClient, ConfigResource, ConfigSource
    from kafka import KafkaProducer

    topic = f"codec-{codec}-{uuid.uuid4().hex[:8]}"
    _create(broker, topic, {"compression.type": codec})
    plain, gzipped = _values(1, 300), _values(2, 300)

    p = ck.Producer(
        {"bootstrap.servers": broker.bootstrap, "compression.type": "none", "linger.ms": 20}
    )
    for v in plain:
        p.produce(topic, v, partition=0)
    assert p.flush(30) == 0
    kp = KafkaProducer(bootstrap_servers=broker.bootstrap, compression_type="gzip", linger_ms=20)
    for v in gzipped:
        kp.send(topic, v, partition=0)
    kp.flush(30)
    kp.close()

    expected = plain + gzipped
    assert _consume_confluent(broker, topic, len(expected)) == expected
    assert _consume_kafka_python(broker, topic, len(expected)) == expected
    if broker.data_dir is not None:
        codecs = _stored_codecs(broker, topic)
        assert codecs and set(codecs) == {CODEC_IDS[codec]}, codecs

    a = AdminClient({"bootstrap.servers": broker.bootstrap})
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    entries = a.describe_configs([res])[res].result(timeout=30)
    entry = entries["compression.type"]
    assert entry.value == codec
    assert entry.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
    assert entries["compression.zstd.level"].source == ConfigSource.DEFAULT_CONFIG.value

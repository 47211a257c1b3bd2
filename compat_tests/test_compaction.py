"""A compacted topic through real clients: cleaned, read by fresh consumers, verified.

confluent-kafka creates a topic with cleanup.policy=compact (small segments, a low dirty
ratio, delete.retention.ms of a few seconds) on a broker whose cleaner runs every 200 ms,
writes many updates per key (one record per batch), then tombstones for some keys. Once the
cleaner ran, a fresh consumer of each client (confluent-kafka, kafka-python) reads: the last
value of every live key at the very offset it was written at, far fewer records than were
written, tombstones still there before delete.retention.ms and gone after it (with every
older value of their keys). `hyperkafka verify` passes on the live data dir and reports the
blocks compacted away (their leaf hashes checked against the signed tree).

Imports the standard library, pytest, the clients and the compat_tests modules.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from compat_tests.harness import Broker, configured_broker, verified

KEYS = 20
UPDATES = 30
DEAD = 5  # keys 0..DEAD-1 get a tombstone at the end
DELETE_RETENTION_MS = 6000


def _produce(broker: Broker, topic: str, pairs: list[tuple[bytes, bytes | None]]) -> list[int]:
    import confluent_kafka as ck

    offsets: list[int] = [-1] * len(pairs)
    p = ck.Producer(
        {"bootstrap.servers": broker.bootstrap, "linger.ms": 0, "batch.num.messages": 1}
    )

    def report(i: int):  # type: ignore[no-untyped-def]
        def done(err, msg) -> None:  # type: ignore[no-untyped-def]
            assert err is None, err
            offsets[i] = msg.offset()

        return done

    for i, (k, v) in enumerate(pairs):
        p.produce(topic, value=v, key=k, partition=0, on_delivery=report(i))
        p.poll(0)
    assert p.flush(60) == 0
    return offsets


def _read_confluent(broker: Broker, topic: str) -> list[tuple[int, bytes, bytes | None]]:
    import confluent_kafka as ck

    c = ck.Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": f"hk-compact-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    out = []
    try:
        c.assign([ck.TopicPartition(topic, 0, ck.OFFSET_BEGINNING)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                assert m.error().code() == ck.KafkaError._PARTITION_EOF, m.error()
                return out
            out.append(
                (m.offset(), bytes(m.key()), None if m.value() is None else bytes(m.value()))
            )
        raise AssertionError("no end of partition within 30 s")
    finally:
        c.close()


def _read_kafka_python(
    broker: Broker, topic: str, end: int
) -> list[tuple[int, bytes, bytes | None]]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, enable_auto_commit=False)
    out: list[tuple[int, bytes, bytes | None]] = []
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        c.seek_to_beginning(tp)
        deadline = time.monotonic() + 30
        while c.position(tp) < end and time.monotonic() < deadline:
            for msgs in c.poll(timeout_ms=300).values():
                out += [(m.offset, m.key, m.value) for m in msgs]
        return out
    finally:
        c.close()


@pytest.mark.timeout(180)
@pytest.mark.matrix("compacted-topic", client="confluent+kafka-python")
def test_compacted_topic_is_cleaned_and_read_by_fresh_consumers(workdir: Path) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    with configured_broker(workdir, {"log.cleaner.backoff.ms": "200"}) as broker:
        topic = f"compacted-{uuid.uuid4().hex[:8]}"
        a = AdminClient({"bootstrap.servers": broker.bootstrap})
        configs = {
            "cleanup.policy": "compact",
            "segment.bytes": "1024",
            "min.cleanable.dirty.ratio": "0.01",
            "delete.retention.ms": str(DELETE_RETENTION_MS),
        }
        a.create_topics([NewTopic(topic, 1, 1, config=configs)])[topic].result(timeout=30)

        updates = [
            (b"key-%02d" % k, b"value %d of key %d" % (u, k))
            for u in range(UPDATES)
            for k in range(KEYS)
        ]
        offsets = _produce(broker, topic, updates)
        tombstones = [(b"key-%02d" % k, None) for k in range(DEAD)]
        t_tomb = time.monotonic()
        offsets += _produce(broker, topic, tombstones)
        # the active segment is never cleaned: a last record moves the tombstones out of it
        offsets += _produce(broker, topic, [(b"sentinel", b"x" * 1100), (b"sentinel", b"y")])
        written = updates + tombstones + [(b"sentinel", b"x" * 1100), (b"sentinel", b"y")]
        end = offsets[-1] + 1
        assert offsets == list(range(end))
        last = {k: off for off, (k, _) in enumerate(written)}  # the last offset of each key

        deadline = time.monotonic() + 60
        while len(got := _read_confluent(broker, topic)) > len(last) + 5:
            assert time.monotonic() < deadline, f"not compacted: {len(got)} records"
            time.sleep(0.3)
        before_horizon = time.monotonic() - t_tomb < DELETE_RETENTION_MS / 1000
        # every record read is one written, at the offset it was written at
        for off, k, v in got:
            assert written[off] == (k, v), off
        # the last record of every key is there (tombstones too, before delete.retention.ms)
        if before_horizon:
            assert {off for off, _, _ in got} >= set(last.values())
        table = {k: v for _, k, v in got}
        for k in range(DEAD, KEYS):
            assert table[b"key-%02d" % k] == b"value %d of key %d" % (UPDATES - 1, k)
        assert _read_kafka_python(broker, topic, end) == got

        # after delete.retention.ms the tombstones go, with every older value of their keys
        dead = {b"key-%02d" % k for k in range(DEAD)}
        deadline = time.monotonic() + 60
        got = _read_confluent(broker, topic)
        while any(k in dead for _, k, _ in got):
            assert time.monotonic() < deadline, "tombstones not removed"
            time.sleep(0.3)
            got = _read_confluent(broker, topic)
        assert time.monotonic() - t_tomb >= DELETE_RETENTION_MS / 1000
        live = {b"key-%02d" % k for k in range(DEAD, KEYS)} | {b"sentinel"}
        assert {k for _, k, _ in got} == live
        for off, k, v in got:
            assert written[off] == (k, v), off
        assert _read_kafka_python(broker, topic, end) == got
        out = verified(broker.data_dir, "--topic", topic)
        assert "compacted away" in out, out

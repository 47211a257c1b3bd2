"""Memory budgets against a real broker process: its RSS must stay bounded under the
attacks that used to grow it without limit, while a normal client produces and consumes.

- 600 connections each sending only a 4-byte size prefix of a 2 MiB frame (the broker
  used to allocate every announced frame at once: 1.3 GB RSS);
- clients pipelining Fetch requests without ever reading the answers (the broker must stop
  reading them once their unsent answers pass hyperkafka.connection.max.unsent.bytes);
- one Fetch naming a partition 20,000 times (it used to be served 20,000 times: 2.4 GB).

The bound each test states is on the growth of VmRSS (/proc/PID/status) over the broker's
own RSS after a warm-up produce and consume.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.clients import create_topic
from compat_tests.harness import Broker, recv_exact

MiB = 1024 * 1024


def rss(broker: Broker) -> int:
    assert broker.proc is not None
    for line in Path(f"/proc/{broker.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker process of our own (its RSS is the point), not an external one."""
    harness.require(Path("/proc/self/status").exists(), "needs /proc to read the broker's RSS")
    if harness.external_broker() is not None:
        pytest.skip("an external broker's RSS cannot be read")
    b = harness.new_broker(tmp_path / "mem")
    b.start()
    try:
        yield b
        assert "internal error" not in b.log_tail(100_000), b.log_tail()
    finally:
        b.kill()


def round_trip(broker: Broker, topic: str, n: int = 50) -> None:
    """A normal client: produce n records with acks=all, then read them all back."""
    from kafka import KafkaConsumer, KafkaProducer

    values = [f"{topic}-{i}-{uuid.uuid4().hex}".encode() for i in range(n)]
    producer = KafkaProducer(
        bootstrap_servers=broker.bootstrap, acks="all", request_timeout_ms=20000
    )
    try:
        for v in values:
            producer.send(topic, v)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=broker.bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=15000,
    )
    try:
        got = [m.value for m in consumer]
    finally:
        consumer.close()
    assert got[-len(values) :] == values  # (after what earlier rounds wrote)


def _header(api_key: int, version: int, correlation_id: int) -> bytes:
    client = b"hk-memory"
    return struct.pack(">hhih", api_key, version, correlation_id, len(client)) + client


def _fetch_v4(
    correlation_id: int, partitions: list[tuple[str, int]], max_bytes: int = 50 * MiB
) -> bytes:
    """A Fetch v4 request frame naming (topic, partition) pairs in order, one topic entry each."""
    body = struct.pack(">iiiib", -1, 0, 0, max_bytes, 0)
    body += struct.pack(">i", len(partitions))
    for topic, part in partitions:
        name = topic.encode()
        body += struct.pack(">h", len(name)) + name + struct.pack(">i", 1)
        body += struct.pack(">iqi", part, 0, 1 * MiB)
    payload = _header(1, 4, correlation_id) + body
    return struct.pack(">i", len(payload)) + payload


@contextlib.contextmanager
def connections(broker: Broker, n: int) -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection((broker.host, broker.port), timeout=10))
        yield socks
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(240)
@pytest.mark.matrix("memory-size-prefix-flood", client="raw-socket")
def test_size_prefix_flood_keeps_rss_bounded(own_broker: Broker) -> None:
    create_topic(own_broker, "mem-flood")
    round_trip(own_broker, "mem-flood")
    base = rss(own_broker)
    with connections(own_broker, 600) as socks:
        for s in socks:
            s.sendall(struct.pack(">i", 2 * MiB) + _header(0, 9, 1))  # a Produce that never comes
        time.sleep(2.0)
        grown = rss(own_broker) - base
        round_trip(own_broker, "mem-flood")  # a normal client is still served meanwhile
        grown = max(grown, rss(own_broker) - base)
    print(
        f"size-prefix flood, 600 connections: broker RSS +{grown / MiB:.1f} MiB over {base / MiB:.1f} MiB"
    )
    assert grown < 64 * MiB, f"RSS grew by {grown / MiB:.0f} MiB for 600 size prefixes"
    assert own_broker.alive()


@pytest.mark.timeout(240)
@pytest.mark.matrix("memory-pipelining-without-reading", client="raw-socket")
def test_pipelining_without_reading_keeps_rss_bounded(own_broker: Broker) -> None:
    """20 clients send Fetch after Fetch for 100 partitions of ~10 KiB each (answers read into
    memory, ~1 MiB each) and never read: each may leave the unsent-answer bound (1 MiB) plus
    one answer unread, not the hundreds of answers it asked for."""
    topic = "mem-pipe"
    create_topic(own_broker, topic, partitions=100)
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=own_broker.bootstrap, acks="all", linger_ms=50)
    try:
        for p in range(100):
            producer.send(topic, b"v" * 10_000, partition=p)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=5)
    round_trip(own_broker, "mem-pipe-normal")
    base = rss(own_broker)
    request = _fetch_v4(7, [(topic, p) for p in range(100)])
    sent = 0
    with connections(own_broker, 20) as socks:
        for s in socks:
            s.setblocking(False)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            progressed = False
            for s in socks:
                try:
                    s.sendall(request)  # non-blocking: a full socket raises
                    sent += 1
                    progressed = True
                except BlockingIOError:
                    pass
            if not progressed:
                time.sleep(0.05)
        grown = rss(own_broker) - base
        round_trip(own_broker, "mem-pipe-normal")
        grown = max(grown, rss(own_broker) - base)
    print(
        f"pipelining without reading, 20 clients, {sent} fetches sent: broker RSS +{grown / MiB:.1f} MiB"
    )
    assert grown < 100 * MiB, f"RSS grew by {grown / MiB:.0f} MiB for clients that do not read"
    assert own_broker.alive()


@pytest.mark.timeout(120)
@pytest.mark.matrix("memory-duplicate-partition-fetch", client="raw-socket")
def test_fetch_naming_one_partition_20000_times_is_served_once(own_broker: Broker) -> None:
    topic = "mem-dup"
    create_topic(own_broker, topic)
    round_trip(own_broker, topic, n=200)
    base = rss(own_broker)
    with socket.create_connection((own_broker.host, own_broker.port), timeout=30) as s:
        s.sendall(_fetch_v4(9, [(topic, 0)] * 20_000))
        head = recv_exact(s, 4)
        assert head is not None
        (size,) = struct.unpack(">i", head)
        answer = recv_exact(s, size)
        assert answer is not None
    grown = rss(own_broker) - base
    # correlation id, throttle, one topic with one partition
    correlation, _, topics = struct.unpack_from(">iii", answer)
    assert (correlation, topics) == (9, 1)
    name_len = struct.unpack_from(">h", answer, 12)[0]
    (partitions,) = struct.unpack_from(">i", answer, 14 + name_len)
    assert partitions == 1
    assert size < 1 * MiB
    print(
        f"one partition named 20,000 times: answer {size} bytes, broker RSS +{grown / MiB:.1f} MiB"
    )
    assert grown < 32 * MiB

"""A broker process on a small open-file limit (RLIMIT_NOFILE 256) against many partitions.

Partition files are on a budget (storage/handles.py): a broker whose limit is a few
hundred descriptors must still create, write, serve and restart on thousands of
partition files, refuse what is past its limits with a Kafka error (POLICY_VIOLATION),
and live through a connection flood larger than its limit.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import Broker, recv_exact

NOFILE = 256
PARTITIONS = 1_000  # 4,000 partition files
RECORDS_PER_PARTITION = 3

# Sets RLIMIT_NOFILE (soft and hard: the broker cannot raise it) and execs the broker.
LAUNCHER = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _limited(b: Broker, nofile: int = NOFILE) -> Broker:
    b.argv = [sys.executable, "-c", LAUNCHER, str(nofile), *b.argv]
    return b


@contextlib.contextmanager
def _broker(workdir: Path, properties: dict[str, str]) -> Iterator[Broker]:
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "server.properties"
    conf.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
    b = _limited(harness.new_broker(workdir, extra=["--config", str(conf)]))
    try:
        yield b
    finally:
        b.kill()


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack(">h", len(data)) + data


def _create_topics(
    broker: Broker, topics: list[tuple[str, int]], timeout: float = 120.0
) -> list[tuple[str, int, str | None]]:
    """CreateTopics v2, by hand: [(name, error code, error message)]."""
    body = struct.pack(">i", len(topics))
    for name, n in topics:
        body += _string(name) + struct.pack(">ihii", n, 1, 0, 0)
    body += struct.pack(">ib", 60_000, 0)
    request = struct.pack(">hhi", 19, 2, 7) + _string("hk-fds") + body
    with socket.create_connection((broker.host, broker.port), timeout=timeout) as s:
        s.sendall(struct.pack(">i", len(request)) + request)
        head = recv_exact(s, 4)
        assert head is not None, "broker closed the CreateTopics connection"
        data = recv_exact(s, struct.unpack(">i", head)[0])
    assert data is not None
    pos = 8  # correlation id, throttle time
    (count,) = struct.unpack_from(">i", data, pos)
    pos += 4
    out = []
    for _ in range(count):
        (ln,) = struct.unpack_from(">h", data, pos)
        name = data[pos + 2 : pos + 2 + ln].decode()
        pos += 2 + ln
        code, mlen = struct.unpack_from(">hh", data, pos)
        pos += 4
        message = None
        if mlen >= 0:
            message = data[pos : pos + mlen].decode()
            pos += mlen
        out.append((name, code, message))
    return out


def _produce_everywhere(broker: Broker, topic: str, start: int) -> None:
    from kafka import KafkaProducer

    p = KafkaProducer(
        bootstrap_servers=broker.bootstrap,
        acks="all",
        linger_ms=20,
        request_timeout_ms=60_000,
        max_block_ms=60_000,
    )
    try:
        futures = [
            p.send(topic, value=f"{i}:{j}".encode(), partition=i)
            for j in range(start, start + RECORDS_PER_PARTITION)
            for i in range(PARTITIONS)
        ]
        p.flush(timeout=120)
        for f in futures:
            f.get(timeout=60)
    finally:
        p.close(timeout=10)


def _read_everything(broker: Broker, topic: str, expect: int) -> dict[int, list[bytes]]:
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(
        bootstrap_servers=broker.bootstrap,
        group_id=None,
        enable_auto_commit=False,
        request_timeout_ms=60_000,
        fetch_max_wait_ms=100,
    )
    try:
        tps = [TopicPartition(topic, i) for i in range(PARTITIONS)]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        got: dict[int, list[bytes]] = {}
        n = 0
        deadline = time.monotonic() + 120
        while n < expect and time.monotonic() < deadline:
            for tp, records in c.poll(timeout_ms=1000, max_records=10_000).items():
                got.setdefault(tp.partition, []).extend(r.value for r in records)
                n += len(records)
        return got
    finally:
        c.close()


def _check(got: dict[int, list[bytes]], rounds: int) -> None:
    for i in range(PARTITIONS):
        want = [f"{i}:{j}".encode() for j in range(rounds * RECORDS_PER_PARTITION)]
        assert got.get(i) == want, f"partition {i}: {got.get(i)}"


def _flood(broker: Broker, n: int) -> None:
    """Hold n connections open at once, more than the broker has descriptors: past its
    sockets' share it refuses them (or accept() fails with EMFILE and it waits); it
    must stay alive either way."""
    socks = []
    try:
        for _ in range(n):
            with contextlib.suppress(OSError):
                socks.append(socket.create_connection((broker.host, broker.port), timeout=5))
        time.sleep(1.0)
        assert broker.alive(), broker.log_tail()
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(600)
def test_many_partitions_on_a_small_open_file_limit(tmp_path: Path) -> None:
    props = {"max.broker.partitions": str(PARTITIONS + 200), "num.partitions": "1"}
    with _broker(tmp_path / "b", props) as b:
        b.start(timeout=60)
        assert "open-file budget: 256 file descriptors" in b.log_tail(200)

        # More partition files than descriptors: created, in one request.
        assert _create_topics(b, [("wide", PARTITIONS)]) == [("wide", 0, None)]
        # Past the limits: a Kafka error with a message, nothing half-made.
        [(_, code, message)] = _create_topics(b, [("toomany", 10_001)])
        assert code == 44 and message and "Excessively large number of partitions" in message
        [(_, code, message)] = _create_topics(b, [("over", 300)])
        assert code == 44 and message and "max.broker.partitions" in message
        assert not (b.data_dir / "over-0").exists()  # type: ignore[operator]

        _produce_everywhere(b, "wide", 0)
        _check(_read_everything(b, "wide", PARTITIONS * RECORDS_PER_PARTITION), 1)

        # A connection flood past the open-file limit: refused or slowed, never fatal.
        _flood(b, NOFILE + 100)
        time.sleep(0.5)
        assert b.alive(), b.log_tail()
        assert harness.api_versions_v0_probe(b.host, b.port, timeout=10), b.log_tail()

        # A clean stop and a restart on the same limit: every partition opens again.
        assert b.stop(timeout=120) == 0, b.log_tail()
        b.start(timeout=120)
        _produce_everywhere(b, "wide", RECORDS_PER_PARTITION)
        _check(_read_everything(b, "wide", 2 * PARTITIONS * RECORDS_PER_PARTITION), 2)

        # Killed (no clean shutdown): recovery must not hold every file open either.
        b.kill()
        b.start(timeout=120)
        _check(_read_everything(b, "wide", 2 * PARTITIONS * RECORDS_PER_PARTITION), 2)
        assert b.stop(timeout=120) == 0, b.log_tail()

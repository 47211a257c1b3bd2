"""Durability across a clean restart.

Produce N records with acks=all, SIGTERM the broker (it must exit 0), start it again on
the same data directory and port, and read every record back byte-exact; then produce more
and check the offsets continue where they stopped. Uses a broker of its own
(`fresh_broker`), so with HK_COMPAT_BOOTSTRAP alone it is skipped (CI: failed), and with
HK_COMPAT_BROKER_CMD it runs against whatever that command starts.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from compat_tests.clients import CLIENTS, create_topic
from compat_tests.harness import Broker
from compat_tests.records import assert_same, generate

N = int(os.environ.get("HK_COMPAT_RECORDS", "20000"))
# How each client's worker is told acks=all: a flag for the Python and Go workers; kcat
# (clients.py: -X acks=all) and the kafkajs worker (acks: -1) always produce with it.
ACKS_ALL: dict[str, tuple[str, ...]] = {
    name: ("--acks", "all")
    for name in ("kafka-python", "confluent", "aiokafka", "franz-go", "sarama")
}


@pytest.mark.timeout(300)
@pytest.mark.matrix("restart-acks-all")
@pytest.mark.parametrize("client", list(CLIENTS))
def test_restart_keeps_acknowledged_records(
    fresh_broker: Broker, workdir: Path, client: str
) -> None:
    c = CLIENTS[client]
    c.require()
    b = fresh_broker
    topic = f"restart-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(b, topic)
    first = generate(N, c.profile, seed=21)
    summary = c.produce(b, topic, first, workdir, extra=ACKS_ALL.get(client, ()))
    # kcat reports no offsets; its records are checked by the reads below.
    assert summary.get("offsets", [0, N - 1]) == [0, N - 1], summary
    assert summary["n"] == N, summary

    status = b.stop()
    assert status == 0, f"broker exited {status} on SIGTERM, expected 0\n{b.log_tail()}"
    b.start()

    consumed, _ = c.consume(b, topic, N, workdir)
    assert_same(first, consumed)

    more = generate(500, c.profile, seed=22)
    summary = c.produce(b, topic, more, workdir, extra=ACKS_ALL.get(client, ()))
    assert summary.get("offsets", [N, N + 499]) == [N, N + 499], f"offsets after restart: {summary}"
    consumed, _ = c.consume(b, topic, N + 500, workdir)
    assert_same(first + more, consumed)

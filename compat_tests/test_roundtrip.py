"""Every client produces and consumes tens of thousands of records, byte-exact and in order.

Each (client, codec) cell: create a one-partition topic through the admin API, produce N
records (HK_COMPAT_RECORDS, default 20,000: null/empty/binary keys and values, headers)
with that client and codec, check the producer's acks are offsets 0..N-1, read everything
back with the same client in assign mode, and require the same bytes in the same order at
offsets 0..N-1, exactly once. A second test has a different
client read what each client wrote, so a broker that only round-trips its own mistakes fails.
"""

from __future__ import annotations

import os
import uuid
import zlib
from pathlib import Path

import pytest

from compat_tests.clients import CLIENTS, Client, create_topic
from compat_tests.harness import Broker
from compat_tests.records import assert_same, generate

N = int(os.environ.get("HK_COMPAT_RECORDS", "20000"))

CELLS = [(name, codec) for name, c in CLIENTS.items() for codec in c.codecs]


def _topic(prefix: str, client: str, codec: str) -> str:
    return f"{prefix}-{client}-{codec}-{uuid.uuid4().hex[:8]}"


def _roundtrip(
    broker: Broker, workdir: Path, writer: Client, reader: Client, codec: str, n: int
) -> None:
    topic = _topic("rt", writer.name, codec)
    create_topic(broker, topic)
    # Data the writer can express that the reader can also read back exactly.
    records = generate(n, writer.profile, seed=zlib.crc32(f"{writer.name}-{codec}".encode()))
    summary = writer.produce(broker, topic, records, workdir, codec=codec)
    assert summary["n"] == n, summary
    if "offsets" in summary:
        assert summary["offsets"] == [0, n - 1], f"producer acks {summary}"
    consumed, _hwm = reader.consume(broker, topic, n, workdir)
    # Readers keep reading past n for a moment, so a duplicate or stray record shows up
    # here as a count mismatch. The high watermark itself is test_list_offsets' business.
    assert_same(records, consumed)


@pytest.mark.timeout(300)
@pytest.mark.matrix("rt-{codec}")
@pytest.mark.parametrize(("client", "codec"), CELLS)
def test_produce_consume(broker: Broker, workdir: Path, client: str, codec: str) -> None:
    c = CLIENTS[client]
    c.require()
    _roundtrip(broker, workdir, c, c, codec, N)


READER_FOR = {
    "kcat-old": "kafka-python",
    "kcat-new": "kafka-python",
    "confluent": "kafka-python",
    "kafka-python": "confluent",
    "aiokafka": "kafka-python",
    "kafkajs": "confluent",
    "franz-go": "confluent",
    "sarama": "kafka-python",
}


@pytest.mark.timeout(300)
@pytest.mark.matrix("read-by-other")
@pytest.mark.parametrize("client", list(CLIENTS))
def test_other_client_reads(broker: Broker, workdir: Path, client: str) -> None:
    writer, reader = CLIENTS[client], CLIENTS[READER_FOR[client]]
    writer.require()
    reader.require()
    _roundtrip(broker, workdir, writer, reader, "gzip", max(1000, N // 4))

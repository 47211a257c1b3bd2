"""Records near the broker's max.message.bytes, through every client that can produce.

The broker refuses a record batch larger than max.message.bytes (1,048,588 bytes by default,
the whole v2 batch counted) with MESSAGE_TOO_LARGE. Each client here must:
- store two single-record batches 16 bytes under the limit and exactly at it, and read them
  back byte-exact (the value is about 1 MB of seeded random bytes; printable text for the
  console producer, which reads lines);
- get the broker's refusal for a batch one byte over it, as the client reports it: an
  exception type, a delivery-report error or a line on stderr, never a record stored.

Every client also has a limit of its own (librdkafka's message.max.bytes, the Java and
Python producers' max.request.size, franz-go's and sarama's max batch bytes), most of them
about 1 MB. The workers raise it above the broker's, so that refusing the record is the
broker's call; a refusal the client makes before sending fails the test (the workers only
collect errors from delivery, and kcat's own refusal reads "% ERROR: Input is too large").

Imports the standard library, pytest and the compat_tests modules.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from compat_tests.clients import CLIENTS, GO_CLIENTS, create_topic, end_offset
from compat_tests.harness import Broker
from compat_tests.records import (
    MAX_MESSAGE_BYTES,
    Profile,
    assert_same,
    record_of_batch_size,
    single_record_batch_bytes,
)

MESSAGE_TOO_LARGE = 10

# How each client surfaces the broker's MESSAGE_TOO_LARGE (None: the Go driver reports the
# error code only).
SURFACED: dict[str, str | None] = {
    "kcat-old": "Delivery failed for message: Broker: Message size too large",
    "kcat-new": "Delivery failed for message: Broker: Message size too large",
    "confluent": "MSG_SIZE_TOO_LARGE: Broker: Message size too large",
    "kafka-python": "MessageSizeTooLargeError",
    "aiokafka": "MessageSizeTooLargeError",
    "kafkajs": "KafkaJSProtocolError MESSAGE_TOO_LARGE",
    "franz-go": None,
    "sarama": None,
}


def _extra(client: str, limit: int) -> tuple[str, ...]:
    """Worker options: one record per batch, and a client-side limit of `limit` bytes."""
    if client in GO_CLIENTS:
        return ("--idempotence", "off", "--max-batch-bytes", str(limit))
    if client == "kafkajs":
        return ("--chunk", "1")  # kafkajs puts every message of one send() in one batch
    if client.startswith("kcat"):
        return ()  # kcat runs with message.max.bytes=4194304 (compat_tests/clients.py)
    return ("--idempotence", "off")  # the Python workers allow 4 MiB requests


@pytest.mark.timeout(180)
@pytest.mark.matrix("near-max-message-bytes")
@pytest.mark.parametrize("client", list(CLIENTS))
def test_records_near_max_message_bytes(broker: Broker, workdir: Path, client: str) -> None:
    c = CLIENTS[client]
    c.require()
    topic = f"max-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    records = [
        record_of_batch_size(MAX_MESSAGE_BYTES - 16, c.profile, seed=31),
        record_of_batch_size(MAX_MESSAGE_BYTES, c.profile, seed=32),
    ]
    # franz-go sizes a batch for the largest request version it might send: a little
    # slack above the broker's limit leaves the exact boundary to the broker.
    summary = c.produce(broker, topic, records, workdir, extra=_extra(client, MAX_MESSAGE_BYTES + 256))
    assert summary["n"] == 2, summary
    if "offsets" in summary:
        assert summary["offsets"] == [0, 1], summary
    consumed, _hwm = c.consume(broker, topic, 2, workdir)
    assert_same(records, consumed)

    over = record_of_batch_size(MAX_MESSAGE_BYTES + 1, c.profile, seed=33)
    summary = c.produce(
        broker, topic, [over], workdir, extra=_extra(client, 2 * MAX_MESSAGE_BYTES), allow_errors=True
    )
    assert summary["n"] == 0, f"a batch of {MAX_MESSAGE_BYTES + 1} bytes was stored: {summary}"
    assert summary["error_codes"] == {str(MESSAGE_TOO_LARGE): 1}, summary
    want = SURFACED[client]
    if want is not None:
        assert len(summary["errors"]) == 1 and want in summary["errors"][0], (
            f"expected {want!r} from {client}: {summary}"
        )
    assert end_offset(broker, topic) == 2, "a refused batch must not move the high watermark"


@pytest.mark.timeout(240)
@pytest.mark.matrix("near-max-message-bytes", client="java-tools")
def test_console_producer_near_max_message_bytes(broker: Broker) -> None:
    """kafka-console-producer with max.request.size raised above the broker's limit: lines
    of 16 bytes under and exactly at it round-trip through kafka-console-consumer; one byte
    over is answered with the broker's RecordTooLargeException, and nothing is stored."""
    from compat_tests.java_tools import JavaTools, require_java

    java = JavaTools(require_java())
    b = broker.bootstrap
    topic = f"max-java-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    # Printable text without a newline or tab: the console tools' line format.
    records = [
        record_of_batch_size(MAX_MESSAGE_BYTES - 16, Profile(), seed=34, printable=True),
        record_of_batch_size(MAX_MESSAGE_BYTES, Profile(), seed=35, printable=True),
    ]
    assert [single_record_batch_bytes(r) for r in records] == [MAX_MESSAGE_BYTES - 16, MAX_MESSAGE_BYTES]
    data = b"".join((r.value or b"") + b"\n" for r in records)
    # The producer's max.request.size (1048576 by default) counts the record, not the batch;
    # twice the broker's limit leaves the refusal to the broker. batch.size stays at 16 KiB,
    # so every record is a batch of its own.
    props = {"max.request.size": str(2 * MAX_MESSAGE_BYTES), "linger.ms": "0"}
    res = java.console_producer(b, topic, data, producer_props=props)
    assert b"Exception" not in res.stderr, res.stderr_tail()
    got = java.console_consumer(
        b, topic, partition=0, offset="earliest", max_messages=2, timeout_ms=30_000
    )
    assert got.processed() == 2, got.stderr_tail()
    assert got.stdout == data, (
        f"console consumer read {len(got.stdout)} bytes in {len(got.stdout.splitlines())} "
        f"lines; wanted {len(data)} bytes in 2"
    )

    over = record_of_batch_size(MAX_MESSAGE_BYTES + 1, Profile(), seed=36, printable=True)
    res = java.console_producer(b, topic, (over.value or b"") + b"\n", producer_props=props, check=False)
    err = res.stderr.decode("utf-8", "replace")
    # The broker's MESSAGE_TOO_LARGE is a RecordTooLargeException carrying the broker's
    # error message; the client's own refusal reads "The message is N bytes when serialized
    # which is larger than ..., which is the value of the max.request.size configuration".
    refusals = [ln for ln in err.splitlines() if "RecordTooLargeException" in ln]
    assert len(refusals) == 1, err[-3000:]
    assert "when serialized" not in refusals[0], f"refused by the client, not the broker: {refusals[0]}"
    assert java.end_offsets(b, topic) == {0: 2}, "a refused batch must not move the high watermark"

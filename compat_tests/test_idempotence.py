"""The idempotent producer, through every client that has one.

- idempotent-default: clients idempotent unless told otherwise (kafka-python 3, franz-go,
  the Java console producer) must run with a producer id and land every record exactly
  once, without being asked.
- idempotent-on: clients not idempotent by default (librdkafka's enable.idempotence,
  aiokafka's enable_idempotence, kafkajs's idempotent and sarama's Producer.Idempotent are
  all false) are switched on; their records must land exactly once, in batches carrying one
  producer id (read back by franz-go's consumer, which reports batch producer ids).

Imports the standard library, pytest and the compat_tests modules.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from compat_tests.clients import CLIENTS, create_topic, run_json
from compat_tests.harness import Broker, find_hkgo
from compat_tests.records import assert_same, generate

N = int(os.environ.get("HK_COMPAT_RECORDS", "20000"))


@pytest.mark.timeout(300)
@pytest.mark.matrix("idempotent-default")
@pytest.mark.parametrize("client,seed", [("kafka-python", 11), ("franz-go", 21)])
def test_idempotent_by_default(broker: Broker, workdir: Path, client: str, seed: int) -> None:
    """Clients that report their producer id: it must be there without being asked for."""
    c = CLIENTS[client]
    c.require()
    topic = f"idem-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    records = generate(N, c.profile, seed=seed)
    summary = c.produce(broker, topic, records, workdir)  # no --idempotence: the default
    assert summary["producer_id"] is not None and summary["producer_id"] >= 0, (
        f"{client} did not run idempotent (no producer id): {summary}"
    )
    assert summary["offsets"] == [0, N - 1], summary
    consumed, _ = c.consume(broker, topic, N, workdir)
    assert_same(records, consumed)


# How each client is told to be idempotent.
IDEMPOTENCE_ON = {
    "kcat-old": ("-X", "enable.idempotence=true"),
    "kcat-new": ("-X", "enable.idempotence=true"),
    "confluent": ("--idempotence", "on"),
    "aiokafka": ("--idempotence", "on"),
    "kafkajs": ("--idempotence", "on"),
    "sarama": ("--idempotence", "on"),
}


@pytest.mark.timeout(300)
@pytest.mark.matrix("idempotent-on")
@pytest.mark.parametrize("client", list(IDEMPOTENCE_ON))
def test_idempotent_producer_when_asked(broker: Broker, workdir: Path, client: str) -> None:
    c, franz = CLIENTS[client], CLIENTS["franz-go"]
    c.require()
    franz.require()
    topic = f"idem-on-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    n = max(1000, N // 10)
    records = generate(n, c.profile, seed=22)
    summary = c.produce(broker, topic, records, workdir, extra=IDEMPOTENCE_ON[client])
    assert summary["n"] == n, summary
    if "offsets" in summary:
        assert summary["offsets"] == [0, n - 1], summary
    # These clients keep their producer id to themselves; franz-go reports the ids in the
    # batches it read.
    consumed, _ = franz.consume(broker, topic, n, workdir)
    assert_same(records, consumed)
    ids = _producer_ids(broker, topic, workdir)
    assert len(ids) == 1 and ids[0] >= 0, f"{client}'s idempotent batches carry producer ids {ids}"


@pytest.mark.timeout(240)
@pytest.mark.matrix("idempotent-default", client="java-tools")
def test_console_producer_idempotent_default(broker: Broker, workdir: Path) -> None:
    """The Java producer is idempotent by default (enable.idempotence=true since Kafka 3.0):
    the console producer, given no properties, writes batches with one producer id."""
    from compat_tests.java_tools import JavaTools, require_java

    java = JavaTools(require_java())
    CLIENTS["franz-go"].require()
    topic = f"idem-java-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    lines = b"".join(b"idempotent line %05d\n" % i for i in range(2000))
    java.console_producer(broker.bootstrap, topic, lines)
    assert java.end_offsets(broker.bootstrap, topic) == {0: 2000}
    ids = _producer_ids(broker, topic, workdir)
    assert len(ids) == 1 and ids[0] >= 0, f"the console producer's batches carry producer ids {ids}"


def _producer_ids(broker: Broker, topic: str, workdir: Path) -> list[int]:
    """The producer ids in the partition's batches, as franz-go's consumer reports them."""
    hkgo, why = find_hkgo()
    assert hkgo is not None, why
    out = workdir / f"pids-{topic}.jsonl"
    argv = [hkgo, "franz-go", "consume", "--bootstrap", broker.bootstrap, "--topic", topic]
    argv += ["--outfile", str(out), "--count", "1", "--timeout", "30"]
    return list(run_json(argv, 60, env=dict(os.environ), label="franz-go consume")["producer_ids"])

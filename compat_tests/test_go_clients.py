"""franz-go and sarama beyond the shared round trips: the idempotent producer.

The shared scenarios (rt-<codec>, read-by-other, the group tests) run the Go clients through
the same code as every other client (compat_tests/clients.py, test_groups.py). Their
topic admin (kadm, sarama's ClusterAdmin) is tested with every other admin client's in
test_metadata_admin.py, their group admin in test_group_admin.py, records near
max.message.bytes in test_record_size.py. This file holds the idempotent producer:

- idempotent-default: franz-go is idempotent unless told otherwise; its records must carry
  a producer id and land exactly once. sarama is not idempotent by default, so its row is
  `idempotent-on` (Producer.Idempotent = true), its producer id read back through franz-go.

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
@pytest.mark.matrix("idempotent-default", client="franz-go")
def test_franz_go_idempotent_default(broker: Broker, workdir: Path) -> None:
    c = CLIENTS["franz-go"]
    c.require()
    topic = f"gidem-franz-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    records = generate(N, c.profile, seed=21)
    summary = c.produce(broker, topic, records, workdir)  # no --idempotence: the default
    assert summary["producer_id"] is not None and summary["producer_id"] >= 0, (
        f"franz-go did not run idempotent (no producer id): {summary}"
    )
    assert summary["offsets"] == [0, N - 1], summary
    consumed, _ = c.consume(broker, topic, N, workdir)
    assert_same(records, consumed)


@pytest.mark.timeout(300)
@pytest.mark.matrix("idempotent-on", client="sarama")
def test_sarama_idempotent_producer(broker: Broker, workdir: Path) -> None:
    sarama, franz = CLIENTS["sarama"], CLIENTS["franz-go"]
    sarama.require()
    topic = f"gidem-sarama-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    records = generate(N, sarama.profile, seed=22)
    summary = sarama.produce(broker, topic, records, workdir, extra=("--idempotence", "on"))
    assert summary["offsets"] == [0, N - 1], summary
    # sarama keeps its producer id to itself; franz-go reports the ids in the batches it read.
    consumed, _ = franz.consume(broker, topic, N, workdir)
    assert_same(records, consumed)
    ids = _producer_ids(broker, topic, workdir)
    assert len(ids) == 1 and ids[0] >= 0, f"sarama's idempotent batches carry producer ids {ids}"


def _producer_ids(broker: Broker, topic: str, workdir: Path) -> list[int]:
    """The producer ids in the partition's batches, as franz-go's consumer reports them."""
    hkgo, why = find_hkgo()
    assert hkgo is not None, why
    out = workdir / f"pids-{topic}.jsonl"
    argv = [hkgo, "franz-go", "consume", "--bootstrap", broker.bootstrap, "--topic", topic]
    argv += ["--outfile", str(out), "--count", "1", "--timeout", "30"]
    return list(run_json(argv, 60, env=dict(os.environ), label="franz-go consume")["producer_ids"])

"""franz-go and sarama beyond the shared round trips: admin, idempotence, group admin.

The shared scenarios (rt-<codec>, read-by-other, the group tests) run the Go clients through
the same code as every other client (compat_tests/clients.py, test_groups.py). This file
holds what only a client with an admin API and an idempotence switch can be asked:

- admin-topics: create (1 and 4 partitions), list, describe, delete; TOPIC_ALREADY_EXISTS
  on a second create and UNKNOWN_TOPIC_OR_PARTITION when deleting a missing topic, through
  franz-go's kadm and sarama's ClusterAdmin.
- describe-configs: a topic's configs with their values and sources.
- idempotent-default: franz-go is idempotent unless told otherwise; its records must carry
  a producer id and land exactly once. sarama is not idempotent by default, so its row is
  `idempotent-on` (Producer.Idempotent = true), its producer id read back through franz-go.
- group-admin: list and describe a live group of that client (members, assignments, state)
  and fetch its committed offsets.

Imports the standard library, pytest and the compat_tests modules.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from compat_tests.clients import CLIENTS, GO_CLIENTS, create_topic, go_admin, run_json
from compat_tests.harness import Broker, find_hkgo
from compat_tests.records import MAX_MESSAGE_BYTES, assert_same, generate

N = int(os.environ.get("HK_COMPAT_RECORDS", "20000"))

TOPIC_ALREADY_EXISTS = 36
UNKNOWN_TOPIC_OR_PARTITION = 3


def _wait(pred: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.2)


@pytest.mark.timeout(120)
@pytest.mark.matrix("admin-topics")
@pytest.mark.parametrize("client", GO_CLIENTS)
def test_go_admin_create_list_describe_delete(broker: Broker, client: str) -> None:
    CLIENTS[client].require()
    tag = uuid.uuid4().hex[:8]
    one, four = f"gadm-{client}-one-{tag}", f"gadm-{client}-four-{tag}"

    got = go_admin(client, "create", broker, "--topic", one, "--partitions", "1")
    assert got["topics"][one]["error_code"] == 0, got
    got = go_admin(client, "create", broker, "--topic", four, "--partitions", "4")
    assert got["topics"][four]["error_code"] == 0, got
    _wait(lambda: {one, four} <= set(go_admin(client, "list", broker)["topics"]), "created topics listed")

    described = go_admin(client, "describe", broker, "--topic", one, "--topic", four)["topics"]
    for name, n in ((one, 1), (four, 4)):
        t = described[name]
        assert t["error_code"] == 0, t
        assert [p["partition"] for p in t["partitions"]] == list(range(n)), t
        for p in t["partitions"]:
            assert p["error_code"] == 0 and p["leader"] >= 0, p
            assert p["replicas"] == [p["leader"]] and p["isr"] == [p["leader"]], p

    again = go_admin(client, "create", broker, "--topic", one, "--partitions", "1")
    assert again["topics"][one]["error_code"] == TOPIC_ALREADY_EXISTS, again

    gone = go_admin(client, "delete", broker, "--topic", one, "--topic", four)["topics"]
    assert gone[one]["error_code"] == 0 and gone[four]["error_code"] == 0, gone
    _wait(lambda: not ({one, four} & set(go_admin(client, "list", broker)["topics"])), "deleted topics gone")

    missing = f"never-{tag}"
    got = go_admin(client, "delete", broker, "--topic", missing)
    assert got["topics"][missing]["error_code"] == UNKNOWN_TOPIC_OR_PARTITION, got


@pytest.mark.timeout(90)
@pytest.mark.matrix("describe-configs")
@pytest.mark.parametrize("client", GO_CLIENTS)
def test_go_describe_topic_configs(broker: Broker, client: str) -> None:
    CLIENTS[client].require()
    topic = f"gcfg-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    got = go_admin(client, "configs", broker, "--topic", topic)["topics"][topic]
    assert got["error_code"] == 0, got
    configs = got["configs"]
    assert configs["max.message.bytes"]["value"] == str(MAX_MESSAGE_BYTES), configs["max.message.bytes"]
    assert configs["cleanup.policy"]["value"] == "delete", configs.get("cleanup.policy")
    assert configs["retention.ms"]["value"] == "604800000", configs.get("retention.ms")
    # Nothing was set on the topic: every value is a default of some kind.
    sources = {name: c["source"] for name, c in configs.items()}
    assert not [n for n, s in sources.items() if "TOPIC" in s.upper()], sources

    missing = f"never-{uuid.uuid4().hex[:8]}"
    got = go_admin(client, "configs", broker, "--topic", missing)["topics"][missing]
    assert got["error_code"] == UNKNOWN_TOPIC_OR_PARTITION, got


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

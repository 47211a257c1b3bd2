"""ListOffsets through every client that can ask for it: two rows of the matrix.

- list-offsets: the log start (-2) and high watermark (-1) of partition 0, empty and after
  batches of 1, 7 and 300 records: (0, 0), (0, 1), (0, 8), (0, 308).
- offsets-for-times: 1000 records with CreateTime timestamps base + 10 i; the first offset
  whose timestamp is >= t, for t before the first record, at it, just after it, in the
  middle, at the last record and past it (where Kafka answers offset -1, which each client
  reports in its own documented way: see NO_OFFSET).

The clients: kafka-python, confluent-kafka and aiokafka through their consumer APIs
(compat_tests/workers/listoffsets.py), kafkajs's admin (compat_tests/js/admin.js),
franz-go's kadm and sarama's Client.GetOffset (`hkgo CLIENT admin list-offsets`), kcat's
-Q (old and new librdkafka) and Java's kafka-get-offsets (GetOffsetShell --time).
"""

from __future__ import annotations

import os
import re
import sys
import uuid

import pytest

from compat_tests import harness
from compat_tests.clients import CLIENTS, GO_CLIENTS, create_topic, run_json
from compat_tests.harness import Broker

LATEST, EARLIEST = -1, -2
CLIENT_NAMES = [
    "kcat-old",
    "kcat-new",
    "confluent",
    "kafka-python",
    "aiokafka",
    "kafkajs",
    "franz-go",
    "sarama",
    "java-tools",
]
BASE = 1_700_000_000_000
N = 1000
# What a client reports for a timestamp past the last record (Kafka's answer: offset -1).
# None: the client says "no offset" (None, or the -1 itself). An int: the client's
# documented substitute, the high watermark (kadm.ListOffsetsAfterMilli's doc comment;
# kafkajs's fetchTopicOffsetsByTimestamp asks for the high watermark and uses it).
NO_OFFSET: dict[str, int | None] = {"franz-go": N, "kafkajs": N}


def _require(client: str) -> None:
    if client == "java-tools":
        from compat_tests.java_tools import require_java

        require_java()
    else:
        CLIENTS[client].require()


def query(client: str, broker: Broker, topic: str, ats: list[int]) -> dict[int, int | None]:
    """Partition 0's offset for each of `ats`, asked through `client`; None for none."""
    if client in ("kcat-old", "kcat-new"):
        return _kcat(client, broker, topic, ats)
    if client == "java-tools":
        return _java(broker, topic, ats)
    flags = [f"--at={at}" for at in ats]
    env = dict(os.environ)
    if client in GO_CLIENTS:
        hkgo, why = harness.find_hkgo()
        assert hkgo is not None, why
        argv = [
            hkgo,
            client,
            "admin",
            "list-offsets",
            "--bootstrap",
            broker.bootstrap,
            "--topic",
            topic,
            *flags,
        ]
    elif client == "kafkajs":
        node, why = harness.find_node_kafkajs()
        assert node is not None, why
        argv = [
            node,
            str(harness.JS_DIR / "admin.js"),
            "list-offsets",
            "--bootstrap",
            broker.bootstrap,
            "--topic",
            topic,
        ]
        argv += [x for at in ats for x in ("--at", str(at))]
    else:
        argv = [
            sys.executable,
            "-m",
            "compat_tests.workers.listoffsets",
            client,
            "--bootstrap",
            broker.bootstrap,
            "--topic",
            topic,
            *flags,
        ]
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p
        )
    got = run_json(argv, 90, env=env, label=f"{client} list-offsets")["offsets"]
    return {
        at: (None if got[str(at)] is None or got[str(at)] < 0 else int(got[str(at)])) for at in ats
    }


_KCAT_LINE = re.compile(r"^\S+ \[(\d+)\] offset (-?\d+)$", re.MULTILINE)


def _kcat(client: str, broker: Broker, topic: str, ats: list[int]) -> dict[int, int | None]:
    """`kcat -Q -t topic:0:TS`: librdkafka's offsetsForTimes, which passes -1 and -2 to the
    broker as Kafka's logical timestamps; it prints `topic [0] offset N` (-1 for none)."""
    kc, why = harness.find_kcat(client.split("-")[1])
    assert kc is not None, why
    out: dict[int, int | None] = {}
    for at in ats:
        text = kc.run(
            ["-Q", "-b", broker.bootstrap, "-t", f"{topic}:0:{at}"], timeout=60
        ).stdout.decode()
        found = {int(p): int(o) for p, o in _KCAT_LINE.findall(text)}
        assert 0 in found, f"{client} -Q printed no offset for partition 0: {text!r}"
        out[at] = None if found[0] < 0 else found[0]
    return out


def _java(broker: Broker, topic: str, ats: list[int]) -> dict[int, int | None]:
    from compat_tests.java_tools import JavaTools, require_java

    java = JavaTools(require_java())
    out: dict[int, int | None] = {}
    for at in ats:
        got = java.end_offsets(broker.bootstrap, topic, time_spec=str(at))
        out[at] = None if got.get(0, -1) < 0 else got[0]
    return out


def _produce(broker: Broker, topic: str, sizes: list[int], timestamps: bool) -> None:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=50, batch_size=1 << 20)
    try:
        i = 0
        for size in sizes:
            for _ in range(size):
                p.send(
                    topic,
                    value=b"x%d" % i,
                    partition=0,
                    timestamp_ms=BASE + 10 * i if timestamps else None,
                )
                i += 1
            p.flush(timeout=30)
    finally:
        p.close(timeout=10)


@pytest.mark.timeout(300)
@pytest.mark.matrix("list-offsets")
@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_list_offsets_start_and_high_watermark(broker: Broker, client: str) -> None:
    _require(client)
    topic = f"lo-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    assert query(client, broker, topic, [EARLIEST, LATEST]) == {EARLIEST: 0, LATEST: 0}, "empty"
    total = 0
    for size in (1, 7, 300):
        _produce(broker, topic, [size], timestamps=False)
        total += size
        assert query(client, broker, topic, [EARLIEST, LATEST]) == {EARLIEST: 0, LATEST: total}, (
            f"after a batch of {size}"
        )


@pytest.mark.timeout(300)
@pytest.mark.matrix("offsets-for-times")
@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_offsets_for_times(broker: Broker, client: str) -> None:
    _require(client)
    topic = f"ot-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    _produce(broker, topic, [300, 700], timestamps=True)
    past = BASE + 10 * (N - 1) + 1
    ats = [0, BASE, BASE + 1, BASE + 10 * 500, BASE + 10 * (N - 1), past]
    expected = {
        0: 0,
        BASE: 0,
        BASE + 1: 1,
        BASE + 10 * 500: 500,
        BASE + 10 * (N - 1): N - 1,
        past: NO_OFFSET.get(client),
    }
    assert query(client, broker, topic, ats) == expected

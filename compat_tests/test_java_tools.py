"""Apache Kafka's own Java command-line tools (4.x) against hyperkafka.

Each tool runs as `java -cp <jars>/* CLASS` (compat_tests/java_tools.py) against a
hyperkafka started here as `python -m broker serve` in a child process, once for the
module; every test uses topics of its own. The jars come from compat_tests/java/setup.sh;
without them (or java) these tests skip, and under CI=true they fail.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.harness import Broker, module_broker, new_broker
from compat_tests.java_tools import NOOP_FORMATTER, JavaTools, ToolFailed, require_java


@pytest.fixture(scope="module")
def java() -> JavaTools:
    return JavaTools(require_java())


@pytest.fixture(scope="module")
def hk(java: JavaTools) -> Iterator[Broker]:
    with module_broker("hk-javalab-", "the Java tests") as broker:
        yield broker


def _explain(hk: Broker) -> str:
    return f"\n--- hyperkafka log tail ---\n{hk.log_tail()}"


def keyed_lines(n: int, seed: int) -> bytes:
    """n lines "key<TAB>value\\n": varied lengths, ASCII and multi-byte UTF-8, empty values.

    Neither tab nor newline occurs inside a key or value (they are the separators the
    console producer splits on and the console consumer prints).
    """
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 -_.:;,!?/{}[]\"'#%&*+=<>|~^`@$()\\äöüßéñ€中文𝄞"
    out = []
    for i in range(n):
        key = f"k{i:05d}-{rng.randrange(1000)}"
        length = 0 if i % 997 == 0 else rng.choice((1, 8, 40, 200, 1000))
        value = "".join(rng.choice(alphabet) for _ in range(length))
        out.append(f"{key}\t{value}\n")
    return "".join(out).encode("utf-8")


# ------------------------------------------------------------------------- kafka-topics


@pytest.mark.matrix("admin-topics", client="java-tools")
def test_topics_create_list_describe_delete(java: JavaTools, hk: Broker) -> None:
    b = hk.bootstrap
    topic = "jt-topics"
    java.topics(b, "--create", "--topic", topic, "--partitions", "3", "--replication-factor", "1")
    listed = java.topics(b, "--list").text.split()
    assert topic in listed, f"--list gave {listed}" + _explain(hk)

    desc = java.topics(b, "--describe", "--topic", topic).text
    lines = [ln for ln in desc.splitlines() if ln.strip()]
    header = lines[0]
    assert f"Topic: {topic}" in header and "PartitionCount: 3" in header, desc
    assert "ReplicationFactor: 1" in header, desc
    assert "TopicId: AAAAAAAAAAAAAAAAAAAAAA" not in header, "topic id must be non-zero\n" + desc
    parts = [ln for ln in lines[1:] if "Partition:" in ln]
    assert len(parts) == 3, desc
    for i, ln in enumerate(parts):
        assert f"Partition: {i}" in ln and "Leader: 0" in ln and "Isr: 0" in ln, desc

    # Creating it again is an error the tool reports (TopicExistsException).
    again = java.topics(b, "--create", "--topic", topic, "--partitions", "1", check=False)
    assert again.returncode != 0 and b"already exists" in again.stderr + again.stdout, again.text

    java.topics(b, "--delete", "--topic", topic)
    # Deletion is asynchronous in Kafka; give the listing a few tries.
    for _ in range(20):
        if topic not in java.topics(b, "--list").text.split():
            break
        time.sleep(0.25)
    else:
        pytest.fail(f"{topic} still listed after --delete" + _explain(hk))

    gone = java.topics(b, "--describe", "--topic", topic, check=False)
    assert gone.returncode != 0, gone.text


@pytest.mark.matrix("describe-configs", client="java-tools")
def test_topics_create_with_config_and_describe_config(java: JavaTools, hk: Broker) -> None:
    b = hk.bootstrap
    topic = "jt-configs"
    java.topics(
        b, "--create", "--topic", topic, "--partitions", "1",
        "--config", "retention.ms=3600000", "--config", "max.message.bytes=2000000",
    )  # fmt: skip
    desc = java.topics(b, "--describe", "--topic", topic).text
    assert "retention.ms=3600000" in desc and "max.message.bytes=2000000" in desc, desc


# ------------------------------------------------------------- console producer/consumer

N_LINES = 10_000


@pytest.mark.timeout(240)
@pytest.mark.matrix("console 10k keyed lines (assign)", client="java-tools")
def test_console_roundtrip_assign_mode(java: JavaTools, hk: Broker) -> None:
    """10,000 keyed lines through the idempotent acks=-1 console producer, read back
    byte-exact by the console consumer in assign mode (no group)."""
    b = hk.bootstrap
    topic = "jt-console-assign"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    data = keyed_lines(N_LINES, seed=5)
    java.console_producer(
        b, topic, data,
        reader_props={"parse.key": "true", "key.separator": "\t"},
        producer_props={"enable.idempotence": "true", "linger.ms": "5"},
    )  # fmt: skip
    res = java.console_consumer(
        b, topic, partition=0, offset="earliest", max_messages=N_LINES, timeout_ms=30_000,
        formatter_props={"print.key": "true", "key.separator": "\t"},
    )  # fmt: skip
    assert res.processed() == N_LINES, res.stderr_tail() + _explain(hk)
    if res.stdout != data:
        got, want = res.stdout.splitlines(), data.splitlines()
        first = next(
            (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
            min(len(got), len(want)),
        )
        pytest.fail(
            f"console consumer output differs: {len(got)} lines vs {len(want)}; first "
            f"difference at line {first}: {got[first:first + 1]!r} != {want[first:first + 1]!r}"
        )
    assert java.end_offsets(b, topic) == {0: N_LINES}


N_CODEC_LINES = 2000


@pytest.mark.timeout(180)
@pytest.mark.matrix("rt-{codec}", client="java-tools")
@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_console_roundtrip_per_codec(java: JavaTools, hk: Broker, codec: str) -> None:
    """Keyed lines through the console producer with compression.type=codec, read back
    byte-exact by the console consumer: every codec the Java client has."""
    b = hk.bootstrap
    topic = f"jt-rt-{codec}"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    data = keyed_lines(N_CODEC_LINES, seed=40 + len(codec))
    java.console_producer(
        b, topic, data,
        reader_props={"parse.key": "true", "key.separator": "\t"},
        producer_props={"compression.type": codec, "linger.ms": "5"},
    )  # fmt: skip
    res = java.console_consumer(
        b, topic, partition=0, offset="earliest", max_messages=N_CODEC_LINES, timeout_ms=30_000,
        formatter_props={"print.key": "true", "key.separator": "\t"},
    )  # fmt: skip
    assert res.processed() == N_CODEC_LINES, res.stderr_tail() + _explain(hk)
    assert res.stdout == data, f"{codec}: console consumer output differs" + _explain(hk)


@pytest.mark.timeout(180)
@pytest.mark.matrix("read-by-other", client="java-tools")
def test_console_producer_read_by_kafka_python(java: JavaTools, hk: Broker, tmp_path: Path) -> None:
    """What the console producer wrote (gzip, keyed lines) is what kafka-python reads."""
    from compat_tests.clients import CLIENTS

    b = hk.bootstrap
    topic = "jt-read-by-other"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    data = keyed_lines(N_CODEC_LINES, seed=47)
    java.console_producer(
        b, topic, data,
        reader_props={"parse.key": "true", "key.separator": "\t"},
        producer_props={"compression.type": "gzip", "linger.ms": "5"},
    )  # fmt: skip
    want = [tuple(line.split(b"\t", 1)) for line in data.splitlines()]
    got, hwm = CLIENTS["kafka-python"].consume(hk, topic, len(want), tmp_path)
    assert [(r.key, r.value) for r in got] == want, f"kafka-python read {len(got)} records" + _explain(hk)
    assert [r.offset for r in got] == list(range(len(want))) and hwm == len(want)


@pytest.mark.timeout(180)
@pytest.mark.matrix("auto-create", client="java-tools")
def test_console_producer_auto_creates_topic(java: JavaTools, hk: Broker) -> None:
    """The Java producer's Metadata request creates a topic nobody created (Kafka's
    auto.create.topics.enable, hyperkafka's default too)."""
    b = hk.bootstrap
    topic = "jt-auto-created"
    data = keyed_lines(500, seed=53)
    java.console_producer(b, topic, data, reader_props={"parse.key": "true", "key.separator": "\t"})
    assert java.end_offsets(b, topic) == {0: 500}, _explain(hk)
    res = java.console_consumer(
        b, topic, partition=0, offset="earliest", max_messages=500, timeout_ms=30_000,
        formatter_props={"print.key": "true", "key.separator": "\t"},
    )  # fmt: skip
    assert res.stdout == data, res.stderr_tail() + _explain(hk)


@pytest.mark.timeout(300)
@pytest.mark.matrix("restart-acks-all", client="java-tools")
def test_console_records_survive_a_restart(java: JavaTools, tmp_path: Path) -> None:
    """acks=-1 console records are all there after SIGTERM and a restart, and the offsets
    go on where they stopped (a broker of its own: the module's keeps running)."""
    b = new_broker(tmp_path)
    b.start()
    try:
        topic = "jt-restart"
        first, more = keyed_lines(2000, seed=59), keyed_lines(300, seed=61)
        props = {"parse.key": "true", "key.separator": "\t"}
        java.console_producer(b.bootstrap, topic, first, reader_props=props, acks="-1")
        assert b.stop() == 0, b.log_tail()
        b.start()
        java.console_producer(b.bootstrap, topic, more, reader_props=props, acks="-1")
        assert java.end_offsets(b.bootstrap, topic) == {0: 2300}, b.log_tail()
        res = java.console_consumer(
            b.bootstrap, topic, partition=0, offset="earliest", max_messages=2300, timeout_ms=30_000,
            formatter_props={"print.key": "true", "key.separator": "\t"},
        )  # fmt: skip
        assert res.stdout == first + more, res.stderr_tail() + b.log_tail()
        assert b.stop() == 0, b.log_tail()
    finally:
        b.kill()


@pytest.mark.timeout(240)
@pytest.mark.matrix("console 10k keyed lines (group)", client="java-tools")
def test_console_roundtrip_group_mode(java: JavaTools, hk: Broker) -> None:
    """The same round trip with `--from-beginning` in a consumer group, then the group as
    kafka-consumer-groups sees it."""
    b = hk.bootstrap
    topic = "jt-console-group"
    group = "jt-console-group-g"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    data = keyed_lines(N_LINES, seed=6)
    java.console_producer(b, topic, data, reader_props={"parse.key": "true"})
    res = java.console_consumer(
        b, topic, group=group, from_beginning=True, max_messages=N_LINES, timeout_ms=60_000,
        formatter_props={"print.key": "true"},
        consumer_props={"enable.auto.commit": "true", "auto.commit.interval.ms": "100"},
        timeout=180,
    )  # fmt: skip
    assert res.processed() == N_LINES, res.stderr_tail()
    assert res.stdout == data
    groups = java.consumer_groups(b, "--list").text.split()
    assert group in groups, groups
    desc = java.consumer_groups(b, "--describe", "--group", group).text
    assert topic in desc, desc


# --------------------------------------------------------------------------- performance

PERF_RECORDS = 100_000
PERF_SIZE = 1024


@pytest.mark.timeout(300)
@pytest.mark.matrix("producer-perf 100k x 1 KiB", client="java-tools")
def test_producer_performance_then_console_count(java: JavaTools, hk: Broker) -> None:
    b = hk.bootstrap
    topic = "jt-perf"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    res = java.producer_perf(
        b, topic, num_records=PERF_RECORDS, record_size=PERF_SIZE,
        producer_props={"acks": "-1", "linger.ms": "5", "batch.size": "262144"},
    )  # fmt: skip
    summary = res.text.strip().splitlines()[-1]
    print(f"\nProducerPerformance: {summary}")
    assert summary.startswith(f"{PERF_RECORDS} records sent"), res.text[-2000:]
    assert java.end_offsets(b, topic) == {0: PERF_RECORDS}
    count = java.console_consumer(
        b, topic, partition=0, offset="earliest", timeout_ms=10_000,
        formatter=NOOP_FORMATTER, timeout=180,
    )  # fmt: skip
    assert count.processed() == PERF_RECORDS, count.stderr_tail() + _explain(hk)


@pytest.mark.timeout(240)
@pytest.mark.matrix("consumer-perf (group)", client="java-tools")
def test_consumer_performance(java: JavaTools, hk: Broker) -> None:
    b = hk.bootstrap
    topic = "jt-consumer-perf"
    java.topics(b, "--create", "--topic", topic, "--partitions", "1")
    java.producer_perf(b, topic, num_records=20_000, record_size=512)
    res = java.consumer_perf(b, topic, num_records=20_000, group="jt-perf-g", timeout_ms=60_000)
    lines = [ln for ln in res.text.splitlines() if ln.strip()]
    # header line, then one data line: start, end, MB, MB/s, records, records/s, ...
    fields = [f.strip() for f in lines[-1].split(",")]
    assert int(fields[4]) == 20_000, res.text


@pytest.mark.matrix("kafka-consumer-groups", client="java-tools")
def test_consumer_groups_list_empty_then_describe_missing(java: JavaTools, hk: Broker) -> None:
    b = hk.bootstrap
    java.consumer_groups(b, "--list")
    missing = java.consumer_groups(b, "--describe", "--group", "jt-no-such-group", check=False)
    assert b"does not exist" in missing.stdout + missing.stderr, missing.text


@pytest.mark.matrix("kafka-topics error exit", client="java-tools")
def test_tool_failure_is_typed(java: JavaTools, hk: Broker) -> None:
    with pytest.raises(ToolFailed):
        java.topics(hk.bootstrap, "--describe", "--topic", "jt-never-created")

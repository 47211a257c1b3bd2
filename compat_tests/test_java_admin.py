"""The admin tools of Apache Kafka (4.x, each a Java AdminClient user) against hyperkafka:
kafka-configs (IncrementalAlterConfigs, DescribeConfigs), kafka-topics --alter
(CreatePartitions), kafka-delete-records (DeleteRecords), kafka-log-dirs
(DescribeLogDirs) and kafka-acls (DescribeAcls). Every change that persists is checked
again after the broker restarted on the same data dir.

The broker runs as `python -m broker serve` in a child process (compat_tests/harness.py);
the tools as `java -cp <jars>/* CLASS` (compat_tests/java_tools.py). Without the jars (or
java) these tests skip, and under CI=true they fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.harness import Broker, module_broker
from compat_tests.java_tools import JavaTools, require_java

CONFIG_COMMAND = "kafka.admin.ConfigCommand"
LOG_DIRS_COMMAND = "org.apache.kafka.tools.LogDirsCommand"
DELETE_RECORDS_COMMAND = "org.apache.kafka.tools.DeleteRecordsCommand"
ACL_COMMAND = "org.apache.kafka.tools.AclCommand"


@pytest.fixture(scope="module")
def java() -> JavaTools:
    return JavaTools(require_java())


@pytest.fixture(scope="module")
def hk(java: JavaTools) -> Iterator[Broker]:
    with module_broker("hk-javaadmin-", "the Java admin tests") as broker:
        yield broker


def restart(hk: Broker) -> None:
    assert hk.stop() == 0, hk.log_tail()
    hk.start()


def configs(java: JavaTools, hk: Broker, topic: str, *args: str, check: bool = True) -> str:
    r = java.run(
        CONFIG_COMMAND,
        [
            "--bootstrap-server",
            hk.bootstrap,
            "--entity-type",
            "topics",
            "--entity-name",
            topic,
            *args,
        ],
        check=check,
    )
    return r.text + r.stderr.decode("utf-8", "replace")


def test_kafka_configs_alter_persists(java: JavaTools, hk: Broker) -> None:
    topic = "ja-configs"
    java.topics(hk.bootstrap, "--create", "--topic", topic, "--partitions", "1")
    configs(
        java, hk, topic, "--alter", "--add-config", "retention.ms=1234567,max.message.bytes=300000"
    )
    desc = configs(java, hk, topic, "--describe")
    assert "retention.ms=1234567" in desc and "max.message.bytes=300000" in desc, desc
    refused = configs(
        java, hk, topic, "--alter", "--add-config", "cleanup.policy=shred", check=False
    )
    assert "cleanup.policy" in refused and "Invalid value shred" in refused, refused
    configs(java, hk, topic, "--alter", "--delete-config", "max.message.bytes")
    restart(hk)
    desc = configs(java, hk, topic, "--describe")
    assert "retention.ms=1234567" in desc and "max.message.bytes" not in desc, desc
    assert "cleanup.policy=shred" not in desc, desc


def test_kafka_topics_alter_partitions_persists(java: JavaTools, hk: Broker) -> None:
    topic = "ja-grow"
    java.topics(hk.bootstrap, "--create", "--topic", topic, "--partitions", "1")
    java.topics(hk.bootstrap, "--alter", "--topic", topic, "--partitions", "4")
    shrink = java.topics(
        hk.bootstrap, "--alter", "--topic", topic, "--partitions", "2", check=False
    )
    assert (
        shrink.returncode != 0 and b"higher than the requested 2" in shrink.stdout + shrink.stderr
    ), shrink.text
    restart(hk)
    desc = java.topics(hk.bootstrap, "--describe", "--topic", topic).text
    assert "PartitionCount: 4" in desc, desc
    java.console_producer(hk.bootstrap, topic, b"a\nb\nc\nd\ne\nf\ng\nh\n")
    assert sum(java.end_offsets(hk.bootstrap, topic).values()) == 8


def test_kafka_delete_records_persists(java: JavaTools, hk: Broker, tmp_path: Path) -> None:
    topic = "ja-delete"
    java.topics(hk.bootstrap, "--create", "--topic", topic, "--partitions", "1")
    java.console_producer(
        hk.bootstrap,
        topic,
        b"".join(b"line %d\n" % i for i in range(10)),
        producer_props={"batch.size": "1", "linger.ms": "0"},
    )
    assert java.end_offsets(hk.bootstrap, topic) == {0: 10}
    spec = tmp_path / "offsets.json"
    spec.write_text(
        json.dumps({"version": 1, "partitions": [{"topic": topic, "partition": 0, "offset": 4}]})
    )
    out = java.run(
        DELETE_RECORDS_COMMAND,
        ["--bootstrap-server", hk.bootstrap, "--offset-json-file", str(spec)],
    ).text
    assert "low_watermark: 4" in out, out
    assert java.end_offsets(hk.bootstrap, topic, time_spec="-2") == {0: 4}
    restart(hk)
    assert java.end_offsets(hk.bootstrap, topic, time_spec="-2") == {0: 4}
    assert java.end_offsets(hk.bootstrap, topic) == {0: 10}


def test_kafka_log_dirs_describe(java: JavaTools, hk: Broker) -> None:
    topic = "ja-logdirs"
    java.topics(hk.bootstrap, "--create", "--topic", topic, "--partitions", "2")
    java.console_producer(hk.bootstrap, topic, b"x\n" * 20)
    out = java.run(
        LOG_DIRS_COMMAND, ["--bootstrap-server", hk.bootstrap, "--describe", "--topic-list", topic]
    ).text
    doc = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    dirs = doc["brokers"][0]["logDirs"]
    assert len(dirs) == 1 and dirs[0]["error"] is None, doc
    sizes = {p["partition"]: p["size"] for p in dirs[0]["partitions"]}
    assert set(sizes) == {f"{topic}-0", f"{topic}-1"} and sum(sizes.values()) > 0, doc


def test_kafka_acls_list_without_security(java: JavaTools, hk: Broker) -> None:
    r = java.run(ACL_COMMAND, ["--bootstrap-server", hk.bootstrap, "--list"], check=False)
    out = r.text + r.stderr.decode("utf-8", "replace")
    # as against Kafka without an authorizer: SECURITY_DISABLED, reported by the tool
    assert "SecurityDisabledException" in out, out

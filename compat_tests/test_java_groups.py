"""kafka-consumer-groups (Apache Kafka's Java tool) on a group that has commits.

A group with offsets committed (30 of 50 records on each of 4 partitions, through
kafka-python) and no live members:

- `--describe --group G` shows every partition with CURRENT-OFFSET 30, LOG-END-OFFSET 50
  and LAG 20;
- `--reset-offsets --to-offset 10 --dry-run` prints the plan and changes nothing;
- `--reset-offsets --to-earliest --execute` moves every commit to 0 (read back through
  kafka-python's admin client), and `--describe` then shows LAG 50;
- `--delete --group G` removes the group: `--list` no longer shows it.

(test_java_tools.py covers `--list` on an empty broker and `--describe` of a missing
group.) Imports the standard library, pytest and the compat_tests modules.
"""

from __future__ import annotations

import uuid

import pytest

from compat_tests.clients import create_topic
from compat_tests.harness import Broker
from compat_tests.java_tools import JavaTools, require_java
from compat_tests.test_groups import PARTITIONS, committed, produce


@pytest.fixture(scope="module")
def java() -> JavaTools:
    return JavaTools(require_java())


def _commit(broker: Broker, group: str, topic: str, offset: int) -> None:
    from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition

    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    try:
        c.commit({TopicPartition(topic, p): OffsetAndMetadata(offset, "", -1) for p in range(PARTITIONS)})
    finally:
        c.close()


def _describe_rows(java: JavaTools, broker: Broker, group: str, topic: str) -> dict[int, tuple[str, str, str]]:
    """partition -> (CURRENT-OFFSET, LOG-END-OFFSET, LAG) from `--describe --group G`."""
    res = java.consumer_groups(broker.bootstrap, "--describe", "--group", group)
    rows: dict[int, tuple[str, str, str]] = {}
    for line in res.stdout.decode().splitlines():
        cols = line.split()
        if len(cols) >= 6 and cols[0] == group and cols[1] == topic:
            rows[int(cols[2])] = (cols[3], cols[4], cols[5])
    assert rows, f"no rows for {topic} in --describe:\n{res.text}"
    return rows


@pytest.mark.timeout(240)
@pytest.mark.matrix("group-admin list/describe/offsets", client="java-tools")
def test_consumer_groups_describe_reset_and_delete(java: JavaTools, broker: Broker) -> None:
    tag = uuid.uuid4().hex[:8]
    topic, group = f"jg-{tag}", f"jg-group-{tag}"
    create_topic(broker, topic, PARTITIONS)
    produce(broker, topic, 50 * PARTITIONS, tag)
    _commit(broker, group, topic, 30)

    assert _describe_rows(java, broker, group, topic) == dict.fromkeys(range(PARTITIONS), ("30", "50", "20"))

    plan = java.consumer_groups(
        broker.bootstrap, "--reset-offsets", "--group", group, "--topic", topic, "--to-offset", "10", "--dry-run"
    )
    assert "NEW-OFFSET" in plan.stdout.decode(), plan.text
    assert committed(broker, group) == dict.fromkeys(range(PARTITIONS), 30), "--dry-run changed the commits"

    java.consumer_groups(
        broker.bootstrap, "--reset-offsets", "--group", group, "--topic", topic, "--to-earliest", "--execute"
    )
    assert committed(broker, group) == dict.fromkeys(range(PARTITIONS), 0)
    assert _describe_rows(java, broker, group, topic) == dict.fromkeys(range(PARTITIONS), ("0", "50", "50"))

    java.consumer_groups(broker.bootstrap, "--delete", "--group", group)
    listed = java.consumer_groups(broker.bootstrap, "--list").stdout.decode().split()
    assert group not in listed, listed

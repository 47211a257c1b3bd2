"""Administration of a quorum-signed topic whose first writer is dead, as real processes
(docs/clusters.md "Quorum-signed partitions", broker/placed_topics.py): three brokers on
one etcd with quorum-signed partitions on (compat_tests/quorum_cluster.py), a topic of
replication factor 3 written by broker 1, which is killed (SIGKILL), or paused (SIGSTOP)
past the session timeout; once a failover elected another leader, confluent-kafka's
AdminClient alters the topic's configs (IncrementalAlterConfigs) and deletes it
(DeleteTopics) through a surviving broker, and both succeed without the writer. Broker 1
back (restarted with its data dir, or SIGCONT): the topic stays deleted on every broker
and its files are gone from broker 1's data dir; a topic of the same name created
afterwards is intact on every broker."""

from __future__ import annotations

import json
import signal
import textwrap
import time
from pathlib import Path

import pytest

from compat_tests.harness import Broker
from compat_tests.quorum_cluster import py, quorum_cluster, topics_listed, wait
from compat_tests.test_cluster_failover import CREATE, FETCH, LEADER

SESSION_MS = 4000
TOPIC = "admin-q"

PRODUCE = textwrap.dedent(
    """
    import sys
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": sys.argv[1], "acks": "all", "enable.idempotence": True,
                  "message.timeout.ms": 60000})
    for i in range(int(sys.argv[4])):
        p.produce(sys.argv[2], b"%s-%03d" % (sys.argv[3].encode(), i))
    assert p.flush(60) == 0
    print("ok")
    """
)

ALTER = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry,
                                       ConfigResource, ResourceType)
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    r = ConfigResource(ResourceType.TOPIC, sys.argv[2], incremental_configs=[
        ConfigEntry("retention.ms", "7654321", incremental_operation=AlterConfigOpType.SET)])
    for f in a.incremental_alter_configs([r]).values():
        f.result(30)
    print("ok")
    """
)

# The topic's overrides as one broker describes them (the request goes to that broker).
DESCRIBE = textwrap.dedent(
    """
    import json, sys
    import trio
    from broker.mirror import kafka_request
    host, port = sys.argv[1].split(":")
    async def main():
        r = await kafka_request(host, int(port), 32, 4, "describe_configs", {
            "resources": [{"resource_type": 2, "resource_name": sys.argv[2],
                           "configuration_keys": None}],
            "include_synonyms": False, "include_documentation": False})
        res = r.results[0]
        print(json.dumps({"error": int(res.error_code),
                          "configs": {e.name: e.value for e in res.configs if e.config_source == 1}}))
    trio.run(main)
    """
)

DELETE = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    for f in a.delete_topics([sys.argv[2]], operation_timeout=10).values():
        f.result(30)
    print("ok")
    """
)


def _values(b: Broker) -> list[str] | None:
    try:
        return json.loads(py(FETCH, b.bootstrap, TOPIC, timeout=30))["values"]  # type: ignore[no-any-return]
    except AssertionError:
        return None  # (not attached there yet, say)


def _lacks(b: Broker) -> bool:
    """Whether `b` answers Metadata without the topic."""
    listed = topics_listed(b)
    return listed is not None and TOPIC not in listed


def _leader(b: Broker) -> int | None:
    try:
        out = json.loads(py(LEADER, b.bootstrap, TOPIC, timeout=30))
    except AssertionError:
        return None
    return int(out["leader"]) if out["error"] is None else None


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_a_topic_whose_writer_is_dead_is_altered_and_deleted(workdir: Path, how: str) -> None:
    with quorum_cluster(workdir, SESSION_MS) as cluster:
        b1, b2, b3 = cluster.brokers
        assert py(CREATE, b1.bootstrap, TOPIC) == "ok"
        assert b1.data_dir is not None and (b1.data_dir / f"{TOPIC}-0" / "manifest").exists()
        assert py(PRODUCE, b1.bootstrap, TOPIC, "old", "20") == "ok"
        old = [f"old-{i:03d}" for i in range(20)]
        for b in (b2, b3):
            wait(f"broker {b.port} holds the records", lambda b=b: _values(b) == old)  # type: ignore[misc]
        listed = topics_listed(b2)
        assert listed is not None and TOPIC in listed
        old_id = listed[TOPIC]
        assert b1.proc is not None
        if how == "kill":
            b1.kill()
        else:
            b1.proc.send_signal(signal.SIGSTOP)
        killed = time.monotonic()
        wait("a failover elected 2 or 3", lambda: _leader(b2) in (2, 3), timeout=60)
        print(f"failover: {time.monotonic() - killed:.1f} s after the {how} (session {SESSION_MS / 1000:.0f} s)")
        # altered through a survivor: written into the topic's etcd record, described everywhere
        t0 = time.monotonic()
        assert py(ALTER, b2.bootstrap, TOPIC) == "ok"
        print(f"IncrementalAlterConfigs without the writer: {time.monotonic() - t0:.2f} s")
        for b in (b2, b3):
            out = json.loads(py(DESCRIBE, b.bootstrap, TOPIC))
            assert out == {"error": 0, "configs": {"retention.ms": "7654321"}}, out
        # deleted through a survivor
        t0 = time.monotonic()
        assert py(DELETE, b3.bootstrap, TOPIC) == "ok"
        print(f"DeleteTopics without the writer: {time.monotonic() - t0:.2f} s")
        for b in (b2, b3):
            wait(f"broker {b.port} dropped it", lambda b=b: _lacks(b))  # type: ignore[misc]
        for b in (b2, b3):
            assert b.data_dir is not None
            assert not list(b.data_dir.rglob(f"{TOPIC}-*")), list(b.data_dir.rglob(f"{TOPIC}-*"))
        # the writer back (data dir kept; or resumed, its lease long gone): it deletes its own
        # copy, serves it nowhere
        if how == "kill":
            b1.start()
        else:
            b1.proc.send_signal(signal.SIGCONT)
        wait("broker 1 deletes its files of the topic", lambda: not (b1.data_dir / f"{TOPIC}-0").exists())
        wait("broker 1 does not list it", lambda: _lacks(b1))
        time.sleep(3)  # (its mirrors reconnected to it meanwhile: nothing comes back)
        for b in (b1, b2, b3):
            listed = topics_listed(b)
            assert listed is not None and TOPIC not in listed, (b.port, listed)
        assert not list(b1.data_dir.rglob(f"{TOPIC}-*"))
        # a topic of the same name, created afterwards, is intact on every broker
        assert py(CREATE, b1.bootstrap, TOPIC) == "ok"
        assert py(PRODUCE, b2.bootstrap, TOPIC, "new", "10") == "ok"
        new = [f"new-{i:03d}" for i in range(10)]
        for b in (b1, b2, b3):
            wait(f"broker {b.port} holds the new topic", lambda b=b: _values(b) == new)  # type: ignore[misc]
            listed = topics_listed(b)
            assert listed is not None and listed.get(TOPIC) not in (None, old_id), listed
            out = json.loads(py(DESCRIBE, b.bootstrap, TOPIC))
            assert out == {"error": 0, "configs": {}}, out

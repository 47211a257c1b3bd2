"""Cluster mode as real processes: three brokers listed in one cluster config.

Each broker's server.properties names all three (`hyperkafka.cluster.brokers`), its own
rack, a replication port, and a short `replica.lag.time.max.ms` so that the ISR shrinks
within the test. One scenario, in steps that build on each other:

1. Topics are created through a broker that is not the controller (confluent's
   AdminClient routes CreateTopics to the controller Metadata names), one of them with
   min.insync.replicas=2.
2. Metadata from every broker, read by kcat, kafka-python and confluent-kafka: three
   brokers with their racks, controller 1, and for each partition leader 1 (the writer),
   replicas 1,2,3 and, once the mirrors caught up, isr 1,2,3.
3. A librdkafka consumer with client.rack=rack-2, bootstrapped at the leader only, is
   sent to broker 2 (KIP-392 preferred_read_replica): its debug log shows the fetches
   going to broker 2, and it keeps consuming while the leader is stopped (SIGSTOP), which
   only a follower can serve.
4. acks=all with min.insync.replicas=2 succeeds while the mirrors are up; with both
   mirrors SIGKILLed it fails with NOT_ENOUGH_REPLICAS_AFTER_APPEND, the ISR shrinks to
   the leader no sooner than replica.lag.time.max.ms after the kill, and the next
   acks=all produce is refused with NOT_ENOUGH_REPLICAS before it is written. acks=1
   still succeeds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.harness import ROOT, Broker

LAG_MS = 5000  # short, to see the ISR shrink; long enough for a loaded CI machine
N_BATCHES = 120

ADMIN = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    fs = a.create_topics([NewTopic("acks", 1, 3, config={"min.insync.replicas": "2"}),
                          NewTopic("racked", 1, 3)], operation_timeout=10)
    for name, f in fs.items():
        f.result(20)
    print("created")
    """
)

# Every broker's view, as confluent-kafka and kafka-python report it, as JSON.
METADATA = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka.admin import AdminClient
    from kafka import KafkaAdminClient
    bootstrap = sys.argv[1]
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    out = {"confluent": {
        "brokers": sorted([b.id, b.host, b.port] for b in md.brokers.values()),
        "controller": md.controller_id,
        "topics": {t: [[p.id, p.leader, list(p.replicas), list(p.isrs)]
                       for p in sorted(md.topics[t].partitions.values(), key=lambda p: p.id)]
                   for t in ("acks", "racked") if t in md.topics},
    }}
    kp = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    cluster = kp.describe_cluster()
    out["kafka-python"] = {
        "brokers": sorted([b["broker_id"], b["host"], b["port"], b["rack"]] for b in cluster["brokers"]),
        "controller": cluster["controller_id"],
        "topics": {t["name"]: [[p["partition_index"], p["leader_id"], list(p["replica_nodes"]), list(p["isr_nodes"])]
                               for p in t["partitions"]]
                   for t in kp.describe_topics(["acks", "racked"])},
    }
    kp.close()
    print(json.dumps(out))
    """
)

PRODUCE = textwrap.dedent(
    """
    import json, sys, time
    from confluent_kafka import Producer
    bootstrap, topic, acks, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    p = Producer({"bootstrap.servers": bootstrap, "acks": acks, "retries": 0, "linger.ms": 0,
                  "request.timeout.ms": 30000, "message.timeout.ms": 60000})
    results = []
    def done(err, msg):
        results.append(err.name() if err is not None else "NONE")
    t0 = time.monotonic()
    for i in range(n):
        p.produce(topic, value=b"record-%05d" % i, key=b"k%d" % i, partition=0, on_delivery=done)
        p.flush(60)  # one batch per record
    print(json.dumps({"results": results, "seconds": time.monotonic() - t0}))
    """
)

# Consumes `n` records with client.rack set; after the first record it tells the test
# (a line on stdout) and goes on; its librdkafka fetch log says which broker served.
RACK_CONSUMER = textwrap.dedent(
    """
    import json, logging, sys
    from confluent_kafka import Consumer, TopicPartition
    bootstrap, topic, rack, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log = logging.getLogger("rdkafka")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "rack-test", "client.rack": rack,
                  "enable.auto.commit": False, "debug": "fetch,topic",
                  "fetch.max.bytes": 1024, "message.max.bytes": 1000, "max.partition.fetch.bytes": 64,
                  "fetch.wait.max.ms": 100}, logger=log)
    c.assign([TopicPartition(topic, 0, 0)])
    got = []
    told = False
    while len(got) < n:
        m = c.poll(20)
        if m is None:
            break
        if m.error():
            continue
        got.append(m.value().decode())
        if not told:
            print("FIRST", flush=True)
            sys.stdin.readline()  # the test stopped the leader meanwhile
            told = True
    c.close()
    json.dump({"values": got, "log": [l for l in lines if "Fetch topic" in l or "preferred" in l]}, open(out, "w"))
    """
)


def _py(code: str, *args: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], timeout=timeout, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _properties(path: Path, node_id: int, rack: str, ports: list[int], rport: int) -> Path:
    brokers = ",".join(f"{i + 1}@127.0.0.1:{p}" for i, p in enumerate(ports))
    path.write_text(textwrap.dedent(f"""\
        node.id={node_id}
        broker.rack={rack}
        hyperkafka.cluster.brokers={brokers}
        hyperkafka.replication.listen=127.0.0.1:{rport}
        replica.lag.time.max.ms={LAG_MS}
        """))
    return path


def _metadata(b: Broker) -> dict[str, Any]:
    return json.loads(_py(METADATA, b.bootstrap))  # type: ignore[no-any-return]


def _kcat_isr(kcat: harness.Kcat, b: Broker, topic: str) -> tuple[str, str, str] | None:
    out = kcat.run(["-L", "-b", b.bootstrap, "-t", topic], timeout=30).stdout.decode()
    m = re.search(r"partition 0, leader (\d+), replicas: ([\d,]+), isrs: ([\d,]+)", out)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def _wait(what: str, check, timeout: float = 30, every: float = 0.3):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last})")


@pytest.mark.timeout(180)
@pytest.mark.matrix("cluster: 3 brokers, metadata/isr, acks=all min.insync, KIP-392 rack fetch", client="kcat+confluent+kafka-python")
def test_three_broker_cluster(workdir: Path) -> None:
    kcat, why = harness.find_kcat("new")
    if kcat is None:
        kcat, why = harness.find_kcat("old")
    harness.require(kcat is not None, why)
    assert kcat is not None
    ports = [harness.free_port() for _ in range(3)]
    rports = [harness.free_port() for _ in range(3)]
    racks = ["rack-1", "rack-2", "rack-3"]
    brokers: list[Broker] = []
    stopped: list[int] = []
    try:
        for i in range(3):
            props = _properties(workdir / f"b{i + 1}.properties", i + 1, racks[i], ports, rports[i])
            brokers.append(harness.new_broker(workdir / f"broker-{i + 1}", port=ports[i],
                                              extra=("--config", str(props))))
        for b in brokers:
            b.start()
        leader, m2, m3 = brokers

        # 1. topics created through broker 3, which is not the controller
        assert "created" in _py(ADMIN, m3.bootstrap)

        # 2. every broker's Metadata: three brokers, racks, controller, leader/replicas/isr
        want_brokers = [[i + 1, "127.0.0.1", p] for i, p in enumerate(ports)]
        for b in brokers:
            def full_isr(b: Broker = b) -> dict[str, Any] | None:
                md = _metadata(b)
                ok = all(md[client]["topics"].get(t) == [[0, 1, [1, 2, 3], [1, 2, 3]]]
                         for client in ("confluent", "kafka-python") for t in ("acks", "racked"))
                return md if ok else None

            md = _wait(f"isr 1,2,3 in {b.bootstrap}'s Metadata", full_isr)
            assert md["confluent"]["brokers"] == want_brokers
            assert md["confluent"]["controller"] == 1
            assert md["kafka-python"]["brokers"] == [[*w, r] for w, r in zip(want_brokers, racks, strict=True)]
            assert md["kafka-python"]["controller"] == 1
            assert _kcat_isr(kcat, b, "acks") == ("1", "1,2,3", "1,2,3")

        # 3. KIP-392: a consumer in rack-2 reads from broker 2, even with the leader stopped
        produced = json.loads(_py(PRODUCE, leader.bootstrap, "racked", "all", str(N_BATCHES)))
        assert produced["results"] == ["NONE"] * N_BATCHES, produced
        _wait("broker 2 back in the ISR of racked",
              lambda: _kcat_isr(kcat, leader, "racked") == ("1", "1,2,3", "1,2,3"))
        out = workdir / "rack-consumer.json"
        consumer = subprocess.Popen([sys.executable, "-c", RACK_CONSUMER, leader.bootstrap, "racked", "rack-2",
                                     str(N_BATCHES), str(out)], cwd=ROOT, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        assert consumer.stdin is not None and consumer.stdout is not None
        try:
            assert consumer.stdout.readline().strip() == "FIRST"
            assert leader.proc is not None
            os.kill(leader.proc.pid, signal.SIGSTOP)
            stopped.append(leader.proc.pid)
            consumer.stdin.write("go\n")
            consumer.stdin.flush()
            assert consumer.wait(60) == 0
        finally:
            if consumer.poll() is None:
                consumer.kill()
            if leader.proc is not None and leader.proc.pid in stopped:
                os.kill(leader.proc.pid, signal.SIGCONT)
                stopped.remove(leader.proc.pid)
        got = json.loads(out.read_text())
        assert got["values"] == [f"record-{i:05d}" for i in range(N_BATCHES)], got["values"][-3:]
        b2 = f"127.0.0.1:{ports[1]}/2"
        assert any("preferred replica" in line and "to 2" in line for line in got["log"]), got["log"][:20]
        served_by_2 = [line for line in got["log"] if f"[thrd:{b2}]" in line and "Fetch topic racked" in line]
        assert len(served_by_2) >= N_BATCHES // 2, got["log"][-20:]

        # 4. acks=all with min.insync.replicas=2
        ok = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "3"))
        assert ok["results"] == ["NONE"] * 3, ok
        for m in (m2, m3):
            m.kill()
        killed = time.monotonic()
        after = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "1"))
        assert after["results"] == ["NOT_ENOUGH_REPLICAS_AFTER_APPEND"], after
        shrunk = _wait("isr shrinks to the leader", lambda: _kcat_isr(kcat, leader, "acks") == ("1", "1,2,3", "1"),
                       timeout=LAG_MS / 1000 + 20, every=0.1)
        assert shrunk
        waited = time.monotonic() - killed
        assert waited >= LAG_MS / 1000 * 0.95, f"isr shrank {waited:.2f}s after the kill, before replica.lag.time.max.ms"
        refused = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "1"))
        assert refused["results"] == ["NOT_ENOUGH_REPLICAS"], refused
        assert refused["seconds"] < LAG_MS / 1000, refused  # refused before the append, not after a wait
        one = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "1", "1"))
        assert one["results"] == ["NONE"], one
        print(f"\n  isr shrank {waited:.2f}s after both mirrors were killed (replica.lag.time.max.ms={LAG_MS})",
              file=sys.stderr)
    except BaseException:
        for b in brokers:
            print(f"--- {b.bootstrap}\n{b.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for b in brokers:
            try:
                b.stop()
            except harness.BrokerError:
                b.kill()

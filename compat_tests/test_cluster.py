"""Cluster mode as real processes: three brokers on one etcd (compat_tests/etcd.py).

Each broker's server.properties names the etcd (`hyperkafka.cluster.etcd.endpoints`), its
own rack, a replication port, and a short `replica.lag.time.max.ms` so that the ISR shrinks
within the test. Broker 1 starts first, so etcd elects it controller. One scenario, in
steps that build on each other, with quorum-signed partitions switched off
(`hyperkafka.quorum.partitions.enable=false`): it covers single-signer topics in a cluster,
whose writes wait for their writer:

1. Topics are created through a broker that is not the controller (confluent's
   AdminClient routes CreateTopics to the controller Metadata names), one of them with
   min.insync.replicas=2, each with a replica assignment that names broker 1 first (so
   the controller places them on broker 1: Kafka's preferred leader).
2. Metadata from every broker, read by kcat, kafka-python and confluent-kafka: three
   brokers with their racks, controller 1, and for each partition leader 1 (the writer),
   replicas 1,2,3 and, once the mirrors caught up, isr 1,2,3.
3. A librdkafka consumer with client.rack=rack-2, bootstrapped at the leader only, is
   sent to broker 2 (KIP-392 preferred_read_replica): its debug log shows the fetches
   going to broker 2, and it keeps consuming while the leader is stopped (SIGSTOP), which
   only a follower can serve.
4. Failover: the writer, also the controller, is SIGKILLed. Once its peers find its port
   refusing connections and revoke its etcd lease (broker/cluster/liveness.py; without
   that evidence, once it expires: broker.session.timeout.ms) Metadata from the others (confluent, kafka-python, kcat)
   no longer lists it, names the newly elected controller (2 or 3, whichever etcd
   elected) and, for its partitions, leader 2 with isr 2,3 (offline replica 1). A
   confluent consumer group (coordinated by the new controller) reads every acknowledged
   record from broker 2's verified copy, byte for byte; CreateTopics goes to the new
   controller and succeeds there; a producer's send to the dead writer's topic is
   refused with NOT_LEADER_OR_FOLLOWER, retried, and delivered once the writer is
   restarted and leads again. Committed offsets survive it: a group whose partition of
   __consumer_offsets broker 1 coordinates (groups are sharded as Kafka's) read part of
   the topic and committed on broker 1; it resumes through brokers 2/3 exactly after its
   commit (the controller moved the partition to 2 or 3, which adopted broker 1's state
   from its copy of broker 1's offsets archive), commits more there, and resumes after
   that commit once broker 1 is back (the partition moves back to broker 1, its
   preferred coordinator, which adopts that commit; OffsetFetch, from the consumer and
   the admin, agrees each time).
5. acks=all with min.insync.replicas=2 succeeds while the mirrors are up; with both
   mirrors SIGSTOPped (alive, their leases kept, not fetching: a killed one would leave
   every ISR at once, as Kafka's controller fences a dead broker) it fails with
   NOT_ENOUGH_REPLICAS_AFTER_APPEND, the ISR shrinks to
   the leader no sooner than replica.lag.time.max.ms after the stop, and the next
   acks=all produce is refused with NOT_ENOUGH_REPLICAS before it is written. acks=1
   still succeeds.

A second scenario, with two brokers: Java's kafka-clients consumer (kafka-console-consumer)
with client.rack=rack-2, bootstrapped at the leader, is sent to broker 2 (its FetchCollector
logs the preferred read replica) and reads every record there, the last ones with the
leader stopped; its topic is quorum-signed (the default).
"""

from __future__ import annotations

import hashlib
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

from broker.cluster.shards import partition_for
from compat_tests import harness
from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import ROOT, Broker
from compat_tests.java_tools import CONSOLE_CONSUMER, JavaTools, require_java

ETCD_MISSING = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; scripts/test does it as root)"

LAG_MS = 5000  # short, to see the ISR shrink; long enough for a loaded CI machine
# Kafka's default; the stopped mirrors of step 5 keep their leases at least 2/3 of it
# (one keep-alive period may have passed), past LAG_MS: they leave the ISR by the lag rule,
# not as dead brokers. The SIGKILL of step 4 is evident at once (its port refuses).
SESSION_MS = 9000
N_FAILOVER = 200
# A group whose partition of __consumer_offsets (50, the default) prefers broker 1:
# partition p prefers [1, 2, 3][p % 3].
RESUME = next(g for g in (f"resume-{i}" for i in range(100)) if partition_for(g, 50) % 3 == 0)
N_RESUME = (50, 100)  # records the group reads before broker 1 dies, then on broker 2
N_BATCHES = 120

ADMIN = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    on_1 = [[1, 2, 3]]  # broker 1 first: the controller places each on broker 1
    fs = a.create_topics([NewTopic("acks", 1, replica_assignment=on_1, config={"min.insync.replicas": "2"}),
                          NewTopic("racked", 1, replica_assignment=on_1), NewTopic("failover", 1, replica_assignment=on_1)],
                         operation_timeout=10)
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
                   for t in ("acks", "racked", "failover") if t in md.topics},
    }}
    kp = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    cluster = kp.describe_cluster()
    out["kafka-python"] = {
        "brokers": sorted([b["broker_id"], b["host"], b["port"], b["rack"]] for b in cluster["brokers"]),
        "controller": cluster["controller_id"],
        "topics": {t["name"]: [[p["partition_index"], p["leader_id"], list(p["replica_nodes"]), list(p["isr_nodes"])]
                               for p in t["partitions"]]
                   for t in kp.describe_topics(["acks", "racked", "failover"])},
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


def _record(i: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """Record `i` of the failover topic: binary, of varied sizes, with a header."""
    value = hashlib.sha256(b"%d" % i).digest() * (1 + i % 40)
    return b"key-%d" % i, value, [("i", i.to_bytes(4, "big"))]


# Produces N_FAILOVER records (acks=all) and prints the acknowledged ones.
FAILOVER_PRODUCE = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka import Producer
    from compat_tests.test_cluster import _record
    bootstrap, n = sys.argv[1], int(sys.argv[2])
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    acked = []
    def done(err, msg):
        if err is None:
            acked.append(msg.offset())
    for i in range(n):
        key, value, headers = _record(i)
        p.produce("failover", value=value, key=key, headers=headers, partition=0, on_delivery=done)
    assert p.flush(60) == 0
    print(json.dumps(sorted(acked)))
    """
)

# A consumer group (coordinated by whichever broker is controller) reading the topic
# from the start: every record as [offset, key, value, headers], hex.
FAILOVER_CONSUME = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka import Consumer
    bootstrap, n = sys.argv[1], int(sys.argv[2])
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "failover-readers",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe(["failover"])
    got = []
    while len(got) < n:
        m = c.poll(30)
        if m is None:
            break
        if m.error():
            print(m.error(), file=sys.stderr)
            continue
        got.append([m.offset(), m.key().hex(), m.value().hex(), [[k, v.hex()] for k, v in m.headers() or []]])
    c.close()
    print(json.dumps(got))
    """
)

# A consumer of group `group` reads `n` records of the failover topic (from its committed
# offset; from the start if it has none), commits after the last one, and reads the
# commit back (OffsetFetch, as the consumer and an admin see it) and the group's
# coordinator: {"offsets", "committed", "admin", "coordinator"}.
GROUP_RESUME = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient
    bootstrap, group, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe(["failover"])
    got = []
    while len(got) < n:
        m = c.poll(30)
        if m is None:
            break
        if m.error():
            print(m.error(), file=sys.stderr)
            continue
        got.append(m.offset())
    if got:
        c.commit(offsets=[TopicPartition("failover", 0, got[-1] + 1)], asynchronous=False)
    committed = c.committed([TopicPartition("failover", 0)], timeout=30)[0].offset
    c.close()
    a = AdminClient({"bootstrap.servers": bootstrap})
    listed = a.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result(30)
    described = a.describe_consumer_groups([group])[group].result(30)
    print(json.dumps({"offsets": got, "committed": committed,
                      "admin": {f"{tp.topic}-{tp.partition}": tp.offset for tp in listed.topic_partitions},
                      "coordinator": described.coordinator.id}))
    """
)

# One send while the writer is dead: librdkafka is refused (NOT_LEADER_OR_FOLLOWER) and
# retries; it says RETRYING once it saw that, and reports the delivery when it comes.
PENDING_PRODUCE = textwrap.dedent(
    """
    import json, logging, sys, time
    from confluent_kafka import Producer
    bootstrap = sys.argv[1]
    refusals = []
    class Keep(logging.Handler):
        def emit(self, record):
            line = record.getMessage()
            if "Not leader" in line or "NOT_LEADER" in line:
                refusals.append(line)
    log = logging.getLogger("rdkafka")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 0, "debug": "msg,protocol",
                  "retry.backoff.ms": 200, "retry.backoff.max.ms": 500, "message.timeout.ms": 120000}, logger=log)
    results = []
    p.produce("failover", value=b"after-failover", key=b"late", partition=0,
              on_delivery=lambda err, msg: results.append([err.name() if err else "NONE", msg.offset()]))
    told = False
    deadline = time.monotonic() + 120
    while not results and time.monotonic() < deadline:
        p.poll(0.2)
        if refusals and not told:
            print("RETRYING", flush=True)
            told = True
    print(json.dumps({"results": results, "refusals": len(refusals), "sample": refusals[:2]}), flush=True)
    """
)

CONTROLLER = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient
    print(AdminClient({"bootstrap.servers": sys.argv[1]}).list_topics(timeout=10).controller_id)
    """
)

CREATE_ONE = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    for f in a.create_topics([NewTopic(sys.argv[2], 1, int(sys.argv[3]))], operation_timeout=10).values():
        f.result(20)
    print("created")
    """
)


def _py(code: str, *args: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], timeout=timeout, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _properties(path: Path, node_id: int, rack: str, etcd: EtcdServer, rport: int,
                quorum: bool = True) -> Path:
    path.write_text(textwrap.dedent(f"""\
        node.id={node_id}
        broker.rack={rack}
        hyperkafka.cluster.etcd.endpoints={etcd.endpoint}
        hyperkafka.replication.listen=127.0.0.1:{rport}
        replica.lag.time.max.ms={LAG_MS}
        broker.session.timeout.ms={SESSION_MS}
        hyperkafka.quorum.partitions.enable={str(quorum).lower()}
        """))
    return path


def _controller(b: Broker) -> int:
    """The controller `b`'s Metadata names (-1: none elected right now)."""
    out = _py(CONTROLLER, b.bootstrap, timeout=30)
    return int(out.strip())


def _metadata(b: Broker, timeout: float = 60) -> dict[str, Any]:
    return json.loads(_py(METADATA, b.bootstrap, timeout=timeout))  # type: ignore[no-any-return]


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


@pytest.mark.timeout(300)
@pytest.mark.matrix("cluster: 3 brokers, metadata/isr, failover of reads and controller, acks=all min.insync, KIP-392 rack fetch", client="kcat+confluent+kafka-python")
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
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    etcd = EtcdServer(workdir / "etcd")
    try:
        etcd.start()
        for i in range(3):
            # Single-signer topics on purpose (quorum partitions are on by default): this
            # scenario is their coverage, a writer's writes waiting for it through a kill
            # (step 4) and min.insync.replicas over mirrors (step 5); quorum-signed
            # failover is compat_tests/test_cluster_failover.py's.
            props = _properties(workdir / f"b{i + 1}.properties", i + 1, racks[i], etcd, rports[i],
                                quorum=False)
            brokers.append(harness.new_broker(workdir / f"broker-{i + 1}", port=ports[i],
                                              extra=("--config", str(props))))
        leader, m2, m3 = brokers
        leader.start()
        _wait("broker 1 elected controller", lambda: _controller(leader) == 1)
        m2.start()
        m3.start()

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
            # (the clients above may have been answered by another broker, whose view of
            # the writer's ISR is up to a probe interval older or newer than b's)
            _wait(f"kcat sees isr 1,2,3 through {b.bootstrap}",
                  lambda b=b: _kcat_isr(kcat, b, "acks") == ("1", "1,2,3", "1,2,3"), timeout=10)

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

        # 4. the writer (and controller) dies; reads fail over, writes wait for it
        acked = json.loads(_py(FAILOVER_PRODUCE, leader.bootstrap, str(N_FAILOVER)))
        assert acked == list(range(N_FAILOVER)), acked[-3:]
        _wait("failover topic in sync", lambda: _kcat_isr(kcat, leader, "failover") == ("1", "1,2,3", "1,2,3"))
        # a group consumes part of it and commits on broker 1, its coordinator (the
        # commit is answered once the in-sync brokers hold it)
        first = json.loads(_py(GROUP_RESUME, leader.bootstrap, RESUME, str(N_RESUME[0])))
        assert first == {"offsets": list(range(N_RESUME[0])), "committed": N_RESUME[0],
                         "admin": {"failover-0": N_RESUME[0]}, "coordinator": 1}, first
        leader.kill()  # SIGKILL
        killed = time.monotonic()
        survivors = [[i + 1, "127.0.0.1", p] for i, p in enumerate(ports) if i > 0]
        ctl = 0  # the controller etcd elects once broker 1's lease expired: 2 or 3
        for b in (m2, m3):
            def failed_over(b: Broker = b) -> dict[str, Any] | None:
                nonlocal ctl
                try:
                    md = _metadata(b, timeout=20)
                except (AssertionError, subprocess.TimeoutExpired):  # it tried the dead broker, still listed
                    return None
                if not ctl and md["confluent"]["controller"] in (2, 3):
                    ctl = md["confluent"]["controller"]  # (-1 while none is elected)
                ok = all([b[0] for b in md[client]["brokers"]] == [2, 3] and md[client]["controller"] == ctl in (2, 3)
                         and all(md[client]["topics"].get(t) == [[0, 2, [1, 2, 3], [2, 3]]]
                                 for t in ("acks", "racked", "failover"))
                         for client in ("confluent", "kafka-python"))
                return md if ok else None

            md = _wait(f"broker 1 out of {b.bootstrap}'s Metadata", failed_over, timeout=SESSION_MS / 1000 + 15)
            if b is m2:
                gone = time.monotonic() - killed
                assert gone <= SESSION_MS / 1000 + 10, gone
            assert md["confluent"]["brokers"] == survivors
            # Each broker hears of the lease's expiry through its own etcd watch, and the
            # clients above may have been answered by the other one: kcat, asking `b`
            # alone, waits for `b` to flip.
            _wait(f"kcat sees broker 2 lead failover through {b.bootstrap}",
                  lambda b=b: _kcat_isr(kcat, b, "failover") == ("2", "1,2,3", "2,3"), timeout=10)
        # every acknowledged record, read from broker 2's verified copy by a group that
        # the new controller coordinates
        got = json.loads(_py(FAILOVER_CONSUME, m3.bootstrap, str(N_FAILOVER)))
        want = [[i, k.hex(), v.hex(), [[hk, hv.hex()] for hk, hv in h]]
                for i, (k, v, h) in ((i, _record(i)) for i in acked)]
        assert got == want, (len(got), got[-1:])
        # the group resumes on the new coordinator (it took over broker 1's commits):
        # exactly after the committed offset, nothing read again, nothing skipped; it
        # commits more there
        done = N_RESUME[0]
        second = json.loads(_py(GROUP_RESUME, f"{m2.bootstrap},{m3.bootstrap}", RESUME, str(N_RESUME[1])))
        assert second["coordinator"] in (2, 3), second
        assert second == {"offsets": list(range(done, done + N_RESUME[1])), "committed": done + N_RESUME[1],
                          "admin": {"failover-0": done + N_RESUME[1]}, "coordinator": second["coordinator"]}, second
        done += N_RESUME[1]
        # topics are created on the controller (two brokers are registered: a factor of 2)
        assert "created" in _py(CREATE_ONE, m3.bootstrap, "made-while-1-is-down", "2")
        # a send to the dead writer's topic: refused (retriable) until it is back, then delivered
        pending = subprocess.Popen([sys.executable, "-c", PENDING_PRODUCE, f"{m2.bootstrap},{m3.bootstrap}"],
                                   cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert pending.stdout is not None
        try:
            assert pending.stdout.readline().strip() == "RETRYING"
            leader.start()
            _wait("broker 1 leads again", lambda: (_kcat_isr(kcat, m3, "failover") or ("",))[0] == "1")
            late = json.loads(pending.stdout.read())
            assert pending.wait(30) == 0
        finally:
            if pending.poll() is None:
                pending.kill()
        assert late["results"] == [["NONE", N_FAILOVER]], late
        assert late["refusals"] >= 1, late
        # broker 1 back is not controller (etcd's election stands) but coordinates the
        # group again (its preferred partition moved back): the group, asked through
        # broker 1, resumes after the commit made on 2 or 3, to the late record
        third = json.loads(_py(GROUP_RESUME, leader.bootstrap, RESUME, str(N_FAILOVER + 1 - done)))
        assert third == {"offsets": list(range(done, N_FAILOVER + 1)), "committed": N_FAILOVER + 1,
                         "admin": {"failover-0": N_FAILOVER + 1}, "coordinator": 1}, third
        print(f"\n  broker 1 left Metadata {gone:.2f}s after SIGKILL (its lease revoked on the evidence; "
              f"broker.session.timeout.ms={SESSION_MS}); "
              f"the send waiting for it was delivered after {late['refusals']} refusal line(s)", file=sys.stderr)

        # 5. acks=all with min.insync.replicas=2
        _wait("the restarted leader's isr is full again",
              lambda: _kcat_isr(kcat, leader, "acks") == ("1", "1,2,3", "1,2,3"))
        ok = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "3"))
        assert ok["results"] == ["NONE"] * 3, ok
        for m in (m2, m3):
            assert m.proc is not None
            os.kill(m.proc.pid, signal.SIGSTOP)
            stopped.append(m.proc.pid)
        killed = time.monotonic()
        after = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "1"))
        assert after["results"] == ["NOT_ENOUGH_REPLICAS_AFTER_APPEND"], after
        shrunk = _wait("isr shrinks to the leader", lambda: _kcat_isr(kcat, leader, "acks") == ("1", "1,2,3", "1"),
                       timeout=LAG_MS / 1000 + 20, every=0.1)
        assert shrunk
        waited = time.monotonic() - killed
        assert waited >= LAG_MS / 1000 * 0.95, f"isr shrank {waited:.2f}s after the stop, before replica.lag.time.max.ms"
        refused = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "all", "1"))
        assert refused["results"] == ["NOT_ENOUGH_REPLICAS"], refused
        assert refused["seconds"] < LAG_MS / 1000, refused  # refused before the append, not after a wait
        one = json.loads(_py(PRODUCE, leader.bootstrap, "acks", "1", "1"))
        assert one["results"] == ["NONE"], one
        print(f"\n  isr shrank {waited:.2f}s after both mirrors were stopped (replica.lag.time.max.ms={LAG_MS})",
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
        etcd.stop()


# The Java tools' log4j2 configuration, plus the consumer's fetch decisions at DEBUG.
JAVA_FETCH_LOG4J = """\
status = error
appender.stderr.type = Console
appender.stderr.name = STDERR
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = %d{HH:mm:ss.SSS} %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = STDERR
logger.collector.name = org.apache.kafka.clients.consumer.internals.FetchCollector
logger.collector.level = debug
logger.fetch.name = org.apache.kafka.clients.consumer.internals.AbstractFetch
logger.fetch.level = debug
"""


@pytest.mark.timeout(180)
@pytest.mark.matrix("cluster: KIP-392 fetch from follower by client.rack", client="java-tools")
def test_java_consumer_fetches_from_its_rack(workdir: Path) -> None:
    java = JavaTools(require_java())
    kcat, why = harness.find_kcat("new")
    if kcat is None:
        kcat, why = harness.find_kcat("old")
    harness.require(kcat is not None, why)
    assert kcat is not None
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    ports = [harness.free_port() for _ in range(2)]
    etcd = EtcdServer(workdir / "etcd")
    brokers = [harness.new_broker(workdir / f"broker-{i + 1}", port=ports[i], extra=(
        "--config", str(_properties(workdir / f"b{i + 1}.properties", i + 1, f"rack-{i + 1}", etcd, harness.free_port()))))
        for i in range(2)]
    stopped: list[int] = []
    n = 60
    try:
        etcd.start()
        leader = brokers[0]
        leader.start()
        _wait("broker 1 elected controller", lambda: _controller(leader) == 1)
        brokers[1].start()
        assert "created" in _py(CREATE_ONE, leader.bootstrap, "java-rack", "2")  # placed on 1, the least loaded
        produced = json.loads(_py(PRODUCE, leader.bootstrap, "java-rack", "all", str(n)))
        assert produced["results"] == ["NONE"] * n, produced
        _wait("broker 2 in the ISR", lambda: _kcat_isr(kcat, leader, "java-rack") == ("1", "1,2", "1,2"))
        config = workdir / "log4j2-fetch.properties"
        config.write_text(JAVA_FETCH_LOG4J)
        args = ["--bootstrap-server", leader.bootstrap, "--topic", "java-rack", "--partition", "0",
                "--offset", "earliest", "--max-messages", str(n), "--timeout-ms", "60000"]
        for k, v in {"client.rack": "rack-2", "max.partition.fetch.bytes": "64", "fetch.max.bytes": "64"}.items():
            args += ["--command-property", f"{k}={v}"]
        argv = [f"-Dlog4j2.configurationFile={config}" if a.startswith("-Dlog4j2.configurationFile=") else a
                for a in java.command(CONSOLE_CONSUMER, args, jvm=java.fast_start)]
        err_path = workdir / "java-consumer.log"
        with err_path.open("w") as err_file:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                    start_new_session=True)
        assert proc.stdout is not None
        try:
            # once the leader sent it to broker 2, stop the leader: only broker 2 can serve
            _wait("the Java consumer sent to broker 2", lambda: "Updating preferred read replica for partition "
                  "java-rack-0 to 2" in err_path.read_text(), timeout=60, every=0.05)
            assert leader.proc is not None
            os.kill(leader.proc.pid, signal.SIGSTOP)
            stopped.append(leader.proc.pid)
            lines = [proc.stdout.readline() for _ in range(n)]
            # every record is in; let the leader answer the consumer's goodbye (a fetch
            # session close, which would otherwise wait for request.timeout.ms)
            os.kill(leader.proc.pid, signal.SIGCONT)
            stopped.remove(leader.proc.pid)
            out = "".join(lines) + proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log = err_path.read_text().splitlines()
        assert out.splitlines() == [f"record-{i:05d}" for i in range(n)], (out[-300:], log[-20:])
        assert any("preferred read replica for partition java-rack-0 to 2" in line for line in log), log[-20:]
        at_2 = [line for line in log if "fetch request for partition java-rack-0" in line
                and f"to node 127.0.0.1:{ports[1]} (id: 2 " in line]
        assert len(at_2) >= n // 2, log[-20:]
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
        etcd.stop()

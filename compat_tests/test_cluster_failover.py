"""The failover of a quorum-signed partition, as real processes (docs/clusters.md
"Failover", broker/takeover.py): three brokers on one etcd with quorum-signed
partitions on (compat_tests/quorum_cluster.py), a topic of replication factor 3 written
by broker 1, and an idempotent acks=all confluent-kafka producer writing it all along.

1. SIGKILL of the leader mid-stream: its peers find its port refusing connections and
   revoke its lease (broker/cluster/liveness.py), the controller has the replicas vote,
   the elected one takes its copy over, and the producer writes again within the
   session timeout (the failover time, from the kill to the first acknowledgement after
   it, is printed and checked). Every record the producer had acknowledged is read
   back from the new leader exactly once and in order, and nothing was lost or written
   twice: the log is every record produced, in order.
   The other replica's copy follows the new leader to the same records.
2. The same with SIGSTOP of the leader past the session timeout, then SIGCONT: the old
   leader, back, must not acknowledge anything (the replicas promised the new epoch and
   take proposals from the new leader only), its Metadata names the new leader, the
   producer's requests stuck at it are retried at the new leader, and it steps down:
   its archive, reopened as a replica, follows the new leader to the same records.
3. SIGKILL of the leader as in 1, then SIGSTOP of the other replica past the session
   timeout, then SIGCONT: the elected leader's commits find no quorum (its head is
   refused NOT_ENOUGH_REPLICAS_AFTER_APPEND, the partition goes offline), and once the
   replica is back the same leader takes the partition back on its own, with no
   election (no lease of a leader was lost): the producer writes again and every check
   of 1 holds.
4. SIGKILL of the leader as in 1, then SIGKILL of the elected leader and its restart at
   once, with the peers' evidence of death off (as when a host reboots: nothing refuses,
   so the old lease still lives when it registers again): the controller sees it registered again since its
   election and has the replicas (it among them) vote again, the new leader writes in
   epoch 2, and the producer writes again within the session timeout and a few seconds
   (before, the restarted leader never took the partition back and, alive, was never
   failed over: no leader for good); every check of 1 holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from compat_tests.harness import ROOT, Broker
from compat_tests.quorum_cluster import (
    QuorumCluster,
    py,
    quorum_cluster,
    stopped,
    wait,
    wait_listed,
)

SESSION_MS = 4000
RESTART_BOUND_S = 6.0  # a restarted leader's partition writes again within SESSION_MS + this
TOPIC = "failover"
GRACE_S = 0.5
PROPOSAL_TIMEOUT_S = 5.0  # broker/quorum_link.py: a replica's answer to one proposal

CREATE = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient, NewTopic
    a = AdminClient({"bootstrap.servers": sys.argv[1]})
    for f in a.create_topics([NewTopic(sys.argv[2], 1, 3)], operation_timeout=10).values():
        f.result(20)
    print("ok")
    """
)

# An idempotent acks=all producer writing r-000000, r-000001, ... about 100 a second until
# SIGTERM; one JSON line per delivery report (acknowledged: value, offset, time), then the
# count produced once everything is flushed.
PRODUCE = textwrap.dedent(
    """
    import json, signal, sys, time
    from confluent_kafka import Producer
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    def error(err):
        print(json.dumps({"error": str(err), "fatal": err.fatal()}), flush=True)
    p = Producer({"bootstrap.servers": sys.argv[1], "enable.idempotence": True, "acks": "all",
                  "linger.ms": 5, "request.timeout.ms": 5000, "socket.timeout.ms": 6000,
                  "message.timeout.ms": 120000,
                  "retry.backoff.ms": 100, "topic.metadata.refresh.interval.ms": 1000,
                  "error_cb": error})
    def report(err, msg):
        if err is None:
            print(json.dumps({"v": msg.value().decode(), "o": msg.offset(), "t": time.time()}), flush=True)
        else:
            print(json.dumps({"v": msg.value().decode(), "err": str(err)}), flush=True)
    i = 0
    while not stop:
        p.produce(sys.argv[2], b"r-%06d" % i, on_delivery=report)
        i += 1
        p.poll(0.01)
    left = p.flush(100)
    print(json.dumps({"done": i, "left": left}), flush=True)
    """
)

# Every record of partition 0, read from its leader up to the high watermark.
CONSUME = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka import Consumer, TopicPartition, OFFSET_BEGINNING
    c = Consumer({"bootstrap.servers": sys.argv[1], "group.id": "check", "enable.auto.commit": False,
                  "enable.partition.eof": True})
    lo, hi = c.get_watermark_offsets(TopicPartition(sys.argv[2], 0), timeout=20)
    c.assign([TopicPartition(sys.argv[2], 0, OFFSET_BEGINNING)])
    out = []
    while True:
        m = c.poll(20)
        assert m is not None, "no record nor end of partition in 20 s"
        if m.error():
            if m.error().code() == -191 and (not out or out[-1][1] >= hi - 1):  # _PARTITION_EOF
                break
            assert m.error().code() == -191, m.error()
            continue
        out.append((m.value().decode(), m.offset()))
    c.close()
    print(json.dumps({"values": [v for v, _ in out], "offsets": [o for _, o in out], "hw": hi}))
    """
)

# Fetch from one broker, whoever leads: the values it holds up to its high watermark.
FETCH = textwrap.dedent(
    """
    import json, sys
    import trio
    from broker.mirror import kafka_request
    from broker.protocol import records
    host, port = sys.argv[1].split(":")
    async def main():
        out, offset, hw = [], 0, None
        while hw is None or offset < hw:
            r = await kafka_request(host, int(port), 1, 12, "fetch", {
                "replica_id": -1, "max_wait_ms": 0, "min_bytes": 0, "max_bytes": 1 << 24,
                "isolation_level": 0, "session_id": 0, "session_epoch": -1, "rack_id": "",
                "forgotten_topics_data": [], "topics": [{"topic": sys.argv[2], "partitions": [{
                    "partition": 0, "current_leader_epoch": -1, "fetch_offset": offset,
                    "last_fetched_epoch": -1, "log_start_offset": -1,
                    "partition_max_bytes": 1 << 24}]}]})
            p = r.responses[0].partitions[0]
            assert p.error_code == 0, p.error_code
            hw = p.high_watermark
            got = [(r.offset, r.value.decode()) for b in records.split_batches(bytes(p.records or b""))
                   for r in records.decode_records(b)]
            if not got:
                break
            out += [v for o, v in got if o >= offset]
            offset = got[-1][0] + 1
        print(json.dumps({"values": out, "hw": hw}))
    trio.run(main)
    """
)

LEADER = textwrap.dedent(
    """
    import json, sys
    from confluent_kafka.admin import AdminClient
    md = AdminClient({"bootstrap.servers": sys.argv[1]}).list_topics(sys.argv[2], timeout=10)
    p = md.topics[sys.argv[2]].partitions[0]
    print(json.dumps({"leader": p.leader, "error": str(p.error) if p.error else None}))
    """
)


LEADER_EPOCH = textwrap.dedent(
    """
    import json, sys
    import trio
    from broker.mirror import kafka_request
    host, port = sys.argv[1].split(":")
    async def main():
        md = await kafka_request(host, int(port), 3, 9, "metadata", {
            "topics": [{"name": sys.argv[2]}], "allow_auto_topic_creation": False,
            "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False})
        p = md.topics[0].partitions[0]
        print(json.dumps([p.leader_id, p.leader_epoch, p.error_code]))
    trio.run(main)
    """
)


def _leader_epoch(b: Broker) -> tuple[int, int] | None:
    """(leader, leader epoch) of partition 0 as `b`'s Metadata says (Metadata v7+)."""
    try:
        out = json.loads(py(LEADER_EPOCH, b.bootstrap, TOPIC, timeout=30))
    except (AssertionError, subprocess.TimeoutExpired):
        return None
    return (int(out[0]), int(out[1])) if out[2] == 0 else None


def _leader(b: Broker) -> int | None:
    try:
        out = json.loads(py(LEADER, b.bootstrap, TOPIC, timeout=30))
    except (AssertionError, subprocess.TimeoutExpired):
        return None
    return int(out["leader"]) if out["error"] is None else None


def _lines(path: Path) -> list[dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip().endswith("}")]


def _run(cluster: QuorumCluster, workdir: Path, how: str) -> None:
    b1 = cluster.brokers[0]
    assert py(CREATE, b1.bootstrap, TOPIC) == "ok"
    assert b1.data_dir is not None and (b1.data_dir / f"{TOPIC}-0" / "manifest").exists()
    out = workdir / "producer.out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with out.open("w") as sink:
        producer = subprocess.Popen([sys.executable, "-c", PRODUCE, cluster.bootstrap, TOPIC],
                                    stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env=env)  # fmt: skip
    new_leader = cluster.brokers[1]
    try:
        def acked() -> list[dict[str, Any]]:
            return [r for r in _lines(out) if "o" in r]

        wait("the producer's first 200 acknowledgements", lambda: len(acked()) >= 200, timeout=90)
        assert b1.proc is not None
        b2, b3 = cluster.brokers[1:]
        leaders: list[int | None] = []
        with contextlib.ExitStack() as paused:  # a SIGSTOPped leader: SIGCONT at its end
            if how.startswith("kill"):
                lost_at = time.time()
                b1.kill()
            else:
                lost_at = paused.enter_context(stopped(b1))
            # (answers already on the wire when the leader was lost arrive within
            # milliseconds: an acknowledgement GRACE_S later comes from the new leader)
            wait("an acknowledgement after the failover",
                 lambda: [r for r in acked() if r["t"] > lost_at + GRACE_S], timeout=60)  # fmt: skip
            first = min(r["t"] for r in acked() if r["t"] > lost_at + GRACE_S)
            print(f"failover ({how}): the producer writes again {first - lost_at:.2f} s after the "
                  f"leader was lost (session timeout {SESSION_MS / 1000:.1f} s)")  # fmt: skip
            if how in ("kill", "kill+stall"):  # its death is evident: no lease to wait for
                assert first - lost_at < SESSION_MS / 1000, first - lost_at

            def named() -> bool:
                leaders[:] = [_leader(b2), _leader(b3)]
                return leaders[0] == leaders[1] and leaders[0] in (2, 3)

            wait("both replicas name the same new leader", named, timeout=30)
            new_leader = cluster.brokers[leaders[0] - 1]  # type: ignore[operator]
        if how == "stop":
            wait_listed("the old leader back in the cluster", b2, [1, 2, 3])
            wait("the old leader names the new one", lambda: _leader(b1) == leaders[0], timeout=30)
        n = len(acked())
        wait("200 more acknowledgements", lambda: len(acked()) >= n + 200, timeout=60)
        if how == "kill+stall":
            other = next(b for b in (b2, b3) if b is not new_leader)
            with stopped(other) as stalled_at:
                wait_listed("the replica's lease gone", new_leader, [leaders[0]], timeout=30)
                time.sleep(PROPOSAL_TIMEOUT_S)  # the leader's commit in flight gives up meanwhile
            back_at = time.time()
            wait_listed("the replica back in the cluster", new_leader, [2, 3], timeout=30)
            n = len(acked())
            wait("200 acknowledgements after the stall", lambda: len(acked()) >= n + 200, timeout=90)
            first = min(r["t"] for r in acked()[n:])
            print(f"stalled replica: the producer writes again {first - stalled_at:.2f} s after "
                  f"it was stopped, {first - back_at:.2f} s after it was continued; same leader "
                  f"{_leader(other)}")  # fmt: skip
            assert _leader(other) == leaders[0]  # no election: the same leader
        if how == "kill+restart":
            new_leader.kill()
            new_leader.start()  # at once: its lease of before the kill still lives
            restarted_at = time.time()
            n = len(acked())
            wait("acknowledgements after the restart",
                 lambda: [r for r in acked()[n:] if r["t"] > restarted_at + GRACE_S], timeout=60)  # fmt: skip
            first = min(r["t"] for r in acked()[n:] if r["t"] > restarted_at + GRACE_S)
            print(f"restarted leader: the producer writes again {first - restarted_at:.2f} s after "
                  f"it was restarted (session timeout {SESSION_MS / 1000:.1f} s)")  # fmt: skip
            assert first - restarted_at < SESSION_MS / 1000 + RESTART_BOUND_S, first - restarted_at
            wait("200 acknowledgements after the restart", lambda: len(acked()) >= n + 200, timeout=60)
            epochs: list[tuple[int, int] | None] = []

            def named_again() -> bool:
                epochs[:] = [_leader_epoch(b2), _leader_epoch(b3)]
                return epochs[0] == epochs[1] and epochs[0] is not None and epochs[0][1] >= 2

            wait("both replicas name a leader in epoch 2 or later", named_again, timeout=30)
            new_leader = cluster.brokers[epochs[0][0] - 1]  # type: ignore[index]
    finally:
        producer.send_signal(signal.SIGTERM)
        try:
            producer.wait(120)
        except subprocess.TimeoutExpired:
            producer.kill()
            producer.wait()
    lines = _lines(out)
    done = [r for r in lines if "done" in r]
    assert done and done[0]["left"] == 0, lines[-5:]
    failed = [r for r in lines if "err" in r or r.get("fatal")]
    assert not failed, failed[:5]
    acks = [r for r in lines if "o" in r]
    assert len(acks) == done[0]["done"]  # every record produced was acknowledged

    got = json.loads(py(CONSUME, new_leader.bootstrap, TOPIC, timeout=120))
    values = got["values"]
    produced = [f"r-{i:06d}" for i in range(done[0]["done"])]
    # once each, in order, nothing lost, nothing written twice
    assert len(values) == len(set(values)), "a record was written twice"
    assert values == produced, (len(values), len(produced), sorted(set(produced) - set(values))[:5])
    assert got["offsets"] == list(range(len(values)))
    # every acknowledgement named the offset the record has in the new leader's log
    at = {v: o for v, o in zip(values, got["offsets"], strict=True)}
    assert all(at[r["v"]] == r["o"] for r in acks), [r for r in acks if at[r["v"]] != r["o"]][:5]
    # every other copy follows the new leader: the other replica, and the old leader
    # back as a replica (its tail no quorum signed cut)
    copies = [b for b in cluster.brokers if b is not new_leader and b.proc is not None]
    assert len(copies) == (2 if how == "stop" else 1)
    for b in copies:
        wait(f"broker {b.port}'s copy follows the new leader",
             lambda b=b: json.loads(py(FETCH, b.bootstrap, TOPIC)) == {"values": values, "hw": len(values)},
             timeout=30)  # fmt: skip


def _scenario(how: str, scenario: str, timeout_s: int) -> Any:
    return pytest.param(how, marks=[pytest.mark.timeout(timeout_s), pytest.mark.matrix(scenario, client="confluent")],
                        id=how)  # fmt: skip


@pytest.mark.parametrize("how", [
    # 1. SIGKILL of the leader
    _scenario("kill", "cluster: quorum-signed partition, its leader SIGKILLed under an idempotent acks=all producer",
              300),
    # 2. SIGSTOP of the leader past the session timeout
    _scenario("stop", "cluster: quorum-signed partition, its leader SIGSTOPped past the session timeout, then SIGCONT",
              300),
    # 3. SIGKILL of the leader, then SIGSTOP of the elected leader's only live replica
    _scenario("kill+stall", "cluster: quorum-signed partition, its elected leader's only live replica SIGSTOPped "
              "past the session timeout", 360),
    # 4. SIGKILL of the leader, then SIGKILL of the elected leader and its restart at once
    _scenario("kill+restart", "cluster: quorum-signed partition, its elected leader SIGKILLed and restarted at once",
              360),
])  # fmt: skip
def test_failover(workdir: Path, how: str) -> None:
    # kill+restart: the path of a leader back on a new lease while its old one lives
    props = {"hyperkafka_cluster_death_evidence_enable": "false"} if how == "kill+restart" else {}
    with quorum_cluster(workdir, SESSION_MS, **props) as cluster:
        _run(cluster, workdir, how)

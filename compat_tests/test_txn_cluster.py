"""Transactions in a cluster (issue 21): three brokers on one etcd, librdkafka's
exactly-once consume-transform-produce (confluent-kafka, send_offsets_to_transaction).

Three input and three output topics, each written by another broker (a replica assignment
naming it first), so every transaction writes into partitions of all three brokers; the
transactional id is coordinated by broker 2 (its partition of __transaction_state prefers
broker 2) and the consumer group by broker 3 (its partition of __consumer_offsets prefers
broker 3), so TxnOffsetCommit goes to another broker than EndTxn, and the markers of every
transaction go from broker 2 to brokers 1 and 3 (WriteTxnMarkers), the group's to broker 3.
Every fourth transaction is aborted and its input read again.

1. `test_exactly_once_across_three_brokers`: once every input was processed, a
   read_committed consumer of the outputs reads every input exactly once and no aborted
   record (a read_uncommitted one does see the aborted ones: aborts happened), and the
   group's committed offsets are the inputs' ends.
2. `test_exactly_once_through_a_coordinator_kill`: the same, with broker 2 (the
   transactional id's coordinator) SIGKILLed mid-stream. The controller moves the id's
   partition of __transaction_state to broker 1 or 3, which adopts broker 2's state from
   its copy of broker 2's archive; the producer re-inits there (a new epoch), the loop
   reads again from the group's committed offsets, and broker 2 is restarted (its data
   partitions take writes again; the partition moves back to it, which adopts again).
   The same checks hold: no committed transaction lost, none half visible.

Imports the standard library, pytest, trio, confluent_kafka, the broker's pure shard
hash and the client side of broker-to-broker requests (broker/mirror.py), and the
compat_tests modules.
"""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.cluster.shards import partition_for
from compat_tests import harness
from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import Broker

ck = pytest.importorskip("confluent_kafka")
ck_admin = pytest.importorskip("confluent_kafka.admin")

ETCD_MISSING = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; scripts/test does it as root)"
SESSION_MS = 6000  # a killed broker's lease (and its coordinators) expire after this
N_PER_INPUT = 120
INPUTS = ["eos-in-1", "eos-in-2", "eos-in-3"]  # written by brokers 1, 2, 3
OUTPUTS = ["eos-out-1", "eos-out-2", "eos-out-3"]
# Partition p of an internal topic (50 partitions, the default) prefers broker [1, 2, 3][p % 3].
TID = next(t for t in (f"eos-tid-{i}" for i in range(200)) if partition_for(t, 50) % 3 == 1)  # broker 2
GROUP = next(g for g in (f"eos-group-{i}" for i in range(200)) if partition_for(g, 50) % 3 == 2)  # broker 3


def _output_of(topic: str, value: bytes) -> str:
    """Record i of in-k goes to out-(k+i+1): every batch of inputs writes into the
    partitions of all three brokers."""
    k, i = INPUTS.index(topic), int(value.rsplit(b":", 1)[1])
    return OUTPUTS[(k + i + 1) % 3]


@dataclass
class TxnCluster:
    etcd: EtcdServer
    brokers: list[Broker]

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)


@contextlib.contextmanager
def txn_cluster(workdir: Path) -> Iterator[TxnCluster]:
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    brokers: list[Broker] = []
    etcd = EtcdServer(workdir / "etcd")
    try:
        etcd.start()
        for i in range(3):
            path = workdir / f"b{i + 1}.properties"
            path.write_text(textwrap.dedent(f"""\
                node.id={i + 1}
                hyperkafka.cluster.etcd.endpoints={etcd.endpoint}
                hyperkafka.replication.listen=127.0.0.1:{harness.free_port()}
                broker.session.timeout.ms={SESSION_MS}
                replica.lag.time.max.ms=5000
                transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
                """))  # fmt: skip
            brokers.append(harness.new_broker(workdir / f"broker-{i + 1}", port=harness.free_port(),
                                              extra=("--config", str(path))))  # fmt: skip
        brokers[0].start()
        _wait("broker 1 is controller", lambda: _controller(brokers[0]) == 1)
        brokers[1].start()
        brokers[2].start()
        cluster = TxnCluster(etcd, brokers)
        _wait("three brokers listed", lambda: _broker_ids(brokers[0]) == [1, 2, 3])
        _create_topics(cluster)
        _wait("the transactional id's coordinator is broker 2", lambda: _txn_coordinator(brokers[0], TID) == 2, 60)
        yield cluster
    finally:
        for b in brokers:
            b.kill()
        etcd.stop()


def _wait(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # a broker not answering yet
            last = exc
        if last is True or (last and not isinstance(last, Exception)):
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last!r})")


def _admin(b: Broker) -> Any:
    return ck_admin.AdminClient({"bootstrap.servers": b.bootstrap})


def _controller(b: Broker) -> int:
    return int(_admin(b).list_topics(timeout=10).controller_id)


def _broker_ids(b: Broker) -> list[int]:
    return sorted(_admin(b).list_topics(timeout=10).brokers)


def _create_topics(cluster: TxnCluster) -> None:
    admin = _admin(cluster.brokers[0])
    topics = []
    for k in range(3):
        on_k = [[k + 1] + [i + 1 for i in range(3) if i != k]]  # broker k+1 first: its writer
        topics += [ck_admin.NewTopic(INPUTS[k], 1, replica_assignment=on_k),
                   ck_admin.NewTopic(OUTPUTS[k], 1, replica_assignment=on_k)]
    for f in admin.create_topics(topics, operation_timeout=20).values():
        f.result(30)

    def leaders() -> bool:
        md = admin.list_topics(timeout=10)
        return all(t in md.topics and md.topics[t].partitions[0].leader == (INPUTS + OUTPUTS).index(t) % 3 + 1
                   for t in INPUTS + OUTPUTS)

    _wait("every topic led by its writer", leaders)


def _txn_coordinator(b: Broker, tid: str) -> int:
    """The broker FindCoordinator(key_type=1) names, asked of `b` (-1: none now)."""
    from broker.mirror import kafka_request

    async def ask() -> Any:
        return await kafka_request(b.host, b.port, 10, 4, "find_coordinator",
                                   {"key_type": 1, "coordinator_keys": [tid]})

    resp = trio.run(ask)
    (c,) = resp.coordinators
    return int(c.node_id) if c.error_code == 0 else -1


def _produce_inputs(cluster: TxnCluster) -> dict[str, list[bytes]]:
    p = ck.Producer({"bootstrap.servers": cluster.bootstrap, "acks": "all", "enable.idempotence": True})
    sent: dict[str, list[bytes]] = {}
    for topic in INPUTS:
        values = [f"{topic}:{i:04d}".encode() for i in range(N_PER_INPUT)]
        for v in values:
            p.produce(topic, v)
        sent[topic] = values
    assert p.flush(60) == 0
    return sent


def _new_producer(cluster: TxnCluster) -> Any:
    p = ck.Producer({"bootstrap.servers": cluster.bootstrap, "transactional.id": TID,
                     "transaction.timeout.ms": 60000, "message.timeout.ms": 60000})
    deadline = time.monotonic() + 90
    while True:
        try:
            p.init_transactions(30)
            return p
        except ck.KafkaException as exc:
            if time.monotonic() > deadline or exc.args[0].fatal():
                raise
            time.sleep(0.5)  # a retriable error (the coordinator moving): again


def _rewind(c: Any) -> None:
    """Back to the group's committed offsets (read_committed: require_stable waits for a
    transaction still completing), which is exactly what committed transactions consumed."""
    parts = c.assignment()
    for tp in c.committed(parts, timeout=60):
        c.seek(ck.TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else ck.OFFSET_BEGINNING))


def _transform(cluster: TxnCluster, on_round: Callable[[int], None] = lambda _r: None,
               timeout_s: float = float(os.environ.get("HK_TXN_CLUSTER_S", "240")),
               commit_times: list[float] | None = None) -> dict[str, int]:
    """The exactly-once loop until every input is committed; counts of what happened
    (and the monotonic time of each commit into `commit_times`)."""
    c = ck.Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": GROUP, "auto.offset.reset": "earliest",
                     "enable.auto.commit": False, "isolation.level": "read_committed"})
    c.subscribe(INPUTS)
    p = _new_producer(cluster)
    stats = {"committed": 0, "aborted": 0, "failed": 0, "reinit": 0, "commit_ms_total": 0, "commit_ms_max": 0}
    errors: list[str] = []  # the first distinct ones, for the failure message
    deadline = time.monotonic() + timeout_s
    rounds = 0
    try:
        while time.monotonic() < deadline:
            on_round(rounds)
            msgs = [m for m in c.consume(25, 1.0) if m.error() is None]
            if not msgs:
                if len(c.assignment()) == len(INPUTS) and _all_committed(c):
                    return stats
                continue
            rounds += 1
            abort = rounds % 4 == 0
            try:
                p.begin_transaction()
                for m in msgs:
                    value = (b"aborted-" if abort else b"") + m.value()
                    p.produce(_output_of(m.topic(), m.value()), value)
                if abort:
                    p.flush(60)  # (abort_transaction drops what is not sent yet: sent, they are aborted in the log)
                    p.abort_transaction(60)
                    stats["aborted"] += 1
                    _rewind(c)
                    continue
                p.send_offsets_to_transaction(c.position(c.assignment()), c.consumer_group_metadata(), 60)
                started = time.monotonic()
                _commit(p)
                stats["committed"] += 1
                stats["commit_ms_max"] = max(stats["commit_ms_max"], round((time.monotonic() - started) * 1000))
                stats["commit_ms_total"] += round((time.monotonic() - started) * 1000)
                if commit_times is not None:
                    commit_times.append(time.monotonic())
            except ck.KafkaException as exc:
                stats["failed"] += 1
                err = exc.args[0]
                if len(errors) < 8 and str(err) not in errors:
                    errors.append(str(err))
                if err.txn_requires_abort():
                    with contextlib.suppress(ck.KafkaException):
                        p.abort_transaction(60)
                if err.fatal() or not err.txn_requires_abort():
                    # Fenced, or the coordinator lost: a new producer (InitProducerId on the
                    # coordinator now named) finishes or aborts what the old one left.
                    p = _new_producer(cluster)
                    stats["reinit"] += 1
                _rewind(c)
        raise AssertionError(f"not every input was committed in {timeout_s}s: {stats} {errors}")
    finally:
        c.close()


def _commit(p: Any) -> None:
    """commit_transaction, retried while it says retriable (the same outcome: committed)."""
    while True:
        try:
            p.commit_transaction(60)
            return
        except ck.KafkaException as exc:
            if not exc.args[0].retriable():
                raise
            time.sleep(0.2)


def _all_committed(c: Any) -> bool:
    parts = c.assignment()
    committed = c.committed(parts, timeout=30)
    for tp in committed:
        _, high = c.get_watermark_offsets(tp, timeout=10)
        if tp.offset != high:
            return False
    return True


def _read_outputs(cluster: TxnCluster, isolation: str) -> list[bytes]:
    c = ck.Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": f"check-{uuid.uuid4().hex[:8]}",
                     "enable.auto.commit": False, "isolation.level": isolation})
    try:
        parts = [ck.TopicPartition(t, 0, ck.OFFSET_BEGINNING) for t in OUTPUTS]
        c.assign(parts)
        ends = {t: c.get_watermark_offsets(ck.TopicPartition(t, 0), timeout=10)[1] for t in OUTPUTS}
        got: list[bytes] = []
        done: set[str] = set()
        deadline = time.monotonic() + 60
        while len(done) < len(OUTPUTS) and time.monotonic() < deadline:
            for m in c.consume(500, 0.5):
                if m.error() is None:
                    got.append(m.value())
            for t in OUTPUTS:
                # (read_committed: up to the LSO, which is the end once nothing is open)
                if c.position([ck.TopicPartition(t, 0)])[0].offset >= ends[t]:
                    done.add(t)
        assert len(done) == len(OUTPUTS), f"outputs not read to their ends {ends}"
        return got
    finally:
        c.close()


def _check_exactly_once(cluster: TxnCluster, sent: dict[str, list[bytes]], stats: dict[str, int]) -> None:
    committed = _read_outputs(cluster, "read_committed")
    want = sorted(v for values in sent.values() for v in values)
    aborted = [v for v in committed if v.startswith(b"aborted-")]
    assert not aborted, f"{len(aborted)} aborted records visible to read_committed: {aborted[:5]}"
    dupes = len(committed) - len(set(committed))
    assert sorted(committed) == want, (
        f"read_committed: {len(committed)} records for {len(want)} inputs ({dupes} duplicates, "
        f"{len(set(want) - set(committed))} missing); {stats}"
    )
    everything = _read_outputs(cluster, "read_uncommitted")
    assert any(v.startswith(b"aborted-") for v in everything), "no aborted transaction reached the outputs"
    c = ck.Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": GROUP, "enable.auto.commit": False,
                     "isolation.level": "read_committed"})
    try:
        offsets = c.committed([ck.TopicPartition(t, 0) for t in INPUTS], timeout=30)
        assert {tp.topic: tp.offset for tp in offsets} == dict.fromkeys(INPUTS, N_PER_INPUT)
    finally:
        c.close()


@pytest.mark.timeout(420)
@pytest.mark.matrix("cluster: transactions, exactly-once consume-transform-produce over partitions of 3 brokers", client="confluent")
def test_exactly_once_across_three_brokers(workdir: Path) -> None:
    with txn_cluster(workdir) as cluster:
        sent = _produce_inputs(cluster)
        stats = _transform(cluster)
        assert stats["committed"] >= 3 and stats["aborted"] >= 1, stats
        print(f"commit_transaction: {stats['commit_ms_total'] / stats['committed']:.0f} ms on average, "
              f"{stats['commit_ms_max']} ms at most; {stats}")
        _check_exactly_once(cluster, sent, stats)


@pytest.mark.timeout(540)
@pytest.mark.matrix("cluster: transactions, exactly-once through a kill -9 of the transaction coordinator", client="confluent")
def test_exactly_once_through_a_coordinator_kill(workdir: Path, request: pytest.FixtureRequest) -> None:
    with txn_cluster(workdir) as cluster:
        sent = _produce_inputs(cluster)
        b1, b2, _ = cluster.brokers
        state: dict[str, float] = {}
        rounds = threading.Event()  # set once two transactions ran

        def schedule() -> None:
            """Kill broker 2 mid-stream; restart it once another broker coordinates the id
            (and a little longer: the producer re-inits there meanwhile)."""
            if not rounds.wait(120):
                return
            assert b2.proc is not None
            os.kill(b2.proc.pid, signal.SIGKILL)
            b2.proc.wait(10)
            state["killed"] = time.monotonic()
            try:
                _wait("another broker coordinates the id", lambda: _txn_coordinator(b1, TID) in (1, 3), 60)
                state["moved"] = time.monotonic()
                time.sleep(8)
            finally:
                b2.start()
                state["restarted"] = time.monotonic()

        def on_round(r: int) -> None:
            if r >= 2:  # early: most inputs, of every partition, still to be processed
                rounds.set()

        killer = threading.Thread(target=schedule, daemon=True)
        killer.start()
        commits: list[float] = []
        stats = _transform(cluster, on_round, timeout_s=360, commit_times=commits)
        killer.join(120)
        assert "moved" in state and "restarted" in state, f"broker 2 was not killed and restarted: {state} {stats}"
        after = [t for t in commits if t > state["killed"]]
        assert after, f"no transaction committed after the kill: {stats}"
        # (figures for the report: the id's new coordinator named, and the first commit)
        request.node.user_properties.extend([
            ("coordinator_named_after_kill_s", round(state["moved"] - state["killed"], 2)),
            ("first_commit_after_kill_s", round(after[0] - state["killed"], 2)),
        ])
        print(f"kill -> new coordinator named {state['moved'] - state['killed']:.2f}s, "
              f"-> first commit {after[0] - state['killed']:.2f}s; {stats}")
        _check_exactly_once(cluster, sent, stats)

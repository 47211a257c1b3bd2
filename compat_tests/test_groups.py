"""Consumer groups through real clients, each member in its own process.

- Groups of two and three members of kafka-python, confluent-kafka, aiokafka, kafkajs,
  franz-go (cooperative-sticky, its default) and sarama (range, its default) split a
  4-partition topic: every member gets partitions, none shared, all records read, and the
  commits cover everything at the end.
- A member killed with SIGKILL: its partitions move to the survivors (the dead member is
  detected after its session timeout, 6 s here) and no record is lost, because members
  commit each record after reading it. The time from the kill to the survivors' new
  assignment is printed per client (`REBALANCE <client>: ...` on stderr, run with -s) and
  kept in the test report's user_properties. No retry: soaked under load (nice 19 on 2
  shared cores), it passed 36 runs in a row with all six clients.
- After a broker restart the group resumes at its commits (nothing read twice or skipped).
- `kcat -G` consumes as a group member and commits.
- Offsets expiry and compaction of the offsets archive through a broker configured by a
  properties file: an expired offset is gone after a restart, compacted commits are kept.

Members are compat_tests/workers/groupclient.py (Python clients),
compat_tests/js/group_worker.js (kafkajs) and `hkgo CLIENT group` (compat_tests/go: franz-go
and sarama), speaking JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.clients import CLIENTS, GO_CLIENTS, admin, create_topic
from compat_tests.harness import Broker

GROUP_CLIENTS = ["kafka-python", "confluent", "aiokafka", "kafkajs", "franz-go", "sarama"]
PARTITIONS = 4
SESSION_MS = 6000
WORKER_TIMEOUT_S = 900  # longer than every test's own timeout below
TIMINGS: dict[str, float] = {}


def _require(client: str) -> None:
    CLIENTS[client].require()


@dataclass
class Member:
    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    _read: int = 0

    def poll(self) -> list[dict[str, Any]]:
        data = self.out.read_bytes()
        text = data[self._read :]
        cut = text.rfind(b"\n")
        if cut >= 0:
            for line in text[: cut + 1].splitlines():
                if line.strip():
                    self.events.append(json.loads(line))
            self._read += cut + 1
        return self.events

    def records(self) -> list[dict[str, Any]]:
        return [e for e in self.poll() if e["ev"] == "rec"]

    def assignments(self) -> list[dict[str, Any]]:
        return [e for e in self.poll() if e["ev"] == "assigned"]

    def stderr(self) -> str:
        err = self.out.with_suffix(".err")
        return err.read_text(errors="replace")[-3000:] if err.exists() else ""


def _member_argv(client: str, broker: Broker, topic: str, group: str, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    args = ["--bootstrap", broker.bootstrap, "--topic", topic, "--group", group, "--session-ms", str(SESSION_MS), *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p)
    if client == "kafkajs":
        node, _ = harness.find_node_kafkajs()
        assert node is not None
        return [node, str(harness.JS_DIR / "group_worker.js"), *args], env
    if client in GO_CLIENTS:
        hkgo, why = harness.find_hkgo()
        assert hkgo is not None, why
        return [hkgo, client, "group", *args], env
    return [sys.executable, "-m", "compat_tests.workers.groupclient", client, *args], env


@contextmanager
def members(client: str, broker: Broker, topic: str, group: str, n: int, workdir: Path, extra: list[str]) -> Iterator[list[Member]]:
    started: list[Member] = []
    # The workers stop by themselves after --timeout (120 s by default): longer than any
    # test here, which kills them when it ends. Under load a test outlived the default, and
    # the survivors of the SIGKILL test quietly stopped reading ("known flake").
    extra = [*extra, "--timeout", str(WORKER_TIMEOUT_S)] if "--timeout" not in extra else extra
    try:
        for i in range(n):
            argv, env = _member_argv(client, broker, topic, group, extra)
            out = workdir / f"{group}-{i}.jsonl"
            with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
                proc = subprocess.Popen(argv, cwd=harness.ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
            started.append(Member(f"{client}-{i}", proc, out))
        yield started
    finally:
        for m in started:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()


def produce(broker: Broker, topic: str, n: int, tag: str) -> set[str]:
    """n records spread evenly over the partitions (kafka-python, acks=all)."""
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    values = [f"{tag}-{i}" for i in range(n)]
    for i, v in enumerate(values):
        p.send(topic, v.encode(), partition=i % PARTITIONS)
    p.flush()
    p.close()
    return set(values)


def committed(broker: Broker, group: str) -> dict[int, int]:
    a = admin(broker)
    try:
        return {tp.partition: om.offset for tp, om in a.list_group_offsets({group: None})[group].items()}
    finally:
        a.close()


def wait_for(what: str, condition: Any, timeout: float, ms: list[Member]) -> None:
    """Wait until `condition()`; fail at `timeout`, or at once when a member exits that
    the test did not kill (a member stopping on its own, even with status 0, is a failure:
    its partitions would simply stop being read)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        for m in ms:
            status = m.proc.poll()
            if status is not None and status != -signal.SIGKILL:
                how = "stopped on its own" if status == 0 else f"exited {status}"
                raise AssertionError(
                    f"{m.name} {how} while waiting for {what} ({len(m.records())} records read, "
                    f"assignments {[a['parts'] for a in m.assignments()]}):\n{m.stderr()}"
                )
        time.sleep(0.1)
    detail = "\n".join(f"{m.name}: {len(m.records())} records, assignments {[a['parts'] for a in m.assignments()]}\n{m.stderr()}" for m in ms)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")


def stop_all(ms: list[Member], stop_file: Path, timeout: float = 30) -> None:
    stop_file.touch()
    deadline = time.monotonic() + timeout
    for m in ms:
        if m.proc.poll() is not None:
            continue
        try:
            m.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{m.name} did not stop within {timeout}s\n{m.stderr()}") from None
        assert m.proc.returncode == 0, f"{m.name} exited {m.proc.returncode}\n{m.stderr()}"


def last_split(ms: list[Member]) -> list[list[int]]:
    return [m.assignments()[-1]["parts"] if m.assignments() else [] for m in ms]


def _record_extra(request: pytest.FixtureRequest, **extra: Any) -> None:
    request.node.user_properties.extend(extra.items())


# ------------------------------------------------------------------ tests


@pytest.mark.timeout(180)
@pytest.mark.matrix("group-split-{size}")
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("client", GROUP_CLIENTS)
def test_group_members_split_a_topic(broker: Broker, workdir: Path, client: str, size: int) -> None:
    _require(client)
    tag = uuid.uuid4().hex[:8]
    topic, group = f"grp-{client}-{size}-{tag}", f"g-{client}-{size}-{tag}"
    create_topic(broker, topic, PARTITIONS)
    stop = workdir / "stop"
    with members(client, broker, topic, group, size, workdir, ["--stop-file", str(stop), "--delay-ms", "5"]) as ms:
        # Let everyone join before there is much to read, then produce.
        wait_for(
            f"{size} members to share the {PARTITIONS} partitions",
            lambda: sorted(p for parts in last_split(ms) for p in parts) == list(range(PARTITIONS)) and all(last_split(ms)),
            90,
            ms,
        )
        produced = produce(broker, topic, 200, tag)
        wait_for("every record to be read", lambda: produced <= {r["v"] for m in ms for r in m.records()}, 60, ms)
        split = last_split(ms)
        assert all(split) and sorted(p for parts in split for p in parts) == list(range(PARTITIONS)), split
        # Each member read only its own partitions (the final split held throughout the reads).
        for m, parts in zip(ms, split, strict=True):
            assert {r["p"] for r in m.records()} <= set(parts), (m.name, parts)
        stop_all(ms, stop)
    assert committed(broker, group) == dict.fromkeys(range(PARTITIONS), 50)


@pytest.mark.timeout(480)
@pytest.mark.matrix("group-sigkill")
@pytest.mark.parametrize("client", GROUP_CLIENTS)
def test_killed_member_partitions_move_to_survivors(broker: Broker, workdir: Path, client: str, request: pytest.FixtureRequest) -> None:
    _require(client)
    _killed_member_scenario(broker, workdir, client, request)


def _killed_member_scenario(broker: Broker, workdir: Path, client: str, request: pytest.FixtureRequest) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    topic, group = f"kill-{client}-{tag}", f"gk-{client}-{tag}"
    create_topic(broker, topic, PARTITIONS)
    stop = workdir / "stop"
    # 40 ms per record: at the kill, the victim's partitions still hold most of their records.
    with members(client, broker, topic, group, 3, workdir, ["--stop-file", str(stop), "--delay-ms", "40"]) as ms:
        wait_for("three members sharing the topic", lambda: all(last_split(ms)) and sorted(p for s in last_split(ms) for p in s) == list(range(PARTITIONS)), 90, ms)
        produced = produce(broker, topic, 400, tag)
        victim, survivors = ms[0], ms[1:]
        wait_for("the victim to read a few records", lambda: len(victim.records()) >= 5, 60, ms)
        victim_parts = last_split([victim])[0]
        before = {id(m): len(m.assignments()) for m in survivors}
        victim.proc.send_signal(signal.SIGKILL)
        killed_at = time.time()
        victim.proc.wait()

        def moved() -> bool:
            fresh = [m.assignments()[before[id(m)] :] for m in survivors]
            if not all(fresh):
                return False
            return sorted(p for f in fresh for p in f[-1]["parts"]) == list(range(PARTITIONS))

        wait_for(f"the victim's partitions {victim_parts} to move to the survivors", moved, SESSION_MS / 1000 + 30, ms)
        moved_at = max(m.assignments()[before[id(m)]]["t"] for m in survivors)
        took = moved_at - killed_at
        TIMINGS[client] = took
        print(f"\nREBALANCE {client}: partitions of the killed member reassigned {took:.2f}s after SIGKILL (session timeout {SESSION_MS / 1000:.0f}s)", file=sys.stderr)
        _record_extra(request, rebalance_seconds=round(took, 2))
        assert took < SESSION_MS / 1000 + 10, f"rebalance took {took:.1f}s"
        wait_for("every record to be read by someone", lambda: produced <= {r["v"] for m in ms for r in m.records()}, 90, ms)
        stop_all(survivors, stop)
    assert committed(broker, group) == dict.fromkeys(range(PARTITIONS), 100)


@pytest.mark.timeout(240)
@pytest.mark.matrix("group-resume-after-restart")
@pytest.mark.parametrize("client", GROUP_CLIENTS)
def test_group_resumes_at_its_commits_after_a_broker_restart(fresh_broker: Broker, workdir: Path, client: str) -> None:
    _require(client)
    b = fresh_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"resume-{tag}", f"gr-{client}-{tag}"
    create_topic(b, topic, PARTITIONS)
    produced = produce(b, topic, 200, tag)
    with members(client, b, topic, group, 1, workdir, ["--max-records", "80"]) as (first,):
        wait_for("the first run to read 80 records and close", lambda: first.proc.poll() is not None, 90, [first])
        assert first.proc.returncode == 0, first.stderr()
    before = committed(b, group)
    read_first = [r["v"] for r in first.records()]
    assert sum(before.values()) == len(read_first) >= 80, (before, len(read_first))

    assert b.stop() == 0
    b.start()
    assert committed(b, group) == before, "commits changed across the restart"
    stop = workdir / "stop2"
    second_dir = workdir / "second"
    second_dir.mkdir()
    with members(client, b, topic, group, 1, second_dir, ["--stop-file", str(stop)]) as (second,):
        wait_for("the rest to be read", lambda: produced <= set(read_first) | {r["v"] for r in second.records()}, 90, [second])
        stop_all([second], stop)
    read_second = [r["v"] for r in second.records()]
    assert not set(read_first) & set(read_second), "records read again after the restart"
    first_offsets = {}
    for r in second.records():
        first_offsets.setdefault(r["p"], r["o"])
    # Committed partitions resume at their commit; never-committed ones start at the beginning.
    expected = {p: before.get(p, 0) for p in range(PARTITIONS) if before.get(p, 0) < 50}
    assert first_offsets == expected, "did not resume at the committed offsets"


@pytest.mark.timeout(120)
@pytest.mark.matrix("kcat-G")
@pytest.mark.parametrize("client", ["kcat-old", "kcat-new"])
def test_kcat_consumes_as_a_group(broker: Broker, workdir: Path, client: str) -> None:
    kcat, why = harness.find_kcat(client.split("-")[1])
    harness.require(kcat is not None, why)
    assert kcat is not None
    tag = uuid.uuid4().hex[:8]
    topic, group = f"kcatg-{tag}", f"gkcat-{tag}"
    create_topic(broker, topic, PARTITIONS)
    produced = produce(broker, topic, 100, tag)
    args = ["-b", broker.bootstrap, "-G", group, "-X", "auto.offset.reset=earliest", "-X", "session.timeout.ms=6000", "-e", "-q", "-f", "%p %o %s\n", topic]
    out = kcat.run(args, timeout=90).stdout.decode()
    lines = [line.split(" ", 2) for line in out.splitlines() if line.strip()]
    assert {v for _, _, v in lines} == produced
    assert committed(broker, group) == dict.fromkeys(range(PARTITIONS), 25)
    # The same group again: nothing left to read.
    again = kcat.run(args, timeout=90).stdout.decode()
    assert not again.strip(), again[:500]


def _commit_standalone(broker: Broker, group: str, topic: str, offsets: dict[int, int], times: int = 1) -> None:
    """Commit as a consumer without group management (generation -1), `times` times,
    each round one OffsetCommit with every partition (offset + round)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    try:
        c.assign([TopicPartition(topic, p) for p in offsets])
        for i in range(times):
            c.commit({TopicPartition(topic, p): OffsetAndMetadata(o + i, "", -1) for p, o in offsets.items()})
    finally:
        c.close()


def _listed_groups(broker: Broker) -> set[str]:
    a = admin(broker)
    try:
        return {g["group_id"] if isinstance(g, dict) else g[0] for g in a.list_groups()}
    finally:
        a.close()


@pytest.mark.timeout(180)
@pytest.mark.matrix("offsets-expiry-compaction", client="kafka-python")
def test_offsets_expire_and_compaction_keeps_commits_across_restarts(fresh_broker: Broker, workdir: Path) -> None:
    """Expiry (KIP-211, standalone consumers count from their commit) and compaction of
    the offsets archive, through a real broker process configured by a properties file.

    Phase 1, default retention: group `exp` commits once; group `kept` commits 100 rounds,
    so superseded records pile up and the broker compacts (copies the live records into a
    new segment, drops the old ones). `kept` commits its final offsets GAP seconds after
    `exp`. Phase 2 restarts the broker with a retention between the two ages: `exp`'s
    offsets are expired by the first check (and the group is gone), `kept`'s are intact.
    """
    _require("kafka-python")
    gap, margin = 10.0, 5.0
    b = fresh_broker
    tag = uuid.uuid4().hex[:8]
    topic = f"expiry-{tag}"
    create_topic(b, topic, PARTITIONS)
    assert b.stop() == 0
    data_dir = b.data_dir
    assert data_dir is not None
    offsets_dir = data_dir / "__consumer_offsets-0"
    phase1 = {"hyperkafka.offsets.compaction.min.dirty.records": "50", "offsets.retention.check.interval.ms": "200"}
    with harness.configured_broker(workdir / "p1", phase1, data_dir=data_dir) as b:
        t_exp = time.monotonic()
        _commit_standalone(b, "exp", topic, {0: 5})
        _commit_standalone(b, "kept", topic, {p: 10 * p for p in range(PARTITIONS)}, times=100)
        deadline = time.monotonic() + 30
        while "compacted __consumer_offsets" not in b.log_tail(400):
            assert time.monotonic() < deadline, "no compaction logged\n" + b.log_tail()
            time.sleep(0.2)
        time.sleep(max(0.0, t_exp + gap - time.monotonic()))
        final = {p: 1000 + p for p in range(PARTITIONS)}
        _commit_standalone(b, "kept", topic, final)
        t_kept = time.monotonic()
        assert committed(b, "exp") == {0: 5}  # the default retention is 7 days
    segments = sorted(n for n in os.listdir(offsets_dir) if n.endswith(".log"))
    assert int(segments[0][:-4]) > 0, f"old segments were not dropped: {segments}"

    restart = time.monotonic()
    retention_ms = int((restart - t_kept + margin) * 1000)  # exp is >= gap - margin past it
    phase2 = {"hyperkafka.offsets.retention.ms": str(retention_ms), "offsets.retention.check.interval.ms": "200"}
    with harness.configured_broker(workdir / "p2", phase2, data_dir=data_dir) as b:
        kept = committed(b, "kept")
        assert time.monotonic() - t_kept < retention_ms / 1000, "too slow to tell expiry apart (machine overloaded?)"
        assert kept == final, "compaction or restart lost committed offsets"
        assert committed(b, "exp") == {}, "the expired offset came back"
        assert "exp" not in _listed_groups(b) and "kept" in _listed_groups(b)

"""KIP-848 consumer groups (group.protocol=consumer) through real clients.

Three members, each in its own process, split a 4-partition topic with the server-side
assignor; one leaves (closes its consumer: a heartbeat with epoch -1), another is killed
with SIGKILL (the broker fences it after group.consumer.session.timeout.ms, 6 s here);
the last one ends up with every partition. Every record produced is read by a live
member, and the commits the members made record by record end at the log end.

A static classic member (group.instance.id; kafka-python, confluent-kafka) of a mixed
group restarts into its partitions without moving the consumer-protocol member's.

Clients: confluent-kafka (librdkafka >= 2.12 serves the protocol as generally
available), the Java consumer (kafka-clients 4.x, compat_tests/java) and franz-go (kgo's
consumer with the new protocol, compat_tests/go). Members are the same workers as the
classic-group tests (compat_tests/test_groups.py), told to use the consumer protocol.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.clients import CLIENTS, create_topic
from compat_tests.harness import Broker
from compat_tests.java_tools import JAVA_DIR, JavaTools, require_java
from compat_tests.test_groups import (
    PARTITIONS,
    WORKER_TIMEOUT_S,
    Member,
    _member_argv,
    committed,
    produce,
    wait_for,
)

SESSION_MS = 6000
PROPERTIES = {
    "group.consumer.session.timeout.ms": str(SESSION_MS),
    "group.consumer.heartbeat.interval.ms": "500",
}
# The matrix column (compat_tests/matrix.py) -> the worker that speaks KIP-848 for it.
KIP848_CLIENTS = {
    "confluent": "confluent-848",
    "java-tools": "java-848",
    "franz-go": "franz-go-848",
}


def _require(client: str) -> None:
    if client == "java-tools":
        require_java()
    else:
        CLIENTS[client].require()


def _argv(
    client: str, broker: Broker, topic: str, group: str, extra: list[str]
) -> tuple[list[str], dict[str, str]]:
    """`client` is a worker name of KIP848_CLIENTS."""
    if client == "java-848":
        tools = JavaTools(require_java())
        # Source-file mode: the worker compiles in the JVM at start (no build step).
        argv = tools.command(
            str(JAVA_DIR / "GroupWorker.java"),
            ["--bootstrap", broker.bootstrap, "--topic", topic, "--group", group, *extra],
        )
        return argv, dict(os.environ)
    if client == "franz-go-848":
        return _member_argv("franz-go", broker, topic, group, [*extra, "--protocol", "consumer"])
    return _member_argv(client, broker, topic, group, extra)


@pytest.fixture
def kip848_broker(workdir: Path) -> Iterator[Broker]:
    with harness.configured_broker(workdir / "broker", PROPERTIES) as b:
        yield b


@contextmanager
def member(
    client: str,
    broker: Broker,
    topic: str,
    group: str,
    workdir: Path,
    name: str,
    extra: Sequence[str] = (),
) -> Iterator[tuple[Member, Path]]:
    """One member with its own stop file (so one can leave while the others stay)."""
    stop = workdir / f"{name}.stop"
    argv, env = _argv(
        client,
        broker,
        topic,
        group,
        ["--stop-file", str(stop), "--delay-ms", "40", "--timeout", str(WORKER_TIMEOUT_S), *extra],
    )
    out = workdir / f"{name}.jsonl"
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        proc = subprocess.Popen(
            argv, cwd=harness.ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    m = Member(name, proc, out)
    try:
        yield m, stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def owned(m: Member) -> list[int]:
    a = m.assignments()
    return a[-1]["parts"] if a else []


def _group_type(broker: Broker, group: str) -> str:
    """The group's type as confluent-kafka's admin lists it (ListGroups v5)."""
    from confluent_kafka.admin import AdminClient

    client = AdminClient({"bootstrap.servers": broker.bootstrap})  # kept alive until answered
    listed = client.list_consumer_groups().result(timeout=20)
    types = {g.group_id: str(g.type).lower() for g in listed.valid}
    assert group in types, (group, types, listed.errors)
    return types[group]


@pytest.mark.timeout(300)
@pytest.mark.matrix("group-kip848")
@pytest.mark.parametrize("client", sorted(KIP848_CLIENTS))
def test_consumer_protocol_members_leave_and_die(
    kip848_broker: Broker, workdir: Path, client: str
) -> None:
    _require(client)
    worker = KIP848_CLIENTS[client]
    b = kip848_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"k848-{client}-{tag}", f"g848-{client}-{tag}"
    create_topic(b, topic, PARTITIONS)
    with ExitStack() as stack:
        pairs = [
            stack.enter_context(member(worker, b, topic, group, workdir, f"{worker}-{i}"))
            for i in range(3)
        ]
        ms = [m for m, _ in pairs]

        def split_is(members: list[Member]) -> bool:
            parts = [owned(m) for m in members]
            return all(parts) and sorted(p for ps in parts for p in ps) == list(range(PARTITIONS))

        wait_for("three members sharing the topic", lambda: split_is(ms), 90, ms)
        assert "consumer" in _group_type(b, group)
        if client == "java-tools":
            # kafka-consumer-groups describes a consumer group through ConsumerGroupDescribe.
            out = (
                JavaTools(require_java())
                .consumer_groups(b.bootstrap, "--describe", "--group", group)
                .stdout.decode()
            )
            rows = [line.split() for line in out.splitlines() if line.startswith(group + " ")]
            assert sorted(int(r[2]) for r in rows) == list(range(PARTITIONS)), out
            assert all(r[6] != "-" for r in rows), f"a partition without its member:\n{out}"
        produced = produce(b, topic, 400, tag)
        leaver, victim, survivor = ms
        wait_for(
            "the members to read a few records",
            lambda: all(len(m.records()) >= 3 for m in ms),
            60,
            ms,
        )
        # One leaves: its partitions go to the two others at once (no session timeout).
        pairs[0][1].touch()
        leaver.proc.wait(30)
        assert leaver.proc.returncode == 0, leaver.stderr()
        left_at = time.time()
        wait_for(
            "the leaver's partitions to move",
            lambda: split_is([victim, survivor]),
            30,
            [victim, survivor],
        )
        print(
            f"\nKIP-848 {client}: a leaving member's partitions moved in {time.time() - left_at:.2f}s"
        )
        # One dies: the broker fences it after the session timeout.
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        killed_at = time.time()
        wait_for(
            "the survivor to own every partition",
            lambda: split_is([survivor]),
            SESSION_MS / 1000 + 30,
            [survivor],
        )
        took = time.time() - killed_at
        print(
            f"KIP-848 {client}: a killed member's partitions moved in {took:.2f}s (session timeout {SESSION_MS / 1000:.0f}s)"
        )
        assert took < SESSION_MS / 1000 + 10
        wait_for(
            "every record to be read",
            lambda: produced <= {r["v"] for m in ms for r in m.records()},
            120,
            [survivor],
        )
        pairs[2][1].touch()
        survivor.proc.wait(30)
        assert survivor.proc.returncode == 0, survivor.stderr()
    # Each partition held 100 records; the commits made record by record reached the end.
    assert committed(b, group) == dict.fromkeys(range(PARTITIONS), 100)


@pytest.mark.timeout(240)
@pytest.mark.matrix("group-kip848")
@pytest.mark.parametrize("client", ["confluent"])
def test_consumer_protocol_member_keeps_its_place_across_a_broker_restart(
    kip848_broker: Broker, workdir: Path, client: str
) -> None:
    """The group's records in __consumer_offsets bring the member back with its epoch and
    partitions: after the restart its heartbeats are accepted as they are (no new
    assignment, which a lost group would force through UNKNOWN_MEMBER_ID and a rejoin),
    and it reads on from where it was, nothing twice."""
    _require(client)
    b = kip848_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"k848r-{tag}", f"g848r-{tag}"
    create_topic(b, topic, PARTITIONS)
    with member(KIP848_CLIENTS[client], b, topic, group, workdir, "restart-0") as (m, stop):
        wait_for(
            "the member to own the topic", lambda: owned(m) == list(range(PARTITIONS)), 90, [m]
        )
        first = produce(b, topic, 40, tag + "a")
        wait_for(
            "the first records to be read", lambda: first <= {r["v"] for r in m.records()}, 60, [m]
        )
        assignments = len(m.assignments())
        b.stop()
        b.start()
        second = produce(b, topic, 40, tag + "b")
        wait_for(
            "the records produced after the restart",
            lambda: second <= {r["v"] for r in m.records()},
            90,
            [m],
        )
        time.sleep(2)  # a few more heartbeats on the restarted broker
        assert len(m.assignments()) == assignments, (
            f"the member was assigned again: {m.assignments()}\n{m.stderr()}"
        )
        values = [r["v"] for r in m.records()]
        assert len(values) == len(set(values)) == 80, "a record was read twice or missed"
        stop.touch()
        m.proc.wait(30)
        assert m.proc.returncode == 0, m.stderr()
    assert committed(b, group) == dict.fromkeys(range(PARTITIONS), 20)


@pytest.mark.timeout(300)
@pytest.mark.matrix("group-kip848")
@pytest.mark.parametrize(
    ("classic", "consumer"), [("kafka-python", "confluent"), ("confluent", "franz-go")]
)
def test_an_empty_group_changes_protocol_and_keeps_its_offsets(
    kip848_broker: Broker, workdir: Path, classic: str, consumer: str
) -> None:
    """Kafka 4's offline migration: a classic group left empty (its offsets only) becomes a
    consumer group when a consumer-protocol member joins, and that consumer group, left
    empty, a classic group again when a classic member joins; each member reads on from
    the group's commits, so every record is read once over the three."""
    _require(classic)
    _require(consumer)
    b = kip848_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"k848m-{tag}", f"g848m-{tag}"
    create_topic(b, topic, PARTITIONS)
    seen: list[str] = []
    rounds = [(classic, "classic"), (KIP848_CLIENTS[consumer], "consumer"), (classic, "classic")]
    for i, (worker, kind) in enumerate(rounds):
        batch = produce(b, topic, 40, f"{tag}-{i}")
        with member(worker, b, topic, group, workdir, f"migrate-{i}") as (m, stop):
            wait_for("the batch to be read", lambda: batch <= {r["v"] for r in m.records()}, 90, [m])  # noqa: B023
            assert _group_type(b, group).endswith(kind)  # ConsumerGroupType.CLASSIC or .CONSUMER
            time.sleep(1)  # nothing more arrives
            stop.touch()
            m.proc.wait(30)
            assert m.proc.returncode == 0, m.stderr()
            values = [r["v"] for r in m.records()]
        assert set(values) == batch, f"round {i} ({worker}) read {len(values)} records"
        seen += values
    assert len(seen) == len(set(seen)) == 120, "a record was read twice or missed"
    assert committed(b, group) == dict.fromkeys(range(PARTITIONS), 30)


@pytest.mark.timeout(300)
@pytest.mark.matrix("group-kip848")
@pytest.mark.parametrize(("classic", "consumer"), [("kafka-python", "confluent")])
def test_a_live_classic_group_takes_a_consumer_protocol_member_and_gives_it_back(
    kip848_broker: Broker, workdir: Path, classic: str, consumer: str
) -> None:
    """Kafka 4's online upgrade (KIP-848, group.consumer.migration.policy bidirectional): a
    consumer-protocol member joins a stable classic group that has a member, the group
    becomes a consumer group with both in it at once, the classic member served through
    JoinGroup/SyncGroup/Heartbeat with the broker's assignment; when that member leaves,
    the group is a classic one again (the downgrade) and the classic member takes every
    partition back. Every record is read once and the commits end at the log end."""
    _require(classic)
    _require(consumer)
    b = kip848_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"k848x-{tag}", f"g848x-{tag}"
    create_topic(b, topic, PARTITIONS)
    with ExitStack() as stack:
        old, old_stop = stack.enter_context(member(classic, b, topic, group, workdir, "classic"))
        wait_for("the classic member to own the topic", lambda: owned(old) == list(range(PARTITIONS)), 90, [old])
        first = produce(b, topic, 40, f"{tag}-a")
        wait_for("the first batch", lambda: first <= {r["v"] for r in old.records()}, 60, [old])
        assert _group_type(b, group).endswith("classic")
        new, new_stop = stack.enter_context(
            member(KIP848_CLIENTS[consumer], b, topic, group, workdir, "consumer")
        )

        def split() -> bool:
            a, c = owned(old), owned(new)
            return bool(a) and bool(c) and sorted(a + c) == list(range(PARTITIONS))

        wait_for("the two members to share the topic", split, 90, [old, new])
        assert _group_type(b, group).endswith("consumer")
        second = produce(b, topic, 80, f"{tag}-b")
        wait_for(
            "the second batch, read by both",
            lambda: second <= {r["v"] for m in (old, new) for r in m.records()},
            90,
            [old, new],
        )
        assert any(r["v"] in second for r in old.records())
        assert any(r["v"] in second for r in new.records())
        time.sleep(1)  # nothing more arrives
        # The consumer-protocol member leaves: the group is a classic one again (the
        # downgrade), its classic member rejoins and takes every partition.
        new_stop.touch()
        new.proc.wait(30)
        assert new.proc.returncode == 0, new.stderr()
        wait_for(
            "the classic member to own the topic again",
            lambda: owned(old) == list(range(PARTITIONS)),
            60,
            [old],
        )
        assert _group_type(b, group).endswith("classic")
        third = produce(b, topic, 40, f"{tag}-c")
        wait_for("the third batch", lambda: third <= {r["v"] for r in old.records()}, 60, [old])
        time.sleep(1)
        old_stop.touch()
        old.proc.wait(30)
        assert old.proc.returncode == 0, old.stderr()
        values = [r["v"] for m in (old, new) for r in m.records()]
    assert sorted(values) == sorted(first | second | third), "a record was read twice or missed"
    assert committed(b, group) == dict.fromkeys(range(PARTITIONS), 40)


@pytest.mark.timeout(300)
@pytest.mark.matrix("group-kip848")
@pytest.mark.parametrize("classic", ["kafka-python", "confluent"])
def test_a_static_classic_member_restarts_in_a_mixed_group_without_a_rebalance(
    kip848_broker: Broker, workdir: Path, classic: str
) -> None:
    """A static classic member (group.instance.id) of a consumer group that also has a
    consumer-protocol member is restarted: the old process closes without a LeaveGroup
    (static), a new one joins with the same instance id and, as in Kafka 4, gets the same
    partitions back at once while the other member's assignment does not move. Every
    record is read once and the commits end at the log end."""
    _require(classic)
    _require("confluent")
    b = kip848_broker
    tag = uuid.uuid4().hex[:8]
    topic, group = f"k848s-{tag}", f"g848s-{tag}"
    static = ["--instance-id", f"static-{tag}", "--session-ms", "20000"]
    create_topic(b, topic, PARTITIONS)
    with ExitStack() as stack:
        other, other_stop = stack.enter_context(
            member(KIP848_CLIENTS["confluent"], b, topic, group, workdir, "consumer")
        )
        wait_for("the consumer-protocol member to own the topic", lambda: owned(other) == list(range(PARTITIONS)), 90, [other])
        first_run, first_stop = stack.enter_context(member(classic, b, topic, group, workdir, "static-1", static))

        def split(m: Member) -> bool:
            a, c = owned(m), owned(other)
            return bool(a) and bool(c) and sorted(a + c) == list(range(PARTITIONS))

        wait_for("the static member to share the topic", lambda: split(first_run), 90, [first_run, other])
        assert _group_type(b, group).endswith("consumer")
        first = produce(b, topic, 40, f"{tag}-a")
        wait_for("the first batch", lambda: first <= {r["v"] for m in (first_run, other) for r in m.records()}, 60, [first_run, other])
        time.sleep(1)  # nothing more arrives, every commit is made
        mine, theirs, moves = owned(first_run), owned(other), len(other.assignments())
        first_stop.touch()
        first_run.proc.wait(30)
        assert first_run.proc.returncode == 0, first_run.stderr()
        restarted_at = time.time()
        second_run, second_stop = stack.enter_context(member(classic, b, topic, group, workdir, "static-2", static))
        wait_for("the restarted member to get its partitions back", lambda: owned(second_run) == mine, 60, [second_run, other])
        print(f"\nstatic {classic} member back on partitions {mine} in {time.time() - restarted_at:.2f}s")
        second = produce(b, topic, 40, f"{tag}-b")
        wait_for("the second batch", lambda: second <= {r["v"] for m in (second_run, other) for r in m.records()}, 60, [second_run, other])
        time.sleep(1)
        assert owned(second_run) == mine and len(second_run.assignments()) == 1, second_run.assignments()
        assert owned(other) == theirs and len(other.assignments()) == moves, (
            f"the other member was rebalanced: {other.assignments()}"
        )
        for m, stop in ((second_run, second_stop), (other, other_stop)):
            stop.touch()
            m.proc.wait(30)
            assert m.proc.returncode == 0, m.stderr()
        values = [r["v"] for m in (first_run, second_run, other) for r in m.records()]
    assert sorted(values) == sorted(first | second), "a record was read twice or missed"
    assert committed(b, group) == dict.fromkeys(range(PARTITIONS), 20)

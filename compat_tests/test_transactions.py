"""Transactions with librdkafka (confluent-kafka): a transactional producer, read_committed
and read_uncommitted consumers, consume-transform-produce with send_offsets_to_transaction,
fencing of a zombie producer, and kill -9 of the broker in the middle of a transaction.

Imports the standard library, pytest, confluent_kafka and the compat_tests modules.
"""

from __future__ import annotations

import shutil
import time
import uuid
from typing import Any

import pytest

from compat_tests.clients import create_topic
from compat_tests.harness import Broker

ck = pytest.importorskip("confluent_kafka")


def _producer(broker: Broker, tid: str, **extra: Any) -> Any:
    p = ck.Producer(
        {
            "bootstrap.servers": broker.bootstrap,
            "transactional.id": tid,
            "transaction.timeout.ms": 10000,
            **extra,
        }
    )
    p.init_transactions(30)
    return p


def _consume(
    broker: Broker,
    topic: str,
    isolation: str,
    expected: int,
    *,
    group: str | None = None,
    timeout: float = 20.0,
) -> list[bytes]:
    c = ck.Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": group or f"g-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    c.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                if len(got) >= expected and expected >= 0:
                    # a little longer: nothing more may arrive
                    extra = c.poll(1.0)
                    if extra is not None and extra.error() is None:
                        got.append(extra.value())
                    break
                continue
            if m.error() is not None:
                continue
            got.append(m.value())
    finally:
        c.close()
    return got


@pytest.mark.timeout(120)
def test_commit_and_abort_interleaved(broker: Broker) -> None:
    topic = f"txn-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic, partitions=2)
    p = _producer(broker, f"tid-{uuid.uuid4().hex[:8]}")
    committed: list[bytes] = []
    everything: list[bytes] = []
    for i in range(6):
        p.begin_transaction()
        values = [f"t{i}-{j}".encode() for j in range(5)]
        for j, v in enumerate(values):
            p.produce(topic, v, key=str(j).encode())
        everything += values
        p.flush(30)  # (else an abort purges what was not sent yet, and the log never has it)
        if i % 2 == 0:
            p.commit_transaction(30)
            committed += values
        else:
            p.abort_transaction(30)
    # an open transaction at the end: read_committed must not see it (the LSO stops there)
    p.begin_transaction()
    p.produce(topic, b"open", key=b"0")
    p.flush(30)
    everything.append(b"open")
    seen = _consume(broker, topic, "read_committed", len(committed))
    assert sorted(seen) == sorted(committed)
    all_seen = _consume(broker, topic, "read_uncommitted", len(everything))
    assert sorted(all_seen) == sorted(everything)
    p.commit_transaction(30)
    seen = _consume(broker, topic, "read_committed", len(committed) + 1)
    assert sorted(seen) == sorted([*committed, b"open"])


@pytest.mark.timeout(120)
def test_consume_transform_produce(broker: Broker) -> None:
    src, dst = f"ctp-in-{uuid.uuid4().hex[:8]}", f"ctp-out-{uuid.uuid4().hex[:8]}"
    create_topic(broker, src)
    create_topic(broker, dst)
    plain = ck.Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(20):
        plain.produce(src, str(i).encode())
    plain.flush(30)
    group = f"ctp-{uuid.uuid4().hex[:8]}"
    c = ck.Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    c.subscribe([src])
    p = _producer(broker, f"ctp-{uuid.uuid4().hex[:8]}")
    done = 0
    rounds = 0
    deadline = time.monotonic() + 60
    while done < 20 and time.monotonic() < deadline:
        msgs = [m for m in c.consume(5, 1.0) if m.error() is None]
        if not msgs:
            continue
        p.begin_transaction()
        for m in msgs:
            p.produce(dst, b"x" + m.value())
        positions = c.position(c.assignment())
        p.send_offsets_to_transaction(positions, c.consumer_group_metadata(), 30)
        if rounds == 1:
            p.abort_transaction(30)  # this batch's output and offsets vanish: reprocessed
            for tp in positions:
                c.seek(ck.TopicPartition(tp.topic, tp.partition, tp.offset - len(msgs)))
        else:
            p.commit_transaction(30)
            done += len(msgs)
        rounds += 1
    c.close()
    assert done == 20
    out = _consume(broker, dst, "read_committed", 20)
    assert sorted(out) == sorted(b"x" + str(i).encode() for i in range(20))
    check = ck.Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    committed = check.committed([ck.TopicPartition(src, 0)], 10)
    check.close()
    assert committed[0].offset == 20


@pytest.mark.timeout(120)
def test_zombie_is_fenced(broker: Broker) -> None:
    topic = f"fence-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    tid = f"fence-{uuid.uuid4().hex[:8]}"
    old = _producer(broker, tid)
    old.begin_transaction()
    old.produce(topic, b"zombie")
    old.flush(30)
    new = _producer(broker, tid)  # fences `old` and aborts its open transaction
    new.begin_transaction()
    new.produce(topic, b"live")
    new.commit_transaction(30)
    with pytest.raises(ck.KafkaException) as info:
        old.produce(topic, b"zombie2")
        old.commit_transaction(30)
    assert info.value.args[0].fatal() or "fenc" in str(info.value).lower()
    assert _consume(broker, topic, "read_committed", 1) == [b"live"]


@pytest.mark.timeout(180)
def test_kill_mid_transaction_is_aborted(fresh_broker: Broker) -> None:
    b = fresh_broker
    topic = f"kill-{uuid.uuid4().hex[:8]}"
    create_topic(b, topic)
    p = _producer(b, "kill-tid", **{"transaction.timeout.ms": 3000})
    p.begin_transaction()
    p.produce(topic, b"committed")
    p.commit_transaction(30)
    p.begin_transaction()
    p.produce(topic, b"never")
    p.flush(30)
    b.kill()
    b.start()
    # The open transaction times out (3 s) after the restart and is aborted: its records
    # never become visible, and the last stable offset moves past them.
    time.sleep(1)
    deadline = time.monotonic() + 60
    seen: list[bytes] = []
    while time.monotonic() < deadline:
        seen = _consume(b, topic, "read_committed", 1, timeout=10)
        if seen == [b"committed"]:
            lso = _end_offset(b, topic)
            if lso >= 3:  # committed + marker + never (+ its abort marker)
                break
        time.sleep(1)
    assert seen == [b"committed"]
    assert _end_offset(b, topic) == 4
    assert sorted(_consume(b, topic, "read_uncommitted", 2)) == [b"committed", b"never"]


def _end_offset(b: Broker, topic: str) -> int:
    c = ck.Consumer(
        {"bootstrap.servers": b.bootstrap, "group.id": "probe", "isolation.level": "read_committed"}
    )
    try:
        _, high = c.get_watermark_offsets(ck.TopicPartition(topic, 0), 10)
        return int(high)
    finally:
        c.close()


@pytest.mark.timeout(180)
def test_kafka_transactions_tool_lists_and_describes(broker: Broker) -> None:
    from compat_tests.java_tools import JavaTools, require_java, tool_class

    java = JavaTools(require_java())
    main = tool_class("kafka-transactions")
    assert main is not None
    topic = f"tool-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    tid = f"tool-{uuid.uuid4().hex[:8]}"
    p = _producer(broker, tid)
    p.begin_transaction()
    p.produce(topic, b"x")
    p.flush(30)

    def tool(*args: str) -> str:
        return java.run(main, ["--bootstrap-server", broker.bootstrap, *args]).text

    listed = tool("list")
    assert any(line.split()[:1] == [tid] and "Ongoing" in line for line in listed.splitlines()), (
        listed
    )
    described = tool("describe", "--transactional-id", tid)
    assert "Ongoing" in described and f"{topic}-0" in described, described
    p.commit_transaction(30)
    described = tool("describe", "--transactional-id", tid)
    assert "CompleteCommit" in described, described


@pytest.mark.timeout(120)
def test_read_committed_offset_fetch_waits_for_a_pending_transactional_commit(
    broker: Broker,
) -> None:
    """A read_committed consumer asks OffsetFetch with require_stable: while a transaction
    holds offsets of its group not yet committed, the broker answers UNSTABLE_OFFSET_COMMIT
    and librdkafka retries (committed() times out) instead of reading the older offset;
    once the transaction commits, the new offset is read."""
    topic = f"stable-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    group = f"stable-{uuid.uuid4().hex[:8]}"
    meta = ck.Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    p = _producer(broker, f"stable-{uuid.uuid4().hex[:8]}")
    p.begin_transaction()
    p.send_offsets_to_transaction([ck.TopicPartition(topic, 0, 4)], meta.consumer_group_metadata(), 30)
    p.commit_transaction(30)
    p.begin_transaction()
    p.send_offsets_to_transaction([ck.TopicPartition(topic, 0, 9)], meta.consumer_group_metadata(), 30)
    meta.close()

    def committed(isolation: str, timeout: float) -> int:
        c = ck.Consumer(
            {"bootstrap.servers": broker.bootstrap, "group.id": group, "isolation.level": isolation}
        )
        try:
            return int(c.committed([ck.TopicPartition(topic, 0)], timeout)[0].offset)
        finally:
            c.close()

    assert committed("read_uncommitted", 10) == 4  # no require_stable: the last committed
    started = time.monotonic()
    with pytest.raises(ck.KafkaException) as raised:
        committed("read_committed", 3)
    assert raised.value.args[0].code() == ck.KafkaError._TIMED_OUT, raised.value
    assert time.monotonic() - started >= 2.5  # retried UNSTABLE_OFFSET_COMMIT until then
    p.commit_transaction(30)
    assert committed("read_committed", 10) == 9


@pytest.mark.timeout(240)
def test_kafka_transactions_tool_finds_and_aborts_a_hanging_transaction(
    fresh_broker: Broker,
) -> None:
    """A hanging transaction: data of an open transaction in a partition whose coordinator
    no longer knows it (here its `__transaction_state` archive was put back to a copy
    taken before the transaction began, as a restore from a backup would). It holds the
    LSO down for ever: `kafka-transactions find-hanging` lists it (DescribeProducers,
    ListTransactions, DescribeTransactions) and `kafka-transactions abort` closes it
    (WriteTxnMarkers), after which read_committed consumers move on."""
    from compat_tests.java_tools import JavaTools, require_java, tool_class

    java = JavaTools(require_java())
    main = tool_class("kafka-transactions")
    assert main is not None
    b = fresh_broker
    assert b.data_dir is not None
    topic = f"hang-{uuid.uuid4().hex[:8]}"
    create_topic(b, topic)
    _producer(b, "hang-other")  # __transaction_state exists, without the id below
    b.stop()
    state = b.data_dir / "__transaction_state-0"
    backup = b.data_dir.parent / "txn-state-backup"
    assert state.is_dir()
    shutil.copytree(state, backup)
    b.start()
    p = _producer(b, "hang-tid", **{"transaction.timeout.ms": 600000})
    p.begin_transaction()
    p.produce(topic, b"stuck")
    p.flush(30)
    b.kill()
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    b.start()
    assert _end_offset(b, topic) == 0  # the open transaction holds the LSO

    def tool(*args: str) -> str:
        return java.run(main, ["--bootstrap-server", b.bootstrap, *args]).text

    found = tool("find-hanging", "--topic", topic, "--max-transaction-timeout", "0")
    rows = [line.split() for line in found.splitlines()[1:] if line.strip()]
    assert [(r[0], r[1], r[5]) for r in rows] == [(topic, "0", "0")], found
    tool("abort", "--topic", topic, "--partition", "0", "--start-offset", "0")
    assert _end_offset(b, topic) == 2  # the record and its ABORT marker
    found = tool("find-hanging", "--topic", topic, "--max-transaction-timeout", "0")
    assert [line for line in found.splitlines()[1:] if line.strip()] == [], found
    after = _producer(b, "hang-after")
    after.begin_transaction()
    after.produce(topic, b"visible")
    after.commit_transaction(30)
    assert _consume(b, topic, "read_committed", 1) == [b"visible"]

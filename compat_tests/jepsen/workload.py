"""The clients of a nemesis run, one role per process, each writing its history as JSON lines.

    python -m compat_tests.jepsen.workload ROLE OUT STOPFILE ARGS...

Roles (all run until STOPFILE exists):

* ``producer BOOTSTRAP TOPIC NAME``: a confluent-kafka (librdkafka) idempotent producer,
  acks=all, writing unique values ``NAME-SEQ``; one line per send with its outcome:
  ``{"op": "send", "value", "t0", "t1", "ok", "partition", "offset", "error"}``.
* ``consumer BOOTSTRAP TOPIC GROUP``: a confluent-kafka consumer in a group (subscribe),
  committing its position synchronously about twice a second; one line per commit:
  ``{"op": "commit", "group", "offsets": {partition: offset}, "t0", "t1", "ok", "error"}``.
* ``probe BROKERS GROUP TOPIC``: asks every broker directly (compat_tests/jepsen/wire.py)
  in rounds: OffsetCommits of the round number (group ``GROUP-all`` to every broker,
  ``GROUP-rr`` to one broker in turn), then OffsetFetches of both; one line per request:
  ``{"op": "pcommit"|"pfetch", "group", "broker", "round", "value", "t0", "t1", "error"}``;
  every tenth round it also names a new topic in a Metadata v1 request to every broker
  (which auto-creates it): ``{"op": "create", "topic", "broker", "t0", "t1", "ok"}``.
  BROKERS is ``ID@HOST:PORT,...``.
* ``admin BOOTSTRAP PREFIX``: creates a topic every second through a confluent-kafka
  AdminClient: ``{"op": "create", "topic", "t0", "t1", "ok", "error"}``.

Times are ``time.monotonic()``, one clock for every process of the machine (Linux's
CLOCK_MONOTONIC), so the checker can order operations of different processes by their
windows. May import the standard library, confluent_kafka and compat_tests.jepsen.wire.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from compat_tests.jepsen.wire import Conn


class History:
    def __init__(self, path: str) -> None:
        self.f: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - closed at exit
        self.lock = threading.Lock()

    def add(self, **event: Any) -> None:
        with self.lock:
            self.f.write(json.dumps(event) + "\n")


def _stopping(stopfile: str) -> Callable[[], bool]:
    return lambda: os.path.exists(stopfile)


def producer(h: History, stop: Callable[[], bool], bootstrap: str, topic: str, name: str) -> None:
    from confluent_kafka import Producer

    fatal = threading.Event()

    def on_error(err: Any) -> None:
        if err.fatal():
            h.add(op="fatal", error=err.name(), t=time.monotonic())
            fatal.set()

    def new() -> Any:
        return Producer(
            {
                "bootstrap.servers": bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "message.timeout.ms": 20000,
                "request.timeout.ms": 5000,
                "socket.timeout.ms": 5000,
                "retry.backoff.ms": 100,
                "topic.metadata.refresh.interval.ms": 2000,
                "error_cb": on_error,
            }
        )

    p = new()
    seq = 0
    while not stop():
        if fatal.is_set():
            # An idempotent producer that hit a fatal error never recovers: start another
            # (its unsent messages fail with _FATAL and are recorded as failed sends).
            p.flush(1)
            fatal.clear()
            p = new()
        value = f"{name}-{seq}"
        seq += 1
        t0 = time.monotonic()

        def done(err: Any, msg: Any, value: str = value, t0: float = t0) -> None:
            t1 = time.monotonic()
            if err is None:
                h.add(
                    op="send",
                    value=value,
                    t0=t0,
                    t1=t1,
                    ok=True,
                    partition=msg.partition(),
                    offset=msg.offset(),
                    error=None,
                )
            else:
                h.add(
                    op="send",
                    value=value,
                    t0=t0,
                    t1=t1,
                    ok=False,
                    partition=msg.partition(),
                    offset=None,
                    error=err.name(),
                )

        try:
            p.produce(topic, value=value.encode(), on_delivery=done)
        except Exception as e:
            h.add(
                op="send",
                value=value,
                t0=t0,
                t1=time.monotonic(),
                ok=False,
                partition=None,
                offset=None,
                error=repr(e),
            )
        p.poll(0.02)
    p.flush(30)


def consumer(h: History, stop: Callable[[], bool], bootstrap: str, topic: str, group: str) -> None:
    from confluent_kafka import Consumer, KafkaException

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 500,
            "socket.timeout.ms": 5000,
            "topic.metadata.refresh.interval.ms": 2000,
        }
    )
    c.subscribe([topic])
    positions: dict[int, int] = {}
    last_commit = time.monotonic()
    while not stop():
        m = c.poll(0.2)
        if m is not None and m.error() is None:
            part, off = m.partition(), m.offset()
            assert part is not None and off is not None  # a message without error has both
            positions[part] = off + 1
        if positions and time.monotonic() - last_commit > 0.5:
            from confluent_kafka import TopicPartition

            offsets = dict(positions)
            t0 = time.monotonic()
            try:
                c.commit(
                    offsets=[TopicPartition(topic, p, o) for p, o in offsets.items()],
                    asynchronous=False,
                )
                h.add(
                    op="commit",
                    group=group,
                    offsets=offsets,
                    t0=t0,
                    t1=time.monotonic(),
                    ok=True,
                    error=None,
                )
            except KafkaException as e:
                h.add(
                    op="commit",
                    group=group,
                    offsets=offsets,
                    t0=t0,
                    t1=time.monotonic(),
                    ok=False,
                    error=str(e.args[0].name() if e.args else e),
                )
            last_commit = time.monotonic()
    c.close()


def probe(h: History, stop: Callable[[], bool], brokers: str, group: str, topic: str) -> None:
    conns: dict[int, Conn] = {}
    for item in brokers.split(","):
        node, _, addr = item.partition("@")
        host, _, port = addr.rpartition(":")
        conns[int(node)] = Conn(host, int(port), timeout=1.0)
    nodes = sorted(conns)
    # Two groups: `GROUP-all` gets each round's commit from every broker at once (two
    # brokers accepting it in consecutive rounds are two coordinators); `GROUP-rr` gets it
    # from one broker per round, in turn, as clients on either side of a partition would
    # send theirs (a broker that accepted a commit the other side never saw then answers
    # OffsetFetch with an older offset).
    broadcast, rr = f"{group}-all", f"{group}-rr"

    def autocreate(node: int, conn: Conn, name: str) -> None:
        t0 = time.monotonic()
        md = conn.metadata([name])
        ok = not isinstance(md, str) and md.topic_errors.get(name) == 0
        ok = ok and not isinstance(md, str) and all(p.leader >= 0 for p in md.topics[name].values())
        h.add(
            op="create",
            topic=name,
            broker=node,
            t0=t0,
            t1=time.monotonic(),
            ok=ok,
            error=md if isinstance(md, str) else None,
        )

    rnd = 0
    while not stop():
        rnd += 1

        def one(node: int, conn: Conn, rnd: int = rnd) -> None:
            targets = [broadcast, rr] if node == nodes[rnd % len(nodes)] else [broadcast]
            for g in targets:
                t0 = time.monotonic()
                res = conn.commit(g, topic, 0, rnd)
                h.add(
                    op="pcommit",
                    group=g,
                    broker=node,
                    round=rnd,
                    value=rnd,
                    t0=t0,
                    t1=time.monotonic(),
                    error=res,
                )
            for g in (broadcast, rr):
                t0 = time.monotonic()
                got = conn.fetch(g, topic, 0)
                value, error = (None, got) if isinstance(got, str) else (got[1], got[0])
                h.add(
                    op="pfetch",
                    group=g,
                    broker=node,
                    round=rnd,
                    value=value,
                    t0=t0,
                    t1=time.monotonic(),
                    error=error,
                )

        if rnd % 10 == 0:
            # Auto-creation (Metadata v1 creates what it names) through every broker at
            # once: one name must get one writer, whichever broker was asked.
            auto = f"{topic}-auto-{rnd}"
            threads = [
                threading.Thread(target=autocreate, args=(n, c, auto)) for n, c in conns.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        # A round's requests go out together; the next round starts after all answered
        # (or timed out), which is what lets the checker order rounds in real time.
        threads = [threading.Thread(target=one, args=(n, c)) for n, c in conns.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.1)


def admin(h: History, stop: Callable[[], bool], bootstrap: str, prefix: str) -> None:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    a = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 5000})
    n = 0
    while not stop():
        n += 1
        topic = f"{prefix}-{n}"
        t0 = time.monotonic()
        try:
            a.create_topics([NewTopic(topic, 1, 3)], operation_timeout=5, request_timeout=8)[
                topic
            ].result(10)
            h.add(op="create", topic=topic, t0=t0, t1=time.monotonic(), ok=True, error=None)
        except Exception as e:
            err = e.args[0] if e.args else e
            h.add(
                op="create",
                topic=topic,
                t0=t0,
                t1=time.monotonic(),
                ok=False,
                error=str(err.name() if hasattr(err, "name") else err),
            )
        time.sleep(1.0)


def create(
    h: History, stop: Callable[[], bool], bootstrap: str, topic: str, partitions: str
) -> None:
    """Creates one topic (retrying until it exists): the producers' topic, before faults."""
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    a = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 60
    while True:
        try:
            a.create_topics([NewTopic(topic, int(partitions), 3)], operation_timeout=10)[
                topic
            ].result(20)
            return
        except Exception as e:
            if "TOPIC_ALREADY_EXISTS" in str(e):
                return
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def readall(
    h: History, stop: Callable[[], bool], bootstrap: str, topic: str, partitions: str
) -> None:
    """Reads every partition of `topic` from offset 0 to its end: one line per record."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "hk-jepsen-readall",
            "enable.auto.commit": False,
        }
    )
    for p in range(int(partitions)):
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
        h.add(op="end", partition=p, low=lo, high=hi)
        if hi <= 0:
            continue
        c.assign([TopicPartition(topic, p, 0)])
        got = 0
        deadline = time.monotonic() + 60
        while got < hi and time.monotonic() < deadline:
            m = c.poll(1)
            if m is None or m.error() is not None:
                continue
            off, value = m.offset(), m.value()
            assert off is not None and value is not None  # records the producers wrote
            h.add(op="read", partition=p, offset=off, value=value.decode())
            got = off + 1
    c.close()


def committed(
    h: History, stop: Callable[[], bool], bootstrap: str, topic: str, group: str, partitions: str
) -> None:
    """The group's committed offsets, as its coordinator answers them now."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    tps = c.committed([TopicPartition(topic, p) for p in range(int(partitions))], timeout=30)
    for tp in tps:
        h.add(
            op="committed",
            group=group,
            partition=tp.partition,
            offset=tp.offset if tp.offset >= 0 else None,
        )
    c.close()


ROLES: dict[str, Callable[..., None]] = {
    "producer": producer,
    "consumer": consumer,
    "probe": probe,
    "admin": admin,
    "create": create,
    "readall": readall,
    "committed": committed,
}

if __name__ == "__main__":
    role, out, stopfile, *args = sys.argv[1:]
    ROLES[role](History(out), _stopping(stopfile), *args)

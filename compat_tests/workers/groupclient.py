"""One consumer-group member with one Python Kafka client, in its own process.

`python -m compat_tests.workers.groupclient CLIENT --bootstrap B --topic T --group G ...`
subscribes (classic group protocol, auto-commit off), and for every record: records it,
sleeps `--delay-ms`, then commits offset+1 synchronously, so a member killed with SIGKILL
has reported at least what it committed (a commit refused by a rebalance is reported on
stderr; the partition's next owner reads that record again). Prints JSON lines on stdout (flushed each time):

    {"ev": "assigned", "parts": [0, 2], "t": <wall seconds>}
    {"ev": "rec", "p": 0, "o": 17, "v": "..."}
    {"ev": "closed", "n": <records>}

It stops (closing the consumer, which leaves the group unless it is static) when `--stop-file` exists, after
`--max-records`, or at `--timeout`. Imports the standard library and the client's package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Stop:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.deadline = time.monotonic() + args.timeout
        self.n = 0

    def now(self) -> bool:
        a = self.args
        return (
            (a.stop_file is not None and Path(a.stop_file).exists())
            or (a.max_records is not None and self.n >= a.max_records)
            or time.monotonic() > self.deadline
        )


def kafka_python(args: argparse.Namespace) -> None:
    from kafka import ConsumerRebalanceListener, KafkaConsumer, OffsetAndMetadata, TopicPartition
    from kafka.errors import CommitFailedError, IllegalStateError

    class Listener(ConsumerRebalanceListener):
        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        def on_partitions_assigned(self, assigned: Any) -> None:
            emit(ev="assigned", parts=sorted(tp.partition for tp in assigned), t=time.time())

    c = KafkaConsumer(
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=args.session_ms,
        heartbeat_interval_ms=args.heartbeat_ms,
        max_poll_records=10,
        group_instance_id=args.instance_id,
    )
    c.subscribe([args.topic], listener=Listener())
    stop = Stop(args)
    while not stop.now():
        for tp, msgs in c.poll(timeout_ms=200).items():
            for m in msgs:
                emit(ev="rec", p=m.partition, o=m.offset, v=m.value.decode())
                time.sleep(args.delay_ms / 1000)
                stop.n += 1
                try:
                    c.commit({TopicPartition(tp.topic, tp.partition): OffsetAndMetadata(m.offset + 1, "", -1)})
                except (CommitFailedError, IllegalStateError) as exc:
                    # A rebalance took the partition: the new owner re-reads from the last commit.
                    print(f"commit failed: {exc}", file=sys.stderr)
                    break
    c.close()
    emit(ev="closed", n=stop.n)


def confluent(args: argparse.Namespace, kip848: bool = False) -> None:
    from confluent_kafka import Consumer, KafkaException

    # With the KIP-848 protocol the assignment is incremental: on_assign hands over the
    # partitions added and on_revoke those taken away, so the member's whole set is kept
    # here and reported after each change (the classic protocol hands over the whole set).
    owned: set[int] = set()

    def on_assign(consumer: Any, partitions: Any) -> None:
        if kip848:
            owned.update(p.partition for p in partitions)
        else:
            owned.clear()
            owned.update(p.partition for p in partitions)
        emit(ev="assigned", parts=sorted(owned), t=time.time())

    def on_revoke(consumer: Any, partitions: Any) -> None:
        if kip848:
            owned.difference_update(p.partition for p in partitions)

    config: dict[str, Any] = {
        "bootstrap.servers": args.bootstrap,
        "group.id": args.group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
    }
    if kip848:
        # The session and heartbeat are the broker's (group.consumer.*) with this protocol.
        config["group.protocol"] = "consumer"
    else:
        config.update({"session.timeout.ms": args.session_ms, "heartbeat.interval.ms": args.heartbeat_ms})
    if args.instance_id is not None:
        config["group.instance.id"] = args.instance_id
    c = Consumer(config)
    c.subscribe([args.topic], on_assign=on_assign, on_revoke=on_revoke)
    stop = Stop(args)
    while not stop.now():
        m = c.poll(0.2)
        if m is None:
            continue
        if m.error():
            print(f"consumer error: {m.error()}", file=sys.stderr)  # shown when a test fails
            continue
        emit(ev="rec", p=m.partition(), o=m.offset(), v=m.value().decode())
        time.sleep(args.delay_ms / 1000)
        stop.n += 1
        try:
            c.commit(message=m, asynchronous=False)
        except KafkaException as exc:
            print(f"commit failed: {exc}", file=sys.stderr)
    c.close()
    emit(ev="closed", n=stop.n)


def aiokafka(args: argparse.Namespace) -> None:
    from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
    from aiokafka.errors import CommitFailedError, IllegalStateError

    class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        async def on_partitions_assigned(self, assigned: Any) -> None:
            emit(ev="assigned", parts=sorted(tp.partition for tp in assigned), t=time.time())

    async def main() -> None:
        c = AIOKafkaConsumer(
            bootstrap_servers=args.bootstrap,
            group_id=args.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=args.session_ms,
            heartbeat_interval_ms=args.heartbeat_ms,
        )
        c.subscribe([args.topic], listener=Listener())
        await c.start()
        stop = Stop(args)
        try:
            while not stop.now():
                batch = await c.getmany(timeout_ms=200, max_records=10)
                for tp, msgs in batch.items():
                    for m in msgs:
                        emit(ev="rec", p=m.partition, o=m.offset, v=m.value.decode())
                        await asyncio.sleep(args.delay_ms / 1000)
                        stop.n += 1
                        try:
                            await c.commit({TopicPartition(tp.topic, tp.partition): m.offset + 1})
                        except (CommitFailedError, IllegalStateError) as exc:
                            print(f"commit failed: {exc}", file=sys.stderr)
                            break
        finally:
            await c.stop()
        emit(ev="closed", n=stop.n)

    asyncio.run(main())


def confluent_848(args: argparse.Namespace) -> None:
    confluent(args, kip848=True)


CLIENTS = {"kafka-python": kafka_python, "confluent": confluent, "confluent-848": confluent_848, "aiokafka": aiokafka}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("client", choices=sorted(CLIENTS))
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--session-ms", type=int, default=6000)
    p.add_argument("--heartbeat-ms", type=int, default=500)
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--max-records", type=int)
    p.add_argument("--stop-file")
    p.add_argument("--timeout", type=float, default=120)
    # A static member (group.instance.id; kafka-python and confluent-kafka only): closing
    # it sends no LeaveGroup, so a new process with the same id takes its place.
    p.add_argument("--instance-id")
    args = p.parse_args()
    CLIENTS[args.client](args)


if __name__ == "__main__":
    main()

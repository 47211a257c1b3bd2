#!/opt/hyperkafka/bin/python
"""The compose demo's producer and console consumer (docker/compose.yaml), with kafka-python.

    hyperkafka-demo-client produce HOST:PORT   # one record a second to topic "demo"
    hyperkafka-demo-client consume HOST:PORT   # print every record of "demo" as it arrives

The producer outlives its broker: while the writer is stopped it keeps waiting for record
n's acknowledgement (kafka-python retries it on reconnect), sends it again only when that
attempt has failed for good, and moves to record n+1 only once n is acknowledged; record
n is "demo record n", so the consumer shows whether any was lost. (A record whose answer
was lost in the restart can still be stored twice: this producer is not idempotent.)
SIGTERM (docker stop, through tini) ends either client at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

TOPIC = "demo"


def _producer(bootstrap: str) -> KafkaProducer:
    while True:
        try:
            return KafkaProducer(
                bootstrap_servers=bootstrap,
                acks="all",
                request_timeout_ms=5000,
                max_block_ms=5000,
                reconnect_backoff_max_ms=1000,
            )
        except KafkaError as exc:
            print(f"waiting for {bootstrap}: {exc}", flush=True)
            time.sleep(1)


def produce(bootstrap: str) -> None:
    producer = _producer(bootstrap)
    i = 0
    pending = None  # record i's future: while it is pending, record i is not sent again
    down_since: float | None = None
    while True:
        try:
            if pending is None:
                pending = producer.send(TOPIC, b"demo record %d" % i)
            meta = pending.get(timeout=5)
        except KafkaError as exc:
            if pending is not None and pending.is_done:
                pending = None  # failed for good (e.g. expired): send record i again
            if down_since is None:
                down_since = time.monotonic()
            print(f"record {i} not acknowledged yet ({type(exc).__name__}); retrying", flush=True)
            time.sleep(1)
            continue
        pending = None
        if down_since is not None:
            print(f"writer back after {time.monotonic() - down_since:.0f} s", flush=True)
            down_since = None
        print(f"produced record {i} at offset {meta.offset}", flush=True)
        i += 1
        time.sleep(1)


def consume(bootstrap: str) -> None:
    tp = TopicPartition(TOPIC, 0)
    while True:
        try:
            c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
            if c.partitions_for_topic(TOPIC):
                break
            c.close()
        except KafkaError:
            pass
        time.sleep(1)  # a mirror attaches "demo" once the writer's catalog has it
    c.assign([tp])
    c.seek(tp, 0)
    for m in c:
        print(f"{bootstrap} offset {m.offset}: {m.value.decode()}", flush=True)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if len(sys.argv) != 3 or sys.argv[1] not in ("produce", "consume"):
        sys.exit("usage: hyperkafka-demo-client produce|consume HOST:PORT")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C under `docker run -it`: no traceback
        {"produce": produce, "consume": consume}[sys.argv[1]](sys.argv[2])


if __name__ == "__main__":
    main()

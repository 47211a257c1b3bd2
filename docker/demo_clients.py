"""The demo's producer and console consumer (docker/compose.yaml), with kafka-python.

    python demo_clients.py produce HOST:PORT   # one record a second to topic "demo"
    python demo_clients.py consume HOST:PORT   # print every record of "demo" as it arrives
"""

from __future__ import annotations

import sys
import time

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError


def produce(bootstrap: str) -> None:
    producer = None
    while producer is None:
        try:
            producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        except KafkaError:
            time.sleep(1)  # the broker is still starting
    i = 0
    while True:
        meta = producer.send("demo", b"demo record %d at %d" % (i, int(time.time()))).get(timeout=30)
        print(f"produced offset {meta.offset}", flush=True)
        i += 1
        time.sleep(1)


def consume(bootstrap: str) -> None:
    tp = TopicPartition("demo", 0)
    while True:
        try:
            c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
            if c.partitions_for_topic("demo"):
                break
            c.close()
        except KafkaError:
            pass
        time.sleep(1)  # the mirror attaches "demo" once the writer's catalog has it
    c.assign([tp])
    c.seek(tp, 0)
    for m in c:
        print(f"{bootstrap} offset {m.offset}: {m.value.decode()}", flush=True)


if __name__ == "__main__":
    {"produce": produce, "consume": consume}[sys.argv[1]](sys.argv[2])

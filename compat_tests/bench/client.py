"""Load generators, each run as its own process: `python -m compat_tests.bench.client MODE SPEC`.

SPEC is one JSON object; the process prints `READY` once it is positioned (consumers and the
idle-connection holder), and its result as the last stdout line, one JSON object. Every
mode uses librdkafka through confluent-kafka, so each broker sees the very same client.

Modes:
- `produce`: N records of S bytes as fast as the producer takes them; MB/s and errors;
- `consume`: read N records from the start of every partition (assign, no group);
- `paced-produce`: records at a fixed byte rate; produce (send -> ack) latencies;
- `e2e-consume`: read N records (assign or a group), end-to-end latency from the
  producer's wall-clock stamp in each record's first 8 bytes to receipt here;
- `touch`: one record into each partition (so every partition exists on disk);
- `idle-conns`: open N connections, do one ApiVersions on each, hold them until stdin closes.

Imports the standard library and confluent_kafka only (never the broker).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

MB = 1_000_000  # throughput is reported in MB/s (10^6), as kafka-producer-perf-test does

Spec = dict[str, Any]


class ClientError(Exception):
    """The load generator could not finish its job (errors, or no progress in time)."""


def stamped_payload(size: int) -> bytearray:
    """A record value of `size` bytes whose first 8 are rewritten with a timestamp per send."""
    body = bytearray(size)
    body[8:] = (bytes(range(256)) * (size // 256 + 1))[: max(0, size - 8)]
    return body


def percentiles(values: list[float], points: tuple[float, ...]) -> dict[str, float]:
    """Nearest-rank percentiles of `values` (ms); empty input gives no keys."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for p in points:
        rank = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
        out[f"p{p:g}"] = ordered[rank]
    out["max"] = ordered[-1]
    return out


def producer_config(spec: Spec) -> dict[str, Any]:
    return {
        "bootstrap.servers": spec["bootstrap"],
        "acks": str(spec.get("acks", "1")),
        "linger.ms": spec.get("linger_ms", 5),
        "batch.size": spec.get("batch_bytes", 1 << 20),
        # librdkafka caps a batch at message.max.bytes too; 1 MiB stays under Kafka's
        # default broker limit (1 MiB + 12).
        "message.max.bytes": max(1_000_000, spec.get("batch_bytes", 1 << 20)),
        "compression.type": "none",
        "enable.idempotence": False,
        "queue.buffering.max.kbytes": 256 * 1024,
        "client.id": "hk-bench",
    }


def consumer_config(spec: Spec, group: str) -> dict[str, Any]:
    return {
        "bootstrap.servers": spec["bootstrap"],
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "client.id": "hk-bench",
        # librdkafka's default fetch.wait.max.ms (500): a broker that answers a parked
        # Fetch as soon as data arrives gets low end-to-end latency, one that waits does not.
        # librdkafka >= 2.4 stops fetching a partition for fetch.queue.backoff.ms (default
        # 1000) once its local queue is over queued.max.messages.kbytes: a broker that
        # delivers faster than this Python loop drains (~1 GB/s) then sits idle for a
        # second, two or three times per GiB (debug=fetch: "Fetch backoff for 1000ms:
        # Local: Queue full"), and the figure measures the back-off, not the broker. The
        # same setting for every broker; a short back-off still stops the queue growing.
        "fetch.queue.backoff.ms": 10,
    }


# ---------------------------------------------------------------------------- producers


def produce(spec: Spec) -> dict[str, Any]:
    records = int(spec["records"])
    size = int(spec["record_size"])
    errors: list[str] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            errors.append(str(err))

    stats: list[dict[str, Any]] = []
    conf = producer_config(spec)
    conf["on_delivery"] = on_delivery
    # librdkafka's statistics count the Produce requests it sent (to size them per request).
    conf["statistics.interval.ms"] = 500
    conf["stats_cb"] = lambda text: stats.append(json.loads(text))
    p = Producer(conf)
    value = bytes(stamped_payload(size))
    topic = spec["topic"]
    # The metadata round trip is not part of the measured transfer.
    p.list_topics(topic, timeout=30)
    start = time.perf_counter()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value)
                break
            except BufferError:
                p.poll(0.005)
        if i % 2000 == 0:
            p.poll(0)
    left = p.flush(float(spec.get("timeout", 600)))
    seconds = time.perf_counter() - start
    cpu = os.times()
    if left or errors:
        raise ClientError(f"{left} records undelivered, {len(errors)} errors: {errors[:3]}")
    p.poll(0.6)  # one more statistics report, taken after the last request
    requests = produce_requests(stats[-1]) if stats else 0
    return {"records": records, "bytes": records * size, "seconds": seconds,
            "mb_s": records * size / MB / seconds, "requests": requests,
            "cpu_s": cpu.user + cpu.system}  # fmt: skip


def produce_requests(stats: dict[str, Any]) -> int:
    """Produce requests sent to real brokers, from one librdkafka statistics report."""
    total = 0
    for broker in stats.get("brokers", {}).values():
        if broker.get("nodeid", -1) >= 0:
            total += int(broker.get("req", {}).get("Produce", 0))
    return total


def paced_produce(spec: Spec) -> dict[str, Any]:
    """Records at `rate_bytes` per second for `seconds`; latency of each send -> ack."""
    size = int(spec["record_size"])
    rate = float(spec["rate_bytes"]) / size  # records per second
    total = int(rate * float(spec["seconds"]))
    warmup = int(total * float(spec.get("warmup_fraction", 0.1)))
    latencies: list[float] = []
    errors: list[str] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            errors.append(str(err))
            return
        lat = msg.latency()  # librdkafka's own produce() -> delivery report, in seconds
        if lat is not None:
            latencies.append(lat * 1000.0)

    stats: list[dict[str, Any]] = []
    conf = producer_config(spec)
    conf["on_delivery"] = on_delivery
    conf["statistics.interval.ms"] = 500  # to count the Produce requests
    conf["stats_cb"] = lambda text: stats.append(json.loads(text))
    p = Producer(conf)
    topic = spec["topic"]
    p.list_topics(topic, timeout=30)
    value = stamped_payload(size)
    start = time.perf_counter()
    sent = 0
    while sent < total:
        due = min(total, int((time.perf_counter() - start) * rate) + 1)
        while sent < due:
            struct.pack_into(">q", value, 0, time.time_ns())
            p.produce(topic, bytes(value))
            sent += 1
        p.poll(0)
        # Sleep to the next record's due time, in steps of at most 1 ms.
        ahead = sent / rate - (time.perf_counter() - start)
        if ahead > 0:
            time.sleep(min(ahead, 0.001))
    # The offered rate is judged over the sending period: the final flush is latency.
    send_seconds = time.perf_counter() - start
    left = p.flush(60)
    if left or errors:
        raise ClientError(f"{left} records undelivered, {len(errors)} errors: {errors[:3]}")
    kept = latencies[warmup:]
    p.poll(0.6)  # one more statistics report, taken after the last request
    requests = produce_requests(stats[-1]) if stats else 0
    return {"records": total, "seconds": send_seconds, "requests": requests,
            "mb_s": total * size / MB / max(send_seconds, 1e-9),
            "produce_ms": percentiles(kept, (50, 99, 99.9))}  # fmt: skip


def touch(spec: Spec) -> dict[str, Any]:
    p = Producer(producer_config(spec))
    for part in range(int(spec["partitions"])):
        p.produce(spec["topic"], b"x", partition=part)
        p.poll(0)
    left = p.flush(float(spec.get("timeout", 300)))
    if left:
        raise ClientError(f"{left} touch records undelivered")
    return {"partitions": int(spec["partitions"])}


# ---------------------------------------------------------------------------- consumers


def _drain(
    c: Consumer,
    expect: int,
    idle_timeout: float,
    on_batch: Callable[[list[Message], int], None],
    pending: Message | None = None,
) -> tuple[int, int, float, float]:
    """Consume until `expect` records arrived, `pending` (one already polled) first;
    (records, bytes, first, last perf_counter)."""
    got = nbytes = 0
    first = last = time.perf_counter()
    last_progress = time.monotonic()
    while got < expect:
        # poll() returns the moment one record is there (consume(n, t) would wait for n or
        # for t, which adds up to t to every end-to-end latency); the rest of what is
        # queued follows without waiting.
        head, pending = (pending, None) if pending is not None else (c.poll(0.2), None)
        if head is None:
            if time.monotonic() - last_progress > idle_timeout:
                raise ClientError(f"stalled at {got}/{expect} records for {idle_timeout:.0f}s")
            continue
        now_ns = time.time_ns()
        batch = [head, *c.consume(999, 0)]
        last = time.perf_counter()
        if got == 0:
            first = last
        good = 0
        for m in batch:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise ClientError(f"consume error: {err}")
            v = m.value()
            if v is not None:
                nbytes += len(v)
            good += 1
        got += good
        on_batch(batch, now_ns)
        last_progress = time.monotonic()
    return got, nbytes, first, last


def _assign_all(c: Consumer, topic: str, partitions: int) -> None:
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])


def consume(spec: Spec) -> dict[str, Any]:
    c = Consumer(consumer_config(spec, spec.get("group", "hk-bench-assign")))
    try:
        c.list_topics(spec["topic"], timeout=30)
        start = time.perf_counter()
        _assign_all(c, spec["topic"], int(spec["partitions"]))
        got, nbytes, _first, last = _drain(
            c, int(spec["records"]), float(spec.get("idle_timeout", 60)), lambda _b, _t: None
        )
    finally:
        c.close()
    seconds = last - start
    return {"records": got, "bytes": nbytes, "seconds": seconds, "mb_s": nbytes / MB / seconds}


def e2e_consume(spec: Spec) -> dict[str, Any]:
    """Latency from the producer's stamp to receipt; in a group when spec has "group"."""
    group = spec.get("group")
    c = Consumer(consumer_config(spec, group or "hk-bench-e2e"))
    lat: list[float] = []
    assigned: list[int] = []
    pending: Message | None = None

    def on_assign(_c: Consumer, parts: list[TopicPartition]) -> None:
        assigned.extend(tp.partition for tp in parts)

    def record(batch: list[Message], now_ns: int) -> None:
        for m in batch:
            v = m.value()
            if m.error() is None and v is not None and len(v) >= 8:
                lat.append((now_ns - struct.unpack_from(">q", v, 0)[0]) / 1e6)

    try:
        if group:
            c.subscribe([spec["topic"]], on_assign=on_assign)
            deadline = time.monotonic() + float(spec.get("join_timeout", 120))
            # Poll until the group hands us every partition; records that arrive now are
            # kept (auto.offset.reset=earliest replays them anyway after a rebalance).
            while len(set(assigned)) < int(spec["partitions"]):
                if time.monotonic() > deadline:
                    raise ClientError(f"group join: {len(set(assigned))} partitions assigned")
                c.poll(0.1)
        else:
            c.list_topics(spec["topic"], timeout=30)
            _assign_all(c, spec["topic"], int(spec["partitions"]))
            # The first Fetch is in flight: the consumer is positioned. What it returned
            # (a topic may hold records already: the bench warms a cluster's) is counted.
            pending = c.poll(0.5)
        print("READY", flush=True)
        start = time.perf_counter()
        got, nbytes, first, last = _drain(
            c, int(spec["records"]), float(spec.get("idle_timeout", 60)), record, pending
        )
    finally:
        c.close()
    warmup = int(len(lat) * float(spec.get("warmup_fraction", 0.1)))
    kept = lat[warmup:]
    return {"records": got, "bytes": nbytes, "seconds": last - start, "first": first,
            "last": last, "e2e_ms": percentiles(kept, (50, 99, 99.9))}  # fmt: skip


# ---------------------------------------------------------------------------- connections


def idle_conns(spec: Spec) -> dict[str, Any]:
    host, _, port = spec["bootstrap"].rpartition(":")
    socks: list[socket.socket] = []
    client_id = b"hk-bench-idle"
    try:
        for i in range(int(spec["connections"])):
            s = socket.create_connection((host, int(port)), timeout=10)
            body = struct.pack(">hhih", 18, 0, i, len(client_id)) + client_id
            s.sendall(struct.pack(">i", len(body)) + body)
            head = s.recv(8)
            if len(head) < 8 or struct.unpack(">ii", head)[1] != i:
                raise ClientError(f"connection {i}: no ApiVersions answer")
            s.setblocking(False)
            socks.append(s)
        print("READY", flush=True)
        sys.stdin.read()  # hold them until the parent closes our stdin
    finally:
        for s in socks:
            s.close()
    return {"connections": len(socks)}


MODES: dict[str, Callable[[Spec], dict[str, Any]]] = {
    "produce": produce,
    "paced-produce": paced_produce,
    "touch": touch,
    "consume": consume,
    "e2e-consume": e2e_consume,
    "idle-conns": idle_conns,
}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in MODES:
        print(
            f"usage: python -m compat_tests.bench.client {{{','.join(MODES)}}} JSON",
            file=sys.stderr,
        )
        return 2
    try:
        result = MODES[argv[0]](json.loads(argv[1]))
    except (ClientError, KafkaException) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Produce or consume records with one Python Kafka client, in its own process.

Owns the per-client code for kafka-python, confluent-kafka and aiokafka: each test runs it
as `python -m compat_tests.workers.pyclient CLIENT produce|consume ...` so a hung client is
killed by a timeout and never shares a process (or an event loop) with pytest. Records come
and go as JSON lines (compat_tests.records). Consumption is assign-mode (no group).

Prints one JSON line on stdout at the end: for produce {"offsets": [first, last], "n": N,
...}, for consume {"n": N, "high_watermark": H}. With --allow-errors a produce reports the
records the broker refused instead of failing: {"n": delivered, "error_codes": {code:
count}, "errors": ["ExceptionType: text", ...]}, each error as the client surfaced it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from compat_tests.records import Record, iter_jsonl, write_jsonl

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


def _fail(msg: str) -> None:
    print(msg, file=sys.stderr)
    raise SystemExit(1)


class _Clock:
    """Stop at the overall timeout, or when nothing new arrived for --idle seconds.

    The idle limit keeps a broker that lost data from costing the whole timeout per test.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.deadline = time.monotonic() + args.timeout
        self.idle = args.idle
        self.last_n = -1
        self.last_change = time.monotonic()

    def go_on(self, n: int) -> bool:
        now = time.monotonic()
        if n != self.last_n:
            self.last_n, self.last_change = n, now
        return now < self.deadline and now - self.last_change < self.idle


def _refusals(n: int, errors: list[tuple[int, str]]) -> dict[str, Any]:
    """The --allow-errors summary: delivered count, Kafka error codes, the clients' texts."""
    codes: dict[str, int] = {}
    for code, _text in errors:
        codes[str(code)] = codes.get(str(code), 0) + 1
    return {"n": n, "error_codes": codes, "errors": [text for _code, text in errors]}


def _surfaced(e: BaseException) -> tuple[int, str]:
    """(Kafka error code, "Type: text") of an exception kafka-python or aiokafka raised."""
    code = getattr(e, "errno", None)
    return (code if isinstance(code, int) else -1), f"{type(e).__name__}: {e}"


def _check_offsets(offsets: list[int]) -> dict[str, Any]:
    """The producer's own acks must be consecutive offsets: no gaps, no reorder."""
    for a, b in itertools.pairwise(offsets):
        if b != a + 1:
            _fail(f"producer acks not consecutive: ... {a}, {b} ...")
    return {"n": len(offsets), "offsets": [offsets[0], offsets[-1]] if offsets else []}


# ---------------------------------------------------------------------------- kafka-python


def kp_produce(args: argparse.Namespace, records: list[Record]) -> dict[str, Any]:
    from kafka import KafkaProducer

    kw: dict[str, Any] = {
        "bootstrap_servers": args.bootstrap,
        "acks": "all" if args.acks == "all" else int(args.acks),
        "linger_ms": 5,
        "batch_size": 256 * 1024,
        "max_request_size": 4 * 1024 * 1024,
        "request_timeout_ms": 30_000,
    }
    if args.codec != "none":
        kw["compression_type"] = args.codec
    if args.idempotence is not None:
        kw["enable_idempotence"] = args.idempotence == "on"
    producer = KafkaProducer(**kw)
    futures = [
        producer.send(
            args.topic,
            value=r.value,
            key=r.key,
            headers=[(n, v if v is not None else b"") for n, v in r.headers],
            partition=args.partition,
            timestamp_ms=r.timestamp,
        )
        for r in records
    ]
    producer.flush(timeout=120)
    if args.allow_errors:
        from kafka.errors import KafkaError

        delivered, errors = 0, []
        for f in futures:
            try:
                f.get(timeout=30)
                delivered += 1
            except KafkaError as e:
                errors.append(_surfaced(e))
        producer.close(timeout=10)
        return _refusals(delivered, errors)
    offsets = [f.get(timeout=30).offset for f in futures]
    result = _check_offsets(offsets)
    tm = getattr(producer, "_transaction_manager", None)
    pid_epoch = getattr(tm, "producer_id_and_epoch", None) if tm is not None else None
    result["producer_id"] = getattr(pid_epoch, "producer_id", None)
    producer.close(timeout=10)
    return result


def kp_consume(args: argparse.Namespace) -> tuple[list[Record], int]:
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(args.topic, args.partition)
    consumer = KafkaConsumer(
        bootstrap_servers=args.bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    consumer.assign([tp])
    consumer.seek(tp, args.offset)
    out: list[Record] = []
    clock = _Clock(args)
    while len(out) < args.count and clock.go_on(len(out)):
        for msgs in consumer.poll(timeout_ms=500).values():
            for m in msgs:
                out.append(
                    Record(
                        m.key, m.value, tuple((n, v) for n, v in m.headers), m.timestamp, m.offset
                    )
                )
    out += _drain_extra_kp(consumer)
    hwm = consumer.end_offsets([tp])[tp]
    consumer.close()
    return out, hwm


def _drain_extra_kp(consumer: Any) -> list[Record]:
    """Anything past the expected count is a duplicate or a stray: collect it to report."""
    extra: list[Record] = []
    for msgs in consumer.poll(timeout_ms=300).values():
        extra += [Record(m.key, m.value, tuple(m.headers), m.timestamp, m.offset) for m in msgs]
    return extra


# ---------------------------------------------------------------------------- confluent


def ck_produce(args: argparse.Namespace, records: list[Record]) -> dict[str, Any]:
    import confluent_kafka as ck

    conf: dict[str, Any] = {
        "bootstrap.servers": args.bootstrap,
        "acks": args.acks,
        "linger.ms": 5,
        "compression.type": args.codec,
        "message.max.bytes": 4 * 1024 * 1024,
        "queue.buffering.max.messages": 200_000,
    }
    if args.idempotence is not None:
        conf["enable.idempotence"] = args.idempotence == "on"
    producer = ck.Producer(conf)
    offsets: list[int] = []
    errors: list[tuple[int, str]] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append((err.code(), f"{err.name()}: {err.str()}"))
        else:
            offsets.append(msg.offset())

    for r in records:
        kwargs: dict[str, Any] = {"partition": args.partition, "on_delivery": on_delivery}
        if r.headers:
            kwargs["headers"] = list(r.headers)
        if r.timestamp is not None:
            kwargs["timestamp"] = r.timestamp
        while True:
            try:
                producer.produce(args.topic, r.value, r.key, **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    left = producer.flush(120)
    if left:
        _fail(f"confluent producer: {left} undelivered, errors: {errors[:5]}")
    if args.allow_errors:
        return _refusals(len(offsets), errors)
    if errors:
        _fail(f"confluent producer: delivery errors: {errors[:5]}")
    return _check_offsets(offsets)


def ck_consume(args: argparse.Namespace) -> tuple[list[Record], int]:
    import confluent_kafka as ck

    # librdkafka's Consumer insists on a group.id even for assign(); with auto commit off
    # and no subscribe() it joins nothing, but it may still look up the coordinator.
    consumer = ck.Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": "hk-compat-assign-only",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "fetch.max.bytes": 8 * 1024 * 1024,
        }
    )
    consumer.assign([ck.TopicPartition(args.topic, args.partition, args.offset)])
    out: list[Record] = []
    clock = _Clock(args)
    while len(out) < args.count + 1 and clock.go_on(len(out)):
        budget = 0.3 if len(out) >= args.count else 0.5
        msgs = consumer.consume(num_messages=1000, timeout=budget)
        if not msgs and len(out) >= args.count:
            break
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == ck.KafkaError._PARTITION_EOF:
                    continue
                _fail(f"confluent consumer error: {err}")
            _tstype, ts = m.timestamp()
            headers: Any = m.headers() or ()
            out.append(Record(m.key(), m.value(), tuple(headers), ts, m.offset()))
    try:
        _low, hwm = consumer.get_watermark_offsets(
            ck.TopicPartition(args.topic, args.partition), timeout=10
        )
    except ck.KafkaException as e:
        print(f"get_watermark_offsets: {e}", file=sys.stderr)
        hwm = -1
    consumer.close()
    return out, hwm


# ---------------------------------------------------------------------------- aiokafka


async def ak_produce_async(args: argparse.Namespace, records: list[Record]) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer

    kw: dict[str, Any] = {
        "bootstrap_servers": args.bootstrap,
        "acks": "all" if args.acks == "all" else int(args.acks),
        "linger_ms": 5,
        "max_batch_size": 256 * 1024,
        "max_request_size": 4 * 1024 * 1024,
    }
    if args.codec != "none":
        kw["compression_type"] = args.codec
    if args.idempotence is not None:
        kw["enable_idempotence"] = args.idempotence == "on"
    producer = AIOKafkaProducer(**kw)
    await producer.start()
    try:
        futures = []
        for r in records:
            futures.append(
                await producer.send(
                    args.topic,
                    value=r.value,
                    key=r.key,
                    partition=args.partition,
                    headers=[(n, v if v is not None else b"") for n, v in r.headers] or None,
                    timestamp_ms=r.timestamp,
                )
            )
        if args.allow_errors:
            from aiokafka.errors import KafkaError

            outcomes = await asyncio.wait_for(
                asyncio.gather(*futures, return_exceptions=True), timeout=120
            )
            errors = []
            for o in outcomes:
                if isinstance(o, KafkaError):
                    errors.append(_surfaced(o))
                elif isinstance(o, BaseException):
                    raise o
            return _refusals(len(outcomes) - len(errors), errors)
        metas = await asyncio.wait_for(asyncio.gather(*futures), timeout=120)
    finally:
        await producer.stop()
    return _check_offsets([m.offset for m in metas])


async def ak_consume_async(args: argparse.Namespace) -> tuple[list[Record], int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    tp = TopicPartition(args.topic, args.partition)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=args.bootstrap,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, args.offset)
        out: list[Record] = []
        clock = _Clock(args)
        while clock.go_on(len(out)):
            batch = await consumer.getmany(tp, timeout_ms=300 if len(out) >= args.count else 500)
            got = batch.get(tp, [])
            if not got and len(out) >= args.count:
                break
            out += [Record(m.key, m.value, tuple(m.headers), m.timestamp, m.offset) for m in got]
        hwm = (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()
    return out, hwm


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("client", choices=["kafka-python", "confluent", "aiokafka"])
    ap.add_argument("action", choices=["produce", "consume"])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--partition", type=int, default=0)
    ap.add_argument("--codec", choices=CODECS, default="none")
    ap.add_argument("--acks", default="all", choices=["all", "0", "1"])
    ap.add_argument("--idempotence", choices=["on", "off"], default=None)
    ap.add_argument(
        "--allow-errors",
        action="store_true",
        help="report records the broker refused (produce) instead of failing",
    )
    ap.add_argument("--infile", type=Path)
    ap.add_argument("--outfile", type=Path)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--idle", type=float, default=20.0, help="give up after this long without a new record"
    )
    args = ap.parse_args(argv)

    summary: dict[str, Any]
    if args.action == "produce":
        if args.infile is None:
            ap.error("produce needs --infile")
        records = list(iter_jsonl(args.infile))
        if args.client == "kafka-python":
            summary = kp_produce(args, records)
        elif args.client == "confluent":
            summary = ck_produce(args, records)
        else:
            summary = asyncio.run(ak_produce_async(args, records))
    else:
        if args.outfile is None:
            ap.error("consume needs --outfile")
        if args.client == "kafka-python":
            got, hwm = kp_consume(args)
        elif args.client == "confluent":
            got, hwm = ck_consume(args)
        else:
            got, hwm = asyncio.run(ak_consume_async(args))
        write_jsonl(args.outfile, got)
        summary = {"n": len(got), "high_watermark": hwm}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The well-behaved client of an attack: an idempotent acks=all producer, or a consumer.

Run as `python -m compat_tests.attack.goodclient produce BOOTSTRAP TOPIC` it writes
records "good-<seq>" at a steady rate (librdkafka, enable.idempotence, acks=all) and prints
one line per delivery report, `a <seq> <offset>` or `e <seq> <error>`, until a line arrives
on stdin; then it flushes and prints `done <produced> <acked> <errors>`.
`consume BOOTSTRAP TOPIC END` reads partition 0 from the beginning up to offset END and
prints `r <offset> <value>` per record, then `done <n>` (or `stuck <next offset>` when
nothing arrives for --idle seconds).

Imports confluent_kafka and the standard library.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def produce(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaError, Producer

    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    p = Producer({
        "bootstrap.servers": args.bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "message.timeout.ms": int(args.delivery_timeout * 1000),
        "socket.timeout.ms": 30_000,
        "client.id": "hk-attack-good",
    })  # fmt: skip
    counts = {"acked": 0, "errors": 0}
    out = sys.stdout

    def report(err: KafkaError | None, msg: object) -> None:
        seq = int(msg.value()[5:])  # type: ignore[attr-defined]
        if err is None:
            counts["acked"] += 1
            out.write(f"a {seq} {msg.offset()}\n")  # type: ignore[attr-defined]
        else:
            counts["errors"] += 1
            out.write(f"e {seq} {err.code()} {str(err).replace(chr(10), ' ')}\n")

    seq = 0
    interval = 1.0 / args.rate
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            p.produce(args.topic, value=b"good-%d" % seq, key=b"k%d" % (seq % 16),
                      partition=0, on_delivery=report)  # fmt: skip
            seq += 1
        except BufferError:
            pass  # the local queue is full: the broker is not keeping up
        p.poll(0)
        out.flush()
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            p.poll(delay)
        else:
            next_at = time.monotonic()
    left = p.flush(args.flush_timeout)
    out.write(f"done {seq} {counts['acked']} {counts['errors']} {left}\n")
    out.flush()
    return 0


def consume(args: argparse.Namespace) -> int:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": "hk-attack-readback",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "fetch.message.max.bytes": 1 << 20,
    })  # fmt: skip
    c.assign([TopicPartition(args.topic, 0, OFFSET_BEGINNING)])
    n = 0
    next_offset = 0
    last = time.monotonic()
    out = sys.stdout
    while next_offset < args.end:
        msg = c.poll(0.5)
        if msg is None or msg.error():
            if time.monotonic() - last > args.idle:
                out.write(f"stuck {next_offset}\n")
                out.flush()
                c.close()
                return 0
            continue
        last = time.monotonic()
        value = msg.value() or b""
        offset = msg.offset() or 0
        out.write(f"r {offset} {value.decode('utf-8', 'replace')}\n")
        n += 1
        next_offset = offset + 1
    out.write(f"done {n}\n")
    out.flush()
    c.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="goodclient")
    sub = ap.add_subparsers(dest="mode", required=True)
    pr = sub.add_parser("produce")
    pr.add_argument("bootstrap")
    pr.add_argument("topic")
    pr.add_argument("--rate", type=float, default=200.0, help="records per second")
    pr.add_argument("--delivery-timeout", type=float, default=120.0)
    pr.add_argument("--flush-timeout", type=float, default=60.0)
    co = sub.add_parser("consume")
    co.add_argument("bootstrap")
    co.add_argument("topic")
    co.add_argument("end", type=int)
    co.add_argument("--idle", type=float, default=10.0)
    args = ap.parse_args(argv)
    return produce(args) if args.mode == "produce" else consume(args)


if __name__ == "__main__":
    sys.exit(main())

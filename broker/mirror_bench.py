"""Mirror catch-up throughput, through real processes (`scripts/bench mirror`).

``python -m broker.mirror_bench [--mb N] [--batch-kib K] [--dir D]`` writes N MB of K KiB
record batches into one partition of a fresh writer data dir (offline, through
`storage.Store`), starts the writer (`--replication-listen`) and a mirror (`--mirror`) as
processes, and times from the mirror's start until its high watermark (asked with Kafka
ListOffsets) equals the writer's: discovery, catalog, verification, fsync and all. Prints
MB/s and writes a JSON line under bench-results/. Imports `broker`, `storage` and trio.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from broker.protocol.codec import decode_response, encode_request
from broker.protocol.header import RequestHeader
from broker.shape import shape
from storage import FsyncPolicy, Store
from storage.batch import build_batch

TOPIC = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _high_watermark(port: int, topic: str = TOPIC) -> int:
    """ListOffsets v1 latest of partition 0, -1 if unknown or unreachable."""
    import importlib

    module = importlib.import_module("kio.schema.list_offsets.v1.request")
    req = shape(module.ListOffsetsRequest, {
        "replica_id": -1,
        "topics": [{"name": topic, "partitions": [{"partition_index": 0, "timestamp": -1}]}],
    })
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(encode_request(RequestHeader(2, 1, 1, "bench"), req))
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = s.recv(65536)
                if not chunk:
                    return -1
                buf += chunk
    except OSError:
        return -1
    _, resp = decode_response(buf[4:], 2, 1)
    p = resp.topics[0].partitions[0]
    return int(p.offset) if p.error_code == 0 else -1


def _attached_at(log_path: Path) -> float | None:
    """Wall clock when the mirror attached the topic (its INFO line), to leave out the
    process start-up (imports) from the transfer time."""
    import datetime

    for line in log_path.read_text(errors="replace").splitlines():
        if "mirroring topic" in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; nan elsewhere): on a busy
    machine MB per CPU-second is the figure that does not depend on the neighbours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _serve(data: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    log = open(data.with_suffix(".log"), "wb")  # noqa: SIM115 - handed to the child
    return subprocess.Popen([sys.executable, "-m", "broker", "serve", "--data-dir", str(data),
                             "--listen", f"127.0.0.1:{port}", "--log-level", "INFO", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(port: int, want: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _high_watermark(port) == want:
            return time.monotonic()
        time.sleep(0.05)
    raise SystemExit(f"port {port} did not reach high watermark {want} in {timeout}s")


LAG_PRODUCER = """
import sys, time
from confluent_kafka import Producer
bootstrap, seconds, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
p = Producer({"bootstrap.servers": bootstrap, "acks": "1", "linger.ms": 5})
value = b"x" * 10_000
per_s = rate * 1e6 / len(value)
t0 = time.time(); sent = 0
while time.time() - t0 < seconds:
    while sent < (time.time() - t0) * per_s:
        p.produce("lag", value, timestamp=int(time.time() * 1000)); sent += 1
    p.poll(0.001)
p.flush(30)
print(sent)
"""

LAG_CONSUMER = """
import json, sys, time
from confluent_kafka import Consumer, TopicPartition
bootstrap, n = sys.argv[1], int(sys.argv[2])
c = Consumer({"bootstrap.servers": bootstrap, "group.id": "lag", "enable.auto.commit": False,
              "fetch.wait.max.ms": 100, "fetch.min.bytes": 1})
c.assign([TopicPartition("lag", 0, 0)])
lags = []
deadline = time.time() + 120
while len(lags) < n and time.time() < deadline:
    m = c.poll(0.5)
    if m is None or m.error():
        continue
    lags.append(time.time() * 1000 - m.timestamp()[1])
print(json.dumps(lags))
"""


def _lag(wport: int, mport: int, seconds: float, rate: float) -> None:
    """Produce `rate` MB/s to the writer; the mirror's consumer measures each record's
    delay from its producer timestamp to its arrival from the mirror."""
    env = dict(os.environ)
    # the topic must exist on the writer (and be attached on the mirror) before timing
    pre = subprocess.run([sys.executable, "-c", LAG_PRODUCER, f"127.0.0.1:{wport}", "0.2", "0.1"],
                         capture_output=True, text=True, env=env, check=True)
    first = int(pre.stdout.strip() or 0)
    deadline = time.monotonic() + 30
    while _high_watermark(mport, "lag") < first and time.monotonic() < deadline:
        time.sleep(0.1)
    producer = subprocess.Popen([sys.executable, "-c", LAG_PRODUCER, f"127.0.0.1:{wport}", str(seconds), str(rate)],
                                stdout=subprocess.PIPE, text=True, env=env)
    expected = first + int(seconds * rate * 1e6 / 10_000)
    # the same records read from the writer at the same time: the baseline
    base = subprocess.Popen([sys.executable, "-c", LAG_CONSUMER, f"127.0.0.1:{wport}", str(expected)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    consumer = subprocess.run([sys.executable, "-c", LAG_CONSUMER, f"127.0.0.1:{mport}", str(expected)],
                              capture_output=True, text=True, env=env, timeout=300)
    sent = int((producer.communicate(timeout=120)[0] or "0").strip() or 0)
    base_out = base.communicate(timeout=120)[0]
    for name, raw in (("writer (baseline)", base_out), ("mirror", consumer.stdout)):
        lags = sorted(json.loads(raw or "[]")[first:])
        if not lags:
            print(f"lag from the {name}: no records measured", consumer.stderr[-500:])
            continue
        p50, p99 = lags[len(lags) // 2], lags[min(len(lags) - 1, int(len(lags) * 0.99))]
        print(f"produce on the writer -> consume from the {name} at {rate} MB/s for {seconds:.0f} s "
              f"({sent} records of 10 kB, acks=1): p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {lags[-1]:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--batch-kib", type=int, default=64)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--lag-seconds", type=float, default=0.0,
                    help="then produce --lag-rate-mb MB/s to the writer for this long and "
                         "measure writer-produce to mirror-consume latency (confluent-kafka)")
    ap.add_argument("--lag-rate-mb", type=float, default=10.0)
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="hk-mirror-bench-"))
    wdir, mdir = work / "writer", work / "mirror"
    store = Store.open(wdir, fsync=FsyncPolicy.NEVER)
    store.create_topic(TOPIC, 1, {})
    lg = store.log(TOPIC, 0)
    value = os.urandom(args.batch_kib * 1024 - 100)
    total = 0
    n = 0
    while total < args.mb * 1_000_000:
        batch = build_batch([value], timestamp_ms=int(time.time() * 1000))
        lg.append(batch)
        total += len(batch)
        n += 1
        if n % 256 == 0:
            lg.commit()
    store.close()
    wport, rport, mport = _free_port(), _free_port(), _free_port()
    procs = [_serve(wdir, wport, "--replication-listen", f"127.0.0.1:{rport}")]
    try:
        _wait(wport, n, 60)
        writer_cpu0 = _cpu_seconds(procs[0].pid)
        t0 = time.monotonic()
        procs.append(_serve(mdir, mport, "--mirror", f"127.0.0.1:{wport}"))
        t1 = _wait(mport, n, 600)
        wall = time.time()
        mirror_cpu = _cpu_seconds(procs[1].pid)
        writer_cpu = _cpu_seconds(procs[0].pid) - writer_cpu0
        dt = t1 - t0
        mbps = total / dt / 1e6
        attached = _attached_at(mdir.with_suffix(".log"))
        transfer = wall - attached if attached else float("nan")
        print(f"mirror caught up {total / 1e6:.0f} MB ({n} batches of {args.batch_kib} KiB) in "
              f"{dt:.2f} s from its process start: {mbps:.1f} MB/s; {transfer:.2f} s from the "
              f"topic attached to caught up: {total / transfer / 1e6:.1f} MB/s; CPU: mirror "
              f"{mirror_cpu:.2f} s (incl. start-up), writer {writer_cpu:.2f} s: "
              f"{total / 1e6 / max(mirror_cpu, writer_cpu):.1f} MB per CPU-second of the busier side")
        if args.lag_seconds > 0:
            _lag(wport, mport, args.lag_seconds, args.lag_rate_mb)
        out = Path("bench-results")
        out.mkdir(exist_ok=True)
        with open(out / "mirror.jsonl", "a") as f:
            f.write(json.dumps({"workload": "mirror-catch-up", "mb": total / 1e6, "batches": n,
                                "batch_kib": args.batch_kib, "seconds": dt, "mb_per_s": mbps,
                                "transfer_seconds": transfer, "mirror_cpu_s": mirror_cpu,
                                "writer_cpu_s": writer_cpu,
                                "time": time.time()}) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


if __name__ == "__main__":
    main()

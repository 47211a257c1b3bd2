"""Mirror catch-up throughput, through real processes (`scripts/bench mirror`).

``python -m broker.mirror_bench [--mb N] [--batch-kib K] [--dir D]`` writes N MB of K KiB
record batches into one partition of a fresh writer data dir (offline, through
`storage.Store`), starts the writer (`--replication-listen`) and a mirror (`--mirror`) as
processes, and times from the mirror's start until its high watermark (asked with Kafka
ListOffsets) equals the writer's: discovery, catalog, verification, and the blocks written
(a mirror serves verified blocks before it has fsynced them), then until the mirror's head
file holds the head (durable). With ``--lag-seconds`` it then measures replication lag
(see `_lag`). Prints MB/s and writes a JSON line under bench-results/. Imports `broker`,
`storage` and trio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


class _Offsets:
    """ListOffsets v1 latest of partition 0 over one kept connection (a connection per
    poll cost the mirror being timed a sixth of its CPU)."""

    def __init__(self, port: int, topic: str = TOPIC) -> None:
        import importlib

        module = importlib.import_module("kio.schema.list_offsets.v1.request")
        self.port = port
        self.request = encode_request(RequestHeader(2, 1, 1, "bench"), shape(module.ListOffsetsRequest, {
            "replica_id": -1,
            "topics": [{"name": topic, "partitions": [{"partition_index": 0, "timestamp": -1}]}],
        }))
        self.sock: socket.socket | None = None

    def high_watermark(self) -> int:
        """-1 if unknown or unreachable."""
        try:
            if self.sock is None:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            self.sock.sendall(self.request)
            buf = b""
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise OSError("closed")
                buf += chunk
        except OSError:
            self.close()
            return -1
        _, resp = decode_response(buf[4:], 2, 1)
        p = resp.topics[0].partitions[0]
        return int(p.offset) if p.error_code == 0 else -1

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _high_watermark(port: int, topic: str = TOPIC) -> int:
    """ListOffsets v1 latest of partition 0, -1 if unknown or unreachable."""
    o = _Offsets(port, topic)
    try:
        return o.high_watermark()
    finally:
        o.close()


def _stored_length(mirror_dir: Path, topic: str = TOPIC) -> int:
    """Length of the head the mirror has stored (fsynced) for partition 0 of `topic`."""
    from storage.fs import OsFileSystem
    from storage.log import read_head_slots

    best = -1
    for path in mirror_dir.glob(f"**/{topic}-0/head"):
        fs = OsFileSystem()
        fd = fs.open(str(path), os.O_RDONLY)
        try:
            head, _ = read_head_slots(fs, fd)
        finally:
            os.close(fd)
        if head is not None:
            best = max(best, head.length)
    return best


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
    offsets = _Offsets(port)
    try:
        while time.monotonic() < deadline:
            if offsets.high_watermark() == want:
                return time.monotonic()
            time.sleep(0.02)
    finally:
        offsets.close()
    raise SystemExit(f"port {port} did not reach high watermark {want} in {timeout}s")


LAG_PRODUCER = """
import json, sys, time
from confluent_kafka import Producer
bootstrap, seconds, rate, first = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
value = b"x" * 10_000
per_s = rate * 1e6 / len(value)
acked = {}

def on_delivery(err, msg):
    if err is None:
        acked[int(msg.key())] = time.time()

t0 = time.time(); sent = 0
while time.time() - t0 < seconds:
    while sent < (time.time() - t0) * per_s:
        p.produce("lag", value, key=str(first + sent).encode(), on_delivery=on_delivery)
        sent += 1
    p.poll(0.001)
p.flush(30)
print(json.dumps(acked))
"""

LAG_CONSUMER = """
import json, sys, time
from confluent_kafka import Consumer, TopicPartition
bootstrap, start, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = Consumer({"bootstrap.servers": bootstrap, "group.id": "lag", "enable.auto.commit": False,
              "fetch.wait.max.ms": 100, "fetch.min.bytes": 1})
c.assign([TopicPartition("lag", 0, start)])
seen = {}
deadline = time.time() + 120
last = time.time()
while len(seen) < n and time.time() < deadline and not (seen and time.time() - last > 5):
    m = c.poll(0.05)  # (consume(n, timeout) would hold records back until n or timeout)
    if m is not None and not m.error():
        last = seen.setdefault(int(m.key()), time.time())
print(json.dumps(seen))
"""


def _percentiles(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    return v[len(v) // 2], v[min(len(v) - 1, int(len(v) * 0.99))], v[-1]


def _lag(wport: int, mport: int, seconds: float, rate: float) -> dict[str, float]:
    """Produce `rate` MB/s of 10 kB records (acks=all) to the writer for `seconds`; a
    consumer on the mirror (and one on the writer, the baseline) notes when each record
    arrives. Replication lag of a record = its arrival from the mirror minus the moment
    the writer acknowledged it to the producer (its delivery report): what the mirror
    adds on top of the writer. All processes share this machine's clock."""
    env = dict(os.environ)
    # the topic must exist on the writer (and be attached on the mirror) before timing
    pre = subprocess.run([sys.executable, "-c", LAG_PRODUCER, f"127.0.0.1:{wport}", "0.2", "0.1", "0"],
                         capture_output=True, text=True, env=env, check=True)
    first = len(json.loads(pre.stdout.strip() or "{}"))
    deadline = time.monotonic() + 30
    while _high_watermark(mport, "lag") < first and time.monotonic() < deadline:
        time.sleep(0.1)
    expected = int(seconds * rate * 1e6 / 10_000)
    consumers = {name: subprocess.Popen(
        [sys.executable, "-c", LAG_CONSUMER, f"127.0.0.1:{port}", str(first), str(expected)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, port in (("writer", wport), ("mirror", mport))}
    time.sleep(1.0)  # consumers connected and polling
    producer = subprocess.run([sys.executable, "-c", LAG_PRODUCER, f"127.0.0.1:{wport}", str(seconds),
                               str(rate), str(first)], capture_output=True, text=True, env=env,
                              timeout=300)
    acked = {int(k): v for k, v in json.loads(producer.stdout.strip() or "{}").items()}
    result: dict[str, float] = {"records": len(acked), "rate_mb": rate, "seconds": seconds}
    for name, proc in consumers.items():
        out, err = proc.communicate(timeout=180)
        seen = {int(k): v for k, v in json.loads(out.strip() or "{}").items()}
        lags = [(seen[k] - t) * 1000 for k, t in acked.items() if k in seen]
        if not lags:
            print(f"lag from the {name}: no records measured", err[-500:])
            continue
        p50, p99, worst = _percentiles(lags)
        slow = sorted((seen[k] - t, t) for k, t in acked.items() if k in seen)[-len(lags) // 100:]
        t0 = min(acked.values())
        print(f"  {name}: the slowest 1% were acked at s {sorted(round(t - t0, 1) for _, t in slow)[::max(1, len(slow) // 12)]}")
        result.update({f"{name}_p50_ms": p50, f"{name}_p99_ms": p99, f"{name}_max_ms": worst,
                       f"{name}_records": len(lags)})
        print(f"writer's ack -> record consumed from the {name}, {rate} MB/s of 10 kB records "
              f"(acks=all) for {seconds:.0f} s, {len(lags)} of {len(acked)} records: "
              f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--batch-kib", type=int, default=64)
    ap.add_argument("--dir", type=Path)
    ap.add_argument("--lag-seconds", type=float, default=0.0,
                    help="then produce --lag-rate-mb MB/s to the writer for this long and "
                         "measure the writer's ack to the record's arrival from the mirror "
                         "(confluent-kafka)")
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
        while _stored_length(mdir) < n and time.monotonic() - t1 < 600:
            time.sleep(0.01)
        durable = time.monotonic() - t0
        mirror_cpu = _cpu_seconds(procs[1].pid)
        writer_cpu = _cpu_seconds(procs[0].pid) - writer_cpu0
        dt = t1 - t0
        mbps = total / dt / 1e6
        attached = _attached_at(mdir.with_suffix(".log"))
        transfer = wall - attached if attached else float("nan")
        print(f"mirror caught up {total / 1e6:.0f} MB ({n} batches of {args.batch_kib} KiB) in "
              f"{dt:.2f} s from its process start: {mbps:.1f} MB/s; {transfer:.2f} s from the "
              f"topic attached to caught up: {total / transfer / 1e6:.1f} MB/s; head stored "
              f"(fsynced) {durable - dt:.2f} s after it was readable; CPU: mirror "
              f"{mirror_cpu:.2f} s (incl. start-up), writer {writer_cpu:.2f} s: "
              f"{total / 1e6 / max(mirror_cpu, writer_cpu):.1f} MB per CPU-second of the busier side")
        lag = _lag(wport, mport, args.lag_seconds, args.lag_rate_mb) if args.lag_seconds > 0 else {}
        out = Path("bench-results")
        out.mkdir(exist_ok=True)
        with open(out / "mirror.jsonl", "a") as f:
            f.write(json.dumps({"workload": "mirror-catch-up", "mb": total / 1e6, "batches": n,
                                "batch_kib": args.batch_kib, "seconds": dt, "mb_per_s": mbps,
                                "transfer_seconds": transfer, "mirror_cpu_s": mirror_cpu,
                                "durable_seconds": durable,
                                "writer_cpu_s": writer_cpu, "lag": lag,
                                "load_avg_1m": os.getloadavg()[0],
                                "time": time.time()}) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        if args.dir is None:  # a temporary dir: hundreds of MB per run
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

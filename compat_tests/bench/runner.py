"""The broker workloads, run side by side, and their report (table, JSON, PNG).

Workloads (OpenMessaging-Benchmark spirit; every client is librdkafka via confluent-kafka,
each in its own process, nothing pinned):
- throughput: 1 KiB records, 1 and 8 partitions, acks=1, linger 5 ms, batches up to 1 MiB,
  no compression: produce MB/s, then consume MB/s from the start of that topic;
- latency: acks=all, 1 KiB records at a steady 5 MB/s: produce p50/p99/p99.9 (librdkafka's
  send -> ack) and end-to-end p99 (producer wall-clock stamp -> consumer receipt);
- fanout: one producer (as in throughput), eight consumer groups reading everything;
- footprint: a fresh broker, a topic of 1,000 partitions (one record each) and 1,000 idle
  connections: RSS and idle CPU of the broker's process tree.

With `Params.brokers` > 1 (`--brokers 3`) every target is a cluster of that many brokers
on this machine (targets.py) and only throughput and latency run: topics have replication
factor `brokers` and min.insync.replicas=2, are warmed by one acks=all record per
partition before anything is timed, and throughput produces with acks=all
(`throughput_acks`). CPU and RSS figures sum every process of a cluster.

Runs interleave: run i of a workload goes to every broker before run i+1 starts (in a
rotating order), so a machine that gets busier or quieter in the middle shifts every broker
alike. Footprint starts fresh instances; the others share one long-lived instance per
broker (restarted after a failed run, so a stuck one does not burn CPU under the others).
Imports the standard library, confluent_kafka, matplotlib (chart only) and
compat_tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from compat_tests import harness
from compat_tests.bench import procfs
from compat_tests.bench.targets import Target, TargetUnavailable, make_target

MiB = 1 << 20
MB = 1_000_000
WORKLOADS = ("throughput", "latency", "fanout", "footprint")
T = TypeVar("T")
PROFILE_HZ = 200  # py-spy samples per second with --profile
# HK_BENCH_PROFILE_GIL=1: sample only the thread holding the GIL (what the loop costs;
# py-spy here often counts a thread blocked in epoll_wait or a worker queue as busy).
PROFILE_EXTRA = ["--gil"] if os.environ.get("HK_BENCH_PROFILE_GIL") == "1" else []


class WorkloadError(Exception):
    """One run of one workload against one broker failed; the message says how.

    `partial` holds what the run measured before it failed (e.g. produce MB/s of a run
    whose consumer then stalled): reported, never thrown away.
    """

    def __init__(self, message: str, partial: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.partial = dict(partial or {})


@dataclass(frozen=True)
class Params:
    runs: int = 3
    record_size: int = 1024
    throughput_bytes: int = 1 << 30
    partitions: tuple[int, ...] = (1, 8)
    latency_rate: int = 5 * MB
    latency_seconds: float = 20.0
    fanout_bytes: int = 64 * MiB
    fanout_groups: int = 8
    footprint_partitions: int = 1000
    footprint_connections: int = 1000
    idle_seconds: float = 10.0
    settle_seconds: float = 2.0  # a fresh broker's start-up work, before RSS at start
    # A latency run whose producer fell behind the offered load (a starved client) is
    # reported as failed rather than as a latency at some other load; tiny mode, which
    # must never fail on speed, checks nothing.
    min_offered_fraction: float = 0.9
    workloads: tuple[str, ...] = WORKLOADS
    hk_fsync: str = "interval"
    profile: bool = False
    brokers: int = 1  # brokers per target: > 1 runs each as a cluster (CLUSTER_WORKLOADS)
    throughput_acks: str = "1"  # "all" in cluster mode

    @property
    def replication_factor(self) -> int:
        return self.brokers


CLUSTER_WORKLOADS = ("throughput", "latency")


PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "quick": {"throughput_bytes": 64 * MiB, "latency_seconds": 6.0, "fanout_bytes": 8 * MiB,
              "idle_seconds": 5.0},
    # The smoke test's: every code path, seconds of traffic, nothing measured seriously.
    "tiny": {"runs": 1, "throughput_bytes": 2 * MiB, "partitions": (1, 2),
             "latency_rate": 500_000, "latency_seconds": 1.0, "fanout_bytes": 1 * MiB,
             "fanout_groups": 2, "footprint_partitions": 8, "footprint_connections": 8,
             "idle_seconds": 1.0, "settle_seconds": 0.5, "min_offered_fraction": 0.0},
}  # fmt: skip

# Applied over a preset by --brokers N (N > 1): 3 + 3 brokers share the machine, so the
# topics are smaller and the latency runs' steady rate lower (on 2 cores a quorum-signed
# hyperkafka partition takes a few MB/s at acks=all; 5 MB/s would measure a backlog).
CLUSTER_PRESETS: dict[str, dict[str, Any]] = {
    "full": {"throughput_bytes": 256 * MiB, "latency_rate": 1 * MB},
    "quick": {"throughput_bytes": 32 * MiB, "latency_rate": 1 * MB},
    "tiny": {},
}


def cluster_params(params: Params, preset: str, brokers: int) -> Params:
    """`params` for a cluster of `brokers` per target: acks=all, the cluster workloads."""
    workloads = tuple(w for w in params.workloads if w in CLUSTER_WORKLOADS)
    return replace(params, brokers=brokers, throughput_acks="all", workloads=workloads,
                   **CLUSTER_PRESETS[preset])  # fmt: skip


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    unit: str
    higher_is_better: bool


def metrics_for(params: Params) -> list[Metric]:
    out: list[Metric] = []
    acks = "" if params.throughput_acks == "1" else f" (acks={params.throughput_acks})"
    if "throughput" in params.workloads:
        for p in params.partitions:
            out += [
                Metric(f"throughput.p{p}.produce_mb_s", f"produce {p}p{acks}", "MB/s", True),
                Metric(f"throughput.p{p}.consume_mb_s", f"consume {p}p", "MB/s", True),
                Metric(
                    f"throughput.p{p}.produce_cpu_s_per_gb", f"broker CPU/GB in {p}p", "s", False
                ),
                Metric(
                    f"throughput.p{p}.consume_cpu_s_per_gb", f"broker CPU/GB out {p}p", "s", False
                ),
                Metric(
                    f"throughput.p{p}.produce_req_kib", f"produce request size {p}p", "KiB", True
                ),
                Metric(
                    f"throughput.p{p}.produce_cpu_us_per_req",
                    f"broker CPU/request {p}p",
                    "us",
                    False,
                ),
                Metric(
                    f"throughput.p{p}.produce_client_cpu_s_per_gb",
                    f"client CPU/GB in {p}p",
                    "s",
                    False,
                ),
                Metric(
                    f"throughput.p{p}.produce_machine_busy_pct",
                    f"machine busy, produce {p}p",
                    "% all cores",
                    False,
                ),
            ]
    if "latency" in params.workloads:
        out += [
            Metric("latency.produce_p50_ms", "produce p50 (acks=all)", "ms", False),
            Metric("latency.produce_p99_ms", "produce p99 (acks=all)", "ms", False),
            Metric("latency.produce_p99.9_ms", "produce p99.9 (acks=all)", "ms", False),
            Metric("latency.e2e_p50_ms", "end-to-end p50", "ms", False),
            Metric("latency.e2e_p99_ms", "end-to-end p99", "ms", False),
        ]
    if "fanout" in params.workloads:
        g = params.fanout_groups
        out += [
            Metric("fanout.produce_mb_s", f"fan-out produce (1 -> {g} groups)", "MB/s", True),
            Metric("fanout.delivered_mb_s", f"fan-out delivered ({g} groups)", "MB/s", True),
        ]
    if "footprint" in params.workloads:
        out += [
            Metric("footprint.rss_start_mb", "RSS at start", "MB", False),
            Metric("footprint.rss_mb", "RSS, partitions + conns", "MB", False),
            Metric("footprint.idle_cpu_pct", "idle CPU, partitions + conns", "% core", False),
        ]
    return out


@dataclass
class BrokerStatus:
    name: str
    available: bool = True
    reason: str = ""
    version: str = ""
    notes: str = ""


@dataclass
class Report:
    params: Params
    started: str
    brokers: list[BrokerStatus]
    # metric -> broker -> run index -> value: the runs of one index ran back to back
    values: dict[str, dict[str, dict[int, float]]] = field(default_factory=dict)
    failures: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0

    def add(self, broker: str, metrics: dict[str, float], run: int) -> None:
        for key, value in metrics.items():
            self.values.setdefault(key, {}).setdefault(broker, {})[run] = value

    def fail(self, broker: str, workload: str, why: str) -> None:
        self.failures.setdefault(workload, {}).setdefault(broker, []).append(why)
        print(f"bench: {broker} {workload} FAILED: {why}", file=sys.stderr)


# ---------------------------------------------------------------------------- clients


class Client:
    """One load-generator process (`compat_tests.bench.client`); stdout read line by line."""

    def __init__(self, mode: str, spec: dict[str, Any], logdir: Path) -> None:
        self.mode = mode
        logdir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = logdir / f"client-{mode}-{uuid.uuid4().hex[:6]}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p
        )
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "compat_tests.bench.client", mode, json.dumps(spec)],
                cwd=harness.ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._buf = b""
        self.lines: list[str] = []

    def _read(self, deadline: float) -> bool:
        """Read what is there (up to the deadline); False at end of output."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return True
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        self._buf += chunk
        *done, self._buf = self._buf.split(b"\n")
        self.lines += [ln.decode("utf-8", "replace") for ln in done]
        return True

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "READY" not in self.lines:
            if time.monotonic() > deadline:
                self.kill()
                raise WorkloadError(f"{self.mode} client not ready within {timeout:.0f}s")
            if not self._read(deadline):
                self.proc.wait()
                raise WorkloadError(f"{self.mode} client exited early: {self._error()}")

    def result(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while self._read(deadline):
            if time.monotonic() > deadline:
                self.kill()
                raise WorkloadError(f"{self.mode} client still running after {timeout:.0f}s")
        self.proc.wait()
        if self._buf:
            self.lines.append(self._buf.decode("utf-8", "replace"))
            self._buf = b""
        return self._parse()

    def _parse(self) -> dict[str, Any]:
        for line in reversed(self.lines):
            if line.startswith("{"):
                out: dict[str, Any] = json.loads(line)
                if "error" in out:
                    raise WorkloadError(f"{self.mode}: {out['error']}")
                if self.proc.returncode != 0:
                    break
                return out
        raise WorkloadError(f"{self.mode} client exited {self.proc.returncode}: {self._error()}")

    def _error(self) -> str:
        for line in reversed(self.lines):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    return str(json.loads(line).get("error", line))
        tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-2:]
        return " | ".join(tail) or "(no output)"

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------- topics


def create_topic(
    bootstrap: str, partitions: int, prefix: str, timeout: float = 120.0, *, replicas: int = 1
) -> str:
    """A new topic whose every partition has a leader. With `replicas` > 1, also
    min.insync.replicas=2 (acks=all needs 2 of them)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    config = {"min.insync.replicas": "2"} if replicas > 1 else {}
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=replicas, config=config)],
        operation_timeout=timeout,
        request_timeout=timeout,
    )
    try:
        futures[name].result(timeout)
    except KafkaException as exc:
        raise WorkloadError(f"CreateTopics {name} ({partitions} partitions): {exc}") from exc
    except TimeoutError as exc:
        raise WorkloadError(f"CreateTopics {name}: no answer in {timeout:.0f} s") from exc
    # Wait until every partition has a leader (Kafka elects them after CreateTopics
    # answers) and, on a cluster, its replicas all in sync.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(name, timeout=10).topics.get(name)
        if (
            md is not None
            and md.error is None
            and len(md.partitions) == partitions
            and all(
                p.leader >= 0
                # (checked on a cluster only: the single-broker peers are taken as they answer)
                and (replicas == 1 or len(p.replicas) == len(p.isrs) == replicas)
                for p in md.partitions.values()
            )
        ):
            return name
        time.sleep(0.2)
    raise WorkloadError(
        f"topic {name}: {partitions} partitions with leaders and {replicas} in-sync "
        "replica(s) not seen in time"
    )


def bench_topic(ctx: Context, target: Target, partitions: int, prefix: str) -> str:
    """A topic for one run: on a cluster replicated `replication_factor` times and warmed,
    one acks=all record into each partition before anything is timed (a new replicated
    partition may refuse or delay its first acks=all while the replicas open it: a
    hyperkafka replica that has not opened its copy yet, a Kafka follower not yet in
    the ISR). Those records are 1 byte, so no latency is read from them."""
    rf = ctx.params.replication_factor
    topic = create_topic(target.bootstrap, partitions, prefix, replicas=rf)
    if rf > 1:
        spec = {"bootstrap": target.bootstrap, "topic": topic, "partitions": partitions,
                "acks": "all", "timeout": 120}  # fmt: skip
        try:
            Client("touch", spec, ctx.outdir / "clients").result(180)
        except WorkloadError:
            delete_topic(target.bootstrap, topic)
            raise
    return topic


def warm_records(params: Params, partitions: int) -> int:
    """Records `bench_topic` put into a topic of `partitions` before the run."""
    return partitions if params.replication_factor > 1 else 0


def delete_topic(bootstrap: str, name: str) -> None:
    """Best effort: frees a peer's memory (tansu keeps topics in RAM) between runs."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
    with contextlib.suppress(Exception):
        admin.delete_topics([name], operation_timeout=60)[name].result(60)


# ---------------------------------------------------------------------------- workloads


@dataclass
class Context:
    params: Params
    outdir: Path
    profile_dir: Path | None = None


def _records(params: Params, nbytes: int) -> int:
    return max(1, nbytes // params.record_size)


def _timeout_for(nbytes: int) -> float:
    # Generous: a broker at 2 MB/s still finishes; a stall is caught by the client's own
    # idle timeout long before this.
    return 120.0 + nbytes / (2 * MB)


@contextlib.contextmanager
def profiling(ctx: Context, target: Target, label: str) -> Iterator[None]:
    """py-spy record of the hyperkafka process while the body runs (with --profile)."""
    if ctx.profile_dir is None or target.name != "hyperkafka":
        yield
        return
    # The bench extra installs py-spy into the venv that runs us; PATH is the fallback.
    beside = Path(sys.executable).parent / "py-spy"
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        raise WorkloadError("--profile needs py-spy (the bench extra installs it)")
    ctx.profile_dir.mkdir(parents=True, exist_ok=True)
    out = ctx.profile_dir / f"{label}.txt"
    proc = subprocess.Popen(
        [spy, "record", "--pid", str(target.pid), "--rate", str(PROFILE_HZ), "--format", "raw",
         "--output", str(out), "--nonblocking", "--threads", *PROFILE_EXTRA],
        stdout=subprocess.DEVNULL, stderr=(ctx.profile_dir / f"{label}.log").open("wb"),
    )  # fmt: skip
    time.sleep(0.5)  # let it attach
    try:
        yield
    finally:
        proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def note_requests(profile_dir: Path, label: str, requests: int) -> None:
    """profile/requests.json: how many Produce requests each profile covers."""
    path = profile_dir / "requests.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known[label] = requests
    path.write_text(json.dumps(known, indent=1) + "\n")


def throughput(ctx: Context, target: Target, run: int) -> dict[str, float]:
    p = ctx.params
    out: dict[str, float] = {}
    failed: list[str] = []
    records = _records(p, p.throughput_bytes)
    for parts in p.partitions:
        topic = bench_topic(ctx, target, parts, f"tp{parts}-r{run}")
        try:
            spec = {"bootstrap": target.bootstrap, "topic": topic, "partitions": parts,
                    "records": records, "record_size": p.record_size,
                    "acks": p.throughput_acks, "linger_ms": 5, "batch_bytes": MiB}  # fmt: skip
            cpu0 = target.usage().cpu_seconds
            busy0, total0 = procfs.machine_busy_seconds()
            try:
                with profiling(ctx, target, f"produce-p{parts}-r{run}"):
                    prod = Client("produce", spec, ctx.outdir / "clients").result(
                        _timeout_for(p.throughput_bytes)
                    )
            except WorkloadError as exc:
                failed.append(f"{parts}p produce: {exc}")  # the other partition count runs
                continue
            cpu1 = target.usage().cpu_seconds
            busy1, total1 = procfs.machine_busy_seconds()
            if ctx.profile_dir is not None and target.name == "hyperkafka":
                note_requests(ctx.profile_dir, f"produce-p{parts}-r{run}", int(prod["requests"]))
            gb = prod["bytes"] / 1e9
            out[f"throughput.p{parts}.produce_mb_s"] = prod["mb_s"]
            out[f"throughput.p{parts}.produce_cpu_s_per_gb"] = (cpu1 - cpu0) / gb
            # The same client on the same machine: how much CPU the load generator took,
            # and how busy the machine was (every core), to tell CPU-bound runs apart.
            out[f"throughput.p{parts}.produce_client_cpu_s_per_gb"] = prod["cpu_s"] / gb
            out[f"throughput.p{parts}.produce_machine_busy_pct"] = (
                100.0 * (busy1 - busy0) / max(total1 - total0, 1e-9)
            )
            if prod.get("requests"):
                # Faster brokers drain the linger window sooner, so their requests are
                # smaller: read CPU per request together with the request size.
                out[f"throughput.p{parts}.produce_req_kib"] = (
                    prod["bytes"] / 1024 / prod["requests"]
                )
                out[f"throughput.p{parts}.produce_cpu_us_per_req"] = (
                    1e6 * (cpu1 - cpu0) / prod["requests"]
                )
            try:
                cons_spec = {**spec, "records": records + warm_records(p, parts)}
                cons = Client("consume", cons_spec, ctx.outdir / "clients").result(
                    _timeout_for(p.throughput_bytes)
                )
                if cons["records"] < records:
                    raise WorkloadError(f"consumed {cons['records']} of {records} records")
            except WorkloadError as exc:
                failed.append(f"{parts}p {exc}")  # the other partition count still runs
                continue
            cpu2 = target.usage().cpu_seconds
            out[f"throughput.p{parts}.consume_mb_s"] = cons["mb_s"]
            out[f"throughput.p{parts}.consume_cpu_s_per_gb"] = (cpu2 - cpu1) / gb
        finally:
            delete_topic(target.bootstrap, topic)
    if failed:
        raise WorkloadError("; ".join(failed), partial=out)
    return out


def latency(ctx: Context, target: Target, run: int) -> dict[str, float]:
    p = ctx.params
    topic = bench_topic(ctx, target, 1, f"lat-r{run}")
    total = int(p.latency_rate / p.record_size * p.latency_seconds)
    spec = {"bootstrap": target.bootstrap, "topic": topic, "partitions": 1, "records": total,
            "record_size": p.record_size, "acks": "all", "linger_ms": 1,
            "batch_bytes": MiB, "rate_bytes": p.latency_rate, "seconds": p.latency_seconds}  # fmt: skip
    consumer = Client("e2e-consume", {**spec, "records": total + warm_records(p, 1)},
                      ctx.outdir / "clients")  # fmt: skip
    try:
        consumer.wait_ready(60)
        with profiling(ctx, target, f"latency-r{run}"):
            prod = Client("paced-produce", spec, ctx.outdir / "clients").result(
                p.latency_seconds + 120
            )
        cons = consumer.result(120)
    finally:
        consumer.kill()
        delete_topic(target.bootstrap, topic)
    achieved = prod["mb_s"] * MB / p.latency_rate
    if achieved < p.min_offered_fraction:
        raise WorkloadError(f"offered load not reached: {prod['mb_s']:.2f} MB/s")
    pm, em = prod["produce_ms"], cons["e2e_ms"]
    return {"latency.produce_p50_ms": pm["p50"], "latency.produce_p99_ms": pm["p99"],
            "latency.produce_p99.9_ms": pm["p99.9"], "latency.e2e_p50_ms": em["p50"],
            "latency.e2e_p99_ms": em["p99"]}  # fmt: skip


def fanout(ctx: Context, target: Target, run: int) -> dict[str, float]:
    p = ctx.params
    parts = max(p.partitions)
    topic = create_topic(target.bootstrap, parts, f"fan-r{run}")
    records = _records(p, p.fanout_bytes)
    spec = {"bootstrap": target.bootstrap, "topic": topic, "partitions": parts,
            "records": records, "record_size": p.record_size, "acks": "1", "linger_ms": 5,
            "batch_bytes": MiB, "join_timeout": 120}  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    consumers = [
        Client("e2e-consume", {**spec, "group": f"fan-{tag}-{g}"}, ctx.outdir / "clients")
        for g in range(p.fanout_groups)
    ]
    try:
        for c in consumers:
            c.wait_ready(150)
        start = time.perf_counter()
        prod = Client("produce", spec, ctx.outdir / "clients").result(_timeout_for(p.fanout_bytes))
        results = [c.result(_timeout_for(p.fanout_bytes)) for c in consumers]
    finally:
        for c in consumers:
            c.kill()
        delete_topic(target.bootstrap, topic)
    # Every client's perf_counter is CLOCK_MONOTONIC, comparable across processes.
    end = max(r["last"] for r in results)
    delivered = sum(r["bytes"] for r in results)
    return {
        "fanout.produce_mb_s": prod["mb_s"],
        "fanout.delivered_mb_s": delivered / MB / (end - start),
    }


def footprint(ctx: Context, target: Target, run: int) -> dict[str, float]:
    """On a fresh instance (the caller starts and stops it)."""
    p = ctx.params
    time.sleep(p.settle_seconds)  # past start-up work
    start_rss = target.usage().rss_bytes
    topic = create_topic(target.bootstrap, p.footprint_partitions, f"foot-r{run}", timeout=600)
    spec = {"bootstrap": target.bootstrap, "topic": topic, "partitions": p.footprint_partitions,
            "connections": p.footprint_connections, "acks": "1", "timeout": 600}  # fmt: skip
    Client("touch", spec, ctx.outdir / "clients").result(900)
    holder = Client("idle-conns", spec, ctx.outdir / "clients")
    try:
        holder.wait_ready(300)
        time.sleep(min(5.0, p.idle_seconds, 2 * p.settle_seconds))  # connections settle
        u0 = target.usage()
        time.sleep(p.idle_seconds)
        u1 = target.usage()
        if holder.proc.poll() is not None:
            raise WorkloadError("the idle-connection holder died")
        holder.close_stdin()
        got = holder.result(60)
        if got["connections"] != p.footprint_connections:
            raise WorkloadError(f"held {got['connections']} connections")
    finally:
        holder.kill()
    return {"footprint.rss_start_mb": start_rss / MB, "footprint.rss_mb": u1.rss_bytes / MB,
            "footprint.idle_cpu_pct": 100.0 * (u1.cpu_seconds - u0.cpu_seconds) / p.idle_seconds}  # fmt: skip


SHARED_WORKLOADS: dict[str, Callable[[Context, Target, int], dict[str, float]]] = {
    "throughput": throughput,
    "latency": latency,
    "fanout": fanout,
}


# ---------------------------------------------------------------------------- the run


def rotated(items: Sequence[T], k: int) -> list[T]:
    """Run k starts with a different broker, so no broker always goes first."""
    k %= max(1, len(items))
    return [*items[k:], *items[:k]]


def run(
    params: Params,
    brokers: Sequence[str],
    outdir: Path,
    *,
    keep_data: bool = False,
    checkpoint: Callable[[Report], object] | None = None,
) -> Report:
    """Every selected workload against every broker; the report (nothing written yet).

    `checkpoint(report)` runs after each pass over the brokers, so a long run that is
    stopped midway still leaves what it measured.
    """
    save = checkpoint or (lambda _r: None)
    t0 = time.monotonic()
    # Absolute: brokers run in their own work dirs, and take their paths from here.
    outdir = outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    ctx = Context(params, outdir, profile_dir=outdir / "profile" if params.profile else None)
    report = Report(params, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), [])
    report.load_before = os.getloadavg()
    statuses: dict[str, BrokerStatus] = {}
    prepared: list[str] = []
    for name in brokers:
        st = BrokerStatus(name)
        statuses[name] = st
        report.brokers.append(st)
        probe = make_target(name, outdir / "work" / name / "probe", fsync=params.hk_fsync,
                            brokers=params.brokers)  # fmt: skip
        try:
            probe.prepare()
        except TargetUnavailable as exc:
            st.available, st.reason = False, str(exc)
            print(f"bench: {name} unavailable: {exc}", file=sys.stderr)
            continue
        st.version, st.notes = probe.version, probe.notes
        prepared.append(name)

    def fresh(name: str, label: str) -> Target:
        t = make_target(name, outdir / "work" / name / label, fsync=params.hk_fsync,
                        brokers=params.brokers)  # fmt: skip
        t.prepare()
        t.start()
        return t

    try:
        if "footprint" in params.workloads:
            for r in range(params.runs):
                for name in rotated(prepared, r):
                    if not statuses[name].available:
                        continue
                    try:
                        t = fresh(name, f"footprint-{r}")
                    except TargetUnavailable as exc:
                        statuses[name].available, statuses[name].reason = False, str(exc)
                        continue
                    try:
                        _one(report, ctx, t, "footprint", r, footprint)
                    finally:
                        t.stop()
                        if not keep_data:
                            _drop_data(t.workdir)
                save(report)

        shared = [w for w in SHARED_WORKLOADS if w in params.workloads]
        if shared:
            live: list[Target] = []
            for name in prepared:
                if not statuses[name].available:
                    continue
                try:
                    live.append(fresh(name, "shared"))
                except TargetUnavailable as exc:
                    statuses[name].available, statuses[name].reason = False, str(exc)
            try:
                for workload in shared:
                    for r in range(params.runs):
                        for t in rotated(live, r):
                            if not t.alive():
                                report.fail(t.name, workload, "broker process is gone; restarting")
                                restart(t, keep_data)
                                continue
                            if not _one(report, ctx, t, workload, r, SHARED_WORKLOADS[workload]):
                                # A broker left stuck by a failed run may go on burning
                                # CPU under the others' measurements (noida, its consume
                                # stalled, spun at 74% of a core for the rest of a run).
                                restart(t, keep_data)
                        save(report)
            finally:
                for t in live:
                    t.stop()
                    if not keep_data:
                        _drop_data(t.workdir)
    finally:
        report.load_after = os.getloadavg()
        report.seconds = time.monotonic() - t0
    return report


def restart(target: Target, keep_data: bool) -> None:
    """A fresh instance of `target`'s broker (each workload makes its own topics)."""
    print(f"bench: restarting {target.name}", file=sys.stderr)
    target.stop()
    if not keep_data:
        _drop_data(target.workdir)
    with contextlib.suppress(TargetUnavailable):
        target.start()


def _one(
    report: Report,
    ctx: Context,
    target: Target,
    workload: str,
    r: int,
    fn: Callable[[Context, Target, int], dict[str, float]],
) -> bool:
    """One run of one workload on one broker: its figures or its failure go to the
    report; whether it succeeded."""
    t0 = time.monotonic()
    try:
        report.add(target.name, fn(ctx, target, r), r)
        outcome = "ok"
    except WorkloadError as exc:
        report.add(target.name, exc.partial, r)
        report.fail(target.name, workload, str(exc))
        outcome = "failed"
    runs = ctx.params.runs
    print(f"bench: {workload} run {r + 1}/{runs} on {target.name}: {outcome} in "
          f"{time.monotonic() - t0:.1f} s", file=sys.stderr)  # fmt: skip
    return outcome == "ok"


def _drop_data(workdir: Path) -> None:
    """Broker data (GiBs) goes; logs stay for a post-mortem. A cluster's members (and its
    etcd) each have a folder of their own in `workdir`."""
    members = [d for d in workdir.iterdir() if d.is_dir()] if workdir.is_dir() else []
    for folder in (workdir, *members):
        for sub in ("data", "logs"):
            shutil.rmtree(folder / sub, ignore_errors=True)


# ---------------------------------------------------------------------------- the report


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def paired_ratios(by_run: dict[str, dict[int, float]]) -> dict[str, float]:
    """Per peer, the median over run indexes of hyperkafka's figure / the peer's figure
    in the same index. A run index is every broker measured back to back (`rotated`),
    so the pair shares the machine's mood of those minutes: on a shared VM whose speed
    drifts by a third over a quarter of an hour, this is steadier than the ratio of
    medians taken over the whole run."""
    hk = by_run.get("hyperkafka", {})
    out = {}
    for name, runs in by_run.items():
        if name == "hyperkafka":
            continue
        ratios = [hk[r] / v for r, v in runs.items() if r in hk and v > 0]
        if ratios:
            out[name] = statistics.median(ratios)
    return out


def to_json(report: Report) -> dict[str, Any]:
    names = [b.name for b in report.brokers]
    metrics = metrics_for(report.params)
    results: dict[str, Any] = {}
    for m in metrics:
        by_run = report.values.get(m.key, {})
        per = {n: list(runs.values()) for n, runs in by_run.items()}
        entry: dict[str, Any] = {"label": m.label, "unit": m.unit,
                                 "higher_is_better": m.higher_is_better, "brokers": {}}  # fmt: skip
        for n in names:
            if per.get(n):
                entry["brokers"][n] = {"runs": per[n], **summary(per[n])}
        hk = entry["brokers"].get("hyperkafka")
        entry["ratio_hyperkafka_over"] = {
            n: hk["median"] / v["median"]
            for n, v in entry["brokers"].items()
            if hk is not None and n != "hyperkafka" and v["median"] > 0
        }
        entry["paired_ratio_hyperkafka_over"] = paired_ratios(by_run)
        results[m.key] = entry
    return {
        "started": report.started,
        "seconds": report.seconds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "loadavg_before": report.load_before, "loadavg_after": report.load_after},
        "params": asdict(report.params),
        "brokers": [asdict(b) for b in report.brokers],
        "results": results,
        "failures": report.failures,
    }  # fmt: skip


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def table(doc: dict[str, Any]) -> str:
    """The medians [min-max] per broker and hyperkafka/peer ratios, as plain text."""
    names = [b["name"] for b in doc["brokers"]]
    peers = [n for n in names if n != "hyperkafka"]
    status = {b["name"]: b for b in doc["brokers"]}
    header = ["metric", "unit", *names, *(f"hk/{p}" for p in peers)]
    rows = [header]
    for entry in doc["results"].values():
        row = [entry["label"] + (" ^" if entry["higher_is_better"] else " v"), entry["unit"]]
        for n in names:
            b = entry["brokers"].get(n)
            if b is not None:
                row.append(f"{_fmt(b['median'])} [{_fmt(b['min'])}-{_fmt(b['max'])}]")
            elif not status[n]["available"]:
                row.append("unavailable")
            else:
                row.append("failed")
        for p in peers:
            r = entry["ratio_hyperkafka_over"].get(p)
            paired = entry.get("paired_ratio_hyperkafka_over", {}).get(p)
            cell = f"{r:.2f}" if r is not None else "-"
            if r is not None and paired is not None:
                cell += f" ({paired:.2f})"
            row.append(cell)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    m = doc["machine"]
    foot = [
        "",
        f"median [min-max] of {doc['params']['runs']} run(s) each; ^ higher is better, v lower is "
        "better; hk/peer = hyperkafka median / peer median (in parentheses: the median "
        "of the ratios of runs made back to back)",
        f"{m['cpus']} CPUs, load average {m['loadavg_before'][0]:.2f} before, "
        f"{m['loadavg_after'][0]:.2f} after; {doc['seconds']:.0f} s in all",
    ]
    for b in doc["brokers"]:
        if b["available"]:
            foot.append(f"{b['name']} {b['version']}: {b['notes']}")
        else:
            foot.append(f"{b['name']}: UNAVAILABLE: {b['reason']}")
    for workload, per in doc["failures"].items():
        for broker, whys in per.items():
            foot.append(f"{broker} {workload}: {len(whys)} failed run(s): {whys[0][:200]}")
    return "\n".join(lines + foot)


def chart(doc: dict[str, Any], path: Path) -> None:
    """One small bar chart per metric: median per broker, whiskers from min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(doc["results"].values())
    names = [b["name"] for b in doc["brokers"]]
    colours = {"hyperkafka": "#d62728", "kafka": "#1f77b4", "tansu": "#2ca02c", "noida": "#9467bd"}
    cols = 4
    rows = max(1, (len(entries) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, entry in zip(axes.flat, entries, strict=False):
        xs, meds, lo, hi, cs = [], [], [], [], []
        for i, n in enumerate(names):
            b = entry["brokers"].get(n)
            if b is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
                continue
            xs.append(i)
            meds.append(b["median"])
            lo.append(b["median"] - b["min"])
            hi.append(b["max"] - b["median"])
            cs.append(colours.get(n, "#7f7f7f"))
        ax.bar(xs, meds, yerr=[lo, hi], color=cs, capsize=3)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        better = "higher" if entry["higher_is_better"] else "lower"
        ax.set_title(f"{entry['label']} ({entry['unit']}, {better} better)", fontsize=9)
    for ax in list(axes.flat)[len(entries) :]:
        ax.axis("off")
    fig.suptitle(
        f"hyperkafka vs peers, {doc['started']}, median of {doc['params']['runs']} "
        f"(whiskers min-max), {doc['machine']['cpus']} CPUs shared with other work",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the first row
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report: Report, outdir: Path, *, draw: bool = True) -> tuple[dict[str, Any], str]:
    """results.json, table.txt and (when matplotlib is there) chart.png in outdir."""
    doc = to_json(report)
    (outdir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = table(doc)
    (outdir / "table.txt").write_text(text + "\n")
    if draw:
        chart(doc, outdir / "chart.png")
    return doc, text

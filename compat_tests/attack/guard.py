"""One attack's referee: a broker of its own, a good producer, a sampler, the verdict.

`Guard` starts our broker (on a fresh data dir, optionally under a lower RLIMIT_NOFILE),
creates the good topic, starts the good producer (compat_tests.attack.goodclient: an
idempotent acks=all librdkafka producer) and samples the broker's VmRSS and open file
descriptors from /proc while the test attacks. `check()` raises at once on a dead broker,
a bound passed or a stalled producer; `finish()` gives the verdict after the attack:

1. the broker process is alive, and the good producer is acknowledged again after the attack;
2. the producer flushes; every record it got an ack for is read back at its offset, by a
   stock consumer (librdkafka) and by our strict reader;
3. every batch of every partition of every topic decodes cleanly (`wire.read_partition`);
4. SIGTERM ends the broker with status 0, and `hyperkafka verify --data-dir` passes;
5. peak RSS and peak fds stayed under the test's `Bounds`, and the longest gap between two
   acknowledgements stayed under `Bounds.stall_s`.

Every problem found is listed in one AssertionError. Figures (peak RSS, fds, acks, the
longest stall) go to the test's user properties, which the compat matrix prints.
Imports the standard library, pytest and the compat_tests modules.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compat_tests import harness
from compat_tests.harness import Broker

from . import wire

GOOD_RATE = 200.0  # records/s from the good producer


@dataclass(frozen=True)
class Bounds:
    """What the broker must stay within during one attack."""

    rss_mib: int = 400
    fds: int | None = None
    stall_s: float = 20.0
    nofile: int | None = None  # RLIMIT_NOFILE for the broker (None: inherited)


class AttackFailed(AssertionError):
    """The broker lost to an attack."""


def proc_status(pid: int) -> tuple[int, int] | None:
    """(VmRSS in KiB, open fds) of pid, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            rss = 0
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1])
                    break
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return rss, fds


class Sampler(threading.Thread):
    """Samples VmRSS and the fd count of one pid every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True, name=f"sampler-{pid}")
        self.pid = pid
        self.interval = interval
        self.peak_rss_kib = 0
        self.peak_fds = 0
        self.samples = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            got = proc_status(self.pid)
            if got is None:
                return
            self.peak_rss_kib = max(self.peak_rss_kib, got[0])
            self.peak_fds = max(self.peak_fds, got[1])
            self.samples += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


class GoodProducer:
    """The good producer's process and what its delivery reports said."""

    def __init__(self, bootstrap: str, topic: str, env: dict[str, str]) -> None:
        self.topic = topic
        self.acked: dict[int, int] = {}  # seq -> offset
        self.ack_times: list[float] = []
        self.errors: list[str] = []
        self.done: str | None = None
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "compat_tests.attack.goodclient", "produce", bootstrap, topic,
             "--rate", str(GOOD_RATE)],
            cwd=harness.ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split(maxsplit=3)
            if not parts:
                continue
            with self.lock:
                if parts[0] == "a":
                    self.acked[int(parts[1])] = int(parts[2])
                    self.ack_times.append(time.monotonic())
                elif parts[0] == "e":
                    self.errors.append(line.strip())
                elif parts[0] == "done":
                    self.done = line.strip()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line.rstrip())
            del self._stderr[:-40]

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr[-20:])

    def acks(self) -> int:
        with self.lock:
            return len(self.ack_times)

    def wait_acks(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.acks() >= n:
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def longest_gap(self, since: float, until: float | None = None) -> float:
        """The longest time without an ack between `since` and `until` (default now)."""
        until = time.monotonic() if until is None else until
        with self.lock:
            times = [t for t in self.ack_times if since <= t <= until]
        edges = [since, *times, until]
        return max(b - a for a, b in itertools.pairwise(edges))

    def stop(self, timeout: float = 90.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def require_own_broker() -> None:
    """Attacks need a broker process of their own (its pid, its data dir)."""
    if harness.external_broker() is not None and not os.environ.get("HK_COMPAT_BROKER_CMD"):
        harness.require(
            False, "attack tests start their own broker; HK_COMPAT_BOOTSTRAP names an external one"
        )


class Guard:
    def __init__(
        self,
        workdir: Path,
        name: str,
        bounds: Bounds | None = None,
        *,
        record: Callable[[str, Any], None] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        require_own_broker()
        self.workdir = workdir
        self.name = name
        self.bounds = bounds or Bounds()
        self._record = record
        self.broker: Broker = harness.new_broker(workdir / "broker", extra=extra_args)
        if self.bounds.nofile is not None:
            self.broker.argv = [sys.executable, "-m", "compat_tests.attack.limits", "--nofile",
                                str(self.bounds.nofile), "--", *self.broker.argv]  # fmt: skip
        self.good_topic = f"good-{name}-{uuid.uuid4().hex[:6]}"
        self.producer: GoodProducer | None = None
        self.sampler: Sampler | None = None
        self.attack_started = 0.0
        self.attack_ended: float | None = None
        self.figures: dict[str, Any] = {}
        self.notes: list[str] = []

    # ------------------------------------------------------------------ lifecycle

    @property
    def host(self) -> str:
        return self.broker.host

    @property
    def port(self) -> int:
        return self.broker.port

    @property
    def pid(self) -> int:
        assert self.broker.proc is not None
        return self.broker.proc.pid

    def __enter__(self) -> Guard:
        try:
            return self._start()
        except BaseException:
            self.__exit__()  # a failed start must not leave a broker or a producer behind
            raise

    def _start(self) -> Guard:
        self.broker.start()
        self.sampler = Sampler(self.pid)
        self.sampler.start()
        wire.create_topic(self.host, self.port, self.good_topic)
        assert self.broker.env is not None
        self.producer = GoodProducer(self.broker.bootstrap, self.good_topic, self.broker.env)
        if not self.producer.wait_acks(20, 60):
            raise AttackFailed(
                "the good producer got no acks before the attack began\n"
                + self.producer.stderr_tail()
                + "\n"
                + self.broker.log_tail()
            )
        self.baseline = proc_status(self.pid)
        self.attack_started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.producer is not None:
            self.producer.kill()
        if self.sampler is not None:
            self.sampler.stop()
            if "peak_rss_mib" not in self.figures and self._record is not None:
                # The attack ended early (a dead broker): its figures still count.
                self._record("peak_rss_mib", self.sampler.peak_rss_kib // 1024)
                self._record("peak_fds", self.sampler.peak_fds)
                if self.broker.proc is not None and self.broker.proc.poll() is not None:
                    self._record("crashed", self.death())
        self.broker.kill()

    # ------------------------------------------------------------------ during the attack

    def alive(self) -> bool:
        return self.broker.proc is not None and self.broker.proc.poll() is None

    def death(self) -> str:
        assert self.broker.proc is not None
        rc = self.broker.proc.returncode
        how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"status {rc}"
        return f"the broker died ({how})"

    def check(self, context: str = "") -> None:
        """Raise AttackFailed now if the broker died or the producer stalled. Bounds are
        judged by `finish` on the peak, so that the peak is known; only RSS past four
        times its bound (this machine's safety) ends the attack at once."""
        where = f" during {context}" if context else ""
        if not self.alive():
            raise AttackFailed(f"{self.death()}{where}\n{self.broker.log_tail(30)}")
        problems = []
        if self.sampler is not None and self.sampler.peak_rss_kib > 4 * self.bounds.rss_mib * 1024:
            problems = self._bound_problems()
        assert self.producer is not None
        gap = self.producer.longest_gap(self.attack_started)
        if gap > self.bounds.stall_s:
            problems.append(
                f"the good producer stalled {gap:.1f} s (bound {self.bounds.stall_s} s)"
            )
        if problems:
            raise AttackFailed("; ".join(problems) + where)

    def _bound_problems(self) -> list[str]:
        out: list[str] = []
        s = self.sampler
        if s is None:
            return out
        if s.peak_rss_kib > self.bounds.rss_mib * 1024:
            out.append(f"broker RSS peaked at {s.peak_rss_kib // 1024} MiB "
                       f"(bound {self.bounds.rss_mib} MiB)")  # fmt: skip
        if self.bounds.fds is not None and s.peak_fds > self.bounds.fds:
            out.append(f"broker held {s.peak_fds} fds (bound {self.bounds.fds})")
        return out

    def end_attack(self) -> None:
        self.attack_ended = time.monotonic()

    def record(self, key: str, value: Any) -> None:
        self.figures[key] = value

    # ------------------------------------------------------------------ the verdict

    def finish(self, extra_problems: list[str] | None = None, *, restart: bool = False) -> None:
        """The full verdict; raises AttackFailed listing every problem found. With
        `restart`, the broker must also start again on its data dir and serve every
        acknowledged record."""
        if self.attack_ended is None:
            self.end_attack()
        problems = list(extra_problems or [])
        assert self.producer is not None and self.sampler is not None
        alive = self.alive()
        if not alive:
            problems.append(self.death())
        else:
            # The producer must be acknowledged again once the attack is over.
            before = self.producer.acks()
            if not self.producer.wait_acks(before + 20, self.bounds.stall_s):
                problems.append(
                    f"the good producer got no new acks within {self.bounds.stall_s} s after the attack"
                )
        gap = self.producer.longest_gap(self.attack_started)
        self.figures["longest_ack_gap_s"] = round(gap, 2)
        if gap > self.bounds.stall_s:
            problems.append(
                f"the good producer stalled {gap:.1f} s (bound {self.bounds.stall_s} s)"
            )
        if self.alive():
            self.producer.stop()
        else:
            self.producer.kill()  # nothing left to flush to
        acked = dict(self.producer.acked)
        self.figures["good_acked"] = len(acked)
        if self.producer.errors:
            self.figures["good_errors"] = len(self.producer.errors)
            self.notes.append("good producer errors: " + "; ".join(self.producer.errors[:3]))
        if self.producer.done is None and self.alive():
            problems.append("the good producer did not flush (no 'done' line)")
        alive = self.alive()
        if alive:
            problems += self._read_back(acked)
        elif not any(p.startswith("the broker died") for p in problems):
            problems.append(self.death())
        self.sampler.stop()
        problems += self._bound_problems()
        self.figures["peak_rss_mib"] = self.sampler.peak_rss_kib // 1024
        self.figures["peak_fds"] = self.sampler.peak_fds
        if alive:
            try:
                status = self.broker.stop()
                if status != 0:
                    problems.append(f"the broker exited {status} on SIGTERM (expected 0)")
            except harness.BrokerError as exc:
                problems.append(str(exc).splitlines()[0])
        problems += self._verify()
        if restart:
            problems += self._restart(acked)
        for k, v in self.figures.items():
            if self._record is not None:
                self._record(k, v)
        if problems:
            tail = self.broker.log_tail(25)
            raise AttackFailed(
                f"{self.name}: "
                + "\n  ".join(problems)
                + ("\n" + "\n".join(self.notes) if self.notes else "")
                + f"\nbroker log tail:\n{tail}"
            )

    def _read_back(self, acked: dict[int, int]) -> list[str]:
        problems: list[str] = []
        host, port = self.host, self.port
        consumer = self._start_stock_consumer(acked)  # reads while we read
        try:
            topics = wire.metadata(host, port)
        except Exception as exc:
            if consumer is not None:
                consumer.kill()
            return [f"Metadata after the attack failed: {exc!r}"]
        malformed: list[str] = []
        batches = 0
        good_records: list[wire.StoredRecord] = []
        for topic, parts in sorted(topics.items()):
            try:
                hws = {}
                for i in range(0, len(parts), 1000):
                    hws.update(wire.high_watermarks(host, port, topic, parts[i : i + 1000]))
                for p in parts:
                    if hws.get(p, 0) == 0 and topic != self.good_topic:
                        continue
                    rb = wire.read_partition(host, port, topic, p)
                    batches += rb.batches
                    malformed += rb.malformed
                    if topic == self.good_topic:
                        good_records = rb.records
            except Exception as exc:
                malformed.append(f"{topic}: read-back failed: {exc!r}")
        self.figures["batches_read_back"] = batches
        if malformed:
            problems.append(f"{len(malformed)} malformed or unreadable batches stored, first: "
                            + "; ".join(malformed[:3]))  # fmt: skip
        by_offset = {r.offset: r.value for r in good_records}
        lost = [(s, o) for s, o in acked.items() if by_offset.get(o) != b"good-%d" % s]
        if lost:
            problems.append(f"{len(lost)} acknowledged records missing or different in the "
                            f"strict read-back (first seq/offset: {sorted(lost)[:3]})")  # fmt: skip
        if consumer is not None:
            problems += self._stock_consumer(consumer, acked)
        return problems

    def _start_stock_consumer(self, acked: dict[int, int]) -> subprocess.Popen[str] | None:
        if not acked:
            return None
        end = max(acked.values()) + 1
        return subprocess.Popen(
            [sys.executable, "-m", "compat_tests.attack.goodclient", "consume",
             self.broker.bootstrap, self.good_topic, str(end)],
            cwd=harness.ROOT, env=self.broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def _stock_consumer(self, proc: subprocess.Popen[str], acked: dict[int, int]) -> list[str]:
        end = max(acked.values()) + 1
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return ["the stock consumer hung reading the good topic back"]
        seen: dict[int, str] = {}
        status = ""
        for line in stdout.splitlines():
            parts = line.split(maxsplit=2)
            if parts and parts[0] == "r" and len(parts) == 3:
                seen[int(parts[1])] = parts[2]
            elif parts and parts[0] in ("done", "stuck"):
                status = line
        if status.startswith("stuck"):
            return [f"the stock consumer got stuck at offset {status.split()[1]} of {end}"]
        lost = [(s, o) for s, o in acked.items() if seen.get(o) != f"good-{s}"]
        if lost:
            return [f"{len(lost)} acknowledged records not read back by the stock consumer "
                    f"(first seq/offset: {sorted(lost)[:3]}; {stderr[-300:]})"]  # fmt: skip
        return []

    def _restart(self, acked: dict[int, int]) -> list[str]:
        started = time.monotonic()
        self.broker.log_path = self.workdir / "broker" / "restart.log"
        try:
            self.broker.start(timeout=180)
        except harness.BrokerError as exc:
            self.broker.kill()
            return [f"the broker does not start again on its data dir: {str(exc).splitlines()[0]}"]
        self.figures["restart_s"] = round(time.monotonic() - started, 1)
        try:
            rb = wire.read_partition(self.host, self.port, self.good_topic, 0)
            by_offset = {r.offset: r.value for r in rb.records}
            lost = [s for s, o in acked.items() if by_offset.get(o) != b"good-%d" % s]
            out = (
                [f"after the restart {len(lost)} acknowledged records are missing"] if lost else []
            )
            out += [f"after the restart: {m}" for m in rb.malformed[:2]]
        except Exception as exc:
            out = [f"after the restart the good topic cannot be read: {exc!r}"]
        try:
            status = self.broker.stop(timeout=60)
            if status != 0:
                out.append(f"the restarted broker exited {status} on SIGTERM")
        except harness.BrokerError as exc:
            out.append(str(exc).splitlines()[0])
        return out

    def _verify(self) -> list[str]:
        assert self.broker.data_dir is not None
        out = subprocess.run(
            [sys.executable, "-m", "broker", "verify", "--data-dir", str(self.broker.data_dir)],
            cwd=harness.ROOT, env=self.broker.env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if out.returncode != 0:
            bad = [ln for ln in out.stdout.splitlines() if ln.startswith("BAD")]
            return [f"hyperkafka verify failed ({out.returncode}): {bad[:3] or out.stderr[-300:]}"]
        return []

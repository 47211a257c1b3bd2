"""Attack suite, part c: resource attacks against a real broker, the good producer beside it.

Each test states its bounds (compat_tests.attack.guard.Bounds): the broker's RSS (VmRSS,
sampled every 0.1 s), its open file descriptors where it matters, and 20 s as the longest
the good producer may go without an acknowledgement. Where the attack is about descriptors
the broker runs under a lower RLIMIT_NOFILE (1024, the common default, or 4096) so that the
attack passes the budget: the broker must then slow down, refuse with a Kafka error, or
close connections, never exit. After each attack the broker must answer a new connection
at once and the usual final checks hold (every acknowledged record read back, nothing
malformed stored, clean SIGTERM, `hyperkafka verify`).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.protocol.codec import encode_request, request_schema
from broker.protocol.header import RequestHeader
from compat_tests import harness
from compat_tests.attack import batches, wire
from compat_tests.attack.guard import Bounds, Guard, proc_status
from compat_tests.attack.schema import make

Record = Callable[[str, Any], None]
FETCH_MAX_BYTES = 55 * 1024 * 1024  # Kafka's broker-side fetch.max.bytes default


def _open_many(host: str, port: int, n: int) -> list[socket.socket]:
    """n non-blocking connects (some may stay pending when the broker stops accepting)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, InterruptedError):
            s.connect((host, port))
        socks.append(s)
    return socks


def _send_some(socks: list[socket.socket], data: bytes) -> int:
    """Try to send `data` on each socket without blocking; how many took all of it."""
    time.sleep(0.3)  # let the connects complete
    ok = 0
    for s in socks:
        try:
            if s.send(data) == len(data):
                ok += 1
        except OSError:
            pass
    return ok


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def _hold(g: Guard, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        g.check(what)
        time.sleep(0.25)


def _answers_quickly(g: Guard, within: float) -> float | None:
    """Seconds until a new connection's ApiVersions is answered, or None past `within`."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if harness.api_versions_v0_probe(g.host, g.port, timeout=2.0):
            return round(time.monotonic() - started, 2)
        g.check("the recovery")
        time.sleep(0.1)
    return None


def _fds_settle(g: Guard, limit: int, within: float = 15.0) -> int:
    """Wait until the broker holds at most `limit` fds; the last count seen."""
    end = time.monotonic() + within
    fds = 0
    while time.monotonic() < end:
        got = proc_status(g.pid)
        if got is None:
            return -1
        fds = got[1]
        if fds <= limit:
            return fds
        time.sleep(0.2)
    return fds


def _after(g: Guard, problems: list[str], record: Record, fd_slack: int = 64) -> None:
    took = _answers_quickly(g, 15.0)
    record("answers_again_after_s", took)
    if took is None:
        problems.append("a new connection got no ApiVersions answer within 15 s after the attack")
    base_fds = g.baseline[1] if g.baseline else 0
    fds = _fds_settle(g, base_fds + fd_slack)
    record("fds_after", fds)
    if fds > base_fds + fd_slack:
        problems.append(
            f"the broker still holds {fds} fds 15 s after the attack (before: {base_fds})"
        )


@pytest.mark.timeout(180)
@pytest.mark.matrix("attack-connection-flood", client="raw-socket")
def test_connection_flood(tmp_path: Path, record_property: Record) -> None:
    """3,000 connections against a broker allowed 1,024 descriptors: accept() meets EMFILE."""
    bounds = Bounds(rss_mib=400, nofile=1024)
    with Guard(tmp_path, "connection-flood", bounds, record=record_property) as g:
        socks = _open_many(g.host, g.port, 3000)
        try:
            half = socks[::2]
            _send_some(half, struct.pack(">i", 40) + b"\x00\x03")  # a frame begun, never ended
            _hold(g, 6.0, "a flood of 3,000 connections")
            record_property("flood_connections", len(socks))
        finally:
            _close_all(socks)
        g.end_attack()
        problems: list[str] = []
        _after(g, problems, record_property)
        g.finish(problems)


@pytest.mark.timeout(180)
@pytest.mark.matrix("attack-slowloris", client="raw-socket")
def test_slowloris(tmp_path: Path, record_property: Record) -> None:
    """300 connections trickling bytes one at a time: half a whole Metadata request (which
    must be answered once complete), half a 1 MiB frame that never completes."""
    with Guard(tmp_path, "slowloris", Bounds(rss_mib=400), record=record_property) as g:
        req = make(request_schema(3, 1), {"topics": None})
        meta = encode_request(RequestHeader(3, 1, 5, "slow"), req)
        big = struct.pack(">i", 1 << 20) + bytes(200)
        socks = []
        for _ in range(300):
            s = socket.create_connection((g.host, g.port), timeout=5)
            s.setblocking(False)
            socks.append(s)
        slow = [(s, meta if i % 2 == 0 else big) for i, s in enumerate(socks)]
        worst = 0.0
        try:
            pos = 0
            end = time.monotonic() + 8.0
            while time.monotonic() < end:
                for s, data in slow:
                    if pos < len(data):
                        with contextlib.suppress(OSError):
                            s.send(data[pos : pos + 1])
                pos += 1
                started = time.monotonic()
                if not harness.api_versions_v0_probe(g.host, g.port, timeout=5.0):
                    worst = 99.0
                worst = max(worst, time.monotonic() - started)
                g.check("slowloris")
                time.sleep(0.2)
            answered = 0
            for s, _data in slow[::2]:
                s.setblocking(True)
                s.settimeout(5)
                with contextlib.suppress(OSError):
                    if s.recv(4):
                        answered += 1
        finally:
            _close_all(socks)
        g.end_attack()
        record_property("slowest_probe_s", round(worst, 2))
        record_property("trickled_requests_answered", answered)
        problems = []
        if worst > 2.0:
            problems.append(
                f"a new connection waited {worst:.1f} s for ApiVersions beside the slow ones"
            )
        if answered < 150:
            problems.append(f"only {answered}/150 trickled Metadata requests were answered")
        _after(g, problems, record_property)
        g.finish(problems)


@pytest.mark.timeout(180)
@pytest.mark.matrix("attack-size-prefix-flood", client="raw-socket")
def test_size_prefix_flood(tmp_path: Path, record_property: Record) -> None:
    """Connections that send only a 4-byte size (2 MiB x 600, 10 MiB x 60, 100 MiB x 6), a
    third of them 64 KiB of payload more: memory must not follow the promises."""
    with Guard(tmp_path, "size-prefix-flood", Bounds(rss_mib=400), record=record_property) as g:
        socks: list[socket.socket] = []
        try:
            for size, n in ((2 << 20, 600), (10 << 20, 60), (100 << 20, 6)):
                group = _open_many(g.host, g.port, n)
                socks += group
                time.sleep(0.2)
                _send_some(group, struct.pack(">i", size) + struct.pack(">hhi", 0, 9, 1))
                _send_some(group[::3], bytes(64 << 10))
                g.check(f"size prefixes of {size >> 20} MiB")
            _hold(g, 5.0, "the size-prefix flood")
        finally:
            _close_all(socks)
        g.end_attack()
        problems: list[str] = []
        _after(g, problems, record_property)
        g.finish(problems)


def _fat_topic(g: Guard, name: str, mib: int = 8) -> None:
    """A topic holding `mib` MiB in batches of ~900 KiB, for answers that are large."""
    wire.create_topic(g.host, g.port, name)
    value = bytes(range(256)) * (900 * 4)
    with wire.Conn(g.host, g.port) as c:
        for _ in range(mib):
            code, msg = wire.produce(c, name, 0, batches.batch(batches.record(0, value=value), 1))
            assert code == 0, f"could not fill {name}: {code} {msg}"


def _fetch(version: int, topic: str, copies: int, partition_max: int, max_bytes: int) -> Any:
    return make(request_schema(1, version), {
        "replica_id": -1, "max_wait": wire.ms(0), "min_bytes": 0, "max_bytes": max_bytes,
        "isolation_level": 0, "session_id": 0, "session_epoch": -1,
        "topics": [{"topic": topic, "partitions": [
            {"partition": 0, "current_leader_epoch": -1, "fetch_offset": 0, "log_start_offset": -1,
             "partition_max_bytes": partition_max}] * copies}],
    })  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.matrix("attack-pipelining-unread", client="raw-socket")
def test_pipelining_without_reading(tmp_path: Path, record_property: Record) -> None:
    """10 connections pipeline 8 MiB Fetch requests (and Metadata) as fast as the socket
    takes them and never read: answers must wait in no unbounded queue."""
    with Guard(tmp_path, "pipelining", Bounds(rss_mib=400), record=record_property) as g:
        _fat_topic(g, "fat")
        fetch = encode_request(
            RequestHeader(1, 11, 1, "pipe"), _fetch(11, "fat", 1, 8 << 20, 50 << 20)
        )
        meta = encode_request(
            RequestHeader(3, 1, 2, "pipe"), make(request_schema(3, 1), {"topics": None})
        )
        socks = [socket.create_connection((g.host, g.port), timeout=5) for _ in range(10)]
        sent = 0
        try:
            for s in socks:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.settimeout(0.3)
            end = time.monotonic() + 8.0
            while time.monotonic() < end:
                for i, s in enumerate(socks):
                    with contextlib.suppress(OSError):
                        s.sendall((fetch if i % 2 == 0 else meta) * 50)
                        sent += 50
                g.check("pipelined requests nobody reads")
        finally:
            _close_all(socks)
        g.end_attack()
        record_property("pipelined_requests", sent)
        problems: list[str] = []
        _after(g, problems, record_property)
        g.finish(problems)


@pytest.mark.timeout(240)
@pytest.mark.matrix("attack-duplicate-partition-fetch", client="raw-socket")
def test_duplicate_partition_fetch(tmp_path: Path, record_property: Record) -> None:
    """Fetch naming one 8 MiB partition 20,000 times (v11 and v4), three at once: each must
    be answered within 60 s (Kafka answers; a well-formed request is no reason to close),
    the answer no larger than Kafka's fetch.max.bytes (55 MB) allows, with RSS under
    400 MiB and fewer than 2,048 fds (one partition: one file, however often named)."""
    bounds = Bounds(rss_mib=400, fds=2048)
    with Guard(tmp_path, "duplicate-fetch", bounds, record=record_property) as g:
        _fat_topic(g, "fat")
        results: dict[str, str] = {}

        def one(i: int, version: int) -> None:
            req = _fetch(version, "fat", 20_000, 1 << 20, 2**31 - 1)
            try:
                with wire.Conn(g.host, g.port, 60) as c:
                    c.send(encode_request(RequestHeader(1, version, 7, "dup"), req))
                    payload = c.recv_frame(60)
                    results[f"{i}/v{version}"] = f"answered {len(payload)} bytes"
            except wire.Closed:
                results[f"{i}/v{version}"] = "closed"
            except TimeoutError:
                results[f"{i}/v{version}"] = "hung"
            except Exception as exc:  # the test process itself must survive to report
                results[f"{i}/v{version}"] = f"error {exc!r}"

        threads = [threading.Thread(target=one, args=(i, v), daemon=True)
                   for i, v in enumerate((11, 11, 4))]  # fmt: skip
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            g.check("Fetch requests naming one partition 20,000 times")
            time.sleep(0.25)
        g.end_attack()
        record_property("answers", dict(results))
        problems = []
        for k, v in results.items():
            if not v.startswith("answered"):
                problems.append(f"duplicate-partition Fetch {k}: {v}, not answered")
            elif int(v.split()[1]) > FETCH_MAX_BYTES + (1 << 20):
                problems.append(f"duplicate-partition Fetch {k}: {v}, past fetch.max.bytes")
        if any(t.is_alive() for t in threads):
            problems.append("a duplicate-partition Fetch was neither answered nor closed in 90 s")
        _after(g, problems, record_property)
        g.finish(problems)


@pytest.mark.timeout(420)
@pytest.mark.matrix("attack-partition-bomb", client="raw-socket")
def test_partition_bomb(tmp_path: Path, record_property: Record) -> None:
    """CreateTopics of one 11,000-partition topic and 250 two-partition topics against a
    broker allowed 4,096 descriptors. Each topic must be created or refused with a Kafka
    error; the broker must stay up and keep serving the good producer, and then restart on
    its own data dir and serve every acknowledged record."""
    bounds = Bounds(rss_mib=1024, nofile=4096, stall_s=20.0)
    with Guard(tmp_path, "partition-bomb", bounds, record=record_property) as g:
        answers: dict[str, Any] = {}

        def create(label: str, topics: dict[str, int]) -> None:
            try:
                answers[label] = wire.create_topics(g.host, g.port, topics, timeout_s=120)
            except Exception as exc:
                answers[label] = exc

        jobs = [("one-topic-11000", {"bomb-11000": 11_000}),
                ("250-topics", {f"bomb-many-{i}": 2 for i in range(250)})]  # fmt: skip
        started = time.monotonic()
        for label, topics in jobs:
            t = threading.Thread(target=create, args=(label, topics), daemon=True)
            t.start()
            while t.is_alive() and time.monotonic() - started < 240:
                g.check(f"CreateTopics {label}")
                time.sleep(0.25)
        g.end_attack()
        record_property("create_seconds", round(time.monotonic() - started, 1))
        problems: list[str] = []
        for label, _topics in jobs:
            got = answers.get(label)
            if got is None:
                problems.append(f"CreateTopics {label}: no answer within 240 s")
            elif isinstance(got, Exception):
                problems.append(f"CreateTopics {label}: {got!r} (not a Kafka error)")
            else:
                codes: dict[int, int] = {}
                for code in got.values():
                    codes[code] = codes.get(code, 0) + 1
                record_property(f"codes_{label}", codes)
        with contextlib.suppress(Exception):
            listed = wire.metadata(g.host, g.port)
            record_property("partitions_listed", sum(len(p) for p in listed.values()))
        _after(g, problems, record_property, fd_slack=4096)
        g.finish(problems, restart=True)

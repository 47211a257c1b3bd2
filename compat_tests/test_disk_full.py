"""A real full disk under a real broker process: a small tmpfs holds the data dir.

- CreateTopics, and auto-creation by Metadata and Produce, answer KAFKA_STORAGE_ERROR at
  once and keep nothing: Metadata goes on working, a restart and `verify` see no trace,
  and the same name is created once the disk has room.
- A broker killed while the disk is full (produces failing with KAFKA_STORAGE_ERROR)
  restarts on the still-full disk and serves every acknowledged record; once room
  returns, the offline partition is reopened (every OFFLINE_RETRY_S) and takes produces.

Mounting needs root: the test skips with a printed reason otherwise, and fails under
CI=true (the CI runs as root).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.tests.conftest import RawClient
from compat_tests.harness import IN_CI, ROOT, Broker, hyperkafka, new_broker
from storage.batch import build_batch, record_values

KAFKA_STORAGE_ERROR = 56


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    reason = ""
    if os.geteuid() != 0:
        reason = "mounting a tmpfs needs root"
    else:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs: {done.stderr.strip()}"
    if reason:
        if IN_CI:
            pytest.fail(f"CI must run the full-disk test: {reason}", pytrace=False)
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    """Write `path` until the filesystem has no byte left."""
    with open(path, "ab", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(bytes(chunk))
    with open(path, "ab", buffering=0) as f, pytest.raises(OSError) as full:
        f.write(bytes(4096))
    assert full.value.errno == errno.ENOSPC


def _talk(b: Broker, fn: Any) -> Any:
    async def main() -> Any:
        with trio.fail_after(30):
            c = RawClient(await trio.open_tcp_stream(b.host, b.port))
            try:
                return await fn(c)
            finally:
                await c.stream.aclose()

    return trio.run(main)


async def _create(c: RawClient, name: str, partitions: int = 1) -> int:
    r = await c.call(
        "create_topics",
        7,
        {
            "topics": [
                {
                    "name": name,
                    "num_partitions": partitions,
                    "replication_factor": 1,
                    "assignments": [],
                    "configs": [],
                }
            ],
            "timeout": 5000,
            "validate_only": False,
        },
    )
    return int(r.topics[0].error_code)


async def _metadata(c: RawClient, names: list[str] | None, auto: bool = False) -> dict[str, int]:
    r = await c.call(
        "metadata",
        9,
        {
            "topics": None if names is None else [{"name": n} for n in names],
            "allow_auto_topic_creation": auto,
            "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False,
        },
    )
    return {t.name: int(t.error_code) for t in r.topics}


async def _produce(c: RawClient, topic: str, value: bytes) -> int:
    r = await c.call(
        "produce",
        9,
        {
            "acks": -1,
            "timeout": 5000,
            "topic_data": [
                {
                    "name": topic,
                    "partition_data": [
                        {
                            "index": 0,
                            "records": bytes(
                                build_batch([value], timestamp_ms=int(time.time() * 1000))
                            ),
                        }
                    ],
                }
            ],
        },
    )
    return int(r.responses[0].partition_responses[0].error_code)


async def _values(c: RawClient, topic: str) -> list[bytes]:
    out: list[bytes] = []
    offset = 0
    while True:
        r = await c.call(
            "fetch",
            12,
            {
                "replica_id": -1,
                "max_wait": 0,
                "min_bytes": 0,
                "max_bytes": 1 << 22,
                "isolation_level": 0,
                "session_id": 0,
                "session_epoch": -1,
                "forgotten_topics_data": [],
                "rack_id": "",
                "topics": [
                    {
                        "topic": topic,
                        "partitions": [
                            {
                                "partition": 0,
                                "fetch_offset": offset,
                                "partition_max_bytes": 1 << 22,
                                "log_start_offset": -1,
                            }
                        ],
                    }
                ],
            },
        )
        p = r.responses[0].partitions[0]
        assert p.error_code == 0, p
        data = bytes(p.records or b"")
        if not data:
            return out
        pos = 0
        while pos + 12 <= len(data):
            size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
            if pos + size > len(data):
                break
            batch = data[pos : pos + size]
            out.extend(record_values(batch))
            offset = int.from_bytes(batch[:8], "big") + int.from_bytes(batch[23:27], "big") + 1
            pos += size


def test_a_new_topic_on_a_full_disk_is_refused_at_once_and_leaves_nothing(
    small_disk: Path, workdir: Path
) -> None:
    b = new_broker(workdir, data_dir=small_disk / "data")
    b.start()
    try:
        assert _talk(b, lambda c: _create(c, "kept")) == 0
        _fill(small_disk / "filler")

        async def refused(c: RawClient) -> tuple[int, dict[str, int], int, dict[str, int]]:
            t0 = time.monotonic()
            created = await _create(c, "fresh", 3)
            assert time.monotonic() - t0 < 5
            auto = await _metadata(c, ["auto-meta"], auto=True)
            produced = await _produce(c, "auto-produce", b"x")
            # the first producer id block cannot be made durable: a retriable answer
            pid = await c.call(
                "init_producer_id",
                4,
                {
                    "transactional_id": None,
                    "transaction_timeout_ms": 60000,
                    "producer_id": -1,
                    "producer_epoch": -1,
                },
            )
            assert pid.error_code == 15, pid
            return created, auto, produced, await _metadata(c, None)

        created, auto, produced, listed = _talk(b, refused)
        assert created == KAFKA_STORAGE_ERROR
        assert auto == {"auto-meta": KAFKA_STORAGE_ERROR}
        assert produced == KAFKA_STORAGE_ERROR
        assert set(listed) == {"kept"}, listed  # Metadata works and lists no half-made topic
        assert not [n for n in os.listdir(small_disk / "data") if n.startswith(("fresh-", "auto-"))]

        os.unlink(small_disk / "filler")  # room again: the same name is created whole
        assert _talk(b, lambda c: _create(c, "fresh", 3)) == 0
        assert _talk(b, lambda c: _produce(c, "fresh", b"after")) == 0
        assert b.stop() == 0
        b.start()
        assert set(_talk(b, lambda c: _metadata(c, None))) == {"kept", "fresh"}
        assert b.stop() == 0
        done = hyperkafka("verify", "--data-dir", str(small_disk / "data"))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        b.kill()


def test_a_broker_killed_on_a_full_disk_restarts_and_serves_every_acknowledged_record(
    small_disk: Path, workdir: Path
) -> None:
    b = new_broker(workdir, data_dir=small_disk / "data")
    b.start()
    try:
        assert _talk(b, lambda c: _create(c, "t")) == 0
        (small_disk / "spare").write_bytes(bytes(512 * 1024))  # freed later: room returns

        async def until_full(c: RawClient) -> list[bytes]:
            acked: list[bytes] = []
            for i in range(10_000):
                value = b"%06d" % i + bytes(16 * 1024)
                code = await _produce(c, "t", value)
                if code == 0:
                    acked.append(value)
                    continue
                assert code == KAFKA_STORAGE_ERROR, code
                return acked
            raise AssertionError("the disk never filled")

        acked = _talk(b, until_full)
        assert len(acked) > 10
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
        b.proc = None
        with contextlib.suppress(AssertionError):
            _fill(small_disk / "filler")  # whatever the kill left free

        b.start()  # on the full disk
        assert _talk(b, lambda c: _values(c, "t"))[: len(acked)] == acked
        # (a batch bigger than the slack left in the files' last pages)
        assert _talk(b, lambda c: _produce(c, "t", bytes(64 * 1024))) == KAFKA_STORAGE_ERROR

        os.unlink(small_disk / "spare")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(small_disk / "filler")
        deadline = time.monotonic() + 20  # OFFLINE_RETRY_S is 5 s
        while (code := _talk(b, lambda c: _produce(c, "t", b"room again"))) != 0:
            assert code == KAFKA_STORAGE_ERROR and time.monotonic() < deadline, code
            time.sleep(0.5)
        values = _talk(b, lambda c: _values(c, "t"))
        assert values[: len(acked)] == acked and values[-1] == b"room again"
        assert b.stop() == 0
        done = hyperkafka("verify", "--data-dir", str(small_disk / "data"))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        b.kill()


# A broker killed with batches written but never signed (what a kill between a round's
# write and its head leaves): recovery must index and sign them, which needs new pages.
UNSIGNED_TAIL = """
import os, sys, time
from storage import Store
from storage.batch import build_batch
store = Store.open(sys.argv[1])
lg = store.log("t", 0)
for i in range(200):
    lg.append(build_batch([b"unsigned-%d" % i], timestamp_ms=int(time.time() * 1000)))
os._exit(0)  # killed: no commit, no close
"""


def test_a_restart_whose_recovery_cannot_write_serves_what_is_signed(
    small_disk: Path, workdir: Path
) -> None:
    data = small_disk / "data"
    b = new_broker(workdir, data_dir=data)
    b.start()
    try:
        assert _talk(b, lambda c: _create(c, "t")) == 0
        acked = [b"acked-%d" % i for i in range(20)]

        async def produce_all(c: RawClient) -> None:
            for v in acked:
                assert await _produce(c, "t", v) == 0

        _talk(b, produce_all)
        assert b.stop() == 0
        subprocess.run(
            [sys.executable, "-c", UNSIGNED_TAIL, str(data)],
            check=True,
            timeout=60,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        _fill(small_disk / "filler")

        b.start()  # recovery must write the tail's index entries and sign it: no room
        assert _talk(b, lambda c: _values(c, "t")) == acked
        assert _talk(b, lambda c: _produce(c, "t", b"x")) == KAFKA_STORAGE_ERROR
        assert "read-only until it can" in b.log_tail(400)

        os.unlink(small_disk / "filler")
        deadline = time.monotonic() + 20  # OFFLINE_RETRY_S is 5 s
        while (code := _talk(b, lambda c: _produce(c, "t", b"room again"))) != 0:
            assert code == KAFKA_STORAGE_ERROR and time.monotonic() < deadline, code
            time.sleep(0.5)
        values = _talk(b, lambda c: _values(c, "t"))
        assert values == acked + [b"unsigned-%d" % i for i in range(200)] + [b"room again"]
        assert b.stop() == 0
        done = hyperkafka("verify", "--data-dir", str(data))
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        b.kill()

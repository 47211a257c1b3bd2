"""storage/progress.py: rendering, throttling on a fake clock, and `hyperkafka verify`
showing progress (lines when stderr is no terminal, a bar under a pty)."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from storage import progress as P
from storage.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_render_line_bytes_with_items_rate_and_eta() -> None:
    clock = Clock()
    p = Progress("verify", 40 << 20, items_total=7, stream=io.StringIO(), tty=False, clock=clock)
    p.done, p.items_done = 12 << 20, 3
    clock.t += 3
    assert p.render() == "verify: 3/7 archives, 12.0 MiB/40.0 MiB (30%), 4.0 MiB/s, ETA 7s"
    assert p.bar().startswith("[#######.................] verify: ")


def test_render_blocks_with_a_growing_total() -> None:
    clock = Clock()
    remote = [1000]
    p = Progress(
        "x: catching up",
        lambda: remote[0],
        unit="blocks",
        stream=io.StringIO(),
        tty=False,
        clock=clock,
    )
    p.done = 250
    clock.t += 5
    assert p.render() == "x: catching up: 250/1000 blocks (25%), 50 blocks/s, ETA 15s"
    remote[0] = 2250
    assert p.render().endswith("250/2250 blocks (11%), 50 blocks/s, ETA 40s")
    remote[0] = 0  # never below what was done
    assert p.total == 250


def test_advance_reads_the_clock_once_per_check_every_and_renders_per_interval() -> None:
    reads = 0
    now = [0.0]

    def clock() -> float:
        nonlocal reads
        reads += 1
        return now[0]

    out = io.StringIO()
    p = Progress("v", 10_000, unit="blocks", stream=out, tty=False, interval=5.0, clock=clock)
    reads = 0
    for _ in range(P.CHECK_EVERY - 1):
        p.advance()
    assert reads == 0  # the per-block path does not look at the clock
    p.advance()
    assert reads == 1 and out.getvalue() == ""  # looked, but the interval has not passed
    now[0] = 4.9
    for _ in range(P.CHECK_EVERY):
        p.advance()
    assert out.getvalue() == ""
    now[0] = 5.0
    for _ in range(P.CHECK_EVERY):
        p.advance()
    assert out.getvalue().splitlines() == ["v: 768/10000 blocks (7%), 154 blocks/s, ETA 1m00s"]
    assert not p.tick()  # the next line only 5 s after this one
    now[0] = 10.0
    assert p.tick() and len(out.getvalue().splitlines()) == 2


def test_a_bar_is_drawn_in_place_cleared_and_ended_with_a_newline() -> None:
    clock = Clock()
    out = io.StringIO()
    p = Progress("v", 100, stream=out, tty=True, clock=clock)
    assert p.interval == P.BAR_INTERVAL_S
    p.done = 50
    clock.t += 1
    assert p.tick()
    assert out.getvalue().startswith("\r\x1b[K[############............] v: 50 B/100 B (50%)")
    assert "\n" not in out.getvalue()
    p.clear()
    assert out.getvalue().endswith("\r\x1b[K")
    p.done = 100
    p.finish()
    assert out.getvalue().endswith("] v: 100 B/100 B (100%), 100 B/s\n")


def test_a_short_job_says_nothing_and_a_logger_gets_records(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    out = io.StringIO()
    quiet = Progress("v", 10, stream=out, tty=True, clock=clock)
    quiet.advance(10)
    quiet.finish()
    assert out.getvalue() == ""
    lg = logging.getLogger("test.progress")
    p = Progress("m", 10, unit="blocks", logger=lg, stream=out, clock=clock)
    assert not p.tty and p.interval == P.LINE_INTERVAL_S
    p.done = 5
    clock.t += 5
    with caplog.at_level(logging.INFO, logger="test.progress"):
        assert p.tick()
    assert [r.getMessage() for r in caplog.records] == ["m: 5/10 blocks (50%), 1 blocks/s, ETA 5s"]
    assert out.getvalue() == ""


# ------------------------------------------------------------- `hyperkafka verify`


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir with several archives (3 partitions of one topic, 1 of another)."""
    from storage.batch import build_batch
    from storage.log import FsyncPolicy
    from storage.store import Store

    d = tmp_path_factory.mktemp("verify-progress") / "data"
    store = Store.open(d, fsync=FsyncPolicy.NEVER)
    try:
        for name, parts in (("alpha", 3), ("beta", 1)):
            store.create_topic(name, parts, {})
            for p in range(parts):
                lg = store.log(name, p)
                for i in range(300):
                    lg.append(
                        build_batch(
                            [bytes(2000) + i.to_bytes(4, "big")], timestamp_ms=1_700_000_000_000
                        )
                    )
                lg.commit()
    finally:
        store.close()
    return d


def _cmd(d: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "broker",
        "verify",
        "--data-dir",
        str(d),
        "--progress-interval",
        "0",
    ]


def test_verify_prints_progress_lines_on_stderr_when_not_a_tty(data_dir: Path) -> None:
    r = subprocess.run(_cmd(data_dir), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\nok ") + r.stdout.startswith("ok ") == 4  # stdout keeps its format
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("verify: ")]
    assert len(lines) >= 4, r.stderr
    assert "\r" not in r.stderr
    assert re.fullmatch(r"verify: 1/5 archives, \d+ B/2\.\d MiB \(0%\), .*/s, ETA \S+", lines[0])
    assert len(set(lines)) == len(lines)  # the last state is not said twice
    assert lines[-1].startswith("verify: 5/5 archives,") and "(100%)" in lines[-1]


def test_verify_draws_a_bar_under_a_pty(data_dir: Path) -> None:
    # stdout and stderr on a pty: the bar is drawn in place and taken off before a line
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.execv(sys.executable, _cmd(data_dir))
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode()
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "\r\x1b[K[" in text and "] verify: " in text
    assert "ok alpha 0 300 blocks" in text
    assert "5/5 archives" in text and "(100%)" in text


def test_finish_says_the_last_state_once_and_redraws_a_cleared_bar() -> None:
    clock = Clock()
    out = io.StringIO()
    p = Progress("v", 100, unit="blocks", stream=out, tty=False, interval=0, clock=clock)
    p.done = 100
    clock.t += 1
    assert p.tick()
    p.finish()
    assert out.getvalue() == "v: 100/100 blocks (100%), 100 blocks/s\n"
    bar = io.StringIO()
    b = Progress("v", 100, unit="blocks", stream=bar, tty=True, interval=0, clock=clock)
    b.done = 100
    assert b.tick()
    b.clear()  # a result line was printed: the bar is off the line
    b.finish()
    assert bar.getvalue().count("] v: 100/100 blocks (100%)") == 2 and bar.getvalue().endswith("\n")

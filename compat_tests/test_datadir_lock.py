"""One data dir, one broker, checked through real processes.

- A second `hyperkafka serve` on a data dir a broker holds exits at once, non-zero, with
  one line naming the dir and the holder's pid, no traceback, and changes nothing there.
- `hyperkafka verify` (read-only) runs beside it and says that a broker holds the dir.
- The lock file a SIGKILLed broker leaves behind does not block its restart.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from compat_tests import broker_logs
from compat_tests.harness import ROOT, api_versions_v0_probe, free_port, hyperkafka, new_broker


def _snapshot(d: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(d))] = (
                st.st_size,
                st.st_mtime_ns,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return out


def test_second_broker_on_one_data_dir_is_refused_and_touches_nothing(workdir: Path) -> None:
    first = new_broker(workdir / "a")
    first.start()
    try:
        assert first.proc is not None and first.data_dir is not None
        before = _snapshot(first.data_dir)
        assert ".lock" in before
        t0 = time.monotonic()
        second = hyperkafka("serve", "--data-dir", str(first.data_dir), "--listen", "127.0.0.1:0")
        took = time.monotonic() - t0
        assert second.returncode != 0, second.stderr
        lines = [ln for ln in (second.stdout + second.stderr).splitlines() if ln.strip()]
        assert len(lines) == 1, lines
        assert str(first.data_dir) in lines[0] and str(first.proc.pid) in lines[0], lines[0]
        assert "Traceback" not in second.stderr
        assert took < 10, took
        assert _snapshot(first.data_dir) == before

        verify = hyperkafka("verify", "--data-dir", str(first.data_dir))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert f"pid {first.proc.pid}" in verify.stderr, verify.stderr
        assert first.alive()
    finally:
        first.kill()


def test_stale_lock_file_of_a_killed_broker_does_not_block_a_restart(workdir: Path) -> None:
    b = new_broker(workdir)
    b.start()
    assert b.proc is not None and b.data_dir is not None
    os.kill(b.proc.pid, signal.SIGKILL)
    b.proc.wait()
    b.proc = None
    assert (b.data_dir / ".lock").read_text().strip().isdigit()  # left behind
    verify = hyperkafka("verify", "--data-dir", str(b.data_dir))
    assert "holds" not in verify.stderr, verify.stderr
    try:
        b.start()
        assert b.stop() == 0
    finally:
        b.kill()


def test_the_default_data_dir_is_locked_too(workdir: Path) -> None:
    """Two `hyperkafka serve` with no --data-dir in one directory: ./hyperkafka-data."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    port = free_port()
    log_path = workdir / "first.log"
    broker_logs.watch(log_path)  # its internal errors fail the test, as for every broker
    with log_path.open("wb") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "broker", "serve", "--listen", f"127.0.0.1:{port}"],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not api_versions_v0_probe("127.0.0.1", port, timeout=1.0):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "broker", "serve", "--listen", "127.0.0.1:0"],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode != 0
        lines = [ln for ln in (second.stdout + second.stderr).splitlines() if ln.strip()]
        assert len(lines) == 1 and "hyperkafka-data" in lines[0] and str(first.pid) in lines[0], (
            lines
        )
    finally:
        first.kill()
        first.wait()

"""What a user sees when something is wrong or when they press Ctrl-C, with real processes.

Every user error is one line on stderr starting `hyperkafka:`, a non-zero exit, and no
change on disk (no data dir made, no key created); a SIGINT (what Ctrl-C sends) at any
moment of `hyperkafka serve`, of a mirror and of `scripts/demo --follow` ends without a
traceback; the demo removes the temporary directory it made.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compat_tests.harness import ROOT, free_port, new_broker

HK = [sys.executable, "-m", "broker"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), e.get("PYTHONPATH", "")) if p)
    return e


def run(
    *args: str, stdin: bytes = b"", cwd: Path = ROOT, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*HK, *args],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        check=False,
    )
    return proc


def one_line(proc: subprocess.CompletedProcess[str], starts: str = "hyperkafka: ") -> str:
    assert proc.returncode != 0, proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts), proc.stderr
    return lines[0]


def test_bad_arguments_are_one_line(tmp_path: Path) -> None:
    for args in (
        [],
        ["serve", "--bogus"],
        ["serve", "--fsync", "sometimes"],
        ["users", "add"],
        ["nope"],
    ):
        one_line(run(*args, cwd=tmp_path))
    assert list(tmp_path.iterdir()) == []  # not even ./hyperkafka-data


def test_a_port_in_use_changes_nothing_on_disk(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run("serve", "--data-dir", str(tmp_path / "data"), "--listen", f"127.0.0.1:{port}")
        line = one_line(proc)
        assert f"127.0.0.1:{port}" in line and "in use" in line
        replication = run(
            "serve",
            "--data-dir",
            str(tmp_path / "data"),
            "--listen",
            "127.0.0.1:0",
            "--replication-listen",
            f"127.0.0.1:{port}",
        )
        assert f"127.0.0.1:{port}" in one_line(replication)
    assert not (tmp_path / "data").exists()
    assert "every acknowledged record" not in proc.stderr + replication.stderr


def test_config_errors_change_nothing_on_disk(tmp_path: Path) -> None:
    conf = tmp_path / "server.properties"
    conf.write_text(f"log.dirs={tmp_path / 'data'}\nlog.retention.mss=5\n")
    assert "log.retention.mss" in one_line(run("serve", "--config", str(conf)))
    typo = run(
        "serve", "--data-dir", str(tmp_path / "data"), extra_env={"KAFKA_NUM_PARTITION": "3"}
    )
    assert "KAFKA_NUM_PARTITION" in one_line(typo)
    assert "no data dir" in one_line(run("keys", "--data-dir", str(tmp_path / "data")))
    assert "no data dir" in one_line(run("verify", "--data-dir", str(tmp_path / "data")))
    assert not (tmp_path / "data").exists()


def test_users_add_without_a_terminal(tmp_path: Path) -> None:
    line = one_line(run("users", "--data-dir", str(tmp_path / "data"), "add", "bob"))
    assert "--password-stdin" in line
    assert not (tmp_path / "data").exists()
    ok = run(
        "users",
        "--data-dir",
        str(tmp_path / "data"),
        "add",
        "bob",
        "--password-stdin",
        stdin=b"s3cret\n",
    )
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr


def read_until(proc: subprocess.Popen[bytes], marker: str, timeout: float) -> str:
    """The output of `proc` up to and including `marker` (AssertionError at the timeout)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while marker.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} within {timeout}s:\n{seen.decode(errors='replace')}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"ended before {marker!r}:\n{seen.decode(errors='replace')}"
            seen += chunk
    return seen.decode(errors="replace")


def _interrupt(
    argv: list[str], ready: str, *, extra_env: dict[str, str] | None = None, timeout: float = 90
) -> tuple[int, str]:
    """Start argv in its own process group, SIGINT the group (as a terminal's Ctrl-C does)
    once `ready` is in its output, and return its status and whole output."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**env(), **(extra_env or {})},
        cwd=ROOT,
        start_new_session=True,
        # as a terminal's foreground job: a test run started in the background (`cmd &`
        # in a script) passes SIGINT down ignored, and Python then never raises
        # KeyboardInterrupt: the broker would rightly go on until its own handler is up
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        seen = read_until(proc, ready, timeout)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        return proc.returncode, seen + out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# While modules load (-X importtime reports each import as it completes: the signal comes
# right after broker.config's, in the midst of the imports), as the data dir opens, and
# once serving. (The interpreter's own first tens of milliseconds, before any of our code
# runs, are out of any program's reach.)
@pytest.mark.parametrize("moment", ["broker.config\n", "open-file budget", "listening on"])
def test_ctrl_c_on_serve_never_prints_a_traceback(tmp_path: Path, moment: str) -> None:
    argv = [
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "broker",
        "serve",
        "--data-dir",
        str(tmp_path / "d"),
        "--listen",
        "127.0.0.1:0",
    ]
    code, out = _interrupt(argv, moment)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert code in (0, 130), out


def test_ctrl_c_on_a_mirror_never_prints_a_traceback(tmp_path: Path) -> None:
    writer = new_broker(tmp_path / "w", extra=["--replication-listen", f"127.0.0.1:{free_port()}"])
    writer.start()
    try:
        mirror_port = free_port()
        argv = [
            *HK,
            "serve",
            "--data-dir",
            str(tmp_path / "m"),
            "--listen",
            f"127.0.0.1:{mirror_port}",
            "--mirror",
            writer.bootstrap,
        ]
        code, out = _interrupt(argv, "listening on")
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert code in (0, 130), out
    finally:
        assert writer.stop() == 0


def test_ctrl_c_on_the_demo_follow(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [str(ROOT / "scripts" / "demo"), "--records", "20", "--follow"]
    # "offset 21:" is a record of the follow phase, read from mirror 1.
    code, out = _interrupt(
        argv, "offset 21:", extra_env={"HK_PYTHON": sys.executable, "TMPDIR": str(tmp)}
    )
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert code == 130, out
    assert list(tmp.iterdir()) == [], "the demo left its temporary directory behind"

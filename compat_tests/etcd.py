"""An etcd server process for tests: cluster mode's tests (and the fault-injection harness)
start their own etcd on free ports in a temp dir, and stop it by its pid.

Owns `EtcdServer` (start, wait until it answers, stop; `pause`/`resume` for fault tests),
`etcd_binary` (Debian's etcd-server, installed by scripts/test) and the `etcd` pytest
fixture. Standard library only, like compat_tests/harness.py: broker/tests use it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from compat_tests.ports import free_port

IN_CI = os.environ.get("CI", "").lower() == "true"
START_TIMEOUT_S = 30.0


def etcd_binary() -> str | None:
    """The etcd server binary (Debian: etcd-server), or None."""
    return shutil.which("etcd")




class EtcdServer:
    """One etcd member `name` on `host`, its data in `data_dir`: alone (the default), or one
    of `members` (every member's name -> peer URL, this one included), which all start
    with the same `members` and `token` and form one cluster.

    `prefix` runs it under another command (``ip netns exec NS``). `command()` is the
    whole command line, for a harness that runs the process itself (compat_tests/jepsen
    kills, pauses and restarts its members). `endpoint` is what
    ``hyperkafka.cluster.etcd.endpoints`` takes. Elections are short by default (tests)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        prefix: Sequence[str] = (),
        name: str = "hk-etcd",
        members: Mapping[str, str] | None = None,
        token: str | None = None,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        log_level: str | None = "warn",
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(
                "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client)"
            )
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.prefix = list(prefix)
        self.name = name
        self.members = dict(members) if members is not None else None
        self.token = token
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def command(self) -> list[str]:
        peer = self.peer_url
        members = self.members if self.members is not None else {self.name: peer}
        argv = [
            *self.prefix,
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            ",".join(f"{n}={url}" for n, url in members.items()),
            "--initial-cluster-state",
            "new",
        ]
        if self.token is not None:
            argv += ["--initial-cluster-token", self.token]
        argv += [
            "--heartbeat-interval",
            str(self.heartbeat_ms),
            "--election-timeout",
            str(self.election_ms),
        ]
        if self.log_level is not None:
            argv += ["--logger", "zap", "--log-level", self.log_level]
        return argv

    def start(self) -> EtcdServer:
        """`spawn` and `wait_ready`: a single member (a member of several answers only once
        a majority of them runs: spawn them all, then wait)."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> EtcdServer:
        """Wait until it answers (it has a leader); stopped and RuntimeError if it does not."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if self.answers():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer within {START_TIMEOUT_S} s: {self.log_tail()}")

    def answers(self) -> bool:
        """Whether the v3 JSON gateway serves a range request (so it has a leader)."""
        body = json.dumps({"key": "AA=="}).encode()
        req = urllib.request.Request(f"{self.endpoint}/v3/kv/range", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=1.0) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_etcd(data_dir: Path | None = None) -> Iterator[EtcdServer]:
    """An etcd for the duration of the block (in a fresh temp dir unless one is given).
    Skips the test when etcd is missing, except under CI=true, where that fails it."""
    if etcd_binary() is None:
        msg = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; scripts/test does it as root)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hk-etcd-")))
        with EtcdServer(data_dir) as server:
            yield server


@pytest.fixture
def etcd() -> Iterator[EtcdServer]:
    """A fresh single-member etcd for one test."""
    with running_etcd() as server:
        yield server

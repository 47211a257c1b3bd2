"""hyperkafka as a child process, for the Java-tool and differential tests.

Owns `Hyperkafka`: `python -m broker serve` on a free loopback port with its own data
dir, awaited until Metadata lists it, stopped with SIGTERM (exit 0 expected). The
compat harness (compat_tests/harness.py) has the general-purpose broker fixture; this
one exists so that these tests can pass extra flags (e.g. --node-id 1 to match the
oracle) and run two brokers side by side. Imports the standard library and
compat_tests.java_tools only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from compat_tests.java_tools import free_port, metadata_broker_count

ROOT = Path(__file__).resolve().parent.parent


class Hyperkafka:
    """hyperkafka in a child process on a free loopback port, with its own data dir."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.log_path = workdir / "hyperkafka.log"
        self.argv = [
            sys.executable, "-m", "broker", "serve",
            "--data-dir", str(workdir / "data"),
            "--listen", f"127.0.0.1:{self.port}",
            "--log-level", "WARNING",
            *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hyperkafka exited {self.proc.returncode}\n{self.log_tail()}")
            if (metadata_broker_count("127.0.0.1", self.port) or 0) >= 1:
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"hyperkafka did not answer within {timeout}s\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"hyperkafka ignored SIGTERM for {timeout}s\n{self.log_tail()}") from None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-lines:])

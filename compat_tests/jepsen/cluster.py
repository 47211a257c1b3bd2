"""Brokers and etcd members as processes, each in its own host of a `Network`.

Owns `JepsenCluster`: it lays out hosts ``n1..nN`` (brokers), ``e1..eM`` (etcd members) and ``c`` (the clients, never cut off from anyone, as Jepsen's control
node), writes each broker's server.properties (``hyperkafka.cluster.etcd.endpoints``
names the etcd members, ``broker.session.timeout.ms`` is the brokers' lease TTL;
``hyperkafka.quorum.partitions.enable`` is `quorum`: partitions signed by a quorum of their
replicas, else single-signer), finds who leads a topic's partitions (`leaders`), starts,
kills (SIGKILL), pauses (SIGSTOP/SIGCONT) and restarts the processes by pid, and on
`close` stops every process it started and deletes the network.

May import the standard library and compat_tests (harness, etcd, jepsen.net, jepsen.wire).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import ROOT
from compat_tests.jepsen.net import Network, in_namespace
from compat_tests.jepsen.wire import Conn, Metadata

KAFKA_PORT = 9092
REPLICATION_PORT = 9093
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
T = TypeVar("T")


class ClusterError(Exception):
    pass


@dataclass
class Proc:
    host: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class JepsenCluster:
    workdir: Path
    brokers: int = 3
    etcd_members: int = 1
    session_ms: int = 6000
    quorum: bool = False
    net: Network = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = Network([*self.broker_hosts, *self.etcd_hosts, "c"])

    # --- layout ---------------------------------------------------------------------------

    @property
    def broker_hosts(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.brokers + 1)]

    @property
    def etcd_hosts(self) -> list[str]:
        return [f"e{i}" for i in range(1, self.etcd_members + 1)]

    def addr(self, host: str) -> str:
        return self.net.address[host]

    def bootstrap(self) -> str:
        return ",".join(f"{self.addr(h)}:{KAFKA_PORT}" for h in self.broker_hosts)

    def broker_list(self) -> str:
        """ID@HOST:PORT,... of every broker (the probe's argument)."""
        return ",".join(
            f"{i}@{self.addr(h)}:{KAFKA_PORT}" for i, h in enumerate(self.broker_hosts, 1)
        )

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _properties(self, node_id: int, host: str) -> Path:
        me = self.addr(host)
        props = {
            "node.id": str(node_id),
            "broker.rack": f"rack-{node_id}",
            "listeners": f"PLAINTEXT://{me}:{KAFKA_PORT}",
            "advertised.listeners": f"PLAINTEXT://{me}:{KAFKA_PORT}",
            "hyperkafka.replication.listen": f"{me}:{REPLICATION_PORT}",
            "broker.session.timeout.ms": str(self.session_ms),
            "replica.lag.time.max.ms": str(self.session_ms),
        }
        props["hyperkafka.cluster.etcd.endpoints"] = ",".join(
            f"http://{self.addr(e)}:{ETCD_CLIENT_PORT}" for e in self.etcd_hosts
        )
        props["hyperkafka.cluster.name"] = "hkj"
        # explicit both ways: quorum-signed partitions are on by default, and the
        # single-signer runs are the coverage of writes that wait for their writer
        props["hyperkafka.quorum.partitions.enable"] = str(self.quorum).lower()
        path = self.workdir / f"{host}.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    # --- processes ------------------------------------------------------------------------

    def start(self) -> None:
        self.start_etcd()
        self.start_brokers()

    def start_etcd(self) -> None:
        for host in self.etcd_hosts:
            self._start_etcd(host)
        for host in self.etcd_hosts:
            self._wait_port(host, ETCD_CLIENT_PORT, 30)

    def etcdctl(self, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
        """etcdctl (v3 API) run from the clients' host against every member."""
        endpoints = ",".join(f"http://{self.addr(e)}:{ETCD_CLIENT_PORT}" for e in self.etcd_hosts)
        argv = ["etcdctl", "--endpoints", endpoints, "--command-timeout", "3s", *args]
        env = {**os.environ, "ETCDCTL_API": "3"}
        return subprocess.run(
            self.net.exec_argv("c", argv), capture_output=True, text=True, timeout=timeout, env=env
        )

    def data_dir(self, host: str) -> Path:
        return self.workdir / host / "data"

    def start_brokers(self) -> None:
        for node_id, host in enumerate(self.broker_hosts, 1):
            data = self.data_dir(host)
            data.mkdir(parents=True, exist_ok=True)
            argv = [
                sys.executable,
                "-m",
                "broker",
                "serve",
                "--data-dir",
                str(data),
                "--config",
                str(self._properties(node_id, host)),
            ]
            self.procs[host] = Proc(host, argv, self.workdir / host / "broker.log")
            self._spawn(self.procs[host])
        for host in self.broker_hosts:
            self.wait_broker(host, 60)

    def _start_etcd(self, host: str) -> None:
        if etcd_binary() is None:
            raise ClusterError("etcd is not installed (apt-get install -y etcd-server)")
        # its data in workdir/host/etcd/data, its log where every process of a host logs
        member = EtcdServer(
            self.workdir / host / "etcd",
            host=self.addr(host),
            client_port=ETCD_CLIENT_PORT,
            peer_port=ETCD_PEER_PORT,
            name=host,
            members={e: f"http://{self.addr(e)}:{ETCD_PEER_PORT}" for e in self.etcd_hosts},
            token=self.net.tag,
            heartbeat_ms=100,
            election_ms=1000,
            log_level=None,
        )
        (self.workdir / host).mkdir(parents=True, exist_ok=True)
        self.procs[host] = Proc(host, member.command(), self.workdir / host / "etcd.log")
        self._spawn(self.procs[host])

    def _spawn(self, proc: Proc) -> None:
        proc.log.parent.mkdir(parents=True, exist_ok=True)
        with proc.log.open("ab") as log:
            # `ip netns exec` execs the command itself: the pid is the broker's, so kill -9
            # and SIGSTOP reach it directly.
            proc.popen = subprocess.Popen(
                self.net.exec_argv(proc.host, proc.argv),
                cwd=ROOT,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.paused = False

    def _wait_port(self, host: str, port: int, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs.get(host)
            if proc is not None and not proc.alive():
                raise ClusterError(f"{host} exited:\n{self.log_tail(host)}")
            try:
                in_namespace(
                    self.net.ns("c"),
                    lambda: socket.create_connection((self.addr(host), port), timeout=1).close(),
                )
                return
            except OSError:
                time.sleep(0.2)
        raise ClusterError(f"{host}:{port} not answering after {timeout}s:\n{self.log_tail(host)}")

    def wait_broker(self, host: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.procs[host].alive():
                raise ClusterError(f"broker {host} exited:\n{self.log_tail(host)}")
            if isinstance(self.metadata(host), Metadata):
                return
            time.sleep(0.3)
        raise ClusterError(
            f"broker {host} not answering Metadata after {timeout}s:\n{self.log_tail(host)}"
        )

    def log_tail(self, host: str, lines: int = 40) -> str:
        proc = self.procs.get(host)
        if proc is None or not proc.log.exists():
            return "(no log)"
        return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])

    def ask(self, host: str, request: Callable[[Conn], T]) -> T:
        """`request` on a new connection to exactly this broker, from the clients' host
        (the connection is made, in that namespace, by the first request)."""
        conn = Conn(self.addr(host), KAFKA_PORT, timeout=2.0)
        try:
            return in_namespace(self.net.ns("c"), lambda: request(conn))
        finally:
            conn.close()

    def metadata(self, host: str, topics: list[str] | None = None) -> Metadata | str:
        """Metadata v1 from exactly this broker."""
        return self.ask(host, lambda conn: conn.metadata(topics))

    def controller(self) -> str | None:
        """The host every live, reachable broker names controller, if they agree."""
        seen = set()
        for host in self.broker_hosts:
            md = self.metadata(host)
            if isinstance(md, Metadata):
                seen.add(md.controller)
        if len(seen) == 1:
            node = seen.pop()
            if 1 <= node <= self.brokers:
                return self.broker_hosts[node - 1]
        return None

    def leaders(self, topic: str) -> dict[int, str]:
        """Partition -> the host most reachable brokers' Metadata names its leader (a
        partition none names a live leader of is left out)."""
        votes: dict[int, dict[int, int]] = {}
        for host in self.broker_hosts:
            md = self.metadata(host, [topic])
            if isinstance(md, Metadata):
                for p, info in md.topics.get(topic, {}).items():
                    if 1 <= info.leader <= self.brokers:
                        seen = votes.setdefault(p, {})
                        seen[info.leader] = seen.get(info.leader, 0) + 1
        return {
            p: self.broker_hosts[max(seen, key=lambda n: (seen[n], -n)) - 1]
            for p, seen in sorted(votes.items())
        }

    def coordinator(self, group: str) -> str | None:
        """The host every reachable broker names coordinator of `group`, if they agree."""
        seen = set()
        for host in self.broker_hosts:
            node = self.ask(host, lambda conn: conn.coordinator(group))
            if isinstance(node, int) and node > 0:
                seen.add(node)
        if len(seen) == 1:
            node = seen.pop()
            if node <= self.brokers:
                return self.broker_hosts[node - 1]
        return None

    def kill(self, host: str) -> None:
        proc = self.procs[host]
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.popen is not None
            proc.popen.wait()

    def restart(self, host: str) -> None:
        self._spawn(self.procs[host])

    def pause(self, host: str) -> None:
        os.kill(self.procs[host].pid, signal.SIGSTOP)
        self.procs[host].paused = True

    def resume(self, host: str) -> None:
        os.kill(self.procs[host].pid, signal.SIGCONT)
        self.procs[host].paused = False

    def client_argv(self, argv: list[str]) -> list[str]:
        return self.net.exec_argv("c", argv)

    def close(self) -> None:
        """Stop every process we started (by pid), then delete the network."""
        try:
            for proc in self.procs.values():
                if proc.popen is None or proc.popen.poll() is not None:
                    continue
                if proc.paused:
                    os.kill(proc.pid, signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
            for proc in self.procs.values():
                if proc.popen is None:
                    continue
                try:
                    proc.popen.wait(10)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        finally:
            self.net.close()

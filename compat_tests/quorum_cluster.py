"""A cluster of three broker processes on a throw-away etcd with quorum-signed partitions
on (``hyperkafka.quorum.partitions.enable=true``), for the compat tests of issue 17
(test_cluster_quorum.py, test_cluster_failover.py, test_quorum_admin.py), and the
helpers they share: a client script run in a subprocess (`py`), a wait (`wait`), the
brokers and the topics a broker's Metadata lists (`brokers_listed`, `wait_listed`,
`topics_listed`), and a broker paused by SIGSTOP for the length of a block (`stopped`).

`quorum_cluster` starts etcd, broker 1 (which becomes the controller, hence the writer
of the topics created while it is), then brokers 2 and 3, and yields once broker 1's
Metadata lists all three; however the block ends, every broker still running is killed
and etcd stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from compat_tests import harness
from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import ROOT, Broker

ETCD_MISSING = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; scripts/test does it as root)"
T = TypeVar("T")


def py(code: str, *args: str, timeout: float = 90) -> str:
    """Run a client script (`code`, with `args`) in a subprocess; its last line of output."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, *args], timeout=timeout, cwd=ROOT,
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def wait(what: str, check: Callable[[], T], timeout: float = 60, every: float = 0.3) -> T:
    """Poll `check` until it answers something true (returned); AssertionError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last})")


_LIST_BROKERS = textwrap.dedent(
    """
    import sys
    from confluent_kafka.admin import AdminClient
    md = AdminClient({"bootstrap.servers": sys.argv[1]}).list_topics(timeout=10)
    print(sorted(md.brokers))
    """
)


def brokers_listed(b: Broker) -> list[int]:
    """The broker ids `b`'s Metadata lists ([] when it does not answer)."""
    try:
        return json.loads(py(_LIST_BROKERS, b.bootstrap, timeout=30))  # type: ignore[no-any-return]
    except (AssertionError, subprocess.TimeoutExpired):
        return []


def wait_listed(what: str, b: Broker, ids: Sequence[int | None], timeout: float = 60) -> None:
    """Wait until `b`'s Metadata lists exactly the brokers `ids`."""
    wait(what, lambda: brokers_listed(b) == list(ids), timeout=timeout)


@contextlib.contextmanager
def stopped(b: Broker) -> Iterator[float]:
    """`b` paused (SIGSTOP) for the block, resumed (SIGCONT) however the block ends; yields
    the time it was stopped."""
    assert b.proc is not None
    at = time.time()
    b.proc.send_signal(signal.SIGSTOP)
    try:
        yield at
    finally:
        b.proc.send_signal(signal.SIGCONT)


# Asked of that one broker (a client's AdminClient may ask any broker it learnt of).
_LIST_TOPICS = textwrap.dedent(
    """
    import json, sys
    import trio
    from broker.mirror import kafka_request
    host, port = sys.argv[1].split(":")
    async def main():
        md = await kafka_request(host, int(port), 3, 10, "metadata", {
            "topics": None, "allow_auto_topic_creation": False, "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False})
        print(json.dumps({t.name: str(t.topic_id) for t in md.topics
                          if not t.error_code and not t.name.startswith("__")}))
    trio.run(main)
    """
)


def topics_listed(b: Broker) -> dict[str, str] | None:
    """The topics `b` itself lists in its Metadata, with their topic ids (None when it
    does not answer)."""
    try:
        return json.loads(py(_LIST_TOPICS, b.bootstrap, timeout=30))  # type: ignore[no-any-return]
    except (AssertionError, subprocess.TimeoutExpired):
        return None


@dataclass
class QuorumCluster:
    etcd: EtcdServer
    brokers: list[Broker]
    rports: list[int]  # each broker's replication port

    @property
    def bootstrap(self) -> str:
        return ",".join(b.bootstrap for b in self.brokers)


@contextlib.contextmanager
def quorum_cluster(workdir: Path, session_ms: int, **props: Any) -> Iterator[QuorumCluster]:
    """Three brokers with quorum-signed partitions on, broker 1 the controller; `props`
    (dots as underscores) are added to every broker's properties."""
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    ports = [harness.free_port() for _ in range(3)]
    rports = [harness.free_port() for _ in range(3)]
    brokers: list[Broker] = []
    etcd = EtcdServer(workdir / "etcd")
    extra = "".join(f"{k.replace('_', '.')}={v}\n" for k, v in props.items())
    try:
        etcd.start()
        for i in range(3):
            path = workdir / f"b{i + 1}.properties"
            path.write_text(textwrap.dedent(f"""\
                node.id={i + 1}
                hyperkafka.cluster.etcd.endpoints={etcd.endpoint}
                hyperkafka.replication.listen=127.0.0.1:{rports[i]}
                broker.session.timeout.ms={session_ms}
                hyperkafka.quorum.partitions.enable=true
                """) + extra)  # fmt: skip
            brokers.append(harness.new_broker(workdir / f"broker-{i + 1}", port=ports[i],
                                              extra=("--config", str(path))))  # fmt: skip
        b1, b2, b3 = brokers
        b1.start()
        wait_listed("broker 1 is controller", b1, [1])
        b2.start()
        b3.start()
        wait_listed("three brokers", b1, [1, 2, 3])
        yield QuorumCluster(etcd, brokers, rports)
    finally:
        for b in brokers:
            if b.proc is not None:
                b.kill()  # (SIGKILL ends a stopped process too)
        etcd.stop()

"""Cluster mode under a pause: the fencing that etcd gives (issue 16), as real processes.

Two brokers on one etcd (compat_tests/etcd.py); broker 1 is elected controller, so it
places topics. Groups are sharded as in Kafka: group G1 maps to a partition of
__consumer_offsets that broker 1 coordinates, G2 to one of broker 2 (every broker's
FindCoordinator says so). Broker 1 is then stopped (SIGSTOP) past
broker.session.timeout.ms: its etcd lease expires, broker 2 is elected controller, moves
broker 1's partitions to itself, takes G1 over and acknowledges a commit. Broker 1 is resumed (SIGCONT) and, at once,
asked to commit an older offset, to create a topic, to fetch offsets, and (with broker 2
at the same moment) to auto-create one new name. Under the old design (the lowest live id
is controller, each broker judging liveness by its own probes) broker 1 went on as
controller and coordinator: it acknowledged the older commit, served its stale offsets
and created the topic a second time. Now:

* broker 1 acknowledges nothing: the commit answers NOT_COORDINATOR (it knows by its own
  clock that its lease may be gone, and its epoch fails in etcd anyway), CreateTopics
  NOT_CONTROLLER (or, once its view names broker 2, forwarded there: KIP-590), OffsetFetch
  NOT_COORDINATOR (never its stale offset);
* the acknowledged commit on broker 2 is never moved backwards; once broker 1 is back,
  G1's partition moves back to it (its preferred coordinator), which adopts broker 2's
  commit; both brokers name one coordinator at a time; G2 stays on broker 2 throughout;
* the name auto-created through both brokers has one writer: one broker holds it as its
  own archive, and both brokers' Metadata name that one as leader.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.cluster.shards import partition_for
from broker.mirror import kafka_request
from compat_tests import harness
from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import Broker

SESSION_MS = 3000
# 50 partitions of __consumer_offsets (the default), partition p preferring [1, 2][p % 2]
G1 = next(g for g in (f"g{i}" for i in range(100)) if partition_for(g, 50) % 2 == 0)
G2 = next(g for g in (f"g{i}" for i in range(100)) if partition_for(g, 50) % 2 == 1)
ETCD_MISSING = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client; scripts/test does it as root)"


def _properties(path: Path, node_id: int, etcd: EtcdServer) -> Path:
    path.write_text(
        textwrap.dedent(f"""\
        node.id={node_id}
        hyperkafka.cluster.etcd.endpoints={etcd.endpoint}
        hyperkafka.replication.listen=127.0.0.1:{harness.free_port()}
        broker.session.timeout.ms={SESSION_MS}
        replica.lag.time.max.ms=10000
        """)
    )
    return path


def _ask(b: Broker, api_key: int, version: int, schema: str, body: dict[str, object]) -> Any:
    return trio.run(kafka_request, b.host, b.port, api_key, version, schema, body)


def _metadata(b: Broker, topics: list[str] | None = None, create: bool = False) -> Any:
    return _ask(
        b,
        3,
        9,
        "metadata",
        {
            "topics": None if topics is None else [{"name": t} for t in topics],
            "allow_auto_topic_creation": create,
            "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False,
        },
    )


def _commit(b: Broker, offset: int, group: str = G1) -> int:
    r = _ask(
        b,
        8,
        8,
        "offset_commit",
        {
            "group_id": group,
            "generation_id_or_member_epoch": -1,
            "member_id": "",
            "group_instance_id": None,
            "topics": [
                {
                    "name": "t",
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": offset,
                            "committed_leader_epoch": -1,
                            "committed_metadata": None,
                        }
                    ],
                }
            ],
        },
    )
    return int(r.topics[0].partitions[0].error_code)


def _committed(b: Broker, group: str = G1) -> tuple[int, int]:
    r = _ask(
        b,
        9,
        8,
        "offset_fetch",
        {
            "groups": [{"group_id": group, "topics": [{"name": "t", "partition_indexes": [0]}]}],
            "require_stable": False,
        },
    )
    g = r.groups[0]
    return int(g.error_code), (int(g.topics[0].partitions[0].committed_offset) if g.topics else -1)


def _coordinator(b: Broker, group: str = G1) -> tuple[int, int]:
    r = _ask(b, 10, 3, "find_coordinator", {"key": group, "key_type": 0})
    return int(r.error_code), int(r.node_id)


def _wait(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, trio.TooSlowError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last!r})")


@pytest.mark.timeout(180)
@pytest.mark.matrix(
    "cluster: a paused controller is fenced by etcd (no second coordinator, no second writer)",
    client="raw",
)
def test_a_paused_controller_is_fenced_when_it_resumes(workdir: Path) -> None:
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    etcd = EtcdServer(workdir / "etcd")
    b1 = harness.new_broker(
        workdir / "broker-1",
        extra=("--config", str(_properties(workdir / "b1.properties", 1, etcd))),
    )
    b2 = harness.new_broker(
        workdir / "broker-2",
        extra=("--config", str(_properties(workdir / "b2.properties", 2, etcd))),
    )
    stopped: list[int] = []
    try:
        etcd.start()
        b1.start()
        _wait("broker 1 elected controller", lambda: _metadata(b1).controller_id == 1)
        b2.start()
        _wait("broker 2 registered", lambda: [b.node_id for b in _metadata(b1).brokers] == [1, 2])
        r = _ask(
            b1,
            19,
            5,
            "create_topics",
            {
                "topics": [
                    {
                        "name": "t",
                        "num_partitions": 1,
                        "replication_factor": 2,
                        "assignments": [],
                        "configs": [],
                    }
                ],
                "timeout": 5000,
                "validate_only": False,
            },
        )
        assert r.topics[0].error_code == 0
        for b in (b1, b2):  # groups land on different brokers, the same from every broker
            _wait(
                "G1 on broker 1, G2 on broker 2",
                lambda b=b: (_coordinator(b, G1), _coordinator(b, G2)) == ((0, 1), (0, 2)),
            )
        assert _wait("a commit on broker 1", lambda: _commit(b1, 5) == 0)
        assert _wait("a commit on broker 2", lambda: _commit(b2, 50, G2) == 0)
        time.sleep(1)  # broker 2's copy of broker 1's offsets archive follows it live

        assert b1.proc is not None
        os.kill(b1.proc.pid, signal.SIGSTOP)
        stopped.append(b1.proc.pid)
        paused = time.monotonic()
        _wait(
            "broker 2 elected controller",
            lambda: (
                (md := _metadata(b2)).controller_id == 2 and [b.node_id for b in md.brokers] == [2]
            ),
            timeout=SESSION_MS / 1000 + 20,
        )
        failover_s = time.monotonic() - paused
        assert _wait("broker 2 takes G1 over", lambda: _committed(b2) == (0, 5))
        takeover_s = time.monotonic() - paused
        assert _commit(b2, 7) == 0  # acknowledged by the new coordinator
        assert _committed(b2, G2) == (0, 50)  # broker 2's own groups never moved

        # resume broker 1, and ask it (and broker 2, for the auto-created name) at once
        answers: dict[str, Any] = {}

        def auto(b: Broker, key: str) -> None:
            answers[key] = [t.error_code for t in _metadata(b, ["auto"], create=True).topics]

        threads = [threading.Thread(target=auto, args=(b2, "auto2"))]
        os.kill(b1.proc.pid, signal.SIGCONT)
        stopped.remove(b1.proc.pid)
        for th in threads:
            th.start()
        answers["commit"] = _commit(b1, 3)  # older than 7: must never be acknowledged
        answers["fetch"] = _committed(b1)
        answers["create"] = int(
            _ask(
                b1,
                19,
                5,
                "create_topics",
                {
                    "topics": [
                        {
                            "name": "x",
                            "num_partitions": 1,
                            "replication_factor": 1,
                            "assignments": [],
                            "configs": [],
                        }
                    ],
                    "timeout": 5000,
                    "validate_only": False,
                },
            )
            .topics[0]
            .error_code
        )
        auto(b1, "auto1")
        for th in threads:
            th.join(30)
        print(
            f"\n  broker 2 elected {failover_s:.2f}s after broker 1 was paused (session {SESSION_MS} ms), "
            f"coordinator of G1 with its commit after {takeover_s:.2f}s; "
            f"broker 1 resumed answered {answers}",
            file=sys.stderr,
        )
        assert answers["commit"] in (16, 14), answers  # NOT_COORDINATOR (or still loading): never 0
        assert answers["fetch"][0] in (16, 14), answers  # never its stale offset
        # NOT_CONTROLLER, or (once its view names broker 2) forwarded to broker 2, which
        # places it under its own epoch: never created by broker 1 as controller
        assert answers["create"] in (41, 0), answers

        _wait(
            "broker 1 registered again",
            lambda: [b.node_id for b in _metadata(b2).brokers] == [1, 2],
        )
        # G1's partition moves back to broker 1, its preferred coordinator, which adopts
        # broker 2's commit: never moved backwards, never served by two
        back = time.monotonic()
        assert _wait("broker 1 coordinates G1 again", lambda: _committed(b1) == (0, 7))
        print(f"  G1 back on broker 1 after {time.monotonic() - back:.2f}s", file=sys.stderr)
        for b in (b1, b2):
            assert _wait(
                f"{b.bootstrap} names broker 1 coordinator of G1",
                lambda b=b: _coordinator(b) == (0, 1),
            )
            assert _coordinator(b, G2) == (0, 2)
        assert _committed(b2)[0] == 16
        assert _committed(b2, G2) == (0, 50)

        def one_leader() -> int | None:
            leaders = set()
            for b in (b1, b2):
                md = _metadata(b, ["auto"], create=True)
                t = md.topics[0]
                if t.error_code or not t.partitions:
                    return None
                leaders.add(t.partitions[0].leader_id)
            return leaders.pop() if len(leaders) == 1 else None

        leader = _wait("one leader of the auto-created topic in both brokers' Metadata", one_leader)
        assert b1.data_dir is not None and b2.data_dir is not None
        own = [
            i
            for i, b in ((1, b1), (2, b2))
            if b.data_dir is not None and (b.data_dir / "auto-0").is_dir()
        ]
        assert own == [leader], (
            own,
            leader,
        )  # one writer: the only broker with its own archive of it
    except BaseException:
        for b in (b1, b2):
            print(f"--- {b.bootstrap}\n{b.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for b in (b1, b2):
            try:
                b.stop()
            except harness.BrokerError:
                b.kill()
        etcd.stop()

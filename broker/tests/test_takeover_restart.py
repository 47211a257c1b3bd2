"""A quorum-signed partition's leader restarted (a crash, then started again at once,
its lease not revoked: `kill -9`) takes produces again within the session timeout,
and only on a leader epoch a vote gave it (broker/takeover.py, docs/clusters.md
"Failover"). Three brokers in this process on a test etcd."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from broker import node as node_module
from broker.cluster.etcd import Etcd
from broker.cluster.failover import restarted
from broker.cluster.membership import Member, Membership, Placement
from broker.tests import quorum_fixtures
from broker.tests.test_cluster import _metadata, _until
from broker.tests.test_takeover import ON, _produce, _values
from compat_tests.etcd import EtcdServer

SESSION_MS = 2000


class Brokers(quorum_fixtures.Brokers):
    """Brokers 1..3 in this process with quorum-signed partitions, each crashed
    (cancelled) and started again on its data dir and ports; `clients` holds the client
    of each one's latest start."""

    def __init__(self, nursery: trio.Nursery, tmp_path: Path, endpoint: str,
                 session_ms: int = SESSION_MS) -> None:  # fmt: skip
        super().__init__(nursery, tmp_path, endpoint, session_ms=session_ms, **ON)
        self.clients: dict[int, Any] = {}

    async def start(self, i: int) -> Any:
        self.clients[i] = client = await super().start(i)
        return client

    def crash(self, i: int) -> None:
        self.stop(i)

    async def leader(self, via: int, topic: str = "q") -> tuple[int, int]:
        p = (await _metadata(self.clients[via], topic)).topics[0].partitions[0]
        return int(p.leader_id), int(p.leader_epoch)


@pytest.fixture
def crash_keeps_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped broker leaves its lease to expire, as a process killed by SIGKILL does
    (a graceful stop revokes it)."""

    async def keep(self: Etcd, lease: int) -> None:
        return None

    monkeypatch.setattr(Etcd, "revoke", keep)


async def _cluster_with_q(b: Brokers) -> None:
    """Brokers 1, 2, 3 up, broker 1 controller, topic q (replicas 1, 2, 3) written by 1
    with v0."""
    c1 = (await quorum_fixtures.three_brokers(b))[1]
    await quorum_fixtures.create_q(c1)

    async def first() -> bool:
        return (await _produce(c1, b"v0", 0))[0] == 0

    await _until(first)


async def _writes_again(b: Brokers, via: int, seq: int, epoch_above: int) -> int:
    """Wait until broker `via`'s Metadata names a live leader of q in an epoch above
    `epoch_above` that acknowledges v<seq> at offset `seq`; that leader."""
    got: list[int] = []

    async def writes() -> bool:
        lead, epoch = await b.leader(via)
        if epoch <= epoch_above or lead not in b.clients:
            return False
        err, offset = await _produce(b.clients[lead], b"v%d" % seq, seq)
        if err != 0:
            return False
        assert offset == seq
        got.append(lead)
        return True

    await _until(writes)
    return got[0]


@pytest.mark.parametrize("down_s", [0.0, SESSION_MS / 1000 + 1], ids=["at-once", "after-its-lease"])
async def test_a_restarted_elected_leader_writes_again_on_a_new_epoch(
    tmp_path: Path, etcd: EtcdServer, crash_keeps_lease: None, down_s: float
) -> None:
    """The leader a failover elected (epoch 1) crashes, the writer being down too, and
    starts again at once (its old lease still alive) or once its lease expired (the
    failover then finds no majority: one replica alive of three): the partition takes
    produces again within the session timeout and a few seconds of the restart, on an
    epoch above 1 (the restarted broker may lead again only after a vote, which it
    joins), and nothing acknowledged is lost. Before, the restarted broker did not even
    open its copy (only the mirror of a live broker did, and the writer was down), and,
    alive again, it was never failed over: the partition had no leader for good."""
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            b = Brokers(nursery, tmp_path, etcd.endpoint)
            await _cluster_with_q(b)
            b.crash(1)  # the writer: a failover elects 2 or 3 in epoch 1
            lead = await _writes_again(b, 2, 1, 0)
            assert await b.leader(2) == (lead, 1)
            assert await _produce(b.clients[lead], b"v2", 2) == (0, 2)

            b.crash(lead)
            await trio.sleep(down_s)
            await b.start(lead)
            restarted = trio.current_time()
            other = 5 - lead
            lead2 = await _writes_again(b, other, 3, 1)
            took = trio.current_time() - restarted
            assert took < SESSION_MS / 1000 + 8, took
            assert await _values(b.clients[lead2]) == [b"v0", b"v1", b"v2", b"v3"]
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("down_s", [0.0, SESSION_MS / 1000 + 1], ids=["at-once", "after-its-lease"])
async def test_a_restarted_writer_writes_again(
    tmp_path: Path, etcd: EtcdServer, crash_keeps_lease: None, down_s: float
) -> None:
    """The topic's writer (epoch 0, no failover yet; the controller too) crashes and
    starts again at once (its old lease still alive: it never looks gone, so nothing is
    failed over and it leads on, its store's log reopened) or once its lease expired (a
    failover elected 2 or 3 meanwhile: it steps down and follows): either way the
    partition takes produces again within the session timeout and a few seconds of
    the restart, and nothing acknowledged is lost."""
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            b = Brokers(nursery, tmp_path, etcd.endpoint)
            await _cluster_with_q(b)
            for seq in (1, 2):
                assert await _produce(b.clients[1], b"v%d" % seq, seq) == (0, seq)
            b.crash(1)
            await trio.sleep(down_s)
            await b.start(1)
            restarted_at = trio.current_time()
            lead = await _writes_again(b, 2, 3, -1)
            took = trio.current_time() - restarted_at
            assert took < SESSION_MS / 1000 + 8, took
            lead_now, epoch = await b.leader(2)
            assert lead_now == lead
            if down_s:
                assert lead in (2, 3) and epoch >= 1  # failed over while it was down
            else:
                assert (lead, epoch) == (1, 0)  # never gone: the writer leads on
            assert await _values(b.clients[lead]) == [b"v0", b"v1", b"v2", b"v3"]

            async def follows() -> bool:
                return await _values(b.clients[1 if lead != 1 else 2]) == [b"v0", b"v1", b"v2", b"v3"]

            await _until(follows)
            nursery.cancel_scope.cancel()

async def test_a_leader_whose_head_no_quorum_signed_resumes_when_a_replica_registers(
    tmp_path: Path, etcd: EtcdServer, crash_keeps_lease: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer 1's replicas 2 and 3 crash (their leases still alive, so its produce is
    appended): its head cannot be quorum-signed, the partition goes offline
    (NOT_ENOUGH_REPLICAS_AFTER_APPEND). Once 3 is back and registered in etcd, the
    leader takes the partition back at that change of the view, not at the next tick of
    its offline retry (made 10 minutes here: before, only that tick, every 5 s, looked)."""
    monkeypatch.setattr(node_module, "OFFLINE_RETRY_S", 600.0)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            b = Brokers(nursery, tmp_path, etcd.endpoint, session_ms=6000)
            await _cluster_with_q(b)
            b.crash(2)
            b.crash(3)
            # NOT_ENOUGH_REPLICAS_AFTER_APPEND: written, its head not signed, offline
            assert (await _produce(b.clients[1], b"v1", 1))[0] == 20

            async def leases_gone() -> bool:
                return [x.node_id for x in (await _metadata(b.clients[1], "x")).brokers] == [1]

            await _until(leases_gone)
            await b.start(3)
            back = trio.current_time()

            async def writes() -> bool:
                return (await _produce(b.clients[1], b"v1", 1)) == (0, 1)

            await _until(writes)
            took = trio.current_time() - back
            assert took < 20, took
            assert await _values(b.clients[1]) == [b"v0", b"v1"]
            nursery.cancel_scope.cancel()

async def test_a_restarted_broker_never_looks_gone_and_gets_a_new_session(etcd: EtcdServer) -> None:
    """A broker restarted while its registration of before still lives (SIGKILL: the
    lease not revoked) replaces it in one transaction: a watcher never sees it absent
    (before, it deleted it first, and a controller could fail over what it led in that
    moment), and its session (the registration's lease) is a new one, by which a
    controller tells it restarted (`failover.restarted`)."""
    client = Etcd([etcd.endpoint])
    old_lease = await client.grant(60)  # the killed broker's, still alive
    me = Member(1, "127.0.0.1", 9001, None, f"{1:064x}")
    await client.put(b"/t/brokers/1", me.encode(), old_lease)
    watcher = Membership(client, "t", Member(2, "127.0.0.1", 9002, None, f"{2:064x}"), 2)
    restarted_m = Membership(Etcd([etcd.endpoint]), "t", me, 2)
    gone: list[int] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run)

            async def look() -> None:
                while True:
                    if 1 not in watcher.members:
                        gone.append(1)
                    await watcher.changed.wait()

            nursery.start_soon(look)
            await trio.sleep(0.1)
            assert watcher.sessions[1] == old_lease
            await nursery.start(restarted_m.run)

            while watcher.sessions.get(1) != restarted_m.lease:
                await watcher.changed.wait()
            assert restarted_m.lease != old_lease
            assert not gone  # never absent from the watcher's view
            placement = Placement("q", 3, 1, {}, 3, ((3, 1, 2),)).with_leader(0, 1, 1, old_lease)
            assert restarted(watcher, placement, 0)
            assert not restarted(watcher, placement.with_leader(0, 1, 2, restarted_m.lease), 0)
            assert not restarted(watcher, placement.with_leader(0, 1, 2, 0), 0)  # (not known)
            nursery.cancel_scope.cancel()
        await client.revoke(old_lease)

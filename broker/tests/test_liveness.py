"""Evidence of a peer's death (broker/cluster/liveness.py), against a real etcd: a peer
whose listener refuses connections after it answered in its session loses its lease at
once; silence, a listener that never answered and a connection the peer merely closed
take nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from broker.cluster.etcd import Etcd
from broker.cluster.liveness import HELD_MIN_S, open_peer_stream, refused, watch_peers
from broker.cluster.membership import Member, Membership
from broker.config import BrokerConfig, apply_properties
from compat_tests.etcd import EtcdServer

TTL_S = 30  # far longer than any test here: a peer gone from the view was revoked


class Listener:
    """A peer's Kafka port, as its process holds it: `kill` closes the listening socket and
    every accepted connection (the kernel does that for a process killed by SIGKILL);
    `hang_up` closes the accepted connections only (an idle reaper)."""

    def __init__(self) -> None:
        self.port = 0
        self.accepted = 0
        self._scope = trio.CancelScope()
        self._streams: set[trio.SocketStream] = set()
        self._more = trio.Event()

    async def wait_accepted(self, n: int) -> None:
        while self.accepted < n:
            await self._more.wait()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]

        async def hold(stream: trio.SocketStream) -> None:
            self.accepted += 1
            self._more.set()
            self._more = trio.Event()
            self._streams.add(stream)
            try:
                async with stream:
                    await trio.sleep_forever()
            finally:
                self._streams.discard(stream)

        with self._scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, hold, listeners)
                task_status.started()

    def kill(self) -> None:
        self._scope.cancel()

    async def hang_up(self) -> None:
        for s in list(self._streams):
            await trio.aclose_forcefully(s)


@asynccontextmanager
async def _cluster(etcd: EtcdServer, peer_port: int) -> AsyncIterator[tuple[Membership, Membership]]:
    """Broker 1 (watching) and broker 2 (registered at 127.0.0.1:`peer_port`)."""
    me, peer = (
        Membership(Etcd([etcd.endpoint]), "lv", Member(i, "127.0.0.1", port, None, f"{i:064x}"), TTL_S)
        for i, port in ((1, 1), (2, peer_port))
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(me.run)
        await nursery.start(peer.run)
        while 2 not in me.members:
            await me.changed.wait()
        nursery.start_soon(watch_peers, me)
        yield me, peer
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _listening_peer(etcd: EtcdServer) -> AsyncIterator[tuple[Listener, Membership, Membership]]:
    """A `Listener` as broker 2's Kafka port, and `_cluster` on it."""
    async with trio.open_nursery() as outer:
        listener = Listener()
        await outer.start(listener.run)
        async with _cluster(etcd, listener.port) as (me, peer):
            yield listener, me, peer
        outer.cancel_scope.cancel()


async def _gone(me: Membership, node_id: int) -> None:
    while node_id in me.members:
        await me.changed.wait()


async def test_a_killed_peer_loses_its_lease_at_once(etcd: EtcdServer) -> None:
    async with _listening_peer(etcd) as (listener, me, peer):
        lease = me.sessions[2]
        await listener.wait_accepted(1)
        started = trio.current_time()
        listener.kill()
        with trio.fail_after(5):  # the lease's TTL is 30 s
            await _gone(me, 2)
        assert trio.current_time() - started < 2
        assert await Etcd([etcd.endpoint]).keepalive(lease) == 0  # revoked
        # the peer (alive after all, in this test) registers again on a new lease
        with trio.fail_after(TTL_S / 2):
            while me.sessions.get(2, lease) == lease:
                await me.changed.wait()
        assert peer.lease != lease


async def test_a_peer_that_never_answered_is_not_thought_dead(etcd: EtcdServer) -> None:
    # a port nobody listens on: refused from the start (a registration advertising an
    # address peers cannot reach must not get that broker revoked)
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError) as failed:
        await open_peer_stream("127.0.0.1", port)
    assert refused(failed.value)
    async with _cluster(etcd, port) as (me, _):
        lease = me.sessions[2]
        await trio.sleep(1.5)  # several tries
        assert me.sessions.get(2) == lease


async def test_a_connection_the_peer_closes_is_not_death(etcd: EtcdServer) -> None:
    async with _listening_peer(etcd) as (listener, me, _):
        lease = me.sessions[2]
        with trio.fail_after(5):
            for n in range(1, 4):
                await listener.wait_accepted(n)
                await trio.sleep(HELD_MIN_S + 0.1)  # held long enough: reconnected at once
                await listener.hang_up()  # the watcher connects again
        assert me.sessions.get(2) == lease
        listener.kill()  # and after all that, death still counts
        with trio.fail_after(5):
            await _gone(me, 2)


def test_the_setting_is_on_by_default_and_can_be_turned_off() -> None:
    assert BrokerConfig().death_evidence
    off = apply_properties(BrokerConfig(), {"hyperkafka.cluster.death.evidence.enable": "false"})
    assert not off.death_evidence
    assert apply_properties(off, {"hyperkafka.cluster.death.evidence.enable": "true"}).death_evidence

"""Membership, election and fencing in etcd (broker/cluster/membership.py), against a real
etcd (compat_tests/etcd.py), and placement's choice of writer (broker/placement.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from broker.cluster import Cluster
from broker.cluster.etcd import Etcd
from broker.cluster.membership import Member, Membership, Placement
from broker.placement import choose_writer
from compat_tests.etcd import EtcdServer

TTL_S = 2


@asynccontextmanager
async def _members(
    etcd: EtcdServer, *ids: int, rack: Callable[[int], str] = lambda i: f"r{i}"
) -> AsyncIterator[list[Membership]]:
    out = [
        Membership(
            Etcd([etcd.endpoint]),
            "t",
            Member(i, "127.0.0.1", 9000 + i, rack(i), f"{i:064x}"),
            TTL_S,
        )
        for i in ids
    ]
    async with trio.open_nursery() as nursery:
        for m in out:
            await nursery.start(m.run)
        yield out
        nursery.cancel_scope.cancel()


async def _until(check: Callable[[], bool]) -> None:
    while True:  # several memberships' views: no one event to wait on
        if check():
            return
        await trio.sleep(0.02)


async def test_one_controller_is_elected_and_everyone_sees_it(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        async with _members(etcd, 1, 2, 3) as ms:
            await _until(
                lambda: all(m.controller is not None and sorted(m.members) == [1, 2, 3] for m in ms)
            )
            assert len({(m.controller, m.controller_epoch) for m in ms}) == 1
            assert sum(m.is_controller for m in ms) == 1
            assert sum(m.elections for m in ms) == 1
            assert ms[0].known == ms[0].members  # the lasting record of who belongs


async def test_a_controller_whose_lease_is_gone_is_fenced_and_another_is_elected(
    etcd: EtcdServer,
) -> None:
    with trio.fail_after(30):
        async with _members(etcd, 1, 2) as ms:
            await _until(
                lambda: any(m.is_controller for m in ms) and all(len(m.members) == 2 for m in ms)
            )
            old = next(m for m in ms if m.is_controller)
            other = next(m for m in ms if m is not old)
            epoch = old.controller_epoch
            assert await old.check_epoch(epoch)
            assert await old.place(Placement("a", old.me.node_id, 1))
            # its lease expires (as when it is paused or cut off): etcd drops its keys
            await Etcd([etcd.endpoint]).revoke(old.lease)
            await _until(lambda: other.is_controller)
            assert other.controller_epoch > epoch
            # whatever the old one still believes, its acts under the old epoch fail
            assert not await old.check_epoch(epoch)
            assert await old.fenced([], [], epoch=epoch) is None
            assert await other.place(Placement("b", other.me.node_id, 1))
            assert (
                await other.place(Placement("a", other.me.node_id, 1)) is False
            )  # the name is taken
            await _until(lambda: sorted(old.members) == [1, 2])  # it came back, as a follower
            assert not old.is_controller and old.controller == other.me.node_id
            kvs, _ = await Etcd([etcd.endpoint]).get(b"/t/topics/", prefix=True)
            assert {kv.key: json.loads(kv.value)["writer"] for kv in kvs} == {
                b"/t/topics/a": old.me.node_id,
                b"/t/topics/b": other.me.node_id,
            }


async def test_a_restarted_broker_replaces_its_own_stale_registration_but_not_anothers(
    etcd: EtcdServer,
) -> None:
    client = Etcd([etcd.endpoint])
    lease = await client.grant(60)  # a registration that would outlive the test
    await client.put(
        b"/t/brokers/1", Member(1, "127.0.0.1", 9001, None, f"{1:064x}").encode(), lease
    )
    await client.put(b"/t/brokers/2", Member(2, "127.0.0.1", 9002, None, "ff" * 32).encode(), lease)
    with trio.fail_after(20):
        async with _members(etcd, 1) as (m1,):  # same node key: killed and restarted
            assert m1.members[1] == m1.me
            m2 = Membership(client, "t", Member(2, "127.0.0.1", 9002, None, f"{2:064x}"), TTL_S)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(m2.run)
                await trio.sleep(1.5)
                assert not m2.ready.is_set()  # another broker holds node.id 2: it waits
                await client.revoke(lease)
                await m2.ready.wait()
                assert m2.members[2] == m2.me
                nursery.cancel_scope.cancel()


def test_placement_spreads_writers_over_brokers_then_racks() -> None:
    m = Membership(Etcd(["http://127.0.0.1:1"]), "t", Member(1, "h", 1, "a"), 3, clock=lambda: 0.0)
    m.lease, m._lease_deadline = 1, float("inf")
    m.members = {
        i: Member(i, "h", i, rack) for i, rack in ((1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "c"))
    }
    c = Cluster(m)
    chosen = []
    for n in range(10):
        w = choose_writer(c)
        chosen.append(w)
        m.placements[f"t{n}"] = Placement(f"t{n}", w, 1)
    # every broker writes as many (two each), and among equals the emptier rack goes
    # first: a, b, c, then the second broker of a and b
    assert chosen[:5] == [1, 3, 5, 2, 4]
    assert [chosen.count(i) for i in range(1, 6)] == [2, 2, 2, 2, 2]
    del m.members[5]  # a dead broker gets nothing new
    assert choose_writer(c) != 5


class _Proxy:
    """A TCP relay to etcd that can go silent (forwards nothing, resets nothing), as a
    link whose packets are dropped does."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silent = False

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        while data := await src.receive_some(65536):
            if self.silent:
                await trio.sleep_forever()
            await dst.send_all(data)

    async def _handle(self, client: trio.SocketStream) -> None:
        if self.silent:
            await trio.sleep_forever()
        try:
            upstream = await trio.open_tcp_stream("127.0.0.1", self.port)
        except OSError:
            await client.aclose()
            return
        async with upstream, client, trio.open_nursery() as n:
            n.start_soon(self._pipe, client, upstream)
            n.start_soon(self._pipe, upstream, client)

    async def serve(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async def handle(client: trio.SocketStream) -> None:
            with contextlib.suppress(trio.BrokenResourceError, OSError):
                await self._handle(client)

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(handle, listeners)


async def test_a_watch_on_an_endpoint_gone_silent_is_replaced(etcd: EtcdServer) -> None:
    """Two endpoints: the first (a relay) goes silent. The keep-alive fails over to the
    second; the watch, which hears nothing on a silent link, is started again there, so
    changes are still seen and the lease stays."""
    proxy = _Proxy(etcd.client_port)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(proxy.serve)
            m = Membership(
                Etcd([f"http://127.0.0.1:{port}", etcd.endpoint]),
                "t",
                Member(1, "127.0.0.1", 9001, None, f"{1:064x}"),
                9,
            )
            await nursery.start(m.run)
            await _until(lambda: m.is_controller)
            proxy.silent = True
            lease = m.lease
            await Etcd([etcd.endpoint]).put(b"/t/brokers/7", Member(7, "h", 7).encode())
            await _until(lambda: 7 in m.members)
            assert m.lease == lease and m.is_controller  # the same session throughout
            nursery.cancel_scope.cancel()

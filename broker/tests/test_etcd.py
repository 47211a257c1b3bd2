"""The etcd client (broker/cluster/etcd.py) against a real etcd (compat_tests/etcd.py)."""

from __future__ import annotations

import trio

from broker.cluster.etcd import Compare, Etcd, EtcdError, Op, prefix_end
from compat_tests.etcd import EtcdServer


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_range_put_delete(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        c = Etcd([etcd.endpoint])
        rev = await c.put(b"/t/a", b"1")
        await c.put(b"/t/b", b"\x00\xff binary")
        await c.put(b"/u", b"x")
        kvs, now = await c.get(b"/t/", prefix=True)
        assert now > rev
        assert [(kv.key, kv.value) for kv in kvs] == [
            (b"/t/a", b"1"),
            (b"/t/b", b"\x00\xff binary"),
        ]
        assert kvs[0].create_revision == rev
        assert await c.delete(b"/t/", prefix=True) == 2
        assert (await c.get(b"/t/a"))[0] == []


async def test_create_if_absent_txn_has_one_winner(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        c = Etcd([etcd.endpoint])
        won: list[int] = []

        async def claim(i: int) -> None:
            r = await c.txn(
                [Compare.absent(b"/k")], [Op.put(b"/k", str(i).encode())], [Op.get(b"/k")]
            )
            if r.succeeded:
                won.append(i)
            else:
                assert r.ranges[0][0].value.isdigit()

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(claim, i)
        assert len(won) == 1
        kvs, _ = await c.get(b"/k")
        assert kvs[0].value == str(won[0]).encode()
        # a write fenced by the create revision of /k fails once /k was re-created
        epoch = kvs[0].create_revision
        await c.delete(b"/k")
        await c.put(b"/k", b"again")
        r = await c.txn([Compare.create_revision(b"/k", epoch)], [Op.put(b"/fenced", b"x")])
        assert not r.succeeded
        assert (await c.get(b"/fenced"))[0] == []


async def test_a_key_on_an_expired_lease_is_gone_and_keepalive_says_so(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        c = Etcd([etcd.endpoint])
        lease = await c.grant(1)
        await c.put(b"/live", b"1", lease)
        assert await c.keepalive(lease) >= 1
        assert (await c.get(b"/live"))[0]
        await trio.sleep(3)
        assert (await c.get(b"/live"))[0] == []
        assert await c.keepalive(lease) == 0
        await c.revoke(lease)  # gone already: no error


async def test_watch_streams_changes_from_a_revision(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        c = Etcd([etcd.endpoint])
        first = await c.put(b"/w/1", b"a")
        seen: list[tuple[str, bytes, bytes]] = []
        done = trio.Event()

        async def watch() -> None:
            async for events in c.watch(b"/w/", prefix=True, start_revision=first):
                seen.extend((e.type, e.kv.key, e.kv.value) for e in events)
                if len(seen) == 3:
                    done.set()
                    return

        async with trio.open_nursery() as n:
            n.start_soon(watch)
            await trio.sleep(0.2)
            await c.put(b"/w/2", b"b")
            await c.put(b"/other", b"not seen")
            await c.delete(b"/w/1")
            await done.wait()
        assert seen == [("PUT", b"/w/1", b"a"), ("PUT", b"/w/2", b"b"), ("DELETE", b"/w/1", b"")]


async def test_unreachable_endpoints_raise_and_a_second_endpoint_is_used(etcd: EtcdServer) -> None:
    with trio.fail_after(20):
        dead = "http://127.0.0.1:1"
        try:
            await Etcd([dead]).get(b"/x")
        except EtcdError as e:
            assert "no etcd endpoint answered" in str(e)
        else:
            raise AssertionError("no error from an unreachable etcd")
        c = Etcd([dead, etcd.endpoint])
        await c.put(b"/x", b"y")
        assert (await c.get(b"/x"))[0][0].value == b"y"

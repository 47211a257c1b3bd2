"""Many archives over one replication connection, sans-I/O: two `Connection`s wired back
to back, several ``hypercore/alpha`` channels on one handshake, a channel for an archive
the server does not hold rejected while the others finish, one channel closed while the
others go on, a bad proof or a bad capability failing its own channel only, channels
opened on a live connection, round-robin answers, errors that do end the connection,
and the Trio `ConnectionDriver` carrying several channels until the connection is lost."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import trio
import trio.testing

from storage.hypercore import KeyPair, discovery_key
from storage.replication import (
    CapabilityError,
    FramingError,
    MemoryArchive,
    RemoteProtocolError,
    VerificationError,
)
from storage.replication.session import Connection, ReplicationChannel
from storage.replication.trio_driver import ConnectionDriver

KEYS = [KeyPair.from_seed(bytes([i + 1]) * 32) for i in range(6)]


def _archive(kp: KeyPair, n: int, size: int = 100) -> MemoryArchive:
    a = MemoryArchive.create(kp)
    for i in range(0, n, 10):
        a.append(*[bytes([(i + j + kp.public_key[0]) % 256]) * (size + (i + j) % 50)
                   for j in range(min(10, n - i))])
    return a


class _Tampered(MemoryArchive):
    def block(self, index: int) -> bytes:
        b = super().block(index)
        return b[:-1] + bytes([b[-1] ^ 1]) if index == 3 else b


def _server(*archives: MemoryArchive) -> Connection:
    by_dk = {discovery_key(a.key): a for a in archives}
    return Connection(initiator=False, lookup=by_dk.get)


def _pump(a: Connection, b: Connection, rounds: int = 10_000) -> None:
    for _ in range(rounds):
        da, db = a.data_to_send(), b.data_to_send()
        if not da and not db:
            return
        if da:
            b.receive_data(da)
        if db:
            a.receive_data(db)
    raise AssertionError("connections did not go quiet")


def test_many_archives_over_one_connection() -> None:
    archives = [_archive(kp, 20 + 7 * i) for i, kp in enumerate(KEYS[:4])]
    server = _server(*archives)
    client = Connection(initiator=True)
    sinks = [MemoryArchive(kp.public_key) for kp in KEYS[:4]]
    chans = [client.follow(a.key, s) for a, s in zip(archives, sinks, strict=True)]
    _pump(client, server)
    for a, s, ch in zip(archives, sinks, chans, strict=True):
        assert s.blocks == a.blocks
        assert ch.done and ch.closed and ch.error is None
    assert not client.channels and not server.channels  # each follower closed its channel
    assert set(client.take_changed()) == set(chans)


def test_unknown_archive_is_rejected_and_the_others_finish() -> None:
    known = _archive(KEYS[0], 30)
    stranger = _archive(KEYS[1], 5)
    server = _server(known)
    client = Connection(initiator=True)
    sink = MemoryArchive(KEYS[0].public_key)
    ok = client.follow(known.key, sink)
    refused = client.follow(stranger.key, MemoryArchive(KEYS[1].public_key), live=True)
    _pump(client, server)
    assert refused.closed and isinstance(refused.error, RemoteProtocolError)
    assert "rejected" in str(refused.error)
    assert ok.error is None and sink.blocks == known.blocks


def test_close_one_channel_while_the_others_go_on() -> None:
    a, b = _archive(KEYS[0], 10), _archive(KEYS[1], 10)
    server = _server(a, b)
    client = Connection(initiator=True)
    sa, sb = MemoryArchive(KEYS[0].public_key), MemoryArchive(KEYS[1].public_key)
    ca = client.follow(a.key, sa, live=True)
    cb = client.follow(b.key, sb, live=True)
    _pump(client, server)
    assert len(sa.blocks) == len(sb.blocks) == 10 and len(server.channels) == 2
    ca.close()
    _pump(client, server)
    assert len(server.channels) == 1 and not ca.error
    a.append(b"a-after-close")
    b.append(b"b-live", b"b-live-2")
    server.notify_append()
    _pump(client, server)
    assert len(sa.blocks) == 10  # closed: nothing more flows
    assert len(sb.blocks) == 12 and sb.blocks == b.blocks and not cb.closed
    # the same archive can be opened again on the live connection
    ca2 = client.follow(a.key, sa, have=sa.frontier.copy(), live=True,
                        public_key=KEYS[0].public_key)
    _pump(client, server)
    assert len(sa.blocks) == 11 and sa.blocks == a.blocks and ca2.opened


def test_bad_proof_fails_its_channel_only() -> None:
    bad = _Tampered.create(KEYS[0])
    bad.append(*[b"%d" % i * 50 for i in range(8)])
    good = _archive(KEYS[1], 40)
    server = _server(bad, good)
    client = Connection(initiator=True)
    sbad, sgood = MemoryArchive(KEYS[0].public_key), MemoryArchive(KEYS[1].public_key)
    cbad = client.follow(bad.key, sbad, window=2)
    cgood = client.follow(good.key, sgood, window=2)
    _pump(client, server)
    assert cbad.closed and isinstance(cbad.error, VerificationError)
    assert len(sbad.blocks) < 8
    assert cgood.error is None and sgood.blocks == good.blocks


def test_bad_capability_fails_its_channel_only() -> None:
    a, b = _archive(KEYS[0], 5), _archive(KEYS[1], 5)
    server = _server(a, b)
    client = Connection(initiator=True)
    sa, sb = MemoryArchive(KEYS[0].public_key), MemoryArchive(KEYS[1].public_key)
    liar = client.follow(a.key, sa)
    liar.key = MemoryArchive.create(KEYS[5]).key  # knows the discovery key, not the key
    honest = client.follow(b.key, sb)
    _pump(client, server)
    assert sb.blocks == b.blocks and honest.error is None
    assert len(sa.blocks) == 0 and liar.closed
    served = [ch for ch in server.take_changed() if ch.key == a.key]
    assert served and isinstance(served[0].error, CapabilityError)
    assert served[0].stats.requests == 0


def test_channels_opened_on_a_live_connection() -> None:
    archives = [_archive(kp, 12) for kp in KEYS[:3]]
    server = _server(*archives)
    client = Connection(initiator=True)
    sinks = [MemoryArchive(kp.public_key) for kp in KEYS[:3]]
    client.follow(archives[0].key, sinks[0], live=True)
    _pump(client, server)
    assert len(sinks[0].blocks) == 12 and len(sinks[1].blocks) == 0
    for a, s in zip(archives[1:], sinks[1:], strict=True):
        client.follow(a.key, s, live=True)
    _pump(client, server)
    assert [s.blocks for s in sinks] == [a.blocks for a in archives]
    assert len(server.channels) == 3


def test_requests_are_answered_round_robin() -> None:
    big, small = _archive(KEYS[0], 200, size=1000), _archive(KEYS[1], 200, size=1000)
    server = _server(big, small)
    client = Connection(initiator=True)
    sbig, ssmall = MemoryArchive(KEYS[0].public_key), MemoryArchive(KEYS[1].public_key)
    client.follow(big.key, sbig, window=64)
    client.follow(small.key, ssmall, window=64)
    for _ in range(20):  # handshake, opens, syncs, upgrades: until block requests queue up
        server.receive_data(client.data_to_send())
        served = {ch.key: ch for ch in server.channels.values()}
        if len(served) == 2 and all(len(ch.requests) > 30 for ch in served.values()):
            break
        client.receive_data(server.data_to_send())
    else:
        raise AssertionError("no requests queued")
    seen = [(served[big.key].stats.blocks, served[small.key].stats.blocks)]
    while server.pending:
        client.receive_data(server.data_to_send(budget=1))  # one answer per call
        seen.append((served[big.key].stats.blocks, served[small.key].stats.blocks))
    # one answer per call, and the two archives took turns while both had requests queued
    winners = []
    for (b0, s0), (b1, s1) in itertools.pairwise(seen):
        assert (b1 - b0) + (s1 - s0) == 1
        winners.append("big" if b1 > b0 else "small")
    assert len(winners) >= 40
    assert all(x != y for x, y in itertools.pairwise(winners[:40]))
    _pump(client, server)
    assert sbig.blocks == big.blocks and ssmall.blocks == small.blocks


def test_stream_errors_end_the_connection() -> None:
    a = _archive(KEYS[0], 3)
    server = _server(a)
    client = Connection(initiator=True)
    client.follow(a.key, MemoryArchive(KEYS[0].public_key), live=True)
    _pump(client, server)
    with pytest.raises(FramingError):
        server.receive_data(b"\x05\x00\x00garbage")


# ------------------------------------------------------------------------- with Trio


async def test_trio_driver_many_channels_live_close_and_loss() -> None:
    archives = [_archive(kp, 30) for kp in KEYS[:3]]
    a, b = trio.testing.memory_stream_pair()
    server = ConnectionDriver(a, _server(*archives))
    client = ConnectionDriver(b, Connection(initiator=True))
    sinks = [MemoryArchive(kp.public_key) for kp in KEYS[:3]]

    async def until(ch: ReplicationChannel, cond: Callable[[], bool]) -> None:
        while not cond():
            await client.wait(ch)

    server_scope = trio.CancelScope()

    async def run_server() -> None:
        with server_scope:
            await server.run()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_server)
            nursery.start_soon(client.run)
            chans = [client.conn.follow(x.key, s, live=True) for x, s in zip(archives, sinks, strict=True)]
            client.kick()
            for ch, s in zip(chans, sinks, strict=True):
                await until(ch, lambda s=s: len(s.blocks) == 30)  # type: ignore[misc]
            chans[0].close()
            client.kick()
            archives[0].append(b"not for the closed channel")
            archives[1].append(b"live")
            server.conn.notify_append()
            server.kick()
            await until(chans[1], lambda: len(sinks[1].blocks) == 31)
            assert sinks[1].blocks == archives[1].blocks and len(sinks[0].blocks) == 30
            assert len(server.conn.channels) == 2 and len(client.conn.channels) == 2
            server_scope.cancel()  # the server goes: every channel's wait says so
            with pytest.raises(trio.BrokenResourceError):
                await until(chans[2], lambda: False)
            nursery.cancel_scope.cancel()

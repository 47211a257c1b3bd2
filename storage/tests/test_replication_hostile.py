"""The replication port against a hostile peer: anyone may connect and send anything.

Covers what random bytes rarely reach: structured messages with absurd numbers sent on
an opened channel to a server and to a follower (only `RemoteProtocolError` escapes, the
follower's sink only ever holds verified blocks, the server stays consistent), batches
nested in batches, channel after channel opened and refused, and frame lengths that claim
megabytes the peer never sends (memory follows the bytes that arrived)."""

from __future__ import annotations

import contextlib
import socket

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hypercore import KeyPair, Node
from storage.hypercore.encoding import encode_buffer, encode_uint
from storage.hypercore.proofs import (
    BlockProof,
    BlockRequest,
    HashProof,
    HashRequest,
    Proof,
    UpgradeProof,
    UpgradeRequest,
)
from storage.replication import MemoryArchive, trio_driver
from storage.replication import messages as M
from storage.replication.errors import HandshakeError, MessageError, RemoteProtocolError
from storage.replication.mux import Mux
from storage.replication.secretstream import RECEIVE_BUFFER, SecretStream
from storage.replication.session import Connection
from storage.replication.trio_driver import ConnectionDriver

KP = KeyPair.from_seed(bytes([9]) * 32)
N_BLOCKS = 37


def _source() -> MemoryArchive:
    src = MemoryArchive.create(KP)
    for i in range(N_BLOCKS):
        src.append(b"block %d" % i)
    return src


SRC = _source()


def _pump(a: Connection, b: Connection) -> None:
    for _ in range(1000):
        da, db = a.data_to_send(), b.data_to_send()
        if not da and not db:
            return
        if da:
            b.receive_data(da)
        if db:
            a.receive_data(db)
    raise AssertionError("connections did not go quiet")


# Numbers where bugs live: around the archive's length, powers of two, the u32 edge and
# the largest integer compact-encoding carries.
_EDGES = [
    0,
    1,
    2,
    N_BLOCKS - 1,
    N_BLOCKS,
    N_BLOCKS + 1,
    63,
    64,
    2 * N_BLOCKS,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 52,
    (1 << 53) - 1,
]
num = st.one_of(st.sampled_from(_EDGES), st.integers(0, (1 << 53) - 1))
nodes = st.lists(st.builds(Node, num, num, st.binary(min_size=32, max_size=32)), max_size=4).map(
    tuple
)
messages = st.one_of(
    st.builds(
        M.Sync,
        num,
        num,
        num,
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
        st.booleans(),
    ),
    st.builds(
        M.Request,
        num,
        st.one_of(st.just(0), num),
        st.none() | st.builds(BlockRequest, num, num),
        st.none() | st.builds(HashRequest, num, num),
        st.none(),
        st.none() | st.builds(UpgradeRequest, num, num),
        st.booleans(),
        st.one_of(st.just(0), num),
    ),
    st.builds(M.Cancel, num),
    st.builds(
        M.Data,
        num,
        st.builds(
            Proof,
            num,
            st.none() | st.builds(BlockProof, num, st.binary(max_size=40), nodes),
            st.none() | st.builds(HashProof, num, nodes),
            st.none()
            | st.builds(
                UpgradeProof,
                num,
                num,
                nodes,
                nodes,
                st.none() | st.binary(min_size=68, max_size=68),
            ),
        ),
    ),
    st.builds(M.NoData, num, st.integers(0, 2)),
    st.builds(M.Want, num, num, st.booleans()),
    st.builds(M.Unwant, num, num, st.booleans()),
    st.builds(M.Bitfield, num, st.lists(st.integers(0, (1 << 32) - 1), max_size=6).map(tuple)),
    st.builds(M.Range, num, num, st.booleans()),
    st.builds(M.Extension, st.text(max_size=8), st.binary(max_size=8)),
)


def _attack(victim: Connection, attacker: Connection, msgs: list[M.Message]) -> None:
    """Send `msgs` from `attacker`'s channel to `victim`, answering as it goes: only a
    RemoteProtocolError may escape (the connection is then dropped)."""
    ach = next(iter(attacker.channels.values()))
    assert ach.channel is not None and ach.opened
    for m in msgs:
        attacker.mux.send(ach.channel, int(m.TYPE), m.encode())
        try:
            victim.receive_data(attacker.data_to_send())
            attacker.receive_data(victim.data_to_send())
        except RemoteProtocolError:
            return


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, min_size=1, max_size=10))
def test_server_takes_any_message_sequence(msgs: list[M.Message]) -> None:
    server = Connection(initiator=False, lookup=lambda dk: SRC)
    client = Connection(initiator=True)
    client.follow(SRC.key, MemoryArchive(KP.public_key), live=True, window=0)
    _pump(client, server)
    _attack(server, client, msgs)
    assert server.queued >= 0
    # whatever it was sent, the server answers an honest follower on a new connection
    honest = Connection(initiator=True)
    sink = MemoryArchive(KP.public_key)
    honest.follow(SRC.key, sink)
    again = Connection(initiator=False, lookup=lambda dk: SRC)
    _pump(honest, again)
    assert sink.frontier.length == N_BLOCKS


@settings(max_examples=300, deadline=None)
@given(st.integers(0, N_BLOCKS), st.lists(messages, min_size=1, max_size=10))
def test_follower_stores_nothing_unverified(have: int, msgs: list[M.Message]) -> None:
    # the follower holds `have` blocks, verified from an honest writer ...
    partial = MemoryArchive.create(KP)
    for i in range(have):
        partial.append(b"block %d" % i)
    sink = MemoryArchive(KP.public_key)
    client = Connection(initiator=True)
    client.follow(SRC.key, sink)
    _pump(client, Connection(initiator=False, lookup=lambda dk: partial))
    assert sink.frontier.length == have
    # ... then a hostile server speaks on the channel of a live follow
    victim = Connection(initiator=True)
    victim.follow(SRC.key, sink, live=True, have=sink.frontier.copy(), public_key=KP.public_key)
    server = Connection(initiator=False, lookup=lambda dk: SRC)
    with contextlib.suppress(RemoteProtocolError):
        _pump(victim, server)
    _attack(victim, server, msgs)
    for i, b in enumerate(sink.blocks):
        assert bytes(b) == SRC.blocks[i]  # only ever what the writer signed
    lengths = [h.length for h in sink.heads]
    assert lengths == sorted(lengths) and all(n <= N_BLOCKS for n in lengths)


def test_a_batch_inside_a_batch_is_refused() -> None:
    # each level costs three bytes: 25 KB would otherwise recurse 5,000 deep
    msg = b"\x00\x00" + encode_uint(1)
    for _ in range(5000):
        msg = b"\x00\x00" + encode_uint(0) + encode_buffer(b"\x00" + msg[2:])
    try:
        Mux().feed(msg)
    except MessageError as e:
        assert "batch inside a batch" in str(e)
    else:
        raise AssertionError("a nested batch was accepted")


def test_refused_channels_leave_no_state() -> None:
    m = Mux()
    for i in range(1, 20_001):
        for ev in m.feed(b"\x00\x01" + encode_uint(i) + encode_buffer(b"x") + b"\x00"):
            m.reject(ev.remote_id)  # type: ignore[union-attr]
    assert not m._remote and not m._pending_remote


def test_a_frame_length_is_not_memory_before_the_bytes_arrive() -> None:
    s = SecretStream(False)
    try:
        s.receive_data(b"\xff\xff\xff")  # 16 MiB announced before any handshake
    except HandshakeError:
        pass
    else:
        raise AssertionError("a 16 MiB setup frame was waited for")
    a, b = SecretStream(True), SecretStream(False)
    for _ in range(4):
        b.receive_data(a.data_to_send())
        a.receive_data(b.data_to_send())
    assert a.established and b.established
    b.receive_data(b"\xff\xff\xff" + bytes(100_000))  # 16 MiB announced, 100 KB sent
    assert len(b._rbuf) <= 2 * RECEIVE_BUFFER
    # a real frame of 5 MB still arrives whole, in any pieces, the buffer growing with it
    a2, b2 = SecretStream(True), SecretStream(False)
    for _ in range(4):
        b2.receive_data(a2.data_to_send())
        a2.receive_data(b2.data_to_send())
    a2.send(b"q" * 5_000_000)
    wire = a2.data_to_send()
    got: list[bytes] = []
    for i in range(0, len(wire), 1 << 16):
        got += b2.receive_data(wire[i : i + (1 << 16)])
        assert len(b2._rbuf) <= 3 * (i + (1 << 16)) + 2 * RECEIVE_BUFFER
    assert got == [b"q" * 5_000_000]


async def test_a_peer_that_does_not_read_stops_being_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages whose answers are sent at once (``want`` -> ``range``; ``sync``, opens)
    from a peer that never reads: the replies wait up to MAX_UNSENT bytes, then the
    server stops reading (TCP backpressure) instead of queueing without end."""
    monkeypatch.setattr(trio_driver, "MAX_UNSENT", 64 << 10)
    a, b = trio.socket.socketpair()
    for sk in (a, b):
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    server_conn = Connection(initiator=False, lookup=lambda dk: SRC)
    driver = ConnectionDriver(trio.SocketStream(a), server_conn)
    attacker = Connection(initiator=True)
    ch = attacker.follow(SRC.key, MemoryArchive(KP.public_key), live=True, window=0)
    peer = trio.SocketStream(b)
    sent = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(driver.run)
        with trio.fail_after(10):
            while not ch.opened:  # the handshake and the channel, reading as a peer does
                out = attacker.data_to_send()
                if out:
                    await peer.send_all(out)
                attacker.receive_data(await peer.receive_some(1 << 16))
        assert ch.channel is not None
        want = M.Want(0, 1).encode()
        with trio.move_on_after(3):  # then only writes: 60,000 wants, never reading
            for _ in range(60):
                attacker.mux.cork()
                for _ in range(1000):
                    attacker.mux.send(ch.channel, int(M.MessageType.WANT), want)
                attacker.mux.uncork()
                await peer.send_all(attacker.data_to_send())
                sent += 1
        await trio.sleep(0.2)
        unsent = server_conn.unsent
        nursery.cancel_scope.cancel()
    assert sent < 60, "the server kept reading a peer that reads nothing"
    assert unsent <= (64 << 10) + (256 << 10), unsent


def test_an_idle_connection_costs_kilobytes_not_a_megabyte() -> None:
    """The receive buffer is not allocated ahead of traffic: a connection that completed
    the handshake and sends nothing holds a few KiB (1 MiB each before: a thousand idle
    peers were a gigabyte); one that streams grows it to RECEIVE_BUFFER."""
    a, b = SecretStream(True), SecretStream(False)
    assert len(b._rbuf) <= 4096
    for _ in range(4):
        b.receive_data(a.data_to_send())
        a.receive_data(b.data_to_send())
    assert a.established and b.established
    assert len(a._rbuf) <= 4096 and len(b._rbuf) <= 4096
    for _ in range(64):
        a.send(bytes(60_000))
    wire = a.data_to_send()
    got = 0
    for i in range(0, len(wire), 1 << 20):
        got += len(b.receive_data(wire[i : i + (1 << 20)]))
    assert got == 64
    assert len(b._rbuf) >= RECEIVE_BUFFER


mux_frames = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 2, 3, 0xFD, 1 << 40]),  # channel ids: control, ours, others
        st.integers(0, 12),
        st.one_of(st.binary(max_size=48), messages.map(lambda m: m.encode())),
    ).map(lambda t: encode_uint(t[0]) + encode_uint(t[1]) + t[2]),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(mux_frames, st.booleans())
def test_encrypted_frames_of_anything_reach_only_typed_errors(
    frames: list[bytes], as_server: bool
) -> None:
    """Well-encrypted frames whose protomux and hypercore/alpha content is anything, on a
    connection with an opened channel, at a server and at a follower."""
    server = Connection(initiator=False, lookup=lambda dk: SRC)
    client = Connection(initiator=True)
    client.follow(SRC.key, MemoryArchive(KP.public_key), live=True)
    _pump(client, server)
    victim, attacker = (server, client) if as_server else (client, server)
    for raw in frames:
        attacker.stream.send(raw)
        try:
            victim.receive_data(attacker.stream.data_to_send())
            victim.data_to_send()
        except RemoteProtocolError:
            return


_HUGE = [
    b"\xff" + (1 << 53).to_bytes(8, "little"),
    b"\xff" * 9,
    b"\xfe\xff\xff\xff\xff",
    b"\xfd\xff\xff",
    b"\xfe\x00\x00\x10\x00",
]  # past 2**53, u64 max, u32 max, 1 Mi


@settings(max_examples=500, deadline=None)
@given(
    messages,
    st.integers(0, 200),
    st.integers(0, 7),
    st.sampled_from(_HUGE),
    st.sampled_from(["truncate", "flip", "huge", "extend"]),
)
def test_mutated_valid_messages_decode_or_raise_message_error(
    m: M.Message, at: int, bit: int, huge: bytes, how: str
) -> None:
    """Valid encodings, then cut short, a bit flipped, a varint replaced by a huge one,
    or bytes appended: a decoder returns a message or raises MessageError, never any
    other error, and never allocates for a count the bytes do not hold."""
    body = bytearray(m.encode())
    i = at % (len(body) + 1)
    if how == "truncate":
        body = body[:i]
    elif how == "flip" and body:
        body[i % len(body)] ^= 1 << bit
    elif how == "huge":
        body[i : i + 1] = huge
    else:
        body += huge
    with contextlib.suppress(MessageError):
        M.decode_message(int(m.TYPE), bytes(body))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 3),
    st.integers(0, 200),
    st.integers(0, 7),
    st.sampled_from(["flip", "truncate", "extend", "length"]),
)
def test_mutated_handshake_frames_raise_only_typed_errors(
    which: int, at: int, bit: int, how: str
) -> None:
    """A real handshake transcript with one frame changed (a bit, cut short, bytes added,
    its length prefix lying): the receiving side raises a ReplicationError or waits for
    more bytes; it never raises anything else nor completes with a tampered transcript."""
    from storage.replication.errors import ReplicationError

    a, b = SecretStream(True), SecretStream(False)
    sides = [(a, b), (b, a), (a, b), (b, a)]
    for k, (src, dst) in enumerate(sides):
        frame = bytearray(src.data_to_send())
        if k == which and frame:
            i = at % len(frame)
            if how == "flip":
                frame[i] ^= 1 << bit
            elif how == "truncate":
                frame = frame[:i]
            elif how == "extend":
                frame += bytes([bit]) * (at % 50 + 1)
            else:
                frame[0:3] = (at * 977).to_bytes(3, "little")
        try:
            dst.receive_data(bytes(frame))
        except ReplicationError:
            return
    if a.established and b.established:
        a.send(b"ping")
        try:
            # appended bytes leave the stream waiting for a frame that never completes
            assert b.receive_data(a.data_to_send()) in ([b"ping"], [])
        except ReplicationError:
            return

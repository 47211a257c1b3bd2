"""Replication sessions Python-to-Python: serve/follow, resume, live tail, a real
PartitionLog as the source, and hostile peers (wrong capability, bad proof, another
key's signature, a manifest for another key, invalid requests)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from storage.batch import build_batch
from storage.hypercore import KeyPair, Manifest, Node, sign_head
from storage.hypercore.proofs import BlockRequest, UpgradeRequest
from storage.log import FsyncPolicy, PartitionLog
from storage.replication import (
    CapabilityError,
    MemoryArchive,
    PartitionLogSource,
    RemoteProtocolError,
    ReplicationSession,
    SignedHead,
    VerificationError,
)
from storage.replication import messages as M
from storage.replication.serve import Server
from storage.replication.trio_driver import follow_archive, serve_archive

KP = KeyPair.from_seed(bytes([7]) * 32)
OTHER = KeyPair.from_seed(bytes([9]) * 32)


def _archive(n: int = 37) -> MemoryArchive:
    a = MemoryArchive.create(KP)
    for i in range(0, n, 10):
        a.append(*[bytes([(i + j) % 256]) * (100 + (i + j) % 50) for j in range(min(10, n - i))])
    return a


def _pump(a: ReplicationSession, b: ReplicationSession, rounds: int = 10_000) -> None:
    for _ in range(rounds):
        da, db = a.data_to_send(), b.data_to_send()
        if not da and not db:
            return
        if da:
            b.receive_data(da)
        if db:
            a.receive_data(db)
    raise AssertionError("sessions did not go quiet")


def _follow(src: object, sink: MemoryArchive | None = None, **kw: object) -> tuple[ReplicationSession, ReplicationSession, MemoryArchive]:
    sink = sink or MemoryArchive(KP.public_key)
    server = ReplicationSession.serve(src, initiator=False)  # type: ignore[arg-type]
    client = ReplicationSession.follow(_archive(0).key, sink, initiator=True, **kw)  # type: ignore[arg-type]
    _pump(client, server)
    return server, client, sink


def test_follow_whole_archive_sans_io() -> None:
    src = _archive()
    server, client, sink = _follow(src, window=4)
    assert client.done and sink.blocks == src.blocks
    assert sink.heads[-1] == src.head()
    assert server.closed  # the follower closed the channel when finished
    assert server.stats.blocks == 37 and client.stats.bytes == sum(map(len, src.blocks))


def test_follow_empty_archive() -> None:
    _server, client, sink = _follow(MemoryArchive.create(KP))
    assert client.done and sink.blocks == [] and sink.heads == []


def test_resume_from_verified_prefix() -> None:
    src = _archive(12)
    _s, _c, sink = _follow(src)
    src.append(b"more", b"and more")
    _s2, c2, sink2 = _follow(src, sink, have=sink.frontier.copy())
    assert sink2 is sink and sink.blocks == src.blocks and c2.stats.blocks == 2
    assert [h.length for h in sink.heads] == [12, 14]


class _Replica(MemoryArchive):
    """A sink that, as a quorum-signed archive's replica, holds blocks its leader proposed
    past what the follower delivered (`proposed`); delivered blocks that differ replace
    them, as FollowerLog.put_block does."""

    def __init__(self, proposed: list[bytes]) -> None:
        super().__init__(KP.public_key)
        self.proposed = list(proposed)

    def held_length(self) -> int:
        return len(self.blocks) + len(self.proposed)

    def holds_tree(self, start: int, length: int, roots: Sequence[Node]) -> bool:
        f = self.frontier.copy()
        if not start == len(self.blocks) <= length <= self.held_length():
            return False
        for b in self.proposed[: length - len(self.blocks)]:
            f.append_data(b)
        return f.roots() == list(roots)

    def put_block(self, index: int, value: bytes | memoryview, leaf: Node) -> None:
        self.proposed.clear()
        super().put_block(index, value, leaf)

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> None:
        while len(self.blocks) < length and self.proposed:  # adopt the held blocks
            b = self.proposed.pop(0)
            self.blocks.append(b)
            self.frontier.append_data(b)
        super().put_head(length, fork, signature, roots)


def test_a_sink_holding_the_signed_blocks_is_sent_none_of_them() -> None:
    # A quorum-signed archive's replica took the blocks in proposals before their head
    # reached its follower: the head is fetched alone, the blocks are not sent again.
    src = _archive(12)
    server, client, sink = _follow(src, _Replica(src.blocks))  # type: ignore[arg-type]
    assert client.done and sink.blocks == src.blocks and sink.heads[-1] == src.head()
    assert server.stats.blocks == 0 and client.stats.bytes == 0
    # live: the next blocks proposed, then appended and announced
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, sink, live=True, have=sink.frontier.copy())
    _pump(client, server)
    src.append(b"x" * 10, b"y" * 20, b"z")
    sink.proposed = list(src.blocks[12:])
    server.notify_append()
    _pump(client, server)
    assert sink.blocks == src.blocks and sink.heads[-1].length == 15
    assert server.stats.blocks == 0


def test_a_sink_holding_other_blocks_gets_the_signed_ones() -> None:
    # held blocks that do not make the verified tree (a deposed leader's tail) are
    # fetched as usual and replaced; so are they when the sink holds only some of them
    src = _archive(12)
    server, client, sink = _follow(src, _Replica([b"other"] * 12))  # type: ignore[arg-type]
    assert client.done and sink.blocks == src.blocks and sink.heads[-1] == src.head()
    assert server.stats.blocks == 12
    server, client, sink = _follow(src, _Replica(src.blocks[:5]))  # type: ignore[arg-type]
    assert client.done and sink.blocks == src.blocks and server.stats.blocks == 12


def test_live_follow_sees_appends() -> None:
    src = _archive(5)
    sink = MemoryArchive(KP.public_key)
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, sink, live=True)
    _pump(client, server)
    assert len(sink.blocks) == 5 and not client.done
    src.append(b"x" * 10, b"y" * 20, b"z")
    server.notify_append()
    _pump(client, server)
    assert sink.blocks == src.blocks and sink.heads[-1].length == 8


def test_server_answers_bad_requests_with_no_data() -> None:
    src = _archive(8)
    server = ReplicationSession.serve(src)
    sink = MemoryArchive(KP.public_key)
    client = ReplicationSession.follow(src.key, sink, live=True)
    _pump(client, server)
    got: list[M.Message] = []
    orig = client.role.on_message
    client.role.on_message = lambda s, m: got.append(m)  # type: ignore[method-assign]
    client.send(M.Request(900, 0, block=BlockRequest(50, 0)))  # past the end
    client.send(M.Request(901, 0, upgrade=UpgradeRequest(3, 99)))  # invalid upgrade
    client.send(M.Request(902, 5, block=BlockRequest(1, 0)))  # wrong fork
    client.send(M.Want(0, 1 << 21))
    _pump(client, server)
    client.role.on_message = orig  # type: ignore[method-assign]
    assert M.NoData(900, M.NoDataReason.NOT_AVAILABLE) in got
    assert M.NoData(901, M.NoDataReason.INVALID_REQUEST) in got
    assert M.NoData(902, M.NoDataReason.NOT_AVAILABLE) in got
    assert M.Range(0, 8) in got


# ---------------------------------------------------------------------- hostile peers


class _Tampered(MemoryArchive):
    def block(self, index: int) -> bytes:
        b = super().block(index)
        return b[:-1] + bytes([b[-1] ^ 1]) if index == 3 else b


def test_bad_block_is_rejected() -> None:
    src = _Tampered.create(KP)
    src.append(*[b"%d" % i * 50 for i in range(6)])
    with pytest.raises(VerificationError):
        _follow(src)


class _ForeignSignature(MemoryArchive):
    def head(self) -> SignedHead:
        h = super().head()
        roots = self.frontier.roots()
        # A valid signature, but by another key over the same tree.
        return dataclasses.replace(h, signature=sign_head(OTHER, self.key, roots, h.length, 0))


def test_another_keys_signature_is_rejected() -> None:
    src = _ForeignSignature.create(KP)
    src.append(b"a", b"b", b"c")
    with pytest.raises(VerificationError):
        _follow(src)


class _ForeignManifest(MemoryArchive):
    @property
    def manifest(self) -> Manifest:
        return Manifest.default(OTHER.public_key)


def test_manifest_for_another_key_is_rejected() -> None:
    src = _ForeignManifest.create(KP)
    src.append(b"a")
    with pytest.raises(VerificationError, match="manifest"):
        _follow(src)


def test_wrong_capability_is_rejected() -> None:
    # The client knows the discovery key (public) but not the archive key, so the
    # capability it sends is computed over the wrong key: the server must refuse.
    src = _archive(3)
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, MemoryArchive(KP.public_key))
    client.key = MemoryArchive.create(OTHER).key
    with pytest.raises(CapabilityError):
        _pump(client, server)
    assert server.stats.requests == 0


def test_server_lying_about_length_is_detected() -> None:
    class Liar(MemoryArchive):
        def head(self) -> SignedHead:
            h = super().head()
            return dataclasses.replace(h, length=h.length + 1)  # unsigned length

    src = Liar.create(KP)
    src.append(b"a", b"b")
    with pytest.raises((VerificationError, RemoteProtocolError)):
        _follow(src)


def test_follower_only_accepts_requested_block() -> None:
    src = _archive(4)
    server = ReplicationSession.serve(src)
    sink = MemoryArchive(KP.public_key)
    client = ReplicationSession.follow(src.key, sink, window=1)
    role = server.role
    assert isinstance(role, Server)
    orig_answer = role.answer

    def swap(s: ReplicationSession, m: M.Request) -> None:
        if m.block is not None:
            m = dataclasses.replace(m, block=BlockRequest((m.block.index + 1) % 4, m.block.nodes))
        orig_answer(s, m)

    role.answer = swap  # type: ignore[method-assign,assignment]
    with pytest.raises(VerificationError, match="another block"):
        _pump(client, server)


# ------------------------------------------------------------------------- with Trio


async def test_trio_driver_over_memory_streams() -> None:
    src = _archive(300)
    sink = MemoryArchive(KP.public_key)
    a, b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(serve_archive, a, src)
            stats = await follow_archive(b, src.key, sink, window=16)
    assert sink.blocks == src.blocks and stats.blocks == 300


async def test_trio_follower_fails_if_peer_hangs_up() -> None:
    src = _archive(30)
    a, b = trio.testing.memory_stream_pair()

    async def rude() -> None:
        s = ReplicationSession.serve(src)
        await a.send_all(s.data_to_send())
        while True:
            data = await a.receive_some(65536)
            s.receive_data(data)
            out = s.data_to_send()
            if out:
                await a.send_all(out[: len(out) // 2])  # cut mid-frame, then hang up
                await a.aclose()
                return

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(rude)
            with pytest.raises(RemoteProtocolError):
                await follow_archive(b, src.key, MemoryArchive(KP.public_key))


async def _wait_blocks(sink: MemoryArchive, n: int) -> None:
    # Polling keeps MemoryArchive free of Trio; fail_after in the caller bounds it.
    for _ in range(1000):
        if len(sink.blocks) >= n:
            return
        await trio.sleep(0.01)


async def test_live_serve_with_wait_appended() -> None:
    src = _archive(3)
    sink = MemoryArchive(KP.public_key)
    appended = trio.Event()

    async def wait() -> None:
        nonlocal appended
        await appended.wait()
        appended = trio.Event()

    a, b = trio.testing.memory_stream_pair()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(lambda: serve_archive(a, src, wait_appended=wait))
            n.start_soon(lambda: follow_archive(b, src.key, sink, live=True))
            await _wait_blocks(sink, 3)
            src.append(b"new block")
            appended.set()
            await _wait_blocks(sink, 4)
            n.cancel_scope.cancel()
    assert sink.blocks == src.blocks


# ------------------------------------------------------------------ PartitionLog source


def test_serve_partition_log(tmp_path: object) -> None:
    log = PartitionLog.open(str(tmp_path), KP, fsync=FsyncPolicy.NEVER)
    try:
        for i in range(25):
            log.append(build_batch([b"value-%d" % i] * (1 + i % 4), timestamp_ms=1000 + i))
            if i % 7 == 6:
                log.commit()
        log.commit()
        src = PartitionLogSource(log)
        assert src.key == MemoryArchive.create(KP).key
        _s, client, sink = _follow(src)
        assert client.done and len(sink.blocks) == 25
        assert b"".join(sink.blocks) == log.read_bytes(0, 1 << 30)
        assert sink.heads[-1].signature == log.head.signature  # type: ignore[union-attr]
    finally:
        log.close()


# ------------------------------------------------- what the peer holds (range / bitfield)


def test_follower_announces_stored_prefix_and_server_tracks_it() -> None:
    """A follower tells the server with a `range` what a stored head covers, on open (its
    resumed prefix) and whenever told; the server keeps Hypercore's contiguous length."""
    src = _archive(12)
    server = ReplicationSession.serve(src, initiator=False)
    client = ReplicationSession.follow(src.key, MemoryArchive(KP.public_key), initiator=True, live=True)
    _pump(client, server)
    assert server.remote_contiguous_length == 0  # it verified everything, stored nothing yet
    client.announce_stored(12)
    _pump(client, server)
    assert server.remote_contiguous_length == 12
    # resuming with a stored prefix announces it as soon as the channel opens
    sink = MemoryArchive(KP.public_key)
    _s, _c, sink = _follow(src, sink)
    server2 = ReplicationSession.serve(src, initiator=False)
    client2 = ReplicationSession.follow(src.key, sink, initiator=True, have=sink.frontier.copy(), live=True)
    _pump(client2, server2)
    assert server2.remote_contiguous_length == 12


def _server_role() -> Server:
    return Server(_archive(0))


def test_remote_ranges_as_hypercore_keeps_them() -> None:
    r = _server_role()
    r._on_range(0, 5, False)
    assert r.remote_contiguous == 5
    r._on_range(8, 2, False)  # past a gap: kept aside
    assert r.remote_contiguous == 5
    r._on_range(5, 3, False)  # fills the gap: the kept range joins the prefix
    assert r.remote_contiguous == 10
    r._on_range(0, 4, False)  # an older, shorter announcement never shrinks it
    assert r.remote_contiguous == 10
    r._on_range(6, 1, True)  # a drop inside the prefix cuts it there
    assert r.remote_contiguous == 6
    r._on_range(0, 0, False)
    assert r.remote_contiguous == 6


def test_remote_bitfield_is_the_truth_for_what_it_covers() -> None:
    r = _server_role()
    r._on_bitfield(0, (0xFFFFFFFF, 0b0111))
    assert r.remote_contiguous == 35
    r._on_bitfield(32, (0b1,))  # says block 33 is missing: the prefix ends at 33
    assert r.remote_contiguous == 33
    r._on_bitfield(64, (0xFFFFFFFF,))  # past the prefix: does not extend it
    assert r.remote_contiguous == 33


def test_range_and_bitfield_messages_reach_the_server_role() -> None:
    src = _archive(3)
    server = ReplicationSession.serve(src, initiator=False)
    client = ReplicationSession.follow(src.key, MemoryArchive(KP.public_key), initiator=True, live=True)
    _pump(client, server)
    client.send(M.Bitfield(0, (0b111,)))
    _pump(client, server)
    assert server.remote_contiguous_length == 3
    client.send(M.Range(1, 2, True))
    _pump(client, server)
    assert server.remote_contiguous_length == 1

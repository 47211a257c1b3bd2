"""Trio driver: run a `ReplicationSession` over a `trio.abc.Stream`.

Owns: `serve_archive` and `follow_archive`, the only code in this package that does
I/O. Each is one receive loop feeding the sans-I/O session plus a send after every
step; timeouts are the caller's cancel scopes. The stream is closed on exit.

May import trio, the standard library and `storage.replication`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from storage.hypercore import Frontier
from storage.replication.errors import RemoteProtocolError
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import ReplicationSession, Stats
from storage.replication.sources import ArchiveSink, ArchiveSource

RECEIVE_SIZE = 1 << 18
IOV_MAX = 512  # frames per sendmsg (Linux allows 1024)


async def send_frames(stream: trio.abc.Stream, frames: list[bytes | bytearray]) -> None:
    """Write `frames` in order: one vectored ``sendmsg`` for many frames on a socket (a
    catch-up answer is megabytes of 64 KiB frames; joining them first costs a copy and
    the page faults of a fresh multi-megabyte buffer), `send_all` each otherwise."""
    if not frames:
        return
    if not isinstance(stream, trio.SocketStream) or len(frames) == 1:
        for f in frames:
            await stream.send_all(f)
        return
    sock = stream.socket
    views = [memoryview(f) for f in frames]
    i = 0
    while i < len(views):
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            n = await sock.sendmsg(views[i : i + IOV_MAX])
        except OSError as exc:
            raise trio.BrokenResourceError from exc
        while n:  # drop what was written: whole frames, then the front of one
            k = len(views[i])
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


async def receive_into(stream: trio.abc.Stream, session: ReplicationSession) -> bool:
    """Read once from `stream` into the session; False at end of stream. On a socket the
    bytes land straight in the session's receive buffer (``recv_into``)."""
    if isinstance(stream, trio.SocketStream):
        buf = session.get_buffer()
        try:
            n = await stream.socket.recv_into(buf)
        except OSError as exc:
            raise trio.BrokenResourceError from exc
        finally:
            buf.release()
        if not n:
            return False
        session.buffer_updated(n)
        return True
    data = await stream.receive_some(RECEIVE_SIZE)
    if not data:
        return False
    session.receive_data(data)
    return True


async def _pump(stream: trio.abc.Stream, session: ReplicationSession, lock: trio.Lock) -> None:
    frames = session.buffers_to_send()
    if frames:
        async with lock:
            await send_frames(stream, frames)
        session.recycle(frames)


async def _run(stream: trio.abc.Stream, session: ReplicationSession,
               wait_appended: Callable[[], Awaitable[None]] | None = None) -> Stats:
    lock = trio.Lock()
    try:
        async with trio.open_nursery() as nursery:
            if wait_appended is not None:

                async def announcer() -> None:
                    while True:
                        await wait_appended()
                        session.notify_append()
                        await _pump(stream, session, lock)

                nursery.start_soon(announcer)
            await _pump(stream, session, lock)
            while not session.done:
                if not await receive_into(stream, session):
                    break
                await _pump(stream, session, lock)
            nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)
    return session.stats


async def serve_archive(
    stream: trio.abc.Stream,
    source: ArchiveSource,
    *,
    initiator: bool = False,
    keypair: Ed25519KeyPair | None = None,
    wait_appended: Callable[[], Awaitable[None]] | None = None,
) -> Stats:
    """Serve `source` to one peer until it goes away or closes the channel.

    `wait_appended`, if given, returns when the source has a new head; the peer is then
    told (live tailing). Raises `RemoteProtocolError` if the peer misbehaves.
    """
    return await _run(stream, ReplicationSession.serve(source, initiator=initiator,
                                                       keypair=keypair), wait_appended)


async def follow_archive(
    stream: trio.abc.Stream,
    key: bytes,
    sink: ArchiveSink,
    *,
    initiator: bool = True,
    keypair: Ed25519KeyPair | None = None,
    have: Frontier | None = None,
    live: bool = False,
    window: int = 128,
) -> Stats:
    """Download and verify archive `key` from the peer into `sink`.

    Returns once every block of the peer's head is verified and delivered (or, with
    `live`, when the peer goes away). Raises `RemoteProtocolError` (e.g.
    `VerificationError`) if the peer sends anything that does not verify, and also if
    it hangs up before we have its head.
    """
    session = ReplicationSession.follow(key, sink, initiator=initiator, keypair=keypair,
                                        have=have, live=live, window=window)
    stats = await _run(stream, session)
    if not live and not session.done:
        raise RemoteProtocolError("peer closed the connection before the archive was complete")
    return stats

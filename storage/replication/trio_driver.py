"""Trio driver: run a replication `Connection` (or a one-archive `ReplicationSession`)
over a `trio.abc.Stream`.

Owns: `ConnectionDriver` (one connection, any number of channels: a receive loop, one
sender, and per-channel waits for the tasks that follow or serve an archive on it), and
`serve_archive` / `follow_archive` (one archive on its own connection), the only code in
this package that does I/O. Timeouts are the caller's cancel scopes. The stream is closed
on exit.

May import trio, the standard library and `storage.replication`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from storage.hypercore import Frontier
from storage.replication.errors import RemoteProtocolError
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import Connection, ReplicationChannel, ReplicationSession, Stats
from storage.replication.sources import ArchiveSink, ArchiveSource

RECEIVE_SIZE = 1 << 18
IOV_MAX = 512  # frames per sendmsg (Linux allows 1024)
SEND_BUDGET = 1 << 20  # bytes of blocks answered per write: the round-robin's turn size
MAX_QUEUED = 8192  # requests read ahead of the answers before we stop reading
MAX_UNSENT = 4 << 20  # bytes of replies waiting for the peer to read before we stop reading


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


async def receive_into(stream: trio.abc.Stream, session: Connection) -> bool:
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


class ConnectionDriver:
    """Runs one `Connection` over `stream` for the tasks that use its channels.

    `run` is the connection's life: a receive loop and a sender woken by `kick`. The
    receive loop keeps reading while the sender writes, so a request for one archive's
    live tail is queued at once and answered in the next round of the round-robin
    (`Connection.buffers_to_send`, `SEND_BUDGET` bytes a round), not after every request
    of a channel catching up; it stops reading while more than `MAX_QUEUED` requests
    wait for answers or more than `MAX_UNSENT` bytes of replies wait to be written (a
    peer that does not read what we send stops being read: TCP backpressure). `run`
    returns when the peer closes the stream and raises `RemoteProtocolError` when the
    connection (not just a channel) fails; either way every `wait` then raises
    `trio.BrokenResourceError`.

    Only the driver's own tasks write to the stream, so a channel task cancelled at any
    point (a topic deleted) never leaves half a frame behind: channel tasks change the
    sans-I/O state and call `kick`. `on_change(channels)` is called with the channels
    that were opened, got messages or closed, after every read and every write."""

    def __init__(self, stream: trio.abc.Stream, conn: Connection,
                 on_change: Callable[[list[ReplicationChannel]], None] | None = None) -> None:
        self.stream = stream
        self.conn = conn
        self.on_change = on_change
        self.dead = False
        self._waiters: dict[ReplicationChannel, trio.Event] = {}
        self._kicked = trio.Event()
        self._sending = False
        self._again = False
        self._drained = trio.Event()

    def kick(self) -> None:
        """There is something to send (the sender writes it soon)."""
        self._kicked.set()

    async def wait(self, ch: ReplicationChannel) -> None:
        """Until `ch` changes (opened, a message, closed). Raises BrokenResourceError
        when the connection is gone."""
        if self.dead:
            raise trio.BrokenResourceError("replication connection lost")
        ev = self._waiters.get(ch)
        if ev is None:
            ev = self._waiters[ch] = trio.Event()
        await ev.wait()
        if self.dead:
            raise trio.BrokenResourceError("replication connection lost")

    def _changed(self) -> None:
        changed = self.conn.take_changed()
        if not changed:
            return
        for ch in changed:
            ev = self._waiters.pop(ch, None)
            if ev is not None:
                ev.set()
        if self.on_change is not None:
            self.on_change(changed)

    async def flush(self) -> None:
        """Write what the connection has to send, answering queued requests a budget at
        a time (the connection takes the channels round-robin); if a write is already
        under way, it writes this too."""
        if self._sending:
            self._again = True
            return
        self._sending = True
        try:
            conn = self.conn
            while True:
                self._again = False
                frames = conn.buffers_to_send(SEND_BUDGET)
                self._changed()
                if frames:
                    await send_frames(self.stream, frames)
                    conn.recycle(frames)
                if conn.queued <= MAX_QUEUED and conn.unsent <= MAX_UNSENT:
                    self._drained.set()
                if not (self._again or conn.pending):
                    return
        finally:
            self._sending = False

    async def _sender(self) -> None:
        while True:
            await self._kicked.wait()
            self._kicked = trio.Event()
            await self.flush()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sender)
                self.kick()
                conn = self.conn
                while await receive_into(self.stream, conn):
                    self._changed()
                    self.kick()
                    # a peer that does not read what we send stops being read: its
                    # requests and the replies its other messages cause stay bounded
                    while conn.queued > MAX_QUEUED or conn.unsent > MAX_UNSENT:
                        self._drained = trio.Event()
                        self.kick()
                        await self._drained.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.dead = True
            waiters, self._waiters = self._waiters, {}
            for ev in waiters.values():
                ev.set()
            await trio.aclose_forcefully(self.stream)


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

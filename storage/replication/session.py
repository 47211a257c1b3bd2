"""Replication connections, sans-I/O: many archives over one stream, served or followed.

Owns: `Connection`, the per-connection state machine tying together the secret stream,
protomux and one ``hypercore/alpha`` channel per archive (id = its discovery key, each
with its own capability check), as Hypercore replicates any number of cores over one
stream; `ReplicationChannel`, one archive on it, which plays one of two roles: serving a
source (`storage.replication.serve.Server`) or following into a sink
(`storage.replication.follow.Follower`); and `ReplicationSession`, a connection with
exactly one channel (the single-archive API: tools, tests, `trio_driver`'s
`serve_archive`/`follow_archive`).

Theory of operation: bytes go in through `receive_data`, bytes to write come out of
`data_to_send`; nothing here blocks, sleeps or does I/O other than calling the
source/sink. The connection decodes protomux frames, checks each channel's capability,
queues a served channel's requests (answered round-robin across channels, for fairness)
and hands every other message to the channel's role. Which errors close one channel and
which the whole connection: see `Connection`. Like Hypercore we treat the capability as
the proof that the peer knows the archive key: the channel id (discovery key) does not
reveal it. Channels of other protomux protocols on the same connection (`open_protocol`,
`accept`) are handed to a `ProtocolHandler` (cluster mode's quorum signing,
broker/cluster/signing.py); extensions are accepted and ignored.

May import the standard library, `storage.hypercore` and
`storage.replication.{noise,secretstream,mux,messages,sources,errors,serve,follow}`;
never trio.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from storage.hypercore import (
    REPLICATE_INITIATOR_NS,
    REPLICATE_RESPONDER_NS,
    Frontier,
    Node,
    discovery_key,
)
from storage.hypercore.multisig import HeadSigner
from storage.hypercore.proofs import Proof
from storage.replication import messages as M
from storage.replication.errors import (
    CapabilityError,
    LocalProtocolError,
    MessageError,
    RemoteProtocolError,
)
from storage.replication.follow import DEFAULT_WINDOW, Follower, read_block_data
from storage.replication.mux import (
    Channel,
    ChannelClosed,
    ChannelMessage,
    ChannelOpened,
    ChannelRejected,
    Mux,
    RemoteOpen,
)
from storage.replication.noise import Ed25519KeyPair
from storage.replication.secretstream import SecretStream
from storage.replication.serve import Server
from storage.replication.sources import ArchiveSink, ArchiveSource, SignedHead

Role = Server | Follower  # what a channel does with its archive: serve it, or follow it


def capability(initiator: bool, key: bytes, handshake_hash: bytes) -> bytes:
    """caps.replicate: BLAKE2b-256(key=handshake hash, msg=NS ‖ core key)."""
    ns = REPLICATE_INITIATOR_NS if initiator else REPLICATE_RESPONDER_NS
    return hashlib.blake2b(ns + key, digest_size=32, key=handshake_hash).digest()


@dataclass
class Stats:
    blocks: int = 0
    bytes: int = 0
    requests: int = 0
    invalid_requests: int = 0



class ReplicationChannel:
    """One archive replicated on a `Connection`: a ``hypercore/alpha`` channel (id = the
    archive's discovery key) and its role, serving a source or following into a sink.
    Create with `Connection.serve` or `Connection.follow`, end with `close`.

    `closed` once either side closed it, the peer rejected it, or it failed; `error` is
    then the `RemoteProtocolError` that failed it (None for an orderly close)."""

    def __init__(self, conn: Connection, key: bytes, role: Role) -> None:
        if len(key) != 32:
            raise ValueError("archive key must be 32 bytes")
        self.conn = conn
        self.key = key
        self.discovery_key = discovery_key(key)
        self.role = role
        self.channel: Channel | None = None
        self.remote_handshake: M.Handshake | None = None
        self.closed = False
        self.error: RemoteProtocolError | None = None
        self.stats = Stats()
        self.requests: deque[M.Request] = deque()  # server: received, not yet answered

    @property
    def mux(self) -> Mux:
        return self.conn.mux

    @property
    def opened(self) -> bool:
        """Both sides opened the channel (and the peer's capability checked out)."""
        return self.channel is not None and self.channel.opened and not self.closed

    @property
    def source(self) -> ArchiveSource | None:
        """The archive a serving channel serves."""
        return self.role.source if isinstance(self.role, Server) else None

    @property
    def public_key(self) -> HeadSigner | None:
        """Follower: the signer's key (or, for a multisig archive, its manifest), once given
        or learned from a verified manifest."""
        return self.role.public_key if isinstance(self.role, Follower) else None

    @property
    def latest_head(self) -> tuple[int, int, bytes, list[Node]] | None:
        """Follower: the newest head verified so far, (length, fork, signature, roots),
        before its blocks arrive (a mirror compares it with what it stores)."""
        return self.role.latest_head if isinstance(self.role, Follower) else None

    @property
    def latest_proof(self) -> Proof | None:
        """Follower: the upgrade proof that gave `latest_head` (evidence, with `probe_at`)."""
        return self.role.latest_proof if isinstance(self.role, Follower) else None

    @property
    def remote_length(self) -> int | None:
        """Follower: the length the peer announced (None before its first sync)."""
        return self.role.remote_length if isinstance(self.role, Follower) else None

    @property
    def remote_contiguous_length(self) -> int:
        """Server: how many blocks from the start the peer says it holds (its ``range``
        and ``bitfield`` messages); 0 until it says."""
        return self.role.remote_contiguous if isinstance(self.role, Server) else 0

    @property
    def done(self) -> bool:
        """A follower that is not live has everything the peer announced, or the
        channel closed."""
        return self.closed or (isinstance(self.role, Follower) and self.role.finished)

    def announce_stored(self, length: int) -> None:
        """Follower: tell the peer we hold blocks [0, length) (a ``range`` message)."""
        if isinstance(self.role, Follower):
            self.role.stored = max(self.role.stored, length)
            if self.opened:
                self.role.announce_stored(self)

    def refetch(self, index: int) -> None:
        """Follower: fetch block `index` again (below our verified length) and hand it to
        the sink's `repair_block(index, value)` once verified (a block damaged on disk)."""
        if isinstance(self.role, Follower):
            self.role.repairs.append(index)
            if self.opened:
                self.mux.cork()
                try:
                    self.role._pump(self)
                finally:
                    self.mux.uncork()

    def notify_append(self) -> None:
        """Server: the source may have a new head; if so, tell the peer."""
        if isinstance(self.role, Server) and self.opened:
            self.role.announce(self)

    def close(self) -> None:
        self.conn.close_channel(self)

    def send(self, m: M.Message) -> None:
        if self.channel is None:
            raise LocalProtocolError("channel not open")
        self.conn.mux.send(self.channel, int(m.TYPE), m.encode())

    def send_parts(self, type_: int, parts: list[bytes | bytearray | memoryview]) -> None:
        """`send` of a message already encoded as the concatenation of `parts`."""
        if self.channel is None:
            raise LocalProtocolError("channel not open")
        self.conn.mux.send_parts(self.channel, int(type_), parts)


class ProtocolHandler:
    """A channel of another protomux protocol than ``hypercore/alpha`` on a replication
    connection (`Connection.open_protocol`, or a remote open `Connection.accept` takes):
    its messages, its opening and its closing. Called while the connection decodes;
    anything slow belongs to the caller's tasks."""

    def on_open(self, conn: Connection, channel: Channel) -> None:
        """Both sides opened the channel."""

    def on_message(self, conn: Connection, channel: Channel, type_: int, payload: bytes) -> None:
        """A message on it (the payload copied out of the transport buffer)."""

    def on_close(self, conn: Connection, channel: Channel) -> None:
        """The channel closed or was rejected (by either side, or with the connection)."""


class Connection:
    """One replication connection to one peer carrying any number of archives, as
    Hypercore does: a secret stream, protomux on it, and one ``hypercore/alpha`` channel
    per archive (id = discovery key), each with its own capability check and role.

    Open channels with `follow(key, sink, ...)` and `serve(source)` at any time (before
    the handshake completes they are opened as soon as it does); close one with
    `ReplicationChannel.close`. A channel the peer opens is served if `lookup` (given at
    construction) returns a source for its discovery key, else rejected (protomux
    ``reject``); the other channels carry on.

    Errors, two planes:

    * Channel errors close that channel only (a protomux ``close`` is sent), set its
      `error` and leave the connection and every other channel running: a capability
      that does not check out, a ``hypercore/alpha`` message that does not decode, a
      proof or signature that does not verify, a refused request for announced data,
      too many invalid requests, the peer rejecting our open. These are safe to
      contain because protomux has already framed the message: nothing about the
      stream or the other channels depends on the bad payload.
    * Connection errors raise from `receive_data` / `buffer_updated` and the caller must
      drop the connection (and with it every channel): a failed handshake, a frame that
      does not decrypt or is malformed (`FramingError`: the secretstream state is then
      out of step), a protomux frame that does not decode or reopens a live channel id
      (`MessageError` from the mux: the message boundaries or channel map can no longer
      be trusted, so no channel can be singled out). protomux destroys the stream on
      these too.

    Send side, fairness: the server role does not answer ``request``s as they arrive;
    it queues them per channel, and `buffers_to_send(budget)` answers them round-robin,
    one request per channel per round, until about `budget` bytes are out. One archive
    catching up (a window of requests queued) so delays another archive's live tail
    by about one block, not by a window of blocks. The follower side bounds its
    in-flight requests per channel (`window`).

    `take_changed()` returns the channels that received anything, were opened or closed
    since the last call (a driver wakes the tasks waiting on them)."""

    def __init__(
        self,
        *,
        initiator: bool,
        keypair: Ed25519KeyPair | None = None,
        ephemeral: Ed25519KeyPair | None = None,
        lookup: Callable[[bytes], ArchiveSource | None] | None = None,
        accept: Callable[[str, bytes | None], ProtocolHandler | None] | None = None,
    ) -> None:
        self.stream = SecretStream(initiator, keypair, ephemeral=ephemeral)
        self.mux = Mux()
        self.lookup = lookup
        # channels of other protocols (protomux carries any number beside hypercore/alpha,
        # and a stock peer rejects one it does not know): `accept` takes the peer's opens
        self.accept = accept
        self._protocols: dict[int, tuple[Channel, ProtocolHandler]] = {}  # by local id
        self._protocols_opening: list[tuple[str, bytes | None, ProtocolHandler, list[Channel]]] = []
        self.channels: dict[int, ReplicationChannel] = {}  # by our mux channel id
        self._opening: list[ReplicationChannel] = []  # waiting for the handshake
        self._ready: deque[ReplicationChannel] = deque()  # servers with queued requests
        self._changed: dict[int, ReplicationChannel] = {}  # by id()
        self._live: dict[bytes, ReplicationChannel] = {}  # not closed, by discovery key
        self.queued = 0  # requests received and not answered yet, every channel

    @property
    def initiator(self) -> bool:
        return self.stream.initiator

    @property
    def remote_public_key(self) -> bytes:
        """The peer's Noise static key (empty before the handshake completes)."""
        return self.stream.remote_public_key

    # ------------------------------------------------------------------ channels

    def follow(self, key: bytes, sink: ArchiveSink, *, live: bool = False,
               have: Frontier | None = None, public_key: HeadSigner | None = None,
               window: int = DEFAULT_WINDOW, probe_at: int | None = None,
               fork: int = 0) -> ReplicationChannel:
        """Follow archive `key` into `sink`. `have` is a verified tree the sink already
        holds (resume) on fork `fork` (the peer must be on it: we do not reorg); `live`
        keeps following new heads instead of finishing.
        `probe_at` (with no `have`): fetch the peer's signed head by an upgrade proof from
        0 to `probe_at` blocks plus the nodes that grow it to the peer's head (Hypercore's
        conflict check, replicator.js ``_checkIfConflict``), so that `latest_proof` shows
        the peer's tree at that length, bound to its signature."""
        return self._add(ReplicationChannel(
            self, key, Follower(key, sink, live, have, public_key, window, probe_at=probe_at,
                                fork=fork)))

    def serve(self, source: ArchiveSource) -> ReplicationChannel:
        """Serve `source` on a channel we open (the peer may open it first or later)."""
        return self._add(ReplicationChannel(self, source.key, Server(source)))

    def open_protocol(self, protocol: str, id: bytes | None, handler: ProtocolHandler) -> None:
        """Open a channel of another protocol (`handler` hears it; it is opened once the
        handshake completes, when it has not yet)."""
        if self.stream.handshake_complete:
            self._open_protocol(protocol, id, handler)
        else:
            self._protocols_opening.append((protocol, id, handler, []))

    def _open_protocol(self, protocol: str, id: bytes | None, handler: ProtocolHandler) -> Channel:
        mch, events = self.mux.open(protocol, id, b"")
        self._protocols[mch.local_id] = (mch, handler)
        for ev in events:
            self._on_event(ev)
        return mch

    def send_protocol(self, channel: Channel, type_: int, payload: bytes) -> None:
        """A message on a channel of another protocol (dropped once it is closed)."""
        self.mux.send(channel, type_, payload)

    def close_protocol(self, channel: Channel) -> None:
        entry = self._protocols.pop(channel.local_id, None)
        self.mux.close(channel)
        if entry is not None:
            entry[1].on_close(self, channel)

    def _add(self, ch: ReplicationChannel) -> ReplicationChannel:
        if ch.discovery_key in self._live:
            raise LocalProtocolError("a channel for this archive is open on this connection")
        self._live[ch.discovery_key] = ch
        if self.stream.handshake_complete:
            self._open(ch)
        else:
            self._opening.append(ch)
        return ch

    def _open(self, ch: ReplicationChannel) -> None:
        cap = capability(self.stream.initiator, ch.key, self.stream.handshake_hash)
        mch, events = self.mux.open(M.PROTOCOL, ch.discovery_key, M.Handshake(cap).encode())
        ch.channel = mch
        self.channels[mch.local_id] = ch
        for ev in events:
            self._on_event(ev)

    def close_channel(self, ch: ReplicationChannel, error: RemoteProtocolError | None = None) -> None:
        """Close `ch` (telling the peer); `error` says why when it failed."""
        if ch.closed:
            return
        if error is not None and ch.error is None:
            ch.error = error
        self._closed(ch)
        if ch in self._opening:
            self._opening.remove(ch)
        if ch.channel is not None:
            self.mux.close(ch.channel)

    def _closed(self, ch: ReplicationChannel) -> None:
        ch.closed = True
        self.queued -= len(ch.requests)
        ch.requests.clear()
        if self._live.get(ch.discovery_key) is ch:
            del self._live[ch.discovery_key]
        if ch.channel is not None:
            self.channels.pop(ch.channel.local_id, None)
        self._changed[id(ch)] = ch

    def take_changed(self) -> list[ReplicationChannel]:
        changed, self._changed = self._changed, {}
        return list(changed.values())

    def notify_append(self) -> None:
        """The sources may have new heads: tell the peer on every serving channel."""
        for ch in list(self.channels.values()):
            if isinstance(ch.role, Server):
                try:
                    ch.notify_append()
                except RemoteProtocolError as e:
                    self.close_channel(ch, e)

    # ------------------------------------------------------------------ I/O surface

    @property
    def pending(self) -> bool:
        """Requests are queued that the next `buffers_to_send` would answer."""
        return bool(self._ready)

    @property
    def unsent(self) -> int:
        """Bytes written by the protocol and not yet taken by `data_to_send` /
        `buffers_to_send` (answers to the peer's sync/want/open messages pile up here
        while it does not read: a driver stops reading past a bound)."""
        self._flush()
        return self.stream.unsent

    def data_to_send(self, budget: int | None = None) -> bytes:
        self._encrypt_outgoing(budget)
        return self.stream.data_to_send()

    def buffers_to_send(self, budget: int | None = None) -> list[bytes | bytearray]:
        """`data_to_send` as a list of frames, for a vectored write (`sendmsg`). With a
        `budget`, queued requests are answered until about that many bytes of blocks
        are out (`pending` says whether some are left); without, all of them."""
        self._encrypt_outgoing(budget)
        return self.stream.buffers_to_send()

    def recycle(self, frames: list[bytes | bytearray]) -> None:
        """Frames from `buffers_to_send` that are written: reuse their memory."""
        self.stream.recycle(frames)

    def _encrypt_outgoing(self, budget: int | None) -> None:
        self._flush()
        ready = self._ready
        spent = 0
        while ready and (budget is None or spent < budget):
            ch = ready.popleft()
            if ch.closed or not ch.requests:
                continue
            m = ch.requests.popleft()
            self.queued -= 1
            before = ch.stats.bytes
            role = ch.role
            assert isinstance(role, Server)  # only a served channel queues requests
            try:
                role.answer(ch, m)
            except RemoteProtocolError as e:
                self.close_channel(ch, e)
            spent += ch.stats.bytes - before + 16
            if ch.requests and not ch.closed:
                ready.append(ch)
            self._flush()

    def _flush(self) -> None:
        stream = self.stream
        for msg in self.mux.outgoing():
            if isinstance(msg, list):
                stream.send_parts(msg)
            else:
                stream.send(msg)

    def get_buffer(self) -> memoryview:
        """Read from the socket into this view (``recv_into``), release it, then call
        `buffer_updated` with the count: `receive_data` without a copy."""
        return self.stream.get_buffer()

    def buffer_updated(self, n: int) -> None:
        self._received(self.stream.buffer_updated(n))

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes read from the socket. Raises RemoteProtocolError when the whole
        connection is unusable (see the class docstring); channel errors close the
        channel and set its `error`."""
        self._received(self.stream.receive_data(data))

    def _received(self, msgs: list[bytes]) -> None:
        if self._opening and self.stream.handshake_complete:
            opening, self._opening = self._opening, []
            for ch in opening:
                self._open(ch)
        if self._protocols_opening and self.stream.handshake_complete:
            popening, self._protocols_opening = self._protocols_opening, []
            for protocol, id_, handler, _ in popening:
                self._open_protocol(protocol, id_, handler)
        for raw in msgs:
            for ev in self.mux.feed(raw):
                self._on_event(ev)

    def close(self) -> None:
        """Close every channel (the caller then closes the transport)."""
        for ch in [*self._opening, *self.channels.values()]:
            self.close_channel(ch)
        for mch, _handler in list(self._protocols.values()):
            self.close_protocol(mch)

    # ------------------------------------------------------------------ events

    def _on_event(self, ev: object) -> None:
        if isinstance(ev, RemoteOpen):
            self._on_remote_open(ev)
            return
        if not isinstance(ev, (ChannelOpened, ChannelRejected, ChannelClosed, ChannelMessage)):
            return
        entry = self._protocols.get(ev.channel.local_id)
        if entry is not None:
            self._on_protocol_event(entry[0], entry[1], ev)
            return
        ch = self.channels.get(ev.channel.local_id)
        if ch is None or ch.closed:
            return  # a channel we closed (late messages are ignored, as in protomux)
        self._changed[id(ch)] = ch
        try:
            if isinstance(ev, ChannelMessage):
                self._on_message(ch, ev)
            elif isinstance(ev, ChannelOpened):
                hs = M.decode_handshake(ev.channel.remote_handshake or b"")
                expected = capability(not self.stream.initiator, ch.key, self.stream.handshake_hash)
                if hs.capability != expected:
                    raise CapabilityError("remote sent an invalid replication capability")
                ch.remote_handshake = hs
                self.mux.cork()
                try:
                    ch.role.on_open(ch)
                finally:
                    self.mux.uncork()
            elif isinstance(ev, ChannelRejected):
                raise RemoteProtocolError("remote rejected the hypercore/alpha channel")
            else:  # ChannelClosed by the peer
                self._closed(ch)
        except RemoteProtocolError as e:
            self.close_channel(ch, e)

    def _on_protocol_event(
        self,
        mch: Channel,
        handler: ProtocolHandler,
        ev: ChannelOpened | ChannelRejected | ChannelClosed | ChannelMessage,
    ) -> None:
        if isinstance(ev, ChannelMessage):
            handler.on_message(self, mch, ev.type, bytes(ev.payload))
        elif isinstance(ev, ChannelOpened):
            handler.on_open(self, mch)
        else:  # rejected, or closed by the peer
            self._protocols.pop(mch.local_id, None)
            if isinstance(ev, ChannelRejected):
                self.mux.close(mch)
            handler.on_close(self, mch)

    def _on_remote_open(self, ev: RemoteOpen) -> None:
        if ev.protocol != M.PROTOCOL and self.accept is not None:
            handler = self.accept(ev.protocol, ev.id)
            if handler is not None:
                self._open_protocol(ev.protocol, ev.id, handler)  # pairs with theirs
                return
        source = None
        if (ev.protocol == M.PROTOCOL and ev.id is not None and self.lookup is not None
                and ev.id not in self._live):
            source = self.lookup(ev.id)
        if source is None:
            # an archive we do not serve (or another protocol, or a second open of a
            # live channel): refused, not left pending forever; the others carry on
            self.mux.reject(ev.remote_id)
            return
        ch = ReplicationChannel(self, source.key, Server(source))
        self._live[ch.discovery_key] = ch
        self._open(ch)

    def _on_message(self, ch: ReplicationChannel, ev: ChannelMessage) -> None:
        if not 0 <= ev.type < len(M.MessageType):
            return  # protomux ignores message types a channel did not register
        role = ch.role
        if ev.type == M.MessageType.DATA and isinstance(role, Follower):
            block = read_block_data(ev.payload)
            if block is not None and role.take_block(ch, *block):
                return
        m = M.decode_message(ev.type, ev.payload)
        if type(m) is M.Request and isinstance(role, Server):
            ch.stats.requests += 1
            if not ch.requests:
                self._ready.append(ch)
            ch.requests.append(m)
            self.queued += 1
            return
        self.mux.cork()
        try:
            role.on_message(ch, m)
        finally:
            self.mux.uncork()


class ReplicationSession(Connection):
    """A connection replicating one archive (the single-archive API, kept for tools and
    tests): a `Connection` with one channel. Unlike `Connection` it raises every
    error, the channel's included: with one archive, a failed channel is a failed
    connection. Create with `serve`, `serve_any` or `follow`."""

    def __init__(self, *, initiator: bool, keypair: Ed25519KeyPair | None = None,
                 ephemeral: Ed25519KeyPair | None = None,
                 lookup: Callable[[bytes], ArchiveSource | None] | None = None) -> None:
        super().__init__(initiator=initiator, keypair=keypair, ephemeral=ephemeral, lookup=lookup)
        self._ch: ReplicationChannel | None = None
        self._raised = False

    @classmethod
    def serve(cls, source: ArchiveSource, *, initiator: bool = False,  # type: ignore[override]
              keypair: Ed25519KeyPair | None = None) -> ReplicationSession:
        s = cls(initiator=initiator, keypair=keypair)
        s._ch = Connection.serve(s, source)
        return s

    @classmethod
    def serve_any(cls, lookup: Callable[[bytes], ArchiveSource | None], *,
                  initiator: bool = False,
                  keypair: Ed25519KeyPair | None = None) -> ReplicationSession:
        """Serve whichever archive the peer opens a channel for: `lookup(discovery_key)`
        returns its source, or None (the channel is rejected). One archive per session:
        the first channel the peer opens that we hold decides it, later ones are
        rejected. (The replication port serves many channels per connection with
        `Connection(lookup=...)`.)"""
        s = cls(initiator=initiator, keypair=keypair)

        def first(dk: bytes) -> ArchiveSource | None:
            return lookup(dk) if s._ch is None else None

        s.lookup = first
        return s

    @classmethod
    def follow(cls, key: bytes, sink: ArchiveSink, *, initiator: bool = True,  # type: ignore[override]
               keypair: Ed25519KeyPair | None = None, live: bool = False,
               have: Frontier | None = None, public_key: HeadSigner | None = None,
               window: int = DEFAULT_WINDOW, probe_at: int | None = None,
               fork: int = 0) -> ReplicationSession:
        """Follow archive `key` into `sink` (see `Connection.follow`)."""
        s = cls(initiator=initiator, keypair=keypair)
        s._ch = Connection.follow(s, key, sink, live=live, have=have, public_key=public_key,
                                  window=window, probe_at=probe_at, fork=fork)
        return s

    def _open(self, ch: ReplicationChannel) -> None:
        if self._ch is None:
            self._ch = ch  # serve_any: the peer's first channel we hold
        super()._open(ch)

    @property
    def channel_session(self) -> ReplicationChannel | None:
        return self._ch

    def _check(self) -> None:
        ch = self._ch
        if ch is not None and ch.error is not None and not self._raised:
            self._raised = True
            raise ch.error

    def _received(self, msgs: list[bytes]) -> None:
        super()._received(msgs)
        self._check()

    def _encrypt_outgoing(self, budget: int | None) -> None:
        super()._encrypt_outgoing(budget)
        self._check()

    # the one channel's state, as attributes of the session

    @property
    def key(self) -> bytes:
        return self._ch.key if self._ch is not None else bytes(32)

    @key.setter
    def key(self, key: bytes) -> None:
        assert self._ch is not None
        self._ch.key = key

    @property
    def discovery_key(self) -> bytes:
        return self._ch.discovery_key if self._ch is not None else discovery_key(bytes(32))

    @property
    def role(self) -> Role:
        assert self._ch is not None
        return self._ch.role

    @property
    def channel(self) -> Channel | None:
        return self._ch.channel if self._ch is not None else None

    @property
    def remote_handshake(self) -> M.Handshake | None:
        return self._ch.remote_handshake if self._ch is not None else None

    @property
    def stats(self) -> Stats:
        return self._ch.stats if self._ch is not None else Stats()

    @property
    def closed(self) -> bool:
        """Our channel is closed (either side); nothing more will flow."""
        return self._ch is not None and self._ch.closed

    @property
    def done(self) -> bool:
        return self._ch is not None and self._ch.done

    @property
    def source(self) -> ArchiveSource | None:
        """The archive a serving session serves (None until a serve_any peer chose one)."""
        return self._ch.source if self._ch is not None else None

    @property
    def public_key(self) -> HeadSigner | None:
        return self._ch.public_key if self._ch is not None else None

    @property
    def latest_head(self) -> tuple[int, int, bytes, list[Node]] | None:
        return self._ch.latest_head if self._ch is not None else None

    @property
    def latest_proof(self) -> Proof | None:
        return self._ch.latest_proof if self._ch is not None else None

    @property
    def remote_length(self) -> int | None:
        return self._ch.remote_length if self._ch is not None else None

    @property
    def remote_contiguous_length(self) -> int:
        return self._ch.remote_contiguous_length if self._ch is not None else 0

    def announce_stored(self, length: int) -> None:
        if self._ch is not None:
            self._ch.announce_stored(length)

    def refetch(self, index: int) -> None:
        if self._ch is not None:
            self._ch.refetch(index)

    def notify_append(self) -> None:
        if self._ch is not None and not self._ch.closed:
            self._ch.notify_append()
            self._check()

    def send(self, m: M.Message) -> None:
        if self._ch is None:
            raise LocalProtocolError("channel not open")
        self._ch.send(m)

    def close(self) -> None:
        if self._ch is not None:
            self._ch.close()


__all__ = ["Connection", "MessageError", "ReplicationChannel", "ReplicationSession", "SignedHead",
           "Stats", "capability"]

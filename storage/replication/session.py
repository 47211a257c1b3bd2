"""Replication connections, sans-I/O: many archives over one stream, served or followed.

Owns: `Connection`, the per-connection state machine tying together the secret stream,
protomux and one ``hypercore/alpha`` channel per archive (id = its discovery key, each
with its own capability check), as Hypercore replicates any number of cores over one
stream; `ReplicationChannel`, one archive on it; `ReplicationSession`, a connection
with exactly one channel (the single-archive API: tools, tests, `trio_driver`'s
`serve_archive`/`follow_archive`); and the two replicator roles a channel plays:

* serve (`Connection.serve(source)`, or a channel the peer opens that `lookup` finds):
  announce the signed head (``sync`` + ``range``), answer ``request`` with proofs from
  `storage.hypercore.proofs.generate_proof` (queued per channel, answered round-robin
  across channels), answer ``want`` with ``range`` (our archives are always contiguous),
  re-announce on append, and track how much the peer holds from the
  ``range``/``bitfield`` messages it sends (`remote_contiguous_length`, Hypercore's
  ``_remoteContiguousLength``: cluster mode's in-sync replicas and acks=all are built on
  it, per channel).
* follow (`Connection.follow(key, sink)`): learn the remote head from ``sync``, fetch it
  with an ``upgrade`` request (plus the manifest, which must hash to `key`), then fetch
  blocks with a window of in-flight ``request``s, verify each with
  `storage.hypercore.proofs.verify_proof` and hand them to the sink in order, each
  verified head once all blocks under it are delivered. `announce_stored(length)` tells
  the peer with a ``range`` that we now hold blocks [0, length), as a contiguous
  Hypercore peer does after storing what it downloaded (``broadcastRange``); the caller
  announces only what a stored signed head covers.

Theory of operation: bytes go in through `receive_data`, bytes to write come out of
`data_to_send`; nothing here blocks, sleeps or does I/O other than calling the
source/sink. Which errors close one channel and which the whole connection: see
`Connection`. Like Hypercore we treat the capability as the proof that the peer knows
the archive key: the channel id (discovery key) does not reveal it. Not implemented
(documented gaps): seek requests, reorgs (a newer fork that drops verified blocks; one
that keeps them is followed with `follow(..., fork=)`), multi-signer
manifests, sparse peers that lack blocks they announced, pushing unrequested blocks
(``allowPush``) and extensions (accepted and ignored). Channels of other protomux
protocols on the same connection (`open_protocol`, `accept`) are handed to a
`ProtocolHandler` (cluster mode's quorum signing, broker/cluster/signing.py).

May import the standard library, PyNaCl, `storage.errors`, `storage.hypercore` and
`storage.replication.{noise,secretstream,mux,messages,sources,errors}`; never trio.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from hashlib import blake2b

from storage.errors import BlockRemoved
from storage.hypercore import (
    REPLICATE_INITIATOR_NS,
    REPLICATE_RESPONDER_NS,
    Frontier,
    HypercoreError,
    Manifest,
    Node,
    discovery_key,
    flat_tree,
)
from storage.hypercore.encoding import Reader, encode_uint
from storage.hypercore.multisig import HeadSigner
from storage.hypercore.proofs import (
    BlockRequest,
    HashRequest,
    InvalidRequest,
    Proof,
    UpgradeRequest,
    generate_proof,
    max_missing_nodes,
    verify_proof,
)
from storage.replication import messages as M
from storage.replication.errors import (
    CapabilityError,
    LocalProtocolError,
    MessageError,
    RemoteProtocolError,
    VerificationError,
)
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
from storage.replication.sources import ArchiveSink, ArchiveSource, SignedHead

# Hypercore gives up on a peer after this many invalid requests (replicator.js).
MAX_INVALID_REQUESTS = 64
DEFAULT_WINDOW = 128
PRUNE_EVERY = 4096  # delivered blocks between prunes of the follower's verified nodes


def block_nodes(index: int, length: int) -> int:
    """How many levels of siblings to ask for with block `index` when blocks are fetched
    in order: up to its lowest ancestor that is a right child, i.e. ``ctz(index)``
    levels (0 for every odd block), capped where the tree of `length` has a root.

    Why: the proof of block ``index - 2**h`` (h = ctz(index)) went at least one level
    higher and so carried that ancestor as a sibling; the follower keeps every node it
    verified, so the rest of the path would be sent and hashed for nothing. On average
    this is one node per block instead of log2(length), on the wire, in the server's
    node reads and in our hashing. Hypercore's own requester does the same thing
    (``nodes`` = levels up to the first node it has). Should the ancestor not be known
    when the answer arrives, the follower waits for earlier answers or asks again with
    the full path."""
    if index:
        low = index & -index  # the ancestor at height ctz spans blocks [index, index + low)
        if index + low <= length:
            return low.bit_length() - 1  # a whole node: the path to it stays in the tree
    return max_missing_nodes(2 * index, length)


def encode_nodes(nodes: tuple[Node, ...]) -> bytes:
    """A proof's node list as on the wire (``uint count``, then index, size, hash each)."""
    return b"".join([encode_uint(len(nodes)),
                     *(encode_uint(n.index) + encode_uint(n.size) + n.hash for n in nodes)])


def _read_block_data(body: bytes | memoryview) -> tuple[int, int, int, memoryview, tuple[Node, ...]] | None:
    """A ``data`` message that carries a block and nothing else (flags = 1; the catch-up
    hot path) as (request, fork, index, value, nodes), the value a view into `body` (no
    copy); None for any other data message, or one that does not decode (the general
    decoder then reports it)."""
    try:
        r = Reader(body)
        if r.uint() != 1:
            return None
        request, fork, index = r.uint(), r.uint(), r.uint()
        value = r.view(r.uint())
        n = r.array_length()
        nodes = tuple(Node(r.uint(), r.uint(), r.fixed(32)) for _ in range(n))
        r.finish()
    except HypercoreError:
        return None
    return request, fork, index, value, nodes


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



class _Role:
    def on_open(self, s: ReplicationChannel) -> None:
        raise NotImplementedError

    def on_message(self, s: ReplicationChannel, m: M.Message) -> None:
        raise NotImplementedError


class ReplicationChannel:
    """One archive replicated on a `Connection`: a ``hypercore/alpha`` channel (id = the
    archive's discovery key) and its role, serving a source or following into a sink.
    Create with `Connection.serve` or `Connection.follow`, end with `close`.

    `closed` once either side closed it, the peer rejected it, or it failed; `error` is
    then the `RemoteProtocolError` that failed it (None for an orderly close)."""

    def __init__(self, conn: Connection, key: bytes, role: _Role) -> None:
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
        return self.role.source if isinstance(self.role, _Server) else None

    @property
    def public_key(self) -> HeadSigner | None:
        """Follower: the signer's key (or, for a multisig archive, its manifest), once given
        or learned from a verified manifest."""
        return self.role.public_key if isinstance(self.role, _Follower) else None

    @property
    def latest_head(self) -> tuple[int, int, bytes, list[Node]] | None:
        """Follower: the newest head verified so far, (length, fork, signature, roots),
        before its blocks arrive (a mirror compares it with what it stores)."""
        return self.role.latest_head if isinstance(self.role, _Follower) else None

    @property
    def latest_proof(self) -> Proof | None:
        """Follower: the upgrade proof that gave `latest_head` (evidence, with `probe_at`)."""
        return self.role.latest_proof if isinstance(self.role, _Follower) else None

    @property
    def remote_length(self) -> int | None:
        """Follower: the length the peer announced (None before its first sync)."""
        return self.role.remote_length if isinstance(self.role, _Follower) else None

    @property
    def remote_contiguous_length(self) -> int:
        """Server: how many blocks from the start the peer says it holds (its ``range``
        and ``bitfield`` messages); 0 until it says."""
        return self.role.remote_contiguous if isinstance(self.role, _Server) else 0

    @property
    def done(self) -> bool:
        """A follower that is not live has everything the peer announced, or the
        channel closed."""
        return self.closed or (isinstance(self.role, _Follower) and self.role.finished)

    def announce_stored(self, length: int) -> None:
        """Follower: tell the peer we hold blocks [0, length) (a ``range`` message)."""
        if isinstance(self.role, _Follower):
            self.role.stored = max(self.role.stored, length)
            if self.opened:
                self.role.announce_stored(self)

    def refetch(self, index: int) -> None:
        """Follower: fetch block `index` again (below our verified length) and hand it to
        the sink's `repair_block(index, value)` once verified (a block damaged on disk)."""
        if isinstance(self.role, _Follower):
            self.role.repairs.append(index)
            if self.opened:
                self.mux.cork()
                try:
                    self.role._pump(self)
                finally:
                    self.mux.uncork()

    def notify_append(self) -> None:
        """Server: the source may have a new head; if so, tell the peer."""
        if isinstance(self.role, _Server) and self.opened:
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
            self, key, _Follower(key, sink, live, have, public_key, window, probe_at=probe_at,
                                fork=fork)))

    def serve(self, source: ArchiveSource) -> ReplicationChannel:
        """Serve `source` on a channel we open (the peer may open it first or later)."""
        return self._add(ReplicationChannel(self, source.key, _Server(source)))

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
            if isinstance(ch.role, _Server):
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
            try:
                ch.role._on_request(ch, m)  # type: ignore[attr-defined]
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
        ch = ReplicationChannel(self, source.key, _Server(source))
        self._live[ch.discovery_key] = ch
        self._open(ch)

    def _on_message(self, ch: ReplicationChannel, ev: ChannelMessage) -> None:
        if not 0 <= ev.type < len(M.MessageType):
            return  # protomux ignores message types a channel did not register
        role = ch.role
        if ev.type == M.MessageType.DATA and isinstance(role, _Follower):
            block = _read_block_data(ev.payload)
            if block is not None and role.take_block(ch, *block):
                return
        m = M.decode_message(ev.type, ev.payload)
        if type(m) is M.Request and isinstance(role, _Server):
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
    def role(self) -> _Role:
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

# ---------------------------------------------------------------------------- server


class _Server(_Role):
    def __init__(self, source: ArchiveSource | None) -> None:
        self.source = source
        self.head = source.head() if source is not None else SignedHead(0, 0, None)
        self.remote_fork = 0
        self.remote_length = 0
        self.announced_remote: tuple[int, int] | None = None
        self.remote_contiguous = 0  # replicator.js Peer._remoteContiguousLength
        self._remote_ranges: dict[int, int] = {}  # start -> end of ranges past the prefix

    def _can_upgrade(self) -> bool:
        # replicator.js _canUpgrade: a peer at length 0 can always take an upgrade.
        if self.remote_fork != self.head.fork:
            return False
        return self.remote_length == 0 or self.remote_length < self.head.length

    def _sync(self, s: ReplicationChannel) -> None:
        self.announced_remote = (self.remote_fork, self.remote_length)
        same = self.remote_fork == self.head.fork
        s.send(M.Sync(
            fork=self.head.fork,
            length=self.head.length,
            remote_length=self.remote_length if same else 0,
            can_upgrade=self._can_upgrade(),
            uploading=True,
            downloading=False,
            has_manifest=True,
            allow_push=False,
        ))

    def on_open(self, s: ReplicationChannel) -> None:
        assert self.source is not None
        self.head = self.source.head()
        self._sync(s)
        self._held(s, 0)

    def _held(self, s: ReplicationChannel, start: int) -> None:
        """Tell the peer which blocks from `start` to our head we hold (Hypercore `range`
        messages): all of them, less the runs our cleaner removed (a `range` with drop),
        so a stock Hypercore peer never asks for those (storage/FORMAT.md section 10)."""
        length = self.head.length
        if length <= start:
            return
        s.send(M.Range(start, length - start))
        removed = getattr(self.source, "removed_runs", None)
        if removed is not None:
            for first, n in removed(length):
                if first + n > start:
                    s.send(M.Range(max(first, start), first + n - max(first, start), drop=True))

    def announce(self, s: ReplicationChannel) -> None:
        assert self.source is not None
        new = self.source.head()
        if new == self.head:
            return
        old, self.head = self.head, new
        s.mux.cork()
        self._sync(s)
        # grown on the same fork: only the new blocks (what the peer knew still holds)
        self._held(s, old.length if old.fork == new.fork and old.length <= new.length else 0)
        s.mux.uncork()

    def on_message(self, s: ReplicationChannel, m: M.Message) -> None:
        if isinstance(m, M.Sync):
            self.remote_fork, self.remote_length = m.fork, m.length
            if self.announced_remote != (m.fork, m.length):
                self._sync(s)  # acknowledge their length so they may ask for an upgrade
        elif isinstance(m, M.Request):
            s.stats.requests += 1
            self._on_request(s, m)
        elif isinstance(m, M.Want) and not isinstance(m, M.Unwant) and self.head.length:
            self._held(s, 0)
        elif isinstance(m, M.Range):
            self._on_range(m.start, m.length, m.drop)
        elif isinstance(m, M.Bitfield):
            self._on_bitfield(m.start, m.bitfield)
        # cancel/unwant/data/noData/extension need no answer from a server that answers
        # every request synchronously and downloads nothing.

    def _on_range(self, start: int, length: int, drop: bool) -> None:
        """What the peer holds, as Hypercore's onrange keeps it: a drop below the
        contiguous prefix cuts it there; a held range at or touching the prefix extends
        it (ranges further out are kept until the gap before them is filled)."""
        end = start + length
        if drop:
            if start < self.remote_contiguous:
                self.remote_contiguous = start
            self._remote_ranges = {a: b for a, b in self._remote_ranges.items() if b <= start}
            return
        if length <= 0:
            return
        if start > self.remote_contiguous:
            if len(self._remote_ranges) < 1024:  # a peer cannot make us keep unbounded state
                self._remote_ranges[start] = max(end, self._remote_ranges.get(start, 0))
            return
        self.remote_contiguous = max(self.remote_contiguous, end)
        while self._remote_ranges:
            reach = [a for a in self._remote_ranges if a <= self.remote_contiguous]
            if not reach:
                break
            for a in reach:
                self.remote_contiguous = max(self.remote_contiguous, self._remote_ranges.pop(a))

    def _on_bitfield(self, start: int, words: tuple[int, ...]) -> None:
        """A bitfield is the truth for the blocks it covers (replicator.js onbitfield):
        the contiguous prefix ends at its first unset bit, if that is within it."""
        if start < self.remote_contiguous:
            self.remote_contiguous = start
        if start != self.remote_contiguous:
            return
        run = 0
        for w in words:
            if w == 0xFFFFFFFF:
                run += 32
                continue
            run += ((~w) & (w + 1)).bit_length() - 1  # trailing ones of w
            break
        if run:
            self._on_range(start, run, False)

    @staticmethod
    def _invalid(s: ReplicationChannel, m: M.Request) -> None:
        s.stats.invalid_requests += 1
        if s.stats.invalid_requests >= MAX_INVALID_REQUESTS:
            raise RemoteProtocolError("too many invalid requests") from None
        s.send(M.NoData(m.id, M.NoDataReason.INVALID_REQUEST))

    def _on_request(self, s: ReplicationChannel, m: M.Request) -> None:
        assert self.source is not None
        head = self.head
        manifest = self.source.manifest if m.manifest else None
        if manifest is not None and m.block is None and m.hash is None and m.upgrade is None:
            s.send(M.Data(m.id, Proof(head.fork, manifest=manifest)))  # manifest alone
            return
        if m.fork != head.fork or m.seek is not None or (
            m.block is not None and m.block.index >= head.length
        ):
            if manifest is not None and m.block is None and m.hash is None and m.upgrade is None:
                s.send(M.Data(m.id, Proof(head.fork, manifest=manifest)))
            else:
                s.send(M.NoData(m.id, M.NoDataReason.NOT_AVAILABLE))
            return

        source = self.source

        def get(index: int) -> Node:
            n = source.node(index)
            if n is None:
                raise KeyError(index)
            return n

        try:
            value = self.source.block(m.block.index) if m.block is not None else None
        except BlockRemoved:
            # removed by the cleaner (storage/FORMAT.md 4a): not held, as Hypercore says of
            # a block it lacks; the leaf stays in the tree (a `hash` request gets it)
            s.send(M.NoData(m.id, M.NoDataReason.NOT_AVAILABLE))
            return
        except (KeyError, IndexError):
            self._invalid(s, m)
            return
        try:
            proof = generate_proof(
                get, head.length, head.fork, head.signature,
                block=m.block, block_value=value, hash=m.hash, upgrade=m.upgrade,
                manifest=manifest,
            )
        except (InvalidRequest, KeyError, IndexError):
            self._invalid(s, m)
            return
        if value is not None:
            s.stats.blocks += 1
            s.stats.bytes += len(value)
        b = proof.block
        if b is not None and b.value is not None and proof.hash is None and proof.upgrade is None \
                and proof.manifest is None:
            # Proof.encode's bytes, in parts: the block is copied once, into the encryption
            s.send_parts(M.MessageType.DATA, [
                b"".join((b"\x01", encode_uint(m.id), encode_uint(proof.fork),
                          encode_uint(b.index), encode_uint(len(b.value)))),
                b.value,
                encode_nodes(b.nodes),
            ])
            return
        s.send(M.Data(m.id, proof))


# -------------------------------------------------------------------------- follower


@dataclass
class _Pending:
    id: int
    block: int | None  # block index, or None for an upgrade request
    upgrade: bool
    manifest: bool
    repair: bool = False  # a block fetched again for sink.repair_block
    hole: bool = False  # the leaf node (a `hash` request) of a block the peer removed


@dataclass
class _Follower(_Role):
    key: bytes
    sink: ArchiveSink
    live: bool
    have: Frontier | None
    public_key: HeadSigner | None
    window: int
    trusted: Frontier = field(default_factory=Frontier)
    fork: int = 0
    known: dict[int, Node] = field(default_factory=dict)
    heads: list[tuple[int, int, bytes, list[Node]]] = field(default_factory=list)
    # None: a block the writer's cleaner removed, its verified leaf (sink.put_removed)
    buffered: dict[int, tuple[bytes | memoryview | None, Node]] = field(default_factory=dict)
    inflight: dict[int, _Pending] = field(default_factory=dict)
    next_id: int = 1
    next_request: int = 0
    next_deliver: int = 0
    remote_length: int | None = None
    remote_fork: int = 0
    upgrading: bool = False
    manifest_requested: bool = False
    latest_head: tuple[int, int, bytes, list[Node]] | None = None
    latest_proof: Proof | None = None
    probe_at: int | None = None  # ask for the peer's tree at this length (see follow)
    repairs: list[int] = field(default_factory=list)
    holes: list[int] = field(default_factory=list)  # removed blocks whose leaf to ask for
    # block answers whose path ends at a node an earlier answer will prove
    stalled: list[tuple[_Pending, int, memoryview, tuple[Node, ...]]] = field(default_factory=list)
    stalls: int = 0  # answers that waited for an earlier one (statistics, tests)
    retries: int = 0  # short answers asked again with the full path
    pruned_at: int = 0
    stored: int = 0  # blocks [0, stored) the sink holds under a stored signed head
    announced: int = 0  # the prefix we told the peer about with a range

    def __post_init__(self) -> None:
        if self.have is not None:
            self.stored = self.have.length
            self.trusted = self.have.copy()
            self.next_request = self.next_deliver = self.have.length
            for r in self.have.roots():
                self.known[r.index] = r

    @property
    def finished(self) -> bool:
        return (
            not self.live
            and self.remote_length is not None
            and not self.inflight
            and not self.stalled
            and self.trusted.length >= self.remote_length
            and self.next_deliver == self.trusted.length
        )

    def _sync(self, s: ReplicationChannel) -> None:
        s.send(M.Sync(
            fork=self.fork,
            length=self.trusted.length,
            remote_length=self.remote_length or 0,
            can_upgrade=False,
            uploading=False,
            downloading=True,
            has_manifest=self.public_key is not None,
            allow_push=False,
        ))

    def on_open(self, s: ReplicationChannel) -> None:
        self._sync(s)
        self.announce_stored(s)  # replicator.js onopen: broadcastRange(0, contiguous)

    def announce_stored(self, s: ReplicationChannel) -> None:
        if self.stored > self.announced:
            s.send(M.Range(0, self.stored))  # a fully contiguous peer always sends from 0
            self.announced = self.stored

    def on_message(self, s: ReplicationChannel, m: M.Message) -> None:
        if isinstance(m, M.Sync):
            if m.fork != self.fork:
                if self.trusted.length:
                    raise VerificationError(
                        f"peer is on fork {m.fork}, we verified fork {self.fork}; reorgs unsupported")
                self.fork = m.fork
            self.remote_fork, self.remote_length = m.fork, m.length
        elif isinstance(m, M.Data):
            self._on_data(s, m)
        elif isinstance(m, M.NoData):
            p = self.inflight.get(m.request)
            if p is not None:
                if not self._removed(p, m.reason):
                    raise RemoteProtocolError(
                        f"peer refused request {m.request} (reason {m.reason}) for data it announced")
                del self.inflight[m.request]
        self._pump(s)
        if self.finished:
            s.close()

    def _removed(self, p: _Pending, reason: int) -> bool:
        """A block request the writer answered `not available`: a block its cleaner removed
        (storage/FORMAT.md 4a). A sink that records such holes (`put_removed`) gets the
        block's leaf instead, from a `hash` request proven against the signed tree; the
        upgrade it rode along with is asked for again alone. Any other sink cannot go on."""
        if (reason != M.NoDataReason.NOT_AVAILABLE or p.block is None or p.manifest or p.repair
                or p.hole or getattr(self.sink, "put_removed", None) is None):
            return False
        if p.upgrade:
            self.upgrading = False
        self.holes.append(p.block)
        self.holes.sort()
        return True

    def _request(self, s: ReplicationChannel, p: _Pending, req: M.Request) -> None:
        self.inflight[p.id] = p
        s.send(req)

    def _pump(self, s: ReplicationChannel) -> None:
        if self.remote_length is None:
            return
        if (self.public_key is None and self.remote_length == 0 and not self.manifest_requested
                and not self.upgrading):
            # an empty archive sends no upgrade: ask for the manifest alone, so the sink
            # learns the signer's key (verified: the manifest hashes to the archive key)
            self.manifest_requested = True
            rid = self._id()
            self._request(s, _Pending(rid, None, False, True), M.Request(rid, self.fork, manifest=True))
        if (not self.upgrading and self.remote_length > self.trusted.length
                and self.remote_fork == self.fork):
            rid = self._id()
            need_manifest = self.public_key is None
            self.upgrading = True
            start = self.trusted.length
            # The first new block rides along (its path is part of the upgrade proof): a
            # live head of one block costs one round trip instead of two.
            first = None
            if not need_manifest and self.next_request == start and len(self.inflight) < self.window:
                first = BlockRequest(start, 0)
                self.next_request = start + 1
            upgrade_length = self.remote_length - start
            if self.probe_at and start == 0 and self.probe_at < upgrade_length:
                # the peer's roots at probe_at, then `additional_nodes` up to its head
                upgrade_length = self.probe_at
            self._request(s, _Pending(rid, start if first else None, True, need_manifest), M.Request(
                rid, self.fork, block=first,
                upgrade=UpgradeRequest(start, upgrade_length),
                manifest=need_manifest,
            ))
        length = self.trusted.length
        while self.repairs and self.repairs[0] < min(length, self.next_deliver):
            i = self.repairs.pop(0)
            rid = self._id()
            self._request(s, _Pending(rid, i, False, False, repair=True), M.Request(
                rid, self.fork, block=BlockRequest(i, max_missing_nodes(2 * i, length))))
        while self.holes and self.holes[0] < length:
            i = self.holes.pop(0)
            rid = self._id()
            self._request(s, _Pending(rid, i, False, False, hole=True), M.Request(
                rid, self.fork, hash=HashRequest(2 * i, max_missing_nodes(2 * i, length))))
        while self.next_request < length and len(self.inflight) < self.window:
            i = self.next_request
            self.next_request += 1
            rid = self._id()
            self._request(s, _Pending(rid, i, False, False), M.Request(
                rid, self.fork, block=BlockRequest(i, block_nodes(i, length))))

    def _id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        return rid

    def take_block(self, s: ReplicationChannel, request: int, fork: int, index: int,
                   value: memoryview, nodes: tuple[Node, ...]) -> bool:
        """A block-only ``data`` message, decoded without copying the value: verified
        here when it answers a plain block request (True), else False and it goes
        through `_on_data` like any other message."""
        p = self.inflight.get(request)
        if (p is None or p.block is None or p.upgrade or p.manifest or p.repair or p.hole
                or self.public_key is None or fork != self.fork):
            return False
        del self.inflight[request]
        self._on_block(s, p, index, value, nodes)
        self._pump(s)
        if self.finished:
            s.close()
        return True

    def _on_data(self, s: ReplicationChannel, m: M.Data) -> None:
        p = self.inflight.pop(m.request, None)
        if p is None:
            return  # unrequested (push) or cancelled: Hypercore ignores it too
        proof = m.proof
        if proof.fork != self.fork:
            raise VerificationError(f"data for fork {proof.fork}, we are on {self.fork}")
        if p.hole:
            self._on_hole(s, p, proof)
            return
        if (p.block is not None and not p.upgrade and not p.manifest and not p.repair
                and proof.upgrade is None and proof.block is not None
                and proof.manifest is None and proof.hash is None and self.public_key is not None):
            if proof.block.value is None:
                raise VerificationError("block proof without a value")
            self._on_block(s, p, proof.block.index, memoryview(proof.block.value),
                           proof.block.nodes)
            return
        if p.manifest:
            if proof.manifest is None:
                raise VerificationError("peer did not send the manifest we asked for")
            if proof.manifest.hash() != self.key:
                raise VerificationError("manifest does not hash to the archive key")
            man = proof.manifest
            if (
                man.prologue is not None
                or man.allow_patch
                or not 1 <= man.quorum <= len(man.signers)
            ):
                raise VerificationError(
                    "manifests with a prologue, patches or no quorum are unsupported"
                )
            single = len(man.signers) == 1 and man == Manifest.default(man.signers[0].public_key)
            # a default single-signer core keeps its bare key (the path every archive of a
            # single node takes); any other manifest is checked as a whole (multisig)
            self.public_key = man.signers[0].public_key if single else man
        if self.public_key is None:
            raise VerificationError("no public key to verify against")
        if p.manifest and not p.upgrade and p.block is None:
            return  # the manifest alone (the key is all we wanted)
        if p.upgrade and proof.upgrade is None:
            raise VerificationError("peer answered an upgrade request without an upgrade")
        if p.block is not None and (proof.block is None or proof.block.index != p.block):
            raise VerificationError("peer answered with another block than requested")
        if not p.upgrade and proof.upgrade is not None:
            raise VerificationError("unrequested upgrade")
        try:
            vp = verify_proof(
                proof, public_key=self.public_key, key=self.key, fork=self.fork,
                trusted=self.trusted, trusted_node=self.known.get,
            )
        except HypercoreError as e:
            raise VerificationError(f"bad proof from peer: {e}") from e
        if p.upgrade:
            self.upgrading = False
            head = vp.head
            assert head is not None and vp.signature is not None
            self.trusted = head
            roots = head.roots()
            # every upgrade node took part in the signed tree hash: verified
            assert proof.upgrade is not None
            for n in proof.upgrade.nodes + proof.upgrade.additional_nodes:
                self.known[n.index] = n
            for r in roots:
                self.known[r.index] = r
            self.heads.append((head.length, self.fork, vp.signature, roots))
            self.latest_head = (head.length, self.fork, vp.signature, roots)
            self.latest_proof = proof
            self._sync(s)  # tell the peer our new length, as Hypercore does after upgrading
        if p.repair:
            assert proof.block is not None
            repair = getattr(self.sink, "repair_block", None)
            if repair is not None:
                repair(p.block, proof.block.value or b"")
            return
        if p.block is not None:
            assert proof.block is not None and vp.proven is not None
            if p.upgrade:
                self._keep_path(vp.proven, proof.block.nodes)
            self.buffered[p.block] = (proof.block.value or b"", vp.proven)
            s.stats.blocks += 1
            s.stats.bytes += len(proof.block.value or b"")
        self._deliver()
        self._unstall(s)

    def _on_hole(self, s: ReplicationChannel, p: _Pending, proof: Proof) -> None:
        """The leaf node of a block the writer removed, with its path up to a node we
        trust: verified, it stands for the block (its hash and size fold into the tree)."""
        assert p.block is not None
        if (proof.hash is None or proof.hash.index != 2 * p.block or proof.block is not None
                or proof.upgrade is not None or self.public_key is None):
            raise VerificationError("peer answered a hash request with another proof")
        try:
            vp = verify_proof(
                proof, public_key=self.public_key, key=self.key, fork=self.fork,
                trusted=self.trusted, trusted_node=self.known.get,
            )
        except HypercoreError as e:
            raise VerificationError(f"bad proof from peer: {e}") from e
        leaf = vp.proven
        if leaf is None or leaf.index != 2 * p.block:
            raise VerificationError("peer answered with another node than requested")
        self._keep_path(leaf, proof.hash.nodes[1:])
        self.buffered[p.block] = (None, leaf)
        self._deliver()
        self._unstall(s)

    def _on_block(self, s: ReplicationChannel, p: _Pending, index: int, value: memoryview,
                  nodes: tuple[Node, ...]) -> None:
        """A plain block answer (the catch-up hot path): hash the value once, fold the
        sibling path up to a node already verified, compare, keep the new nodes."""
        if index != p.block:
            raise VerificationError("peer answered with another block than requested")
        ite = 2 * index
        size = len(value)
        h = blake2b(b"\x00" + size.to_bytes(8, "little"), digest_size=32)
        h.update(value)
        leaf = cur = Node(ite, size, h.digest())
        path = [cur]
        for d, sib in enumerate(nodes):
            step = 2 << d
            right = (ite >> (d + 1)) & 1
            if sib.index != (ite - step if right else ite + step) or len(sib.hash) != 32:
                raise VerificationError(f"bad proof from peer: unexpected node {sib.index}")
            left_n, right_n = (sib, cur) if right else (cur, sib)
            total = left_n.size + right_n.size
            ite = ite - (step >> 1) if right else ite + (step >> 1)
            cur = Node(ite, total, blake2b(
                b"\x01" + total.to_bytes(8, "little") + left_n.hash + right_n.hash,
                digest_size=32).digest())
            path.append(sib)
            path.append(cur)
        known = self.known
        have = known.get(cur.index)
        if have is None:
            if any(q.block is not None and q.block < index for q in self.inflight.values()):
                self.stalls += 1
                self.stalled.append((p, index, value, nodes))  # an earlier answer proves its top
                return
            # nothing in flight can prove it (e.g. an upgrade moved the roots): full path
            self.retries += 1
            rid = self._id()
            self._request(s, _Pending(rid, index, False, False), M.Request(
                rid, self.fork,
                block=BlockRequest(index, max_missing_nodes(2 * index, self.trusted.length))))
            return
        if have.hash != cur.hash or have.size != cur.size:
            raise VerificationError(f"bad proof from peer: checksum mismatch at node {cur.index}")
        for n in path:
            known[n.index] = n
        self.buffered[index] = (value, leaf)
        s.stats.blocks += 1
        s.stats.bytes += size
        self._deliver()
        self._unstall(s)

    def _unstall(self, s: ReplicationChannel) -> None:
        """Answers that waited for an earlier one: try them again (that one is in)."""
        if self.stalled:
            again, self.stalled = self.stalled, []
            for q, i, v, ns in again:
                self._on_block(s, q, i, v, ns)

    def _keep_path(self, leaf: Node, siblings: tuple[Node, ...]) -> None:
        """Remember a verified block's path (its siblings and the parents they make), as
        `_on_block` does, so the next blocks' short proofs can end on it."""
        known = self.known
        cur = leaf
        known[cur.index] = cur
        for sib in siblings:
            if sib.index != flat_tree.sibling(cur.index):
                return  # not a plain path: keep what we have
            left, right = (sib, cur) if sib.index < cur.index else (cur, sib)
            total = left.size + right.size
            cur = Node(flat_tree.parent(cur.index), total, blake2b(
                b"\x01" + total.to_bytes(8, "little") + left.hash + right.hash,
                digest_size=32).digest())
            known[sib.index] = sib
            known[cur.index] = cur

    def _prune(self) -> None:
        """Forget verified nodes wholly left of every block still to come (they can
        never be a sibling or an ancestor on a later path); keep the trusted roots."""
        edge = 2 * self.next_deliver
        self.known = {i: n for i, n in self.known.items() if flat_tree.right_span(i) >= edge}
        for r in self.trusted.roots():
            self.known[r.index] = r
        self.pruned_at = self.next_deliver

    def _deliver(self) -> None:
        if self.next_deliver - self.pruned_at >= PRUNE_EVERY:
            self._prune()
        while self.next_deliver in self.buffered:
            value, leaf = self.buffered.pop(self.next_deliver)
            if value is None:
                self.sink.put_removed(self.next_deliver, leaf)  # type: ignore[attr-defined]
            else:
                self.sink.put_block(self.next_deliver, value, leaf)
            self.next_deliver += 1
        while self.heads and self.heads[0][0] <= self.next_deliver:
            length, fork, sig, roots = self.heads.pop(0)
            self.sink.put_head(length, fork, sig, roots)


__all__ = ["Connection", "MessageError", "ReplicationChannel", "ReplicationSession", "SignedHead",
           "Stats", "capability"]

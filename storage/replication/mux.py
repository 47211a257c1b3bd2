"""protomux framing: channels multiplexed over one message stream.

Owns: the byte layout of holepunchto/protomux 3.12: every transport message is
``uint channel, uint type, payload``. Channel 0 is control: type 0 = batch
(``uint channel`` then length-prefixed ``uint type ‖ payload`` items, an item of length 0
switches channel to the ``uint`` that follows), 1 = open (``uint localId, string
protocol, optionalBuffer id, handshake``), 2 = reject (``uint localId`` of the opener),
3 = close (``uint localId``). Channel ids are the *sender's* local ids, so each side
keeps a map from the remote's ids to its own channels. Integers are compact-encoding
uints.

`Mux` is sans-I/O: `open`, `send`, `close`, `reject` and `cork`/`uncork` return or queue
transport messages (`outgoing()`); `feed(message)` returns events. Like the JS it
ignores messages for channels it has closed and message types a channel does not know;
anything that does not decode raises `MessageError`.

May import only the standard library, `storage.hypercore.{encoding,errors}` and
`storage.replication.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from storage.hypercore.encoding import Reader, encode_buffer, encode_uint
from storage.hypercore.errors import HypercoreError
from storage.replication.errors import LocalProtocolError, MessageError

Buffer: TypeAlias = bytes | bytearray | memoryview

CONTROL_BATCH = 0
CONTROL_OPEN = 1
CONTROL_REJECT = 2
CONTROL_CLOSE = 3


def encode_open(local_id: int, protocol: str, id: bytes | None, handshake: bytes) -> bytes:
    return b"".join(
        (
            b"\x00\x01",
            encode_uint(local_id),
            encode_buffer(protocol.encode()),
            encode_buffer(id) if id else b"\x00",
            handshake,
        )
    )


def encode_message(local_id: int, type_: int, payload: bytes) -> bytes:
    return encode_uint(local_id) + encode_uint(type_) + payload


def encode_batch(items: list[tuple[int, int, bytes]]) -> bytes:
    """One batch frame for (local channel id, type, payload) items, in order."""
    if not items:
        raise LocalProtocolError("empty batch")
    prev = items[0][0]
    out = [b"\x00\x00", encode_uint(prev)]
    for ch, type_, payload in items:
        if ch != prev:
            out += [b"\x00", encode_uint(ch)]
            prev = ch
        out.append(encode_buffer(encode_uint(type_) + payload))
    return b"".join(out)


@dataclass
class Channel:
    protocol: str
    id: bytes | None
    local_id: int
    remote_id: int = 0
    remote_handshake: bytes | None = None  # raw bytes of the remote's open handshake
    opened: bool = False  # both sides have sent open
    closed: bool = False


@dataclass(frozen=True)
class ChannelOpened:
    channel: Channel


@dataclass(frozen=True)
class ChannelRejected:
    channel: Channel


@dataclass(frozen=True)
class ChannelClosed:
    channel: Channel
    remote: bool


@dataclass(frozen=True)
class RemoteOpen:
    """The remote opened a channel we have not opened (yet); `accept` or `reject` it."""

    remote_id: int
    protocol: str
    id: bytes | None
    handshake: bytes


@dataclass(frozen=True)
class ChannelMessage:
    channel: Channel
    type: int
    payload: bytes | memoryview  # a view into the transport message (no copy)


MuxEvent = ChannelOpened | ChannelRejected | ChannelClosed | RemoteOpen | ChannelMessage


@dataclass
class Mux:
    _local: dict[int, Channel] = field(default_factory=dict)
    _remote: dict[int, Channel | None] = field(default_factory=dict)
    _pending_remote: dict[tuple[str, bytes | None], RemoteOpen] = field(default_factory=dict)
    _next_id: int = 1
    _out: list[bytes | list[Buffer]] = field(default_factory=list)
    _batch: list[tuple[int, int, bytes | list[Buffer]]] | None = None
    _corked: int = 0

    # ------------------------------------------------------------------ output

    def outgoing(self) -> list[bytes | list[Buffer]]:
        """Transport messages queued since the last call, in order. A message sent with
        `send_parts` alone in its batch stays a list of parts (to be gathered by the
        transport, not joined here: a block is copied once, into the encryption)."""
        out, self._out = self._out, []
        return out

    def cork(self) -> None:
        if self._corked == 0:
            self._batch = []
        self._corked += 1

    def uncork(self) -> None:
        if self._corked == 0:
            raise LocalProtocolError("uncork without cork")
        self._corked -= 1
        if self._corked == 0:
            batch, self._batch = self._batch or [], None
            if len(batch) == 1:
                ch, type_, payload = batch[0]
                if isinstance(payload, list):
                    self._out.append([encode_uint(ch) + encode_uint(type_), *payload])
                else:
                    self._out.append(encode_message(ch, type_, payload))
            elif batch:
                self._out.append(encode_batch([
                    (ch, t, b"".join(p) if isinstance(p, list) else p) for ch, t, p in batch]))

    def open(self, protocol: str, id: bytes | None, handshake: bytes) -> tuple[Channel, list[MuxEvent]]:
        """Open a channel; pairs at once if the remote already opened the same one."""
        for ch in self._local.values():
            if ch.protocol == protocol and ch.id == id and not ch.closed:
                raise LocalProtocolError("channel already open")
        ch = Channel(protocol, id, self._next_id)
        self._next_id += 1
        self._local[ch.local_id] = ch
        self._control(encode_open(ch.local_id, protocol, id, handshake))
        events: list[MuxEvent] = []
        pending = self._pending_remote.pop((protocol, id), None)
        if pending is not None:
            self._pair(ch, pending.remote_id, pending.handshake)
            events.append(ChannelOpened(ch))
        return ch, events

    def _control(self, msg: bytes) -> None:
        # Control messages bypass the batch in protomux only when not corked; inside a
        # cork they are still written straight away, before the batch (protomux _write0).
        self._out.append(msg)

    def send(self, ch: Channel, type_: int, payload: bytes) -> None:
        if ch.closed:
            return  # protomux drops sends on closed channels
        if self._batch is not None:
            self._batch.append((ch.local_id, type_, payload))
        else:
            self._out.append(encode_message(ch.local_id, type_, payload))

    def send_parts(self, ch: Channel, type_: int, parts: list[Buffer]) -> None:
        """`send` of the concatenation of `parts`, without concatenating them."""
        if ch.closed:
            return
        if self._batch is not None:
            self._batch.append((ch.local_id, type_, parts))
        else:
            self._out.append([encode_uint(ch.local_id) + encode_uint(type_), *parts])

    def close(self, ch: Channel) -> None:
        if ch.closed:
            return
        self._control(b"\x00\x03" + encode_uint(ch.local_id))
        self._drop(ch)

    def reject(self, remote_id: int) -> None:
        self._control(b"\x00\x02" + encode_uint(remote_id))
        # No tombstone: messages for an id we do not map are ignored anyway, and a peer
        # opening (and being refused) channel after channel must not grow this map.
        self._remote.pop(remote_id, None)
        for k, v in list(self._pending_remote.items()):
            if v.remote_id == remote_id:
                del self._pending_remote[k]

    def _drop(self, ch: Channel) -> None:
        ch.closed = True
        self._local.pop(ch.local_id, None)
        if ch.remote_id and self._remote.get(ch.remote_id) is ch:
            del self._remote[ch.remote_id]

    def _pair(self, ch: Channel, remote_id: int, handshake: bytes) -> None:
        ch.remote_id = remote_id
        ch.remote_handshake = handshake
        ch.opened = True
        self._remote[remote_id] = ch

    # ------------------------------------------------------------------ input

    def feed(self, message: bytes | memoryview) -> list[MuxEvent]:
        """Decode one transport message into events."""
        if not message:
            return []  # protomux ignores empty frames
        events: list[MuxEvent] = []
        try:
            r = Reader(memoryview(message))
            self._decode(r.uint(), r, events)
        except HypercoreError as e:
            raise MessageError(f"bad protomux message: {e}") from e
        return events

    def _decode(self, remote_id: int, r: Reader, events: list[MuxEvent],
                batched: bool = False) -> None:
        type_ = r.uint()
        if remote_id == 0:
            if batched and type_ == CONTROL_BATCH:
                # protomux never nests batches; refusing them bounds the recursion a
                # few bytes per level would otherwise buy (RecursionError, not a typed error)
                raise MessageError("a batch inside a batch")
            self._control_in(type_, r, events)
            return
        ch = self._remote.get(remote_id)
        if ch is None:
            return  # closed or never opened: protomux ignores it
        events.append(ChannelMessage(ch, type_, r.rest_view()))

    def _control_in(self, type_: int, r: Reader, events: list[MuxEvent]) -> None:
        if type_ == CONTROL_BATCH:
            remote_id = r.uint()
            while r.remaining():
                n = r.uint()
                if n == 0:
                    remote_id = r.uint()
                    continue
                item = Reader(r.view(n))
                self._decode(remote_id, item, events, batched=True)
        elif type_ == CONTROL_OPEN:
            remote_id = r.uint()
            try:
                protocol = r.buffer().decode()
            except UnicodeDecodeError as e:
                raise MessageError("protocol name is not UTF-8") from e
            raw_id = r.buffer()
            id_ = raw_id or None
            handshake = r.fixed(r.remaining())
            if remote_id == 0:
                self.reject(0)
                return
            if self._remote.get(remote_id) is not None:
                raise MessageError(f"remote reopened channel {remote_id}")
            for ch in self._local.values():
                if ch.protocol == protocol and ch.id == id_ and not ch.opened:
                    self._pair(ch, remote_id, handshake)
                    events.append(ChannelOpened(ch))
                    return
            ro = RemoteOpen(remote_id, protocol, id_, handshake)
            self._pending_remote[(protocol, id_)] = ro
            events.append(ro)
        elif type_ == CONTROL_REJECT:
            local_id = r.uint()
            rejected = self._local.get(local_id)
            if rejected is None or rejected.opened:
                raise MessageError(f"invalid reject of channel {local_id}")
            self._drop(rejected)
            events.append(ChannelRejected(rejected))
        elif type_ == CONTROL_CLOSE:
            remote_id = r.uint()
            closing = self._remote.get(remote_id)
            if remote_id == 0 or closing is None:
                return
            self._drop(closing)
            events.append(ChannelClosed(closing, True))
        # unknown control types are ignored, as protomux does

"""The ``hypercore/alpha`` channel: handshake and the ten message types, as bytes.

Owns: encoders and strict decoders for lib/messages.js ``wire.*`` of hypercore 11.39.5
(handshake, sync, request, cancel, data, noData, want, unwant, bitfield, range,
extension). ``data`` reuses `storage.hypercore.proofs.Proof` (its codec is the wire
codec). Fields follow the JS names in snake_case. Decoders raise only `MessageError`;
they are stricter than compact-encoding in refusing trailing bytes (the pinned JS never
sends any) and, like `Proof.decode`, refuse ``seek`` proofs in ``data``.

May import only the standard library, `storage.hypercore.{encoding,proofs,errors}` and
`storage.replication.errors`.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage.hypercore.encoding import Reader, encode_buffer, encode_uint
from storage.hypercore.errors import HypercoreError
from storage.hypercore.proofs import BlockRequest, HashRequest, Proof, UpgradeRequest
from storage.replication.errors import MessageError

PROTOCOL = "hypercore/alpha"


class MessageType(enum.IntEnum):
    SYNC = 0
    REQUEST = 1
    CANCEL = 2
    DATA = 3
    NO_DATA = 4
    WANT = 5
    UNWANT = 6
    BITFIELD = 7
    RANGE = 8
    EXTENSION = 9


class NoDataReason(enum.IntEnum):
    UNKNOWN = 0
    NOT_AVAILABLE = 1
    INVALID_REQUEST = 2


def _string(s: str) -> bytes:
    return encode_buffer(s.encode())


def _read_string(r: Reader) -> str:
    try:
        return r.buffer().decode()
    except UnicodeDecodeError as e:
        raise MessageError("string is not UTF-8") from e


@dataclass(frozen=True)
class Handshake:
    capability: bytes
    seeks: bool = False

    def encode(self) -> bytes:
        if len(self.capability) != 32:
            raise ValueError("capability must be 32 bytes")
        return encode_uint(1 if self.seeks else 0) + self.capability

    @classmethod
    def read(cls, r: Reader) -> Handshake:
        flags = r.uint()
        return cls(r.fixed(32), bool(flags & 1))


@dataclass(frozen=True)
class Sync:
    fork: int
    length: int
    remote_length: int
    can_upgrade: bool = False
    uploading: bool = False
    downloading: bool = False
    has_manifest: bool = False
    allow_push: bool = False
    TYPE = MessageType.SYNC

    def encode(self) -> bytes:
        flags = (
            (1 if self.can_upgrade else 0)
            | (2 if self.uploading else 0)
            | (4 if self.downloading else 0)
            | (8 if self.has_manifest else 0)
            | (16 if self.allow_push else 0)
        )
        return b"".join(map(encode_uint, (flags, self.fork, self.length, self.remote_length)))

    @classmethod
    def read(cls, r: Reader) -> Sync:
        flags = r.uint()
        fork, length, remote = r.uint(), r.uint(), r.uint()
        return cls(
            fork,
            length,
            remote,
            bool(flags & 1),
            bool(flags & 2),
            bool(flags & 4),
            bool(flags & 8),
            bool(flags & 16),
        )


@dataclass(frozen=True)
class SeekRequest:
    bytes: int
    padding: int


@dataclass(frozen=True)
class Request:
    id: int
    fork: int
    block: BlockRequest | None = None
    hash: HashRequest | None = None
    seek: SeekRequest | None = None
    upgrade: UpgradeRequest | None = None
    manifest: bool = False
    priority: int = 0
    TYPE = MessageType.REQUEST

    def encode(self) -> bytes:
        flags = (
            (1 if self.block else 0)
            | (2 if self.hash else 0)
            | (4 if self.seek else 0)
            | (8 if self.upgrade else 0)
            | (16 if self.manifest else 0)
            | (32 if self.priority else 0)
        )
        out = [encode_uint(flags), encode_uint(self.id), encode_uint(self.fork)]
        if self.block:
            out += [encode_uint(self.block.index), encode_uint(self.block.nodes)]
        if self.hash:
            out += [encode_uint(self.hash.index), encode_uint(self.hash.nodes)]
        if self.seek:
            out += [encode_uint(self.seek.bytes), encode_uint(self.seek.padding)]
        if self.upgrade:
            out += [encode_uint(self.upgrade.start), encode_uint(self.upgrade.length)]
        if self.priority:
            out.append(encode_uint(self.priority))
        return b"".join(out)

    @classmethod
    def read(cls, r: Reader) -> Request:
        flags = r.uint()
        id_, fork = r.uint(), r.uint()
        block = BlockRequest(r.uint(), r.uint()) if flags & 1 else None
        hash_ = HashRequest(r.uint(), r.uint()) if flags & 2 else None
        seek = SeekRequest(r.uint(), r.uint()) if flags & 4 else None
        upgrade = UpgradeRequest(r.uint(), r.uint()) if flags & 8 else None
        priority = r.uint() if flags & 32 else 0
        return cls(id_, fork, block, hash_, seek, upgrade, bool(flags & 16), priority)


@dataclass(frozen=True)
class Cancel:
    request: int
    TYPE = MessageType.CANCEL

    def encode(self) -> bytes:
        return encode_uint(self.request)

    @classmethod
    def read(cls, r: Reader) -> Cancel:
        return cls(r.uint())


@dataclass(frozen=True)
class Data:
    request: int
    proof: Proof
    TYPE = MessageType.DATA

    def encode(self) -> bytes:
        return self.proof.encode(self.request)

    @classmethod
    def decode_body(cls, body: bytes | memoryview) -> Data:
        request, proof = Proof.decode(body)
        return cls(request, proof)


@dataclass(frozen=True)
class NoData:
    request: int
    reason: int = 0
    TYPE = MessageType.NO_DATA

    def encode(self) -> bytes:
        out = encode_uint(self.request) + encode_uint(1 if self.reason else 0)
        return out + (encode_uint(self.reason) if self.reason else b"")

    @classmethod
    def read(cls, r: Reader) -> NoData:
        request = r.uint()
        flags = r.uint() if r.remaining() else 0
        return cls(request, r.uint() if flags & 1 else 0)


@dataclass(frozen=True)
class Want:
    start: int
    length: int
    any: bool = False
    TYPE = MessageType.WANT

    def encode(self) -> bytes:
        out = encode_uint(self.start) + encode_uint(self.length)
        return out + (b"\x01" if self.any else b"")

    @classmethod
    def read(cls, r: Reader) -> Want:
        start, length = r.uint(), r.uint()
        flags = r.uint() if r.remaining() else 0
        return cls(start, length, bool(flags & 1))


@dataclass(frozen=True)
class Unwant(Want):
    TYPE = MessageType.UNWANT


@dataclass(frozen=True)
class Bitfield:
    start: int
    bitfield: tuple[int, ...]  # little-endian uint32 words, bit i of word w = block start+32w+i
    TYPE = MessageType.BITFIELD

    def encode(self) -> bytes:
        words = b"".join(w.to_bytes(4, "little") for w in self.bitfield)
        return encode_uint(self.start) + encode_uint(len(self.bitfield)) + words

    @classmethod
    def read(cls, r: Reader) -> Bitfield:
        start, n = r.uint(), r.array_length()
        raw = r.fixed(4 * n)
        # in C: a peer's 4 MiB bitfield took 300 ms of the event loop word by word
        return cls(start, struct.unpack(f"<{n}I", raw))


@dataclass(frozen=True)
class Range:
    start: int
    length: int
    drop: bool = False
    TYPE = MessageType.RANGE

    def encode(self) -> bytes:
        flags = (1 if self.drop else 0) | (2 if self.length == 1 else 0)
        out = encode_uint(flags) + encode_uint(self.start)
        return out if self.length == 1 else out + encode_uint(self.length)

    @classmethod
    def read(cls, r: Reader) -> Range:
        flags = r.uint()
        start = r.uint()
        length = 1 if flags & 2 else r.uint()
        return cls(start, length, bool(flags & 1))


@dataclass(frozen=True)
class Extension:
    name: str
    message: bytes
    TYPE = MessageType.EXTENSION

    def encode(self) -> bytes:
        return _string(self.name) + self.message

    @classmethod
    def read(cls, r: Reader) -> Extension:
        name = _read_string(r)
        return cls(name, r.fixed(r.remaining()))


Message = Sync | Request | Cancel | Data | NoData | Want | Unwant | Bitfield | Range | Extension

_T = TypeVar("_T")


def _strict(body: bytes | memoryview, read: Callable[[Reader], _T]) -> _T:
    try:
        r = Reader(body)
        m = read(r)
        r.finish()
    except HypercoreError as e:
        raise MessageError(str(e)) from e
    return m


_READERS: dict[int, Callable[[Reader], Message]] = {
    MessageType.SYNC: Sync.read,
    MessageType.REQUEST: Request.read,
    MessageType.CANCEL: Cancel.read,
    MessageType.NO_DATA: NoData.read,
    MessageType.WANT: Want.read,
    MessageType.UNWANT: Unwant.read,
    MessageType.BITFIELD: Bitfield.read,
    MessageType.RANGE: Range.read,
    MessageType.EXTENSION: Extension.read,
}


def decode_message(type_: int, body: bytes | memoryview) -> Message:
    """Decode a hypercore/alpha message body of protomux message type `type_`."""
    if type_ == MessageType.DATA:
        try:
            return Data.decode_body(body)
        except HypercoreError as e:
            raise MessageError(f"bad data message: {e}") from e
    reader = _READERS.get(type_)
    if reader is None:
        raise MessageError(f"unknown hypercore/alpha message type {type_}")
    return _strict(body, reader)


def decode_handshake(body: bytes) -> Handshake:
    return _strict(body, Handshake.read)

"""The KIP-848 consumer-group records of `__consumer_offsets`, in Kafka 4.x's formats.

Keys are non-flexible (an int16 version that is the record type, then int16-length
strings); values are an int16 version (0) followed by a flexible message (compact
strings and arrays, tagged fields, which we never write and skip when reading):

    3 ConsumerGroupMetadata                (group)          -> Epoch
    5 ConsumerGroupMemberMetadata          (group, member)  -> InstanceId, RackId, ClientId,
        ClientHost, SubscribedTopicNames, SubscribedTopicRegex, RebalanceTimeoutMs, ServerAssignor
    6 ConsumerGroupTargetAssignmentMetadata (group)         -> AssignmentEpoch
    7 ConsumerGroupTargetAssignmentMember  (group, member)  -> TopicPartitions
    8 ConsumerGroupCurrentMemberAssignment (group, member)  -> MemberEpoch, PreviousMemberEpoch,
        State, AssignedPartitions, PartitionsPendingRevocation

(4, ConsumerGroupPartitionMetadata, is read and ignored: the subscribed topics' metadata is
recomputed from the catalog on load.) A null value is a tombstone. Pure; only
`RecordFormatError` escapes a decoder. Imports the standard library and
broker.groups.records (for the error type).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from broker.groups.records import RecordFormatError

GROUP_METADATA = 3
PARTITION_METADATA = 4
MEMBER_METADATA = 5
TARGET_METADATA = 6
TARGET_MEMBER = 7
CURRENT_MEMBER = 8
TYPES = frozenset(
    {
        GROUP_METADATA,
        PARTITION_METADATA,
        MEMBER_METADATA,
        TARGET_METADATA,
        TARGET_MEMBER,
        CURRENT_MEMBER,
    }
)
_PER_MEMBER = frozenset({MEMBER_METADATA, TARGET_MEMBER, CURRENT_MEMBER})

Partitions = Mapping[uuid.UUID, frozenset[int]]


@dataclass(frozen=True)
class ConsumerGroupKey:
    record_type: int
    group_id: str
    member_id: str = ""  # the per-member records only


@dataclass(frozen=True)
class MemberMetadata:
    instance_id: str | None
    rack_id: str | None
    client_id: str
    client_host: str
    subscribed_topic_names: tuple[str, ...]
    subscribed_topic_regex: str | None
    rebalance_timeout_ms: int
    server_assignor: str | None
    # A member of the classic protocol in a consumer group (KIP-848 online migration):
    # (session timeout ms, its JoinGroup protocols as (name, metadata)); None otherwise.
    classic: tuple[int, tuple[tuple[str, bytes], ...]] | None = None


@dataclass(frozen=True)
class CurrentAssignment:
    member_epoch: int
    previous_member_epoch: int
    state: int
    assigned: Partitions
    pending_revocation: Partitions


# ---------------------------------------------------------------- keys


def _str16(s: str) -> bytes:
    data = s.encode("utf-8")
    if len(data) > 0x7FFF:
        raise RecordFormatError("string longer than 32767 bytes")
    return struct.pack(">h", len(data)) + data


def key(record_type: int, group_id: str, member_id: str = "") -> bytes:
    out = struct.pack(">h", record_type) + _str16(group_id)
    if record_type in _PER_MEMBER:
        out += _str16(member_id)
    return out


def decode_key(data: bytes) -> ConsumerGroupKey:
    r = _Reader(data)
    record_type = r.num(">h")
    if record_type not in TYPES:
        raise RecordFormatError(f"not a consumer group key: type {record_type}")
    group_id = r.str16()
    member_id = r.str16() if record_type in _PER_MEMBER else ""
    if r.pos != len(data):
        raise RecordFormatError("trailing bytes after a consumer group key")
    return ConsumerGroupKey(record_type, group_id, member_id)


# ---------------------------------------------------------------- values


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _cstr(s: str | None) -> bytes:
    if s is None:
        return b"\x00"
    data = s.encode("utf-8")
    return _uvarint(len(data) + 1) + data


def _partitions(parts: Partitions) -> bytes:
    out = bytearray(_uvarint(len(parts) + 1))
    for topic in sorted(parts, key=str):
        ps = sorted(parts[topic])
        out += (
            topic.bytes
            + _uvarint(len(ps) + 1)
            + b"".join(struct.pack(">i", p) for p in ps)
            + b"\x00"
        )
    return bytes(out)


_V0 = b"\x00\x00"
_NO_TAGS = b"\x00"


def group_metadata(epoch: int) -> bytes:
    return _V0 + struct.pack(">i", epoch) + _NO_TAGS


def target_metadata(assignment_epoch: int) -> bytes:
    return _V0 + struct.pack(">i", assignment_epoch) + _NO_TAGS


def member_metadata(m: MemberMetadata) -> bytes:
    out = bytearray(_V0)
    out += _cstr(m.instance_id) + _cstr(m.rack_id) + _cstr(m.client_id) + _cstr(m.client_host)
    out += _uvarint(len(m.subscribed_topic_names) + 1) + b"".join(
        _cstr(t) for t in m.subscribed_topic_names
    )
    out += (
        _cstr(m.subscribed_topic_regex)
        + struct.pack(">i", m.rebalance_timeout_ms)
        + _cstr(m.server_assignor)
    )
    if m.classic is None:
        return bytes(out + _NO_TAGS)
    # ClassicMemberMetadata: tagged field 0, a nullable struct (a 1 byte marker first).
    session_ms, protocols = m.classic
    body = bytearray(b"\x01" + struct.pack(">i", session_ms) + _uvarint(len(protocols) + 1))
    for name, metadata in protocols:
        body += _cstr(name) + _uvarint(len(metadata) + 1) + metadata + _NO_TAGS
    body += _NO_TAGS
    return bytes(out + _uvarint(1) + _uvarint(0) + _uvarint(len(body)) + body)


def target_member(assignment: Partitions) -> bytes:
    return _V0 + _partitions(assignment) + _NO_TAGS


def current_member(c: CurrentAssignment) -> bytes:
    return (
        _V0
        + struct.pack(">iib", c.member_epoch, c.previous_member_epoch, c.state)
        + _partitions(c.assigned)
        + _partitions(c.pending_revocation)
        + _NO_TAGS
    )


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def num(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise RecordFormatError("record cut short")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return int(value)

    def raw(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise RecordFormatError("record cut short")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def str16(self) -> str:
        return self._text(self.raw(self.num(">h")))

    def uvarint(self) -> int:
        n = shift = 0
        while True:
            b = self.raw(1)[0]
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                return n
            shift += 7
            if shift > 28:
                raise RecordFormatError("varint too long")

    def cstr(self) -> str | None:
        n = self.uvarint()
        return None if n == 0 else self._text(self.raw(n - 1))

    def req_cstr(self) -> str:
        s = self.cstr()
        if s is None:
            raise RecordFormatError("null where a string is required")
        return s

    def count(self) -> int:
        n = self.uvarint()
        if n == 0:
            raise RecordFormatError("null where an array is required")
        if n - 1 > len(self.data) - self.pos:  # each element takes a byte at least
            raise RecordFormatError("array longer than the record")
        return n - 1

    def partitions(self) -> dict[uuid.UUID, frozenset[int]]:
        out = {}
        for _ in range(self.count()):
            topic = uuid.UUID(bytes=self.raw(16))
            out[topic] = frozenset(self.num(">i") for _ in range(self.count()))
            self.tags()
        return out

    def tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.raw(self.uvarint())

    def end(self) -> None:
        self.tags()
        if self.pos != len(self.data):
            raise RecordFormatError("trailing bytes after a consumer group value")

    def version0(self) -> None:
        if self.num(">h") != 0:
            raise RecordFormatError("unknown consumer group value version")

    @staticmethod
    def _text(raw: bytes) -> str:
        try:
            return raw.decode("utf-8", "strict")
        except UnicodeDecodeError as exc:
            raise RecordFormatError(str(exc)) from None


def decode_epoch(data: bytes) -> int:
    """The epoch of a ConsumerGroupMetadataValue or ConsumerGroupTargetAssignmentMetadataValue."""
    r = _Reader(data)
    r.version0()
    epoch = r.num(">i")
    r.end()
    return epoch


def decode_member_metadata(data: bytes) -> MemberMetadata:
    r = _Reader(data)
    r.version0()
    instance, rack, client_id, client_host = r.cstr(), r.cstr(), r.req_cstr(), r.req_cstr()
    topics = tuple(r.req_cstr() for _ in range(r.count()))
    regex = r.cstr()
    rebalance = r.num(">i")
    assignor = r.cstr()
    classic = None
    for _ in range(r.uvarint()):
        tag, size = r.uvarint(), r.uvarint()
        field_end = r.pos + size
        if tag != 0:
            r.raw(size)
            continue
        if r.num(">b") >= 0:
            session_ms = r.num(">i")
            protocols = []
            for _ in range(r.count()):
                name = r.req_cstr()
                n = r.uvarint()
                if n == 0:
                    raise RecordFormatError("null protocol metadata")
                protocols.append((name, r.raw(n - 1)))
                r.tags()
            r.tags()
            classic = (session_ms, tuple(protocols))
        if r.pos != field_end:
            raise RecordFormatError("ClassicMemberMetadata of the wrong size")
    if r.pos != len(r.data):
        raise RecordFormatError("trailing bytes after a consumer group value")
    return MemberMetadata(
        instance, rack, client_id, client_host, topics, regex, rebalance, assignor, classic
    )


def decode_target_member(data: bytes) -> dict[uuid.UUID, frozenset[int]]:
    r = _Reader(data)
    r.version0()
    parts = r.partitions()
    r.end()
    return parts


def decode_current_member(data: bytes) -> CurrentAssignment:
    r = _Reader(data)
    r.version0()
    epoch, previous, state = r.num(">i"), r.num(">i"), r.num(">b")
    assigned, pending = r.partitions(), r.partitions()
    r.end()
    return CurrentAssignment(epoch, previous, state, assigned, pending)

"""The records of the offsets archive, in Kafka's own `__consumer_offsets` formats.

Keys (a version prefix, int16): 0/1 = OffsetCommitKey (group, topic, partition),
2 = GroupMetadataKey (group), and one of hyperkafka's own, 100 = the pending
transactional offsets of one producer in one group (`PendingKey`: group, producer id;
its value `PendingValue`: producer epoch and the offsets), which Kafka keeps as
transactional OffsetCommit records awaiting their marker; here they are one record,
replaced whole, tombstoned when the transaction's marker commits (the offsets are then
written as OffsetCommitValues in the same batch) or aborts them. Values: OffsetCommitValue v0-v3 (we write v3: offset,
leader epoch, metadata, commit timestamp; v1, with its expire timestamp, for a commit that
carried a retention time, as Kafka does) and GroupMetadataValue v0-v3 (we write v3:
protocol type, generation, protocol, leader, state timestamp, members with instance id,
client id/host, timeouts, subscription and assignment). A null value is a tombstone.
Using Kafka's layout means Kafka's own tools can read a dump of the archive, and the
archive is made of real v2 record batches, so it verifies like any partition.

Pure: encodes and decodes bytes, builds uncompressed v2 batches through
`storage.batch.build_batch`. Only `RecordFormatError` escapes a decoder. Imports the
standard library and storage.batch.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from storage import batch as storage_batch


class RecordFormatError(ValueError):
    """Bytes that are not a record of the offsets archive."""


@dataclass(frozen=True)
class OffsetKey:
    group_id: str
    topic: str
    partition: int


@dataclass(frozen=True)
class GroupKey:
    group_id: str


@dataclass(frozen=True)
class PendingKey:
    group_id: str
    producer_id: int


PENDING_KEY_VERSION = 100


@dataclass(frozen=True)
class PendingOffset:
    topic: str
    partition: int
    offset: int
    leader_epoch: int
    metadata: str


@dataclass(frozen=True)
class PendingValue:
    producer_epoch: int
    offsets: tuple[PendingOffset, ...]


@dataclass(frozen=True)
class OffsetValue:
    offset: int
    leader_epoch: int
    metadata: str
    commit_timestamp: int
    expire_timestamp: int | None = None  # only OffsetCommit v2-v4 with a retention time


@dataclass(frozen=True)
class MemberValue:
    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    rebalance_timeout_ms: int
    session_timeout_ms: int
    subscription: bytes
    assignment: bytes


@dataclass(frozen=True)
class GroupValue:
    protocol_type: str
    generation_id: int
    protocol: str | None
    leader: str | None
    current_state_timestamp: int
    members: tuple[MemberValue, ...]


# ---------------------------------------------------------------- writing


def _str(s: str | None) -> bytes:
    if s is None:
        return b"\xff\xff"
    data = s.encode("utf-8")
    if len(data) > 0x7FFF:
        raise RecordFormatError("string longer than 32767 bytes")
    return struct.pack(">h", len(data)) + data


def _bytes(b: bytes | None) -> bytes:
    if b is None:
        return b"\xff\xff\xff\xff"
    return struct.pack(">i", len(b)) + b


def offset_key(group_id: str, topic: str, partition: int) -> bytes:
    return struct.pack(">h", 1) + _str(group_id) + _str(topic) + struct.pack(">i", partition)


def group_key(group_id: str) -> bytes:
    return struct.pack(">h", 2) + _str(group_id)


def pending_key(group_id: str, producer_id: int) -> bytes:
    return struct.pack(">h", PENDING_KEY_VERSION) + _str(group_id) + struct.pack(">q", producer_id)


def pending_value(value: PendingValue) -> bytes:
    out = bytearray(struct.pack(">hhi", 0, value.producer_epoch, len(value.offsets)))
    for o in value.offsets:
        out += _str(o.topic) + struct.pack(">iqi", o.partition, o.offset, o.leader_epoch) + _str(o.metadata)
    return bytes(out)


def decode_pending_value(data: bytes) -> PendingValue:
    r = _Reader(data)
    version, epoch, count = r.take(">hhi")
    if version != 0:
        raise RecordFormatError(f"unknown pending offsets version {version}")
    if count < 0:
        raise RecordFormatError("negative count")
    offsets = []
    try:
        for _ in range(count):
            topic = r.req_string()
            partition, offset, leader_epoch = r.take(">iqi")
            offsets.append(PendingOffset(topic, partition, offset, leader_epoch, r.req_string()))
    except UnicodeDecodeError as exc:
        raise RecordFormatError(str(exc)) from None
    return PendingValue(epoch, tuple(offsets))


def offset_value(value: OffsetValue) -> bytes:
    if value.expire_timestamp is not None:
        # Kafka writes v1 exactly when a commit carries its own expiry (no leader epoch
        # there: the OffsetCommit versions that carry a retention time have none either).
        return (
            struct.pack(">hq", 1, value.offset)
            + _str(value.metadata)
            + struct.pack(">qq", value.commit_timestamp, value.expire_timestamp)
        )
    return (
        struct.pack(">hqi", 3, value.offset, value.leader_epoch)
        + _str(value.metadata)
        + struct.pack(">q", value.commit_timestamp)
    )


def group_value(value: GroupValue) -> bytes:
    out = bytearray(struct.pack(">h", 3))
    out += _str(value.protocol_type) + struct.pack(">i", value.generation_id)
    out += _str(value.protocol) + _str(value.leader) + struct.pack(">q", value.current_state_timestamp)
    out += struct.pack(">i", len(value.members))
    for m in value.members:
        out += _str(m.member_id) + _str(m.group_instance_id) + _str(m.client_id) + _str(m.client_host)
        out += struct.pack(">ii", m.rebalance_timeout_ms, m.session_timeout_ms)
        out += _bytes(m.subscription) + _bytes(m.assignment)
    return bytes(out)


# ---------------------------------------------------------------- reading


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> tuple[int, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise RecordFormatError("record cut short")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def i(self, fmt: str) -> int:
        return self.take(fmt)[0]

    def string(self, nullable: bool = False) -> str | None:
        n = self.i(">h")
        if n < 0:
            if nullable:
                return None
            raise RecordFormatError("null where a string is required")
        return self._raw(n).decode("utf-8", "strict")

    def req_string(self) -> str:
        s = self.string()
        assert s is not None
        return s

    def bytes_(self) -> bytes:
        n = self.i(">i")
        return b"" if n < 0 else self._raw(n)

    def _raw(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise RecordFormatError("record cut short")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


_KEY_HEAD = struct.Struct(">hh")  # version, length of the group id
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_OFFSET_V3_HEAD = struct.Struct(">hqih")  # version, offset, leader epoch, metadata length


def decode_key(data: bytes) -> OffsetKey | GroupKey | PendingKey:
    """A key of the archive. Replay decodes every record, so the exact-length layouts we
    write are read with a few struct calls; anything else takes `_decode_key_checked`."""
    n = len(data)
    if n >= 4:
        version, glen = _KEY_HEAD.unpack_from(data, 0)
        try:
            if version in (0, 1) and glen >= 0 and 6 + glen <= n:
                (tlen,) = _I16.unpack_from(data, 4 + glen)
                end = 6 + glen + tlen
                if tlen >= 0 and end + 4 == n:
                    return OffsetKey(data[4 : 4 + glen].decode(), data[6 + glen : end].decode(), _I32.unpack_from(data, end)[0])
            elif version == 2 and glen >= 0 and 4 + glen == n:
                return GroupKey(data[4:].decode())
        except UnicodeDecodeError:
            pass  # the checked decoder says why
    return _decode_key_checked(data)


def _decode_key_checked(data: bytes) -> OffsetKey | GroupKey | PendingKey:
    try:
        r = _Reader(data)
        version = r.i(">h")
        if version in (0, 1):
            return OffsetKey(r.req_string(), r.req_string(), r.i(">i"))
        if version == 2:
            return GroupKey(r.req_string())
        if version == PENDING_KEY_VERSION:
            key = PendingKey(r.req_string(), r.i(">q"))
            if r.pos != len(data):
                raise RecordFormatError("trailing bytes after a pending offsets key")
            return key
    except UnicodeDecodeError as exc:
        raise RecordFormatError(str(exc)) from None
    raise RecordFormatError(f"unknown key version {version}")


def decode_offset_value(data: bytes) -> OffsetValue:
    """An OffsetCommitValue; v3 of the exact length we write takes the short path."""
    n = len(data)
    if n >= _OFFSET_V3_HEAD.size + 8:
        version, offset, epoch, mlen = _OFFSET_V3_HEAD.unpack_from(data, 0)
        if version == 3 and mlen >= 0 and _OFFSET_V3_HEAD.size + mlen + 8 == n:
            try:
                metadata = data[16 : 16 + mlen].decode()
            except UnicodeDecodeError:
                pass
            else:
                return OffsetValue(offset, epoch, metadata, _I64.unpack_from(data, 16 + mlen)[0])
    return _decode_offset_value_checked(data)


def _decode_offset_value_checked(data: bytes) -> OffsetValue:
    try:
        r = _Reader(data)
        version = r.i(">h")
        if version == 0:
            offset = r.i(">q")
            metadata = r.req_string()
            return OffsetValue(offset, -1, metadata, r.i(">q"))
        if version in (1, 2):
            offset = r.i(">q")
            metadata = r.req_string()
            commit = r.i(">q")
            expire = r.i(">q") if version == 1 else -1  # v1's explicit expiry (KIP-211 keeps it)
            return OffsetValue(offset, -1, metadata, commit, None if expire == -1 else expire)
        if version == 3:
            offset, epoch = r.take(">qi")
            metadata = r.req_string()
            return OffsetValue(offset, epoch, metadata, r.i(">q"))
    except UnicodeDecodeError as exc:
        raise RecordFormatError(str(exc)) from None
    raise RecordFormatError(f"unknown offset value version {version}")


def decode_group_value(data: bytes) -> GroupValue:
    try:
        r = _Reader(data)
        version = r.i(">h")
        if not 0 <= version <= 3:
            raise RecordFormatError(f"unknown group value version {version}")
        protocol_type = r.req_string()
        generation = r.i(">i")
        protocol = r.string(nullable=True)
        leader = r.string(nullable=True)
        timestamp = r.i(">q") if version >= 2 else -1
        members = []
        for _ in range(r.i(">i")):
            member_id = r.req_string()
            instance = r.string(nullable=True) if version >= 3 else None
            client_id = r.req_string()
            client_host = r.req_string()
            rebalance = r.i(">i") if version >= 1 else -1
            session = r.i(">i")
            if version == 0:
                rebalance = session
            members.append(MemberValue(member_id, instance, client_id, client_host, rebalance, session, r.bytes_(), r.bytes_()))
        return GroupValue(protocol_type, generation, protocol, leader, timestamp, tuple(members))
    except UnicodeDecodeError as exc:
        raise RecordFormatError(str(exc)) from None


# ---------------------------------------------------------------- batches


def build_batch(records: Sequence[tuple[bytes, bytes | None]], timestamp_ms: int,
                timestamps: Sequence[int] | None = None) -> bytearray:
    """An uncompressed v2 batch of (key, value-or-tombstone) records, CRC-32C filled in,
    base offset 0 (the log assigns the real one); every record at `timestamp_ms`, or each
    at its own of `timestamps` (records copied from elsewhere keep their time)."""
    return storage_batch.build_batch(
        [value for _, value in records], keys=[key for key, _ in records], timestamp_ms=timestamp_ms,
        timestamps=timestamps,
    )

"""Bytes of transactions: `__transaction_state` records and control batches (markers).

`__transaction_state` records use Kafka's TransactionLogKey v0 and TransactionLogValue
v0 (non-flexible), so the archive reads as Kafka's own topic does:

    key   = int16 version 0, string transactional_id
    value = int16 version 0, int64 producer_id, int16 producer_epoch,
            int32 transaction_timeout_ms, int8 status, [string topic, [int32 partition]],
            int64 last_update_timestamp_ms, int64 start_timestamp_ms

One record of hyperkafka's own sits beside them: the offsets a transaction commits
(TxnOffsetCommit), written in the same batch as its PrepareCommit so that a coordinator
that restarts between PrepareCommit and CompleteCommit still has them to commit. Its
key has version 100 (Kafka's keys stop at 0), value:

    int16 version 0, int64 producer_id, int16 producer_epoch, int32 count,
    count x (string group, string topic, int32 partition, int64 offset,
             int32 leader_epoch, string metadata)

and it is deleted (a tombstone) in the batch that completes the transaction.

A control batch (a transaction marker) is a v2 batch with the transactional (bit 4) and
control (bit 5) attributes, the producer's id and epoch, no sequence, and one record:
key = int16 version 0, int16 type (0 ABORT, 1 COMMIT); value = int16 version 0, int32
coordinator epoch (Kafka's EndTransactionMarker: the epoch of the transaction
coordinator that sent it, which the partition keeps per producer id to refuse an older
coordinator's marker; `marker_coordinator_epoch`). Only the broker writes one (the
produce handler refuses them).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import crc32c

from storage.batch import build_batch

ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20
_ATTRIBUTES_AT = 21  # int16 in the v2 header; the CRC-32C (at 17) covers from here on
_CRC_AT = 17

KEY_STATE = 0
KEY_OFFSETS = 100


class MarkerType(enum.IntEnum):
    ABORT = 0
    COMMIT = 1


class Status(enum.IntEnum):
    """TransactionState ids as Kafka writes them in the log."""

    EMPTY = 0
    ONGOING = 1
    PREPARE_COMMIT = 2
    PREPARE_ABORT = 3
    COMPLETE_COMMIT = 4
    COMPLETE_ABORT = 5
    DEAD = 6
    PREPARE_EPOCH_FENCE = 7

    @property
    def kafka_name(self) -> str:
        """The name DescribeTransactions and ListTransactions use (TransactionState.stateName)."""
        return "".join(w.capitalize() for w in self.name.split("_"))


class RecordFormatError(ValueError):
    """A `__transaction_state` record that does not parse."""


@dataclass(frozen=True)
class TxnValue:
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    status: Status
    partitions: tuple[tuple[str, int], ...]
    update_ms: int
    start_ms: int


@dataclass(frozen=True)
class TxnOffset:
    group: str
    topic: str
    partition: int
    offset: int
    leader_epoch: int
    metadata: str


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack(">h", len(raw)) + raw


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        s = struct.Struct(fmt)
        if self.pos + s.size > len(self.data):
            raise RecordFormatError("record too short")
        out = s.unpack_from(self.data, self.pos)
        self.pos += s.size
        return out

    def string(self) -> str:
        (n,) = self.take(">h")
        if n < 0 or self.pos + n > len(self.data):
            raise RecordFormatError("bad string length")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise RecordFormatError("string is not UTF-8") from exc

    def count(self) -> int:
        (n,) = self.take(">i")
        if n < -1 or n > len(self.data):
            raise RecordFormatError("bad array length")
        return max(n, 0)


def state_key(transactional_id: str) -> bytes:
    return struct.pack(">h", KEY_STATE) + _str(transactional_id)


def offsets_key(transactional_id: str) -> bytes:
    return struct.pack(">h", KEY_OFFSETS) + _str(transactional_id)


def decode_key(data: bytes) -> tuple[int, str]:
    """(key kind: KEY_STATE or KEY_OFFSETS, transactional id)."""
    r = _Reader(data)
    (version,) = r.take(">h")
    if version not in (KEY_STATE, KEY_OFFSETS):
        raise RecordFormatError(f"unknown key version {version}")
    return version, r.string()


def encode_value(v: TxnValue) -> bytes:
    by_topic: dict[str, list[int]] = {}
    for topic, partition in v.partitions:
        by_topic.setdefault(topic, []).append(partition)
    out = bytearray(
        struct.pack(">hqhib", 0, v.producer_id, v.producer_epoch, v.timeout_ms, int(v.status))
    )
    out += struct.pack(">i", len(by_topic))
    for topic, parts in by_topic.items():
        out += (
            _str(topic)
            + struct.pack(">i", len(parts))
            + b"".join(struct.pack(">i", p) for p in parts)
        )
    out += struct.pack(">qq", v.update_ms, v.start_ms)
    return bytes(out)


def decode_value(data: bytes) -> TxnValue:
    r = _Reader(data)
    version, pid, epoch, timeout, status = r.take(">hqhib")
    if version not in (0, 1):
        raise RecordFormatError(f"unknown value version {version}")
    try:
        st = Status(status)
    except ValueError as exc:
        raise RecordFormatError(f"unknown transaction status {status}") from exc
    partitions = []
    for _ in range(r.count()):
        topic = r.string()
        for _ in range(r.count()):
            partitions.append((topic, r.take(">i")[0]))
    update_ms, start_ms = r.take(">qq")
    return TxnValue(pid, epoch, timeout, st, tuple(partitions), update_ms, start_ms)


def encode_offsets(producer_id: int, epoch: int, offsets: Sequence[TxnOffset]) -> bytes:
    out = bytearray(struct.pack(">hqhi", 0, producer_id, epoch, len(offsets)))
    for o in offsets:
        out += (
            _str(o.group)
            + _str(o.topic)
            + struct.pack(">iqi", o.partition, o.offset, o.leader_epoch)
            + _str(o.metadata)
        )
    return bytes(out)


def decode_offsets(data: bytes) -> tuple[int, int, list[TxnOffset]]:
    r = _Reader(data)
    version, pid, epoch = r.take(">hqh")
    if version != 0:
        raise RecordFormatError(f"unknown offsets version {version}")
    out = []
    for _ in range(r.count()):
        group, topic = r.string(), r.string()
        partition, offset, leader_epoch = r.take(">iqi")
        out.append(TxnOffset(group, topic, partition, offset, leader_epoch, r.string()))
    return pid, epoch, out


def build_state_batch(
    records: Iterable[tuple[bytes, bytes | None]], timestamp_ms: int
) -> bytearray:
    pairs = list(records)
    return build_batch([v for _, v in pairs], keys=[k for k, _ in pairs], timestamp_ms=timestamp_ms)


def control_batch(
    marker: MarkerType,
    producer_id: int,
    producer_epoch: int,
    coordinator_epoch: int,
    timestamp_ms: int,
) -> bytearray:
    """A transaction marker: a control batch of one control record, CRC-32C filled in."""
    key = struct.pack(">hh", 0, int(marker))
    value = struct.pack(">hi", 0, coordinator_epoch)
    batch = build_batch(
        [value],
        keys=[key],
        timestamp_ms=timestamp_ms,
        producer_id=producer_id,
        producer_epoch=producer_epoch,
    )
    struct.pack_into(">h", batch, _ATTRIBUTES_AT, ATTR_TRANSACTIONAL | ATTR_CONTROL)
    struct.pack_into(">I", batch, _CRC_AT, crc32c.crc32c(bytes(batch[_ATTRIBUTES_AT:])))
    return batch


def marker_type(key: bytes | None) -> MarkerType | None:
    """The type of a control record from its key (None: not a transaction marker)."""
    if key is None or len(key) < 4:
        return None
    version, kind = struct.unpack_from(">hh", key)
    if version != 0 or kind not in (0, 1):
        return None
    return MarkerType(kind)


def marker_coordinator_epoch(value: bytes | None) -> int:
    """The coordinator epoch of a control record from its value (-1: none readable, as
    Kafka's producer state has before any marker)."""
    if value is None or len(value) < 6:
        return -1
    version, epoch = struct.unpack_from(">hi", value)
    return epoch if version >= 0 else -1

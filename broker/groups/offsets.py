"""The offsets archive: committed offsets and group metadata kept in `__consumer_offsets`.

Owns the internal topic's life cycle (created through the node on first start, with time
and size retention off: only compaction may drop its segments), appending records to it as
real v2 batches (signed and verifiable like any partition), replaying it on open into a
`Replayed` snapshot that the coordinator installs, and compacting it. The topic is
internal: its name starts with "__", which the node hides from topic listings unless a
client names it.

Compaction. Kafka compacts `__consumer_offsets` by rewriting segments in place; a signed,
append-only archive cannot do that (a rewritten block would no longer match the signed
tree). So compaction here is copy-forward plus retention:

1. `live` holds the archive's last word per key (raw key and value bytes), kept up to date
   by replay and by every `append` in log order (a tombstone removes the key). It is the
   archive's view, not the coordinator's: a commit appended but not yet durable is in it.
2. When superseded records outnumber live ones (`needs_compaction`), `write_snapshot`
   starts a new segment (`PartitionLog.roll`) at offset F and appends every live record
   again, as ordinary batches of up to SNAPSHOT_BATCH_RECORDS, letting other tasks run
   between batches. Other appends may land between the batches; that is safe because each
   batch copies the values `live` holds *when it is written* (the newest ones), a key
   deleted before its turn is skipped (its tombstone is at or past F), and a key first
   written after F is past F anyway. So for every key, its last record at or past F is
   its last record in the whole log: replaying from F gives the state of the whole log.
   In cluster mode tombstones younger than the topic's ``delete.retention.ms`` (Kafka's
   default: a day) are copied forward the same way, since the other brokers' archives
   may still hold the values they deleted (a coordinator adopting that archive, `adopt`,
   needs the tombstone to delete them).
3. Once a signed head covers the snapshot, `drop_below(first)` drops every segment below
   it through the storage retention path (`PartitionLog.drop_segments_below`): the data
   and the head are fsynced first, the log start offset advances, the tree file keeps the
   nodes of the dropped blocks, so proofs for the retained blocks stay valid.

Copies keep time. Every record keeps the timestamp its coordinator wrote it with:
compaction's copies and the records a new coordinator adopts from the previous
coordinator's archive (cluster mode, `adopt`) are written with their original timestamps
(expiry reads them). Nothing orders records by those timestamps: the log does.
`read_records` and `last_words` read any offsets archive, ours or a peer's verified
copy.

Crash safety: a crash before step 3 leaves old records followed by (part of) the snapshot,
and a snapshot record only repeats the latest value of its key, so the replay gives the
same offsets; a crash during step 3 is finished by storage recovery (FORMAT.md, crash
state 13). No committed offset is lost at any point. Records that do not parse (the
topic was writable by Produce once) are not in `live` and are not carried forward.

Synchronous except `wait_durable` and `drop_below` (they wait on the commit loop and the
partition lock). Imports the node's types, storage-free helpers from
broker.protocol.records (to split and decode batches), broker.groups.records,
broker.groups.consumer_records (KIP-848 groups' records, replayed into
`Replayed.consumer_groups`) and storage.errors.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import trio

from broker.groups import consumer_records
from broker.groups.consumer_records import ConsumerGroupKey
from broker.groups.records import (
    GroupKey,
    GroupValue,
    OffsetKey,
    OffsetValue,
    PendingKey,
    PendingValue,
    RecordFormatError,
    build_batch,
    decode_group_value,
    decode_key,
    decode_offset_value,
    decode_pending_value,
)
from broker.protocol import records as batches
from broker.protocol.errors import RecordBatchError
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.node import Node, Partition
    from storage import PartitionLog

log = logging.getLogger("hyperkafka.groups")

OFFSETS_TOPIC = "__consumer_offsets"
# Time and size retention would drop live commits: only compaction drops segments here.
OFFSETS_TOPIC_CONFIGS = {"retention.ms": "-1", "retention.bytes": "-1"}
READ_CHUNK = 1 << 20
_V0, _V1 = b"\x00\x00", b"\x00\x01"
SNAPSHOT_BATCH_RECORDS = 1000
SNAPSHOT_BATCH_BYTES = 256 * 1024
DROP_ATTEMPTS = 100  # drop_below retries while a commit job is in flight


class Word(NamedTuple):
    """A key's last record in one archive: the record's timestamp (the wall-clock time the
    coordinator wrote it; copies keep it), the raw key and the value (None: a tombstone)."""

    timestamp: int
    key: bytes
    value: bytes | None


def decode_any_key(raw_key: bytes) -> OffsetKey | GroupKey | PendingKey | ConsumerGroupKey:
    """A key of the archive: classic (offsets, group metadata) or KIP-848 consumer group."""
    if len(raw_key) >= 2 and int.from_bytes(raw_key[:2], "big") in consumer_records.TYPES:
        return consumer_records.decode_key(raw_key)
    return decode_key(raw_key)


def normal_key(raw_key: bytes) -> bytes:
    """Offset keys v0 and v1 have the same layout after the version: one key."""
    return _V1 + raw_key[2:] if raw_key[:2] == _V0 else raw_key


def read_records(plog: PartitionLog, start: int | None = None, name: str = OFFSETS_TOPIC,
                 ) -> Iterator[tuple[int, int, bytes, bytes | None]]:
    """(offset, timestamp, key, value) of every keyed record of an offsets archive (ours or
    a peer's verified copy) from `start` (default: the log start) to the high watermark;
    what does not decode is logged and skipped."""
    offset = plog.log_start_offset if start is None else max(start, plog.log_start_offset)
    while offset < plog.high_watermark:
        try:
            chunk = plog.read(offset, READ_CHUNK)
        except StorageError as exc:
            # Serve the broker with what verified; storage already logged the damage.
            log.error("%s: replay stops at offset %d: %s", name, offset, exc)
            return
        data = chunk.read()
        if not data:
            break
        try:
            split = batches.split_batches(data)
        except RecordBatchError as exc:
            log.warning("%s offset %d: unreadable batches skipped: %s", name, offset, exc)
            split = []
        for batch in split:
            try:
                decoded = list(batches.iter_records(batch))
            except RecordBatchError as exc:
                log.warning("%s: skipping a batch that does not decode: %s", name, exc)
                continue
            for rec in decoded:
                if rec.key is not None and rec.offset >= offset:
                    yield rec.offset, rec.timestamp, rec.key, rec.value
        offset = chunk.end_offset


def last_words(plog: PartitionLog, start: int | None = None, name: str = OFFSETS_TOPIC) -> dict[bytes, Word]:
    """Every group key's last word in an offsets archive, tombstones included (by
    `normal_key`); records that are not group records are left out."""
    words: dict[bytes, Word] = {}
    for _, timestamp, key, value in read_records(plog, start, name):
        try:
            decode_any_key(key)
        except RecordFormatError:
            continue
        words[normal_key(key)] = Word(timestamp, key, value)
    return words


def adopt(own: Mapping[bytes, Word], previous: Mapping[bytes, Word]) -> list[Word]:
    """What a new coordinator adopts from the archive of the previous coordinator
    (`previous`, the last word per key of the broker etcd names in ``groups/coordinator``)
    over its own (`own`): every key whose last word there differs from ours. A tombstone
    is adopted only over a value (deleting what is not there changes nothing).

    Why not timestamps: offsets are ordered by the coordinators' logs and their epochs,
    never by wall clocks. One coordinator at a time writes (each act fenced by its epoch in
    etcd), and each coordinator, taking over, first writes the previous one's state into
    its own archive: so the previous coordinator's archive holds the latest word of every
    key, whatever the clocks say."""
    adopted: list[Word] = []
    for k, word in previous.items():
        mine = own.get(k)
        if mine is None:
            if word.value is not None:
                adopted.append(word)
        elif mine.value != word.value and (word.value is not None or mine.value is not None):
            adopted.append(word)
    return adopted


@dataclass
class Replayed:
    """The archive's last word per key: offsets and group metadata (tombstones applied)."""

    offsets: dict[tuple[str, str, int], tuple[OffsetValue, int]] = field(default_factory=dict)
    groups: dict[str, GroupValue] = field(default_factory=dict)
    # KIP-848 consumer groups: group id -> (record type, member id) -> value
    consumer_groups: dict[str, dict[tuple[int, str], bytes]] = field(default_factory=dict)
    # transactional offsets awaiting their transaction's marker: (group, producer id) -> them
    pending: dict[tuple[str, int], PendingValue] = field(default_factory=dict)
    records: int = 0
    skipped: int = 0

    def apply(self, record_offset: int, key: OffsetKey | GroupKey | PendingKey | ConsumerGroupKey,
              value: bytes | None) -> None:
        if isinstance(key, PendingKey):
            if value is None:
                self.pending.pop((key.group_id, key.producer_id), None)
            else:
                self.pending[(key.group_id, key.producer_id)] = decode_pending_value(value)
        elif isinstance(key, ConsumerGroupKey):
            records = self.consumer_groups.setdefault(key.group_id, {})
            if value is None:
                records.pop((key.record_type, key.member_id), None)
                if not records:
                    del self.consumer_groups[key.group_id]
            else:
                records[(key.record_type, key.member_id)] = value
        elif isinstance(key, OffsetKey):
            k = (key.group_id, key.topic, key.partition)
            if value is None:
                self.offsets.pop(k, None)
            else:
                self.offsets[k] = (decode_offset_value(value), record_offset)
        elif value is None:
            self.groups.pop(key.group_id, None)
        else:
            self.groups[key.group_id] = decode_group_value(value)


class OffsetsArchive:
    """Appends to and replays the one partition of `__consumer_offsets`."""

    def __init__(self, node: Node) -> None:
        self.node = node
        topic = node.topics.get(OFFSETS_TOPIC)
        if topic is None:
            topic = node.create_topic(OFFSETS_TOPIC, 1, -1, OFFSETS_TOPIC_CONFIGS)
            assert topic is not None
        self.partition: Partition = topic.partitions[0]
        # The archive's last word per key (`normal_key`): `live` holds the values,
        # `tombstones` the deletions not yet compacted away (the merge needs their time).
        self.live: dict[bytes, Word] = {}
        self.tombstones: dict[bytes, Word] = {}
        # Cluster mode: how long compaction keeps tombstones (None: not at all).
        self.tombstone_retention_ms: int | None = None

    def words(self) -> dict[bytes, Word]:
        """The archive's last word per key, tombstones included (`merge`'s `own`)."""
        return {**self.tombstones, **self.live}

    def replay(self) -> Replayed:
        state = Replayed()
        self.live.clear()
        self.tombstones.clear()
        for record_offset, timestamp, key, value in read_records(self.partition.log):
            try:
                decoded = decode_any_key(key)
                state.apply(record_offset, decoded, value)
                self._track(key, value, timestamp)
                state.records += 1
            except RecordFormatError as exc:
                # Not ours (the topic is writable by Produce like any other): skip it.
                state.skipped += 1
                log.warning("%s offset %d: skipping a record that does not parse: %s", OFFSETS_TOPIC, record_offset, exc)
        return state

    def _track(self, raw_key: bytes, value: bytes | None, timestamp: int) -> None:
        key = normal_key(raw_key)
        word = Word(timestamp, raw_key, value)
        if value is None:
            self.live.pop(key, None)
            self.tombstones[key] = word
        else:
            self.tombstones.pop(key, None)
            self.live[key] = word

    def holds(self, raw_key: bytes) -> bool:
        """Whether the archive's last word for this key (`records.offset_key` or
        `records.group_key` bytes) is a value, not a tombstone."""
        return raw_key in self.live

    def append(self, entries: Sequence[tuple[bytes, bytes | None]], timestamp_ms: int,
               timestamps: Sequence[int] | None = None) -> tuple[int, int]:
        """Append one batch, its records at `timestamp_ms` (or each at its own of
        `timestamps`: records copied keep their time); (base offset, last offset).
        Durable once `wait_durable(last)`."""
        partition = self.partition
        if partition.failed:
            raise OSError(partition.failed)
        base, last = partition.log.append(build_batch(entries, timestamp_ms, timestamps))
        self.node.mark_dirty(partition)
        for i, (raw_key, value) in enumerate(entries):
            self._track(raw_key, value, timestamp_ms if timestamps is None else timestamps[i])
        return base, last

    def adopt(self, words: Sequence[Word]) -> tuple[int, int] | None:
        """Append records taken from other archives (`merge`), each keeping its timestamp,
        in batches of up to SNAPSHOT_BATCH_RECORDS; (first, last) offset, or None."""
        span: tuple[int, int] | None = None
        for i in range(0, len(words), SNAPSHOT_BATCH_RECORDS):
            chunk = words[i : i + SNAPSHOT_BATCH_RECORDS]
            base, last = self.append([(w.key, w.value) for w in chunk], chunk[0].timestamp,
                                     [w.timestamp for w in chunk])
            span = (base if span is None else span[0], last)
        return span

    async def wait_durable(self, last_offset: int) -> None:
        await self.partition.wait_durable(last_offset)

    # ------------------------------------------------------------------ compaction

    @property
    def dirty_records(self) -> int:
        """Records in the archive that no longer matter (superseded, tombstones, junk)."""
        plog = self.partition.log
        kept = len(self.tombstones) if self.tombstone_retention_ms is not None else 0
        return plog.log_end_offset - plog.log_start_offset - len(self.live) - kept

    def needs_compaction(self, min_dirty_records: int) -> bool:
        dirty = self.dirty_records
        return dirty >= min_dirty_records and dirty >= len(self.live)

    async def write_snapshot(self, timestamp_ms: int) -> tuple[int, int] | None:
        """Step 2: append every live record again, from a new segment; (first, last)
        offset of the snapshot, or None when nothing is live. Yields between batches.
        With `tombstone_retention_ms` (cluster mode), tombstones younger than that are
        copied too and older ones forgotten (Kafka's delete.retention.ms), so that a
        broker that was away meanwhile cannot bring the deleted key back (`merge`)."""
        retention = self.tombstone_retention_ms
        tombstones_since = None if retention is None else timestamp_ms - retention
        for k in [k for k, w in self.tombstones.items() if tombstones_since is None or w.timestamp < tombstones_since]:
            del self.tombstones[k]  # not copied: gone from the archive with the old segments
        keys = list(self.live) + list(self.tombstones)
        if not keys:
            return None
        self.partition.log.roll()
        first: int | None = None
        last = -1
        i = 0
        while i < len(keys):
            chunk: list[tuple[bytes, bytes | None]] = []
            times: list[int] = []
            size = 0
            while i < len(keys) and len(chunk) < SNAPSHOT_BATCH_RECORDS and size < SNAPSHOT_BATCH_BYTES:
                # the newest word now: gone if deleted meanwhile (a tombstone only if kept)
                current = self.live.get(keys[i]) or self.tombstones.get(keys[i])
                i += 1
                if current is not None:
                    chunk.append((current.key, current.value))
                    # the copy keeps the record's time: the cross-broker merge orders by it
                    times.append(current.timestamp)
                    size += len(current.key) + len(current.value or b"")
            if chunk:
                base, last = self.append(chunk, timestamp_ms, times)
                first = base if first is None else first
            await trio.lowlevel.checkpoint()  # requests go on between batches (safe: see the module doc)
        return None if first is None else (first, last)

    async def drop_below(self, offset: int) -> int:
        """Step 3: drop the segments below a durable snapshot that starts at `offset`."""
        partition = self.partition
        for _ in range(DROP_ATTEMPTS):
            async with partition.lock:
                if partition.failed:
                    return 0
                plog = partition.log
                if plog.high_watermark <= offset:
                    raise ValueError(f"snapshot at {offset} is not durable yet")
                dropped = plog.drop_segments_below(offset)
                # Dropping commits what was appended (a head must cover the data before
                # it forgets segments): wake whoever waits for those offsets.
                partition.notify()
                if dropped or plog.log_start_offset >= offset:
                    return dropped
            await trio.sleep(0.01)  # a commit job was in flight; the loop publishes it soon
        log.warning("%s: could not drop the segments below %d (commit jobs kept running)", OFFSETS_TOPIC, offset)
        return 0

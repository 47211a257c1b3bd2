"""The offsets archive: committed offsets and group metadata kept in `__consumer_offsets`.

Owns the internal topic's life cycle (created through the node on first start, with
retention off: there is no compaction, so dropping old segments would lose live commits),
appending records to it as real v2 batches (signed and verifiable like any partition), and
replaying it on open into a `Replayed` snapshot that the coordinator installs. The topic is
internal: its name starts with "__", which the node hides from topic listings unless a
client names it.

Synchronous except for nothing: the coordinator awaits durability through
`Partition.wait_durable`. Imports the node's types, storage-free helpers from
broker.protocol.records (to split and decode batches) and broker.groups.records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker.groups.records import (
    GroupKey,
    GroupValue,
    OffsetKey,
    OffsetValue,
    RecordFormatError,
    build_batch,
    decode_group_value,
    decode_key,
    decode_offset_value,
)
from broker.protocol import records as batches
from broker.protocol.errors import RecordBatchError
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.node import Node, Partition

log = logging.getLogger("hyperkafka.groups")

OFFSETS_TOPIC = "__consumer_offsets"
# No compaction on signed archives: keep every segment, or live commits would expire.
OFFSETS_TOPIC_CONFIGS = {"retention.ms": "-1", "retention.bytes": "-1"}
READ_CHUNK = 1 << 20


@dataclass
class Replayed:
    """The archive's last word per key: offsets and group metadata (tombstones applied)."""

    offsets: dict[tuple[str, str, int], tuple[OffsetValue, int]] = field(default_factory=dict)
    groups: dict[str, GroupValue] = field(default_factory=dict)
    records: int = 0
    skipped: int = 0

    def apply(self, record_offset: int, key: OffsetKey | GroupKey, value: bytes | None) -> None:
        if isinstance(key, OffsetKey):
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

    def replay(self) -> Replayed:
        state = Replayed()
        for record_offset, key, value in self._records():
            try:
                state.apply(record_offset, decode_key(key), value)
                state.records += 1
            except RecordFormatError as exc:
                # Not ours (the topic is writable by Produce like any other): skip it.
                state.skipped += 1
                log.warning("%s offset %d: skipping a record that does not parse: %s", OFFSETS_TOPIC, record_offset, exc)
        return state

    def _records(self) -> Iterator[tuple[int, bytes, bytes | None]]:
        plog = self.partition.log
        offset = plog.log_start_offset
        while offset < plog.high_watermark:
            try:
                chunk = plog.read(offset, READ_CHUNK)
            except StorageError as exc:
                # Serve the broker with what verified; storage already logged the damage.
                log.error("%s: replay stops at offset %d: %s", OFFSETS_TOPIC, offset, exc)
                return
            data = chunk.read()
            if not data:
                break
            try:
                split = batches.split_batches(data)
            except RecordBatchError as exc:
                log.warning("%s offset %d: unreadable batches skipped: %s", OFFSETS_TOPIC, offset, exc)
                split = []
            for batch in split:
                try:
                    decoded = list(batches.iter_records(batch))
                except RecordBatchError as exc:
                    log.warning("%s: skipping a batch that does not decode: %s", OFFSETS_TOPIC, exc)
                    continue
                for rec in decoded:
                    if rec.key is not None and rec.offset >= offset:
                        yield rec.offset, rec.key, rec.value
            offset = chunk.end_offset

    def append(self, entries: Sequence[tuple[bytes, bytes | None]], timestamp_ms: int) -> tuple[int, int]:
        """Append one batch; (base offset, last offset). Durable once `wait_durable(last)`."""
        partition = self.partition
        if partition.failed:
            raise OSError(partition.failed)
        base, last = partition.log.append(build_batch(entries, timestamp_ms))
        self.node.mark_dirty(partition)
        return base, last

    async def wait_durable(self, last_offset: int) -> None:
        await self.partition.wait_durable(last_offset)

"""The log cleaner: compaction of the partitions of compacted topics (cleanup.policy
compact or compact,delete), as Kafka's LogCleaner, on signed archives.

Owns the topic's compaction configs read as a `storage.compaction.CompactionPolicy`, the
decoding of a stored batch into (offset, key, is_tombstone) for the storage layer (the
records are Kafka's, storage does not read them), the rule that a compacted topic takes
only records with keys (`keyless_record`, Kafka's LogValidator message), and the loop that
runs a pass over every compacted partition this node writes every log.cleaner.backoff.ms.
What a pass removes and how the archive stays verifiable: storage/FORMAT.md section 4a.

A pass runs under the partition's lock in the event loop's thread (storage is
synchronous): it reads the cleanable segments and rewrites those that lose blocks, so a
large partition holds the loop for the time of that I/O. Imports broker.protocol.records
and storage; the node only for types.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from broker.protocol import records
from broker.protocol.errors import RecordBatchError
from storage import PartitionLog
from storage.compaction import CompactionPolicy, clean
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.node import Node

log = logging.getLogger("hyperkafka.cleaner")


def compaction_policy(config: Callable[[str], str]) -> CompactionPolicy | None:
    """A topic's compaction configs from its effective ones; None unless its
    cleanup.policy names compact."""
    if "compact" not in config("cleanup.policy").split(","):
        return None
    return CompactionPolicy(
        min_cleanable_dirty_ratio=float(config("min.cleanable.dirty.ratio")),
        delete_retention_ms=int(config("delete.retention.ms")),
        min_compaction_lag_ms=int(config("min.compaction.lag.ms")),
        max_compaction_lag_ms=int(config("max.compaction.lag.ms")),
    )


def keys_of(batch: bytes) -> Sequence[tuple[int, bytes, bool]] | None:
    """(offset, key, is_tombstone) of each record of a stored batch; None when the batch
    must stay whole: a control batch, a record without a key, records that do not decode."""
    try:
        header = records.parse_batch_header(batch)
        if header.is_control:
            return None
        out = []
        for r in records.iter_records(batch):
            if r.key is None:
                return None
            out.append((r.offset, r.key, r.value is None))
        return out
    except RecordBatchError:
        return None


def keyless_record(batch: bytes | bytearray | memoryview) -> int | None:
    """The index of the first record without a key in a produced batch (already
    validated), or None."""
    for i, r in enumerate(records.iter_records(batch)):
        if r.key is None:
            return i
    return None


def keyless_message(topic: str, partition: int) -> str:
    # Kafka's LogValidator.validateKey
    return (
        f"Compacted topic cannot accept message without key in topic partition {topic}-{partition}."
    )


class Cleaner:
    """Compacts the compacted partitions this node writes, one pass per backoff."""

    def __init__(self, node: Node) -> None:
        self.node = node
        # offset below which each log was cleaned (in memory: FORMAT.md 4a)
        self._clean_to: weakref.WeakKeyDictionary[PartitionLog, int] = weakref.WeakKeyDictionary()
        # when a kept tombstone becomes removable: a pass is due then, dirty or not
        self._tombstones_due: weakref.WeakKeyDictionary[PartitionLog, int] = (
            weakref.WeakKeyDictionary()
        )
        self.passes = 0
        self.removed_blocks = 0

    async def run(self) -> None:
        while True:
            await trio.sleep(self.node.config.log_cleaner_backoff_ms / 1000)
            await self.clean_all()

    async def clean_all(self, *, now_ms: int | None = None, force: bool = False) -> int:
        """One pass over every compacted partition; returns the blocks removed."""
        from broker.node import ms_now  # the node imports this module

        removed = 0
        for topic in list(self.node.topics.values()):
            policy = topic.compaction
            if policy is None or topic.mirrored or topic.name.startswith("__"):
                continue  # internal topics compact themselves (broker/groups/offsets.py)
            for p in topic.partitions:
                async with p.lock:
                    if p.failed:
                        continue
                    now = ms_now() if now_ms is None else now_ms
                    due = self._tombstones_due.get(p.log)
                    forced = force or (due is not None and now >= due)
                    dirty_from = self._clean_to.get(p.log, 0)
                    try:
                        res = clean(p.log, keys_of, policy, now, dirty_from, force=forced)
                    except StorageError as exc:  # before anything was written
                        log.error("compaction of %s-%d failed: %s", topic.name, p.index, exc)
                        continue
                    except OSError as exc:
                        # A failed write or rename mid-swap: offline until reopened, and
                        # recovery finishes or undoes the swap (FORMAT.md crash state 18).
                        self.node.fail_partition(p, f"compaction failed: {exc}")
                        continue
                if res is None:
                    continue
                self.passes += 1
                self._clean_to[p.log] = res.cleaned_to
                if res.tombstones_due_ms is None:
                    self._tombstones_due.pop(p.log, None)
                else:
                    self._tombstones_due[p.log] = res.tombstones_due_ms
                removed += res.removed_blocks
                if res.removed_blocks:
                    log.info(
                        "compacted %s-%d below offset %d: %d batches (%d bytes) removed from %d segments",
                        topic.name,
                        p.index,
                        res.cleaned_to,
                        res.removed_blocks,
                        res.freed_bytes,
                        res.segments_rewritten,
                    )
        self.removed_blocks += removed
        return removed

"""The log cleaner: compaction of the partitions of compacted topics (cleanup.policy
compact or compact,delete), as Kafka's LogCleaner, on signed archives.

Owns the topic's compaction configs read as a `storage.compaction.CompactionPolicy`, the
decoding of a stored batch into (offset, key, is_tombstone) for the storage layer (the
records are Kafka's, storage does not read them), for a transaction's batch also whose it
is and how the transaction ended (from the partition's aborted transactions; a pass stays
below the last stable offset, so every one it sees has ended), the rule that a compacted topic takes
only records with keys (`keyless_record`, Kafka's LogValidator message), and the loop that
runs a pass over every compacted partition this node writes every log.cleaner.backoff.ms.
What a pass removes and how the archive stays verifiable: storage/FORMAT.md section 4a.

A pass is decided and installed under the partition's lock in the event loop's thread;
reading the cleanable segments and writing their cleaned copies runs in a worker thread
without the lock, so appends, commits and fetches go on meanwhile (storage/compaction.py
`begin`/`prepare`/`install`). Imports broker.protocol.records
and storage; the node only for types.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from broker.protocol import records
from broker.protocol.errors import RecordBatchError
from storage import PartitionLog, compaction
from storage.compaction import CleanResult, CompactionPolicy, KeysOf, TxnBatch
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.node import Node, Partition
    from broker.transactions.partition import Aborted

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
    must stay whole: a control or transactional batch (whose outcome this does not know:
    `txn_keys_of` does), a record without a key, records that do not decode."""
    try:
        header = records.parse_batch_header(batch)
    except RecordBatchError:
        return None
    if header.is_control or header.is_transactional:
        return None
    return _record_keys(batch)


def _record_keys(batch: bytes) -> Sequence[tuple[int, bytes, bool]] | None:
    try:
        out = []
        for r in records.iter_records(batch):
            if r.key is None:
                return None
            out.append((r.offset, r.key, r.value is None))
        return out
    except RecordBatchError:
        return None


class AbortedIndex:
    """Whether a transactional batch (producer id, offset) belongs to an aborted
    transaction, from a snapshot of the partition's aborted transactions."""

    def __init__(self, aborted: Iterable[Aborted]) -> None:
        self._by_producer: dict[int, tuple[list[int], list[int]]] = {}
        for a in sorted(aborted, key=lambda a: a.first_offset):
            firsts, lasts = self._by_producer.setdefault(a.producer_id, ([], []))
            firsts.append(a.first_offset)
            lasts.append(a.last_offset)

    def __call__(self, producer_id: int, offset: int) -> bool:
        spans = self._by_producer.get(producer_id)
        if spans is None:
            return False
        i = bisect.bisect_right(spans[0], offset) - 1  # a producer's transactions never overlap
        return i >= 0 and offset <= spans[1][i]


def txn_keys_of(aborted: Callable[[int, int], bool]) -> KeysOf:
    """`keys_of` for a log whose transactions below the pass's end have all ended:
    `aborted(producer_id, offset)` tells an aborted one's batch from a committed one's."""

    def keys(batch: bytes) -> Sequence[tuple[int, bytes, bool]] | TxnBatch | None:
        try:
            header = records.parse_batch_header(batch)
        except RecordBatchError:
            return None
        if not header.is_transactional:
            return None if header.is_control else _record_keys(batch)
        pid = header.producer_id
        if header.is_control:
            return TxnBatch(pid, marker=True)
        if aborted(pid, header.base_offset):
            return TxnBatch(pid, aborted=True)
        return TxnBatch(pid, _record_keys(batch))

    return keys


def keyless_record(batch: bytes | bytearray | memoryview) -> int | None:
    """The index of the first record without a key in a produced batch that passed
    validation (so its records are well formed), or None. Reads only each record's
    length and the varints before its key: a null key is the one-byte varint 0x01
    (zigzag -1), and no other key length starts with that byte."""
    header = records.parse_batch_header(batch)
    body = memoryview(batch)[records.BATCH_HEADER_SIZE : header.size]
    data = (
        body
        if header.compression == records.Compression.NONE
        else records.decompress(header.compression, body)
    )
    pos = 0
    for i in range(header.records_count):
        length = shift = 0
        while True:  # the record's length (zigzag varint)
            b = data[pos]
            pos += 1
            length |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        length = (length >> 1) ^ -(length & 1)
        q = pos + 1  # past the attributes
        for _ in range(2):  # timestamp delta, offset delta
            while data[q] & 0x80:
                q += 1
            q += 1
        if data[q] == 0x01:
            return i
        pos += length
    return None


def keyless_message(topic: str, partition: int) -> str:
    # Kafka's LogValidator.validateKey
    return (
        f"Compacted topic cannot accept message without key in topic partition {topic}-{partition}"
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

        removed = 0
        for topic in list(self.node.topics.values()):
            policy = topic.compaction
            if policy is None or topic.mirrored or topic.name.startswith("__"):
                continue  # internal topics compact themselves (broker/groups/offsets.py)
            for p in topic.partitions:
                if p.log.replica:  # a leader that stepped down (broker/takeover.py): a copy
                    continue
                res = await self._clean_one(p, policy, now_ms, force)
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

    async def _clean_one(
        self, p: Partition, policy: CompactionPolicy, now_ms: int | None, force: bool
    ) -> CleanResult | None:
        """One pass over `p`: decided and installed under its lock, the reading and
        writing in a worker thread without it (appends and commits go on meanwhile)."""
        from broker.node import ms_now  # the node imports this module

        plog = p.log
        async with p.lock:
            if p.failed:
                return None
            now = ms_now() if now_ms is None else now_ms
            due = self._tombstones_due.get(plog)
            forced = force or (due is not None and now >= due)
            # Below the LSO every transaction has ended; the aborted ones are listed
            # (a snapshot: the worker thread reads it while appends go on).
            stable = p.txns.lso(plog.high_watermark)
            keys = txn_keys_of(AbortedIndex(p.txns.aborted_in(0, stable)))
            # Each producer's last batch stays (Kafka's cleaner keeps it too): the
            # idempotence state is rebuilt from it at open, so a retry after a restart
            # is still known as a duplicate.
            keep = frozenset(
                e.batches[-1].first_offset for _, e in p.producers.items() if e.batches
            )
            try:
                job = compaction.begin(
                    plog,
                    policy,
                    now,
                    self._clean_to.get(plog, 0),
                    force=forced,
                    stable_offset=stable,
                    keep=keep,
                )
            except StorageError as exc:  # its files could not be opened
                log.error("compaction of %s-%d: %s", p.topic.name, p.index, exc)
                return None
        if job is None:
            return None
        try:
            await trio.to_thread.run_sync(compaction.prepare, plog, job, keys)
        except (StorageError, OSError) as exc:  # nothing the log serves was changed
            async with p.lock:
                with contextlib.suppress(OSError):
                    compaction.abandon(plog, job)
            log.error("compaction of %s-%d failed: %s", p.topic.name, p.index, exc)
            return None
        except BaseException:
            with contextlib.suppress(OSError):
                compaction.abandon(plog, job)
            raise
        async with p.lock:
            if p.failed or plog.closed:
                with contextlib.suppress(OSError):
                    compaction.abandon(plog, job)
                return None
            try:
                return compaction.install(plog, job)
            except OSError as exc:
                # A failed rename mid-swap: offline until reopened, and recovery finishes
                # or undoes the swap (FORMAT.md crash state 18).
                self.node.fail_partition(p, f"compaction failed: {exc}")
                return None

"""Compaction of a partition's local storage (cleanup.policy=compact): design in
storage/FORMAT.md section 4a.

Owns choosing the blocks a compaction removes (whole stored batches whose every record is
superseded, or an expired tombstone with nothing older of its key left), rewriting the
sealed segments that hold them (surviving batches byte for byte, one index entry per block,
size 0 for a removed one), the crash-safe swap of the rewritten files and its completion at
open (`finish_swaps`), and the size of a removed leaf (`leaf_size`). The signed tree, the
heads and the tree file never change: only local bytes go.

Record-level decoding is not storage's: the caller passes `keys_of(batch)`, which returns
the batch's records as (offset, key, is_tombstone), None for a batch that must stay (a
keyless record), or for a batch of a transaction a `TxnBatch` saying whose it is and how
the transaction ended: an aborted one's data goes, a committed one's is compacted as any
other, and its marker goes once nothing of the transaction is left and
delete.retention.ms passed (Kafka's cleaner). The caller bounds the pass by the last
stable offset, so every transaction below it has ended. Works on the log's internals as recovery does, in
the log's owner thread, with no commit job in flight. May import the standard library,
`storage.errors`, `storage.format`, `storage.hashing`; `storage.log` only for types.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from storage.errors import StorageError
from storage.format import ENTRY_SIZE, Segment, encode_entry, encode_index_header
from storage.hashing import compute_leaf

if TYPE_CHECKING:
    from storage.fs import FileSystem
    from storage.log import PartitionLog

Records = Sequence[tuple[int, bytes, bool]]  # (offset, key, is_tombstone) of each record


@dataclass(frozen=True, slots=True)
class TxnBatch:
    """A stored batch of a transaction that ended, as the caller decoded it."""

    producer_id: int
    records: Records | None = None  # a committed data batch's; None: it stays whole
    aborted: bool = False  # data of an aborted transaction: removed
    marker: bool = False  # the transaction's marker (its control batch)


# A batch's records, a transaction's batch, or None: keep the batch whole.
KeysOf = Callable[[bytes], Records | TxnBatch | None]

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class CompactionPolicy:
    """A topic's compaction configs (Kafka's names)."""

    min_cleanable_dirty_ratio: float = 0.5
    delete_retention_ms: int = 86_400_000
    min_compaction_lag_ms: int = 0
    max_compaction_lag_ms: int = INT64_MAX


@dataclass(frozen=True)
class CleanResult:
    cleaned_to: int  # offsets below this were cleaned (the next pass's dirty start)
    removed_blocks: int  # blocks removed by this pass
    freed_bytes: int
    segments_rewritten: int
    # When a tombstone or transaction marker this pass kept becomes removable by age (its
    # batch's maxTimestamp + delete.retention.ms), or None: a pass is due then even without new dirty bytes
    # (Kafka's cleaner also picks a log for its delete horizon, KIP-534).
    tombstones_due_ms: int | None = None


def removed(seg: Segment, k: int) -> bool:
    """Entry k of `seg` is a block removed by compaction (size 0)."""
    return seg.size_of(k) == 0


def leaf_size(lg: PartitionLog, seg: Segment, k: int) -> int:
    """The byte size of block k of `seg` as its tree leaf says: the entry's, or for a
    removed block the tree file's leaf node (kept and fsynced before the removal)."""
    size = seg.size_of(k)
    if size:
        return size
    node = lg._read_node(2 * (seg.first_leaf + k))
    if node is None or node.hash != seg.leaf_of(k):
        raise StorageError(
            f"{lg.path}: tree leaf of compacted block {seg.first_leaf + k} is missing"
        )
    return int(node.size)


def next_present(lg: PartitionLog, seg: Segment, k: int, hwm: int) -> tuple[Segment, int] | None:
    """The first block at or after entry k of `seg` that was not removed and starts below
    `hwm`; None when there is none."""
    segments = lg._segments
    si = segments.index(seg)
    while si < len(segments):
        s = segments[si]
        while k < s.count:
            if s.bases[k] >= hwm:
                return None
            if s.size_of(k):
                return s, k
            k += 1
        si, k = si + 1, 0
    return None


def cleanable_segments(
    lg: PartitionLog, policy: CompactionPolicy, now_ms: int, stable_offset: int | None = None
) -> list[Segment]:
    """The sealed segments of the cleanable range (FORMAT.md 4a): below the high
    watermark and the last stable offset (`stable_offset`: no open transaction there)."""
    out = []
    lag_edge = now_ms - policy.min_compaction_lag_ms
    upper = lg.high_watermark if stable_offset is None else min(lg.high_watermark, stable_offset)
    for seg in lg._segments[:-1]:
        if not seg.count or seg.next_offset() > upper:
            break
        if policy.min_compaction_lag_ms > 0 and max(seg.max_ts) > lag_edge:
            break
        out.append(seg)
    return out


def due(
    lg: PartitionLog, segs: list[Segment], policy: CompactionPolicy, dirty_from: int, now_ms: int
) -> bool:
    """Whether the dirty share of `segs` reached min.cleanable.dirty.ratio, or their
    first dirty batch is older than max.compaction.lag.ms."""
    total = dirty = 0
    first_dirty_ts: int | None = None
    for seg in segs:
        for k in range(seg.count):
            size = seg.size_of(k)
            total += size
            if seg.bases[k] >= dirty_from and size:
                dirty += size
                if first_dirty_ts is None:
                    first_dirty_ts = int(seg.max_ts[k])
    if not dirty:
        return False
    if dirty >= policy.min_cleanable_dirty_ratio * total:
        return True
    return first_dirty_ts is not None and first_dirty_ts < now_ms - policy.max_compaction_lag_ms


def _leaf(lg: PartitionLog, seg: Segment, k: int) -> tuple[int, bytes]:
    """(size, hash) of block k's tree leaf, from the tree file (the in-memory entries of
    blocks appended since open carry no leaf hash: storage/log.py `_store`)."""
    node = lg._read_node(2 * (seg.first_leaf + k))
    if node is None:
        raise StorageError(
            f"{lg.path}: tree leaf of block {seg.first_leaf + k} is missing; not compacting"
        )
    return int(node.size), bytes(node.hash)


def _read(lg: PartitionLog, seg: Segment, k: int) -> bytes:
    size = seg.size_of(k)
    data = lg.fs.pread_exact(seg.log_fd, size, seg.positions[k])
    if len(data) != size or (size, compute_leaf(data, size)) != _leaf(lg, seg, k):
        # never carry bytes that are not the signed ones into a rewritten segment
        raise StorageError(
            f"{lg.path}: block {seg.first_leaf + k} does not match its leaf; not compacting"
        )
    return data


def plan(
    lg: PartitionLog,
    segs: list[Segment],
    keys_of: KeysOf,
    policy: CompactionPolicy,
    now_ms: int,
    keep: frozenset[int] = frozenset(),
) -> tuple[dict[int, list[int]], int | None]:
    """The entries to remove, per index of `segs` (FORMAT.md 4a's rules), and when the
    first tombstone or marker kept for its age may go. The batches at the base offsets
    `keep` stay whole (each producer's last: its idempotence state is rebuilt from it)."""
    last: dict[bytes, int] = {}
    decoded: list[list[Records | TxnBatch | None]] = []
    for seg in segs:
        per_seg: list[Records | TxnBatch | None] = []
        for k in range(seg.count):
            if removed(seg, k):
                per_seg.append(())
                continue
            d = keys_of(_read(lg, seg, k))
            per_seg.append(d)
            # an aborted transaction's records supersede nothing
            for off, key, _ in _records(d) or ():
                last[key] = off
        decoded.append(per_seg)
    horizon = now_ms - policy.delete_retention_ms
    kept_keys: set[bytes] = set()  # keys with a record that stays, in the log order so far
    # producer id -> a data batch of its current transaction stays (its marker must too)
    txn_kept: dict[int, bool] = {}
    out: dict[int, list[int]] = {}
    due_at: int | None = None

    def later(at: int) -> None:
        nonlocal due_at
        due_at = at if due_at is None else min(due_at, at)

    for si, seg in enumerate(segs):
        for k, d in enumerate(decoded[si]):
            if d is not None and not isinstance(d, TxnBatch) and not d and removed(seg, k):
                continue  # removed by an earlier pass
            old = int(seg.max_ts[k]) < horizon
            if int(seg.bases[k]) in keep and not (isinstance(d, TxnBatch) and d.marker):
                # a producer's last batch stays whole (aborted or not), and so its
                # transaction's marker
                if isinstance(d, TxnBatch):
                    txn_kept[d.producer_id] = True
                kept_keys.update(key for _, key, _ in _records(d) or ())
                continue
            if isinstance(d, TxnBatch):
                if d.aborted:
                    out.setdefault(si, []).append(k)
                    continue
                if d.marker:
                    # Kafka's rule: a marker stays while a batch of its transaction does
                    # (a reader, and the rebuild at open, need it to close the transaction)
                    if txn_kept.pop(d.producer_id, False):
                        continue
                    if old:
                        out.setdefault(si, []).append(k)
                    else:
                        later(int(seg.max_ts[k]) + policy.delete_retention_ms + 1)
                    continue
            recs = _records(d)
            if recs is None:
                if isinstance(d, TxnBatch):
                    txn_kept[d.producer_id] = True
                continue  # stays whole; its keys are unknown to us (keyless)
            drop = bool(recs) and all(
                last[key] > off or (tomb and old and key not in kept_keys)
                for off, key, tomb in recs
            )
            if drop:
                out.setdefault(si, []).append(k)
                continue
            if isinstance(d, TxnBatch):
                txn_kept[d.producer_id] = True
            kept_keys.update(key for _, key, _ in recs)
            if not old and any(tomb and last[key] == off for off, key, tomb in recs):
                later(int(seg.max_ts[k]) + policy.delete_retention_ms + 1)
    return out, due_at


def _records(d: Records | TxnBatch | None) -> Records | None:
    """The records of a batch that may supersede others: None for one kept whole, for an
    aborted transaction's data and for a marker."""
    if isinstance(d, TxnBatch):
        return None if d.aborted or d.marker else d.records
    return d


@dataclass
class Pass:
    """One compaction pass: `begin` (owner thread), `prepare` (any thread: reads the
    segments and writes the cleaned files), `install` (owner thread: the swap)."""

    segs: list[Segment]
    end: int
    now_ms: int
    policy: CompactionPolicy
    keep: frozenset[int] = frozenset()  # base offsets of batches that stay (`plan`)
    # from `prepare`: per segment to swap, its new entries and .log size, and bytes freed
    rewritten: list[tuple[Segment, bytearray, int]] = field(default_factory=list)
    removed_blocks: int = 0
    tombstones_due_ms: int | None = None


def begin(
    lg: PartitionLog,
    policy: CompactionPolicy,
    now_ms: int,
    dirty_from: int = 0,
    *,
    force: bool = False,
    stable_offset: int | None = None,
    keep: frozenset[int] = frozenset(),
) -> Pass | None:
    """Owner thread: the pass to run, or None when nothing is due or the log is busy (a
    commit job in flight, damaged, not writable). `force`: ignore the dirty ratio;
    `stable_offset`: the last stable offset, the pass stays below it; `keep`: the base
    offsets of batches that must stay (each producer's last). The log is pinned (its
    files stay open) until `install` or `abandon`."""
    lg._close_doomed()
    if lg._job is not None or lg.damage is not None or lg._poisoned is not None:
        return None
    segs = cleanable_segments(lg, policy, now_ms, stable_offset)
    if not segs or (not force and not due(lg, segs, policy, dirty_from, now_ms)):
        return None
    lg.pin()
    return Pass(segs, segs[-1].next_offset(), now_ms, policy, keep)


def prepare(lg: PartitionLog, p: Pass, keys_of: KeysOf) -> None:
    """Any thread, while the owner may append and commit (only sealed segments and
    committed tree nodes are read): decide what goes and write each rewritten segment's
    `.cleaned` files, fsynced. Nothing the log serves changes until `install`."""
    drops, p.tombstones_due_ms = plan(lg, p.segs, keys_of, p.policy, p.now_ms, p.keep)
    if drops:
        # A removed leaf's size comes from the tree file from now on: make it durable.
        lg.fs.fsync(lg._tree_fd)
    for si, ks in drops.items():
        seg = p.segs[si]
        entries, size = _write_cleaned(lg, seg, set(ks))
        p.rewritten.append((seg, entries, size))
        p.removed_blocks += len(ks)


def install(lg: PartitionLog, p: Pass) -> CleanResult:
    """Owner thread, with no commit job in flight: swap the cleaned files in (a segment
    retention dropped meanwhile is skipped) and unpin the log."""
    freed = swapped = 0
    try:
        for seg, entries, size in p.rewritten:
            if seg not in lg._segments:
                _discard(lg, seg)
                continue
            freed += seg.log_size - size
            _swap(lg, seg, entries, size)
            swapped += 1
    finally:
        lg.unpin()
    return CleanResult(p.end, p.removed_blocks, freed, swapped, p.tombstones_due_ms)


def abandon(lg: PartitionLog, p: Pass) -> None:
    """Owner thread: drop a pass that failed or was not prepared; unpin the log."""
    try:
        for seg, _, _ in p.rewritten:
            _discard(lg, seg)
    finally:
        lg.unpin()


def clean(
    lg: PartitionLog,
    keys_of: KeysOf,
    policy: CompactionPolicy,
    now_ms: int,
    dirty_from: int = 0,
    *,
    force: bool = False,
    stable_offset: int | None = None,
    keep: frozenset[int] = frozenset(),
) -> CleanResult | None:
    """One whole pass in the calling (owner) thread; None when nothing was due."""
    p = begin(lg, policy, now_ms, dirty_from, force=force, stable_offset=stable_offset, keep=keep)
    if p is None:
        return None
    try:
        prepare(lg, p, keys_of)
    except BaseException:
        abandon(lg, p)
        raise
    return install(lg, p)


def _write_cleaned(lg: PartitionLog, seg: Segment, drop: set[int]) -> tuple[bytearray, int]:
    """Write `seg` without the blocks `drop` as `.cleaned` files (FORMAT.md 4a: one
    entry per block, size 0 for a removed one); returns the new entries and .log size."""
    fs = lg.fs
    entries = bytearray()
    body = bytearray()
    for k in range(seg.count):
        o = k * ENTRY_SIZE
        ent = seg.entries
        base, max_ts = int(seg.bases[k]), int(seg.max_ts[k])
        delta = int.from_bytes(ent[o + 24 : o + 28], "little", signed=True)
        _, leaf = _leaf(lg, seg, k)
        if k in drop or removed(seg, k):
            entries += encode_entry(base, max_ts, len(body), 0, delta, leaf)
        else:
            entries += encode_entry(base, max_ts, len(body), seg.size_of(k), delta, leaf)
            body += _read(lg, seg, k)
    fds = []
    try:
        lfd = fs.open(seg.log_path + ".cleaned", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        fds.append(lfd)
        ifd = fs.open(seg.idx_path + ".cleaned", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        fds.append(ifd)
        fs.pwrite_all(lfd, body, 0)
        fs.pwrite_all(ifd, encode_index_header(seg.base_offset, seg.first_leaf) + entries, 0)
        fs.fsync(lfd)
        fs.fsync(ifd)
    finally:
        for fd in fds:
            fs.close(fd)
    return entries, len(body)


def _discard(lg: PartitionLog, seg: Segment) -> None:
    for path in (seg.log_path + ".cleaned", seg.idx_path + ".cleaned"):
        if lg.fs.exists(path):
            lg.fs.unlink(path)


def _swap(lg: PartitionLog, seg: Segment, entries: bytearray, size: int) -> None:
    """The crash-safe swap of FORMAT.md 4a, then the segment's new files in memory."""
    fs = lg.fs
    fs.rename(seg.idx_path + ".cleaned", seg.idx_path + ".swap")
    fs.rename(seg.log_path + ".cleaned", seg.log_path + ".swap")  # the commit point
    fs.fsync_dir(lg.path)
    fs.rename(seg.idx_path + ".swap", seg.idx_path)
    fs.rename(seg.log_path + ".swap", seg.log_path)
    fs.fsync_dir(lg.path)
    # The descriptors still point at the old files: open the new ones. The old ones are
    # closed later, as retention's (`_close_doomed`): a range read handed out may use them.
    lg._doomed.append(
        Segment(seg.base_offset, seg.first_leaf, seg.log_fd, seg.idx_fd, seg.log_path, seg.idx_path)
    )
    seg.log_fd = fs.open(seg.log_path, os.O_RDWR)
    seg.idx_fd = fs.open(seg.idx_path, os.O_RDWR)
    seg.set_entries(entries)
    seg.idx_written = seg.count
    seg.log_size = size


def finish_swaps(fs: FileSystem, path: str) -> None:
    """Crash state 18: finish a committed swap, drop an uncommitted one."""
    names = set(fs.listdir(path))
    if not any(n.endswith((".swap", ".cleaned")) for n in names):
        return
    for n in sorted(names):
        full = os.path.join(path, n)
        if n.endswith(".log.swap"):
            stem = n[: -len(".log.swap")]
            if stem + ".bidx.swap" in names:
                fs.rename(
                    os.path.join(path, stem + ".bidx.swap"), os.path.join(path, stem + ".bidx")
                )
            fs.rename(full, os.path.join(path, stem + ".log"))
        elif n.endswith(".cleaned"):
            fs.unlink(full)
    for n in sorted(fs.listdir(path)):
        if n.endswith(".bidx.swap"):  # its .log.swap never came: not committed
            fs.unlink(os.path.join(path, n))
    fs.fsync_dir(path)

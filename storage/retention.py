"""Retention and DeleteRecords: dropping the oldest data of a partition archive.

Owns what `PartitionLog.apply_retention`, `drop_segments_below` and `delete_records_below`
do: pick whole old segments by retention.ms / retention.bytes (or below an offset), make
the tree nodes and data the head covers durable, record the new log start and minimum
index in a new head slot (the signed part unchanged: the start is local bookkeeping),
then unlink the segments. Tree nodes are never dropped: whatever was signed stays
provable. A dropped segment's descriptors stay open (`_doomed`) until the next call, as
read ranges handed out before the drop may still use them. Each function works on the
log it is given, on its owner thread.

May import the standard library, `storage.errors`, `storage.format`; `storage.log` only
for types.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from storage import format as fmt
from storage.errors import StorageError
from storage.format import POLICY_CODE, SLOT_SIZE, Head

if TYPE_CHECKING:
    from storage.log import PartitionLog


def apply_retention(lg: PartitionLog, now_ms: int) -> int:
    """Drop whole old segments by retention_ms / retention_bytes. Returns the number of
    segments dropped. Never the active segment, never data above the high watermark;
    skipped while a commit job is in flight. Tree nodes are kept (proofs). A replica
    keeps what its writer signed (retention of mirrors: not yet)."""
    if lg.replica:
        return 0
    lg._close_doomed()
    if lg._job is not None or lg.damage is not None or lg._poisoned is not None:
        return 0
    cfg = lg.config
    total = sum(s.log_size for s in lg._segments)
    drop = 0
    for seg in lg._segments[:-1]:
        if seg.next_offset() > lg.high_watermark or not seg.count:
            break
        by_time = cfg.retention_ms >= 0 and max(seg.max_ts) < now_ms - cfg.retention_ms
        by_size = cfg.retention_bytes >= 0 and total - seg.log_size >= cfg.retention_bytes
        if not (by_time or by_size):
            break
        drop += 1
        total -= seg.log_size
    return _drop_first_segments(lg, drop)


def drop_segments_below(lg: PartitionLog, offset: int) -> int:
    """Drop the whole segments that end at or below `offset` (never the active one,
    never data above the high watermark), exactly as retention drops them: the log
    start offset advances, tree nodes stay (proofs), the head records the new start.
    For a log whose owner rewrote everything it still needs at `offset` or later
    (the offsets archive's compaction). Returns the number of segments dropped; 0 also
    while a commit job is in flight (call again later)."""
    lg._close_doomed()
    if lg._job is not None or lg.damage is not None or lg._poisoned is not None:
        return 0
    drop = 0
    for seg in lg._segments[:-1]:
        end = seg.next_offset()
        if not seg.count or end > offset or end > lg.high_watermark:
            break
        drop += 1
    return _drop_first_segments(lg, drop)


def delete_records_below(lg: PartitionLog, offset: int) -> int:
    """Kafka's DeleteRecords: make `offset` (at most the high watermark) the log start
    offset; returns the new log start (never lower than before). Whole segments below
    it are dropped as retention drops them; inside a segment the start is only
    recorded in a new head slot (reads below it are out of range, and recovery keeps
    the larger of the first segment's base and the head's start). Tree nodes stay:
    whatever was signed stays provable. Raises StorageError while a commit job is in
    flight or the archive takes no writes."""
    if offset > lg.high_watermark:
        raise ValueError(f"offset {offset} is above the high watermark {lg.high_watermark}")
    lg._close_doomed()
    if lg._job is not None or lg.damage is not None or lg._poisoned is not None:
        raise StorageError(f"{lg.path}: busy or not writable; try again")
    if offset <= lg.log_start_offset:
        return lg.log_start_offset
    drop_segments_below(lg, offset)
    if lg.log_start_offset < offset:
        lg._ensure_open()
        lg.commit(force_sync=True)  # the head we copy covers everything appended
        head = lg._head
        assert head is not None
        lg.log_start_offset = offset
        write_head_slot(lg, head, lg._min_index)
    return lg.log_start_offset


def write_head_slot(lg: PartitionLog, head: Head, min_index: int) -> None:
    """Rewrite the last signed head with this log's start and min index (the signed
    part is unchanged: the start is local bookkeeping, not part of the tree)."""
    lg._head_seq += 1
    new_head = Head(
        head.fork,
        head.length,
        head.byte_length,
        head.tree_hash,
        head.signature,
        head.next_offset,
        lg.log_start_offset,
        min_index,
        head.roots,
        lg._head_seq,
        POLICY_CODE[lg.policy] << 8,
        fmt.BOOT_ID,
        int(time.time() * 1000),
        head.length,
    )
    lg.fs.pwrite_all(lg._head_fd, new_head.encode(), (lg._head_seq % 2) * SLOT_SIZE)
    lg.fs.fsync(lg._head_fd)
    lg._head = new_head


def _drop_first_segments(lg: PartitionLog, drop: int) -> int:
    if not drop:
        return 0
    # (what to drop is decided from memory: a parked log opens its files only when
    # retention has something to do, not on every check)
    lg._ensure_open()
    dropped = lg._segments[:drop]
    keep = lg._segments[drop:]
    # The tree file's nodes for these leaves can no longer be rebuilt: make them durable
    # (and the data the head covers) before the head that forgets the segments.
    lg.commit(force_sync=True)
    lg.fs.fsync(lg._tree_fd)
    lg._segments = keep
    lg._segments_ready()
    # (DeleteRecords may have put the start inside the first kept segment already)
    lg.log_start_offset = max(lg.log_start_offset, keep[0].base_offset)
    new_min = keep[0].first_leaf
    lg._leaf_ok = lg._leaf_ok[new_min - lg._leaf_ok_base :]
    lg._leaf_ok_base = new_min
    lg._min_index = new_min
    head = lg._head
    assert head is not None
    write_head_slot(lg, head, new_min)
    for seg in dropped:
        lg.fs.unlink(seg.log_path)
        lg.fs.unlink(seg.idx_path)
    lg.fs.fsync_dir(lg.path)
    lg._doomed = dropped
    return drop

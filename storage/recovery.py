"""Recovery at open: what `PartitionLog.open` does before the log takes appends.

Owns the crash-state table of storage/FORMAT.md in code: load segments in order and cut
at the first inconsistency (a torn tail, a segment that does not continue the last, index
entries past the log), rebuild index entries from the log, check the tree against the
last signed head (or rebuild it from the data after a power loss, under a new fork), open
read-only when the archive is damaged or recovery could not write, and sign what was
appended but never signed. Each function works on the log being opened (owner thread).

May import the standard library, `storage.batch`, `storage.errors`, `storage.format`,
`storage.hashing`, `storage.hypercore`; `storage.log` only for types.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from storage import batch as B
from storage import compaction
from storage import format as fmt
from storage.errors import ArchiveDamaged, RecoveryFailed
from storage.format import (
    BE_I32,
    BE_I64,
    ENTRY_SIZE,
    FLAG_CLEAN,
    IDX_HEADER_SIZE,
    POLICY_CODE,
    SLOT_SIZE,
    U32,
    FsyncPolicy,
    Head,
    Segment,
    check_head,
    column,
    decode_index_header,
    encode_entry,
    encode_index_header,
    entry_ok,
    read_head_slots,
)
from storage.hashing import compute_leaf
from storage.hypercore import Frontier, Manifest, flat_tree, tree_hash

if TYPE_CHECKING:
    from storage.log import PartitionLog

log = logging.getLogger("storage.log")


def open_unwritable(lg: PartitionLog, failure: OSError) -> None:
    """Open read-only after recovery could not write: nothing here writes."""
    lg._head_fd = lg._open_rw("head")
    lg._tree_fd = lg._open_rw("tree")
    head, _ = read_head_slots(lg.fs, lg._head_fd)
    if head is not None and check_head(head, lg.head_signer, lg.key) is not None:
        head = None  # a bad head is damage, found again by the next writable open
    names = lg.fs.listdir(lg.path)
    bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
    open_damaged(
        lg,
        RecoveryFailed(
            f"{lg.path}: recovery could not write ({failure}); read-only until it can",
            head.next_offset if head is not None else None,
            failure,
        ),
        bases,
        head,
    )


def recover(lg: PartitionLog) -> None:
    fs = lg.fs
    compaction.finish_swaps(fs, lg.path)
    lg._head_fd = lg._open_rw("head")
    lg._tree_fd = lg._open_rw("tree")
    head, corrupt_slot = read_head_slots(fs, lg._head_fd)
    names = sorted(fs.listdir(lg.path))
    bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
    for n in names:  # index files without a log: nothing to index
        if n.endswith(".bidx") and n[:-5].isdigit() and int(n[:-5]) not in bases:
            fs.unlink(os.path.join(lg.path, n))
    if head is None and not corrupt_slot and not bases:
        # A new archive: make an unsigned genesis slot (length 0) durable before any
        # head is signed, so a later power loss always finds the writer's policy and
        # boot id on disk and can tell that heads may have been lost (FORMAT.md sec. 8).
        head = Head(
            0,
            0,
            0,
            tree_hash([]),
            bytes(68),
            0,
            0,
            0,
            (),
            1,
            FLAG_CLEAN | (POLICY_CODE[lg.policy] << 8),
            fmt.BOOT_ID,
            int(time.time() * 1000),
            0,
        )
        fs.pwrite_all(lg._head_fd, head.encode(), SLOT_SIZE)
        fs.fsync(lg._head_fd)
        fs.fsync_dir(lg.path)
    if head is not None:
        why = check_head(head, lg.head_signer, lg.key)
        if why is not None:
            open_damaged(
                lg, ArchiveDamaged(f"{lg.path}: {why}", head.log_start_offset), bases, None
            )
            return
        lg._head_seq = head.seq
        lg._fork = head.fork
        lg._disk_clean = head.clean
    elif corrupt_slot and bases:
        open_damaged(lg, ArchiveDamaged(f"{lg.path}: both head slots invalid", 0), bases, None)
        return
    min_index = head.min_index if head else 0
    signed_len = head.length if head else 0
    rebooted = head is not None and not head.clean and head.boot_id != fmt.BOOT_ID
    power_loss = rebooted and head is not None and head.policy is not FsyncPolicy.ALWAYS
    # Below `checkpoint` the .bidx entries and tree nodes are trusted without rehashing:
    # after a clean close or a process crash (same boot: the page cache survived) that is
    # the whole signed length, after a reboot only what was fsynced (derived_length).
    if head is None:
        checkpoint = 0
    elif rebooted:
        checkpoint = min(head.derived_length, signed_len)
    else:
        checkpoint = signed_len

    # Load segments in order, checking the structure; cut at the first inconsistency.
    # The first segment must start where the head says the log starts; a segment that
    # does not continue the previous one means data in between is gone: cut there.
    expect_leaf: int = min_index
    expect_offset: int = head.log_start_offset if head is not None else 0
    cut = False  # something was truncated or dropped
    rebuilt_from: int | None = None  # first leaf whose entry was rebuilt from the log
    for bi, base in enumerate(bases):
        seg = lg._open_segment_files(base)
        if cut:
            lg._drop_segment_files(seg)
            continue
        hdr = decode_index_header(fs.pread_exact(seg.idx_fd, IDX_HEADER_SIZE, 0))
        # A segment wholly below the log start is a leftover of an interrupted retention
        # (its leaves are below the head's min index), unless it holds the first leaves
        # the head keeps: DeleteRecords up to the end of the then active segment, which
        # later appends rolled. That one stays, as it did in the process that wrote it;
        # dropping it here would number the leaves after it from the wrong one.
        nxt = bases[bi + 1] if bi + 1 < len(bases) else None
        below_start = head is not None and nxt is not None and nxt <= head.log_start_offset
        if below_start and (lg._segments or hdr != (base, expect_leaf)):
            lg._drop_segment_files(seg)
            continue
        log_size = fs.size(seg.log_fd)
        seg.log_size = log_size
        first_leaf = expect_leaf
        # DeleteRecords may have put the log start inside the first segment: that one
        # may begin below it (never above: data the head says is kept would be gone).
        inside = head is not None and not lg._segments and base < expect_offset
        if base != expect_offset and not inside:
            log.warning(
                "%s: segment %d does not continue the log at %d; dropping it and "
                "everything after it",
                lg.path,
                base,
                expect_offset,
            )
            cut = True
            lg._drop_segment_files(seg)
            continue
        if hdr is None or hdr != (base, first_leaf):
            fs.ftruncate(seg.idx_fd, 0)
            fs.pwrite_all(seg.idx_fd, encode_index_header(base, first_leaf), 0)
            raw = bytearray()
        else:
            size = fs.size(seg.idx_fd) - IDX_HEADER_SIZE
            raw = bytearray(fs.pread_exact(seg.idx_fd, size - size % ENTRY_SIZE, IDX_HEADER_SIZE))
        seg.first_leaf = first_leaf
        seg.created_ms = int(time.time() * 1000)  # segment.ms counts from this open
        seg.set_entries(raw)
        seg.idx_written = seg.count
        seg.log_size = log_size
        # Structural check: entries contiguous from 0 and inside the log. The sum of
        # sizes equals the end of the last entry iff no gaps (positions increase).
        good = structural_prefix(lg, seg, log_size)
        # Entries at or past the signed length are the tail: check them fully.
        # After a power loss of a non-`always` writer anything unsynced may be torn,
        # so everything is checked (slow, but only then).
        tail_from = 0 if power_loss else max(0, checkpoint - first_leaf)
        k = tail_from
        while k < good:
            if not check_entry_against_log(lg, seg, k):
                break
            k += 1
        if k < seg.count:
            good = min(good, k)
        if good < seg.count:
            lg._truncate_entries(seg, good)
            cut = True
        # Batches in the log past the last entry: rebuild their entries.
        end = seg.end_of(seg.count - 1) if seg.count else 0
        log_size = fs.size(seg.log_fd)
        scanned_to, added_from = scan_log_tail(lg, seg, end, log_size)
        if added_from is not None and rebuilt_from is None:
            rebuilt_from = added_from
        if scanned_to < log_size:
            fs.ftruncate(seg.log_fd, scanned_to)
            seg.log_size = scanned_to
            cut = True
        # we cannot know whether the previous process fsynced this: sync it again
        seg.synced_log = False
        seg.idx_dirty = True
        lg._segments.append(seg)
        expect_leaf = seg.first_leaf + seg.count
        expect_offset = seg.next_offset()
    total = expect_leaf
    if lg._cut_unsigned and head is not None and total > signed_len and lg._segments:
        log.warning("%s: cutting %d block(s) never signed", lg.path, total - signed_len)
        if not lg.replica and lg.manifest is not None and lg.manifest != Manifest.default(lg.public_key):
            # a quorum-signed writer: replicas may have signed those blocks (a late
            # signature): its next head must be on a new fork (`PartitionLog.next_fork`)
            lg.cut_at_open = total - signed_len
        while len(lg._segments) > 1 and lg._segments[-1].first_leaf >= signed_len:
            lg._drop_segment_files(lg._segments.pop())
        seg = lg._segments[-1]
        k = max(0, signed_len - seg.first_leaf)
        lg._truncate_entries(seg, k)
        seg.log_size = seg.end_of(k - 1) if k else 0
        fs.ftruncate(seg.log_fd, seg.log_size)
        total = seg.first_leaf + seg.count
        if rebuilt_from is not None and rebuilt_from >= total:
            rebuilt_from = None
    lg._seg_bases = [s.base_offset for s in lg._segments]
    lg._dirty = bool(lg._segments)
    if lg._segments:
        lg.log_start_offset = lg._segments[0].base_offset
        lg.log_end_offset = lg._segments[-1].next_offset()
    elif head is not None:
        lg.log_start_offset = head.log_start_offset
        lg.log_end_offset = head.next_offset
    lg._min_index = lg._segments[0].first_leaf if lg._segments else min_index
    if head is not None:
        lg.log_start_offset = max(lg.log_start_offset, head.log_start_offset)

    if head is not None and total < signed_len:
        lost_at = lg.log_end_offset
        if not power_loss:
            lg._segments_ready()
            open_damaged(
                lg,
                ArchiveDamaged(
                    f"{lg.path}: data ends at block {total} but the signed head covers "
                    f"{signed_len}; refusing to write (would sign a different tree)",
                    lost_at,
                ),
                None,
                head,
                keep_segments=True,
            )
            return

    # Frontier at the end of the data.
    lg._segments_ready()
    if (
        head is not None
        and rebuilt_from is None
        and total >= signed_len
        and not power_loss
        and checkpoint == signed_len
    ):
        # the common case: continue from the roots in the verified head, no hashing
        lg._frontier = Frontier.from_roots(list(head.roots))
        fold(lg, signed_len, total)
    elif head is not None and not power_loss:
        # index entries below the head were rebuilt from the log: recompute and compare
        start = min(rebuilt_from if rebuilt_from is not None else total, signed_len, checkpoint)
        ok = False
        for attempt in ("stored", "leaves"):
            lg._pending_nodes = []
            fr = frontier_at(lg, start, use_stored=attempt == "stored")
            if fr is None:
                continue
            lg._frontier = fr
            fold(lg, start, signed_len)
            if lg._frontier.tree_hash() == head.tree_hash:
                ok = True
                break
        if not ok:
            open_damaged(
                lg,
                ArchiveDamaged(
                    f"{lg.path}: tree rebuilt from the data differs from the signed head",
                    lg.offset_of_leaf(start),
                ),
                None,
                head,
                keep_segments=True,
            )
            return
        fold(lg, signed_len, total)
    else:
        # no head, or after a power loss: the data is the truth, rebuilt from its leaves
        fr = frontier_at(lg, total, use_stored=False)
        if fr is None:
            open_damaged(
                lg,
                ArchiveDamaged(
                    f"{lg.path}: cannot rebuild the tree below block {lg._min_index}",
                    lg.log_start_offset,
                ),
                None,
                head,
                keep_segments=True,
            )
            return
        lg._frontier = fr
    lg._next_leaf = total
    lg._head = head
    if head is not None:
        lg.high_watermark = head.next_offset if total >= signed_len else lg.log_end_offset
        lg._published_length = min(signed_len, total)
        lg._open_roots = {r.index: r for r in head.roots}
    else:
        lg.high_watermark = lg.log_start_offset
    # Leaves below the signed length are authenticated lazily on first read.
    lg._leaf_ok_base = lg._min_index
    verified_below = min(checkpoint, total) if head is not None else lg._min_index
    if rebuilt_from is not None:
        verified_below = min(verified_below, rebuilt_from)
    if power_loss:
        # everything was rehashed and the tree rebuilt from the data: that tree (about
        # to be signed under the new fork) is the reference, not the old head's
        verified_below = lg._min_index
        lg._open_roots = {r.index: r for r in lg._frontier.roots()}
    verified_below = max(verified_below, lg._min_index)
    lg._leaf_ok = bytearray(verified_below - lg._min_index) + b"\x01" * (total - verified_below)

    fork_bump = power_loss
    if head is not None and power_loss:
        log.warning(
            "%s: unclean shutdown of a %s writer across a reboot: heads signed after the "
            "last durable one may be lost; truncating to %d blocks under fork %d -> %d",
            lg.path,
            head.policy.value,
            total,
            head.fork,
            head.fork + 1,
        )
    if fork_bump:
        lg._fork += 1
        lg.high_watermark = lg.log_start_offset
        lg._published_length = 0
    if fork_bump or total > lg._published_length:
        lg.commit(force_sync=True)
    elif lg._pending_nodes:  # tree nodes rebuilt below the head: repair the file
        lg._write_nodes(lg._pending_nodes)
        lg._pending_nodes = []


def open_damaged(
    lg: PartitionLog,
    exc: ArchiveDamaged,
    bases: list[int] | None,
    head: Head | None,
    keep_segments: bool = False,
) -> None:
    """Read-only: serve what is present up to the damage, never write."""
    log.error("%s", exc)
    lg.damage = exc
    if not keep_segments and bases is not None:
        for base in bases:
            seg = lg._open_segment_files(base)
            hdr = decode_index_header(lg.fs.pread_exact(seg.idx_fd, IDX_HEADER_SIZE, 0))
            size = lg.fs.size(seg.idx_fd) - IDX_HEADER_SIZE
            raw = (
                bytearray(
                    lg.fs.pread_exact(seg.idx_fd, max(0, size - size % ENTRY_SIZE), IDX_HEADER_SIZE)
                )
                if hdr
                else bytearray()
            )
            seg.first_leaf = hdr[1] if hdr else 0
            seg.log_size = lg.fs.size(seg.log_fd)
            seg.set_entries(raw)
            good = structural_prefix(lg, seg, seg.log_size)
            lg._truncate_entries(seg, good, write=False)
            lg._segments.append(seg)
        lg._segments_ready()
    if lg._segments:
        lg.log_start_offset = lg._segments[0].base_offset
        lg.log_end_offset = lg._segments[-1].next_offset()
    lg._head = head
    # Serve nothing unauthenticated: only what is below both the damage and the head.
    limit = exc.offset if exc.offset is not None else lg.log_start_offset
    if head is not None:
        limit = min(limit, head.next_offset)
    lg.high_watermark = max(lg.log_start_offset, min(limit, lg.log_end_offset))
    lg._open_roots = {r.index: r for r in head.roots} if head else {}
    lg._min_index = lg._segments[0].first_leaf if lg._segments else 0
    lg._leaf_ok_base = lg._min_index
    total = (lg._segments[-1].first_leaf + lg._segments[-1].count) if lg._segments else 0
    lg._leaf_ok = bytearray(max(0, total - lg._min_index))
    lg._next_leaf = total
    if not lg._open_roots:
        lg.high_watermark = lg.log_start_offset


def structural_prefix(lg: PartitionLog, seg: Segment, log_size: int) -> int:
    """Number of leading entries that are contiguous and inside the log file."""
    n = seg.count
    if not n:
        return 0
    sizes_total = sum(column(seg.entries, "I", 20))
    last_end = seg.positions[-1] + seg.size_of(n - 1)
    if seg.positions[0] == 0 and sizes_total == last_end and last_end <= log_size:
        return n
    # Slow path (only after a crash): walk.
    pos = 0
    for k in range(n):
        if seg.positions[k] != pos or not entry_ok(seg.entries, k):
            return k
        pos += seg.size_of(k)
        if pos > log_size:
            return k
    return n


def check_entry_against_log(lg: PartitionLog, seg: Segment, k: int) -> bool:
    if not entry_ok(seg.entries, k):
        return False
    pos, size = seg.positions[k], seg.size_of(k)
    if not size:  # removed by compaction (FORMAT.md 4a): the leaf is the tree file's
        return lg._read_node(2 * (seg.first_leaf + k)) is not None
    data = lg.fs.pread_exact(seg.log_fd, size, pos)
    if len(data) != size or not batch_ok(data):
        return False
    base = BE_I64.unpack_from(data, 0)[0]
    return base == seg.bases[k] and compute_leaf(data, size) == seg.leaf_of(k)


def batch_ok(data: bytes) -> bool:
    if len(data) < B.HEADER_SIZE or data[B.MAGIC_AT] != B.MAGIC:
        return False
    if 12 + BE_I32.unpack_from(data, B.BATCH_LENGTH)[0] != len(data):
        return False
    return B.batch_crc_ok(data)


def scan_log_tail(
    lg: PartitionLog, seg: Segment, start: int, log_size: int
) -> tuple[int, int | None]:
    """Parse whole, CRC-valid batches from `start`; add their entries. Returns (end of
    the last good batch, first leaf added or None)."""
    pos = start
    added_from: int | None = None
    expect = seg.next_offset()
    while pos + B.HEADER_SIZE <= log_size:
        hdr = lg.fs.pread_exact(seg.log_fd, B.HEADER_SIZE, pos)
        size = 12 + BE_I32.unpack_from(hdr, B.BATCH_LENGTH)[0]
        if size < B.HEADER_SIZE or pos + size > log_size:
            break
        data = lg.fs.pread_exact(seg.log_fd, size, pos)
        if not batch_ok(data):
            break
        base = BE_I64.unpack_from(data, 0)[0]
        if seg.count and base != expect:
            break
        delta = BE_I32.unpack_from(data, B.LAST_OFFSET_DELTA)[0]
        max_ts = BE_I64.unpack_from(data, B.MAX_TIMESTAMP)[0]
        entry = encode_entry(base, max_ts, pos, size, delta, compute_leaf(data, size))
        if added_from is None:
            added_from = seg.first_leaf + seg.count
        lg._add_entry(seg, entry, base, max_ts, pos)
        pos += size
        expect = base + delta + 1
    if added_from is not None:
        seg.log_size = pos
        flush_entries(lg, seg)
    return pos, added_from


def flush_entries(lg: PartitionLog, seg: Segment) -> None:
    if seg.idx_written < seg.count:
        off = seg.idx_written * ENTRY_SIZE
        lg.fs.pwrite_all(seg.idx_fd, bytes(seg.entries[off:]), IDX_HEADER_SIZE + off)
        seg.idx_written = seg.count


def stored_roots(lg: PartitionLog, length: int) -> Frontier | None:
    roots = []
    for idx in flat_tree.full_roots(2 * length):
        n = lg._read_node(idx)
        if n is None:
            return None
        roots.append(n)
    try:
        return Frontier.from_roots(roots)
    except Exception:
        return None


def frontier_at(lg: PartitionLog, length: int, *, use_stored: bool) -> Frontier | None:
    """The tree at `length` blocks. use_stored: the roots stored in the tree file (must
    be checked by the caller). Otherwise the roots at min_index from the tree file
    (durable: fsynced before retention deleted those leaves) plus the index leaf
    hashes from min_index on."""
    if length == 0:
        return Frontier()
    if use_stored:
        return stored_roots(lg, length)
    mi = lg._min_index
    fr = Frontier() if mi == 0 else stored_roots(lg, mi)
    if fr is None or length < mi:
        return None
    lg._frontier = fr
    lg._pending_nodes = []
    fold(lg, mi, length)
    return lg._frontier


def fold(lg: PartitionLog, start: int, end: int) -> None:
    """Append index leaves [start, end) to the frontier, collecting the nodes."""
    fr = lg._frontier
    nodes = lg._pending_nodes
    leaf_index = start
    while leaf_index < end:
        seg, k = lg._locate_leaf(leaf_index)
        stop = min(end - seg.first_leaf, seg.count)
        ent = seg.entries
        for kk in range(k, stop):
            o = kk * ENTRY_SIZE
            size = U32.unpack_from(ent, o + 20)[0] or compaction.leaf_size(lg, seg, kk)
            nodes.extend(fr.append(bytes(ent[o + 28 : o + 60]), size))
        leaf_index = seg.first_leaf + stop


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (itself, or a cause: a commit job wraps its OSError in a
    StorageError), or None: recovery failed for another reason."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    return None

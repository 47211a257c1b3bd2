"""Offline, full verification of archives in a data directory (`hyperkafka verify`).

Checks every batch of a partition against its index entry, its stored tree leaf, the tree
recomputed from all leaves, and the signed head (storage/FORMAT.md section 9, last row).
Read-only: opens files with O_RDONLY and never repairs. May import the standard library
and `storage`; never `broker`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from storage import batch as B
from storage.errors import ArchiveDamaged
from storage.fs import FileSystem, OsFileSystem
from storage.hashing import compute_leaf
from storage.hypercore import Frontier, Node, flat_tree, parent_node
from storage.hypercore.multisig import HeadSigner, head_manifest
from storage.log import (
    ENTRY_SIZE,
    IDX_HEADER_SIZE,
    NODE_SIZE,
    Head,
    check_head,
    decode_index_header,
    entry_ok,
    read_head_slots,
)
from storage.progress import Progress

_ENTRY = struct.Struct("<qqIIi32s")
_NODE = struct.Struct("<Q32s")


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    length: int  # blocks checked
    signed_length: int
    first_bad_offset: int | None = None
    reason: str = ""
    compacted: int = 0  # blocks removed by compaction: their leaves checked, not their bytes


def _node(fs: FileSystem, fd: int, index: int) -> tuple[int, bytes] | None:
    data = fs.pread_exact(fd, NODE_SIZE, index * NODE_SIZE)
    if len(data) != NODE_SIZE or data == bytes(NODE_SIZE):
        return None
    size, h = _NODE.unpack(data)
    return size, h


def verify_partition(path: str, public_key: HeadSigner, fs: FileSystem | None = None,
                     progress: Progress | None = None) -> VerifyResult:
    """Verify one archive directory completely. Never raises for bad data. `progress`
    counts the bytes of every batch checked. `public_key` is the single signer's key, or
    the manifest of a quorum-signed archive (its heads need a quorum of its signers)."""
    fs = fs or OsFileSystem()
    key = head_manifest(public_key).hash()
    fds: list[int] = []

    def ropen(p: str) -> int:
        fd = fs.open(p, os.O_RDONLY)
        fds.append(fd)
        return fd

    try:
        names = sorted(fs.listdir(path))
        head = None
        if "head" in names:
            head, corrupt = read_head_slots(fs, ropen(os.path.join(path, "head")))
            if head is None and corrupt:
                return VerifyResult(False, 0, 0, 0, "both head slots are corrupt")
        if head is not None:
            why = check_head(head, public_key, key)
            if why:
                return VerifyResult(False, 0, head.length, head.log_start_offset, why)
        signed = head.length if head else 0
        min_index = head.min_index if head else 0
        tree_fd = ropen(os.path.join(path, "tree")) if "tree" in names else -1
        bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
        if head is not None:
            # Leftovers of an interrupted retention (wholly below the log start, leaves
            # below the min index) are not checked; a segment wholly below the log start
            # that holds the first leaves kept (DeleteRecords up to the end of the then
            # active segment) is, as recovery keeps it (storage/recovery.py).
            def leftover(i: int, b: int) -> bool:
                if i + 1 == len(bases) or bases[i + 1] > head.log_start_offset:
                    return False
                ifd = ropen(os.path.join(path, f"{b:020d}.bidx"))
                hdr = decode_index_header(fs.pread_exact(ifd, IDX_HEADER_SIZE, 0))
                return hdr != (b, min_index)

            bases = [b for i, b in enumerate(bases) if not leftover(i, b)]
        # the tree below min_index comes from stored nodes (the head check authenticates them)
        if min_index:
            roots = []
            for ri in flat_tree.full_roots(2 * min_index):
                rn = _node(fs, tree_fd, ri) if tree_fd >= 0 else None
                if rn is None:
                    return VerifyResult(False, 0, signed, head.log_start_offset if head else 0,
                                        f"tree node {ri} below the retained range is missing")
                roots.append(Node(ri, rn[0], rn[1]))
            fr = Frontier.from_roots(roots)
        else:
            fr = Frontier()
        leaf = min_index
        expect_offset: int | None = None
        seen: list[tuple[int, int, bytes]] = []  # (offset, size, leaf hash) below the head
        bad: tuple[int, str] | None = None
        compacted = 0  # blocks removed by compaction, proven by their leaf hashes only
        for base in bases:
            lfd = ropen(os.path.join(path, f"{base:020d}.log"))
            ifd = ropen(os.path.join(path, f"{base:020d}.bidx"))
            raw_idx = _read_all(fs, ifd)
            hdr = decode_index_header(raw_idx[:IDX_HEADER_SIZE])
            if hdr is None or hdr != (base, leaf):
                bad = (base, "index header is damaged or does not continue the archive")
                break
            if expect_offset is not None and base != expect_offset:
                bad = (expect_offset, "segments are not contiguous")
                break
            entries = raw_idx[IDX_HEADER_SIZE:]
            count = len(entries) // ENTRY_SIZE
            pos = 0
            log_size = fs.size(lfd)
            for k in range(count):
                e_base, max_ts, e_pos, size, delta, e_leaf = _ENTRY.unpack_from(entries, k * ENTRY_SIZE)
                if not entry_ok(entries, k) or e_pos != pos:
                    bad = (e_base if entry_ok(entries, k) else (expect_offset or base),
                           "index entry damaged")
                    break
                if expect_offset is not None and e_base != expect_offset:
                    bad = (expect_offset, "offsets not contiguous")
                    break
                if size == 0:
                    # Removed by compaction (FORMAT.md 4a): the leaf is the tree file's.
                    node = _node(fs, tree_fd, 2 * leaf) if tree_fd >= 0 else None
                    if node is None or node[1] != e_leaf:
                        bad = (e_base, "compacted block's leaf is missing from the tree file")
                        break
                    if leaf < signed:
                        seen.append((e_base, node[0], e_leaf))
                    fr.append(e_leaf, node[0])
                    leaf += 1
                    compacted += 1
                    expect_offset = e_base + delta + 1
                    if leaf == signed and fr.tree_hash() != head.tree_hash:  # type: ignore[union-attr]
                        assert head is not None
                        bad = (_first_unauthenticated(fs, tree_fd, head, min_index, seen),
                               "tree recomputed from the data differs from the signed head")
                        break
                    continue
                data = fs.pread_exact(lfd, size, pos)
                if len(data) != size:
                    bad = (e_base, "batch missing from the segment")
                    break
                if (data[B.MAGIC_AT] != B.MAGIC or 12 + int.from_bytes(data[8:12], "big") != size
                        or not B.batch_crc_ok(data)):
                    bad = (e_base, "batch framing or CRC-32C is wrong")
                    break
                if (int.from_bytes(data[0:8], "big", signed=True) != e_base
                        or int.from_bytes(data[35:43], "big", signed=True) != max_ts
                        or int.from_bytes(data[23:27], "big", signed=True) != delta):
                    bad = (e_base, "batch header differs from its index entry")
                    break
                h = compute_leaf(data, size)
                if h != e_leaf:
                    bad = (e_base, "batch bytes do not match their leaf hash")
                    break
                if leaf < signed:
                    seen.append((e_base, size, h))
                fr.append(h, size)
                leaf += 1
                pos += size
                expect_offset = e_base + delta + 1
                if progress is not None:
                    progress.advance(size)
                if leaf == signed and fr.tree_hash() != head.tree_hash:  # type: ignore[union-attr]
                    assert head is not None
                    bad = (_first_unauthenticated(fs, tree_fd, head, min_index, seen),
                           "tree recomputed from the data differs from the signed head")
                    break
            if bad:
                break
            if pos != log_size and leaf <= signed:
                bad = (expect_offset or base, "segment holds bytes its index does not cover")
                break
        if bad is None and leaf < signed:
            bad = (expect_offset if expect_offset is not None else (head.next_offset if head else 0),
                   f"data ends at block {leaf} but the signed head covers {signed}")
        if bad is not None:
            return VerifyResult(False, leaf, signed, bad[0], bad[1])
        return VerifyResult(True, leaf, signed, compacted=compacted)
    finally:
        for fd in fds:
            fs.close(fd)


def _first_unauthenticated(fs: FileSystem, tree_fd: int, head: Head, min_index: int,
                           seen: list[tuple[int, int, bytes]]) -> int:
    """The offset of the first batch whose path (its recomputed leaf hash plus the stored
    sibling nodes) does not hash up to a signed root. Only run when the tree is wrong."""
    roots = {r.index: r for r in head.roots}
    for i, (offset, size, h) in enumerate(seen):
        cur = Node(2 * (min_index + i), size, h)
        while cur.index not in roots:
            sib = _node(fs, tree_fd, flat_tree.sibling(cur.index)) if tree_fd >= 0 else None
            if sib is None or cur.index > 2 * head.length:
                break
            s = Node(flat_tree.sibling(cur.index), sib[0], sib[1])
            left, right = (cur, s) if cur.index < s.index else (s, cur)
            cur = parent_node(left, right)
        root = roots.get(cur.index)
        if root is None or root.hash != cur.hash:
            return offset
    return seen[0][0] if seen else head.log_start_offset


def _read_all(fs: FileSystem, fd: int) -> bytes:
    return fs.pread_exact(fd, fs.size(fd), 0)



def signed_batches(path: str, public_key: HeadSigner, fs: FileSystem | None = None) -> list[bytes]:
    """Every batch covered by the archive's signed head, after a full `verify_partition`.
    Read-only (safe next to a running broker); raises ArchiveDamaged when it does not
    verify. For small archives such as the catalog."""
    fs = fs or OsFileSystem()
    res = verify_partition(path, public_key, fs)
    if not res.ok:
        raise ArchiveDamaged(f"{path}: {res.reason}", res.first_bad_offset)
    names = sorted(fs.listdir(path))
    if "head" not in names:
        return []
    fd = fs.open(os.path.join(path, "head"), os.O_RDONLY)
    try:
        head, _ = read_head_slots(fs, fd)
    finally:
        fs.close(fd)
    if head is None:
        return []
    out: list[bytes] = []
    for base in sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit()):
        lfd = fs.open(os.path.join(path, f"{base:020d}.log"), os.O_RDONLY)
        ifd = fs.open(os.path.join(path, f"{base:020d}.bidx"), os.O_RDONLY)
        try:
            entries = _read_all(fs, ifd)[IDX_HEADER_SIZE:]
            for k in range(len(entries) // ENTRY_SIZE):
                e_base, _ts, pos, size, _d, _leaf = _ENTRY.unpack_from(entries, k * ENTRY_SIZE)
                if e_base < head.log_start_offset:
                    continue
                if e_base >= head.next_offset:
                    return out
                out.append(fs.pread_exact(lfd, size, pos))
        finally:
            fs.close(lfd)
            fs.close(ifd)
    return out

"""One topic partition as a signed, append-only archive (storage/FORMAT.md is the spec).

Owns `PartitionLog`: segments and the dense batch index in memory, appends, preparing and
publishing group commits (the high watermark), reads as sendfile-ready byte ranges, lazy
authentication of old batches on first read, the replica mode of storage.follower, and
the file budget (parking). The ideas it stands on live beside it: the byte formats and
`Head` in `storage.format`, leaf hashing in `storage.hashing`, what a commit job does in
`storage.commit`, recovery at open in `storage.recovery`, retention and DeleteRecords in
`storage.retention`.

Threading: everything runs on one owner thread (the broker's event loop or its commit
thread) except `CommitJob.run`, which may run in a worker thread while appends continue
(storage.commit says what it touches). An INTERVAL writer's periodic fsync runs in a
`BackgroundSync` thread that only calls fsync on descriptors, which stay open until it was
joined (close, retention, forced sync). Open files are on a budget (storage/handles.py):
an idle log may be parked (every descriptor closed, the in-memory index kept) and reopens
its files on its next use.

May import the standard library, crc32c, `storage.hypercore`, `storage.fs`,
`storage.errors`, `storage.batch` and the modules above. Never `broker`, trio or protocol
types.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from hashlib import blake2b
from typing import cast

from storage import batch as B
from storage import compaction, recovery, retention
from storage import format as fmt
from storage.commit import BackgroundSync, CommitJob, PendingBatch, hash_jobs
from storage.epochs import EpochCache
from storage.errors import (
    ArchiveDamaged,
    BlockRemoved,
    CorruptBatch,
    LogClosed,
    NotQuorumSigned,
    OffsetOutOfRange,
    StorageError,
)
from storage.format import (
    BE_I32,
    BE_I64,
    CODE_POLICY,
    ENTRY,
    ENTRY_NO_LEAF,
    ENTRY_SIZE,
    FLAG_CLEAN,
    IDX_HEADER,
    IDX_HEADER_SIZE,
    IDX_MAGIC,
    MAX_ROOTS,
    NODE,
    NODE_SIZE,
    POLICY_CODE,
    SLOT_SIZE,
    FsyncPolicy,
    Head,
    Segment,
    check_head,
    decode_index_header,
    encode_entry,
    encode_index_header,
    entry_ok,
    read_head_slots,
    segment_name,
)
from storage.fs import FileSystem, OsFileSystem
from storage.handles import HandleCache
from storage.hashing import INLINE_HASH_BELOW, compute_leaf
from storage.hypercore import Frontier, KeyPair, Manifest, Node, archive_key, flat_tree, tree_hash
from storage.hypercore.multisig import HeadSigner
from storage.hypercore.tree import NATIVE_LEAVES
from storage.manifest_file import read_manifest

# Names other modules and tools import from here (kept where they were).
__all__ = [
    "BE_I32",
    "BE_I64",
    "CODE_POLICY",
    "ENTRY",
    "ENTRY_SIZE",
    "FLAG_CLEAN",
    "IDX_HEADER",
    "IDX_HEADER_SIZE",
    "IDX_MAGIC",
    "MAX_ROOTS",
    "NODE",
    "NODE_SIZE",
    "SLOT_SIZE",
    "BackgroundSync",
    "CommitJob",
    "FileRange",
    "FsyncPolicy",
    "Head",
    "LogConfig",
    "PartitionLog",
    "PendingBatch",
    "check_head",
    "compute_leaf",
    "decode_index_header",
    "encode_entry",
    "encode_index_header",
    "entry_ok",
    "hash_jobs",
    "read_head_slots",
    "segment_name",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogConfig:
    segment_bytes: int = 1 << 30
    segment_ms: int = 7 * 24 * 3600 * 1000
    retention_ms: int = 7 * 24 * 3600 * 1000  # -1 = forever
    retention_bytes: int = -1  # -1 = unlimited
    flush_interval_ms: int = 1000  # INTERVAL policy: max time between fsyncs


# What append reads from a batch header in one call: batchLength, magic, lastOffsetDelta,
# maxTimestamp (offsets in storage.batch), and what it writes: baseOffset, batchLength,
# partitionLeaderEpoch.
_BATCH_READ = struct.Struct(">8xi4xb6xi8xq")
assert _BATCH_READ.size == B.MAX_TIMESTAMP + 8
_BATCH_WRITE = struct.Struct(">qii")
_HEADER_SIZE = B.HEADER_SIZE
_MAGIC = B.MAGIC


# ---------------------------------------------------------------------------- ranges


@dataclass(frozen=True)
class FileRange:
    """Whole batches `[base_offset, end_offset)` at `position` in file descriptor `fd`,
    `size` bytes: hand it to os.sendfile, or `read()` it. Empty when size == 0."""

    fd: int
    position: int
    size: int
    base_offset: int
    end_offset: int

    def read(self) -> bytes:
        if not self.size:
            return b""
        data = os.pread(self.fd, self.size, self.position)
        while len(data) < self.size:  # short read on a regular file is rare but legal
            more = os.pread(self.fd, self.size - len(data), self.position + len(data))
            if not more:
                raise StorageError("segment shorter than its index")
            data += more
        return data


# ---------------------------------------------------------------------------- the log


class PartitionLog:
    """A partition archive. Create with `PartitionLog.open`."""

    def __init__(
        self, path: str, keypair: KeyPair, policy: FsyncPolicy, config: LogConfig, fs: FileSystem
    ) -> None:
        self.path = path
        self.keypair = keypair
        self.public_key = keypair.public_key
        self.key = archive_key(keypair.public_key)
        # a quorum-signed archive's manifest (its `manifest` file); None: single signer
        self.manifest: Manifest | None = None
        self._quorum_signed = False  # a manifest of several signers (`_use_manifest`)
        # how a quorum-signed archive gets a head signed: (tree hash, length, fork) ->
        # the assembled quorum signature (called from the commit job's thread, may block
        # while the replicas sign; raises when they do not). None: commits refuse to sign.
        self.quorum_sign: Callable[[bytes, int, int], bytes] | None = None
        self.policy = policy
        self.config = config
        # a segment stays below segment_bytes and below 4 GiB (positions are u32)
        self._segment_limit = min(config.segment_bytes, (1 << 32) - 1)
        self.fs = fs
        self._segments: list[Segment] = []
        self._seg_bases: list[int] = []
        # Owned by the commit job while one is in flight, else by the owner thread.
        self._frontier = Frontier()
        self._pending_nodes: list[Node] = []
        self._pending: list[PendingBatch] = []
        # a replica's verified leaf hashes of `_pending` (see `replica`); None: hash them
        self._pending_leaves: list[bytes] | None = None
        # a replica's blocks the writer's cleaner removed (FORMAT.md section 10), not yet
        # under a stored head: leaf index -> the leaf's byte size (its index entry is 0)
        self._hole_sizes: dict[int, int] = {}
        # Heads come from another node (storage.follower), never from us: `prepare_commit`
        # builds no job of its own, blocks past the last stored head are dropped at commit,
        # close and recovery (fetched again), retention keeps what the writer signed.
        self.replica = False
        self._next_leaf = 0  # blocks appended (the frontier catches up in the commit job)
        self._head: Head | None = None
        self._head_seq = 0
        self._fork = 0
        self.log_start_offset = 0
        self.log_end_offset = 0
        self.high_watermark = 0
        self._published_length = 0
        self._min_index = 0
        self._job: CommitJob | None = None
        self._sync: BackgroundSync | None = None  # INTERVAL fsync running beside commits
        self._poisoned: BaseException | None = None
        self.damage: ArchiveDamaged | None = None  # set: read-only, nothing served past it
        self._bad_offset: int | None = None  # first batch that failed authentication
        self._new_segments = False
        self._last_sync_ms = time.monotonic() * 1000
        self._last_derived_sync_ms = self._last_sync_ms
        self._dirty = False  # written since the last fsync
        # Authentication of batches that were on disk at open (FORMAT.md section 9).
        self._leaf_ok = bytearray()  # per leaf, offset by _leaf_ok_base
        self._leaf_ok_base = 0
        self._node_ok: bytearray | None = None
        self._open_roots: dict[int, Node] = {}
        self._doomed: list[Segment] = []
        self._head_fd = -1
        self._tree_fd = -1
        self._closed = False
        # File budget (storage/handles.py): parked = every descriptor closed until next use.
        self._handles: HandleCache | None = None
        self._parked = False
        self._pins = 0
        # The head on disk says "clean shutdown": the first commit must fsync a head without
        # that flag before publishing, or a power loss would hide that we signed anything.
        self._disk_clean = False
        self._cut_unsigned = False  # `open(cut_unsigned=True)`
        # blocks of a quorum-signed writer's unsigned tail its recovery cut: some replica
        # may have signed them, so the next head must be on a new fork (`next_fork`)
        self.cut_at_open = 0

    # ------------------------------------------------------------------ properties

    @property
    def fork(self) -> int:
        return self._fork

    @property
    def head(self) -> Head | None:
        """The last published head."""
        return self._head

    @property
    def length(self) -> int:
        """Number of batches appended (blocks in the archive, including unpublished)."""
        return self._next_leaf

    @property
    def min_index(self) -> int:
        """First retained block (blocks below it were dropped by retention)."""
        return self._min_index

    @property
    def committing(self) -> bool:
        """A commit (or a replica's accept) job is in flight: `held_tree_at` waits for it."""
        return self._job is not None

    @property
    def quiescent(self) -> bool:
        """Nothing for a commit to do: every appended batch is published, no commit or
        background sync is in flight, and (under `interval`) nothing written waits for a
        sync. `prepare_commit` would return None; a periodic tick can skip this log."""
        return (
            self._job is None
            and self._sync is None
            and self._next_leaf == self._published_length
            and (self._head is None or self._fork == self._head.fork)
            and not (self._dirty and self.policy is FsyncPolicy.INTERVAL)
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def retained_bytes(self) -> int:
        """Bytes of batches in the segments on disk (Kafka's partition size)."""
        return sum(s.log_size for s in self._segments)

    @property
    def writable(self) -> bool:
        """Takes appends: not closed, damaged, or poisoned by a failed write."""
        return not self._closed and self.damage is None and self._poisoned is None

    def set_config(self, config: LogConfig) -> None:
        self.config = config
        self._segment_limit = min(config.segment_bytes, (1 << 32) - 1)

    def block(self, index: int) -> bytes:
        """The stored batch at archive block (leaf) `index`, byte for byte; KeyError below
        the minimum index or at/after the number of appended blocks. Not authenticated
        here: replication peers verify every block against the signed head."""
        if index < self._min_index or index >= self._next_leaf or not self._segments:
            raise KeyError(index)
        self._ensure_open()
        seg, k = self._locate_leaf(index)
        if not 0 <= k < seg.count:
            raise KeyError(index)
        size = seg.size_of(k)
        if not size:  # removed by compaction (FORMAT.md 4a): not held here
            raise BlockRemoved(index)
        data = self.fs.pread_exact(seg.log_fd, size, seg.positions[k])
        if len(data) != size:
            raise KeyError(index)
        return bytes(data)

    def removed_runs(self, length: int) -> list[tuple[int, int]]:
        """(first block, count) of each run of blocks below `length` that are not held here
        because a cleaner removed them (size-0 entries, FORMAT.md 4a and 10), in order."""
        self._ensure_open()
        runs: list[tuple[int, int]] = []
        for seg in self._segments:
            first = seg.first_leaf
            if first >= length:
                break
            # a size is 0 only if its low byte is: find those in C, then check each
            low = bytes(seg.entries[20 : seg.count * ENTRY_SIZE : ENTRY_SIZE])
            k = low.find(0)
            while k != -1 and first + k < length:
                if not seg.size_of(k):
                    i = first + k
                    if runs and runs[-1][0] + runs[-1][1] == i:
                        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                    else:
                        runs.append((i, 1))
                k = low.find(0, k + 1)
        return runs

    # ------------------------------------------------------------------ open / recovery

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        keypair: KeyPair,
        *,
        fsync: FsyncPolicy = FsyncPolicy.INTERVAL,
        config: LogConfig | None = None,
        fs: FileSystem | None = None,
        cut_unsigned: bool = False,
        replica: bool = False,
    ) -> PartitionLog:
        """Open (and recover) the archive at `path`. `cut_unsigned`: blocks past the last
        signed head are cut instead of signed (the catalog: a change whose head was never
        signed was never applied, its caller got an error).

        A recovery write that fails (a full disk, EIO: rebuilding derived files, the
        genesis head, signing a tail) does not fail the open: the archive opens read-only
        instead, serving what its signed head covers (authenticated on read), with
        `damage` a `RecoveryFailed`; reopen it once the disk has room.

        `replica`: another node signs this archive (see `self.replica`; storage.follower
        opens it with the writer's public key only and stores the heads it verified)."""
        fs = fs or OsFileSystem()
        p = os.fspath(path)
        fs.makedirs(p)
        manifest = read_manifest(fs, p)
        self = cls(p, keypair, FsyncPolicy(fsync), config or LogConfig(), fs)
        self._set_replica(replica)
        self._use_manifest(manifest)
        # a quorum-signed archive cannot sign its tail alone: blocks past its last quorum
        # head were never acknowledged as acks=all, and are cut (docs/clusters.md)
        self._cut_unsigned = cut_unsigned or (
            manifest is not None and manifest != Manifest.default(keypair.public_key)
        )
        try:
            recovery.recover(self)
        except BaseException as exc:
            self._close_fds()
            failure = recovery.os_error_in(exc)
            if failure is None:
                raise
            self = cls(p, keypair, FsyncPolicy(fsync), config or LogConfig(), fs)
            self._set_replica(replica)
            self._use_manifest(manifest)
            try:
                recovery.open_unwritable(self, failure)
            except BaseException:
                self._close_fds()
                raise
        return self

    def _set_replica(self, replica: bool) -> None:
        self.replica = replica
        self._pending_leaves = [] if replica else None

    def _use_manifest(self, manifest: Manifest | None) -> None:
        if manifest is not None:
            self.manifest = manifest
            self.key = manifest.hash()
            self._quorum_signed = manifest != Manifest.default(self.public_key)

    @property
    def head_signer(self) -> HeadSigner:
        """What heads are checked against: the manifest of a quorum-signed archive, else
        the single signer's public key."""
        return self.manifest if self.manifest is not None else self.public_key

    def _open_rw(self, name: str) -> int:
        return self.fs.open(os.path.join(self.path, name), os.O_RDWR | os.O_CREAT)

    def _segments_ready(self) -> None:
        self._seg_bases = [s.base_offset for s in self._segments]

    def _truncate_entries(self, seg: Segment, n: int, write: bool = True) -> None:
        del seg.entries[n * ENTRY_SIZE :]
        seg.set_entries(seg.entries)
        seg.idx_written = min(seg.idx_written, n)
        if write:  # the log past these entries is rescanned (and cut) by recovery.scan_log_tail
            self.fs.ftruncate(seg.idx_fd, IDX_HEADER_SIZE + n * ENTRY_SIZE)

    def _locate_leaf(self, leaf_index: int) -> tuple[Segment, int]:
        lo, hi = 0, len(self._segments) - 1
        while lo < hi:  # segments are few; binary search on first_leaf
            mid = (lo + hi + 1) // 2
            if self._segments[mid].first_leaf <= leaf_index:
                lo = mid
            else:
                hi = mid - 1
        seg = self._segments[lo]
        return seg, leaf_index - seg.first_leaf

    def leaf_of_offset(self, offset: int) -> int:
        """The archive block (leaf) index of the stored batch holding Kafka `offset`, which
        must be readable (log start <= offset < high watermark; OffsetOutOfRange else)."""
        if not self.log_start_offset <= offset < self.high_watermark:
            raise OffsetOutOfRange(offset, self.log_start_offset, self.high_watermark)
        self._ensure_open()
        seg, i = self._find(offset)
        return seg.first_leaf + i

    def offset_of_leaf(self, leaf_index: int) -> int:
        """The base offset of block `leaf_index` (the log end offset at or past the end)."""
        if not self._segments:
            return self.log_start_offset
        total = self._segments[-1].first_leaf + self._segments[-1].count
        if leaf_index >= total:
            return self._segments[-1].next_offset()
        seg, k = self._locate_leaf(leaf_index)
        return int(seg.bases[k])

    def _open_segment_files(self, base: int) -> Segment:
        lp = os.path.join(self.path, segment_name(base, "log"))
        ip = os.path.join(self.path, segment_name(base, "bidx"))
        seg = Segment(base, 0, -1, -1, lp, ip)
        seg.log_fd = self.fs.open(lp, os.O_RDWR | os.O_CREAT)
        seg.idx_fd = self.fs.open(ip, os.O_RDWR | os.O_CREAT)
        return seg

    def _drop_segment_files(self, seg: Segment) -> None:
        self.fs.close(seg.log_fd)
        self.fs.close(seg.idx_fd)
        self.fs.unlink(seg.log_path)
        self.fs.unlink(seg.idx_path)

    # ------------------------------------------------------------------ tree file

    def _write_nodes(self, nodes: list[Node], lo: int = 0, hi: int = 0) -> None:
        """Write nodes at 40 * index. Nodes in [lo, hi) (the flat-tree range of the leaves
        just hashed) go out as one buffer: every index there is either a node created now
        or one that does not exist yet (zero). The few parents left of it, and recovery's
        nodes, are written in coalesced runs."""
        if hi > lo:
            buf = bytearray((hi - lo) * NODE_SIZE)
            rest = []
            pack = NODE.pack_into
            for n in nodes:
                if lo <= n.index < hi:
                    pack(buf, (n.index - lo) * NODE_SIZE, n.size, n.hash)
                else:
                    rest.append(n)
            # the last odd position is a parent that cannot be complete yet: leave it alone
            self.fs.pwrite_all(
                self._tree_fd, memoryview(buf)[: (hi - lo - 1) * NODE_SIZE], lo * NODE_SIZE
            )
            nodes = rest
        nodes = sorted(nodes, key=lambda n: n.index)
        i = 0
        while i < len(nodes):
            j = i
            buf = bytearray(NODE.pack(nodes[i].size, nodes[i].hash))
            while j + 1 < len(nodes) and nodes[j + 1].index == nodes[j].index + 1:
                j += 1
                buf += NODE.pack(nodes[j].size, nodes[j].hash)
            self.fs.pwrite_all(self._tree_fd, buf, nodes[i].index * NODE_SIZE)
            i = j + 1

    def _read_node(self, index: int) -> Node | None:
        data = self.fs.pread_exact(self._tree_fd, NODE_SIZE, index * NODE_SIZE)
        if len(data) != NODE_SIZE or data == bytes(NODE_SIZE):
            return None
        size, h = NODE.unpack(data)
        return Node(index, size, h)

    def node(self, index: int) -> Node | None:
        """A stored tree node (for proofs); None if never written."""
        self._ensure_open()
        return self._read_node(index)

    # ------------------------------------------------------------------ append

    def check_writable(self) -> None:
        """Raise unless the log takes writes (closed, damaged, or poisoned by a failure)."""
        if self._closed:
            raise StorageError("log is closed")
        if self.damage is not None:
            raise self.damage
        if self._poisoned is not None:
            raise StorageError(f"log failed earlier and must be reopened: {self._poisoned}")

    def append(self, batch: bytearray, *, leader_epoch: int | None = None) -> tuple[int, int]:
        """Assign offsets to `batch` (written into it in place) and append it, stamped with
        `leader_epoch` (None: the archive's own, its fork for a quorum-signed archive,
        whose leader epoch the fork is (storage/epochs.py), else 0).
        Returns (base_offset, last_offset). Invisible to readers until a head covers it."""
        if self._closed or self.damage is not None or self._poisoned is not None:
            self.check_writable()
        size = len(batch)
        if size < _HEADER_SIZE:
            raise CorruptBatch("not a record batch v2")
        batch_length, magic, delta, max_ts = _BATCH_READ.unpack_from(batch)
        if magic != _MAGIC:
            raise CorruptBatch("not a record batch v2")
        if 12 + batch_length != size:
            raise CorruptBatch("batch length does not match its size")
        if delta < 0:
            raise CorruptBatch("negative lastOffsetDelta")
        if self.cut_at_open:
            self._fork_after_cut()
        if leader_epoch is None:
            leader_epoch = self._fork if self._quorum_signed else 0
        base = self.log_end_offset
        _BATCH_WRITE.pack_into(batch, 0, base, batch_length, leader_epoch)
        return self._store(batch, size, base, delta, max_ts)

    def _store(
        self, batch: bytes | bytearray | memoryview, size: int, base: int, delta: int, max_ts: int
    ) -> tuple[int, int]:
        """Write a checked batch whose base offset is `base` (= log_end_offset) as is."""
        self._ensure_open()
        segs = self._segments
        seg = segs[-1] if segs else None
        if (
            seg is None
            or not seg.bases
            or seg.log_size + size > self._segment_limit
            or time.time() * 1000 - seg.created_ms >= self.config.segment_ms
        ):
            seg = self._active_for(size)
        pos = seg.log_size
        self.fs.pwrite_all(seg.log_fd, batch, pos)
        seg.log_size = pos + size
        seg.synced_log = False
        k = len(seg.bases)
        # in memory the leaf hash stays zero (reads do not need it; the file gets it)
        seg.entries += ENTRY_NO_LEAF.pack(base, max_ts, pos, size, delta)
        seg.bases.append(base)
        seg.max_ts.append(max_ts)
        seg.positions.append(pos)
        self._pending.append((seg.log_fd, seg.idx_fd, k, base, max_ts, pos, size, delta))
        self._next_leaf += 1
        self._leaf_ok.append(1)
        self.log_end_offset = base + delta + 1
        self._dirty = True
        return base, base + delta

    @staticmethod
    def _add_entry(seg: Segment, entry: bytes, base: int, max_ts: int, pos: int) -> None:
        seg.entries += entry
        seg.bases.append(base)
        seg.max_ts.append(max_ts)
        seg.positions.append(pos)

    def _active_for(self, size: int) -> Segment:
        """The segment a batch of `size` bytes goes to, rolling a new one when the last is
        full or old. `_store` tests the common case (room in a live segment) inline first."""
        now_ms = int(time.time() * 1000)
        if self._segments:
            seg = self._segments[-1]
            if not seg.count:
                seg.created_ms = now_ms
                return seg
            too_big = seg.log_size + size > self.config.segment_bytes
            too_old = now_ms - seg.created_ms >= self.config.segment_ms
            if not (too_big or too_old) and seg.log_size + size < (1 << 32):
                return seg
        # roll: the previous segment's buffered index entries go out with the next commit
        if self._handles is not None and not self._pins:
            # (a pinned log may be written by a worker thread, which never parks others:
            # its two new descriptors wait for the owner thread's next make_room)
            self._handles.make_room(2, keep=self)
        seg = self._open_segment_files(self.log_end_offset)
        seg.first_leaf = self._next_leaf
        self.fs.pwrite_all(seg.idx_fd, encode_index_header(seg.base_offset, seg.first_leaf), 0)
        seg.created_ms = now_ms
        self._segments.append(seg)
        self._seg_bases.append(seg.base_offset)
        self._new_segments = True
        if self._handles is not None:
            self._handles.touch(self)  # counts the two new descriptors
        return seg

    # ------------------------------------------------------------------ commit

    def prepare_commit(self, *, force_sync: bool = False) -> CommitJob | None:
        """Snapshot what is new for a group commit (owner thread, cheap). None when there
        is nothing to sign and no fsync is due. At most one job may be in flight.

        Under INTERVAL the periodic fsync is not waited for: the job starts it in a
        `BackgroundSync` and a later commit records what it made durable. `force_sync`
        waits for a running one and syncs inline.

        A replica builds jobs only for `prepare_signed` and for a forced sync (shutdown,
        recovery), which rewrites the last stored head after dropping the blocks past it."""
        if self.replica:
            if not force_sync:
                return None
            self.drop_unsigned_tail()
        return self._prepare(force_sync, background=True)

    def _reap_sync(self, wait: bool) -> int | None:
        """The derived length a finished background sync made durable (None: no sync, or
        still running and not `wait`). A failed one poisons the log (fsyncgate)."""
        sync = self._sync
        if sync is None or not (wait or sync.done()):
            return None
        sync.wait()
        self._sync = None
        if sync.error is not None:
            self._poisoned = sync.error
            raise StorageError(f"background fsync failed: {sync.error}") from sync.error
        return sync.length

    def _prepare(self, force_sync: bool, background: bool) -> CommitJob | None:
        self.check_writable()
        self._ensure_open()
        if self._job is not None:
            raise StorageError("a commit job is already in flight")
        if self.cut_at_open:
            self._fork_after_cut()
        synced = self._reap_sync(wait=force_sync or not background)
        now = time.monotonic() * 1000
        new = self._next_leaf != self._published_length or (
            self._head is not None and self._fork != self._head.fork
        )
        interval = self.config.flush_interval_ms
        policy = self.policy
        due = (
            force_sync
            or policy is FsyncPolicy.ALWAYS
            # Nothing written since the last sync: nothing is due. (Else a finished
            # background sync's head commit started another, empty, background sync, and
            # an idle log fsynced its head and started a thread on every tick.)
            or (
                policy is FsyncPolicy.INTERVAL
                and self._dirty
                and now - self._last_sync_ms >= interval
            )
        )
        background = background and due and policy is FsyncPolicy.INTERVAL and not force_sync
        if background and self._sync is not None:
            # the last interval's data is still being written back: sync again after it
            due = background = False
        if not new and not (due and self._dirty) and synced is None:
            return None
        # .bidx and tree are derived from the log: under `always` they are synced on the
        # interval only (recovery rebuilds a lagging tail), else together with the data.
        if force_sync:
            derived_due = True
        elif policy is FsyncPolicy.ALWAYS:
            derived_due = now - self._last_derived_sync_ms >= interval
        else:
            derived_due = due
        sync_fds: list[int] = []
        if self._pending:
            first_fd = self._pending[0][1]
            for seg in reversed(self._segments):  # segments the pending entries go to
                seg.idx_dirty = True
                if seg.idx_fd == first_fd:
                    break
        for seg in self._segments:
            if due and not seg.synced_log:
                sync_fds.append(seg.log_fd)
                seg.synced_log = True
            if derived_due and seg.idx_dirty:
                sync_fds.append(seg.idx_fd)
                seg.idx_dirty = False
        if due:
            self._last_sync_ms = now
            self._dirty = False
        if derived_due:
            self._last_derived_sync_ms = now
        sync_dir = due and self._new_segments
        if sync_dir:
            self._new_segments = False
        self._head_seq += 1
        derived_length = self._head.derived_length if self._head else 0
        if synced is not None:
            derived_length = max(derived_length, synced)
        job = CommitJob(
            log=self,
            frontier=self._frontier,  # advanced by the job; nothing else touches it meanwhile
            next_offset=self.log_end_offset,
            log_start_offset=self.log_start_offset,
            min_index=self._min_index,
            fork=self._fork,
            seq=self._head_seq,
            index_writes=[],
            nodes=self._pending_nodes,
            pending=self._pending,
            leaves=self._pending_leaves,
            hole_sizes=self._hole_sizes or None,
            sync_fds=sync_fds,
            sync_derived=derived_due,
            derived_length=derived_length,
            # a background sync's head is fsynced by the first commit after it finished
            sync_head=(due and not background) or self._disk_clean or synced is not None,
            sync_dir=sync_dir,
            sign=new or self._head is None,
            flags=POLICY_CODE[self.policy] << 8,
            background=background,
        )
        pending_bytes = sum(p[6] for p in self._pending)
        self._pending_nodes = []
        self._pending = []
        if self._pending_leaves is not None:
            self._pending_leaves = []
        self._disk_clean = False
        self._job = job
        if (
            not NATIVE_LEAVES
            and job.pending
            and pending_bytes < INLINE_HASH_BELOW * len(job.pending)
        ):
            # Small batches: hashlib's BLAKE2b keeps the GIL below 2 KiB, so a worker thread
            # would only fight the loop thread for it (convoy); hash here, the job keeps the
            # I/O. (The native core releases the GIL whatever the size: the job hashes.)
            job._hash_pending()
        return job

    def publish(self, job: CommitJob) -> Head:
        """Owner thread, after `job.run()` returned: the new head becomes visible."""
        if job is not self._job:
            raise StorageError("not this log's job in flight")
        self._job = None
        if not job.done or job.head is None:
            raise StorageError("commit job did not complete") from job.error
        head = job.head
        if job.sync is not None:
            self._sync = job.sync
        self._head = head
        self._published_length = head.length
        self.high_watermark = head.next_offset
        if self._hole_sizes:  # their leaves are in the tree file now
            self._hole_sizes = {i: n for i, n in self._hole_sizes.items() if i >= head.length}
        handles = self._handles
        if handles is not None and handles.total > handles.budget:
            # logs that were busy when others opened are idle now: back within budget
            handles.make_room(0, keep=self)
        return head

    def abandon(self, job: CommitJob) -> None:
        """Forget a job whose run() raised. The log is poisoned then, except when only the
        quorum signature was missing (`job.unsigned`): its blocks, index entries and tree
        nodes are written, the head slot is not, so the log stays writable with an
        unsigned tail and the next job asks for the same head (same tree, same length,
        same fork: a replica that signed it late signs it again)."""
        if job is self._job:
            self._job = None
            if job.sync is not None:
                self._sync = job.sync  # joined at close
            if job.unsigned:
                self._head_seq = job.seq - 1  # that slot was never written
                if job.sync_head:
                    self._disk_clean = True  # (the head that clears the clean flag is still due)

    def commit(self, *, force_sync: bool = False) -> Head | None:
        """prepare_commit + run + publish in a row (tests, shutdown, recovery); fsyncs
        inline, after any background sync finished. A replica drops its blocks past the
        last stored head first (it never signs)."""
        if self.replica:
            self.drop_unsigned_tail()
        job = self._prepare(force_sync, background=False)
        if job is None:
            return None
        try:
            job.run()
        except BaseException:
            self.abandon(job)
            raise
        return self.publish(job)

    # ------------------------------------------------------------------ replica

    @property
    def published_length(self) -> int:
        """Blocks covered by the last published head."""
        return self._published_length

    def append_verified(
        self, batch: bytes | bytearray | memoryview, base: int, delta: int, max_ts: int, leaf: bytes
    ) -> None:
        """Replica: store a batch as is (no offset or epoch stamped), which the caller
        checked to be the next one (`base` = log end offset) and verified to hash to `leaf`
        under a signed head. Invisible until `prepare_signed` stores a head over it."""
        self.check_writable()
        assert self._pending_leaves is not None, "not a replica"
        self._store(batch, len(batch), base, delta, max_ts)
        self._pending_leaves.append(bytes(leaf))

    def append_removed(self, base: int, delta: int, leaf: bytes, leaf_size: int) -> None:
        """Replica: record block `next leaf` as one the writer's cleaner removed (FORMAT.md
        section 10): a size-0 index entry covering offsets [base, base + delta] with the leaf
        hash and byte size a replication session verified under a signed head. No bytes.
        Invisible until `prepare_signed` stores a head over it, as `append_verified`."""
        self.check_writable()
        assert self._pending_leaves is not None, "not a replica"
        if leaf_size <= 0:
            raise StorageError("a removed block's leaf has a size")
        self._hole_sizes[self._next_leaf] = leaf_size
        self._store(b"", 0, base, delta, -1)
        self._pending_leaves.append(bytes(leaf))

    def sync_unsigned_tail(self) -> None:
        """Replica: fsync the data of the blocks past the last stored head (a replica that
        vouches for them, signing them as one of a quorum, needs them to outlive a crash)."""
        self.check_writable()
        self._ensure_open()
        for seg in self._segments:
            if seg.first_leaf + seg.count > self._published_length:
                self.fs.fsync(seg.log_fd)

    def held_tree_at(self, n: int) -> bytes | None:
        """Replica: the tree hash of the first `n` blocks held, stored or delivered after
        the stored head (None when fewer are held, or the tree is busy in a commit job)."""
        head = self._head
        stored = head.length if head is not None else 0
        if n <= stored:
            if head is not None and n == stored:
                return head.tree_hash
            nodes = [self.node(i) for i in flat_tree.full_roots(2 * n)]
            if any(x is None for x in nodes):
                return None
            return tree_hash(cast(list[Node], nodes))
        leaves = self._pending_leaves
        if self._job is not None or leaves is None or n > self._next_leaf:
            return None
        f = Frontier.from_roots(list(head.roots)) if head is not None and stored else Frontier()
        for leaf, p in zip(leaves[: n - stored], self._pending[: n - stored], strict=True):
            f.append(leaf, p[6] or self._hole_sizes[f.length])
        return f.tree_hash()

    def drop_unsigned_tail(self, keep_length: int | None = None) -> None:
        """Replica: forget blocks past the last stored head (never signed by us, fetched
        again), or past `keep_length` blocks (not below the stored head: a takeover keeps
        the signed tail it was elected with). Nothing to do while a commit job is in
        flight."""
        keep = self._published_length
        if keep_length is not None:
            if not keep <= keep_length <= self._next_leaf:
                raise StorageError(
                    f"cannot keep {keep_length} blocks: {keep} stored, {self._next_leaf} held"
                )
            keep = keep_length
        if self._next_leaf <= keep or self._job is not None:
            return
        n_keep = keep - self._published_length
        kept, kept_leaves = self._pending[:n_keep], (self._pending_leaves or [])[:n_keep]
        self._ensure_open()
        fs = self.fs
        while len(self._segments) > 1 and self._segments[-1].first_leaf >= keep:
            seg = self._segments.pop()
            self._drop_segment_files(seg)
        if self._segments:
            seg = self._segments[-1]
            n = max(0, keep - seg.first_leaf)
            if n < seg.count:
                end = int(seg.positions[n]) if n < seg.count else seg.log_size
                self._truncate_entries(seg, n)
                fs.ftruncate(seg.log_fd, end)
                seg.log_size = end
        self._segments_ready()
        self._pending = kept
        self._pending_leaves = kept_leaves
        self._pending_nodes = []
        self._hole_sizes = {}
        self._next_leaf = keep
        self.log_end_offset = (
            self._segments[-1].next_offset() if self._segments else self.log_start_offset
        )
        self.high_watermark = min(self.high_watermark, self.log_end_offset)  # revealed, unstored
        self._leaf_ok = self._leaf_ok[: max(0, keep - self._leaf_ok_base)]
        head = self._head
        self._frontier = (
            Frontier.from_roots(list(head.roots)) if head and head.length else Frontier()
        )

    def take_over(self, keypair: KeyPair, epoch: int, length: int) -> None:
        """Replica of a quorum-signed archive, owner thread: become its writer in leader
        epoch `epoch` after a failover vote elected this copy at `length` blocks (docs/
        clusters.md). Blocks held past `length` are cut (they never reached a quorum: a
        Hypercore truncate); the fork becomes `epoch`, so the next commit (with
        `quorum_sign` set) has the replicas sign the first `length` blocks on the new
        fork, and appends continue from there. The leader-epoch checkpoint of the
        archive (storage/epochs.py) records that `epoch` starts at the kept end. `keypair`: this broker's node key, one of
        the manifest's signers. Raises StorageError (nothing changed) when the archive
        is not quorum-signed, `epoch` is not newer than its fork, `length` is below its
        stored head or above what it holds, or a commit job is in flight."""
        manifest = self.manifest
        if not self.replica or manifest is None or manifest == Manifest.default(self.public_key):
            raise StorageError(f"{self.path}: not a replica of a quorum-signed archive")
        if keypair.public_key not in [s.public_key for s in manifest.signers]:
            raise StorageError(f"{self.path}: this key is not one of the archive's signers")
        if epoch <= self._fork:
            raise StorageError(f"{self.path}: epoch {epoch} is not newer than fork {self._fork}")
        if self._job is not None:
            raise StorageError(f"{self.path}: a commit job is in flight")
        self.check_writable()
        self.drop_unsigned_tail(length)  # raises (nothing changed) for a length out of range
        self.sync_unsigned_tail()
        self._begin_fork(epoch)
        self.keypair = keypair
        self.replica = False
        self._pending_leaves = None  # the writer's commit hashes its pending blocks

    def _begin_fork(self, fork: int) -> None:
        """Move to fork (= leader epoch) `fork` at the log end: the leader epochs
        (storage/epochs.py) before it end where the kept blocks end, `fork` starts there
        (the first leader's, the current fork, at the log start when none is recorded)."""
        epochs = EpochCache(self.fs, self.path)
        epochs.truncate_from_end(self.log_end_offset)
        if not epochs.entries and self.log_end_offset > self.log_start_offset:
            epochs.assign(self._fork, self.log_start_offset)
        epochs.assign(fork, self.log_end_offset)
        self._fork = fork

    def _fork_after_cut(self) -> None:
        """Before the first append or commit of a quorum-signed writer whose open cut an
        unsigned tail (`cut_at_open`), once it leads (`quorum_sign` set): `next_fork`."""
        if self.quorum_sign is not None and not self.replica and self._job is None:
            cut, fork = self.cut_at_open, self.next_fork()
            log.warning("%s: %d unsigned block(s) cut at open: its next head is on fork %d",
                        self.path, cut, fork)

    def next_fork(self) -> int:
        """Move to the next fork at the log end: what a quorum-signed writer whose open cut
        an unsigned tail does before it appends or commits again as leader, so that its
        next head (the kept blocks and what is appended after them) never disagrees
        within a fork with a head a replica signed over the cut blocks (a signature that
        came after the leader gave up, or just before it crashed: the replica's signing
        rule refuses every later head of that fork otherwise). Hypercore's truncate, as a
        failover's takeover does. Returns the new fork."""
        if self._job is not None:
            raise StorageError(f"{self.path}: a commit job is in flight")
        self._begin_fork(self._fork + 1)
        self.cut_at_open = 0
        return self._fork

    def prepare_signed(
        self, length: int, fork: int, signature: bytes, tree_hash: bytes
    ) -> CommitJob | None:
        """Replica, owner thread: the commit job that stores another node's `signature`
        over our first `length` blocks on `fork` (the caller verified it). Its `run`
        folds the verified leaf hashes and writes nothing unless they make `tree_hash`.
        Blocks past `length` stay pending; more may arrive while the job runs."""
        assert self._pending_leaves is not None, "not a replica"
        if length > self._next_leaf:
            raise StorageError(f"head covers {length} blocks, {self._next_leaf} delivered")
        self._fork = fork
        n_tail = self._next_leaf - length
        if n_tail > len(self._pending):
            raise StorageError("blocks under the new head were already committed")
        pending, leaves = self._pending, self._pending_leaves
        cut = len(pending) - n_tail
        assert len(leaves) == len(pending)
        tail = pending[cut:]
        self._pending, self._pending_leaves = pending[:cut], leaves[:cut]
        next_offset = tail[0][3] if tail else self.log_end_offset
        try:
            job = self._prepare(True, background=True)
        except BaseException:
            self._pending, self._pending_leaves = pending, leaves
            raise
        if job is None:  # pragma: no cover - new blocks always make a job
            self._pending, self._pending_leaves = pending, leaves
            return None
        self._pending, self._pending_leaves = tail, leaves[cut:]
        job.next_offset = next_offset
        job.remote_signature = signature
        job.expect_tree = (length, tree_hash)
        return job

    def withdraw(self, job: CommitJob) -> None:
        """Replica: forget a `prepare_signed` job that never ran (nothing was written): back
        to the last stored head, the blocks after it dropped (they are fetched again)."""
        self.abandon(job)
        self._head_seq = job.seq - 1  # that slot was never written
        self.drop_unsigned_tail()

    def bad_block(self) -> int | None:
        """The block of the first stored batch that failed authentication on read, if any."""
        bad = self._bad_offset
        if bad is None or not self._segments:
            return None
        seg, k = self._find(bad)
        return seg.first_leaf + k

    def repair_block(self, index: int, value: bytes) -> None:
        """Overwrite stored block `index` with `value`, which the caller verified against
        our signed head (a replica's copy damaged on disk, fetched again): data and index
        entry, fsynced. The next read authenticates it again. KeyError outside the signed
        blocks; ValueError when `value` is not the size or base offset stored there."""
        if not self._min_index <= index < self._published_length:
            raise KeyError(index)
        self._ensure_open()
        seg, k = self._locate_leaf(index)
        size = seg.size_of(k)
        if len(value) != size:
            raise ValueError(f"repair of block {index}: {len(value)} bytes, stored {size}")
        pos = int(seg.positions[k])
        base = BE_I64.unpack_from(value, B.BASE_OFFSET)[0]
        if base != int(seg.bases[k]):
            raise ValueError(f"repair of block {index}: base offset {base}")
        delta = BE_I32.unpack_from(value, B.LAST_OFFSET_DELTA)[0]
        max_ts = BE_I64.unpack_from(value, B.MAX_TIMESTAMP)[0]
        entry = encode_entry(base, max_ts, pos, size, delta, compute_leaf(value, size))
        self.fs.pwrite_all(seg.log_fd, value, pos)
        self.fs.pwrite_all(seg.idx_fd, entry, IDX_HEADER_SIZE + k * ENTRY_SIZE)
        seg.entries[k * ENTRY_SIZE : (k + 1) * ENTRY_SIZE] = entry
        self.fs.fsync(seg.log_fd)
        self.fs.fsync(seg.idx_fd)
        li = index - self._leaf_ok_base
        if 0 <= li < len(self._leaf_ok):
            self._leaf_ok[li] = 0
        if self._bad_offset == base:
            self._bad_offset = None

    # ------------------------------------------------------------------ reads

    def _find(self, offset: int) -> tuple[Segment, int]:
        si = bisect.bisect_right(self._seg_bases, offset) - 1
        seg = self._segments[si]
        return seg, bisect.bisect_right(seg.bases, offset) - 1

    def read(self, offset: int, max_bytes: int, *, end: int | None = None) -> FileRange:
        """Whole batches starting with the one containing `offset`, up to max_bytes (at
        least one batch), never past the high watermark, within one segment; with `end`
        (a batch boundary: the last stable offset), none starting at or past it."""
        if self._closed:  # its segments are gone: never an IndexError from a stale reference
            raise LogClosed(f"{self.path}: the log is closed")
        hwm = self.high_watermark
        if self._bad_offset is not None:
            hwm = min(hwm, self._bad_offset)
        if offset < self.log_start_offset or offset > self.high_watermark:
            raise OffsetOutOfRange(offset, self.log_start_offset, self.high_watermark)
        if end is not None and end < hwm:
            if offset >= end:
                return FileRange(-1, 0, 0, offset, offset)
            hwm = end
        if offset >= hwm:
            if (
                self._bad_offset is not None
                and offset >= self._bad_offset
                and offset < self.high_watermark
            ):
                raise CorruptBatch("stored batch fails authentication", self._bad_offset)
            return FileRange(-1, 0, 0, offset, offset)
        self._ensure_open()
        seg, i = self._find(offset)
        if compaction.removed(seg, i):  # FORMAT.md 4a: served from the next batch kept
            kept = compaction.next_present(self, seg, i, hwm)
            if kept is None:
                return FileRange(-1, 0, 0, offset, hwm)
            seg, i = kept
        end_i = bisect.bisect_left(seg.bases, hwm, i)
        start = seg.positions[i]
        limit = start + max_bytes
        e = bisect.bisect_right(seg.positions, limit, i + 1, end_i)
        t = end_i if (e == end_i and seg.end_of(end_i - 1) <= limit) else max(i + 1, e - 1)
        t = self._authenticate(seg, i, t)
        if t == i:
            raise CorruptBatch("stored batch fails authentication", int(seg.bases[i]))
        end = seg.end_of(t - 1)
        end_offset = int(seg.bases[t]) if t < seg.count else seg.next_offset()
        return FileRange(seg.log_fd, start, end - start, int(seg.bases[i]), end_offset)

    def read_bytes(self, offset: int, max_bytes: int) -> bytes:
        return self.read(offset, max_bytes).read()

    def _authenticate(self, seg: Segment, i: int, t: int) -> int:
        """Check entries [i, t) of `seg` not yet authenticated; return the end of the
        authenticated prefix (t when all hold)."""
        lo = seg.first_leaf + i - self._leaf_ok_base
        hi = seg.first_leaf + t - self._leaf_ok_base
        if self._leaf_ok.find(0, lo, hi) < 0:
            return t
        for k in range(i, t):
            li = seg.first_leaf + k - self._leaf_ok_base
            if self._leaf_ok[li]:
                continue
            if not self._authenticate_leaf(seg, k):
                bad = int(seg.bases[k])
                if self._bad_offset is None or bad < self._bad_offset:
                    self._bad_offset = bad
                    log.error(
                        "%s: batch at offset %d fails authentication; not serving it "
                        "or anything after it",
                        self.path,
                        bad,
                    )
                return k
            self._leaf_ok[li] = 1
        return t

    def _authenticate_leaf(self, seg: Segment, k: int) -> bool:
        """Leaf hash of the stored bytes, then up the stored tree to a trusted node (a root
        of the head verified at open, or a node authenticated before)."""
        leaf_index = seg.first_leaf + k
        size = seg.size_of(k)
        if not size:
            return True  # removed by compaction: no bytes of it are served
        data = self.fs.pread_exact(seg.log_fd, size, seg.positions[k])
        if len(data) != size:
            return False
        cur = Node(2 * leaf_index, size, compute_leaf(data, size))
        if self._node_ok is None:
            # every node under the roots verified at open has an index below 2 * length
            top = max((flat_tree.right_span(i) for i in self._open_roots), default=-1)
            self._node_ok = bytearray(top + 1)
        ok = self._node_ok
        path: list[int] = []
        while True:
            idx = cur.index
            root = self._open_roots.get(idx)
            if root is not None:
                good = root.hash == cur.hash and root.size == cur.size
                break
            if idx < len(ok) and ok[idx]:
                stored = self._read_node(idx)
                good = stored is not None and stored.hash == cur.hash and stored.size == cur.size
                break
            if idx >= len(ok):
                return False  # above every root verified at open: not ours to judge
            sib = self._read_node(flat_tree.sibling(idx))
            if sib is None:
                return False
            path.append(sib.index)
            path.append(idx)
            left, right = (cur, sib) if idx < sib.index else (sib, cur)
            h = blake2b(
                b"\x01" + (left.size + right.size).to_bytes(8, "little") + left.hash + right.hash,
                digest_size=32,
            ).digest()
            cur = Node(flat_tree.parent(idx), left.size + right.size, h)
        if good:
            for idx in path:
                if idx < len(ok):
                    ok[idx] = 1
            # the sibling's stored hash is now authenticated, but its stored bytes on disk
            # must equal what we read; they do, we read them from the tree file.
        return good

    def batch_for_timestamp(self, timestamp_ms: int) -> bytes | None:
        """The first batch whose maxTimestamp >= timestamp_ms and that holds an offset at
        or above the log start (the broker scans records; those below the start that
        DeleteRecords left in the batch are its to skip)."""
        hwm, start = self.high_watermark, self.log_start_offset
        for seg in self._segments:
            if not seg.count or seg.bases[0] >= hwm:
                break
            for k, ts in enumerate(seg.max_ts):
                if seg.bases[k] >= hwm:
                    return None
                if ts >= timestamp_ms and self._batch_end(seg, k) > start and seg.size_of(k):
                    return self.read_bytes(max(int(seg.bases[k]), start), 1)
        return None

    @staticmethod
    def _batch_end(seg: Segment, k: int) -> int:
        """The offset after the last one of batch k of `seg`."""
        return int(seg.bases[k + 1]) if k + 1 < seg.count else seg.next_offset()

    def batch_with_max_timestamp(self) -> bytes | None:
        """The first batch holding the largest maxTimestamp below the high watermark."""
        best: tuple[int, int] | None = None
        hwm, start = self.high_watermark, self.log_start_offset
        for seg in self._segments:
            for k, ts in enumerate(seg.max_ts):
                base = int(seg.bases[k])
                if base >= hwm:
                    break
                if self._batch_end(seg, k) <= start or not seg.size_of(k):
                    continue  # wholly below the log start (DeleteRecords), or compacted
                if best is None or ts > best[0]:
                    best = (ts, max(base, start))
        return None if best is None else self.read_bytes(best[1], 1)

    def batch_headers(self, start_offset: int = 0) -> Iterator[bytes]:
        """Raw 61-byte headers of the batches from the one containing start_offset up to
        the log end (including appended but unpublished ones), for rebuilding producer
        state. Not authenticated (the broker only uses them as hints)."""
        for seg in list(self._segments):
            if seg.count and seg.next_offset() <= start_offset:
                continue
            k = max(0, bisect.bisect_right(seg.bases, start_offset) - 1)
            if k < seg.count:
                self._ensure_open()  # a log parked between two segments opens again
            for kk in range(k, seg.count):
                if seg.size_of(kk):  # a compacted block has no bytes here
                    yield self.fs.pread_exact(seg.log_fd, B.HEADER_SIZE, seg.positions[kk])

    # ------------------------------------------------------------------ retention

    def apply_retention(self, now_ms: int) -> int:
        """Drop whole old segments by retention_ms / retention_bytes (storage.retention);
        the number dropped."""
        return retention.apply_retention(self, now_ms)

    def drop_segments_below(self, offset: int) -> int:
        """Drop the whole segments that end at or below `offset` as retention drops them
        (storage.retention); the number dropped."""
        return retention.drop_segments_below(self, offset)

    def delete_records_below(self, offset: int) -> int:
        """Kafka's DeleteRecords (storage.retention): `offset` becomes the log start offset;
        returns the new log start."""
        return retention.delete_records_below(self, offset)

    def roll(self) -> None:
        """Make the next append start a new segment (when the active one holds anything).
        Done by aging the active segment past segment_ms, which the append path already
        checks, so the hot path stays as it is."""
        if self._segments and self._segments[-1].count:
            self._segments[-1].created_ms = -(1 << 80)

    def _close_doomed(self) -> None:
        """Close the descriptors of segments dropped earlier (retention, compaction): kept
        open until now as read ranges handed out before the drop may still use them."""
        for seg in self._doomed:
            self.fs.close(seg.log_fd)
            self.fs.close(seg.idx_fd)
        self._doomed = []

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Commit pending data, make everything durable, mark the head clean, close."""
        if self._closed:
            return
        try:
            if self.damage is None and self._poisoned is None and self._job is None:
                self._ensure_open()  # a parked log writes its clean head too
                # a quorum-signed tail no quorum signed (nobody to ask at shutdown) stays
                # durable past the clean head below; the next open cuts it. Its signer is
                # not asked: it reaches the replicas through the event loop, which may be
                # the very thread waiting for this close (Store.close from a broker's
                # shutdown: asked, the close waited for ever).
                self.quorum_sign = None
                with contextlib.suppress(NotQuorumSigned):
                    self.commit(force_sync=True)
                if self._head is not None:
                    for seg in self._segments:
                        self.fs.fsync(seg.log_fd)
                        self.fs.fsync(seg.idx_fd)
                    self.fs.fsync(self._tree_fd)
                    h = self._head
                    self._head_seq += 1
                    clean = Head(
                        h.fork,
                        h.length,
                        h.byte_length,
                        h.tree_hash,
                        h.signature,
                        h.next_offset,
                        h.log_start_offset,
                        h.min_index,
                        h.roots,
                        self._head_seq,
                        FLAG_CLEAN | (POLICY_CODE[self.policy] << 8),
                        fmt.BOOT_ID,
                        int(time.time() * 1000),
                        h.length,
                    )
                    self.fs.pwrite_all(
                        self._head_fd, clean.encode(), (self._head_seq % 2) * SLOT_SIZE
                    )
                    self.fs.fsync(self._head_fd)
        finally:
            self._closed = True
            self._close_fds()

    def discard(self) -> None:
        """Close without writing anything: a log replaced by a fresh open of the same
        files (a partition a disk error took offline, reopened), whose head it must not
        overwrite."""
        self._closed = True
        self._close_fds()

    def _close_fds(self) -> None:
        if self._sync is not None:  # never close a descriptor under a running fsync
            self._sync.wait()
            self._sync = None
        for seg in self._segments + self._doomed:
            for fd in (seg.log_fd, seg.idx_fd):
                if fd >= 0:
                    self.fs.close(fd)
            seg.log_fd = seg.idx_fd = -1
        self._segments = []
        self._doomed = []
        for fd in (self._head_fd, self._tree_fd):
            if fd >= 0:
                self.fs.close(fd)
        self._head_fd = self._tree_fd = -1
        self._parked = False
        if self._handles is not None:
            self._handles.forget(self)

    # ------------------------------------------------------------------ file budget

    def attach_handles(self, handles: HandleCache) -> None:
        """Put this (open) log's files on `handles`' budget: from now on it may be parked
        when idle, and it parks others, least recently used first, when it reopens."""
        self._handles = handles
        if self._head_fd >= 0:
            handles.touch(self)
            handles.make_room(0, keep=self)

    def detach_handles(self) -> None:
        """Take this log off its budget (shutdown closes many logs from several threads,
        where none may park another)."""
        if self._handles is not None:
            self._handles.forget(self)
            self._handles = None

    def open_fds(self) -> int:
        """Descriptors this log holds now."""
        if self._head_fd < 0:
            return 0
        return 2 + 2 * (len(self._segments) + len(self._doomed))

    def parkable(self) -> bool:
        """Nothing refers to this log's descriptors but the log: no commit job, no
        background fsync running (a finished one is reaped by the next commit as usual:
        it holds only its outcome), no appended batch waiting for a job (`_pending` names
        its descriptors), no pin."""
        return (
            self._head_fd >= 0
            and not self._closed
            and self._pins == 0
            and self._job is None
            and (self._sync is None or self._sync.done())
            and not self._pending
        )

    @property
    def parked(self) -> bool:
        return self._parked

    def park(self) -> None:
        """Close every descriptor, keep everything in memory; the next use reopens them.
        Owner thread, only when `parkable()`.

        Data written through a descriptor closed here and not yet fsynced (`synced_log`,
        `idx_dirty`, the tree under `always`) is still made durable by the next fsync on
        the descriptor that the next use opens: on Linux dirty pages belong to the file
        (its inode's page cache), not to the descriptor that wrote them, and fsync/
        fdatasync on any descriptor of the file writes them all back. A writeback error
        that happened while no descriptor was open is reported to the next fsync (Linux
        4.16 and later report an error no one has seen yet to a later opener), so the
        fsyncgate rule (a failed fsync poisons the log) still holds."""
        if not self.parkable():
            raise StorageError(f"{self.path}: log is in use and cannot be parked")
        fs = self.fs
        for seg in self._segments + self._doomed:
            for fd in (seg.log_fd, seg.idx_fd):
                if fd >= 0:
                    fs.close(fd)
            seg.log_fd = seg.idx_fd = -1
        # FileRanges of dropped segments were consumed synchronously (a sendfile owns a
        # dup, broker/sendfile.py): nothing reads the doomed descriptors any more.
        self._doomed = []
        for fd in (self._head_fd, self._tree_fd):
            if fd >= 0:
                fs.close(fd)
        self._head_fd = self._tree_fd = -1
        self._parked = True
        if self._handles is not None:
            self._handles.forget(self)

    def _ensure_open(self) -> None:
        """Reopen a parked log's files (owner thread), and mark the log recently used."""
        if self._parked:
            self._unpark()
        if self._handles is not None:
            self._handles.touch(self)

    def _unpark(self) -> None:
        if self._closed:
            raise StorageError("log is closed")
        if self._handles is not None:
            self._handles.make_room(2 + 2 * len(self._segments), keep=self)
        fs = self.fs
        # O_RDWR without O_CREAT: a file that vanished while parked is an error, never a
        # fresh empty file served as if it held the data.
        opened: list[int] = []
        try:
            head_fd = fs.open(os.path.join(self.path, "head"), os.O_RDWR)
            opened.append(head_fd)
            tree_fd = fs.open(os.path.join(self.path, "tree"), os.O_RDWR)
            opened.append(tree_fd)
            fds: list[tuple[int, int]] = []
            for seg in self._segments:
                log_fd = fs.open(seg.log_path, os.O_RDWR)
                opened.append(log_fd)
                idx_fd = fs.open(seg.idx_path, os.O_RDWR)
                opened.append(idx_fd)
                fds.append((log_fd, idx_fd))
        except OSError as exc:
            for fd in opened:
                fs.close(fd)
            raise StorageError(f"{self.path}: cannot reopen the archive's files: {exc}") from exc
        self._head_fd, self._tree_fd = head_fd, tree_fd
        for seg, (log_fd, idx_fd) in zip(self._segments, fds, strict=True):
            seg.log_fd, seg.idx_fd = log_fd, idx_fd
        self._parked = False

    def pin(self) -> None:
        """Owner thread: open the files and keep them open until `unpin` (a worker thread
        is about to write this log)."""
        self._ensure_open()
        self._pins += 1

    def unpin(self) -> None:
        self._pins -= 1

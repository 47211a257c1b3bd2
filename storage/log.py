"""One topic partition as a signed, append-only archive (storage/FORMAT.md is the spec).

Owns: segments, the dense batch index, the tree-node file, the two-slot head file, group
commit with fsync policies, the high watermark, reads as sendfile-ready byte ranges,
recovery at open, lazy authentication of old batches on first read, and retention.

Threading: everything runs on one owner thread (the broker's event loop) except
`CommitJob.run`, which may run in a worker thread while appends continue. The job only
touches what `prepare_commit` handed it (copies of the frontier and of the new index
bytes and tree nodes, and descriptors that stay open while a job is in flight) plus the
head file, which nothing else writes while a job is in flight.
An INTERVAL writer's periodic fsync runs in a `BackgroundSync` thread that only calls
fsync on descriptors, which stay open until it was joined (close, retention, forced sync).
Open files are on a budget (storage/handles.py): an idle log may be parked (every
descriptor closed, the in-memory index kept) and reopens its files on its next use.
A job hashes a large span's leaves with helper threads (`hash_leaves`, a pool shared by
every log), which only read the job's view of that span and are done before the job goes on.

May import the standard library, crc32c, `storage.hypercore`, `storage.fs`,
`storage.errors`, `storage.batch`. Never `broker`, trio or protocol types.
"""

from __future__ import annotations

import bisect
import enum
import logging
import os
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import blake2b

import crc32c

from storage import batch as B
from storage import timing
from storage.errors import (
    ArchiveDamaged,
    CorruptBatch,
    OffsetOutOfRange,
    RecoveryFailed,
    StorageError,
)
from storage.fs import FileSystem, OsFileSystem
from storage.handles import HandleCache
from storage.hypercore import (
    Frontier,
    KeyPair,
    Node,
    archive_key,
    flat_tree,
    sign_head,
    tree_hash,
    verify_head,
)

log = logging.getLogger(__name__)


class FsyncPolicy(enum.StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


_POLICY_CODE = {FsyncPolicy.ALWAYS: 0, FsyncPolicy.INTERVAL: 1, FsyncPolicy.NEVER: 2}
_CODE_POLICY = {v: k for k, v in _POLICY_CODE.items()}


@dataclass(frozen=True)
class LogConfig:
    segment_bytes: int = 1 << 30
    segment_ms: int = 7 * 24 * 3600 * 1000
    retention_ms: int = 7 * 24 * 3600 * 1000  # -1 = forever
    retention_bytes: int = -1  # -1 = unlimited
    flush_interval_ms: int = 1000  # INTERVAL policy: max time between fsyncs


# ---------------------------------------------------------------------------- formats

IDX_MAGIC = b"HKBIDX01"
IDX_HEADER_SIZE = 64
ENTRY_SIZE = 64
_IDX_HEADER = struct.Struct("<8sqQ36x")  # 60 bytes, then crc
_ENTRY = struct.Struct("<qqIIi32s")  # 60 bytes, then crc
_U32 = struct.Struct("<I")
# An entry as append keeps it in memory: leaf hash and CRC zero (only the file gets them).
_ENTRY_NO_LEAF = struct.Struct("<qqIIi36x")
_BE_I32 = struct.Struct(">i")
_BE_I64 = struct.Struct(">q")
# What append reads from a batch header in one call: batchLength, magic, lastOffsetDelta,
# maxTimestamp (offsets in storage.batch), and what it writes: baseOffset, batchLength,
# partitionLeaderEpoch.
_BATCH_READ = struct.Struct(">8xi4xb6xi8xq")
assert _BATCH_READ.size == B.MAX_TIMESTAMP + 8
_BATCH_WRITE = struct.Struct(">qii")
_HEADER_SIZE = B.HEADER_SIZE
_MAGIC = B.MAGIC

HEAD_MAGIC = b"HKHEAD01"
SLOT_SIZE = 4096
_SLOT_FIXED = struct.Struct("<8sIIQQQQ32s68sqqQ16sqQI")  # 208 bytes
_ROOT = struct.Struct("<QQ32s")
FLAG_CLEAN = 1
MAX_ROOTS = 64
NODE_SIZE = 40
_NODE = struct.Struct("<Q32s")

LEAF_PREFIX = b"\x00"
INLINE_HASH_BELOW = 4096  # mean batch size under which prepare_commit hashes inline
PARALLEL_HASH_MIN = 512 * 1024  # a job hashing less than this uses one thread
HASH_CHUNK = 256 * 1024  # bytes of batches a hashing thread claims at a time


def segment_name(base_offset: int, ext: str) -> str:
    return f"{base_offset:020d}.{ext}"


def compute_leaf(data: bytes | bytearray | memoryview, size: int) -> bytes:
    """Hypercore leaf hash, without concatenating (no copy of a large batch)."""
    if size < 4096:  # one call is cheaper than three for small batches
        return blake2b(LEAF_PREFIX + size.to_bytes(8, "little") + data, digest_size=32).digest()
    h = blake2b(digest_size=32)
    h.update(LEAF_PREFIX + size.to_bytes(8, "little"))
    h.update(data)
    return h.digest()


_leaf_pool: ThreadPoolExecutor | None = None
_leaf_pool_lock = threading.Lock()
# Threads that may hash leaves beside a commit job's own: the job's thread plus these use
# every core (2 here; BLAKE2b is the bulk of a commit, and it releases the GIL above 2 KiB)
# when the machine leaves them idle (`idle_helpers`).
LEAF_HELPERS = max(1, min(3, (os.cpu_count() or 2) - 1))


def idle_helpers() -> int:
    """How many leaf-hashing helpers may run now: one per core the machine leaves idle (by
    the 1-minute load average), at most LEAF_HELPERS. A helper on a busy core does not
    hash faster; it only adds GIL hand-offs (measured at load 8 on 2 cores: wall time
    unchanged, +10-20% CPU per GB), so on a saturated machine the job hashes alone."""
    try:
        idle = (os.cpu_count() or 1) - os.getloadavg()[0]
    except OSError:
        return LEAF_HELPERS
    return max(0, min(LEAF_HELPERS, int(idle)))


def _helpers() -> ThreadPoolExecutor:
    global _leaf_pool
    with _leaf_pool_lock:
        if _leaf_pool is None:
            _leaf_pool = ThreadPoolExecutor(LEAF_HELPERS, thread_name_prefix="hk-leaf-hash")
        return _leaf_pool


def _hash_range(view: memoryview, items: Sequence[tuple[int, int]], leaves: list[bytes],
                lo: int, hi: int) -> None:
    for t in range(lo, hi):
        o, size = items[t]
        leaves[t] = compute_leaf(view[o : o + size], size)


def _hash_chunks(view: memoryview, items: Sequence[tuple[int, int]], leaves: list[bytes],
                 chunks: Iterator[int], step: int) -> None:
    """Hash the chunks of `items` claimed from the shared iterator `chunks` (next() is
    atomic under the GIL) into `leaves`."""
    n = len(items)
    for lo in chunks:
        _hash_range(view, items, leaves, lo, min(lo + step, n))


def hash_leaves(view: memoryview, items: Sequence[tuple[int, int]],
                consume: Callable[[list[bytes], int, int], None],
                helpers: int | None = None) -> None:
    """Leaf hashes of the batches at `items` ((offset in view, size) each), handed to
    `consume(leaves, lo, hi)` on this thread, in order, as ranges of them are ready.

    A large run of large batches is shared with helper threads: every thread claims chunks
    in order from one iterator, and this one, after each chunk, consumes whatever prefix is
    ready, so the (sequential) folding overlaps the helpers' hashing. Small batches would
    only fight over the GIL (BLAKE2b keeps it below 2 KiB): they are hashed here alone.
    `helpers`: how many helper threads to use (default: `idle_helpers()`)."""
    n = len(items)
    leaves = [b""] * n
    total = sum(size for _, size in items)
    if total < PARALLEL_HASH_MIN or total < INLINE_HASH_BELOW * n:
        helpers = 0
    elif helpers is None:
        helpers = idle_helpers()
    if not helpers:
        _hash_range(view, items, leaves, 0, n)
        consume(leaves, 0, n)
        return
    step = max(1, HASH_CHUNK * n // total)
    chunks = iter(range(0, n, step))
    pool = _helpers()
    futures: list[Future[None]] = [
        pool.submit(_hash_chunks, view, items, leaves, chunks, step)
        for _ in range(min(helpers, LEAF_HELPERS))
    ]
    done = 0
    try:
        for lo in chunks:
            _hash_range(view, items, leaves, lo, min(lo + step, n))
            ready = done
            while ready < n and leaves[ready]:  # a helper stores a leaf once it is complete
                ready += 1
            if ready > done:
                consume(leaves, done, ready)
                done = ready
    finally:
        # even when this thread failed: the helpers must be done with `view` before the
        # caller unmaps it
        for f in futures:
            f.result()
    if done < n:
        consume(leaves, done, n)


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


BOOT_ID = _boot_id()


@dataclass(frozen=True)
class Head:
    """A signed head as stored in a head slot."""

    fork: int
    length: int
    byte_length: int
    tree_hash: bytes
    signature: bytes
    next_offset: int
    log_start_offset: int
    min_index: int
    roots: tuple[Node, ...]
    seq: int = 0
    flags: int = 0
    boot_id: bytes = bytes(16)
    written_ms: int = 0
    derived_length: int = 0  # blocks whose .bidx entries and tree nodes were fsynced

    @property
    def clean(self) -> bool:
        return bool(self.flags & FLAG_CLEAN)

    @property
    def policy(self) -> FsyncPolicy:
        return _CODE_POLICY.get((self.flags >> 8) & 0xFF, FsyncPolicy.NEVER)

    def encode(self) -> bytes:
        if len(self.roots) > MAX_ROOTS:
            raise StorageError("too many roots")
        body = bytearray(SLOT_SIZE)
        _SLOT_FIXED.pack_into(
            body,
            0,
            HEAD_MAGIC,
            0,
            self.flags,
            self.seq,
            self.fork,
            self.length,
            self.byte_length,
            self.tree_hash,
            self.signature,
            self.next_offset,
            self.log_start_offset,
            self.min_index,
            self.boot_id,
            self.written_ms,
            self.derived_length,
            len(self.roots),
        )
        pos = _SLOT_FIXED.size
        for r in self.roots:
            _ROOT.pack_into(body, pos, r.index, r.size, r.hash)
            pos += _ROOT.size
        _U32.pack_into(body, 8, crc32c.crc32c(memoryview(body)[12:]))
        return bytes(body)

    @classmethod
    def decode(cls, slot: bytes) -> Head | None:
        """None when the slot is empty or fails its CRC (torn)."""
        if len(slot) < SLOT_SIZE or slot[:8] != HEAD_MAGIC:
            return None
        (crc,) = _U32.unpack_from(slot, 8)
        if crc32c.crc32c(memoryview(slot)[12:SLOT_SIZE]) != crc:
            return None
        (_, _, flags, seq, fork, length, byte_length, th, sig, nxt, lso, mi, boot, ms, dl,
         nroots) = _SLOT_FIXED.unpack_from(slot, 0)
        if nroots > MAX_ROOTS:
            return None
        roots = tuple(
            Node(*_ROOT.unpack_from(slot, _SLOT_FIXED.size + i * _ROOT.size)) for i in range(nroots)
        )
        return cls(fork, length, byte_length, th, sig, nxt, lso, mi, roots, seq, flags, boot, ms,
                   dl)


def read_head_slots(fs: FileSystem, fd: int) -> tuple[Head | None, bool]:
    """(best valid head, whether a non-empty slot failed its check)."""
    data = fs.pread_exact(fd, 2 * SLOT_SIZE, 0)
    best: Head | None = None
    corrupt = False
    for i in range(2):
        slot = data[i * SLOT_SIZE : (i + 1) * SLOT_SIZE]
        h = Head.decode(slot)
        if h is None:
            if slot.strip(b"\0"):
                corrupt = True
            continue
        if best is None or h.seq > best.seq:
            best = h
    return best, corrupt


def check_head(head: Head, public_key: bytes, key: bytes) -> str | None:
    """Why a head does not verify, or None."""
    try:
        if tree_hash(head.roots) != head.tree_hash:
            return "head roots do not hash to the head's tree hash"
        if flat_tree.full_roots(2 * head.length) != [r.index for r in head.roots]:
            return "head roots are not the roots of its length"
        if sum(r.size for r in head.roots) != head.byte_length:
            return "head byte length does not match its roots"
    except Exception as exc:  # malformed roots from disk: report, do not crash
        return f"head roots malformed: {exc}"
    if head.length and not verify_head(
        public_key, key, head.tree_hash, head.length, head.fork, head.signature
    ):
        return "head signature does not verify"
    return None


def encode_index_header(base_offset: int, first_leaf: int) -> bytes:
    body = _IDX_HEADER.pack(IDX_MAGIC, base_offset, first_leaf)
    return body + _U32.pack(crc32c.crc32c(body))


def decode_index_header(data: bytes) -> tuple[int, int] | None:
    if len(data) < IDX_HEADER_SIZE or data[:8] != IDX_MAGIC:
        return None
    if crc32c.crc32c(data[:60]) != _U32.unpack_from(data, 60)[0]:
        return None
    _, base, first = _IDX_HEADER.unpack_from(data, 0)
    return base, first


def encode_entry(
    base: int, max_ts: int, position: int, size: int, last_delta: int, leaf: bytes
) -> bytes:
    body = _ENTRY.pack(base, max_ts, position, size, last_delta, leaf)
    return body + _U32.pack(crc32c.crc32c(body))


def entry_ok(entries: bytes | bytearray | memoryview, k: int) -> bool:
    o = k * ENTRY_SIZE
    mv = memoryview(entries)
    return bool(crc32c.crc32c(mv[o : o + 60]) == _U32.unpack_from(entries, o + 60)[0])


def _column(entries: bytes | bytearray, typecode: str, byte_offset: int) -> array:  # type: ignore[type-arg]
    """Pull one fixed-offset column out of the 64-byte entries with a strided copy."""
    out: array = array(typecode)  # type: ignore[type-arg]
    n = len(entries) // ENTRY_SIZE
    if not n:
        return out
    width = out.itemsize
    if sys.byteorder == "little" and byte_offset % width == 0:
        mv = memoryview(entries)[: n * ENTRY_SIZE].cast(typecode)  # type: ignore[call-overload]
        step = ENTRY_SIZE // width
        out.frombytes(mv[byte_offset // width :: step].tobytes())
    else:
        fmt = "<" + typecode
        out.extend(struct.unpack_from(fmt, entries, k * ENTRY_SIZE + byte_offset)[0] for k in range(n))
    return out


# ---------------------------------------------------------------------------- segments


class _Segment:
    """A `.log` + `.bidx` pair; the index lives in memory as raw entries plus columns."""

    __slots__ = (
        "base_offset",
        "bases",
        "created_ms",
        "entries",
        "first_leaf",
        "idx_dirty",
        "idx_fd",
        "idx_path",
        "idx_written",
        "log_fd",
        "log_path",
        "log_size",
        "max_ts",
        "positions",
        "synced_log",
    )

    def __init__(self, base_offset: int, first_leaf: int, log_fd: int, idx_fd: int,
                 log_path: str, idx_path: str) -> None:
        self.base_offset = base_offset
        self.first_leaf = first_leaf
        self.log_fd = log_fd
        self.idx_fd = idx_fd
        self.log_path = log_path
        self.idx_path = idx_path
        self.log_size = 0
        self.entries = bytearray()
        self.idx_written = 0  # entries already written to the .bidx file
        self.idx_dirty = False  # written but not fsynced
        self.bases: array = array("q")  # type: ignore[type-arg]
        self.positions: array = array("q")  # type: ignore[type-arg]
        self.max_ts: array = array("q")  # type: ignore[type-arg]
        self.created_ms = 0
        self.synced_log = True

    @property
    def count(self) -> int:
        return len(self.bases)

    def set_entries(self, entries: bytearray) -> None:
        self.entries = entries
        self.bases = _column(entries, "q", 0)
        self.max_ts = _column(entries, "q", 8)
        self.positions = array("q", _column(entries, "I", 16))

    def end_of(self, k: int) -> int:
        """Byte position just past entry k."""
        if k + 1 < len(self.positions):
            return int(self.positions[k + 1])
        return int(self.positions[k]) + self.size_of(k)

    def size_of(self, k: int) -> int:
        return int(_U32.unpack_from(self.entries, k * ENTRY_SIZE + 20)[0])

    def leaf_of(self, k: int) -> bytes:
        o = k * ENTRY_SIZE + 28
        return bytes(self.entries[o : o + 32])

    def next_offset(self) -> int:
        if not self.bases:
            return self.base_offset
        (delta,) = struct.unpack_from("<i", self.entries, (self.count - 1) * ENTRY_SIZE + 24)
        return int(self.bases[-1]) + int(delta) + 1


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


# ---------------------------------------------------------------------------- commit

# A batch appended since the last commit job: (.log fd, .bidx fd, entry number in its
# segment, base offset, max timestamp, position, size, last offset delta).
PendingBatch = tuple[int, int, int, int, int, int, int, int]


class BackgroundSync:
    """The periodic fsync of an INTERVAL writer, in its own thread.

    Why: on this class of machine an fsync of one interval's data (hundreds of MB) takes
    as long as hashing it, and the policy lets heads be published before their data is
    durable. Run inside the commit job it stalls every later commit (and the broker's
    commit round for all partitions) for the whole write-back; here it overlaps them.
    `length` is the derived length it makes durable: the job wrote the `.bidx` entries
    and tree nodes of every block below it before starting the sync. The first commit
    after it finished records `length` as the head's derived length and fsyncs the head.
    """

    def __init__(self, fs: FileSystem, fds: list[int], dir_path: str | None, tree_fd: int,
                 length: int) -> None:
        self.fs = fs
        self.fds = fds
        self.dir_path = dir_path
        self.tree_fd = tree_fd
        self.length = length
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hk-interval-fsync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            for fd in self.fds:
                self.fs.fsync(fd)
            if self.dir_path is not None:
                self.fs.fsync_dir(self.dir_path)
            if self.tree_fd >= 0:
                self.fs.fsync(self.tree_fd)
            timing.FSYNC_SECONDS.observe(time.perf_counter() - t0)
        except BaseException as exc:  # reported to the owner thread by the next commit
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()


@dataclass
class CommitJob:
    """One group commit, built by `prepare_commit`; `run()` may execute in any thread."""

    log: PartitionLog
    frontier: Frontier
    next_offset: int
    log_start_offset: int
    min_index: int
    fork: int
    seq: int
    index_writes: list[tuple[int, int, bytes]]
    nodes: list[Node]
    # batches appended since the last job: read back and hashed here, off the owner thread
    pending: list[PendingBatch]
    sync_fds: list[int]
    sync_derived: bool
    derived_length: int
    sync_head: bool
    sync_dir: bool
    sign: bool
    flags: int
    # A follower's commit: the writer's signature over this tree, verified by the caller
    # (storage.follower); used instead of signing with our own key.
    remote_signature: bytes | None = None
    # A follower's commit: the leaf hash of each pending batch, verified by the caller
    # against the writer's signed tree before the batch was written; used instead of
    # reading the batches back and hashing them a second time.
    leaves: list[bytes] | None = None
    # INTERVAL policy, periodic sync: the fsyncs run in a `BackgroundSync` beside later
    # commits instead of inside this job (FORMAT.md section 6).
    background: bool = False
    sync: BackgroundSync | None = None
    head: Head | None = None
    leaf_lo: int = 0  # leaves [leaf_lo, leaf_hi) were hashed by this job
    leaf_hi: int = 0
    done: bool = False
    error: BaseException | None = field(default=None, repr=False)

    def run(self) -> None:
        lg = self.log
        fs = lg.fs
        try:
            self._hash_pending()
            for fd, pos, data in self.index_writes:
                fs.pwrite_all(fd, data, pos)
            if self.nodes:
                lg._write_nodes(self.nodes, self.leaf_lo * 2, self.leaf_hi * 2)
            fr = self.frontier
            if self.background:
                # Everything up to fr.length (data, .bidx entries, tree nodes) is written
                # now; the sync makes it durable while later commits go on.
                self.sync = BackgroundSync(fs, self.sync_fds, lg.path if self.sync_dir else None,
                                           lg._tree_fd if self.sync_derived else -1, fr.length)
                self.sync.start()
            elif self.sync_fds or self.sync_dir or self.sync_derived:
                t0 = time.perf_counter()
                for fd in self.sync_fds:
                    fs.fsync(fd)
                if self.sync_dir:
                    fs.fsync_dir(lg.path)
                if self.sync_derived:
                    fs.fsync(lg._tree_fd)
                timing.FSYNC_SECONDS.observe(time.perf_counter() - t0)
            if self.remote_signature is not None:
                sig = self.remote_signature
            elif self.sign:
                t0 = time.perf_counter()
                sig = sign_head(lg.keypair, lg.key, fr.tree_hash(), fr.length, self.fork)
                timing.SIGN_SECONDS.observe(time.perf_counter() - t0)
            else:
                assert lg._head is not None
                sig = lg._head.signature
            head = Head(
                fork=self.fork,
                length=fr.length,
                byte_length=fr.byte_length,
                tree_hash=fr.tree_hash(),
                signature=sig,
                next_offset=self.next_offset,
                log_start_offset=self.log_start_offset,
                min_index=self.min_index,
                roots=tuple(fr.roots()),
                seq=self.seq,
                flags=self.flags,
                boot_id=BOOT_ID,
                written_ms=int(time.time() * 1000),
                derived_length=(fr.length if self.sync_derived and not self.background
                                else self.derived_length),
            )
            fs.pwrite_all(lg._head_fd, head.encode(), (self.seq % 2) * SLOT_SIZE)
            if self.sync_head:
                fs.fsync(lg._head_fd)
            self.head = head
            self.done = True
        except BaseException as exc:
            # fsyncgate: after a failed fsync the page cache can no longer be trusted.
            self.error = exc
            lg._poisoned = exc
            raise StorageError(f"commit failed: {exc}") from exc

    def _hash_pending(self) -> None:
        """Leaf hashes (BLAKE2b releases the GIL above 2 KiB, so this overlaps the owner
        thread's appends), frontier, and the index entries, one pwrite per run of entries."""
        fr = self.frontier
        nodes = self.nodes
        pending = self.pending
        if not pending:
            return
        self.leaf_lo = fr.length
        self.leaf_hi = fr.length + len(pending)
        fs = self.log.fs
        fr_append = fr.append
        pack_entry = _ENTRY.pack
        pack_u32 = _U32.pack
        crc = crc32c.crc32c
        verified = self.leaves  # a follower's leaf hashes, computed while verifying
        if verified is not None and len(verified) != len(pending):
            raise StorageError("verified leaf hashes do not match the pending batches")
        i, n = 0, len(pending)
        while i < n:
            # The new batches of one segment are contiguous in its .log and its .bidx: read
            # them back as one span (a view of the page cache, see FileSystem.read_view) and
            # write their entries as one run. What we hash is exactly what we will serve.
            log_fd, idx_fd, k0 = pending[i][:3]
            j = i + 1
            while j < n and pending[j][0] == log_fd:
                j += 1
            group = pending[i:j]
            if group[-1][2] - k0 != len(group) - 1:
                raise StorageError("appended batches are not contiguous in their segment")
            span_start = group[0][5]
            span_len = group[-1][5] + group[-1][6] - span_start
            entries = bytearray()

            def fold(leaves: list[bytes], lo: int, hi: int, group: list[PendingBatch] = group,
                     entries: bytearray = entries) -> None:
                for t in range(lo, hi):
                    _, _, _, base, max_ts, pos, size, delta = group[t]
                    leaf = leaves[t]
                    nodes.extend(fr_append(leaf, size))
                    body = pack_entry(base, max_ts, pos, size, delta, leaf)
                    entries.extend(body)
                    entries.extend(pack_u32(crc(body)))

            if verified is not None:
                fold(verified[i:j], 0, len(group))
            else:
                with fs.read_view(log_fd, span_len, span_start) as span:
                    if len(span) != span_len:
                        raise StorageError("segment shorter than what was appended")
                    hash_leaves(span, [(p[5] - span_start, p[6]) for p in group], fold)
                timing.LEAF_HASHED_BYTES.add(span_len)
            self.index_writes.append((idx_fd, IDX_HEADER_SIZE + k0 * ENTRY_SIZE, bytes(entries)))
            i = j
        self.pending = []
        self.leaves = None


# ---------------------------------------------------------------------------- the log


class PartitionLog:
    """A partition archive. Create with `PartitionLog.open`."""

    def __init__(self, path: str, keypair: KeyPair, policy: FsyncPolicy, config: LogConfig,
                 fs: FileSystem) -> None:
        self.path = path
        self.keypair = keypair
        self.public_key = keypair.public_key
        self.key = archive_key(keypair.public_key)
        self.policy = policy
        self.config = config
        # a segment stays below segment_bytes and below 4 GiB (positions are u32)
        self._segment_limit = min(config.segment_bytes, (1 << 32) - 1)
        self.fs = fs
        self._segments: list[_Segment] = []
        self._seg_bases: list[int] = []
        # Owned by the commit job while one is in flight, else by the owner thread.
        self._frontier = Frontier()
        self._pending_nodes: list[Node] = []
        self._pending: list[PendingBatch] = []
        # a follower's verified leaf hashes of `_pending` (storage.follower); None: hash them
        self._pending_leaves: list[bytes] | None = None
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
        self._doomed: list[_Segment] = []
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
        data = self.fs.pread_exact(seg.log_fd, size, seg.positions[k])
        if len(data) != size:
            raise KeyError(index)
        return bytes(data)

    # ------------------------------------------------------------------ open / recovery

    @classmethod
    def open(cls, path: str | os.PathLike[str], keypair: KeyPair, *,
             fsync: FsyncPolicy = FsyncPolicy.INTERVAL, config: LogConfig | None = None,
             fs: FileSystem | None = None, cut_unsigned: bool = False) -> PartitionLog:
        """Open (and recover) the archive at `path`. `cut_unsigned`: blocks past the last
        signed head are cut instead of signed (the catalog: a change whose head was never
        signed was never applied, its caller got an error).

        A recovery write that fails (a full disk, EIO: rebuilding derived files, the
        genesis head, signing a tail) does not fail the open: the archive opens read-only
        instead, serving what its signed head covers (authenticated on read), with
        `damage` a `RecoveryFailed`; reopen it once the disk has room."""
        fs = fs or OsFileSystem()
        p = os.fspath(path)
        fs.makedirs(p)
        self = cls(p, keypair, FsyncPolicy(fsync), config or LogConfig(), fs)
        self._cut_unsigned = cut_unsigned
        try:
            self._recover()
        except BaseException as exc:
            self._close_fds()
            failure = _os_error_in(exc)
            if failure is None:
                raise
            self = cls(p, keypair, FsyncPolicy(fsync), config or LogConfig(), fs)
            try:
                self._open_unwritable(failure)
            except BaseException:
                self._close_fds()
                raise
        return self

    def _open_unwritable(self, failure: OSError) -> None:
        """Open read-only after recovery could not write: nothing here writes."""
        self._head_fd = self._open_rw("head")
        self._tree_fd = self._open_rw("tree")
        head, _ = read_head_slots(self.fs, self._head_fd)
        if head is not None and check_head(head, self.public_key, self.key) is not None:
            head = None  # a bad head is damage, found again by the next writable open
        names = self.fs.listdir(self.path)
        bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
        self._open_damaged(RecoveryFailed(f"{self.path}: recovery could not write ({failure}); "
                                          "read-only until it can",
                                          head.next_offset if head is not None else None,
                                          failure),
                           bases, head)

    def _open_rw(self, name: str) -> int:
        return self.fs.open(os.path.join(self.path, name), os.O_RDWR | os.O_CREAT)

    def _recover(self) -> None:
        fs = self.fs
        self._head_fd = self._open_rw("head")
        self._tree_fd = self._open_rw("tree")
        head, corrupt_slot = read_head_slots(fs, self._head_fd)
        names = sorted(fs.listdir(self.path))
        bases = sorted(int(n[:-4]) for n in names if n.endswith(".log") and n[:-4].isdigit())
        for n in names:  # index files without a log: nothing to index
            if n.endswith(".bidx") and n[:-5].isdigit() and int(n[:-5]) not in bases:
                fs.unlink(os.path.join(self.path, n))
        if head is None and not corrupt_slot and not bases:
            # A new archive: make an unsigned genesis slot (length 0) durable before any
            # head is signed, so a later power loss always finds the writer's policy and
            # boot id on disk and can tell that heads may have been lost (FORMAT.md sec. 8).
            head = Head(0, 0, 0, tree_hash([]), bytes(68), 0, 0, 0, (), 1,
                        FLAG_CLEAN | (_POLICY_CODE[self.policy] << 8), BOOT_ID,
                        int(time.time() * 1000), 0)
            fs.pwrite_all(self._head_fd, head.encode(), SLOT_SIZE)
            fs.fsync(self._head_fd)
            fs.fsync_dir(self.path)
        if head is not None:
            why = check_head(head, self.public_key, self.key)
            if why is not None:
                self._open_damaged(ArchiveDamaged(f"{self.path}: {why}", head.log_start_offset),
                                   bases, None)
                return
            self._head_seq = head.seq
            self._fork = head.fork
            self._disk_clean = head.clean
        elif corrupt_slot and bases:
            self._open_damaged(ArchiveDamaged(f"{self.path}: both head slots invalid", 0), bases, None)
            return
        min_index = head.min_index if head else 0
        signed_len = head.length if head else 0
        rebooted = head is not None and not head.clean and head.boot_id != BOOT_ID
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
            seg = self._open_segment_files(base)
            if cut:
                self._drop_segment_files(seg)
                continue
            # A segment wholly below the log start is a leftover of an interrupted retention.
            nxt = bases[bi + 1] if bi + 1 < len(bases) else None
            if head is not None and nxt is not None and nxt <= head.log_start_offset:
                self._drop_segment_files(seg)
                continue
            hdr = decode_index_header(fs.pread_exact(seg.idx_fd, IDX_HEADER_SIZE, 0))
            log_size = fs.size(seg.log_fd)
            seg.log_size = log_size
            first_leaf = expect_leaf
            # DeleteRecords may have put the log start inside the first segment: that one
            # may begin below it (never above: data the head says is kept would be gone).
            inside = head is not None and not self._segments and base < expect_offset
            if base != expect_offset and not inside:
                log.warning("%s: segment %d does not continue the log at %d; dropping it and "
                            "everything after it", self.path, base, expect_offset)
                cut = True
                self._drop_segment_files(seg)
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
            good = self._structural_prefix(seg, log_size)
            # Entries at or past the signed length are the tail: check them fully.
            # After a power loss of a non-`always` writer anything unsynced may be torn,
            # so everything is checked (slow, but only then).
            tail_from = 0 if power_loss else max(0, checkpoint - first_leaf)
            k = tail_from
            while k < good:
                if not self._check_entry_against_log(seg, k):
                    break
                k += 1
            if k < seg.count:
                good = min(good, k)
            if good < seg.count:
                self._truncate_entries(seg, good)
                cut = True
            # Batches in the log past the last entry: rebuild their entries.
            end = seg.end_of(seg.count - 1) if seg.count else 0
            log_size = fs.size(seg.log_fd)
            scanned_to, added_from = self._scan_log_tail(seg, end, log_size)
            if added_from is not None and rebuilt_from is None:
                rebuilt_from = added_from
            if scanned_to < log_size:
                fs.ftruncate(seg.log_fd, scanned_to)
                seg.log_size = scanned_to
                cut = True
            # we cannot know whether the previous process fsynced this: sync it again
            seg.synced_log = False
            seg.idx_dirty = True
            self._segments.append(seg)
            expect_leaf = seg.first_leaf + seg.count
            expect_offset = seg.next_offset()
        total = expect_leaf
        if self._cut_unsigned and head is not None and total > signed_len and self._segments:
            log.warning("%s: cutting %d block(s) never signed", self.path, total - signed_len)
            while len(self._segments) > 1 and self._segments[-1].first_leaf >= signed_len:
                self._drop_segment_files(self._segments.pop())
            seg = self._segments[-1]
            k = max(0, signed_len - seg.first_leaf)
            self._truncate_entries(seg, k)
            seg.log_size = seg.end_of(k - 1) if k else 0
            fs.ftruncate(seg.log_fd, seg.log_size)
            total = seg.first_leaf + seg.count
            if rebuilt_from is not None and rebuilt_from >= total:
                rebuilt_from = None
        self._seg_bases = [s.base_offset for s in self._segments]
        self._dirty = bool(self._segments)
        if self._segments:
            self.log_start_offset = self._segments[0].base_offset
            self.log_end_offset = self._segments[-1].next_offset()
        elif head is not None:
            self.log_start_offset = head.log_start_offset
            self.log_end_offset = head.next_offset
        self._min_index = self._segments[0].first_leaf if self._segments else min_index
        if head is not None:
            self.log_start_offset = max(self.log_start_offset, head.log_start_offset)

        if head is not None and total < signed_len:
            lost_at = self.log_end_offset
            if not power_loss:
                self._segments_ready()
                self._open_damaged(
                    ArchiveDamaged(
                        f"{self.path}: data ends at block {total} but the signed head covers "
                        f"{signed_len}; refusing to write (would sign a different tree)",
                        lost_at,
                    ),
                    None,
                    head,
                    keep_segments=True,
                )
                return

        # Frontier at the end of the data.
        self._segments_ready()
        if (head is not None and rebuilt_from is None and total >= signed_len and not power_loss
                and checkpoint == signed_len):
            # the common case: continue from the roots in the verified head, no hashing
            self._frontier = Frontier.from_roots(list(head.roots))
            self._fold(signed_len, total)
        elif head is not None and not power_loss:
            # index entries below the head were rebuilt from the log: recompute and compare
            start = min(rebuilt_from if rebuilt_from is not None else total, signed_len,
                        checkpoint)
            ok = False
            for attempt in ("stored", "leaves"):
                self._pending_nodes = []
                fr = self._frontier_at(start, use_stored=attempt == "stored")
                if fr is None:
                    continue
                self._frontier = fr
                self._fold(start, signed_len)
                if self._frontier.tree_hash() == head.tree_hash:
                    ok = True
                    break
            if not ok:
                self._open_damaged(
                    ArchiveDamaged(f"{self.path}: tree rebuilt from the data differs from the "
                                   "signed head", self._offset_of_leaf(start)),
                    None, head, keep_segments=True)
                return
            self._fold(signed_len, total)
        else:
            # no head, or after a power loss: the data is the truth, rebuilt from its leaves
            fr = self._frontier_at(total, use_stored=False)
            if fr is None:
                self._open_damaged(
                    ArchiveDamaged(f"{self.path}: cannot rebuild the tree below block "
                                   f"{self._min_index}", self.log_start_offset),
                    None, head, keep_segments=True)
                return
            self._frontier = fr
        self._next_leaf = total
        self._head = head
        if head is not None:
            self.high_watermark = head.next_offset if total >= signed_len else self.log_end_offset
            self._published_length = min(signed_len, total)
            self._open_roots = {r.index: r for r in head.roots}
        else:
            self.high_watermark = self.log_start_offset
        # Leaves below the signed length are authenticated lazily on first read.
        self._leaf_ok_base = self._min_index
        verified_below = min(checkpoint, total) if head is not None else self._min_index
        if rebuilt_from is not None:
            verified_below = min(verified_below, rebuilt_from)
        if power_loss:
            # everything was rehashed and the tree rebuilt from the data: that tree (about
            # to be signed under the new fork) is the reference, not the old head's
            verified_below = self._min_index
            self._open_roots = {r.index: r for r in self._frontier.roots()}
        verified_below = max(verified_below, self._min_index)
        self._leaf_ok = bytearray(verified_below - self._min_index) + b"\x01" * (total - verified_below)

        fork_bump = power_loss
        if head is not None and power_loss:
            log.warning(
                "%s: unclean shutdown of a %s writer across a reboot: heads signed after the "
                "last durable one may be lost; truncating to %d blocks under fork %d -> %d",
                self.path, head.policy.value, total, head.fork, head.fork + 1,
            )
        if fork_bump:
            self._fork += 1
            self.high_watermark = self.log_start_offset
            self._published_length = 0
        if fork_bump or total > self._published_length:
            self.commit(force_sync=True)
        elif self._pending_nodes:  # tree nodes rebuilt below the head: repair the file
            self._write_nodes(self._pending_nodes)
            self._pending_nodes = []

    def _segments_ready(self) -> None:
        self._seg_bases = [s.base_offset for s in self._segments]

    def _open_damaged(self, exc: ArchiveDamaged, bases: list[int] | None, head: Head | None,
                      keep_segments: bool = False) -> None:
        """Read-only: serve what is present up to the damage, never write."""
        log.error("%s", exc)
        self.damage = exc
        if not keep_segments and bases is not None:
            for base in bases:
                seg = self._open_segment_files(base)
                hdr = decode_index_header(self.fs.pread_exact(seg.idx_fd, IDX_HEADER_SIZE, 0))
                size = self.fs.size(seg.idx_fd) - IDX_HEADER_SIZE
                raw = bytearray(self.fs.pread_exact(seg.idx_fd, max(0, size - size % ENTRY_SIZE),
                                                    IDX_HEADER_SIZE)) if hdr else bytearray()
                seg.first_leaf = hdr[1] if hdr else 0
                seg.log_size = self.fs.size(seg.log_fd)
                seg.set_entries(raw)
                good = self._structural_prefix(seg, seg.log_size)
                self._truncate_entries(seg, good, write=False)
                self._segments.append(seg)
            self._segments_ready()
        if self._segments:
            self.log_start_offset = self._segments[0].base_offset
            self.log_end_offset = self._segments[-1].next_offset()
        self._head = head
        # Serve nothing unauthenticated: only what is below both the damage and the head.
        limit = exc.offset if exc.offset is not None else self.log_start_offset
        if head is not None:
            limit = min(limit, head.next_offset)
        self.high_watermark = max(self.log_start_offset, min(limit, self.log_end_offset))
        self._open_roots = {r.index: r for r in head.roots} if head else {}
        self._min_index = self._segments[0].first_leaf if self._segments else 0
        self._leaf_ok_base = self._min_index
        total = (self._segments[-1].first_leaf + self._segments[-1].count) if self._segments else 0
        self._leaf_ok = bytearray(max(0, total - self._min_index))
        self._next_leaf = total
        if not self._open_roots:
            self.high_watermark = self.log_start_offset

    def _structural_prefix(self, seg: _Segment, log_size: int) -> int:
        """Number of leading entries that are contiguous and inside the log file."""
        n = seg.count
        if not n:
            return 0
        sizes_total = sum(_column(seg.entries, "I", 20))
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

    def _check_entry_against_log(self, seg: _Segment, k: int) -> bool:
        if not entry_ok(seg.entries, k):
            return False
        pos, size = seg.positions[k], seg.size_of(k)
        data = self.fs.pread_exact(seg.log_fd, size, pos)
        if len(data) != size or not self._batch_ok(data):
            return False
        base = _BE_I64.unpack_from(data, 0)[0]
        return base == seg.bases[k] and compute_leaf(data, size) == seg.leaf_of(k)

    @staticmethod
    def _batch_ok(data: bytes) -> bool:
        if len(data) < B.HEADER_SIZE or data[B.MAGIC_AT] != B.MAGIC:
            return False
        if 12 + _BE_I32.unpack_from(data, B.BATCH_LENGTH)[0] != len(data):
            return False
        return B.batch_crc_ok(data)

    def _scan_log_tail(self, seg: _Segment, start: int, log_size: int) -> tuple[int, int | None]:
        """Parse whole, CRC-valid batches from `start`; add their entries. Returns (end of
        the last good batch, first leaf added or None)."""
        pos = start
        added_from: int | None = None
        expect = seg.next_offset()
        while pos + B.HEADER_SIZE <= log_size:
            hdr = self.fs.pread_exact(seg.log_fd, B.HEADER_SIZE, pos)
            size = 12 + _BE_I32.unpack_from(hdr, B.BATCH_LENGTH)[0]
            if size < B.HEADER_SIZE or pos + size > log_size:
                break
            data = self.fs.pread_exact(seg.log_fd, size, pos)
            if not self._batch_ok(data):
                break
            base = _BE_I64.unpack_from(data, 0)[0]
            if seg.count and base != expect:
                break
            delta = _BE_I32.unpack_from(data, B.LAST_OFFSET_DELTA)[0]
            max_ts = _BE_I64.unpack_from(data, B.MAX_TIMESTAMP)[0]
            entry = encode_entry(base, max_ts, pos, size, delta, compute_leaf(data, size))
            if added_from is None:
                added_from = seg.first_leaf + seg.count
            self._add_entry(seg, entry, base, max_ts, pos)
            pos += size
            expect = base + delta + 1
        if added_from is not None:
            seg.log_size = pos
            self._flush_entries(seg)
        return pos, added_from

    def _flush_entries(self, seg: _Segment) -> None:
        if seg.idx_written < seg.count:
            off = seg.idx_written * ENTRY_SIZE
            self.fs.pwrite_all(seg.idx_fd, bytes(seg.entries[off:]), IDX_HEADER_SIZE + off)
            seg.idx_written = seg.count

    def _truncate_entries(self, seg: _Segment, n: int, write: bool = True) -> None:
        del seg.entries[n * ENTRY_SIZE :]
        seg.set_entries(seg.entries)
        seg.idx_written = min(seg.idx_written, n)
        if write:  # the log past these entries is rescanned (and cut) by _scan_log_tail
            self.fs.ftruncate(seg.idx_fd, IDX_HEADER_SIZE + n * ENTRY_SIZE)

    def _stored_roots(self, length: int) -> Frontier | None:
        roots = []
        for idx in flat_tree.full_roots(2 * length):
            n = self._read_node(idx)
            if n is None:
                return None
            roots.append(n)
        try:
            return Frontier.from_roots(roots)
        except Exception:
            return None

    def _frontier_at(self, length: int, *, use_stored: bool) -> Frontier | None:
        """The tree at `length` blocks. use_stored: the roots stored in the tree file (must
        be checked by the caller). Otherwise the roots at min_index from the tree file
        (durable: fsynced before retention deleted those leaves) plus the index leaf
        hashes from min_index on."""
        if length == 0:
            return Frontier()
        if use_stored:
            return self._stored_roots(length)
        mi = self._min_index
        fr = Frontier() if mi == 0 else self._stored_roots(mi)
        if fr is None or length < mi:
            return None
        self._frontier = fr
        self._pending_nodes = []
        self._fold(mi, length)
        return self._frontier

    def _fold(self, start: int, end: int) -> None:
        """Append index leaves [start, end) to the frontier, collecting the nodes."""
        fr = self._frontier
        nodes = self._pending_nodes
        leaf_index = start
        while leaf_index < end:
            seg, k = self._locate_leaf(leaf_index)
            stop = min(end - seg.first_leaf, seg.count)
            ent = seg.entries
            for kk in range(k, stop):
                o = kk * ENTRY_SIZE
                nodes.extend(fr.append(bytes(ent[o + 28 : o + 60]), _U32.unpack_from(ent, o + 20)[0]))
            leaf_index = seg.first_leaf + stop

    def _locate_leaf(self, leaf_index: int) -> tuple[_Segment, int]:
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

    def _offset_of_leaf(self, leaf_index: int) -> int:
        if not self._segments:
            return self.log_start_offset
        total = self._segments[-1].first_leaf + self._segments[-1].count
        if leaf_index >= total:
            return self._segments[-1].next_offset()
        seg, k = self._locate_leaf(leaf_index)
        return int(seg.bases[k])

    def _open_segment_files(self, base: int) -> _Segment:
        lp = os.path.join(self.path, segment_name(base, "log"))
        ip = os.path.join(self.path, segment_name(base, "bidx"))
        seg = _Segment(base, 0, -1, -1, lp, ip)
        seg.log_fd = self.fs.open(lp, os.O_RDWR | os.O_CREAT)
        seg.idx_fd = self.fs.open(ip, os.O_RDWR | os.O_CREAT)
        return seg

    def _drop_segment_files(self, seg: _Segment) -> None:
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
            pack = _NODE.pack_into
            for n in nodes:
                if lo <= n.index < hi:
                    pack(buf, (n.index - lo) * NODE_SIZE, n.size, n.hash)
                else:
                    rest.append(n)
            # the last odd position is a parent that cannot be complete yet: leave it alone
            self.fs.pwrite_all(self._tree_fd, memoryview(buf)[: (hi - lo - 1) * NODE_SIZE],
                               lo * NODE_SIZE)
            nodes = rest
        nodes = sorted(nodes, key=lambda n: n.index)
        i = 0
        while i < len(nodes):
            j = i
            buf = bytearray(_NODE.pack(nodes[i].size, nodes[i].hash))
            while j + 1 < len(nodes) and nodes[j + 1].index == nodes[j].index + 1:
                j += 1
                buf += _NODE.pack(nodes[j].size, nodes[j].hash)
            self.fs.pwrite_all(self._tree_fd, buf, nodes[i].index * NODE_SIZE)
            i = j + 1

    def _read_node(self, index: int) -> Node | None:
        data = self.fs.pread_exact(self._tree_fd, NODE_SIZE, index * NODE_SIZE)
        if len(data) != NODE_SIZE or data == bytes(NODE_SIZE):
            return None
        size, h = _NODE.unpack(data)
        return Node(index, size, h)

    def node(self, index: int) -> Node | None:
        """A stored tree node (for proofs); None if never written."""
        self._ensure_open()
        return self._read_node(index)

    # ------------------------------------------------------------------ append

    def _check_writable(self) -> None:
        if self._closed:
            raise StorageError("log is closed")
        if self.damage is not None:
            raise self.damage
        if self._poisoned is not None:
            raise StorageError(f"log failed earlier and must be reopened: {self._poisoned}")

    def append(self, batch: bytearray, *, leader_epoch: int = 0) -> tuple[int, int]:
        """Assign offsets to `batch` (written into it in place) and append it.
        Returns (base_offset, last_offset). Invisible to readers until a head covers it."""
        if self._closed or self.damage is not None or self._poisoned is not None:
            self._check_writable()
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
        base = self.log_end_offset
        _BATCH_WRITE.pack_into(batch, 0, base, batch_length, leader_epoch)
        return self._store(batch, size, base, delta, max_ts)

    def _store(self, batch: bytes | bytearray | memoryview, size: int, base: int, delta: int,
               max_ts: int) -> tuple[int, int]:
        """Write a checked batch whose base offset is `base` (= log_end_offset) as is."""
        self._ensure_open()
        segs = self._segments
        seg = segs[-1] if segs else None
        if (seg is None or not seg.bases or seg.log_size + size > self._segment_limit
                or time.time() * 1000 - seg.created_ms >= self.config.segment_ms):
            seg = self._active_for(size)
        pos = seg.log_size
        self.fs.pwrite_all(seg.log_fd, batch, pos)
        seg.log_size = pos + size
        seg.synced_log = False
        k = len(seg.bases)
        # in memory the leaf hash stays zero (reads do not need it; the file gets it)
        seg.entries += _ENTRY_NO_LEAF.pack(base, max_ts, pos, size, delta)
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
    def _add_entry(seg: _Segment, entry: bytes, base: int, max_ts: int, pos: int) -> None:
        seg.entries += entry
        seg.bases.append(base)
        seg.max_ts.append(max_ts)
        seg.positions.append(pos)

    def _active_for(self, size: int) -> _Segment:
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
        waits for a running one and syncs inline."""
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
        self._check_writable()
        self._ensure_open()
        if self._job is not None:
            raise StorageError("a commit job is already in flight")
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
            or (policy is FsyncPolicy.INTERVAL and self._dirty
                and now - self._last_sync_ms >= interval)
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
            sync_fds=sync_fds,
            sync_derived=derived_due,
            derived_length=derived_length,
            # a background sync's head is fsynced by the first commit after it finished
            sync_head=(due and not background) or self._disk_clean or synced is not None,
            sync_dir=sync_dir,
            sign=new or self._head is None,
            flags=_POLICY_CODE[self.policy] << 8,
            background=background,
        )
        pending_bytes = sum(p[6] for p in self._pending)
        self._pending_nodes = []
        self._pending = []
        if self._pending_leaves is not None:
            self._pending_leaves = []
        self._disk_clean = False
        self._job = job
        if job.pending and pending_bytes < INLINE_HASH_BELOW * len(job.pending):
            # Small batches: BLAKE2b keeps the GIL below 2 KiB, so a worker thread would only
            # fight the loop thread for it (convoy); hash here, the job keeps the I/O.
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
        handles = self._handles
        if handles is not None and handles.total > handles.budget:
            # logs that were busy when others opened are idle now: back within budget
            handles.make_room(0, keep=self)
        return head

    def abandon(self, job: CommitJob) -> None:
        """Forget a job whose run() raised (the log is poisoned then anyway)."""
        if job is self._job:
            self._job = None
            if job.sync is not None:
                self._sync = job.sync  # joined at close

    def commit(self, *, force_sync: bool = False) -> Head | None:
        """prepare_commit + run + publish in a row (tests, shutdown, recovery); fsyncs
        inline, after any background sync finished."""
        job = self._prepare(force_sync, background=False)
        if job is None:
            return None
        try:
            job.run()
        except BaseException:
            self.abandon(job)
            raise
        return self.publish(job)

    # ------------------------------------------------------------------ reads

    def _find(self, offset: int) -> tuple[_Segment, int]:
        si = bisect.bisect_right(self._seg_bases, offset) - 1
        seg = self._segments[si]
        return seg, bisect.bisect_right(seg.bases, offset) - 1

    def read(self, offset: int, max_bytes: int) -> FileRange:
        """Whole batches starting with the one containing `offset`, up to max_bytes (at
        least one batch), never past the high watermark, within one segment."""
        hwm = self.high_watermark
        if self._bad_offset is not None:
            hwm = min(hwm, self._bad_offset)
        if offset < self.log_start_offset or offset > self.high_watermark:
            raise OffsetOutOfRange(offset, self.log_start_offset, self.high_watermark)
        if offset >= hwm:
            if self._bad_offset is not None and offset >= self._bad_offset and offset < self.high_watermark:
                raise CorruptBatch("stored batch fails authentication", self._bad_offset)
            return FileRange(-1, 0, 0, offset, offset)
        self._ensure_open()
        seg, i = self._find(offset)
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

    def _authenticate(self, seg: _Segment, i: int, t: int) -> int:
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
                    log.error("%s: batch at offset %d fails authentication; not serving it "
                              "or anything after it", self.path, bad)
                return k
            self._leaf_ok[li] = 1
        return t

    def _authenticate_leaf(self, seg: _Segment, k: int) -> bool:
        """Leaf hash of the stored bytes, then up the stored tree to a trusted node (a root
        of the head verified at open, or a node authenticated before)."""
        leaf_index = seg.first_leaf + k
        size = seg.size_of(k)
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
            h = blake2b(b"\x01" + (left.size + right.size).to_bytes(8, "little") + left.hash
                        + right.hash, digest_size=32).digest()
            cur = Node(flat_tree.parent(idx), left.size + right.size, h)
        if good:
            for idx in path:
                if idx < len(ok):
                    ok[idx] = 1
            # the sibling's stored hash is now authenticated, but its stored bytes on disk
            # must equal what we read; they do, we read them from the tree file.
        return good

    def batch_for_timestamp(self, timestamp_ms: int) -> bytes | None:
        """The first batch whose maxTimestamp >= timestamp_ms (the broker scans records)."""
        hwm = self.high_watermark
        for seg in self._segments:
            if not seg.count or seg.bases[0] >= hwm:
                break
            for k, ts in enumerate(seg.max_ts):
                if seg.bases[k] >= hwm:
                    return None
                if ts >= timestamp_ms:
                    return self.read_bytes(int(seg.bases[k]), 1)
        return None

    def batch_with_max_timestamp(self) -> bytes | None:
        """The first batch holding the largest maxTimestamp below the high watermark."""
        best: tuple[int, int] | None = None
        hwm = self.high_watermark
        for seg in self._segments:
            for k, ts in enumerate(seg.max_ts):
                base = int(seg.bases[k])
                if base >= hwm:
                    break
                if best is None or ts > best[0]:
                    best = (ts, base)
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
                yield self.fs.pread_exact(seg.log_fd, B.HEADER_SIZE, seg.positions[kk])

    # ------------------------------------------------------------------ retention

    def apply_retention(self, now_ms: int) -> int:
        """Drop whole old segments by retention_ms / retention_bytes. Returns the number of
        segments dropped. Never the active segment, never data above the high watermark;
        skipped while a commit job is in flight. Tree nodes are kept (proofs)."""
        self._close_doomed()
        if self._job is not None or self.damage is not None or self._poisoned is not None:
            return 0
        cfg = self.config
        total = sum(s.log_size for s in self._segments)
        drop = 0
        for seg in self._segments[:-1]:
            if seg.next_offset() > self.high_watermark or not seg.count:
                break
            by_time = cfg.retention_ms >= 0 and max(seg.max_ts) < now_ms - cfg.retention_ms
            by_size = cfg.retention_bytes >= 0 and total - seg.log_size >= cfg.retention_bytes
            if not (by_time or by_size):
                break
            drop += 1
            total -= seg.log_size
        return self._drop_first_segments(drop)

    def drop_segments_below(self, offset: int) -> int:
        """Drop the whole segments that end at or below `offset` (never the active one,
        never data above the high watermark), exactly as retention drops them: the log
        start offset advances, tree nodes stay (proofs), the head records the new start.
        For a log whose owner rewrote everything it still needs at `offset` or later
        (the offsets archive's compaction). Returns the number of segments dropped; 0 also
        while a commit job is in flight (call again later)."""
        self._close_doomed()
        if self._job is not None or self.damage is not None or self._poisoned is not None:
            return 0
        drop = 0
        for seg in self._segments[:-1]:
            end = seg.next_offset()
            if not seg.count or end > offset or end > self.high_watermark:
                break
            drop += 1
        return self._drop_first_segments(drop)

    def delete_records_below(self, offset: int) -> int:
        """Kafka's DeleteRecords: make `offset` (at most the high watermark) the log start
        offset; returns the new log start (never lower than before). Whole segments below
        it are dropped as retention drops them; inside a segment the start is only
        recorded in a new head slot (reads below it are out of range, and recovery keeps
        the larger of the first segment's base and the head's start). Tree nodes stay:
        whatever was signed stays provable. Raises StorageError while a commit job is in
        flight or the archive takes no writes."""
        if offset > self.high_watermark:
            raise ValueError(f"offset {offset} is above the high watermark {self.high_watermark}")
        self._close_doomed()
        if self._job is not None or self.damage is not None or self._poisoned is not None:
            raise StorageError(f"{self.path}: busy or not writable; try again")
        if offset <= self.log_start_offset:
            return self.log_start_offset
        self.drop_segments_below(offset)
        if self.log_start_offset < offset:
            self._ensure_open()
            self.commit(force_sync=True)  # the head we copy covers everything appended
            head = self._head
            assert head is not None
            self.log_start_offset = offset
            self._write_head_slot(head, self._min_index)
        return self.log_start_offset

    def _write_head_slot(self, head: Head, min_index: int) -> None:
        """Rewrite the last signed head with this log's start and min index (the signed
        part is unchanged: the start is local bookkeeping, not part of the tree)."""
        self._head_seq += 1
        new_head = Head(
            head.fork, head.length, head.byte_length, head.tree_hash, head.signature,
            head.next_offset, self.log_start_offset, min_index, head.roots, self._head_seq,
            _POLICY_CODE[self.policy] << 8, BOOT_ID, int(time.time() * 1000), head.length,
        )
        self.fs.pwrite_all(self._head_fd, new_head.encode(), (self._head_seq % 2) * SLOT_SIZE)
        self.fs.fsync(self._head_fd)
        self._head = new_head

    def roll(self) -> None:
        """Make the next append start a new segment (when the active one holds anything).
        Done by aging the active segment past segment_ms, which the append path already
        checks, so the hot path stays as it is."""
        if self._segments and self._segments[-1].count:
            self._segments[-1].created_ms = -(1 << 80)

    def _close_doomed(self) -> None:
        for seg in self._doomed:  # ranges handed out before the last drop are stale now
            self.fs.close(seg.log_fd)
            self.fs.close(seg.idx_fd)
        self._doomed = []

    def _drop_first_segments(self, drop: int) -> int:
        if not drop:
            return 0
        # (what to drop is decided from memory: a parked log opens its files only when
        # retention has something to do, not on every check)
        self._ensure_open()
        dropped = self._segments[:drop]
        keep = self._segments[drop:]
        # The tree file's nodes for these leaves can no longer be rebuilt: make them durable
        # (and the data the head covers) before the head that forgets the segments.
        self.commit(force_sync=True)
        self.fs.fsync(self._tree_fd)
        self._segments = keep
        self._segments_ready()
        # (DeleteRecords may have put the start inside the first kept segment already)
        self.log_start_offset = max(self.log_start_offset, keep[0].base_offset)
        new_min = keep[0].first_leaf
        self._leaf_ok = self._leaf_ok[new_min - self._leaf_ok_base :]
        self._leaf_ok_base = new_min
        self._min_index = new_min
        head = self._head
        assert head is not None
        self._write_head_slot(head, new_min)
        for seg in dropped:
            self.fs.unlink(seg.log_path)
            self.fs.unlink(seg.idx_path)
        self.fs.fsync_dir(self.path)
        self._doomed = dropped
        return drop

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Commit pending data, make everything durable, mark the head clean, close."""
        if self._closed:
            return
        try:
            if self.damage is None and self._poisoned is None and self._job is None:
                self._ensure_open()  # a parked log writes its clean head too
                self.commit(force_sync=True)
                if self._head is not None:
                    for seg in self._segments:
                        self.fs.fsync(seg.log_fd)
                        self.fs.fsync(seg.idx_fd)
                    self.fs.fsync(self._tree_fd)
                    h = self._head
                    self._head_seq += 1
                    clean = Head(
                        h.fork, h.length, h.byte_length, h.tree_hash, h.signature,
                        h.next_offset, h.log_start_offset, h.min_index, h.roots,
                        self._head_seq, FLAG_CLEAN | (_POLICY_CODE[self.policy] << 8),
                        BOOT_ID, int(time.time() * 1000), h.length,
                    )
                    self.fs.pwrite_all(self._head_fd, clean.encode(),
                                       (self._head_seq % 2) * SLOT_SIZE)
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
        return (self._head_fd >= 0 and not self._closed and self._pins == 0 and self._job is None
                and (self._sync is None or self._sync.done()) and not self._pending)

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


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (itself, or a cause: a commit job wraps its OSError in a
    StorageError), or None: recovery failed for another reason."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__
    return None

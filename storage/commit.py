"""Group commit: what one commit job does, and the INTERVAL writer's background fsync.

Owns `CommitJob` (built by `PartitionLog.prepare_commit` on the owner thread; `run` may
execute in any thread: it hashes the new batches, writes their index entries and tree
nodes, fsyncs as the policy says, signs and writes the head), `hash_jobs` (the leaves of
many jobs, one commit round, in one native call) and `BackgroundSync`.

Threading: the job only touches what `prepare_commit` handed it (copies of the frontier
and of the new index bytes and tree nodes, and descriptors that stay open while a job is
in flight) plus the head file and the tree file, which nothing else writes while a job is
in flight. May import the standard library, crc32c, `storage.hypercore`, `storage.fs`,
`storage.errors`, `storage.format`, `storage.hashing`; `storage.log` only for types.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import crc32c

from storage import format as fmt
from storage import timing
from storage.errors import NotQuorumSigned, StorageError
from storage.format import ENTRY, ENTRY_SIZE, IDX_HEADER_SIZE, SLOT_SIZE, U32, Head
from storage.fs import FileSystem
from storage.hashing import NATIVE_LEAVES, hash_leaves, hash_many
from storage.hypercore import Frontier, Manifest, Node, sign_head
from storage.hypercore.multisig import verify_manifest_head

if TYPE_CHECKING:
    from storage.log import PartitionLog


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

    def __init__(
        self, fs: FileSystem, fds: list[int], dir_path: str | None, tree_fd: int, length: int
    ) -> None:
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
    # A follower's commit: the leaf byte size of each pending block the writer's cleaner
    # removed (its entry's size is 0, FORMAT.md section 10), by leaf index.
    hole_sizes: dict[int, int] | None = None
    # A follower's commit: (length, tree hash) of the writer's signed head; `run` writes
    # nothing unless the folded leaves make exactly that tree.
    expect_tree: tuple[int, bytes] | None = None
    # INTERVAL policy, periodic sync: the fsyncs run in a `BackgroundSync` beside later
    # commits instead of inside this job (FORMAT.md section 6).
    background: bool = False
    sync: BackgroundSync | None = None
    head: Head | None = None
    leaf_lo: int = 0  # leaves [leaf_lo, leaf_hi) were hashed by this job
    leaf_hi: int = 0
    done: bool = False
    error: BaseException | None = field(default=None, repr=False)
    unsigned: bool = False  # `run` failed for want of a quorum signature only

    def run(self) -> None:
        lg = self.log
        fs = lg.fs
        try:
            self._hash_pending()
            expect = self.expect_tree
            if expect is not None and (
                self.frontier.length != expect[0] or self.frontier.tree_hash() != expect[1]
            ):
                raise StorageError(
                    f"{lg.path}: stored blocks do not reproduce the signed head at length {expect[0]}"
                )
            for fd, pos, data in self.index_writes:
                fs.pwrite_all(fd, data, pos)
            if self.nodes:
                lg._write_nodes(self.nodes, self.leaf_lo * 2, self.leaf_hi * 2)
            fr = self.frontier
            if self.background:
                # Everything up to fr.length (data, .bidx entries, tree nodes) is written
                # now; the sync makes it durable while later commits go on.
                self.sync = BackgroundSync(
                    fs,
                    self.sync_fds,
                    lg.path if self.sync_dir else None,
                    lg._tree_fd if self.sync_derived else -1,
                    fr.length,
                )
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
            elif (
                self.sign
                and fr.length == 0
                and lg.manifest is not None
                and lg.manifest != Manifest.default(lg.public_key)
            ):
                # The empty tree of a quorum-signed archive (a failover's new fork of one
                # nothing was written to): no head of length 0 is ever verified
                # (check_head), and replicas refuse to sign one, there being nothing to
                # vouch for.
                sig = b""
            elif (
                self.sign
                and lg.manifest is not None
                and lg.manifest != Manifest.default(lg.public_key)
            ):
                # a quorum-signed archive: its replicas sign (PartitionLog.quorum_sign), and
                # nothing short of a verifying quorum signature is ever stored as a head
                if lg.quorum_sign is None:
                    raise NotQuorumSigned(f"{lg.path}: a quorum-signed archive is not signed alone")
                try:
                    sig = lg.quorum_sign(fr.tree_hash(), fr.length, self.fork)
                except Exception as exc:
                    raise NotQuorumSigned(
                        f"{lg.path}: no quorum signed length {fr.length} on fork {self.fork}: {exc}"
                    ) from exc
                if not verify_manifest_head(
                    lg.manifest, lg.key, fr.tree_hash(), fr.length, self.fork, sig
                ):
                    raise StorageError(
                        f"{lg.path}: the quorum signature for length {fr.length} does not verify"
                    )
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
                boot_id=fmt.BOOT_ID,
                written_ms=int(time.time() * 1000),
                derived_length=(
                    fr.length if self.sync_derived and not self.background else self.derived_length
                ),
            )
            fs.pwrite_all(lg._head_fd, head.encode(), (self.seq % 2) * SLOT_SIZE)
            if self.sync_head:
                fs.fsync(lg._head_fd)
            self.head = head
            self.done = True
        except NotQuorumSigned as exc:
            # written and synced up to the head, nothing of the head slot written: the log
            # stays usable and the next job asks for the same head (`PartitionLog.abandon`)
            self.error = exc
            self.unsigned = True
            raise
        except BaseException as exc:
            # fsyncgate: after a failed fsync the page cache can no longer be trusted.
            self.error = exc
            lg._poisoned = exc
            raise StorageError(f"commit failed: {exc}") from exc

    def waits_for_fsync(self) -> bool:
        """Whether `run` waits for an fsync. An `interval` job that starts the periodic sync
        hands its fsyncs to a `BackgroundSync` thread and does not wait, unless it also
        syncs the head."""
        if self.sync_head:
            return True
        return not self.background and bool(self.sync_fds or self.sync_dir or self.sync_derived)

    def needs_leaves(self) -> bool:
        """Whether `run` would hash batches (`hash_jobs` may do it for many jobs at once)."""
        return bool(self.pending) and self.leaves is None

    def _groups(self) -> list[list[PendingBatch]]:
        """The pending batches by segment: the new batches of one segment are contiguous in
        its .log and its .bidx, so they are read back as one span and indexed as one run."""
        pending = self.pending
        out = []
        i, n = 0, len(pending)
        while i < n:
            log_fd, k0 = pending[i][0], pending[i][2]
            j = i + 1
            while j < n and pending[j][0] == log_fd:
                j += 1
            if pending[j - 1][2] - k0 != j - i - 1:
                raise StorageError("appended batches are not contiguous in their segment")
            out.append(pending[i:j])
            i = j
        return out

    def _read_back(self, stack: contextlib.ExitStack, views: list[memoryview]) -> None:
        """Append to `views` a view of each pending batch as the page cache holds it (a map
        of the whole span, see FileSystem.read_view), valid until `stack` closes: what we
        hash is exactly what we will serve. The caller releases the views first."""
        fs = self.log.fs
        for group in self._groups():
            span_start = group[0][5]
            span_len = group[-1][5] + group[-1][6] - span_start
            span = stack.enter_context(fs.read_view(group[0][0], span_len, span_start))
            if len(span) != span_len:
                raise StorageError("segment shorter than what was appended")
            for p in group:
                o = p[5] - span_start
                views.append(span[o : o + p[6]])

    def _hash_pending(self) -> None:
        """Leaf hashes (natively: every batch of the job in one call with the GIL released;
        else hashlib, which releases the GIL above 2 KiB: either way this overlaps the owner
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
        holes = self.hole_sizes or {}
        pack_entry = ENTRY.pack
        pack_u32 = U32.pack
        crc = crc32c.crc32c
        if self.leaves is None and NATIVE_LEAVES:
            hash_jobs([self], strict=True)
        # a follower's leaf hashes (computed while verifying), or this round's (`hash_jobs`)
        given = self.leaves
        if given is not None and len(given) != len(pending):
            raise StorageError("given leaf hashes do not match the pending batches")
        i = 0
        for group in self._groups():
            j = i + len(group)
            k0 = group[0][2]
            entries = bytearray()

            def fold(
                leaves: list[bytes],
                lo: int,
                hi: int,
                group: list[PendingBatch] = group,
                entries: bytearray = entries,
            ) -> None:
                for t in range(lo, hi):
                    _, _, _, base, max_ts, pos, size, delta = group[t]
                    leaf = leaves[t]
                    nodes.extend(fr_append(leaf, size or holes[fr.length]))
                    body = pack_entry(base, max_ts, pos, size, delta, leaf)
                    entries.extend(body)
                    entries.extend(pack_u32(crc(body)))

            if given is not None:
                fold(given[i:j], 0, len(group))
            else:
                span_start = group[0][5]
                span_len = group[-1][5] + group[-1][6] - span_start
                with fs.read_view(group[0][0], span_len, span_start) as span:
                    if len(span) != span_len:
                        raise StorageError("segment shorter than what was appended")
                    hash_leaves(span, [(p[5] - span_start, p[6]) for p in group], fold)
            timing.LEAF_HASHED_BYTES.add(sum(p[6] for p in group))
            self.index_writes.append(
                (group[0][1], IDX_HEADER_SIZE + k0 * ENTRY_SIZE, bytes(entries))
            )
            i = j
        self.pending = []
        self.leaves = None


def hash_jobs(jobs: Sequence[CommitJob], *, strict: bool = False) -> None:
    """Hash the pending batches of every job in `jobs` (one commit round, any number of
    partitions) in one call of the native core: leaves are independent, so the more
    there are, the more SIMD lanes are busy (about twice one stream's speed with four),
    and the GIL is released for the whole of the hashing. Each job then folds its leaves
    in `run`. Without the native core this does nothing (each job hashes its own, with
    helper threads). A job whose batches cannot be read back is left to fail in its own
    `run` (only its log is poisoned), unless `strict`. Runs where the jobs run."""
    if not NATIVE_LEAVES:
        return
    todo: list[tuple[CommitJob, int, int]] = []
    views: list[memoryview] = []
    with contextlib.ExitStack() as stack:
        try:
            for job in jobs:
                if not job.needs_leaves():
                    continue
                lo = len(views)
                try:
                    job._read_back(stack, views)
                except (OSError, StorageError):
                    if strict:
                        raise
                    for v in views[lo:]:
                        v.release()
                    del views[lo:]
                    continue
                todo.append((job, lo, len(views)))
            leaves = hash_many(views) if views else []
        finally:
            for v in views:  # before the maps close (read_view's rule)
                v.release()
    for job, lo, hi in todo:
        job.leaves = leaves[lo:hi]

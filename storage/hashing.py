"""Leaf hashes of appended batches: the per-byte half of a group commit.

Owns `compute_leaf` (one Hypercore leaf hash, no concatenation of a large batch) and
`hash_leaves`, which hashes a run of batches for a commit job, sharing a large run with
helper threads on idle cores (hashlib's BLAKE2b releases the GIL above 2 KiB), and
`hash_many`, the native path: every leaf of a whole commit round in one call of the Rust
core, several leaves side by side in SIMD lanes, the GIL released for all of it.

May import the standard library and `storage.hypercore.tree`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from hashlib import blake2b

from storage.hypercore.tree import NATIVE_LEAVES, leaf_hashes

__all__ = [
    "HASH_CHUNK",
    "INLINE_HASH_BELOW",
    "LEAF_HELPERS",
    "LEAF_PREFIX",
    "NATIVE_LEAVES",
    "PARALLEL_HASH_MIN",
    "compute_leaf",
    "hash_leaves",
    "hash_many",
    "idle_helpers",
    "leaf_hashes",
]

LEAF_PREFIX = b"\x00"
INLINE_HASH_BELOW = 4096  # mean batch size under which prepare_commit hashes inline
PARALLEL_HASH_MIN = 512 * 1024  # a job hashing less than this uses one thread
HASH_CHUNK = 256 * 1024  # bytes of batches a hashing thread claims at a time


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


def _hash_range(
    view: memoryview, items: Sequence[tuple[int, int]], leaves: list[bytes], lo: int, hi: int
) -> None:
    for t in range(lo, hi):
        o, size = items[t]
        leaves[t] = compute_leaf(view[o : o + size], size)


def _hash_chunks(
    view: memoryview,
    items: Sequence[tuple[int, int]],
    leaves: list[bytes],
    chunks: Iterator[int],
    step: int,
) -> None:
    """Hash the chunks of `items` claimed from the shared iterator `chunks` (next() is
    atomic under the GIL) into `leaves`."""
    n = len(items)
    for lo in chunks:
        _hash_range(view, items, leaves, lo, min(lo + step, n))


def hash_leaves(
    view: memoryview,
    items: Sequence[tuple[int, int]],
    consume: Callable[[list[bytes], int, int], None],
    helpers: int | None = None,
) -> None:
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


def hash_many(blocks: Sequence[memoryview]) -> list[bytes]:
    """The leaf hash of each block: natively in one call (many lanes at once, GIL released)
    where the core was built (`NATIVE_LEAVES`), else one by one with hashlib."""
    if NATIVE_LEAVES:
        return leaf_hashes(blocks)
    return [compute_leaf(b, b.nbytes) for b in blocks]

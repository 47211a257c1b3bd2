"""Hypercore 11's Merkle tree hashes and the in-memory frontier of a growing tree.

Owns: `Node`, `leaf_hash`, `parent_hash`, `tree_hash` (byte-identical to npm
`hypercore-crypto` ``data``/``parent``/``tree``) and `Frontier`, the <= 64 peaks that
are all an appender needs to keep. BLAKE2b-256 comes from `hashlib` because it is C,
releases the GIL on large inputs and beats libsodium's generichash through PyNaCl on
small ones (the append hot path hashes one leaf and ~one parent per block). Leaves of
4 KiB and more go to the native core where it was built (blake2b_simd, GIL released:
about 1.1 GB/s against hashlib's 0.5-0.9 here), and `leaf_hashes` hashes many leaves at
once in SIMD lanes (about 2.4 GB/s on one core).

May import only the standard library, `storage._native` (optional) and
`storage.hypercore.{flat_tree,errors}`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import NamedTuple

from storage.hypercore import flat_tree
from storage.hypercore.errors import InvalidTree

try:
    from storage._native import leaf_hashes as _native_leaf_hashes
except ImportError:  # built without a Rust toolchain: hashlib serves
    _native_leaf_hashes = None  # type: ignore[assignment]
if os.environ.get("HYPERKAFKA_NO_NATIVE") == "1":
    _native_leaf_hashes = None  # type: ignore[assignment]
_NATIVE_MIN = 4096  # below this hashlib is as fast (call overhead dominates)
# Whether `leaf_hashes` runs natively (many leaves side by side, the GIL released).
NATIVE_LEAVES = _native_leaf_hashes is not None

# Type prefixes make leaf, parent and root hashes disjoint (second-preimage defence).
_LEAF = b"\x00"
_PARENT = b"\x01"
_ROOT = b"\x02"


class Node(NamedTuple):
    """A tree node: flat-tree index, bytes of block data beneath it, BLAKE2b-256 hash."""

    # Shadows tuple.index() on purpose: the field name is the one Hypercore uses everywhere.
    index: int  # type: ignore[assignment]
    size: int
    hash: bytes


def leaf_hash(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE2b-256(0x00 ‖ u64le(len) ‖ data), hypercore-crypto ``data()``."""
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    if n >= _NATIVE_MIN and _native_leaf_hashes is not None:
        return bytes(_native_leaf_hashes([data])[0])
    h = blake2b(_LEAF + n.to_bytes(8, "little"), digest_size=32)
    h.update(data)
    return h.digest()


def leaf_hashes(blocks: Sequence[bytes | bytearray | memoryview]) -> list[bytes]:
    """`leaf_hash` of each block; natively, several blocks side by side, where built."""
    if _native_leaf_hashes is not None:
        return [bytes(h) for h in _native_leaf_hashes(list(blocks))]
    return [leaf_hash(b) for b in blocks]


def parent_hash(left: Node, right: Node) -> bytes:
    """BLAKE2b-256(0x01 ‖ u64le(sizes) ‖ left.hash ‖ right.hash), lower index first."""
    if left.index > right.index:
        # hypercore-crypto orders by index, so callers may pass siblings either way.
        left, right = right, left
    return blake2b(
        _PARENT + (left.size + right.size).to_bytes(8, "little") + left.hash + right.hash,
        digest_size=32,
    ).digest()


def parent_node(left: Node, right: Node) -> Node:
    """The parent of two siblings (index, summed size, hash)."""
    return Node((left.index + right.index) >> 1, left.size + right.size, parent_hash(left, right))


def leaf_node(block_index: int, data: bytes | bytearray | memoryview) -> Node:
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    return Node(2 * block_index, n, leaf_hash(data))


def tree_hash(roots: Iterable[Node]) -> bytes:
    """BLAKE2b-256(0x02 ‖ Σ(hash ‖ u64le(index) ‖ u64le(size))) over the roots, in order."""
    h = blake2b(_ROOT, digest_size=32)
    for r in roots:
        h.update(r.hash + r.index.to_bytes(8, "little") + r.size.to_bytes(8, "little"))
    return h.digest()


def check_roots(roots: Sequence[Node]) -> int:
    """Return the length that `roots` are the full roots of, or raise InvalidTree."""
    if not roots:
        return 0
    length = flat_tree.length_of_roots([roots[-1].index])
    expected = flat_tree.full_roots(2 * length)
    if [r.index for r in roots] != expected:
        raise InvalidTree(f"nodes {[r.index for r in roots]} are not the roots of any length")
    return length


class Frontier:
    """The peaks (roots) of a tree of ``length`` blocks; appends in O(1) amortised hashes.

    Not thread-safe; one owner mutates it. `copy()` is cheap (a list of <= 64 tuples).
    """

    __slots__ = ("_hash", "_roots", "byte_length", "length")

    def __init__(self) -> None:
        self._roots: list[Node] = []
        self.length = 0
        self.byte_length = 0
        self._hash: bytes | None = None

    @classmethod
    def from_roots(cls, roots: Sequence[Node]) -> Frontier:
        """Rebuild from stored roots; raises InvalidTree unless they are a length's roots."""
        f = cls()
        f.length = check_roots(roots)
        f._roots = [Node(r.index, r.size, bytes(r.hash)) for r in roots]
        f.byte_length = sum(r.size for r in roots)
        return f

    def copy(self) -> Frontier:
        f = Frontier()
        f._roots = list(self._roots)
        f.length = self.length
        f.byte_length = self.byte_length
        f._hash = self._hash
        return f

    def roots(self) -> list[Node]:
        return list(self._roots)

    def append(self, leaf: bytes, size: int) -> list[Node]:
        """Add the block whose leaf hash is `leaf` and byte size `size`.

        Returns the nodes created, leaf first then each new parent upwards, so a log can
        persist them. Takes the precomputed hash so the caller may hash off-thread.
        """
        # tuple.__new__ skips NamedTuple's Python-level __new__ (this runs once per block)
        new = tuple.__new__
        index = 2 * self.length
        node = new(Node, (index, size, leaf))
        created = [node]
        roots = self._roots
        span = 2  # distance between same-depth neighbours: 2 ** (depth + 1)
        # The last root is the new node's left sibling exactly when it sits one span left.
        while roots and roots[-1][0] == index - span:
            _, left_size, left_hash = roots.pop()
            total = left_size + size
            index -= span >> 1
            size = total
            leaf = blake2b(_PARENT + total.to_bytes(8, "little") + left_hash + leaf,
                           digest_size=32).digest()
            node = new(Node, (index, total, leaf))
            created.append(node)
            span <<= 1
        roots.append(node)
        self.length += 1
        self.byte_length += created[0][1]
        self._hash = None
        return created

    def append_data(self, data: bytes | bytearray | memoryview) -> list[Node]:
        """Hash `data` as the next block and append it (convenience for tests and tools)."""
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        return self.append(leaf_hash(data), n)

    def tree_hash(self) -> bytes:
        if self._hash is None:
            self._hash = tree_hash(self._roots)
        return self._hash

    def __repr__(self) -> str:
        return f"Frontier(length={self.length}, byte_length={self.byte_length}, roots={[r.index for r in self._roots]})"

"""Flat-tree index arithmetic, as in the npm `flat-tree` package Hypercore uses.

Owns: pure integer functions over flat-tree indexes. Leaf ``i`` (block ``i``) has
index ``2*i``; a node at depth ``d`` and offset ``k`` has index ``2**d * (2*k + 1) - 1``.
A tree of ``length`` blocks is the forest of perfect subtrees given by the binary
decomposition of ``length``; their top nodes are the *roots* (``full_roots(2*length)``).

May not import anything outside the standard library; no I/O.
"""

from __future__ import annotations


def depth(index: int) -> int:
    """Height of the node above the leaves (leaves are depth 0)."""
    # The number of trailing one bits of the index.
    return ((index + 1) & -(index + 1)).bit_length() - 1


def offset(index: int, d: int | None = None) -> int:
    """Position of the node among the nodes of its depth, counted from the left."""
    if d is None:
        d = depth(index)
    return index >> (d + 1)


def index(d: int, off: int) -> int:
    """Flat index of the node at depth ``d`` and offset ``off``."""
    return ((2 * off + 1) << d) - 1


def parent(index_: int) -> int:
    d = depth(index_)
    return index(d + 1, offset(index_, d) >> 1)


def sibling(index_: int) -> int:
    d = depth(index_)
    return index(d, offset(index_, d) ^ 1)


def left_child(index_: int) -> int:
    """Left child, or -1 for a leaf (as flat-tree returns)."""
    if not index_ & 1:
        return -1
    d = depth(index_)
    return index(d - 1, offset(index_, d) * 2)


def right_child(index_: int) -> int:
    if not index_ & 1:
        return -1
    d = depth(index_)
    return index(d - 1, offset(index_, d) * 2 + 1)


def left_span(index_: int) -> int:
    """Index of the leftmost leaf under the node."""
    d = depth(index_)
    return offset(index_, d) << (d + 1)


def right_span(index_: int) -> int:
    """Index of the rightmost leaf under the node."""
    d = depth(index_)
    return ((offset(index_, d) + 1) << (d + 1)) - 2


def spans(index_: int) -> tuple[int, int]:
    return left_span(index_), right_span(index_)


def count_leaves(index_: int) -> int:
    return 1 << depth(index_)


def contains(node: int, other: int) -> bool:
    """True when ``other`` lies in the subtree rooted at ``node`` (inclusive)."""
    half = 1 << depth(node)  # factor / 2 in flat-tree's iterator
    return node - half < other < node + half


def full_roots(head: int) -> list[int]:
    """Root indexes of the tree whose next leaf index is ``head`` (= 2 * length)."""
    if head & 1:
        raise ValueError("full_roots takes an even (leaf) index")
    n = head >> 1
    result: list[int] = []
    off = 0
    while n:
        factor = 1 << (n.bit_length() - 1)  # largest power of two <= n
        result.append(off + factor - 1)
        off += 2 * factor
        n -= factor
    return result


def length_of_roots(root_indexes: list[int]) -> int:
    """Number of blocks covered by a forest whose last root is ``root_indexes[-1]``."""
    if not root_indexes:
        return 0
    return right_span(root_indexes[-1]) // 2 + 1

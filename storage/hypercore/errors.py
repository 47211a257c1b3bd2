"""Typed errors of the Hypercore primitives.

Owns: the exception hierarchy raised by `storage.hypercore`. Standard library only.
"""

from __future__ import annotations


class HypercoreError(Exception):
    """Base of every error `storage.hypercore` raises on purpose."""


class DecodeError(HypercoreError, ValueError):
    """Bytes that are not a valid compact-encoding of the expected message."""


class InvalidProof(HypercoreError):
    """A proof that does not verify: wrong shape, wrong nodes, or wrong signature."""


class InvalidTree(HypercoreError, ValueError):
    """Nodes that cannot form the tree they claim to (e.g. roots for no length)."""

"""Helpers for the storage tests: realistic v2 batches and a fresh Frontier model."""

from __future__ import annotations

import random
import struct

import crc32c

from storage.batch import build_batch
from storage.hypercore import Frontier, derive_keypair, leaf_hash

KEYPAIR = derive_keypair(bytes(range(32)), b"test-partition")


def make_batch(n_records: int = 1, value_size: int = 10, ts: int = 1_000, seed: int = 0) -> bytearray:
    rng = random.Random(seed)
    values = [rng.randbytes(value_size) for _ in range(n_records)]
    return build_batch(values, timestamp_ms=ts)


def batch_of_size(size: int, ts: int = 1_000) -> bytearray:
    """One-record batch of exactly `size` bytes (size >= 80)."""
    b = build_batch([b""], timestamp_ms=ts)
    value = bytes(size - len(b) - 2)  # varint length grows by up to 2 bytes
    b = build_batch([value], timestamp_ms=ts)
    while len(b) < size:
        value += b"\0"
        b = build_batch([value], timestamp_ms=ts)
    return b


def crc_ok(batch: bytes) -> bool:
    return bool(crc32c.crc32c(batch[21:]) == struct.unpack_from(">I", batch, 17)[0])


def tree_hash_of(batches: list[bytes]) -> bytes:
    f = Frontier()
    for b in batches:
        f.append(leaf_hash(b), len(b))
    return f.tree_hash()


def split_batches(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
        out.append(data[pos : pos + size])
        pos += size
    return out

"""Every broker's copy of a quorum-signed topic's partitions, read from the data dirs after
a run, as plain data for compat_tests/jepsen/checker.py.

Owns `read_copies`: for each broker's data dir, each copy it holds of ``TOPIC-P`` (its
own archive, ``TOPIC-P``, or a mirror's, ``__mirrors/<node key>/TOPIC-P``, which a
failover turns into the leader's in place), a `dict` with the copy's head as stored
(fork, length, tree hash), whether the archive verifies fully against its manifest
(`storage.verify.verify_partition`, what ``hyperkafka verify`` runs: every batch against
its leaf, the tree against the head, the head against a quorum of the manifest's
signers), the leaf hash of every block the head covers (two heads of one fork agree iff
the shorter one's leaves are a prefix of the longer one's), and the records those blocks
hold (offset -> value). A copy without a head (nothing signed yet) is listed with
length 0.

Read-only, and run after the brokers stopped. May import the standard library,
`storage` and `broker.protocol.records` (to decode the batches).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

from broker.protocol.records import iter_records
from storage.fs import OsFileSystem
from storage.hypercore.multisig import head_manifest
from storage.log import ENTRY_SIZE, IDX_HEADER_SIZE, check_head, read_head_slots
from storage.manifest_file import read_manifest
from storage.store import MIRRORS_DIR
from storage.verify import verify_partition

_ENTRY = struct.Struct("<qqIIi32s")  # base offset, max ts, position, size, delta, leaf


def copy_dirs(data_dir: Path, topic: str, partition: int) -> list[Path]:
    name = f"{topic}-{partition}"
    out = [data_dir / name] if (data_dir / name).is_dir() else []
    mirrors = data_dir / MIRRORS_DIR
    if mirrors.is_dir():
        out += sorted(d / name for d in mirrors.iterdir() if (d / name).is_dir())
    return out


def read_copy(path: Path) -> dict[str, Any]:
    """One archive directory, summarised (see the module docstring)."""
    fs = OsFileSystem()
    out: dict[str, Any] = {"path": str(path), "fork": 0, "length": 0, "tree": "", "leaves": [],
                           "records": {}, "ok": True, "why": ""}  # fmt: skip
    manifest = read_manifest(fs, str(path))
    if manifest is None:
        return {**out, "ok": False, "why": "no manifest: not a quorum-signed archive"}
    if not (path / "head").exists():
        return out
    fd = fs.open(str(path / "head"), os.O_RDONLY)
    try:
        head, _ = read_head_slots(fs, fd)
    finally:
        fs.close(fd)
    if head is None:
        return out
    out.update(fork=head.fork, length=head.length, tree=head.tree_hash.hex())
    why = check_head(head, manifest, head_manifest(manifest).hash())
    res = verify_partition(str(path), manifest)
    if why or not res.ok:
        return {**out, "ok": False, "why": why or f"offset {res.first_bad_offset}: {res.reason}"}
    leaves: list[str] = []
    records: dict[int, str] = {}
    bases = sorted(int(n.name[:-4]) for n in path.iterdir() if n.name.endswith(".log"))
    for base in bases:
        entries = (path / f"{base:020d}.bidx").read_bytes()[IDX_HEADER_SIZE:]
        data = (path / f"{base:020d}.log").read_bytes()
        for k in range(len(entries) // ENTRY_SIZE):
            if len(leaves) >= head.length - head.min_index:
                break
            _base, _ts, pos, size, _delta, leaf = _ENTRY.unpack_from(entries, k * ENTRY_SIZE)
            leaves.append(leaf.hex())
            for r in iter_records(data[pos : pos + size]):
                records[r.offset] = (r.value or b"").decode(errors="replace")
    out.update(leaves=leaves, records=records, min_index=head.min_index)
    return out


def read_copies(data_dirs: dict[int, Path], topic: str, partitions: int) -> list[dict[str, Any]]:
    """Every copy of every partition of `topic` in the brokers' data dirs (broker id ->
    data dir), each tagged with its broker and partition."""
    return [
        {"broker": broker, "partition": p, **read_copy(path)}
        for broker, data_dir in sorted(data_dirs.items())
        for p in range(partitions)
        for path in copy_dirs(data_dir, topic, p)
    ]

"""The `manifest` file of a quorum-signed archive directory (storage/FORMAT.md section 1).

Owns: reading and writing the encoded Hypercore manifest that a multisig archive keeps
beside its segments. A directory without the file is a single-signer archive whose
manifest is the default one of its key (every archive of a single node): nothing is
written for those, so their directories stay exactly as they were. The file is written
once, before the genesis head (tmp + fsync + rename), and never changes: the archive key
is its hash.

May import the standard library and `storage.{fs,errors,hypercore}`.
"""

from __future__ import annotations

import os

from storage.errors import ArchiveDamaged
from storage.fs import FileSystem
from storage.hypercore import HypercoreError, Manifest

MANIFEST_FILE = "manifest"
MAX_MANIFEST_BYTES = 64 * 1024  # 32 signers take 2.1 KB; refuse to read anything huge


def read_manifest(fs: FileSystem, path: str) -> Manifest | None:
    """The manifest stored in archive directory `path`, or None when there is none.
    ArchiveDamaged when the file is there but is not a manifest we can verify against."""
    mpath = os.path.join(path, MANIFEST_FILE)
    if not fs.exists(mpath):
        return None
    raw = fs.read_file(mpath)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ArchiveDamaged(f"{mpath}: {len(raw)} bytes is not a manifest")
    try:
        m = Manifest.decode(raw)
    except HypercoreError as exc:
        raise ArchiveDamaged(f"{mpath}: undecodable manifest: {exc}") from exc
    if not m.signers or not 1 <= m.quorum <= len(m.signers) or m.prologue or m.allow_patch:
        raise ArchiveDamaged(
            f"{mpath}: unsupported manifest (quorum {m.quorum} of "
            f"{len(m.signers)} signers, prologue or patches)"
        )
    return m


def write_manifest(fs: FileSystem, path: str, manifest: Manifest) -> None:
    """Record `manifest` in archive directory `path` (idempotent for the same manifest;
    ArchiveDamaged if the directory already holds another archive's)."""
    have = read_manifest(fs, path)
    if have is not None:
        if have != manifest:
            raise ArchiveDamaged(f"{path} holds the archive of another manifest")
        return
    fs.write_file_atomic(os.path.join(path, MANIFEST_FILE), manifest.encode())

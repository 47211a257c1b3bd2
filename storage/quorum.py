"""Quorum-signed partitions, the storage side: a partition's manifest and the signing
rule a replica keeps on disk (storage/FORMAT.md section 11, docs/clusters.md).

Owns: `partition_manifest` (v2 manifest: the replicas' node keys, majority quorum,
userData naming the partition), the `signed` record of the highest head a replica
signed, and `sign_proposal`, the only way a replica signs a head of a quorum-signed
archive: it checks the proposed tree against the tree of what it holds, checks the
record, makes the new record durable, and only then returns its signature. So a replica
never signs two heads that disagree within a fork, whatever crashes in between.

Sans-I/O apart from the record file: the caller says what tree it holds (`tree_at`) and
must hold those blocks durably before asking. May import the standard library, crc32c
and `storage.{fs,errors,hypercore,store}`; never trio or `broker`.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import crc32c

from storage.errors import ArchiveDamaged, StorageError
from storage.fs import FileSystem
from storage.hypercore import KeyPair, Manifest
from storage.hypercore.multisig import PartialSignature, multisig_manifest, sign_partial
from storage.store import partition_key_name

SIGNED_FILE = "signed"
_MAGIC = b"HKSIGN01"
_BODY = struct.Struct("<8sQQ32s")  # 56 bytes, then CRC and 4 zero bytes
_SIZE = 64


def partition_manifest(
    replica_keys: Sequence[bytes], topic_id: uuid.UUID, partition: int
) -> Manifest:
    """The manifest of a cluster partition replicated on the brokers whose node keys are
    `replica_keys` (placement order, leader first): majority quorum, and userData = the
    partition's key name, so the archive key is unique per partition and per topic id."""
    return multisig_manifest(replica_keys, None, partition_key_name(topic_id, partition))


@dataclass(frozen=True)
class SignedRecord:
    """The highest head a replica signed: (fork, length, tree hash)."""

    fork: int
    length: int
    tree_hash: bytes

    def encode(self) -> bytes:
        body = _BODY.pack(_MAGIC, self.fork, self.length, self.tree_hash)
        return body + struct.pack("<I", crc32c.crc32c(body)) + bytes(4)

    @classmethod
    def decode(cls, data: bytes) -> SignedRecord:
        """ArchiveDamaged when the bytes are not an intact record: the replica then cannot
        tell what it promised, and must not sign until someone looks."""
        if len(data) != _SIZE or data[:8] != _MAGIC:
            raise ArchiveDamaged("signing record is not a record (bad size or magic)")
        if crc32c.crc32c(data[: _BODY.size]) != struct.unpack_from("<I", data, _BODY.size)[0]:
            raise ArchiveDamaged("signing record fails its CRC")
        _, fork, length, th = _BODY.unpack_from(data, 0)
        return cls(fork, length, th)


def read_record(fs: FileSystem, path: str) -> SignedRecord | None:
    """The signing record of archive directory `path`; None when it never signed."""
    p = os.path.join(path, SIGNED_FILE)
    if not fs.exists(p):
        return None
    return SignedRecord.decode(fs.read_file(p))


class RefusedToSign(StorageError):
    """The proposal contradicts what this replica holds or already signed."""


def sign_proposal(
    fs: FileSystem,
    path: str,
    keypair: KeyPair,
    manifest: Manifest,
    fork: int,
    length: int,
    tree_hash: bytes,
    tree_at: Callable[[int], bytes | None],
) -> PartialSignature:
    """Sign the head (`fork`, `length`, `tree_hash`) of the quorum-signed archive in
    `path` as `keypair`, one of `manifest`'s signers, if the signing rule allows it.

    `tree_at(n)` is the tree hash of the first n blocks this replica holds durably (None
    when it holds fewer). Raises RefusedToSign, or ArchiveDamaged for an unreadable record.
    The record is fsynced before this returns, so the signature never precedes it."""
    if length < 1 or len(tree_hash) != 32:
        raise RefusedToSign(f"nothing to sign at length {length}")
    own = tree_at(length)
    if own is None:
        raise RefusedToSign(f"holds fewer than the {length} blocks proposed")
    if own != tree_hash:
        raise RefusedToSign(
            f"the proposed tree at length {length} is not the tree of what it holds"
        )
    rec = read_record(fs, path)
    if rec is not None:
        if fork < rec.fork:
            raise RefusedToSign(f"fork {fork} is older than fork {rec.fork} it signed")
        if fork == rec.fork:
            if length < rec.length:
                raise RefusedToSign(
                    f"length {length} is below length {rec.length} it signed in fork {fork}"
                )
            if tree_at(rec.length) != rec.tree_hash:
                raise RefusedToSign(
                    f"its blocks no longer form the tree it signed at length {rec.length} in fork {fork}"
                )
    new = SignedRecord(fork, length, bytes(tree_hash))
    partial = sign_partial(keypair, manifest, tree_hash, length, fork)  # raises for a non-signer
    if new != rec:
        fs.write_file_atomic(os.path.join(path, SIGNED_FILE), new.encode())
    return partial

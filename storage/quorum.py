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
PROMISED_FILE = "promised"
_PMAGIC = b"HKPROM01"
_PBODY = struct.Struct("<8sQ")  # 16 bytes, then CRC and 4 zero bytes
_PSIZE = 24


def partition_manifest(
    replica_keys: Sequence[bytes], topic_id: uuid.UUID, partition: int
) -> Manifest:
    """The manifest of a cluster partition replicated on the brokers whose node keys are
    `replica_keys` (placement order, leader first): majority quorum, and userData = the
    partition's key name, so the archive key is unique per partition and per topic id."""
    return multisig_manifest(replica_keys, None, partition_key_name(topic_id, partition))


def manifest_partition(manifest: Manifest) -> int | None:
    """The partition index a `partition_manifest` names in its userData; None for any
    other manifest."""
    data = manifest.user_data or b""
    prefix = b"hyperkafka/partition/"
    if not data.startswith(prefix) or len(data) < len(prefix) + 18:
        return None
    rest = data[len(prefix) + 16 :]
    if rest[:1] != b"/" or not rest[1:].isdigit():
        return None
    return int(rest[1:])


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


class RefusedToPromise(StorageError):
    """A vote for an epoch older than one this replica already promised."""


def encode_promise(epoch: int) -> bytes:
    body = _PBODY.pack(_PMAGIC, epoch)
    return body + struct.pack("<I", crc32c.crc32c(body)) + bytes(4)


def decode_promise(data: bytes) -> int:
    """ArchiveDamaged unless `data` is an intact promise record (FORMAT.md section 11)."""
    if len(data) != _PSIZE or data[:8] != _PMAGIC:
        raise ArchiveDamaged("promise record is not a record (bad size or magic)")
    if crc32c.crc32c(data[: _PBODY.size]) != struct.unpack_from("<I", data, _PBODY.size)[0]:
        raise ArchiveDamaged("promise record fails its CRC")
    return int(_PBODY.unpack_from(data, 0)[1])


def read_promise(fs: FileSystem, path: str) -> int:
    """The leader epoch archive directory `path` promised (0: none)."""
    p = os.path.join(path, PROMISED_FILE)
    if not fs.exists(p):
        return 0
    return decode_promise(fs.read_file(p))


@dataclass(frozen=True)
class Vote:
    """A replica's answer to a failover vote for epoch `epoch`: its longest head, the
    greater by (fork, length) of its stored quorum-signed head and the head it last
    signed (which a quorum may have completed while the assembled head never reached it:
    an acknowledged write lives on at least one voter of any majority only as this)."""

    epoch: int
    fork: int
    length: int
    tree_hash: bytes

    @property
    def rank(self) -> tuple[int, int]:
        return (self.fork, self.length)


def promise(
    fs: FileSystem,
    path: str,
    epoch: int,
    stored: tuple[int, int, bytes] | None,
    tree_at: Callable[[int], bytes | None],
) -> Vote:
    """Promise leader epoch `epoch` for the quorum-signed archive in `path` and answer
    this replica's longest head. `stored`: (fork, length, tree hash) of its stored head,
    None if it has none; `tree_at` as for `sign_proposal` (a signed head is answered only
    while this replica still holds its blocks: one it lost, say across a reopen that cut
    its unsigned tail, is not answered, and its stored head is).

    The same epoch again is answered again (a controller's retry); an older one raises
    RefusedToPromise. The promise is fsynced before this returns: the vote never precedes
    it, and from then on `sign_proposal` refuses every fork older than `epoch`."""
    if epoch < 1:
        raise RefusedToPromise(f"epoch {epoch}: leader epochs of a failover start at 1")
    have = read_promise(fs, path)
    if epoch < have:
        raise RefusedToPromise(f"epoch {epoch} is older than epoch {have} it promised")
    if epoch != have:
        fs.write_file_atomic(os.path.join(path, PROMISED_FILE), encode_promise(epoch))
    best = Vote(epoch, 0, 0, tree_at(0) or b"")
    if stored is not None:
        best = Vote(epoch, stored[0], stored[1], stored[2])
    rec = read_record(fs, path)
    held = rec is not None and tree_at(rec.length) == rec.tree_hash
    if rec is not None and held and (rec.fork, rec.length) > best.rank:
        best = Vote(epoch, rec.fork, rec.length, rec.tree_hash)
    return best


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
    promised = read_promise(fs, path)
    if fork < promised:
        raise RefusedToSign(f"fork {fork} is older than epoch {promised} it promised a vote for")
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

"""Hypercore 11 multisig heads: several signers, a quorum, one assembled signature.

Owns: building a multi-signer manifest (lib/verifier.js ``createManifest``, default
quorum = majority), one signer's partial signature over the 112-byte tree signable,
assembling partial signatures into the ``multiSignature`` wrapper (lib/multisig.js
``assemble``), ``signableLength``, and checking a head against any v1/v2 manifest
exactly as lib/verifier.js ``_verifyMulti`` / ``verify`` do.

What a v1+ signer signs: ``TREE_NS ‖ manifest hash ‖ tree hash ‖ u64 length ‖ u64 fork``
(caps.treeSignable with the manifest hash as context). A signer's ``namespace`` field is
part of the manifest (so of its hash, the archive key) but not of the signable: Hypercore
uses the namespace as signing context only for v0 (compat) manifests, which we never make.
A signature made for another archive, or over a namespace instead of the manifest hash,
therefore fails here exactly as it fails in Hypercore.

Patches (``allowPatch``: a signer that signed a shorter tree, upgraded by shared patch
nodes) are not produced and not accepted: our replicas sign the very tree the leader
publishes. A manifest with ``allow_patch`` whose proofs carry a patch is rejected; with
``allow_patch`` off, Hypercore ignores a proof's patch count and so do we.

May import only the standard library, PyNaCl and `storage.hypercore.{crypto,tree,errors}`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from storage.hypercore.crypto import (
    DEFAULT_NAMESPACE,
    KeyPair,
    Manifest,
    MultiSignature,
    MultisigProof,
    Signer,
    sign_raw,
    signable,
    verify_head,
    verify_raw,
)
from storage.hypercore.errors import HypercoreError
from storage.hypercore.tree import Node, tree_hash


def majority(signers: int) -> int:
    """lib/verifier.js ``defaultQuorum``: ``(n >> 1) + 1`` signers (0 for none)."""
    return (signers >> 1) + 1 if signers > 0 else 0


def multisig_manifest(
    public_keys: Sequence[bytes], quorum: int | None = None, user_data: bytes | None = None
) -> Manifest:
    """A manifest naming `public_keys` (in this order) with `quorum` (default majority):
    v1, or v2 carrying `user_data` (as Hypercore's createManifest picks the version).

    The order is part of the archive key: a proof names its signer by index. Refuses what
    Hypercore's ``createManifest`` refuses (a quorum above the signer count) and what
    could never verify (no signers, duplicate keys, quorum < 1).
    """
    keys = [bytes(k) for k in public_keys]
    if not keys:
        raise ValueError("a multisig manifest needs at least one signer")
    if any(len(k) != 32 for k in keys):
        raise ValueError("signer public keys are 32 bytes")
    if len(set(keys)) != len(keys):
        raise ValueError("a signer may appear only once in a manifest")
    q = majority(len(keys)) if quorum is None else quorum
    if not 1 <= q <= len(keys):
        raise ValueError(f"quorum must be between 1 and {len(keys)} signers, got {q}")
    signers = tuple(Signer(k, DEFAULT_NAMESPACE) for k in keys)
    if user_data:
        return Manifest(signers=signers, quorum=q, version=2, user_data=bytes(user_data))
    return Manifest(signers=signers, quorum=q)


def signer_index(manifest: Manifest, public_key: bytes) -> int:
    """The position of `public_key` among the manifest's signers; ValueError if absent."""
    for i, s in enumerate(manifest.signers):
        if s.public_key == public_key:
            return i
    raise ValueError("public key is not a declared signer of this manifest")


def _th(roots_or_tree_hash: Sequence[Node] | bytes) -> bytes:
    if isinstance(roots_or_tree_hash, bytes | bytearray | memoryview):
        th = bytes(roots_or_tree_hash)
        if len(th) != 32:
            raise ValueError("tree hash must be 32 bytes")
        return th
    return tree_hash(roots_or_tree_hash)


@dataclass(frozen=True)
class PartialSignature:
    """One signer's ed25519 signature over a head (lib/multisig.js ``partialSignature``
    with ``patch = 0``): what a replica returns to the leader."""

    signer: int
    signature: bytes


def sign_partial(
    keypair: KeyPair,
    manifest: Manifest,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int,
) -> PartialSignature:
    """Sign the head (tree, length, fork) of the archive `manifest` as `keypair`.

    Byte-identical to ``verifier.sign(batch, keyPair)`` of Hypercore for a manifest with
    several signers (a bare 64-byte signature; ed25519 is deterministic).
    """
    if manifest.version not in (1, 2):
        raise ValueError("only v1/v2 manifests are signed")
    idx = signer_index(manifest, keypair.public_key)
    msg = signable(manifest.hash(), _th(roots_or_tree_hash), length, fork)
    return PartialSignature(idx, sign_raw(keypair, msg))


def assemble(partials: Iterable[PartialSignature]) -> bytes:
    """lib/multisig.js ``assemble`` without patches: proofs in the given order.

    Hypercore checks only the first ``quorum`` proofs, so pass them signer-sorted and
    deduplicated (see `assemble_quorum`) unless you mean to reproduce another order.
    """
    proofs = tuple(MultisigProof(p.signer, p.signature, 0) for p in partials)
    return MultiSignature(proofs).encode()


def assemble_quorum(manifest: Manifest, partials: Iterable[PartialSignature]) -> bytes:
    """The head signature to publish: `manifest.quorum` partial signatures, one per signer,
    lowest signer index first. ValueError when fewer distinct signers than the quorum
    are given; the partials themselves are assumed checked (`verify_partial`)."""
    by_signer: dict[int, PartialSignature] = {}
    for p in partials:
        if not 0 <= p.signer < len(manifest.signers):
            raise ValueError(f"signer {p.signer} is not in the manifest")
        by_signer.setdefault(p.signer, p)
    if manifest.quorum < 1 or len(by_signer) < manifest.quorum:
        raise ValueError(f"{len(by_signer)} distinct signers, the quorum is {manifest.quorum}")
    return assemble(by_signer[i] for i in sorted(by_signer)[: manifest.quorum])


def verify_partial(
    manifest: Manifest,
    partial: PartialSignature,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int,
) -> bool:
    """Is `partial` a valid signature of its claimed signer over this head?"""
    if not 0 <= partial.signer < len(manifest.signers):
        return False
    msg = signable(manifest.hash(), _th(roots_or_tree_hash), length, fork)
    return verify_raw(manifest.signers[partial.signer].public_key, msg, partial.signature)


def verify_manifest_head(
    manifest: Manifest,
    key: bytes,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int,
    signature: bytes | None,
) -> bool:
    """Check a stored or wire head signature against `manifest` for archive `key`.

    lib/verifier.js ``verify`` for v1/v2 manifests: a prologue covers lengths up to its
    own by tree hash alone; otherwise the first ``quorum`` proofs must each name a
    distinct declared signer and carry its valid signature. `key` must be the manifest's
    hash, so a head cannot be replayed under another archive. Malformed input is False.
    """
    if manifest.version not in (1, 2) or manifest.hash() != key:
        return False
    th = _th(roots_or_tree_hash)
    if manifest.prologue is not None and length <= manifest.prologue.length:
        return length == manifest.prologue.length and th == manifest.prologue.hash
    if not signature or manifest.quorum < 1:
        return False
    try:
        ms = MultiSignature.decode(signature)
    except HypercoreError:
        return False
    if len(ms.proofs) < manifest.quorum:
        return False
    msg = signable(key, th, length, fork)
    tried: set[int] = set()
    for proof in ms.proofs[: manifest.quorum]:
        if proof.patch and manifest.allow_patch:
            return False  # patched proofs are not supported (module docstring)
        if proof.signer >= len(manifest.signers) or proof.signer in tried:
            return False
        tried.add(proof.signer)
        if not verify_raw(manifest.signers[proof.signer].public_key, msg, proof.signature):
            return False
    return True


def signable_length(lengths: Sequence[int], quorum: int) -> int:
    """lib/multisig.js ``signableLength``: the longest length that `quorum` of the given
    signer lengths reach (0 if fewer lengths than the quorum)."""
    q = quorum if quorum > 0 else 1
    if q > len(lengths):
        return 0
    return sorted(lengths, reverse=True)[q - 1]


HeadSigner = bytes | Manifest
"""Who signs an archive's heads: a single signer's public key (the default v1 manifest
of that key, as every single-node archive has) or a full manifest."""


def head_manifest(signer: HeadSigner) -> Manifest:
    """The manifest a `HeadSigner` stands for."""
    return signer if isinstance(signer, Manifest) else Manifest.default(signer)


def verify_signed_head(
    signer: HeadSigner,
    key: bytes,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int,
    signature: bytes | None,
) -> bool:
    """Check a head against a single signer's key (the unchanged `verify_head` path) or
    against a manifest (`verify_manifest_head`)."""
    if isinstance(signer, Manifest):
        return verify_manifest_head(signer, key, roots_or_tree_hash, length, fork, signature)
    if signature is None:
        return False
    return verify_head(signer, key, roots_or_tree_hash, length, fork, signature)

"""Hypercore 11 keys, manifests and signed heads.

Owns: the "hypercore" namespaces (lib/caps.js), ed25519 key pairs and their
deterministic derivation, the manifest (lib/messages.js ``manifest``) and its hash,
which is the archive key, the discovery key, the 112-byte tree signable and the
multisig signature wrapper (lib/messages.js ``multiSignature``) that Hypercore stores
and sends for a v1 manifest.

May import only the standard library, PyNaCl and `storage.hypercore.{tree,encoding,errors}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import NamedTuple

import nacl.bindings
import nacl.exceptions

from storage.hypercore.encoding import Reader, encode_buffer, encode_uint
from storage.hypercore.errors import DecodeError, HypercoreError
from storage.hypercore.tree import Node, tree_hash


def _h(data: bytes, key: bytes | None = None) -> bytes:
    if key is None:
        return blake2b(data, digest_size=32).digest()
    return blake2b(data, digest_size=32, key=key).digest()


def namespace(name: bytes, count: int) -> list[bytes]:
    """hypercore-crypto ``namespace(name, count)``: H(H(name) ‖ byte i) for i < count."""
    base = _h(name)
    return [_h(base + bytes((i,))) for i in range(count)]


(
    TREE_NS,
    REPLICATE_INITIATOR_NS,
    REPLICATE_RESPONDER_NS,
    MANIFEST_NS,
    DEFAULT_NAMESPACE,
    DEFAULT_ENCRYPTION_NS,
) = namespace(b"hypercore", 6)

# Corestore's namespace for seed derivation (corestore index.js: ``[NS] = namespace('corestore', 1)``).
(CORESTORE_NS,) = namespace(b"corestore", 1)


class KeyPair(NamedTuple):
    """ed25519 keys in libsodium layout: 32-byte public key, 64-byte secret (seed ‖ pk)."""

    public_key: bytes
    secret_key: bytes

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        """libsodium ``crypto_sign_seed_keypair`` (hypercore-crypto ``keyPair(seed)``)."""
        if len(seed) != 32:
            raise ValueError("ed25519 seed must be 32 bytes")
        pk, sk = nacl.bindings.crypto_sign_seed_keypair(seed)
        return cls(pk, sk)


def derive_keypair(node_seed: bytes, name: bytes, namespace: bytes = bytes(32)) -> KeyPair:
    """Deterministic key pair for archive `name` under a node's secret `node_seed`.

    Exactly Corestore 7's ``createKeyPair(name)`` with ``primaryKey = node_seed``:
    ``seed = BLAKE2b-256(key=node_seed, msg=CORESTORE_NS ‖ namespace ‖ name)`` and then
    ``crypto_sign_seed_keypair(seed)``; Corestore's default namespace is 32 zero bytes.
    So a Corestore opened with the same primary key derives the same archive keys.
    Different names give independent keys; nothing about `node_seed` leaks from them.
    """
    if len(node_seed) != 32:
        raise ValueError("node seed must be 32 bytes")
    if len(namespace) != 32:
        raise ValueError("namespace must be 32 bytes")
    return KeyPair.from_seed(_h(CORESTORE_NS + namespace + name, key=node_seed))


def discovery_key(key: bytes) -> bytes:
    """BLAKE2b-256(key=core key, msg="hypercore"): the public channel id of a core."""
    return _h(b"hypercore", key=key)


# ---------------------------------------------------------------------------- manifest

_FLAG_PATCH = 1
_FLAG_PROLOGUE = 2
_FLAG_LINKED = 4
_FLAG_USER_DATA = 8


@dataclass(frozen=True)
class Signer:
    """One manifest signer; Hypercore supports only ed25519 (id 0)."""

    public_key: bytes
    namespace: bytes = DEFAULT_NAMESPACE


@dataclass(frozen=True)
class Prologue:
    """A pre-committed prefix: the tree hash at `length` blocks."""

    hash: bytes
    length: int


@dataclass(frozen=True)
class Manifest:
    """A v1/v2 Hypercore manifest (hash is always BLAKE2b, signatures always ed25519)."""

    signers: tuple[Signer, ...]
    quorum: int = 1
    version: int = 1
    allow_patch: bool = False
    prologue: Prologue | None = None
    linked: tuple[bytes, ...] | None = None
    user_data: bytes | None = field(default=None)

    @classmethod
    def default(cls, public_key: bytes) -> Manifest:
        """What ``new Hypercore(storage, {keyPair})`` creates (Verifier.defaultSignerManifest)."""
        return cls(signers=(Signer(bytes(public_key)),))

    def encode(self) -> bytes:
        if self.version not in (1, 2):
            raise ValueError("only manifest versions 1 and 2 are encoded")
        flags = (
            (_FLAG_PATCH if self.allow_patch else 0)
            | (_FLAG_PROLOGUE if self.prologue else 0)
            | (_FLAG_LINKED if self.linked else 0)
            | (_FLAG_USER_DATA if self.user_data else 0)
        )
        out = [encode_uint(self.version), encode_uint(flags), encode_uint(0)]  # 0 = blake2b
        out.append(encode_uint(self.quorum))
        out.append(encode_uint(len(self.signers)))
        for s in self.signers:
            if len(s.public_key) != 32 or len(s.namespace) != 32:
                raise ValueError("signer key and namespace must be 32 bytes")
            out.append(b"\x00" + s.namespace + s.public_key)  # 0 = ed25519
        if self.prologue:
            out.append(self.prologue.hash + encode_uint(self.prologue.length))
        if self.linked:
            out.append(encode_uint(len(self.linked)))
            out.extend(self.linked)
        if self.user_data:
            out.append(encode_buffer(self.user_data))
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        r = Reader(data)
        m = cls.read(r)
        r.finish()
        return m

    @classmethod
    def read(cls, r: Reader) -> Manifest:
        version = r.uint()
        if version not in (1, 2):
            # v0 (compat-era) manifests are never produced by Hypercore 11 for new cores.
            raise DecodeError(f"unsupported manifest version {version}")
        flags = r.uint()
        if r.uint() != 0:
            raise DecodeError("unknown manifest hash id")
        quorum = r.uint()
        signers = []
        for _ in range(r.array_length()):
            if r.uint() != 0:
                raise DecodeError("unknown signature id")
            ns = r.fixed(32)
            signers.append(Signer(r.fixed(32), ns))
        prologue = Prologue(r.fixed(32), r.uint()) if flags & _FLAG_PROLOGUE else None
        linked = (
            tuple(r.fixed(32) for _ in range(r.array_length())) if flags & _FLAG_LINKED else None
        )
        user_data = r.buffer() if flags & _FLAG_USER_DATA else None
        return cls(
            signers=tuple(signers),
            quorum=quorum,
            version=version,
            allow_patch=bool(flags & _FLAG_PATCH),
            prologue=prologue,
            linked=linked,
            user_data=user_data,
        )

    def hash(self) -> bytes:
        return manifest_hash(self)


def manifest_hash(manifest: Manifest | bytes) -> bytes:
    """BLAKE2b-256(MANIFEST_NS ‖ encode(manifest)): the core key of a v1+ core."""
    enc = manifest.encode() if isinstance(manifest, Manifest) else bytes(manifest)
    return _h(MANIFEST_NS + enc)


def archive_key(public_key: bytes) -> bytes:
    """The key Hypercore 11 gives a core created with this single signer's key pair."""
    return manifest_hash(Manifest.default(public_key))


# ----------------------------------------------------------------------- signed heads


def signable(key: bytes, tree_hash: bytes, length: int, fork: int) -> bytes:
    """TREE_NS ‖ key(manifest hash) ‖ treeHash ‖ u64le(length) ‖ u64le(fork): 112 bytes."""
    if len(key) != 32 or len(tree_hash) != 32:
        raise ValueError("key and tree hash must be 32 bytes")
    return TREE_NS + key + tree_hash + length.to_bytes(8, "little") + fork.to_bytes(8, "little")


class MultisigProof(NamedTuple):
    signer: int
    signature: bytes
    patch: int


@dataclass(frozen=True)
class MultiSignature:
    """lib/messages.js ``multiSignature``: per-signer proofs plus shared patch nodes."""

    proofs: tuple[MultisigProof, ...]
    patch: tuple[Node, ...] = ()

    def encode(self) -> bytes:
        out = [encode_uint(len(self.proofs))]
        for p in self.proofs:
            if len(p.signature) != 64:
                raise ValueError("ed25519 signatures are 64 bytes")
            out += [encode_uint(p.signer), p.signature, encode_uint(p.patch)]
        out.append(encode_uint(len(self.patch)))
        for n in self.patch:
            out += [encode_uint(n.index), encode_uint(n.size), n.hash]
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> MultiSignature:
        """Strict decode: trailing bytes are an error (compact-encoding would ignore them)."""
        r = Reader(data)
        proofs = tuple(
            MultisigProof(r.uint(), r.fixed(64), r.uint()) for _ in range(r.array_length())
        )
        patch = tuple(Node(r.uint(), r.uint(), r.fixed(32)) for _ in range(r.array_length()))
        r.finish()
        return cls(proofs, patch)


def _tree_hash_of(roots_or_tree_hash: Sequence[Node] | bytes) -> bytes:
    if isinstance(roots_or_tree_hash, bytes | bytearray | memoryview):
        th = bytes(roots_or_tree_hash)
        if len(th) != 32:
            raise ValueError("tree hash must be 32 bytes")
        return th
    return tree_hash(roots_or_tree_hash)


def sign_raw(keypair: KeyPair, message: bytes) -> bytes:
    """Detached ed25519 signature (64 bytes), deterministic per RFC 8032."""
    return bytes(nacl.bindings.crypto_sign(message, keypair.secret_key)[:64])


def verify_raw(public_key: bytes, message: bytes, signature: bytes) -> bool:
    if len(signature) != 64 or len(public_key) != 32:
        return False
    try:
        nacl.bindings.crypto_sign_open(signature + message, public_key)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError):
        return False
    return True


def sign_head(
    keypair: KeyPair,
    key: bytes,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int = 0,
) -> bytes:
    """The 68-byte signature Hypercore stores for a default v1 single-signer core.

    ``[1 proof][signer 0][ed25519 over signable(...)][patch 0][0 patch nodes]``.
    """
    sig = sign_raw(keypair, signable(key, _tree_hash_of(roots_or_tree_hash), length, fork))
    return MultiSignature((MultisigProof(0, sig, 0),)).encode()


def verify_head(
    public_key: bytes,
    key: bytes,
    roots_or_tree_hash: Sequence[Node] | bytes,
    length: int,
    fork: int,
    signature: bytes,
) -> bool:
    """Check a stored/wire signature of a default single-signer v1 core at (length, fork).

    Mirrors Verifier._verifyMulti for ``quorum=1, allowPatch=false``: the first proof
    must name signer 0 and carry a valid ed25519 signature over the signable. Also checks
    that `key` is this public key's archive key, so a head cannot be replayed under
    another core. Undecodable wrappers are False, never an exception.
    """
    if archive_key(public_key) != key:
        return False
    try:
        ms = MultiSignature.decode(signature)
    except HypercoreError:
        return False
    if not ms.proofs or ms.proofs[0].signer != 0:
        return False
    msg = signable(key, _tree_hash_of(roots_or_tree_hash), length, fork)
    return verify_raw(public_key, msg, ms.proofs[0].signature)

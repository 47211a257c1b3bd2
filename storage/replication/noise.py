"""Noise XX over Ed25519, exactly as @hyperswarm/secret-stream runs it.

Owns: the handshake state machine "Noise_XX_Ed25519_ChaChaPoly_BLAKE2b" of the npm
packages noise-handshake 4 + noise-curve-ed 2: BLAKE2b-512 as HASH, HMAC-BLAKE2b HKDF,
ChaCha20-Poly1305-IETF with nonce ``0000 ‖ u64le(n)``, DH =
``crypto_scalarmult_ed25519_noclamp(clamp(SHA-512(seed)[:32]), remote ed25519 point)``,
an empty prologue and empty payloads. The static key is an ordinary ed25519 key pair, so
the remote's static key is its ed25519 public key.

Sans-I/O: `NoiseXX.write_message()` / `read_message(bytes)` return and take message
bodies (no uint24 length prefix; the transport adds that). Ephemeral keys may be passed
in so tests can replay known-answer vectors generated from the JS.

May import only the standard library, PyNaCl and `storage.replication.errors`.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NamedTuple

import nacl.bindings as sodium
import nacl.exceptions

from storage.replication.errors import HandshakeError, LocalProtocolError

PROTOCOL_NAME = b"Noise_XX_Ed25519_ChaChaPoly_BLAKE2b"
HASHLEN = 64
DHLEN = 32
MAC = 16


class Ed25519KeyPair(NamedTuple):
    """libsodium layout: 32-byte public key, 64-byte secret key (seed ‖ public key)."""

    public_key: bytes
    secret_key: bytes

    @classmethod
    def from_seed(cls, seed: bytes) -> Ed25519KeyPair:
        pk, sk = sodium.crypto_sign_seed_keypair(seed)
        return cls(pk, sk)

    @classmethod
    def generate(cls) -> Ed25519KeyPair:
        pk, sk = sodium.crypto_sign_keypair()
        return cls(pk, sk)


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.blake2b).digest()


def hkdf(salt: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """noise-handshake's hkdf with empty info and two 64-byte outputs (RFC 5869)."""
    prk = _hmac(salt, ikm)
    t1 = _hmac(prk, b"\x01")
    t2 = _hmac(prk, t1 + b"\x02")
    return t1, t2


def dh(remote_public: bytes, local: Ed25519KeyPair) -> bytes:
    """noise-curve-ed ``dh``: the clamped scalar of the seed times the remote point."""
    sk = bytearray(hashlib.sha512(local.secret_key[:32]).digest()[:32])
    sk[0] &= 248
    sk[31] &= 127
    sk[31] |= 64
    try:
        return bytes(sodium.crypto_scalarmult_ed25519_noclamp(bytes(sk), remote_public))
    except (nacl.exceptions.RuntimeError, nacl.exceptions.ValueError, nacl.exceptions.TypeError) as e:
        # libsodium refuses small-order and non-canonical points; a peer sending one is hostile.
        raise HandshakeError(f"unusable remote DH key: {e}") from e


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


class NoiseXX:
    """One side of the XX handshake; three messages, then `complete` with tx/rx/hash."""

    def __init__(
        self,
        initiator: bool,
        static: Ed25519KeyPair,
        *,
        ephemeral: Ed25519KeyPair | None = None,
    ) -> None:
        self.initiator = initiator
        self.s = static
        self._e_fixed = ephemeral
        self.e: Ed25519KeyPair | None = None
        self.re: bytes | None = None
        self.rs: bytes | None = None
        # Protocol name fits in HASHLEN, so h is the name zero-padded (Noise spec 5.2).
        self.h = PROTOCOL_NAME.ljust(HASHLEN, b"\x00")
        self.ck = self.h
        self._k: bytes | None = None
        self._n = 0
        self._mix_hash(b"")  # empty prologue
        self._step = 0  # messages processed so far (0..3)
        self.complete = False
        self.tx = b""
        self.rx = b""
        self.handshake_hash = b""

    # ------------------------------------------------------------------ symmetric state

    def _mix_hash(self, data: bytes) -> None:
        self.h = _hash(self.h + data)

    def _mix_key(self, remote: bytes, local: Ed25519KeyPair) -> None:
        self.ck, temp = hkdf(self.ck, dh(remote, local))
        self._k = temp[:32]
        self._n = 0

    def _encrypt_and_hash(self, plaintext: bytes) -> bytes:
        if self._k is None:
            ct = plaintext
        else:
            ct = sodium.crypto_aead_chacha20poly1305_ietf_encrypt(
                plaintext, self.h, _nonce(self._n), self._k
            )
            self._n += 1
        self._mix_hash(ct)
        return bytes(ct)

    def _decrypt_and_hash(self, ct: bytes) -> bytes:
        if self._k is None:
            pt = ct
        else:
            try:
                pt = sodium.crypto_aead_chacha20poly1305_ietf_decrypt(
                    ct, self.h, _nonce(self._n), self._k
                )
            except nacl.exceptions.CryptoError as e:
                raise HandshakeError("handshake message failed authentication") from e
            self._n += 1
        self._mix_hash(ct)
        return bytes(pt)

    def _split(self) -> None:
        k1, k2 = hkdf(self.ck, b"")
        self.tx, self.rx = (k1[:32], k2[:32]) if self.initiator else (k2[:32], k1[:32])
        self.handshake_hash = self.h
        self.complete = True

    # ------------------------------------------------------------------ messages

    def _my_turn(self) -> bool:
        # XX: initiator writes messages 0 and 2, the responder writes message 1.
        return (self._step % 2 == 0) == self.initiator

    def write_message(self) -> bytes:
        """The next handshake message body (empty payload)."""
        if self.complete or not self._my_turn():
            raise LocalProtocolError("not our turn to write a handshake message")
        out = []
        if self._step == 0:
            out.append(self._write_e())
        elif self._step == 1:
            out.append(self._write_e())
            assert self.re is not None and self.e is not None
            self._mix_key(self.re, self.e)  # ee
            out.append(self._encrypt_and_hash(self.s.public_key))  # s
            self._mix_key(self.re, self.s)  # es (responder: local static, remote ephemeral)
        else:
            out.append(self._encrypt_and_hash(self.s.public_key))  # s
            assert self.re is not None
            self._mix_key(self.re, self.s)  # se (initiator: local static, remote ephemeral)
        out.append(self._encrypt_and_hash(b""))
        self._step += 1
        if self._step == 3:
            self._split()
        return b"".join(out)

    def _write_e(self) -> bytes:
        self.e = self._e_fixed or Ed25519KeyPair.generate()
        self._mix_hash(self.e.public_key)
        return self.e.public_key

    def read_message(self, msg: bytes) -> None:
        """Consume the peer's next handshake message; HandshakeError if it is bad."""
        if self.complete or self._my_turn():
            raise HandshakeError("unexpected handshake message")
        msg = bytes(msg)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal pos
            if len(msg) - pos < n:
                raise HandshakeError("handshake message too short")
            v = msg[pos : pos + n]
            pos += n
            return v

        if self._step == 0:
            self.re = take(DHLEN)
            self._mix_hash(self.re)
        elif self._step == 1:
            self.re = take(DHLEN)
            self._mix_hash(self.re)
            assert self.e is not None
            self._mix_key(self.re, self.e)  # ee
            self.rs = self._decrypt_and_hash(take(DHLEN + MAC))  # s
            self._mix_key(self.rs, self.e)  # es (initiator: local ephemeral, remote static)
        else:
            self.rs = self._decrypt_and_hash(take(DHLEN + MAC))  # s
            assert self.e is not None
            self._mix_key(self.rs, self.e)  # se (responder: local ephemeral, remote static)
        payload = self._decrypt_and_hash(msg[pos:])
        if payload:
            # secret-stream never sends a handshake payload; refuse rather than ignore data.
            raise HandshakeError("unexpected handshake payload")
        self._step += 1
        if self._step == 3:
            self._split()

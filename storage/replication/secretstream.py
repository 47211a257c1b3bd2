"""The @hyperswarm/secret-stream transport as a sans-I/O object.

Owns: uint24le length framing (a frame body is at most 2**24 - 1 bytes), the three Noise
XX handshake frames (`storage.replication.noise`), the 56-byte id header each side sends
next (``streamId ‖ secretstream header``, where ``streamId = BLAKE2b-256(key=handshake
hash, msg=NS_INITIATOR or NS_RESPONDER)`` and the namespaces are hypercore-crypto's
``namespace('hyperswarm/secret-stream', 3)``), and then one libsodium
crypto_secretstream_xchacha20poly1305 message per frame (empty plaintext = keep-alive,
dropped here). The unordered UDP "send" channel of secret-stream is not implemented (it
needs a UDX socket; over TCP the JS never uses it).

Shape: `receive_data(bytes) -> list[bytes]` returns whole decrypted messages;
`send(bytes)` queues one encrypted frame; `data_to_send()` drains the outgoing buffer.
Input is parsed from a buffer that is only consumed once a frame is whole, so partial
input never leaves half-changed state. Only `HandshakeError`/`FramingError` escape.

Copies: `send` encrypts straight into the frame it queues and `receive_data` decrypts
straight out of the bytes read, by calling libsodium through PyNaCl's cffi module
(`nacl._sodium`): the public wrappers take only `bytes` and return copies, which cost a
fresh 64 KiB allocation and copy per block and direction. Same C functions, same bytes.

May import only the standard library, PyNaCl and `storage.replication.{noise,errors}`.
"""

from __future__ import annotations

import hashlib

import nacl.bindings as sodium
import nacl.exceptions
from nacl._sodium import ffi, lib

from storage.replication.errors import FramingError, HandshakeError, LocalProtocolError
from storage.replication.noise import Ed25519KeyPair, NoiseXX


def _namespace(name: bytes, count: int) -> list[bytes]:
    base = hashlib.blake2b(name, digest_size=32).digest()
    return [hashlib.blake2b(base + bytes((i,)), digest_size=32).digest() for i in range(count)]


NS_INITIATOR, NS_RESPONDER, NS_SEND = _namespace(b"hyperswarm/secret-stream", 3)

MAX_FRAME = (1 << 24) - 1
ABYTES = sodium.crypto_secretstream_xchacha20poly1305_ABYTES  # 17: tag byte + 16-byte MAC
HEADERBYTES = sodium.crypto_secretstream_xchacha20poly1305_HEADERBYTES  # 24
ID_HEADER_BYTES = 32 + HEADERBYTES
# Largest plaintext a single frame can carry.
MAX_MESSAGE = MAX_FRAME - ABYTES


def stream_id(handshake_hash: bytes, initiator: bool) -> bytes:
    ns = NS_INITIATOR if initiator else NS_RESPONDER
    return hashlib.blake2b(ns, digest_size=32, key=handshake_hash).digest()


def frame(body: bytes) -> bytes:
    """uint24le length prefix + body."""
    n = len(body)
    if n > MAX_FRAME:
        raise LocalProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return n.to_bytes(3, "little") + body


class SecretStream:
    """One end of a secret-stream connection (initiator = the side that dialled)."""

    def __init__(
        self,
        initiator: bool,
        static: Ed25519KeyPair | None = None,
        *,
        ephemeral: Ed25519KeyPair | None = None,
    ) -> None:
        self.initiator = initiator
        self.static = static or Ed25519KeyPair.generate()
        self._noise: NoiseXX | None = NoiseXX(initiator, self.static, ephemeral=ephemeral)
        self._in = bytearray()
        self._out: list[bytes | bytearray] = []
        self._push: object | None = None
        self._pull: object | None = None
        self._plain = ffi.new("unsigned char[]", 0)  # reused decryption buffer
        self._tag = ffi.new("unsigned char *")
        self._tx = b""
        self._rx = b""
        self.handshake_hash = b""
        self.remote_public_key = b""
        self.established = False  # both id headers exchanged: application data may flow
        self.handshake_complete = False
        if initiator:
            self._out.append(frame(self._noise.write_message()))

    # ------------------------------------------------------------------ output

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def send(self, message: bytes) -> None:
        """Encrypt `message` into one frame (after the handshake)."""
        if self._push is None:
            raise LocalProtocolError("secret stream is not set up yet")
        if len(message) > MAX_MESSAGE:
            raise LocalProtocolError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
        mlen = len(message)
        clen = mlen + ABYTES
        out = bytearray(3 + clen)
        out[0:3] = clen.to_bytes(3, "little")
        with ffi.from_buffer(out) as o, ffi.from_buffer(message) as m:
            rc = lib.crypto_secretstream_xchacha20poly1305_push(
                self._push.statebuf,  # type: ignore[attr-defined]
                ffi.cast("unsigned char *", o) + 3,
                ffi.NULL,
                m,
                mlen,
                ffi.NULL,
                0,
                sodium.crypto_secretstream_xchacha20poly1305_TAG_MESSAGE,
            )
        if rc != 0:
            raise LocalProtocolError("secretstream push failed")
        self._out.append(out)

    # ------------------------------------------------------------------ input

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Feed bytes from the wire; returns the application messages they completed.

        Whole frames are decrypted straight out of `data`; only an incomplete tail is
        kept for the next call. (Appending every read to a buffer, slicing a bytearray,
        converting to bytes and trimming cost four copies of every byte, a quarter of a
        follower's time at 64 KiB blocks.)"""
        buffered = bool(self._in)
        if buffered:
            self._in += data
        view = memoryview(self._in if buffered else data).cast("B")
        out: list[bytes] = []
        pos = 0
        end = len(view)
        try:
            while end - pos >= 3:
                n = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
                if end - pos < 3 + n:
                    break
                pos += 3 + n
                with view[pos - n : pos] as body:
                    msg = self._incoming(body)
                if msg:  # None during setup; empty = keep-alive
                    out.append(msg)
            tail = b"" if buffered or pos == end else bytes(view[pos:])
        finally:
            view.release()
        if buffered:
            del self._in[:pos]
        elif tail:
            self._in += tail
        return out

    def _incoming(self, body: memoryview) -> bytes | None:
        if self._noise is not None:
            self._on_handshake(bytes(body))
            return None
        if self._pull is None:
            self._on_id_header(bytes(body))
            return None
        clen = len(body)
        if clen < ABYTES:
            raise FramingError("encrypted frame shorter than its MAC")
        mlen = clen - ABYTES
        if len(self._plain) < mlen:
            self._plain = ffi.new("unsigned char[]", max(mlen, 1 << 16))
        with ffi.from_buffer(body) as c:  # released here, so `body` can be
            rc = lib.crypto_secretstream_xchacha20poly1305_pull(
                self._pull.statebuf,  # type: ignore[attr-defined]
                self._plain,
                ffi.NULL,
                self._tag,
                c,
                clen,
                ffi.NULL,
                0,
            )
        if rc != 0:
            raise FramingError("frame failed authentication")
        return ffi.buffer(self._plain, mlen)[:]  # type: ignore[no-any-return]

    def _on_handshake(self, body: bytes) -> None:
        noise = self._noise
        assert noise is not None
        if not body:
            raise HandshakeError("empty handshake frame")
        noise.read_message(body)
        if not noise.complete:
            self._out.append(frame(noise.write_message()))
        if noise.complete:
            self._setup(noise)

    def _setup(self, noise: NoiseXX) -> None:
        self._noise = None
        self.handshake_complete = True
        self.handshake_hash = noise.handshake_hash
        assert noise.rs is not None
        self.remote_public_key = noise.rs
        self._tx, self._rx = noise.tx, noise.rx
        state = sodium.crypto_secretstream_xchacha20poly1305_state()
        header = sodium.crypto_secretstream_xchacha20poly1305_init_push(state, self._tx)
        self._push = state
        self._out.append(frame(stream_id(self.handshake_hash, self.initiator) + bytes(header)))

    def _on_id_header(self, body: bytes) -> None:
        if len(body) != ID_HEADER_BYTES:
            raise HandshakeError("invalid secret-stream header message")
        if body[:32] != stream_id(self.handshake_hash, not self.initiator):
            raise HandshakeError("invalid secret-stream id")
        state = sodium.crypto_secretstream_xchacha20poly1305_state()
        try:
            sodium.crypto_secretstream_xchacha20poly1305_init_pull(state, body[32:], self._rx)
        except (nacl.exceptions.CryptoError, nacl.exceptions.ValueError, ValueError) as e:
            raise HandshakeError("bad secretstream header") from e
        self._pull = state
        self.established = True

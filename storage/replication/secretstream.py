"""The @hyperswarm/secret-stream transport as a sans-I/O object.

Owns: uint24le length framing (a frame body is at most 2**24 - 1 bytes), the three Noise
XX handshake frames (`storage.replication.noise`), the 56-byte id header each side sends
next (``streamId ‖ secretstream header``, where ``streamId = BLAKE2b-256(key=handshake
hash, msg=NS_INITIATOR or NS_RESPONDER)`` and the namespaces are hypercore-crypto's
``namespace('hyperswarm/secret-stream', 3)``), and then one libsodium
crypto_secretstream_xchacha20poly1305 message per frame (empty plaintext = keep-alive,
dropped here). The unordered UDP "send" channel of secret-stream is not implemented (it
needs a UDX socket; over TCP the JS never uses it).

Shape: `receive_data(bytes) -> list[bytes]` returns whole decrypted messages (or, to read
from the socket straight into our buffer, `get_buffer()` then `buffer_updated(n)`);
`send(bytes)` / `send_parts([...])` queue one encrypted frame; `data_to_send()` drains
the outgoing buffer (`buffers_to_send()` as separate frames, for a vectored write).
Input is parsed from a buffer that is only consumed once a frame is whole, so partial
input never leaves half-changed state. Only `HandshakeError`/`FramingError` escape.

Copies: `send` encrypts straight into the frame it queues and frames are decrypted
straight out of the receive buffer, by calling libsodium through PyNaCl's cffi module
(`nacl._sodium`): the public wrappers take only `bytes` and return copies, which cost a
fresh 64 KiB allocation and copy per block and direction. Same C functions, same bytes.
Reads land in one reused buffer (`get_buffer`): a fresh 256 KiB object per read, and
appending partial frames to a backlog, cost page faults and copies of every byte.

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
FRAME_POOL = 256  # frame buffers kept for reuse
RECEIVE_BUFFER = 1 << 20  # reused receive buffer (grows for a frame larger than this)
ABYTES = sodium.crypto_secretstream_xchacha20poly1305_ABYTES  # 17: tag byte + 16-byte MAC
HEADERBYTES = sodium.crypto_secretstream_xchacha20poly1305_HEADERBYTES  # 24
ID_HEADER_BYTES = 32 + HEADERBYTES
# Before the stream is set up only Noise messages (under 100 bytes: no payloads) and the
# id header come: a bigger frame is refused from its length prefix, before it arrives.
MAX_SETUP_FRAME = 1024
# The receive buffer starts small (a connection that sends little costs little: idle
# peers, the handshake) and doubles while reads fill it, up to RECEIVE_BUFFER; a frame
# larger than the buffer grows it towards the frame's size as its bytes arrive.
INITIAL_BUFFER = 2 * MAX_SETUP_FRAME
MIN_FREE = 1024
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
        self._out: list[bytes | bytearray] = []
        self.unsent = 0  # bytes queued in _out (a driver stops reading past a bound)
        self._push: object | None = None
        self._pull: object | None = None
        self._plain = ffi.new("unsigned char[]", 0)  # reused decryption buffer
        self._gather = bytearray()  # reused plaintext buffer of send_parts
        self._pool: list[bytearray] = []  # frames sent and given back (`recycle`)
        self._rbuf = bytearray(INITIAL_BUFFER)  # get_buffer / buffer_updated
        self._rfill = 0  # bytes of _rbuf holding input not parsed yet
        self._offered = 0  # free bytes the last get_buffer offered
        self._busy = False  # the last read filled them: the peer is sending a lot
        self._tag = ffi.new("unsigned char *")
        self._tx = b""
        self._rx = b""
        self.handshake_hash = b""
        self.remote_public_key = b""
        self.established = False  # both id headers exchanged: application data may flow
        self.handshake_complete = False
        if initiator:
            self._queue(frame(self._noise.write_message()))

    # ------------------------------------------------------------------ output

    def _queue(self, f: bytes | bytearray) -> None:
        self._out.append(f)
        self.unsent += len(f)

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        self.unsent = 0
        return out

    def buffers_to_send(self) -> list[bytes | bytearray]:
        """The queued frames as they are (for a vectored write: no join of megabytes)."""
        out, self._out = self._out, []
        self.unsent = 0
        return out

    def send(self, message: bytes | bytearray | memoryview) -> None:
        """Encrypt `message` into one frame (after the handshake)."""
        self._push_frame(message, len(message))

    def send_parts(self, parts: list[bytes | bytearray | memoryview]) -> None:
        """Encrypt the concatenation of `parts` as one message: the parts are gathered
        into a reused plaintext buffer (hot in cache, no allocation), not joined."""
        if len(parts) == 1:
            self.send(parts[0])
            return
        mlen = sum(len(p) for p in parts)
        if len(self._gather) < mlen:
            self._gather = bytearray(max(mlen, 2 * len(self._gather), 1 << 16))
        buf = self._gather
        pos = 0
        for p in parts:
            n = len(p)
            buf[pos : pos + n] = p
            pos += n
        self._push_frame(buf, mlen)

    def recycle(self, frames: list[bytes | bytearray]) -> None:
        """Frames from `buffers_to_send` that were written and are referenced no more:
        their buffers are reused for the next frames. (A fresh 64 KiB buffer per frame
        costs page faults whenever the allocator handed memory back to the kernel: a
        third of a server's time.)"""
        pool = self._pool
        for f in frames:
            if len(pool) >= FRAME_POOL:
                break
            if isinstance(f, bytearray):
                pool.append(f)

    def _frame(self, n: int) -> bytearray:
        """A buffer of `n` bytes, from the pool when one is there (contents undefined)."""
        pool = self._pool
        while pool:
            f = pool.pop()
            try:
                if len(f) > n:
                    del f[n:]  # keeps its memory unless it shrinks below half
                elif len(f) < n:
                    f.extend(bytes(n - len(f)))
            except BufferError:  # still exported (a view outlived the send): leave it
                continue
            return f
        return bytearray(n)

    def _push_frame(self, message: bytes | bytearray | memoryview, mlen: int) -> None:
        if self._push is None:
            raise LocalProtocolError("secret stream is not set up yet")
        if mlen > MAX_MESSAGE:
            raise LocalProtocolError(f"message of {mlen} bytes exceeds {MAX_MESSAGE}")
        clen = mlen + ABYTES
        out = self._frame(3 + clen)
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
        self._queue(out)

    # ------------------------------------------------------------------ input

    def get_buffer(self) -> memoryview:
        """Where to read the next bytes from the socket into (``recv_into``); then call
        `buffer_updated` with the count, after releasing the view. One reused buffer: no
        allocation per read, and only the partial frame at its end is ever moved."""
        buf = self._rbuf
        size = len(buf)
        need = self._rfill + MIN_FREE
        if self._rfill >= 3 and size - self._rfill < size // 4:
            # Nearly full of a frame bigger than the buffer: grow towards its size, at
            # most doubling, so memory follows the bytes that arrived (a peer announcing
            # 16 MiB and sending nothing gets no 16 MiB) at amortized linear copying.
            frame_end = 3 + (buf[0] | buf[1] << 8 | buf[2] << 16)
            if frame_end > size:
                need = max(need, min(frame_end, 2 * size))
        if self._busy and self._pull is not None:
            need = max(need, min(2 * size, RECEIVE_BUFFER))  # the last read filled it
        if need > size:
            buf.extend(bytes(need - size))
        self._offered = len(buf) - self._rfill
        return memoryview(self._rbuf)[self._rfill :]

    def buffer_updated(self, n: int) -> list[bytes]:
        """`n` bytes were written where `get_buffer` pointed; returns the application
        messages they completed (as `receive_data`)."""
        self._busy = n >= self._offered
        end = self._rfill + n
        buf = self._rbuf
        view = memoryview(buf)
        out: list[bytes] = []
        pos = 0
        try:
            while end - pos >= 3:
                k = buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16
                if k > MAX_SETUP_FRAME and self._pull is None:
                    raise HandshakeError(f"a {k}-byte frame before the stream is set up")
                if end - pos < 3 + k:
                    break
                pos += 3 + k
                with view[pos - k : pos] as body:
                    msg = self._incoming(body)
                if msg:  # None during setup; empty = keep-alive
                    out.append(msg)
        finally:
            view.release()
        if pos:
            buf[: end - pos] = buf[pos:end]  # the partial frame, if any, to the front
        self._rfill = end - pos
        if self._rfill == 0 and len(buf) > 4 * RECEIVE_BUFFER:
            self._rbuf = bytearray(RECEIVE_BUFFER)  # after a huge frame: give it back
        return out

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Feed bytes from the wire; returns the application messages they completed."""
        out: list[bytes] = []
        data = memoryview(data).cast("B")
        while data:
            into = self.get_buffer()
            n = min(len(into), len(data))
            into[:n] = data[:n]
            into.release()
            data = data[n:]
            out += self.buffer_updated(n)
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
            self._queue(frame(noise.write_message()))
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
        self._queue(frame(stream_id(self.handshake_hash, self.initiator) + bytes(header)))

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

"""Kafka's length-prefixed framing: an int32 big-endian size, then that many bytes.

Owns `FrameDecoder` (sans-I/O: feed it bytes with `receive_data`, pull whole frames with
`next_frame`) and `frame()`. Imports only the standard library and `.errors`.

The size is validated before a single byte of the payload is buffered for it, so a peer
announcing 100 MiB cannot make us allocate it up front; memory grows only with bytes
actually received. Small frames live in one bytearray with a read cursor: consuming a
frame moves the cursor instead of deleting from the front (which would copy the tail
every time), and the consumed prefix is dropped only once it is at least half the
buffer, so copying stays linear. A large frame gets its own bytearray that the decoder
hands over and forgets, so the caller may keep memoryviews into it (record batches) for
as long as it likes while the connection keeps reading.

A large frame of at most `prealloc_max` bytes gets its whole buffer when its size is
read, and `receive_buffer()` then offers the part still to fill, so a socket can
`recv_into` it: the payload is copied once (kernel to frame) instead of twice (kernel to a
fresh bytes, then into the frame). That pins up to `prealloc_max` bytes per connection
before they arrive, as Kafka does for a whole request; bigger frames still grow only with
the bytes received.
"""

from __future__ import annotations

import struct

from .errors import FrameTooLarge, InvalidFrame

__all__ = ["DEFAULT_MAX_FRAME_SIZE", "FrameDecoder", "frame"]

DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes default
# A Produce of one 1 MiB batch (librdkafka's and the Java client's largest by default,
# message.max.bytes) with its headers fits.
DEFAULT_PREALLOC_MAX = 2 * 1024 * 1024
_SIZE = struct.Struct(">i")


def frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Return `payload` with its int32 size prefix."""
    return _SIZE.pack(len(payload)) + bytes(payload)


class FrameDecoder:
    """Split a byte stream into Kafka frames (payloads without the size prefix).

    `next_frame()` returns `bytes` for frames under `large_frame_size`, and for larger
    ones a writable `memoryview` over a bytearray that belongs to the caller from then on
    (a handler may patch a record batch in place). After an `InvalidFrame` the decoder is
    poisoned: the stream cannot be resynchronised, so the connection must be closed.
    """

    def __init__(
        self,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        *,
        large_frame_size: int = 64 * 1024,
        prealloc_max: int = DEFAULT_PREALLOC_MAX,
    ) -> None:
        if max_frame_size < 0:
            raise ValueError("max_frame_size must be >= 0")
        self.max_frame_size = max_frame_size
        self.large_frame_size = large_frame_size
        self.prealloc_max = prealloc_max
        self._buf = bytearray()
        self._pos = 0
        self._error: InvalidFrame | None = None
        # The large frame being assembled: its buffer, how much of it is filled, and its
        # announced size. Preallocated (len == size) up to prealloc_max, else grown.
        self._large: bytearray | None = None
        self._large_fill = 0
        self._large_size = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        pending = self._large_fill if self._large is not None else 0
        return pending + len(self._buf) - self._pos

    def receive_buffer(self) -> memoryview | None:
        """The unfilled rest of a preallocated large frame, for `recv_into`; then call
        `received_into(n)`. None when the next bytes must go through `receive_data`."""
        large = self._large
        if large is None or len(large) != self._large_size or self._large_fill >= self._large_size:
            return None
        return memoryview(large)[self._large_fill :]

    def received_into(self, n: int) -> None:
        """`n` bytes were written at the start of the last `receive_buffer()`."""
        if self._large is None or not 0 <= n <= self._large_size - self._large_fill:
            raise ValueError("more bytes than the frame has room for")
        self._large_fill += n

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes read from the socket. Never raises for well-typed input."""
        if self._large is not None:
            large, fill = self._large, self._large_fill
            need = self._large_size - fill
            rest = None
            if len(data) > need:
                view = memoryview(data)
                data, rest = view[:need], view[need:]
            take = len(data)
            if len(large) == self._large_size:  # preallocated
                large[fill : fill + take] = data
            else:
                large += data
            self._large_fill = fill + take
            if rest is None:
                return
            data = rest
        if self._pos and self._pos * 2 >= len(self._buf):
            # Compact only when the dead prefix is at least half the buffer: amortised O(1).
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> bytes | memoryview | None:
        """Return the next whole frame's payload, or None if more bytes are needed.

        Raises `FrameTooLarge` or `InvalidFrame` as soon as a bad size prefix is readable.
        """
        if self._error is not None:
            raise self._error
        if self._large is not None:
            if self._large_fill < self._large_size:
                return None
            done = self._large
            self._large = None
            return memoryview(done)
        avail = len(self._buf) - self._pos
        if avail < 4:
            return None
        (size,) = _SIZE.unpack_from(self._buf, self._pos)
        if size < 0:
            self._error = InvalidFrame(f"negative frame size {size}")
            raise self._error
        if size > self.max_frame_size:
            self._error = FrameTooLarge(size, self.max_frame_size)
            raise self._error
        start = self._pos + 4
        if size >= self.large_frame_size:
            # Move what we have of it into its own buffer; the rest is appended there.
            have = min(avail - 4, size)
            if size <= self.prealloc_max:
                large = bytearray(size)
                large[:have] = memoryview(self._buf)[start : start + have]
            else:
                large = bytearray(self._buf[start : start + have])
            self._large = large
            self._large_fill = have
            self._large_size = size
            self._pos = start + have
            return self.next_frame()
        if avail - 4 < size:
            return None
        self._pos = start + size
        return bytes(self._buf[start : self._pos])

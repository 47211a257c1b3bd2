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

A large frame's buffer grows as its bytes arrive, `grow_chunk` bytes at a time, never
ahead of them by more than that: a peer that sends a 4-byte size prefix and nothing more
costs us nothing but the prefix. `receive_buffer()` grows the buffer by one chunk when it
is full and offers the unfilled part, so a socket can `recv_into` it: the payload is
copied once (kernel to frame) instead of twice (kernel to a fresh bytes, then into the
frame). Growing a bytearray that large reallocates in place (glibc `mremap`), so the
chunks cost a few syscalls, not copies (compat_tests/bench/framing.py measures it).
`announced` tells the driver the size of the frame being received as soon as its prefix
is read, so it can account for it (broker/memory.py) before reading the rest.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import cast

from .errors import FrameTooLarge, InvalidFrame

__all__ = ["DEFAULT_MAX_FRAME_SIZE", "FrameDecoder", "frame"]

DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes default
# What a large frame's buffer may hold ahead of the bytes received: one recv_into.
DEFAULT_GROW_CHUNK = 64 * 1024
_SIZE = struct.Struct(">i")


_ZEROS = bytes(DEFAULT_GROW_CHUNK)


def _zeros(n: int) -> bytes | memoryview:
    return memoryview(_ZEROS)[:n] if n <= len(_ZEROS) else bytes(n)


def _byte_array_resize() -> Callable[[bytearray, int], int] | None:
    """CPython's `PyByteArray_Resize`, which lengthens a bytearray without writing the new
    bytes (as `+=` does, minus its copy); None where the C API is not there. Like `+=` it
    raises BufferError while a view of the bytearray is alive."""
    try:
        import ctypes

        resize = ctypes.pythonapi.PyByteArray_Resize
    except (ImportError, AttributeError):  # pragma: no cover - not CPython
        return None
    resize.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
    resize.restype = ctypes.c_int
    return cast(Callable[[bytearray, int], int], resize)


# Why: the bytes a large frame's buffer grows by are written by `recv_into` right after;
# zero-filling them first wrote every byte of a large request twice (about 55 us per MiB
# on the 2-core machine, against about 650 us to receive it; compat_tests/bench/framing.py).
# A grown byte is never read before it is received: a frame is handed over only when full.
_RESIZE = _byte_array_resize()


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
        grow_chunk: int = DEFAULT_GROW_CHUNK,
    ) -> None:
        if max_frame_size < 0:
            raise ValueError("max_frame_size must be >= 0")
        self.max_frame_size = max_frame_size
        self.large_frame_size = large_frame_size
        if grow_chunk <= 0:
            raise ValueError("grow_chunk must be > 0")
        self.grow_chunk = grow_chunk
        self._buf = bytearray()
        self._pos = 0
        self._error: InvalidFrame | None = None
        # The large frame being assembled: its buffer, how much of it is filled, and its
        # announced size. The buffer is at most one grow_chunk longer than what is filled.
        self._large: bytearray | None = None
        self._large_fill = 0
        self._large_size = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        pending = self._large_fill if self._large is not None else 0
        return pending + len(self._buf) - self._pos

    @property
    def announced(self) -> int | None:
        """The size of the frame being received once its prefix is here and valid, else
        None (no prefix yet, or one `next_frame` will refuse)."""
        if self._large is not None:
            return self._large_size
        if len(self._buf) - self._pos < 4:
            return None
        (size,) = _SIZE.unpack_from(self._buf, self._pos)
        return size if 0 <= size <= self.max_frame_size else None

    @property
    def receiving_large(self) -> bool:
        """A large frame is being received: its next bytes go to `receive_buffer()`."""
        return self._large is not None and self._large_fill < self._large_size

    @property
    def needed(self) -> int | None:
        """Bytes still missing from the frame being received (from its prefix while that
        is incomplete), or None when nothing of it is here or its prefix is refused."""
        if self._large is not None:
            return self._large_size - self._large_fill
        avail = len(self._buf) - self._pos
        if avail == 0:
            return None
        if avail < 4:
            return 4 - avail
        size = self.announced
        return None if size is None else max(size - (avail - 4), 0)

    def receive_buffer(self) -> memoryview | None:
        """Room for the next bytes of a large frame, for `recv_into` (at most
        `grow_chunk`, grown now if the buffer is full); then call `received_into(n)`.
        None when the next bytes must go through `receive_data`."""
        large = self._large
        if large is None:
            return None
        fill = self._large_fill
        if fill >= self._large_size:
            return None
        if fill == len(large):
            self.grow(self.grow_chunk)
        return memoryview(large)[fill:]

    @property
    def room(self) -> int:
        """Bytes the large frame's buffer has grown and not filled (what `recv_into` may
        write without growing it)."""
        large = self._large
        return 0 if large is None else len(large) - self._large_fill

    @property
    def growth(self) -> int:
        """What the next growth of the large frame's buffer adds (0: none being received)."""
        large = self._large
        if large is None:
            return 0
        return min(self.grow_chunk, self._large_size - len(large))

    def grow(self, n: int) -> int:
        """Grow the large frame's buffer by at most `n` (and `growth`) bytes; how many."""
        large = self._large
        n = min(n, self.growth)
        if large is None or n <= 0:
            return 0
        if _RESIZE is not None:
            _RESIZE(large, len(large) + n)
        else:  # pragma: no cover - not CPython
            large += _zeros(n)
        return n

    def received_into(self, n: int) -> None:
        """`n` bytes were written at the start of the last `receive_buffer()`."""
        if self._large is None or not 0 <= n <= len(self._large) - self._large_fill:
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
            room = len(large) - fill  # grown by receive_buffer, not filled
            if room:
                view = memoryview(data)
                large[fill : fill + min(room, take)] = view[:room]
                if take > room:
                    large += view[room:]
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
            self._large = bytearray(memoryview(self._buf)[start : start + have])
            self._large_fill = have
            self._large_size = size
            self._pos = start + have
            return self.next_frame()
        if avail - 4 < size:
            return None
        self._pos = start + size
        return bytes(self._buf[start : self._pos])

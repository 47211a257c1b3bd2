"""The subset of the npm `compact-encoding` format that Hypercore's messages use.

Owns: unsigned varints (``uint``), fixed byte strings, length-prefixed buffers and
arrays, as bytes. ``uint`` is one byte for 0..0xfc, else a marker byte (0xfd, 0xfe,
0xff) followed by a little-endian u16, u32 or u64. Like the JS decoder we accept
non-minimal varints (Hypercore does), but unlike it we cap values at 2**53 - 1 only
where JS would (u64) and raise `DecodeError` instead of any `IndexError`/`struct.error`.

May not import anything outside the standard library and `storage.hypercore.errors`.
"""

from __future__ import annotations

from storage.hypercore.errors import DecodeError

# JS numbers are doubles; compact-encoding's uint64 decoder rejects anything above this.
MAX_SAFE_INTEGER = (1 << 53) - 1
# compact-encoding's array decoder refuses longer arrays ("Array is too big").
MAX_ARRAY_LENGTH = 0x100000


def encode_uint(n: int) -> bytes:
    if n < 0:
        raise ValueError("uint must be non-negative")
    if n <= 0xFC:
        return bytes((n,))
    if n <= 0xFFFF:
        return b"\xfd" + n.to_bytes(2, "little")
    if n <= 0xFFFFFFFF:
        return b"\xfe" + n.to_bytes(4, "little")
    if n > MAX_SAFE_INTEGER:
        raise ValueError("uint above 2**53 - 1 cannot round-trip through JavaScript")
    return b"\xff" + n.to_bytes(8, "little")


def encode_buffer(b: bytes) -> bytes:
    return encode_uint(len(b)) + bytes(b)


class Reader:
    """A cursor over bytes; every read either succeeds whole or raises DecodeError."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview, start: int = 0) -> None:
        # A memoryview is read in place (a replication frame carries a 64 KiB block:
        # copying it whole just to slice it again costs a page-faulting allocation);
        # `fixed` still hands out bytes.
        self.buf: bytes | memoryview = (
            buf.cast("B") if isinstance(buf, memoryview) else bytes(buf))
        self.pos = start
        self.end = len(self.buf)

    def remaining(self) -> int:
        return self.end - self.pos

    def uint8(self) -> int:
        if self.pos >= self.end:
            raise DecodeError("out of bounds reading a byte")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def _le(self, n: int) -> int:
        if self.end - self.pos < n:
            raise DecodeError(f"out of bounds reading {n} bytes")
        v = int.from_bytes(self.buf[self.pos : self.pos + n], "little")
        self.pos += n
        return v

    def uint(self) -> int:
        a = self.uint8()
        if a <= 0xFC:
            return a
        if a == 0xFD:
            return self._le(2)
        if a == 0xFE:
            return self._le(4)
        v = self._le(8)
        if v > MAX_SAFE_INTEGER:
            raise DecodeError("uint64 above 2**53 - 1")
        return v

    def fixed(self, n: int) -> bytes:
        if self.end - self.pos < n:
            raise DecodeError(f"out of bounds reading {n} fixed bytes")
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v if isinstance(v, bytes) else bytes(v)

    def view(self, n: int) -> memoryview:
        """The next `n` bytes without a copy."""
        if self.end - self.pos < n:
            raise DecodeError(f"out of bounds reading {n} fixed bytes")
        v = memoryview(self.buf)[self.pos : self.pos + n]
        self.pos += n
        return v

    def rest_view(self) -> memoryview:
        """Everything not read yet, without a copy; consumes it."""
        v = memoryview(self.buf)[self.pos : self.end]
        self.pos = self.end
        return v

    def buffer(self) -> bytes:
        return self.fixed(self.uint())

    def array_length(self) -> int:
        n = self.uint()
        if n > MAX_ARRAY_LENGTH:
            raise DecodeError("array is too big")
        return n

    def finish(self) -> None:
        """Require that everything was consumed (we are stricter than compact-encoding)."""
        if self.pos != self.end:
            raise DecodeError(f"{self.end - self.pos} trailing bytes")

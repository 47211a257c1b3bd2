"""Primitive readers and writers of the Kafka wire format, shared by the hand-written codecs.

Readers take (buffer, offset) and return (value, new_offset). They raise `_Short` or
`_Bad`, which the public decoders translate into `MalformedRequest`; nothing else may
escape (callers also catch `struct.error`, `IndexError` and `ValueError` to be safe).
Standard library only.
"""

from __future__ import annotations

import struct
from typing import Final

I8: Final = struct.Struct(">b")
I16: Final = struct.Struct(">h")
I32: Final = struct.Struct(">i")
I64: Final = struct.Struct(">q")
U32: Final = struct.Struct(">I")

Buf = bytes | bytearray | memoryview


class _Short(Exception):
    """The buffer ended inside a field."""


class _Bad(Exception):
    """A field holds an impossible value (negative length, over-long varint, bad UTF-8)."""


def read_uvarint(buf: Buf, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise _Short("varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 28:  # Kafka's unsigned varint is at most 5 bytes (32 bits)
            raise _Bad("unsigned varint longer than 5 bytes")


def read_varint(buf: Buf, pos: int, max_bytes: int = 5) -> tuple[int, int]:
    """Zig-zag signed varint (varlong with max_bytes=10)."""
    result = 0
    shift = 0
    end = len(buf)
    limit = 7 * max_bytes
    while True:
        if pos >= end:
            raise _Short("varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift >= limit:
            raise _Bad("varint too long")


def write_uvarint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_i16(buf: Buf, pos: int) -> tuple[int, int]:
    if pos + 2 > len(buf):
        raise _Short("int16")
    return I16.unpack_from(buf, pos)[0], pos + 2


def read_i32(buf: Buf, pos: int) -> tuple[int, int]:
    if pos + 4 > len(buf):
        raise _Short("int32")
    return I32.unpack_from(buf, pos)[0], pos + 4


def _decode_utf8(raw: Buf) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad("invalid UTF-8 in string") from exc


def read_nullable_string(buf: Buf, pos: int) -> tuple[str | None, int]:
    """int16 length, -1 = null (also used by header v2's client_id)."""
    n, pos = read_i16(buf, pos)
    if n == -1:
        return None, pos
    if n < 0:
        raise _Bad(f"negative string length {n}")
    if pos + n > len(buf):
        raise _Short("string")
    return _decode_utf8(buf[pos : pos + n]), pos + n


MAX_STRING_BYTES: Final = 0x7FFF
"""Kafka's generated readers refuse longer strings, compact ones too: an answer could
not echo them in a non-flexible (int16-length) version."""


def read_compact_nullable_string(buf: Buf, pos: int) -> tuple[str | None, int]:
    n, pos = read_uvarint(buf, pos)
    if n == 0:
        return None, pos
    n -= 1
    if n > MAX_STRING_BYTES:
        raise _Bad(f"string of {n} bytes")
    if pos + n > len(buf):
        raise _Short("compact string")
    return _decode_utf8(buf[pos : pos + n]), pos + n


def skip_tagged_fields(buf: Buf, pos: int) -> int:
    """Skip a tagged-field section; unknown tags are legal and ignored (KIP-482)."""
    count, pos = read_uvarint(buf, pos)
    for _ in range(count):
        _tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        pos += size
        if pos > len(buf):
            raise _Short("tagged field")
    return pos


# The encoded size of each fixed-size kio field kind, and the kinds that carry a length
# prefix: what a walk over a request body (bounds, tags) needs to know of every field.
FIXED_SIZE = {
    "int8": 1, "uint8": 1, "bool": 1,
    "int16": 2, "uint16": 2, "error_code": 2,
    "int32": 4, "uint32": 4, "timedelta_i32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "timedelta_i64": 8, "datetime_i64": 8,
    "uuid": 16,
}  # fmt: skip
LENGTHED_KINDS = frozenset({"string", "bytes", "records"})

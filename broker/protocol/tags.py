"""Drop tagged fields that our schema does not know from a flexible request body.

KIP-482 makes unknown tagged fields legal: a newer client may add a tag to a version we
already serve, and Kafka's generated parsers skip what they do not recognise. kio's
native reader raises on an unknown tag instead, so `codec.decode_request` falls back to
this module when that happens: `strip_unknown_tags` walks the body with the kio schema
(field order and `kafka_type` metadata), copies every byte it understands, leaves out
the unknown tags, and the result is parsed again by kio. The walk runs only on that rare
path, so it is written for clarity, not speed.

Owns the walk only; imports the standard library, kio's dataclass metadata and `_wire`.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

from ._wire import FIXED_SIZE, LENGTHED_KINDS, Buf, _Bad, _Short, read_uvarint, write_uvarint


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (UnionType, Union):
        args = [a for a in get_args(tp) if a is not NoneType]
        return args[0], True
    return tp, False


@cache
def _plan(cls: Any) -> tuple[tuple[tuple[str, Any, bool, bool], ...], frozenset[int]]:
    """(kind, type, is_array, optional) per untagged field in wire order; known tags."""
    fields: list[tuple[str, Any, bool, bool]] = []
    tags: set[int] = set()
    for f in dataclasses.fields(cls):
        if "tag" in f.metadata:
            tags.add(int(f.metadata["tag"]))
            continue
        tp, optional = _unwrap_optional(f.type)
        is_array = get_origin(tp) is tuple
        if is_array:
            tp, _ = _unwrap_optional(get_args(tp)[0])
        if dataclasses.is_dataclass(tp):
            fields.append(("entity", tp, is_array, optional))
        else:
            fields.append((str(f.metadata["kafka_type"]), None, is_array, optional))
    return tuple(fields), frozenset(tags)


class _Walker:
    def __init__(self, buf: Buf, pos: int) -> None:
        self.buf = buf
        self.pos = pos
        self.out = bytearray()
        self.dropped: list[int] = []

    def _copy_to(self, end: int) -> None:
        if end > len(self.buf):
            raise _Short("body")
        self.out += self.buf[self.pos : end]
        self.pos = end

    def _uvarint(self) -> int:
        value, end = read_uvarint(self.buf, self.pos)
        self._copy_to(end)
        return value

    def _value(self, kind: str) -> None:
        if kind in FIXED_SIZE:
            self._copy_to(self.pos + FIXED_SIZE[kind])
        elif kind in LENGTHED_KINDS:
            n = self._uvarint()  # compact: length + 1, 0 for null
            self._copy_to(self.pos + max(n - 1, 0))
        else:
            raise _Bad(f"field type {kind!r} has no flexible encoding")

    def entity(self, cls: Any) -> None:
        fields, known = _plan(cls)
        for kind, tp, is_array, optional in fields:
            count = 1
            if is_array:
                count = self._uvarint() - 1  # compact array: n + 1, 0 for null
            elif kind == "entity" and optional:
                count = 1 if self._int8() >= 0 else 0  # nullable struct marker
            for _ in range(count):
                if kind == "entity":
                    self.entity(tp)
                else:
                    self._value(kind)
        self._tag_section(known)

    def _int8(self) -> int:
        if self.pos >= len(self.buf):
            raise _Short("struct marker")
        value = int.from_bytes(self.buf[self.pos : self.pos + 1], "big", signed=True)
        self._copy_to(self.pos + 1)
        return value

    def _tag_section(self, known: frozenset[int]) -> None:
        count, pos = read_uvarint(self.buf, self.pos)
        kept = bytearray()
        kept_count = 0
        for _ in range(count):
            start = pos
            tag, pos = read_uvarint(self.buf, pos)
            size, pos = read_uvarint(self.buf, pos)
            pos += size
            if pos > len(self.buf):
                raise _Short("tagged field")
            if tag in known:
                kept += self.buf[start:pos]
                kept_count += 1
            else:
                self.dropped.append(tag)
        self.out += write_uvarint(kept_count)
        self.out += kept
        self.pos = pos


def strip_unknown_tags(buf: Buf, pos: int, schema: type[Any]) -> tuple[bytes, list[int]]:
    """The body at `buf[pos:]` re-encoded without tags unknown to `schema` (a flexible
    kio request class), and the tags left out. Raises `_Short`/`_Bad` on a body that does
    not follow the schema."""
    walker = _Walker(buf, pos)
    walker.entity(schema)
    return bytes(walker.out) + bytes(buf[walker.pos :]), walker.dropped

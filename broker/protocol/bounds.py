"""A bounds check of every request body, run before kio's native reader sees the frame.

kio's Rust reader trusts the counts it reads: a compact array count of 0xF0000000 makes
it reserve 32 GiB and the allocator aborts the process, beyond any Python handler. So
`check_request_body` walks the body first, with the same kio schema, and refuses, as
`MalformedRequest`, everything Kafka's own generated parsers refuse:

* an array whose count exceeds the bytes that remain divided by the smallest encoding
  of one element (Kafka's generated code checks count > remaining bytes);
* a string, bytes or records length past the end of the frame, or a string longer than
  0x7fff bytes (Kafka: "string field X had invalid length"), so every string a handler
  sees could be written back in a non-flexible answer;
* null (int16/int32 -1, compact 0, struct marker -1) where the schema does not allow
  it (Kafka: "non-nullable field X was serialized as null");
* more than `MAX_ELEMENTS` array elements in one request (each becomes a Python object:
  this bounds what decoding may allocate whatever the frame size);
* tagged fields (known or not) whose size runs past the end; a known tag's value must
  fill exactly the size it announces, so our walk and kio's reader cannot disagree.

The walk allocates nothing that grows with the counts it reads, and each element it
visits consumes at least one byte, so its work is bounded by the frame's length.

For speed, each kio request class (and each nested struct) is compiled once into a
small Python function of straight-line code (`_compile`); a Metadata request costs a
microsecond or two. Imports kio's dataclass metadata, `_wire` and the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

from ._wire import (
    FIXED_SIZE,
    I16,
    I32,
    LENGTHED_KINDS,
    MAX_STRING_BYTES,
    Buf,
    _Bad,
    _Short,
    read_uvarint,
)
from .errors import MalformedRequest

__all__ = ["MAX_ELEMENTS", "MAX_STRING_BYTES", "check_request_body", "min_size", "walker"]


Walk = Callable[[Buf, int, int], int]

MAX_ELEMENTS = 1 << 20
"""Array elements one request may hold, all arrays together. Each becomes a Python
object (up to ~20 times the bytes it took on the wire), so without a cap a 100 MiB frame
of tiny elements would cost gigabytes; a million is far past any real client's request
(a Produce or OffsetCommit to every partition of a very large cluster)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: str  # a kafka_type, or "entity"
    entity: Any  # the nested dataclass for kind == "entity"
    is_array: bool
    nullable: bool  # the array itself when is_array, else the value
    tag: int | None


def _unwrap(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (UnionType, Union):
        args = [a for a in get_args(tp) if a is not NoneType]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        return args[0], True
    return tp, False


def _fields(cls: Any) -> list[_Field]:
    out = []
    for f in dataclasses.fields(cls):
        tp, nullable = _unwrap(f.type)
        is_array = get_origin(tp) is tuple
        if is_array:
            tp, _ = _unwrap(get_args(tp)[0])
        tag = f.metadata.get("tag")
        if dataclasses.is_dataclass(tp):
            kind, entity = "entity", tp
        else:
            kind, entity = str(f.metadata["kafka_type"]), None
            if kind not in FIXED_SIZE and kind not in LENGTHED_KINDS:
                raise TypeError(f"{cls.__name__}.{f.name}: unknown kafka_type {kind!r}")
        out.append(
            _Field(f.name, kind, entity, is_array, nullable, None if tag is None else int(tag))
        )
    return out


@functools.cache
def min_size(cls: Any) -> int:
    """Fewest bytes one encoded `cls` (a kio struct) can take."""
    flexible = bool(cls.__flexible__)
    total = 1 if flexible else 0  # the tagged-field count
    for f in _fields(cls):
        if f.tag is not None:
            continue
        total += _min_value_size(f, flexible)
    return total


def _min_value_size(f: _Field, flexible: bool) -> int:
    if f.is_array:
        return 1 if flexible else 4
    return _min_element_size(f, flexible, nullable=f.nullable)


def _min_element_size(f: _Field, flexible: bool, *, nullable: bool = False) -> int:
    if f.kind == "entity":
        return 1 if nullable else min_size(f.entity)
    if f.kind in FIXED_SIZE:
        return FIXED_SIZE[f.kind]
    if flexible:
        return 1
    return 2 if f.kind == "string" else 4


# ------------------------------------------------------------------------ code generation


class _Gen:
    """Writes one function per struct class; `names` maps a class to its function."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[Any, str] = {}
        self.consts: dict[str, Any] = {}
        self.pending: list[Any] = []

    def fn(self, cls: Any) -> str:
        name = self.names.get(cls)
        if name is None:
            name = f"_w{len(self.names)}_{cls.__name__}"
            self.names[cls] = name
            self.pending.append(cls)
        return name

    def const(self, value: Any) -> str:
        name = f"_c{len(self.consts)}"
        self.consts[name] = value
        return name

    def build(self, root: Any) -> Walk:
        self.fn(root)
        while self.pending:
            self._struct(self.pending.pop())
        namespace: dict[str, Any] = {
            "_h": I16.unpack_from,
            "_i": I32.unpack_from,
            "_uv": _uv,
            "_Bad": _Bad,
            "_Short": _Short,
            "_tags": _tag_section,
            "_MAXS": MAX_STRING_BYTES,
            "_MAXE": MAX_ELEMENTS,
            **self.consts,
        }
        exec(compile("\n".join(self.lines), f"<bounds {root.__name__}>", "exec"), namespace)
        return namespace[self.names[root]]  # type: ignore[no-any-return]

    def _struct(self, cls: Any) -> None:
        body = self._struct_body(cls)  # may emit the functions of tagged fields first
        self.lines.append(f"def {self.names[cls]}(b, p, e):")
        self.lines.append("    t = 0")  # array elements so far
        self.lines += ["    " + line for line in body]
        self.lines.append("    return p")

    def _struct_body(self, cls: Any) -> list[str]:
        """The walk of one struct as lines of code, nested structs inlined (Kafka's
        schemas do not recurse): a call per element cost more than the checks."""
        flexible = bool(cls.__flexible__)
        body: list[str] = []
        tagged: dict[int, str] = {}
        fixed = 0
        for f in _fields(cls):
            if f.tag is not None:
                tagged[f.tag] = self._tag_fn(cls, f, flexible)
                continue
            if not f.is_array and f.kind in FIXED_SIZE:
                fixed += FIXED_SIZE[f.kind]  # a run of fixed fields is one jump
                continue
            if fixed:
                body.append(f"p += {fixed}")
                fixed = 0
            body += self._field(cls, f, flexible)
        if fixed:
            body.append(f"p += {fixed}")
        if flexible:
            known = self.const(tagged)
            body += [
                "n = b[p]",
                "p += 1",
                "if n:",
                f"    p = _tags(b, p - 1, e, {known})",
            ]
        return body or ["pass"]

    def _tag_fn(self, cls: Any, f: _Field, flexible: bool) -> str:
        body = (
            [f"p += {FIXED_SIZE[f.kind]}"]
            if not f.is_array and f.kind in FIXED_SIZE
            else self._field(cls, f, flexible)
        )
        name = f"_t{len(self.lines)}_{cls.__name__}_{f.name}"
        self.lines.append(f"def {name}(b, p, e):")
        self.lines.append("    t = 0")
        self.lines += ["    " + line for line in body]
        self.lines.append("    return p")
        # The tag table needs the function itself, which exists once the module runs.
        return name

    def _length(self, flexible: bool, wide: bool) -> list[str]:
        """Leave the length (or count) in n; -1 for null."""
        if flexible:
            return [
                "n = b[p]",
                "p += 1",
                "if n & 0x80:",
                "    n, p = _uv(b, p - 1)",
                "n -= 1",
            ]
        return ["n = _i(b, p)[0]", "p += 4"] if wide else ["n = _h(b, p)[0]", "p += 2"]

    def _null_check(self, what: str, nullable: bool, flexible: bool) -> list[str]:
        if nullable:
            if flexible:
                return []  # a compact length is at least -1 (null)
            return ["if n < -1:", f"    raise _Bad('negative length of {what}')"]
        return ["if n < 0:", f"    raise _Bad('null or negative length of non-nullable {what}')"]

    def _field(self, cls: Any, f: _Field, flexible: bool) -> list[str]:
        what = f"{cls.__name__}.{f.name}"
        if f.is_array:
            lines = self._length(flexible, wide=True) + self._null_check(what, f.nullable, flexible)
            per = max(_min_element_size(f, flexible), 1)
            lines += [
                f"if n * {per} > e - p:",
                f"    raise _Short('array {what} of ' + str(n) + ' elements in ' + str(e - p) + ' bytes')",
                "t += n",
                "if t > _MAXE:",
                f"    raise _Bad('more than ' + str(_MAXE) + ' array elements (at {what})')",
            ]
            if f.kind in FIXED_SIZE:
                lines.append(f"p += n * {FIXED_SIZE[f.kind]}")
            else:
                lines.append("for _ in range(n):")
                lines += ["    " + line for line in self._element(cls, f, flexible, what)]
            return lines
        return self._element(cls, f, flexible, what, nullable=f.nullable)

    def _element(
        self, cls: Any, f: _Field, flexible: bool, what: str, *, nullable: bool = False
    ) -> list[str]:
        if f.kind == "entity":
            inline = self._struct_body(f.entity)
            if not nullable:
                return inline
            # A nullable struct: an int8 marker, negative for null (Kafka's readByte() < 0).
            return ["n = b[p]", "p += 1", "if n < 0x80:"] + ["    " + line for line in inline]
        if f.kind in FIXED_SIZE:
            return [f"p += {FIXED_SIZE[f.kind]}"]
        lines = self._length(flexible, wide=f.kind != "string") + self._null_check(
            what, nullable, flexible
        )
        if f.kind == "string":
            lines += ["if n > _MAXS:", f"    raise _Bad('string {what} of ' + str(n) + ' bytes')"]
        lines += ["if n > 0:", "    p += n"]
        return lines


def _uv(b: Buf, p: int) -> tuple[int, int]:
    """An unsigned varint of two to five bytes at `p` (the caller read the first byte),
    unrolled: records lengths take three bytes, and a loop cost more than the walk.
    IndexError past the end, which the caller treats as a short frame."""
    n = b[p] & 0x7F
    c = b[p + 1]
    n |= (c & 0x7F) << 7
    if not c & 0x80:
        return n, p + 2
    c = b[p + 2]
    n |= (c & 0x7F) << 14
    if not c & 0x80:
        return n, p + 3
    c = b[p + 3]
    n |= (c & 0x7F) << 21
    if not c & 0x80:
        return n, p + 4
    c = b[p + 4]
    if c & 0x80:
        raise _Bad("unsigned varint longer than 5 bytes")
    return n | (c << 28), p + 5


def _tag_section(b: Buf, p: int, e: int, known: dict[int, Walk]) -> int:
    count, p = read_uvarint(b, p)
    if count * 2 > e - p:  # a tag and a size, one byte each at least
        raise _Short(f"{count} tagged fields in {e - p} bytes")
    for _ in range(count):
        tag, p = read_uvarint(b, p)
        size, p = read_uvarint(b, p)
        end = p + size
        if end > e:
            raise _Short(f"tagged field {tag} of {size} bytes")
        walk = known.get(tag)
        if walk is not None and walk(b, p, end) != end:
            raise _Bad(f"tagged field {tag} does not fill its {size} bytes")
        p = end
    return p


@functools.cache
def walker(schema: Any) -> Walk:
    """The compiled bounds walk of a kio request class: `walk(buf, pos, end) -> end pos`."""
    gen = _Gen()
    walk = gen.build(schema)
    # Tag tables were filled with function names; swap in the functions.
    namespace = walk.__globals__
    for value in gen.consts.values():
        if isinstance(value, dict):
            for tag, name in list(value.items()):
                value[tag] = namespace[name]
    return walk


def check_request_body(frame: Buf, pos: int, schema: Any) -> None:
    """Raise `MalformedRequest` unless the body at `frame[pos:]` keeps every bound of
    `schema` (see the module docstring): a request, or a response a mirror reads from a
    peer. Bytes after the body are allowed (Kafka ignores them)."""
    end = len(frame)
    try:
        stop = walker(schema)(frame, pos, end)
    except _Short as exc:
        raise MalformedRequest(
            f"{schema.__name__} v{schema.__version__} cut short: {exc}"
        ) from None
    except _Bad as exc:
        raise MalformedRequest(f"bad {schema.__name__} v{schema.__version__}: {exc}") from None
    except (IndexError, struct.error):
        raise MalformedRequest(f"{schema.__name__} v{schema.__version__} cut short") from None
    if stop > end:
        raise MalformedRequest(
            f"{schema.__name__} v{schema.__version__} cut short: {stop - end} bytes missing"
        )

"""kio's request schemas, walked: build entities from values, random valid entities, and an
encoder that also says where every length, count, integer and tagged-field section lies.

kio describes each message version as a dataclass whose fields carry a `kafka_type`
(int32, string, records, ...), an optional `tag`, and nullability in the type; nested
structures are dataclasses too. `make` builds an entity from plain values, `Gen` draws a
random valid one (names from small pools so a fuzzer never names the good producer's topic),
and `encode_with_spans` encodes it exactly as kio's writer does while recording `Span`s, the
places a mutator can make lie. The self-test in test_attack_fuzz.py checks that its bytes
equal kio's for every API version the broker advertises.

Imports kio (including its introspection helpers, pinned by pyproject.toml) and the
standard library.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import struct
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kio.schema.errors import ErrorCode
from kio.serial._implicit_defaults import get_tagged_field_default
from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveTupleField,
    classify_field,
    get_field_tag,
    is_optional,
)

EPOCH = datetime.datetime.fromtimestamp(0, tz=datetime.UTC)


@dataclass(frozen=True)
class FieldInfo:
    """One field of a kio entity, classified once."""

    name: str
    kafka_type: str | None  # None for a (nested) entity or an array of entities
    entity: type[Any] | None
    array: bool
    optional: bool
    tag: int | None
    field: dataclasses.Field[Any]


_FIELDS: dict[type[Any], tuple[FieldInfo, ...]] = {}


def fields_of(entity_type: type[Any]) -> tuple[FieldInfo, ...]:
    """The classified fields of a kio entity class (remembered: classifying is slow)."""
    cached = _FIELDS.get(entity_type)
    if cached is not None:
        return cached
    out = []
    for f in dataclasses.fields(entity_type):
        cls = classify_field(f)
        entity = cls.type_ if isinstance(cls, EntityField | EntityTupleField) else None
        tag = get_field_tag(f)
        out.append(
            FieldInfo(
                name=f.name,
                kafka_type=None if entity is not None else f.metadata.get("kafka_type"),
                entity=entity,
                array=isinstance(cls, EntityTupleField | PrimitiveTupleField),
                optional=is_optional(f),
                tag=None if tag is None else int(tag),
                field=f,
            )
        )
    _FIELDS[entity_type] = tuple(out)
    return _FIELDS[entity_type]


def zero_scalar(kafka_type: str) -> Any:
    """The value kio writes as all-zero bytes (or the empty string) for a kafka_type."""
    return {
        "string": "",
        "bytes": b"",
        "records": b"",
        "bool": False,
        "float64": 0.0,
        "uuid": uuid.UUID(int=0),
        "error_code": ErrorCode.none,
        "timedelta_i32": datetime.timedelta(0),
        "timedelta_i64": datetime.timedelta(0),
        "datetime_i64": EPOCH,
    }.get(kafka_type, 0)


def make(entity_type: type[Any], values: Mapping[str, Any] | None = None) -> Any:
    """An entity from plain values; nested entities may be given as dicts (lists of dicts
    for arrays); fields left out get zero values (tagged fields their kio default)."""
    values = values or {}
    kwargs: dict[str, Any] = {}
    for fi in fields_of(entity_type):
        if fi.name in values:
            v = values[fi.name]
            if fi.entity is not None and v is not None:
                if fi.array:
                    v = tuple(make(fi.entity, x) if isinstance(x, Mapping) else x for x in v)
                elif isinstance(v, Mapping):
                    v = make(fi.entity, v)
            elif fi.array and v is not None:
                v = tuple(v)
            kwargs[fi.name] = v
        elif fi.tag is not None:
            kwargs[fi.name] = get_tagged_field_default(fi.field)
        elif fi.array:
            kwargs[fi.name] = ()
        elif fi.entity is not None:
            kwargs[fi.name] = None if fi.optional else make(fi.entity)
        else:
            assert fi.kafka_type is not None
            kwargs[fi.name] = zero_scalar(fi.kafka_type)
    return entity_type(**kwargs)


# ---------------------------------------------------------------- random valid entities

TOPIC_POOL = tuple(f"fz-t{i}" for i in range(6))
GROUP_POOL = tuple(f"fz-g{i}" for i in range(4))
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789-_."


class Gen:
    """Draws random valid entities. Numbers stay small and waits short so that a valid
    request is cheap to serve; mutation classes push them to the edges."""

    def __init__(self, rng: random.Random, records: Callable[[random.Random], bytes]) -> None:
        self.rng = rng
        self.records = records

    def entity(self, entity_type: type[Any], depth: int = 0) -> Any:
        kwargs: dict[str, Any] = {}
        owner = entity_type.__name__.lower()
        for fi in fields_of(entity_type):
            if fi.tag is not None and self.rng.random() < 0.6:
                kwargs[fi.name] = get_tagged_field_default(fi.field)
                continue
            kwargs[fi.name] = self.field(fi, owner, depth)
        return entity_type(**kwargs)

    def field(self, fi: FieldInfo, owner: str, depth: int) -> Any:
        rng = self.rng
        if fi.optional and fi.tag is None and rng.random() < 0.15:
            return None
        if fi.array:
            n = rng.choice((0, 1, 1, 2, 3)) if depth < 3 else rng.choice((0, 1))
            if fi.entity is not None:
                return tuple(self.entity(fi.entity, depth + 1) for _ in range(n))
            assert fi.kafka_type is not None
            return tuple(self.scalar(fi.kafka_type, fi.name, owner) for _ in range(n))
        if fi.entity is not None:
            return self.entity(fi.entity, depth + 1)
        assert fi.kafka_type is not None
        return self.scalar(fi.kafka_type, fi.name, owner)

    def scalar(self, kafka_type: str, name: str, owner: str) -> Any:
        rng = self.rng
        if kafka_type == "string":
            return self.string(name, owner)
        if kafka_type == "bytes":
            return rng.randbytes(rng.randint(0, 24))
        if kafka_type == "records":
            return self.records(rng)
        if kafka_type == "bool":
            return rng.random() < 0.5
        if kafka_type == "float64":
            return rng.choice((0.0, 1.5, -1.0))
        if kafka_type == "uuid":
            return uuid.UUID(int=rng.choice((0, rng.getrandbits(128))))
        if kafka_type == "error_code":
            return rng.choice((ErrorCode.none, ErrorCode.unknown_server_error))
        if kafka_type in ("timedelta_i32", "timedelta_i64"):
            return datetime.timedelta(milliseconds=self.number(name, 32))
        if kafka_type == "datetime_i64":
            return EPOCH + datetime.timedelta(milliseconds=rng.randint(0, 2**40))
        bits = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8, "uint16": 16,
                "uint32": 32, "uint64": 64}[kafka_type]  # fmt: skip
        value = self.number(name, bits)
        if kafka_type.startswith("uint"):
            value = abs(value)
        return value

    def number(self, name: str, bits: int) -> int:
        hi = 2 ** (bits - 1) - 1
        return int(max(-hi - 1, min(hi, self._number(name))))

    def _number(self, name: str) -> int:
        rng = self.rng
        if "acks" in name:
            return rng.choice((-1, 0, 1))
        if "timeout" in name or "wait" in name or "delay" in name:
            return rng.randint(0, 200)
        if ("partition" in name and "bytes" not in name) or name in ("index", "partitions"):
            return rng.choice((0, 0, 1, 2, -1))
        if "replication_factor" in name:
            return rng.choice((-1, 1))
        if "bytes" in name:
            return rng.choice((0, 1, 1 << 16, 1 << 20))
        return rng.choice((0, 0, 1, 2, 3, -1, rng.randint(0, 1000)))

    def string(self, name: str, owner: str) -> str:
        rng = self.rng
        if "topic" in name or (name == "name" and "topic" in owner):
            return rng.choice(TOPIC_POOL)
        if "group" in name:
            return rng.choice(GROUP_POOL)
        if "transactional" in name:
            return rng.choice(("", "fz-tx"))
        return "".join(rng.choice(_ALNUM) for _ in range(rng.randint(0, 12)))


# ---------------------------------------------------------------- encoding with spans


@dataclass(frozen=True)
class Span:
    """Where a mutator can make the bytes lie.

    kind: "array", "string", "bytes" (a length/count prefix at [start, prefix_end) whose
    content runs to content_end), "tags" (a tagged-field section: its count at [start,
    prefix_end), the section to content_end), "int" (a fixed-width integer, fmt its struct
    format), "marker" (a nullable struct's int8 marker).
    """

    kind: str
    start: int
    prefix_end: int
    content_end: int
    compact: bool
    nullable: bool
    path: str
    fmt: str = ""


def uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_FIXED = {"int8": ">b", "int16": ">h", "int32": ">i", "int64": ">q", "uint8": ">B",
          "uint16": ">H", "uint32": ">I", "uint64": ">Q", "float64": ">d", "bool": ">?",
          "error_code": ">h", "timedelta_i32": ">i", "timedelta_i64": ">q",
          "datetime_i64": ">q"}  # fmt: skip


class _Encoder:
    def __init__(self) -> None:
        self.out = bytearray()
        self.spans: list[Span] = []

    def entity(self, entity_type: type[Any], value: Any, path: str) -> None:
        flexible = bool(entity_type.__flexible__)
        tagged = []
        for fi in fields_of(entity_type):
            v = getattr(value, fi.name)
            if fi.tag is not None:
                tagged.append((fi, v))
                continue
            self.field(fi, v, flexible, f"{path}.{fi.name}", fi.optional)
        if not flexible:
            return
        start = len(self.out)
        body = _Encoder()
        count = 0
        for fi, v in sorted(tagged, key=lambda t: t[0].tag or 0):
            default = fi.field.default
            if v == default or (
                default is dataclasses.MISSING and v == get_tagged_field_default(fi.field)
            ):
                continue
            inner = _Encoder()
            inner.field(fi, v, flexible, f"{path}.{fi.name}", optional=False)
            head = uvarint(fi.tag or 0) + uvarint(len(inner.out))
            body.absorb(head, inner)
            count += 1
        prefix = uvarint(count)
        self.out += prefix
        self.spans.append(
            Span("tags", start, start + len(prefix), start + len(prefix) + len(body.out), True,
                 False, f"{path}.<tags>")
        )  # fmt: skip
        self.absorb(b"", body)

    def absorb(self, head: bytes, other: _Encoder) -> None:
        base = len(self.out) + len(head)
        self.out += head + other.out
        self.spans += [
            dataclasses.replace(
                s, start=s.start + base, prefix_end=s.prefix_end + base,
                content_end=s.content_end + base,
            )
            for s in other.spans
        ]  # fmt: skip

    def field(self, fi: FieldInfo, v: Any, flexible: bool, path: str, optional: bool) -> None:
        if fi.array:
            self.length("array", v, None if v is None else len(v), flexible, True, optional, path)
            if v is None:
                return
            start_items = len(self.out)
            for i, item in enumerate(v):
                self.single(fi, item, flexible, f"{path}[{i}]", optional=False)
            self._close(start_items)
            return
        self.single(fi, v, flexible, path, optional)

    def _close(self, content_start: int) -> None:
        # The latest length span whose content starts here ends where we are now.
        for i in range(len(self.spans) - 1, -1, -1):
            s = self.spans[i]
            if s.prefix_end == content_start and s.content_end == -1:
                self.spans[i] = dataclasses.replace(s, content_end=len(self.out))
                return

    def length(
        self, kind: str, v: Any, n: int | None, flexible: bool, array: bool, optional: bool,
        path: str,
    ) -> None:  # fmt: skip
        start = len(self.out)
        if flexible:
            self.out += uvarint(0 if n is None else n + 1)
        elif kind == "string" and not array:
            self.out += struct.pack(">h", -1 if n is None else n)
        else:
            self.out += struct.pack(">i", -1 if n is None else n)
        end = len(self.out)
        self.spans.append(
            Span(kind, start, end, end if v is None else -1, flexible, optional, path)
        )

    def single(self, fi: FieldInfo, v: Any, flexible: bool, path: str, optional: bool) -> None:
        if fi.entity is not None:
            if optional:
                start = len(self.out)
                self.out += struct.pack(">b", -1 if v is None else 1)
                self.spans.append(Span("marker", start, start + 1, start + 1, False, True, path))
                if v is None:
                    return
            self.entity(fi.entity, v, path)
            return
        kt = fi.kafka_type
        assert kt is not None
        if kt in ("string", "bytes", "records"):
            raw = None if v is None else (v.encode() if isinstance(v, str) else bytes(v))
            kind = "string" if kt == "string" else "bytes"
            self.length(kind, raw, None if raw is None else len(raw), flexible, False,
                        optional, path)  # fmt: skip
            if raw is not None:
                self.out += raw
                self._close(len(self.out) - len(raw))
            return
        if kt == "uuid":
            self.out += (v or uuid.UUID(int=0)).bytes
            return
        fmt = _FIXED[kt]
        if kt == "error_code":
            num: Any = v.value
        elif kt.startswith("timedelta"):
            num = round(v.total_seconds() * 1000)
        elif kt == "datetime_i64":
            num = -1 if v is None else round(v.timestamp() * 1000)
        else:
            num = v
        start = len(self.out)
        self.out += struct.pack(fmt, num)
        if kt not in ("bool", "float64"):
            self.spans.append(Span("int", start, len(self.out), len(self.out), False, False,
                                   path, fmt))  # fmt: skip


def encode_with_spans(entity: Any) -> tuple[bytes, list[Span]]:
    """The body bytes kio would write for `entity`, and the spans inside them."""
    enc = _Encoder()
    enc.entity(type(entity), entity, type(entity).__name__)
    return bytes(enc.out), enc.spans


def kio_body(entity: Any) -> bytes:
    """kio's own encoding of a request body (no header)."""
    import io

    from kio.serial import entity_writer

    buf = io.BytesIO()
    entity_writer(type(entity))(buf, entity)
    return buf.getvalue()


def request_header(
    api_key: int,
    version: int,
    correlation_id: int,
    client_id: bytes | None,
    header_version: int,
) -> bytes:
    """Request header v0 (no client id), v1 (int16 client id) or v2 (v1 + no tags)."""
    out = struct.pack(">hhi", api_key, version, correlation_id)
    if header_version >= 1:
        out += (
            struct.pack(">h", -1)
            if client_id is None
            else struct.pack(">h", len(client_id)) + client_id
        )
    if header_version >= 2:
        out += b"\x00"
    return out


def frame(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


def mutable_spans(spans: Sequence[Span], kinds: Sequence[str]) -> list[Span]:
    return [s for s in spans if s.kind in kinds]

"""Build a kio message of any version from one version-agnostic description.

Each Kafka message version is its own generated kio class, with fields that come and go.
Handlers describe their answer once, as plain dicts, lists, ints and strings, with the
field names Kafka's JSON schemas use (in kio's snake_case); `shape(cls, data)` turns it
into an instance of the class for the negotiated version, keeping the fields that
version has and dropping the rest, as Kafka's generated code does for ignorable fields.

Conversions the schema types need are done here once: milliseconds to `timedelta` for
`*Timedelta` fields, epoch milliseconds to an aware `datetime` for timestamp fields, and
nested lists to tuples of nested entities. Plans are cached per class, so the cost per
message is one dict lookup per field.
"""

from __future__ import annotations

import dataclasses
import datetime
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, TypeVar

from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta, i64Timedelta

T = TypeVar("T")

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
Convert = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _ms_to_timedelta(value: Any) -> Any:
    if isinstance(value, datetime.timedelta):
        return value
    return datetime.timedelta(milliseconds=int(value))


def _ms_to_datetime(value: Any) -> Any:
    if value is None or isinstance(value, datetime.datetime):
        return value
    if value < 0:
        return None
    return _EPOCH + datetime.timedelta(milliseconds=int(value))


def _converter(tp: Any) -> Convert:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            conv = _converter(inner[0])
            if conv is _identity:
                return _identity
            return lambda v: None if v is None else conv(v)
        return _identity
    if origin is tuple and args:
        item = args[0]
        if dataclasses.is_dataclass(item):
            item_cls: Any = item
            return lambda v: None if v is None else tuple(
                x if isinstance(x, item_cls) else shape(item_cls, x) for x in v
            )
        conv = _converter(item)
        return lambda v: None if v is None else tuple(conv(x) for x in v)
    if dataclasses.is_dataclass(tp):
        cls: Any = tp
        return lambda v: v if isinstance(v, cls) else shape(cls, v)
    if isinstance(tp, type):
        if issubclass(tp, ErrorCode):
            return ErrorCode
        if issubclass(tp, (i32Timedelta, i64Timedelta)) or tp is datetime.timedelta:
            return _ms_to_timedelta
        if issubclass(tp, datetime.datetime):
            return _ms_to_datetime
    return _identity


_MAX_MESSAGE_BYTES = 0x7FFF


def _clip_message(value: Any) -> Any:
    """An error message quotes names from the request (each up to 0x7fff bytes): cut it to
    what an int16-length string holds, so the answer stays encodable."""
    if isinstance(value, str) and len(value) * 4 > _MAX_MESSAGE_BYTES:
        raw = value.encode()
        if len(raw) > _MAX_MESSAGE_BYTES:
            return raw[:_MAX_MESSAGE_BYTES].decode(errors="ignore")
    return value


_MISSING: Any = object()


@cache
def _plan(cls: type) -> tuple[tuple[str, Convert, Any], ...]:
    """Per field: its name, the conversion, and the value used when the description
    leaves it out (`_MISSING` where the class has a default of its own)."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fallback = _zero(cls, hints[f.name], f.name) if required else _MISSING
        convert = _clip_message if f.name == "error_message" else _converter(hints[f.name])
        plan.append((f.name, convert, fallback))
    return tuple(plan)


def _zero(cls: type, tp: Any, name: str) -> Any:
    """A neutral value for a field the description left out but this version requires."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        return ()
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return None
    if isinstance(tp, type):
        if issubclass(tp, ErrorCode):
            return ErrorCode.none
        if issubclass(tp, bool):
            return False
        if issubclass(tp, int):
            return 0
        if issubclass(tp, str):
            return ""
        if issubclass(tp, bytes):
            return b""
        if issubclass(tp, datetime.timedelta):
            return datetime.timedelta(0)
        if issubclass(tp, datetime.datetime):
            return _EPOCH - datetime.timedelta(milliseconds=1)  # written as -1: no time
    if dataclasses.is_dataclass(tp):
        return shape(typing.cast(type, tp), {})
    raise TypeError(f"{cls.__qualname__}.{name} is required and has no neutral value")


def shape(cls: type[T], data: Mapping[str, Any]) -> T:
    """An instance of kio class `cls` holding what `data` says that version can carry."""
    kwargs = {}
    for name, convert, fallback in _plan(typing.cast(type, cls)):
        if name in data:
            kwargs[name] = convert(data[name])
        elif fallback is not _MISSING:
            kwargs[name] = fallback
    return cls(**kwargs)


def field_of(entity: object, name: str, default: Any = None) -> Any:
    """Read a request field that older versions of the message do not have."""
    return getattr(entity, name, default)

"""Request decoding and response encoding for every API, through kio's generated schemas.

Owns `decode_request`, `encode_response`, `encode_response_parts`,
`encode_api_versions_fallback`, the schema lookups `request_schema`/`response_schema`, and,
for tests and tools, the mirror image `encode_request`/`decode_response`. Produce requests
(v3-v11) and Fetch responses (v4-v12) take the hand-written fast path in `.fastpath`,
whose results equal kio's (tested by round trips).

Theory of operation, for a server:

    header, request = decode_request(payload, supported=RANGES)   # ProtocolError -> close
    response = handle(header, request)                            # a kio response entity
    parts = encode_response_parts(header, response)               # framed, ready for writev

Before kio's native reader sees a body, `bounds.check_request_body` walks it with the
same schema: counts, lengths, nulls and tagged fields are checked against the bytes that
remain, so no lie reaches kio's allocator (one once aborted the process).

`supported` maps api_key -> (min, max) and should be exactly what ApiVersions advertises.
A (key, version) outside it raises `UnsupportedVersion` (or `UnknownApiKey`) *before the
body is parsed*; for api key 18 the server then sends
`encode_api_versions_fallback(exc.header.correlation_id, RANGES)` and keeps the
connection, for anything else it closes (as Kafka does).

Imports kio and the standard library only; no I/O.
"""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Iterable, Mapping
from typing import Any, cast

from kio.index import KioIndexError, load_request_schema, load_response_schema
from kio.schema.index import api_key_map
from kio.serial import entity_reader, entity_writer

from . import fastpath
from ._wire import I32, Buf, _Bad, _Short, skip_tagged_fields
from .bounds import check_request_body
from .errors import MalformedRequest, UnknownApiKey, UnsupportedVersion
from .header import (
    RequestHeader,
    is_flexible_request,
    parse_request_header,
    request_header_version,
    response_header_version,
)
from .tags import strip_unknown_tags

__all__ = [
    "ApiRanges",
    "decode_request",
    "decode_response",
    "encode_api_versions_fallback",
    "encode_request",
    "encode_response",
    "encode_response_parts",
    "request_schema",
    "response_schema",
]

ApiRanges = Mapping[int, tuple[int, int]]
"""api_key -> (min_version, max_version), inclusive."""

UNSUPPORTED_VERSION_ERROR = 35


# kio resolves a schema by importing its module path on every call (pkgutil.resolve_name,
# ~0.1 ms); the server asks for one per request and per response, so remember them.
@functools.cache
def request_schema(api_key: int, api_version: int) -> type[Any]:
    """kio's request dataclass for (api_key, api_version); KeyError if kio has none."""
    try:
        return load_request_schema(api_key, api_version)
    except KioIndexError as exc:
        raise KeyError((api_key, api_version)) from exc


@functools.cache
def response_schema(api_key: int, api_version: int) -> type[Any]:
    """kio's response dataclass for (api_key, api_version); KeyError if kio has none."""
    try:
        return load_response_schema(api_key, api_version)
    except KioIndexError as exc:
        raise KeyError((api_key, api_version)) from exc


def _check_supported(header: RequestHeader, supported: ApiRanges | None) -> None:
    if supported is not None:
        rng = supported.get(header.api_key)
        if rng is None:
            raise UnknownApiKey(header)
        if not rng[0] <= header.api_version <= rng[1]:
            raise UnsupportedVersion(header)
    if is_flexible_request(header.api_key, header.api_version) is None:
        # kio has no schema for it, so we cannot parse it whatever `supported` says.
        if header.api_key not in api_key_map:
            raise UnknownApiKey(header)
        raise UnsupportedVersion(header)


def decode_request(
    frame: Buf, *, supported: ApiRanges | None = None, fast: bool = True
) -> tuple[RequestHeader, Any]:
    """Decode one request payload (a frame without its size prefix).

    Returns the header and kio's request dataclass for that version. For a Produce v3-v11
    frame of at least `fastpath.PRODUCE_FAST_MIN_BYTES` (with `fast`) each partition's
    `records` is a zero-copy `memoryview` into `frame` (writable if `frame` is), or None;
    for smaller frames kio's Rust reader is faster and `records` is `bytes`. Treat
    `records` as a bytes-like object either way.
    Raises only `ProtocolError` subclasses: `UnsupportedVersion`/`UnknownApiKey` (header
    attached, body not parsed), `MalformedRequest` (header or body does not parse, or
    bytes are left over after the body).
    """
    # Parse the fixed v1 prefix first: an unsupported version's header (notably
    # ApiVersions from a newer client) must be reported without touching the body.
    header, pos = parse_request_header(frame, header_version=1)
    _check_supported(header, supported)
    if is_flexible_request(header.api_key, header.api_version):
        try:
            pos = skip_tagged_fields(frame, pos)  # header v2: v1 + tagged fields
        except (_Short, _Bad) as exc:
            raise MalformedRequest(f"bad request header tagged fields: {exc}") from None
    if (
        fast
        and len(frame) >= fastpath.PRODUCE_FAST_MIN_BYTES
        and header.api_key == fastpath.PRODUCE_KEY
        and header.api_version in fastpath.PRODUCE_VERSIONS
    ):
        return header, fastpath.decode_produce_request(frame, pos, header.api_version)
    schema = request_schema(header.api_key, header.api_version)
    # kio's native reader trusts counts and lengths (a lying array count aborts the
    # process in its allocator) and lets nulls through where the schema forbids them.
    check_request_body(frame, pos, schema)
    if isinstance(frame, memoryview) and not frame.readonly:
        # kio's native reader refuses writable buffers (large frames from FrameDecoder
        # are writable); a read-only view of the same memory costs no copy.
        frame = frame.toreadonly()
    try:
        # kio's reader returns (value, bytes consumed), not a new offset.
        entity, _size = entity_reader(schema)(frame, pos)
    except KeyError as exc:
        if "tagged field" not in str(exc):
            raise MalformedRequest(
                f"cannot decode api {header.api_key} v{header.api_version}: {exc}"
            ) from None
        entity = _decode_without_unknown_tags(header, frame, pos, schema)
    except Exception as exc:  # kio's native reader raises its own errors, ValueError, ...
        raise MalformedRequest(
            f"cannot decode api {header.api_key} v{header.api_version}: {exc}"
        ) from None
    # Bytes after the body are ignored, as Kafka's generated parsers do (they read what
    # the schema describes and never check that the buffer is exhausted): librdkafka
    # 2.16 sends three extra bytes after Metadata v12, and Kafka serves it.
    return header, entity


def _decode_without_unknown_tags(header: RequestHeader, frame: Buf, pos: int, schema: Any) -> Any:
    """kio refuses tags it does not know; KIP-482 says skip them. Parse again without."""
    try:
        body, _dropped = strip_unknown_tags(frame, pos, schema)
        entity, _size = entity_reader(schema)(body, 0)
    except Exception as exc:
        raise MalformedRequest(
            f"cannot decode api {header.api_key} v{header.api_version}: {exc}"
        ) from None
    return entity


def _write_header_and_body(
    out: io.BytesIO, correlation_id: int, header_version: int, entity: Any
) -> None:
    out.write(I32.pack(correlation_id))
    if header_version >= 1:
        out.write(b"\x00")  # no tagged header fields
    entity_writer(type(entity))(out, entity)


def _check_pair(header: RequestHeader, entity: Any) -> None:
    key = getattr(entity, "__api_key__", None)
    version = getattr(entity, "__version__", None)
    if key != header.api_key or version != header.api_version:
        # A handler bug, not the peer's fault: a plain ValueError.
        raise ValueError(
            f"response {type(entity).__name__} (key {key} v{version}) does not answer "
            f"api {header.api_key} v{header.api_version}"
        )


def encode_response_parts(header: RequestHeader, response: Any) -> list[Any]:
    """Encode a framed response as a list of pieces to write in order.

    Every piece is `bytes` or a `memoryview`, except that a Fetch response's `records`
    fields pass through untouched: whatever object the handler put there (bytes, a
    memoryview, or any object with `__len__` describing a file range to `sendfile`).
    The first piece starts with the int32 frame size. For everything but Fetch v4-v12 the
    list has one element.
    """
    _check_pair(header, response)
    if header.api_key == fastpath.FETCH_KEY and header.api_version in fastpath.FETCH_VERSIONS:
        return fastpath.encode_fetch_response(header.correlation_id, response)
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    _write_header_and_body(
        out,
        header.correlation_id,
        response_header_version(header.api_key, header.api_version),
        response,
    )
    buf = out.getbuffer()
    struct.pack_into(">i", buf, 0, len(buf) - 4)
    del buf
    return [out.getvalue()]


def encode_response(header: RequestHeader, response: Any) -> bytes:
    """Encode a framed response (size prefix, response header, body) as one bytes."""
    return b"".join(bytes(p) for p in encode_response_parts(header, response))


def encode_api_versions_fallback(
    correlation_id: int, ranges: ApiRanges | Iterable[tuple[int, int, int]]
) -> bytes:
    """The framed reply to an ApiVersions request at a version we do not serve.

    A v0 body (whatever version was asked: v0 is what every client can read), error
    UNSUPPORTED_VERSION (35) and our ranges, so the client retries at a version we have
    (Kafka's RequestContext / KIP-511). Response header v0.
    """
    items = (
        [(k, lo, hi) for k, (lo, hi) in ranges.items()]
        if isinstance(ranges, Mapping)
        else list(ranges)
    )
    body = bytearray(struct.pack(">ihi", correlation_id, UNSUPPORTED_VERSION_ERROR, len(items)))
    for key, lo, hi in sorted(items):
        body += struct.pack(">hhh", key, lo, hi)
    return struct.pack(">i", len(body)) + bytes(body)


# ----------------------------------------------------------------- client side (tests, tools)


def encode_request(header: RequestHeader, request: Any) -> bytes:
    """Encode a framed request with the header version its (key, version) requires."""
    _check_pair(header, request)
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    hv = request_header_version(header.api_key, header.api_version)
    out.write(struct.pack(">hhi", header.api_key, header.api_version, header.correlation_id))
    if hv >= 1:
        cid = None if header.client_id is None else header.client_id.encode()
        out.write(struct.pack(">h", -1) if cid is None else struct.pack(">h", len(cid)) + cid)
    if hv >= 2:
        out.write(b"\x00")
    entity_writer(type(request))(out, request)
    buf = out.getbuffer()
    struct.pack_into(">i", buf, 0, len(buf) - 4)
    del buf
    return out.getvalue()


def decode_response(frame: Buf, api_key: int, api_version: int) -> tuple[int, Any]:
    """Decode a response payload (no size prefix) -> (correlation_id, kio entity).

    For tests and tools; raises `MalformedRequest` on bad input, like the request side.
    """
    schema = response_schema(api_key, api_version)
    try:
        (correlation_id,) = I32.unpack_from(frame, 0)
        pos = 4
        if response_header_version(api_key, api_version) >= 1:
            pos = skip_tagged_fields(frame, pos)
        # A mirror reads its peers' answers with this: the same lies could abort it.
        check_request_body(frame, pos, schema)
        entity, size = entity_reader(schema)(frame, pos)
        end = pos + size
    except Exception as exc:
        raise MalformedRequest(f"cannot decode response {api_key} v{api_version}: {exc}") from None
    if end != len(frame):
        raise MalformedRequest(f"{len(frame) - end} bytes left after response body")
    return int(correlation_id), cast(Any, entity)

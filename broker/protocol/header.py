"""Kafka request headers v0-v2 and response headers v0-v1.

Owns `RequestHeader`, `parse_request_header`, and the rules that pick a header version:

* Request header v1 = api_key i16, api_version i16, correlation_id i32, client_id as an
  int16-length nullable string. v2 (used when the API version is flexible) appends
  tagged fields, and client_id **stays** int16-length (RequestHeader.json says
  `flexibleVersions: none` for it). v0 (no client_id) exists only for ControlledShutdown
  v0, which we never serve; it is parsed for completeness.
* Response header v0 = correlation_id; v1 adds an (empty) tagged-field section and is
  used for flexible responses, except ApiVersions, which always answers with v0 so a
  client can read it whatever version it sent (KIP-511).

Which versions are flexible comes from kio's generated schemas. Imports kio and the
standard library only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kio.index import KioIndexError, load_request_schema

from ._wire import I16, I32, Buf, _Bad, _Short, read_nullable_string, skip_tagged_fields
from .errors import MalformedRequest

__all__ = [
    "API_VERSIONS_KEY",
    "MAX_CLIENT_ID_BYTES",
    "RequestHeader",
    "is_flexible_request",
    "parse_request_header",
    "request_header_version",
    "response_header_version",
]

API_VERSIONS_KEY = 18

MAX_CLIENT_ID_BYTES = 0x7FFF - 37
"""The longest client id we accept. A group member's id is "<client id>-<uuid4>" (37
bytes more, as Kafka builds it) and answers carry it in an int16-length string, so a
longer client id would make a member id no answer could hold."""
_CONTROLLED_SHUTDOWN_KEY = 7


@dataclass(frozen=True, slots=True)
class RequestHeader:
    """The parts of a request header a server needs. Tagged header fields are skipped."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None


@functools.cache
def is_flexible_request(api_key: int, api_version: int) -> bool | None:
    """True/False from kio's schema, or None if kio does not know (api_key, api_version)."""
    try:
        return bool(load_request_schema(api_key, api_version).__flexible__)
    except (KioIndexError, ImportError, AttributeError, ValueError):
        return None


def request_header_version(api_key: int, api_version: int) -> int:
    """Header version a request of (api_key, api_version) carries; 1 if unknown."""
    if api_key == _CONTROLLED_SHUTDOWN_KEY and api_version == 0:
        return 0
    return 2 if is_flexible_request(api_key, api_version) else 1


def response_header_version(api_key: int, api_version: int) -> int:
    """Header version of the response: 1 for flexible versions, but always 0 for ApiVersions."""
    if api_key == API_VERSIONS_KEY:
        return 0
    return 1 if is_flexible_request(api_key, api_version) else 0


def parse_request_header(
    frame: Buf, *, header_version: int | None = None
) -> tuple[RequestHeader, int]:
    """Parse a request header at the start of `frame` (a payload without its size prefix).

    Returns the header and the offset where the body starts. The header version is
    chosen from (api_key, api_version) unless given. For a version kio does not know, the
    v1 fields are parsed and the returned offset is only valid for non-flexible bodies;
    callers must reject such requests before reading the body (`decode_request` does).
    Raises `MalformedRequest` if the header is cut short or holds bad data.
    """
    try:
        if len(frame) < 8:
            raise _Short("header")
        api_key = I16.unpack_from(frame, 0)[0]
        api_version = I16.unpack_from(frame, 2)[0]
        correlation_id = I32.unpack_from(frame, 4)[0]
        version = (
            request_header_version(api_key, api_version)
            if header_version is None
            else header_version
        )
        pos = 8
        client_id: str | None = None
        if version >= 1:
            client_id, pos = read_nullable_string(frame, pos)
            # Characters are at most 4 bytes of UTF-8: encode only when it could matter.
            if (
                client_id is not None
                and len(client_id) * 4 > MAX_CLIENT_ID_BYTES
                and len(client_id.encode()) > MAX_CLIENT_ID_BYTES
            ):
                raise _Bad(
                    f"client id of {len(client_id.encode())} bytes (at most {MAX_CLIENT_ID_BYTES})"
                )
        if version >= 2:
            pos = skip_tagged_fields(frame, pos)
    except _Short as exc:
        raise MalformedRequest(f"request header cut short ({exc})") from None
    except _Bad as exc:
        raise MalformedRequest(f"bad request header: {exc}") from None
    return RequestHeader(api_key, api_version, correlation_id, client_id), pos

"""The Kafka wire codec: bytes in, typed messages out. No I/O, no trio, no storage.

Public API (see each module's docstring for the details):

* framing: `FrameDecoder(max_frame_size)`, `.receive_data(data)`, `.next_frame()`;
  `frame(payload)`.
* requests/responses: `decode_request(frame, supported=...)` -> `(RequestHeader, entity)`,
  `encode_response(header, entity)` -> bytes, `encode_response_parts(header, entity)` ->
  writev pieces (Fetch records pass through untouched), `encode_api_versions_fallback(
  correlation_id, ranges)`, `request_schema`/`response_schema` (kio dataclasses),
  `parse_request_header`; `encode_request`/`decode_response` for tests and tools.
* bounds: `broker.protocol.bounds.check_request_body`, the schema walk every body passes
  before kio's reader (counts and lengths within the frame, nulls only where allowed,
  strings of at most 0x7fff bytes, at most `MAX_ELEMENTS` array elements).
* records: `broker.protocol.records` (batch header view, CRC-32C, splitting,
  LogAppendTime, record decoding with decompression, ListOffsets-by-time search).
* errors: `ProtocolError` (close the connection) and `RecordBatchError` (a per-partition
  Kafka error code) hierarchies.
* `RECOMMENDED_RANGES`: the versions this codec is tested for.

May import kio, crc32c and the compression libraries; never trio, sockets or `storage`.
"""

from .codec import (
    ApiRanges,
    decode_request,
    decode_response,
    encode_api_versions_fallback,
    encode_request,
    encode_response,
    encode_response_parts,
    request_schema,
    response_schema,
)
from .errors import (
    CorruptRecordBatch,
    FrameTooLarge,
    InvalidFrame,
    InvalidRecordBatch,
    MalformedRequest,
    ProtocolError,
    RecordBatchError,
    RecordBatchTooLarge,
    UnknownApiKey,
    UnsupportedCompression,
    UnsupportedMagic,
    UnsupportedVersion,
)
from .framing import DEFAULT_MAX_FRAME_SIZE, FrameDecoder, frame
from .header import (
    RequestHeader,
    parse_request_header,
    request_header_version,
    response_header_version,
)
from .versions import RECOMMENDED_RANGES, intersect_ranges

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "RECOMMENDED_RANGES",
    "ApiRanges",
    "CorruptRecordBatch",
    "FrameDecoder",
    "FrameTooLarge",
    "InvalidFrame",
    "InvalidRecordBatch",
    "MalformedRequest",
    "ProtocolError",
    "RecordBatchError",
    "RecordBatchTooLarge",
    "RequestHeader",
    "UnknownApiKey",
    "UnsupportedCompression",
    "UnsupportedMagic",
    "UnsupportedVersion",
    "decode_request",
    "decode_response",
    "encode_api_versions_fallback",
    "encode_request",
    "encode_response",
    "encode_response_parts",
    "frame",
    "intersect_ranges",
    "parse_request_header",
    "request_header_version",
    "request_schema",
    "response_header_version",
    "response_schema",
]

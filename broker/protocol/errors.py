"""Typed errors of the Kafka codec.

Two planes, as in h11/wsproto:

* `ProtocolError` and its subclasses: the peer broke the protocol (bad framing, a header
  or body that does not parse, an API or version we do not serve). The server answers
  nothing more on that connection and closes it, as Kafka's SocketServer does. The one
  exception is ApiVersions at an unsupported version: `UnsupportedVersion.header` lets the
  server answer with `encode_api_versions_fallback` first (KIP-511).
* `RecordBatchError` and its subclasses: a Produce carried a record batch we refuse. That
  is a Kafka outcome, not a broken connection: each carries the Kafka `error_code` the
  handler puts in that partition's response.

These are the only exceptions a decoder in `broker.protocol` lets escape; `struct.error`,
`IndexError`, `UnicodeDecodeError`, zlib/lz4/zstd/snappy errors and kio's errors are all
translated. Imports nothing from the rest of the project.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .header import RequestHeader

__all__ = [
    "CorruptRecordBatch",
    "FrameTooLarge",
    "InvalidFrame",
    "InvalidRecordBatch",
    "InvalidRecordTimestamp",
    "MalformedRequest",
    "ProtocolError",
    "RecordBatchError",
    "RecordBatchTooLarge",
    "UnknownApiKey",
    "UnsupportedCompression",
    "UnsupportedMagic",
    "UnsupportedVersion",
]


class ProtocolError(Exception):
    """The peer broke the Kafka protocol: close the connection."""


class InvalidFrame(ProtocolError):
    """The 4-byte size prefix is impossible (negative) or a frame is cut short."""


class FrameTooLarge(InvalidFrame):
    """A frame announces more bytes than the configured maximum."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class MalformedRequest(ProtocolError):
    """The request header or body does not parse for its (api_key, api_version)."""


class UnsupportedVersion(ProtocolError):
    """The (api_key, api_version) pair is not served.

    `header` is the parsed request header (its client_id and correlation id are real) so
    the server can answer an ApiVersions request with the v0 fallback before closing.
    The body was not parsed.
    """

    def __init__(self, header: RequestHeader, message: str | None = None) -> None:
        super().__init__(
            message or f"unsupported version {header.api_version} of api key {header.api_key}"
        )
        self.header = header

    @property
    def api_key(self) -> int:
        return self.header.api_key

    @property
    def api_version(self) -> int:
        return self.header.api_version


class UnknownApiKey(UnsupportedVersion):
    """The api key is not served at any version (subclass so one `except` covers both)."""

    def __init__(self, header: RequestHeader) -> None:
        super().__init__(header, f"unknown api key {header.api_key}")


# Kafka error codes the record-batch errors map to (kafka.common.protocol.Errors).
CORRUPT_MESSAGE = 2
MESSAGE_TOO_LARGE = 10
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87
INVALID_TIMESTAMP = 32


class RecordBatchError(Exception):
    """A record batch is refused; `error_code` is the Kafka code for the partition.

    `record_index` is the index inside the batch of the first bad record (what Produce
    v8+ answers as record_errors' batch_index), None when the batch as a whole is bad.
    """

    error_code: int = CORRUPT_MESSAGE

    def __init__(self, message: str, record_index: int | None = None) -> None:
        super().__init__(message)
        self.record_index = record_index


class CorruptRecordBatch(RecordBatchError):
    """Truncated or inconsistent bytes, or a CRC-32C mismatch: CORRUPT_MESSAGE (2)."""

    error_code = CORRUPT_MESSAGE


class InvalidRecordBatch(RecordBatchError):
    """The batch parses but breaks a rule (count, offset deltas): INVALID_RECORD (87)."""

    error_code = INVALID_RECORD


class InvalidRecordTimestamp(RecordBatchError):
    """A CreateTime record outside the topic's message.timestamp.{before,after}.max.ms."""

    error_code = INVALID_TIMESTAMP


class UnsupportedMagic(RecordBatchError):
    """Message format v0/v1 (magic 0/1): UNSUPPORTED_FOR_MESSAGE_FORMAT (43)."""

    error_code = UNSUPPORTED_FOR_MESSAGE_FORMAT


class UnsupportedCompression(RecordBatchError):
    """Unknown codec id, or a codec the request version may not use (76)."""

    error_code = UNSUPPORTED_COMPRESSION_TYPE


class RecordBatchTooLarge(RecordBatchError):
    """Decompressed data past the caller's limit: MESSAGE_TOO_LARGE (10)."""

    error_code = MESSAGE_TOO_LARGE

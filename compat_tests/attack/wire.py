"""Kafka requests on raw sockets through our codec, and the strict read-back of a log.

`Conn` frames bytes on one socket; `call` sends one kio request and decodes the answer.
On top: ApiVersions, CreateTopics, Metadata, ListOffsets, Produce of raw batches, and
`read_partition`, which fetches a partition from offset 0 to its high watermark and decodes
every stored batch with `strict_decode` (our own checks, independent of the broker's) and
with the broker's `iter_records`: a batch either decodes cleanly by both or is reported.

Imports kio, broker.protocol (sans-I/O) and the standard library.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c

from broker.protocol.codec import decode_response, encode_request, request_schema
from broker.protocol.header import RequestHeader
from broker.protocol.records import iter_records

from .schema import make

_CORRELATION = itertools.count(1000)


class Closed(Exception):
    """The broker closed the connection (or reset it) before answering."""


class Conn:
    """One TCP connection speaking length-prefixed frames."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise Closed(str(exc)) from None

    def _fill(self, n: int, timeout: float) -> None:
        self.sock.settimeout(timeout)
        while len(self._buf) < n:
            try:
                chunk = self.sock.recv(max(65536, n - len(self._buf)))
            except ConnectionResetError:
                raise Closed("reset") from None
            if not chunk:
                raise Closed("eof")
            self._buf += chunk

    def recv_frame(self, timeout: float = 10.0) -> bytes:
        """The next response payload (no size prefix). Closed on EOF; TimeoutError."""
        self._fill(4, timeout)
        (size,) = struct.unpack_from(">i", self._buf)
        self._fill(4 + size, timeout)
        payload = bytes(self._buf[4 : 4 + size])
        del self._buf[: 4 + size]
        return payload

    def call(self, api_key: int, version: int, request: Any, timeout: float = 30.0) -> Any:
        cid = next(_CORRELATION) & 0x7FFFFFFF
        self.send(encode_request(RequestHeader(api_key, version, cid, "hk-attack"), request))
        payload = self.recv_frame(timeout)
        got, response = decode_response(payload, api_key, version)
        if got != cid:
            raise AssertionError(f"correlation id {got}, expected {cid}")
        return response


def call(host: str, port: int, api_key: int, version: int, values: dict[str, Any],
         timeout: float = 30.0) -> Any:  # fmt: skip
    """One request (built by `schema.make` from `values`) on a new connection."""
    with Conn(host, port, timeout) as c:
        return c.call(api_key, version, make(request_schema(api_key, version), values), timeout)


def api_versions(host: str, port: int) -> dict[int, tuple[int, int]]:
    resp = call(host, port, 18, 3, {"client_software_name": "hk-attack",
                                    "client_software_version": "1"})  # fmt: skip
    if int(resp.error_code.value) != 0:
        raise AssertionError(f"ApiVersions v3 error {resp.error_code}")
    return {int(k.api_key): (int(k.min_version), int(k.max_version)) for k in resp.api_keys}


def ms(n: int) -> datetime.timedelta:
    return datetime.timedelta(milliseconds=n)


def create_topics(
    host: str, port: int, topics: dict[str, int], timeout_s: float = 60.0
) -> dict[str, int]:
    """CreateTopics v5: name -> partitions; returns name -> error code."""
    resp = call(
        host, port, 19, 5,
        {"topics": [{"name": n, "num_partitions": p, "replication_factor": 1}
                    for n, p in topics.items()],
         "timeout": ms(int(timeout_s * 1000))},
        timeout=timeout_s + 30,
    )  # fmt: skip
    return {str(t.name): int(t.error_code.value) for t in resp.topics}


def create_topic(host: str, port: int, name: str, partitions: int = 1) -> None:
    err = create_topics(host, port, {name: partitions})[name]
    if err not in (0, 36):  # TOPIC_ALREADY_EXISTS is fine
        raise AssertionError(f"CreateTopics {name}: error {err}")


def metadata(host: str, port: int, topics: list[str] | None = None) -> dict[str, list[int]]:
    """Metadata v1 (all topics when None): topic -> its partition indexes."""
    values: dict[str, Any] = {"topics": None if topics is None else [{"name": t} for t in topics]}
    resp = call(host, port, 3, 1, values)
    return {
        str(t.name): sorted(int(p.partition_index) for p in t.partitions)
        for t in resp.topics
        if int(t.error_code.value) == 0
    }


def list_offsets(
    host: str, port: int, topic: str, partitions: list[int], timestamp: int
) -> dict[int, int]:
    """ListOffsets v5 (-1 latest, -2 earliest): partition -> offset (-1 when refused)."""
    resp = call(
        host, port, 2, 5,
        {"replica_id": -1, "topics": [{"name": topic, "partitions": [
            {"partition_index": p, "current_leader_epoch": -1, "timestamp": timestamp}
            for p in partitions]}]},
    )  # fmt: skip
    out = {}
    for t in resp.topics:
        for p in t.partitions:
            out[int(p.partition_index)] = int(p.offset) if int(p.error_code.value) == 0 else -1
    return out


def high_watermarks(host: str, port: int, topic: str, partitions: list[int]) -> dict[int, int]:
    """ListOffsets latest: partition -> offset (-1 when the broker refused)."""
    return list_offsets(host, port, topic, partitions, -1)


def produce(conn: Conn, topic: str, partition: int, records: bytes, version: int = 9,
            acks: int = -1, timeout: float = 60.0) -> tuple[int, str | None]:  # fmt: skip
    """Produce raw `records` bytes; (error code, error message) for the partition."""
    schema = request_schema(0, version)
    req = make(schema, {
        "transactional_id": None, "acks": acks, "timeout": ms(30_000),
        "topic_data": [{"name": topic, "partition_data": [{"index": partition, "records": records}]}],
    })  # fmt: skip
    resp = conn.call(0, version, req, timeout)
    for t in resp.responses:
        for p in t.partition_responses:
            return int(p.error_code.value), getattr(p, "error_message", None)
    raise AssertionError("Produce answer names no partition")


# ---------------------------------------------------------------- strict read-back


class Malformed(Exception):
    """A stored batch does not decode cleanly."""


@dataclass(frozen=True)
class StoredRecord:
    offset: int
    key: bytes | None
    value: bytes | None


def _varint(buf: bytes, pos: int, max_bytes: int = 10) -> tuple[int, int]:
    result = shift = 0
    for i in range(max_bytes):
        if pos + i >= len(buf):
            raise Malformed("varint cut short")
        b = buf[pos + i]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return (result >> 1) ^ -(result & 1), pos + i + 1
        shift += 7
    raise Malformed("varint too long")


def _varbytes(buf: bytes, pos: int, end: int) -> tuple[bytes | None, int]:
    n, pos = _varint(buf, pos, 5)
    if n == -1:
        return None, pos
    if n < 0 or pos + n > end:
        raise Malformed(f"length {n} runs past the record")
    return buf[pos : pos + n], pos + n


INFLATE_CAP = 64 << 20  # no batch a client may send inflates past this (max.message.bytes x 64)


def _inflate(codec: int, data: bytes) -> bytes:
    try:
        if codec == 0:
            return data
        if codec == 1:
            d = zlib.decompressobj(47)
            out = d.decompress(data, INFLATE_CAP + 1)
            if not d.eof:
                raise Malformed("gzip stream truncated or past the cap")
            return out
        if codec == 2:
            import snappy  # type: ignore[import-untyped]

            if data.startswith(b"\x82SNAPPY\x00"):
                pos, parts = 16, []
                while pos < len(data):
                    (n,) = struct.unpack_from(">i", data, pos)
                    parts.append(_snappy_block(snappy, data[pos + 4 : pos + 4 + n]))
                    pos += 4 + n
                return b"".join(parts)
            return _snappy_block(snappy, data)
        if codec == 3:
            import lz4.frame  # type: ignore[import-untyped]

            ld = lz4.frame.LZ4FrameDecompressor()
            out = ld.decompress(data, max_length=INFLATE_CAP + 1)
            if not ld.eof:
                raise Malformed("lz4 frame truncated or past the cap")
            return bytes(out)
        if codec == 4:
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True) as r:
                out = r.read(INFLATE_CAP + 1)
            if len(out) > INFLATE_CAP:
                raise Malformed("zstd payload inflates past the cap")
            return bytes(out)
    except Malformed:
        raise
    except Exception as exc:
        raise Malformed(f"codec {codec}: {exc}") from None
    raise Malformed(f"unknown codec {codec}")


def _snappy_block(snappy: Any, block: bytes) -> bytes:
    n, _ = _uvarint(block)
    if n > INFLATE_CAP:
        raise Malformed(f"snappy block states {n} bytes")
    return bytes(snappy.uncompress(block))


def _uvarint(buf: bytes) -> tuple[int, int]:
    result = shift = 0
    for i, b in enumerate(buf[:5]):
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i + 1
        shift += 7
    raise Malformed("bad uvarint")


def _check_control(batch: bytes, attrs: int, lod: int, count: int) -> None:
    """A control batch as only a broker writes one (Kafka's EndTransactionMarker): transactional,
    uncompressed, one record whose key is (version 0, ABORT or COMMIT) and whose value is
    (version 0, coordinator epoch), from a producer id; Malformed otherwise."""
    pid = struct.unpack_from(">q", batch, 43)[0]
    if not attrs & 0x10 or attrs & 0x07 or count != 1 or lod != 0 or pid < 0:
        raise Malformed(f"control batch: attributes {attrs:#x}, {count} records, producer {pid}")
    data = batch[61:]
    n, pos = _varint(data, 0, 5)
    if pos + n != len(data):
        raise Malformed(f"control batch: a record of {n} bytes in {len(data) - pos}")
    p = pos + 1
    _ts, p = _varint(data, p)
    delta, p = _varint(data, p, 5)
    key, p = _varbytes(data, p, len(data))
    value, p = _varbytes(data, p, len(data))
    nh, p = _varint(data, p, 5)
    if delta != 0 or key is None or len(key) != 4 or key[:2] != b"\0\0" or key[2:] not in (b"\0\0", b"\0\1"):
        raise Malformed(f"control batch: key {key!r}")
    if value is None or len(value) < 6 or value[:2] != b"\0\0" or nh != 0 or p != len(data):
        raise Malformed(f"control batch: value {value!r}, {nh} headers")


def strict_decode(batch: bytes) -> list[StoredRecord]:
    """Every record of one stored batch, or Malformed: magic 2, exact length, CRC-32C,
    count == lastOffsetDelta + 1 == records present, offset deltas 0..n-1, every length in
    bounds, header keys not null, no byte left over; payload inflated under INFLATE_CAP."""
    if len(batch) < 61:
        raise Malformed("batch shorter than its header")
    base, length, _epoch, magic, crc = struct.unpack_from(">qiibI", batch)
    if magic != 2:
        raise Malformed(f"magic {magic}")
    if length + 12 != len(batch):
        raise Malformed(f"batch length {length} but {len(batch) - 12} bytes follow")
    if crc32c.crc32c(batch[21:]) != crc:
        raise Malformed("CRC-32C mismatch")
    attrs, lod, _bts, _mts, _pid, _pe, _bs, count = struct.unpack_from(">hiqqqhii", batch, 21)
    if attrs & 0x20:
        _check_control(batch, attrs, lod, count)
        return []  # a transaction marker: no record of a client's
    if count <= 0 or lod != count - 1:
        raise Malformed(f"{count} records but lastOffsetDelta {lod}")
    data = _inflate(attrs & 0x07, batch[61:])
    out = []
    pos = 0
    for i in range(count):
        n, pos = _varint(data, pos, 5)
        if n <= 0 or pos + n > len(data):
            raise Malformed(f"record {i}: length {n} runs past the batch")
        end = pos + n
        p = pos + 1  # attributes
        _ts, p = _varint(data, p)
        delta, p = _varint(data, p, 5)
        if delta != i:
            raise Malformed(f"record {i} has offset delta {delta}")
        key, p = _varbytes(data, p, end)
        value, p = _varbytes(data, p, end)
        nh, p = _varint(data, p, 5)
        if nh < 0 or nh > n:
            raise Malformed(f"record {i}: {nh} headers")
        for _ in range(nh):
            hk, p = _varbytes(data, p, end)
            if hk is None:
                raise Malformed(f"record {i}: null header key")
            # Not UTF-8 is not malformed: Kafka's reader decodes a key with replacement.
            _hv, p = _varbytes(data, p, end)
        if p != end:
            raise Malformed(f"record {i}: {end - p} bytes left inside the record")
        out.append(StoredRecord(base + i, key, value))
        pos = end
    if pos != len(data):
        raise Malformed(f"{len(data) - pos} bytes after the last record")
    return out


def split_stored(blob: bytes) -> Iterator[bytes]:
    """Whole batches of a Fetch answer's records (a cut tail batch is dropped)."""
    pos = 0
    while pos + 12 <= len(blob):
        (length,) = struct.unpack_from(">i", blob, pos + 8)
        if length < 49:
            raise Malformed(f"stored batch length {length}")
        if pos + 12 + length > len(blob):
            return
        yield blob[pos : pos + 12 + length]
        pos += 12 + length


@dataclass
class ReadBack:
    records: list[StoredRecord]
    batches: int
    malformed: list[str]
    high_watermark: int


def read_partition(host: str, port: int, topic: str, partition: int,
                   timeout: float = 120.0) -> ReadBack:  # fmt: skip
    """Fetch `topic`/`partition` from its log start to its high watermark (Fetch v11), decoding
    every batch with `strict_decode` and the broker's `iter_records`."""
    hw = high_watermarks(host, port, topic, [partition])[partition]
    out = ReadBack([], 0, [], hw)
    # From the log start: retention and compaction (__consumer_offsets) move it past 0.
    offset = max(0, list_offsets(host, port, topic, [partition], -2)[partition])
    with Conn(host, port, timeout) as c:
        while offset < hw:
            req = make(request_schema(1, 11), {
                "replica_id": -1, "max_wait": ms(0), "min_bytes": 0, "max_bytes": 16 << 20,
                "isolation_level": 0, "session_id": 0, "session_epoch": -1,
                "topics": [{"topic": topic, "partitions": [{
                    "partition": partition, "current_leader_epoch": -1, "fetch_offset": offset,
                    "log_start_offset": -1, "partition_max_bytes": 8 << 20}]}],
            })  # fmt: skip
            resp = c.call(1, 11, req, timeout)
            p = resp.responses[0].partitions[0]
            if int(p.error_code.value) != 0:
                out.malformed.append(
                    f"{topic}/{partition} offset {offset}: Fetch error {p.error_code}"
                )
                break
            blob = bytes(p.records or b"")
            got = list(split_stored(blob)) if blob else []
            if not got:
                out.malformed.append(
                    f"{topic}/{partition} offset {offset}: Fetch returned no whole batch below {hw}"
                )
                break
            for b in got:
                (base,) = struct.unpack_from(">q", b)
                lod = struct.unpack_from(">i", b, 23)[0]
                out.batches += 1
                try:
                    recs = strict_decode(b)
                    control = bool(struct.unpack_from(">h", b, 21)[0] & 0x20)
                    theirs = [(r.offset, r.key, r.value) for r in iter_records(b)]
                    if not control and theirs != [(r.offset, r.key, r.value) for r in recs]:
                        raise Malformed("the broker's iter_records reads it differently")
                    out.records += recs
                except Exception as exc:
                    out.malformed.append(f"{topic}/{partition} offset {base}: {exc} "
                                         f"(batch {b[:80].hex()}...)")  # fmt: skip
                offset = max(offset, base + max(lod, 0) + 1)
    return out

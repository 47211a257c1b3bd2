"""The differential oracle: one fixed request script, sent to Apache Kafka and to hyperkafka.

Owns:
- `RawClient`, a blocking one-connection Kafka client over kio messages (the codec's
  `encode_request`/`decode_response`), which can also send hand-made frames;
- `fixed_batch`, a deterministic magic-2 record batch builder (the script's payloads);
- `run_script(bootstrap)`: the request script, returning one `Exchange` per request with
  the response turned into plain, normalised data (`plain`, `normalise`);
- `diff` (field-by-field comparison, arrays of keyed structs matched by key) and the
  accepted-differences table of compat_tests/FINDINGS.md (`load_findings`, `Finding`).

What is normalised away, because it differs between any two healthy brokers (see
NORMALISED and FINDINGS.md): throttle times, cluster ids, topic ids (kept: zero vs
non-zero), broker ports, producer ids (kept: -1 vs assigned), error messages (kept: null
entirely), log dir paths and disk sizes, LogAppendTime timestamps (kept: -1 vs set),
transaction markers' timestamps and transaction start times,
config documentation (kept: null vs present), record-batch CRCs (kept: valid or not; they
cover the producer id), and the values of the configs in CONFIG_VALUES_THAT_DIFFER.

Imports the standard library, crc32c, kio and broker.protocol (the codec), broker.shape.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib
import itertools
import re
import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c

from broker.protocol.codec import decode_response, encode_request
from broker.protocol.header import RequestHeader
from broker.shape import shape

FINDINGS_PATH = Path(__file__).resolve().parent / "FINDINGS.md"

T0 = 1_700_000_000_000  # base timestamp of every scripted batch (ms)
CLIENT_ID = "hk-oracle"

API_NAMES = {
    0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 8: "OffsetCommit",
    9: "OffsetFetch", 10: "FindCoordinator", 11: "JoinGroup", 12: "Heartbeat", 13: "LeaveGroup",
    14: "SyncGroup", 15: "DescribeGroups", 16: "ListGroups", 17: "SaslHandshake",
    18: "ApiVersions", 19: "CreateTopics", 20: "DeleteTopics", 22: "InitProducerId",
    23: "OffsetForLeaderEpoch", 32: "DescribeConfigs", 36: "SaslAuthenticate",
    42: "DeleteGroups", 47: "OffsetDelete", 60: "DescribeCluster", 21: "DeleteRecords",
    29: "DescribeAcls", 30: "CreateAcls", 31: "DeleteAcls", 33: "AlterConfigs",
    35: "DescribeLogDirs", 37: "CreatePartitions", 44: "IncrementalAlterConfigs",
    46: "ListPartitionReassignments", 61: "DescribeProducers",
    68: "ConsumerGroupHeartbeat", 69: "ConsumerGroupDescribe",
    24: "AddPartitionsToTxn", 25: "AddOffsetsToTxn", 26: "EndTxn", 28: "TxnOffsetCommit",
    65: "DescribeTransactions", 66: "ListTransactions", 27: "WriteTxnMarkers",
}  # fmt: skip

# Config values that legitimately differ between the two brokers: they describe the
# machine or the process (paths, addresses), not behaviour a client sees.
CONFIG_VALUES_THAT_DIFFER = frozenset(
    {"log.dirs", "log.dir", "listeners", "advertised.listeners", "node.id", "broker.id"}
)

NORMALISED = (
    "throttle_time",
    "cluster_id",
    "topic_id (zero vs non-zero kept)",
    "brokers[*].port",
    "producer_id (-1 vs assigned kept)",
    "error_message (free text; the error code carries the meaning)",
    "log_append_time (-1 vs set kept)",
    "transaction markers' timestamps and transaction start times (the broker's clock)",
    "documentation",
    "records[*].crc",
    "records[*].max_timestamp (LogAppendTime batches)",
    f"configs[*].value for {sorted(CONFIG_VALUES_THAT_DIFFER)}",
    "log_dir (a path), total_bytes and usable_bytes (the disk; -1 vs known kept)",
)


class OracleProtocolError(Exception):
    """A broker's answer could not be read (closed early, bad frame, wrong correlation)."""


# ---------------------------------------------------------------------------- the client


def request_class(api: str, version: int) -> Any:
    module = importlib.import_module(f"kio.schema.{api}.v{version}.request")
    name = "".join(part.title() for part in api.split("_")) + "Request"
    return getattr(module, name)


class RawClient:
    """One blocking connection speaking the Kafka protocol with kio messages."""

    def __init__(self, host: str, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self._ids = itertools.count(1)
        self._buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_id(self) -> int:
        return next(self._ids)

    def call(self, api: str, version: int, body: dict[str, Any]) -> Any:
        return self.receive(self.send(api, version, body))

    def send(self, api: str, version: int, body: dict[str, Any]) -> RequestHeader:
        """Send a request without waiting for its answer (`receive` reads it)."""
        cls = request_class(api, version)
        header = RequestHeader(cls.__api_key__, version, self.next_id(), CLIENT_ID)
        self.sock.sendall(encode_request(header, shape(cls, body)))
        return header

    def receive(self, header: RequestHeader) -> Any:
        got, response = decode_response(self.read_frame(), header.api_key, header.api_version)
        if got != header.correlation_id:
            raise OracleProtocolError(f"correlation id {got} != {header.correlation_id}")
        return response

    def send_raw(self, frame: bytes) -> None:
        self.sock.sendall(frame)

    def read_frame(self) -> bytes:
        while True:
            if len(self._buf) >= 4:
                (size,) = struct.unpack_from(">i", self._buf)
                if len(self._buf) >= 4 + size:
                    frame = bytes(self._buf[4 : 4 + size])
                    del self._buf[: 4 + size]
                    return frame
            data = self.sock.recv(1 << 20)
            if not data:
                raise OracleProtocolError("connection closed")
            self._buf += data

    def closed_by_peer(self, wait: float = 3.0) -> bool:
        """True when the broker closes this connection within `wait` seconds."""
        self.sock.settimeout(wait)
        try:
            while self.sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True
        return True


# ---------------------------------------------------------------------------- batches


def _varint(value: int) -> bytes:
    zz = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        byte = zz & 0x7F
        zz >>= 7
        if zz:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varbytes(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


def fixed_batch(
    records: Iterable[tuple[int, bytes | None, bytes | None, tuple[tuple[str, bytes], ...]]],
    *,
    base_timestamp: int = T0,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
) -> bytes:
    """A magic-2 batch, uncompressed, CreateTime: records are (ts delta, key, value, headers)."""
    body = bytearray()
    max_ts = base_timestamp
    n = 0
    for i, (delta, key, value, headers) in enumerate(records):
        rec = bytearray(b"\x00")  # attributes
        rec += _varint(delta) + _varint(i) + _varbytes(key) + _varbytes(value)
        rec += _varint(len(headers))
        for hk, hv in headers:
            rec += _varbytes(hk.encode()) + _varbytes(hv)
        body += _varint(len(rec)) + rec
        max_ts = max(max_ts, base_timestamp + delta)
        n += 1
    after_crc = struct.pack(
        ">hiqqqhii", 0, n - 1, base_timestamp, max_ts, producer_id, producer_epoch, base_sequence, n
    ) + bytes(body)
    crc = crc32c.crc32c(after_crc)
    head = struct.pack(">qiibI", 0, 4 + 1 + 4 + len(after_crc), -1, 2, crc)
    return head + after_crc


def script_batch(base_delta: int = 0, **kw: Any) -> bytes:
    """The script's three records: a key/value/header record, a null key, a null value."""
    return fixed_batch(
        [
            (base_delta + 0, b"k0", b"v0-\x00\xff binary", (("h1", b"x"),)),
            (base_delta + 10, None, b"v1", ()),
            (base_delta + 20, b"k2", None, (("h1", b""), ("h2", b"yy"))),
        ],
        **kw,
    )


def describe_records(data: bytes | None) -> Any:
    """A record set as a list of batch headers plus the records' bytes, for comparison."""
    if data is None:
        return None
    out: list[dict[str, Any]] = []
    pos = 0
    data = bytes(data)
    while pos + 12 <= len(data):
        (base_offset, length) = struct.unpack_from(">qi", data, pos)
        end = pos + 12 + length
        if end > len(data):
            out.append({"partial_tail_bytes": len(data) - pos})
            break
        b = data[pos:end]
        (epoch, magic, crc, attrs, last_delta, base_ts, max_ts, pid, pepoch, bseq, count) = (
            struct.unpack_from(">ibIhiqqqhii", b, 12)
        )
        out.append(
            {
                "base_offset": base_offset,
                "batch_length": length,
                "partition_leader_epoch": epoch,
                "magic": magic,
                "crc": crc,
                "crc_valid": crc == crc32c.crc32c(b[21:]),
                "attributes": attrs,
                "last_offset_delta": last_delta,
                "base_timestamp": base_ts,
                "max_timestamp": max_ts,
                "producer_id": pid,
                "producer_epoch": pepoch,
                "base_sequence": bseq,
                "records_count": count,
                "records_hex": b[61:].hex(),
            }
        )
        pos = end
    return out


# ---------------------------------------------------------------------------- plain data


def plain(value: Any, name: str = "") -> Any:
    """kio entities -> dicts/lists/ints/strs; record sets -> `describe_records`."""
    if name == "records":
        return describe_records(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name), f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return int(value.value)
    if isinstance(value, datetime.timedelta):
        return int(value / datetime.timedelta(milliseconds=1))
    if isinstance(value, datetime.datetime):
        return int(value.timestamp() * 1000)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


ZERO_UUID = str(uuid.UUID(int=0))


def normalise(data: Any, name: str = "", parent: dict[str, Any] | None = None) -> Any:
    """Replace the values that differ between any two healthy brokers (see NORMALISED)."""
    if isinstance(data, dict):
        out = {k: normalise(v, k, data) for k, v in data.items()}
        if "records_hex" in out and out.get("attributes", 0) & 0x08:
            out["max_timestamp"] = "<log-append-time>"
        if "records_hex" in out and out.get("attributes", 0) & 0x20:
            # a transaction marker: written by the broker at its own clock
            out["base_timestamp"] = out["max_timestamp"] = "<marker-time>"
        if "crc" in out and "crc_valid" in out:
            out["crc"] = "<crc>"
        if (
            name == ""
            and "name" in out
            and "value" in out
            and out["name"] in CONFIG_VALUES_THAT_DIFFER
            and out["value"] is not None
        ):
            out["value"] = "<machine-specific>"
        return out
    if isinstance(data, list):
        return [normalise(v, "", parent) for v in data]
    if name in ("throttle_time", "throttle_time_ms"):
        return "<throttle>"
    if name == "cluster_id" and data is not None:
        return "<cluster-id>"
    if name == "topic_id":
        # kio reads the all-zero UUID as None.
        return "<zero-uuid>" if data in (None, ZERO_UUID) else "<topic-id>"
    if name == "port" and parent is not None and "host" in parent:
        return "<port>"
    if name == "producer_id" and isinstance(data, int) and data >= 0:
        return "<producer-id>"
    if name == "error_message":
        return "<any>"
    if name == "documentation" and data is not None:
        return "<text>"
    if name in ("log_append_time", "log_append_time_ms") and data not in (None, -1):
        return "<log-append-time>"
    if name == "transaction_start_time" and isinstance(data, int) and data > 0:
        return "<transaction-start-time>"
    if name == "log_dir" and data is not None:
        return "<log-dir>"
    if name in ("total_bytes", "usable_bytes") and isinstance(data, int) and data >= 0:
        return "<disk-bytes>"
    return data


# ---------------------------------------------------------------------------- the script


@dataclass
class Exchange:
    step: str
    api: str
    version: int
    response: Any  # normalised plain data, or {"connection_closed": bool}


@dataclass
class Session:
    host: str
    port: int
    exchanges: list[Exchange] = field(default_factory=list)
    learned: dict[str, Any] = field(default_factory=dict)

    def client(self) -> RawClient:
        return RawClient(self.host, self.port)


def _record(
    s: Session,
    c: RawClient,
    step: str,
    api: str,
    version: int,
    body: dict[str, Any],
    *,
    retry_top_level: bool = False,
) -> Any:
    """Send, record the normalised answer, return the plain one.

    With `retry_top_level`, a retriable top-level error (a coordinator still loading, as
    Kafka's is right after start) is retried as a client would, and only the final
    answer is recorded.
    """
    deadline = time.monotonic() + 30
    while True:
        resp = c.call(api, version, body)
        raw = plain(resp)
        if not (retry_top_level and raw.get("error_code") in RETRIABLE):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    s.exchanges.append(Exchange(step, API_NAMES[resp.__api_key__], version, normalise(raw)))
    return raw


def _wait(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise OracleProtocolError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _metadata(c: RawClient, topics: list[str] | None) -> dict[str, Any]:
    body = {
        "topics": None if topics is None else [{"name": t} for t in topics],
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False,
    }
    return dict(plain(c.call("metadata", 12, body)))


def _topics_ready(c: RawClient, names: list[str]) -> bool:
    """Every partition has a leader in Metadata *and* that leader serves ListOffsets.

    Kafka publishes a new topic in its metadata before the partition's leader is ready
    (a Produce then gets NOT_LEADER_OR_FOLLOWER); neither check is recorded.
    """
    md = _metadata(c, names)
    parts: list[tuple[str, int, int]] = []
    for t in md["topics"]:
        if t["error_code"] != 0 or not t["partitions"]:
            return False
        if any(p["error_code"] != 0 or p["leader_id"] < 0 for p in t["partitions"]):
            return False
        parts += [(t["name"], p["partition_index"], -1) for p in t["partitions"]]
    lo = plain(c.call("list_offsets", 7, _list_offsets_body(parts)))
    return all(p["error_code"] == 0 for t in lo["topics"] for p in t["partitions"])


def _topics_gone(c: RawClient, names: list[str]) -> bool:
    md = _metadata(c, None)
    present = {t["name"] for t in md["topics"]}
    return not present & set(names)


TOPIC_A = "hk-oracle-a"  # 1 partition: the produce/fetch target
TOPIC_B = "hk-oracle-b"  # broker defaults (-1/-1), a config
TOPIC_C = "hk-oracle-c"  # 3 partitions, LogAppendTime
MISSING = "hk-oracle-missing"
AUTO_V1 = "hk-oracle-auto-v1"  # named in a Metadata v1 request: auto-created
RETRIABLE = frozenset(
    {14, 15, 16, 51}
)  # COORDINATOR_LOAD_IN_PROGRESS/NOT_AVAILABLE, NOT_COORDINATOR, CONCURRENT_TXNS


def _produce_body(topic: str, partition: int, batch: bytes, acks: int = -1) -> dict[str, Any]:
    return {
        "transactional_id": None,
        "acks": acks,
        "timeout": 30_000,
        "topic_data": [{"name": topic, "partition_data": [{"index": partition, "records": batch}]}],
    }


def _fetch_body(parts: list[tuple[str, int, int]], isolation: int = 0) -> dict[str, Any]:
    topics: dict[str, list[dict[str, Any]]] = {}
    for topic, partition, offset in parts:
        topics.setdefault(topic, []).append(
            {
                "partition": partition,
                "current_leader_epoch": -1,
                "fetch_offset": offset,
                "last_fetched_epoch": -1,
                "log_start_offset": -1,
                "partition_max_bytes": 1 << 20,
            }
        )
    return {
        "cluster_id": None,
        "replica_id": -1,
        "max_wait": 50,
        "min_bytes": 0,
        "max_bytes": 50 << 20,
        "isolation_level": isolation,
        "session_id": 0,
        "session_epoch": -1,
        "topics": [{"topic": t, "partitions": p} for t, p in topics.items()],
        "forgotten_topics_data": [],
        "rack_id": "",
    }


def _list_offsets_body(parts: list[tuple[str, int, int]], isolation: int = 0) -> dict[str, Any]:
    topics: dict[str, list[dict[str, Any]]] = {}
    for topic, partition, ts in parts:
        topics.setdefault(topic, []).append(
            {"partition_index": partition, "current_leader_epoch": -1, "timestamp": ts}
        )
    return {
        "replica_id": -1,
        "isolation_level": isolation,
        "topics": [{"name": t, "partitions": p} for t, p in topics.items()],
    }


def _api_versions_unsupported_frame(correlation_id: int, version: int = 127) -> bytes:
    """An ApiVersions request at a version no broker has: header v2, a v3-shaped body."""
    cid = CLIENT_ID.encode()
    body = struct.pack(">hhih", 18, version, correlation_id, len(cid)) + cid + b"\x00"
    name, ver = b"hk-oracle", b"1.0"
    body += bytes([len(name) + 1]) + name + bytes([len(ver) + 1]) + ver + b"\x00"
    return struct.pack(">i", len(body)) + body


def run_script(host: str, port: int) -> list[Exchange]:
    """Send the fixed request script to one broker (fresh, node id 1) and return it all."""
    s = Session(host, port)
    with s.client() as c:
        _script_api_versions(s, c)
    _script_unsupported_version_of_other_api(s)
    with s.client() as c:
        _script_topics_and_data(s, c)
    return s.exchanges


def _script_api_versions(s: Session, c: RawClient) -> None:
    _record(s, c, "api-versions-v0", "api_versions", 0, {})
    sw = {"client_software_name": "hk-oracle", "client_software_version": "1.0"}
    _record(s, c, "api-versions-v3", "api_versions", 3, sw)
    _record(s, c, "api-versions-v4", "api_versions", 4, sw)
    # An unknown ApiVersions version: the broker must answer with a v0 body (KIP-511).
    cid = c.next_id()
    c.send_raw(_api_versions_unsupported_frame(cid))
    got, resp = decode_response(c.read_frame(), 18, 0)
    if got != cid:
        raise OracleProtocolError(f"correlation id {got} != {cid}")
    s.exchanges.append(
        Exchange("api-versions-v127-unsupported", "ApiVersions", 127, normalise(plain(resp)))
    )
    # The connection stays usable after that.
    _record(s, c, "api-versions-v3-after-unsupported", "api_versions", 3, sw)


def _script_unsupported_version_of_other_api(s: Session) -> None:
    """Metadata v99: every other unsupported (api, version) closes the connection."""
    with s.client() as c:
        cid = c.next_id()
        cid_b = CLIENT_ID.encode()
        frame = struct.pack(">hhih", 3, 99, cid, len(cid_b)) + cid_b + b"\x00" + b"\x00\x00"
        c.send_raw(struct.pack(">i", len(frame)) + frame)
        closed = c.closed_by_peer()
    s.exchanges.append(
        Exchange("metadata-v99-unsupported", "Metadata", 99, {"connection_closed": closed})
    )


def _script_topics_and_data(s: Session, c: RawClient) -> None:
    # --- metadata on an empty cluster
    _record(s, c, "metadata-v1-all-empty-cluster", "metadata", 1, {"topics": None})
    _record(s, c, "metadata-v1-none", "metadata", 1, {"topics": []})

    # --- create topics: good ones and every validation error
    create = {
        "topics": [
            {"name": TOPIC_A, "num_partitions": 1, "replication_factor": 1, "assignments": [], "configs": []},
            {"name": TOPIC_B, "num_partitions": -1, "replication_factor": -1, "assignments": [],
             "configs": [{"name": "retention.ms", "value": "86400000"}]},
            {"name": TOPIC_C, "num_partitions": 3, "replication_factor": 1, "assignments": [],
             "configs": [{"name": "message.timestamp.type", "value": "LogAppendTime"}]},
            {"name": "hk-oracle/bad", "num_partitions": 1, "replication_factor": 1, "assignments": [], "configs": []},
            {"name": "hk-oracle-zero", "num_partitions": 0, "replication_factor": 1, "assignments": [], "configs": []},
            {"name": "hk-oracle-rf3", "num_partitions": 1, "replication_factor": 3, "assignments": [], "configs": []},
            {"name": "hk-oracle-badcfg", "num_partitions": 1, "replication_factor": 1, "assignments": [],
             "configs": [{"name": "no.such.config", "value": "1"}]},
            # A topic config Kafka has had since 3.8 (KIP-390).
            {"name": "hk-oracle-level", "num_partitions": 1, "replication_factor": 1, "assignments": [],
             "configs": [{"name": "compression.gzip.level", "value": "5"}]},
        ],
        "timeout": 30_000,
        "validate_only": False,
    }  # fmt: skip
    _record(s, c, "create-topics-v7", "create_topics", 7, create)
    _wait("topics ready", lambda: _topics_ready(c, [TOPIC_A, TOPIC_B, TOPIC_C]))
    again = {
        "topics": [
            {"name": TOPIC_A, "num_partitions": 1, "replication_factor": 1, "assignments": [], "configs": []},
            {"name": "hk-oracle-validate", "num_partitions": 2, "replication_factor": 1, "assignments": [], "configs": []},
        ],
        "timeout": 30_000,
        "validate_only": True,
    }  # fmt: skip
    _record(s, c, "create-topics-v7-exists-and-validate-only", "create_topics", 7, again)

    # --- metadata with topics
    md_all = {
        "topics": None,
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False,
    }
    _record(s, c, "metadata-v12-all", "metadata", 12, md_all)
    named = {
        "topics": [{"name": TOPIC_A}, {"name": TOPIC_C}, {"name": MISSING}],
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False,
    }
    raw = _record(s, c, "metadata-v12-named", "metadata", 12, named)
    s.learned["topic_ids"] = {t["name"]: t["topic_id"] for t in raw["topics"]}
    # Metadata v0-v3 always ask for auto-creation; the broker's default allows it.
    _record(
        s,
        c,
        "metadata-v1-auto-create",
        "metadata",
        1,
        {"topics": [{"name": TOPIC_A}, {"name": AUTO_V1}]},
    )
    _wait("auto-created topic ready", lambda: _topics_ready(c, [AUTO_V1]))
    _record(s, c, "metadata-v1-after-auto-create", "metadata", 1, {"topics": [{"name": AUTO_V1}]})

    # --- produce
    _record(s, c, "produce-v9-a0", "produce", 9, _produce_body(TOPIC_A, 0, script_batch()))
    _record(s, c, "produce-v9-a0-again", "produce", 9, _produce_body(TOPIC_A, 0, script_batch()))
    _record(
        s,
        c,
        "produce-v9-c1-log-append-time",
        "produce",
        9,
        _produce_body(TOPIC_C, 1, script_batch()),
    )
    _record(
        s,
        c,
        "produce-v9-unknown-partition",
        "produce",
        9,
        _produce_body(TOPIC_A, 7, script_batch()),
    )
    _record(
        s, c, "produce-v9-acks1", "produce", 9, _produce_body(TOPIC_C, 2, script_batch(), acks=1)
    )
    bad_crc = bytearray(script_batch())
    bad_crc[-1] ^= 0xFF
    _record(s, c, "produce-v9-bad-crc", "produce", 9, _produce_body(TOPIC_C, 0, bytes(bad_crc)))

    # --- idempotent produce
    init = {
        "transactional_id": None,
        "transaction_timeout": 60_000,
        "producer_id": -1,
        "producer_epoch": -1,
    }
    raw = _record(s, c, "init-producer-id-v4", "init_producer_id", 4, init, retry_top_level=True)
    pid, epoch = raw["producer_id"], raw["producer_epoch"]
    idem = script_batch(100, producer_id=pid, producer_epoch=epoch, base_sequence=0)
    _record(s, c, "produce-v9-idempotent", "produce", 9, _produce_body(TOPIC_A, 0, idem))
    _record(s, c, "produce-v9-idempotent-duplicate", "produce", 9, _produce_body(TOPIC_A, 0, idem))
    gap = script_batch(200, producer_id=pid, producer_epoch=epoch, base_sequence=10)
    _record(
        s, c, "produce-v9-idempotent-sequence-gap", "produce", 9, _produce_body(TOPIC_A, 0, gap)
    )

    # --- fetch
    _record(s, c, "fetch-v12-a0-from-0", "fetch", 12, _fetch_body([(TOPIC_A, 0, 0)]))
    _record(s, c, "fetch-v12-a0-mid-batch", "fetch", 12, _fetch_body([(TOPIC_A, 0, 4)]))
    _record(s, c, "fetch-v12-a0-at-end", "fetch", 12, _fetch_body([(TOPIC_A, 0, 9)]))
    _record(s, c, "fetch-v12-a0-out-of-range", "fetch", 12, _fetch_body([(TOPIC_A, 0, 100)]))
    _record(s, c, "fetch-v12-c-all", "fetch", 12,
            _fetch_body([(TOPIC_C, 0, 0), (TOPIC_C, 1, 0), (TOPIC_C, 2, 0)]))  # fmt: skip
    _record(s, c, "fetch-v12-unknown", "fetch", 12, _fetch_body([(TOPIC_A, 9, 0), (MISSING, 0, 0)]))
    _record(
        s, c, "fetch-v12-read-committed", "fetch", 12, _fetch_body([(TOPIC_A, 0, 0)], isolation=1)
    )

    # --- list offsets
    for label, ts in (
        ("latest", -1), ("earliest", -2), ("max-timestamp", -3), ("by-time", T0 + 10),
        ("by-time-before-all", T0 - 5), ("by-time-idempotent-batch", T0 + 105),
        ("by-time-after-all", T0 + 1_000_000),
    ):  # fmt: skip
        _record(
            s,
            c,
            f"list-offsets-v7-{label}",
            "list_offsets",
            7,
            _list_offsets_body([(TOPIC_A, 0, ts)]),
        )
    _record(s, c, "list-offsets-v7-read-committed", "list_offsets", 7,
            _list_offsets_body([(TOPIC_A, 0, -1), (TOPIC_C, 1, -1)], isolation=1))  # fmt: skip
    _record(s, c, "list-offsets-v7-unknown", "list_offsets", 7,
            _list_offsets_body([(TOPIC_A, 9, -1), (MISSING, 0, -1)]))  # fmt: skip

    # --- describe configs
    dc = {
        "resources": [
            {"resource_type": 2, "resource_name": TOPIC_A, "configuration_keys": None},
            {"resource_type": 2, "resource_name": TOPIC_C,
             "configuration_keys": ["message.timestamp.type", "retention.ms", "cleanup.policy"]},
            {"resource_type": 2, "resource_name": MISSING, "configuration_keys": None},
        ],
        "include_synonyms": True,
        "include_documentation": False,
    }  # fmt: skip
    _record(s, c, "describe-configs-v4-topics", "describe_configs", 4, dc)
    dcb = {
        "resources": [
            {"resource_type": 2, "resource_name": TOPIC_B, "configuration_keys": ["retention.ms", "segment.bytes"]},
            {"resource_type": 4, "resource_name": "1",
             "configuration_keys": ["message.max.bytes", "log.segment.bytes", "log.retention.hours",
                                    "auto.create.topics.enable", "default.replication.factor", "log.retention.ms"]},
        ],
        "include_synonyms": False,
        "include_documentation": True,
    }  # fmt: skip
    _record(s, c, "describe-configs-v4-broker-docs", "describe_configs", 4, dcb)

    # --- describe cluster
    _record(s, c, "describe-cluster-v1-brokers", "describe_cluster", 1,
            {"include_cluster_authorized_operations": False, "endpoint_type": 1})  # fmt: skip
    _record(s, c, "describe-cluster-v1-controllers", "describe_cluster", 1,
            {"include_cluster_authorized_operations": False, "endpoint_type": 2})  # fmt: skip

    # --- offset for leader epoch
    def oe(parts: list[tuple[str, int, int, int]]) -> dict[str, Any]:
        topics: dict[str, list[dict[str, Any]]] = {}
        for t, p, cur, ep in parts:
            topics.setdefault(t, []).append(
                {"partition": p, "current_leader_epoch": cur, "leader_epoch": ep}
            )
        return {
            "replica_id": -1,
            "topics": [{"topic": t, "partitions": p} for t, p in topics.items()],
        }

    _record(s, c, "offset-for-leader-epoch-v4", "offset_for_leader_epoch", 4,
            oe([(TOPIC_A, 0, 0, 0), (TOPIC_C, 1, -1, 0), (TOPIC_C, 2, 0, 3), (TOPIC_C, 0, 5, 0)]))  # fmt: skip
    _record(s, c, "offset-for-leader-epoch-v4-unknown", "offset_for_leader_epoch", 4,
            oe([(TOPIC_A, 9, -1, 0), (MISSING, 0, -1, 0)]))  # fmt: skip

    # --- delete topics, by name and by id
    dt = {
        "topics": [
            {"name": TOPIC_B, "topic_id": uuid.UUID(int=0)},
            {"name": None, "topic_id": uuid.UUID(s.learned["topic_ids"][TOPIC_C])},
            {"name": MISSING, "topic_id": uuid.UUID(int=0)},
            {"name": AUTO_V1, "topic_id": uuid.UUID(int=0)},
        ],
        "timeout": 30_000,
    }
    _record(s, c, "delete-topics-v6", "delete_topics", 6, dt)
    _wait("topics deleted", lambda: _topics_gone(c, [TOPIC_B, TOPIC_C, AUTO_V1]))
    _record(s, c, "metadata-v12-after-delete", "metadata", 12, md_all)


# ---------------------------------------------------------------------------- diffing

_KEYS = ("api_key", "name", "topic", "resource_name", "partition_index", "partition",
         "index", "node_id", "broker_id", "batch_index", "base_offset", "group_id", "key",
         "member_id")  # fmt: skip


def _key_of(*lists: list[Any]) -> str | None:
    """The field that identifies each struct uniquely within every one of `lists`, if any."""
    items = [x for xs in lists for x in xs]
    if not items or not all(isinstance(x, dict) for x in items):
        return None
    for k in _KEYS:
        if all(k in x for x in items) and all(
            len({repr(x[k]) for x in xs}) == len(xs) for xs in lists
        ):
            return k
    return None


@dataclass(frozen=True, eq=False)
class Difference:
    step: str
    api: str
    version: int
    path: str
    oracle: Any
    hyperkafka: Any

    def __str__(self) -> str:
        return (
            f"{self.api} v{self.version} [{self.step}] {self.path}: "
            f"kafka={_short(self.oracle)} hyperkafka={_short(self.hyperkafka)}"
        )


ABSENT = "<absent>"


def _short(v: Any, n: int = 160) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def diff(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, a value, b value) for every place where a and b differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else k
            if k not in a:
                yield sub, ABSENT, b[k]
            elif k not in b:
                yield sub, a[k], ABSENT
            else:
                yield from diff(a[k], b[k], sub)
        return
    if isinstance(a, list) and isinstance(b, list):
        key = _key_of(a, b)
        if key is not None:
            am = {x[key]: x for x in a}
            bm = {x[key]: x for x in b}
            for k in list(am) + [k for k in bm if k not in am]:
                sub = f"{path}[{k}]"
                if k not in am:
                    yield sub, ABSENT, bm[k]
                elif k not in bm:
                    yield sub, am[k], ABSENT
                else:
                    yield from diff(am[k], bm[k], sub)
            return
        if len(a) != len(b):
            yield f"{path}.length", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from diff(x, y, f"{path}[{i}]")
        return
    if a != b or type(a) is not type(b):
        yield path, a, b


MEMBER_ID_FIELDS = ("member_id", "leader")


def relabel_members(exchanges: list[Exchange]) -> list[Exchange]:
    """Member ids (client id + "-" + a random UUID on both brokers) replaced by
    `<member-N>`, N counting distinct ids in order of first appearance: what is compared
    is which member is which (the leader, who got what), not the random part."""
    labels: dict[str, str] = {}

    def walk(data: Any) -> Any:
        if isinstance(data, dict):
            return {
                k: (labels.setdefault(v, f"<member-{len(labels) + 1}>")
                    if k in MEMBER_ID_FIELDS and isinstance(v, str) and v else walk(v))
                for k, v in data.items()
            }  # fmt: skip
        if isinstance(data, list):
            return [walk(v) for v in data]
        return data

    return [dataclasses.replace(e, response=walk(e.response)) for e in exchanges]


def compare(kafka: list[Exchange], ours: list[Exchange]) -> list[Difference]:
    out: list[Difference] = []
    kafka, ours = relabel_members(kafka), relabel_members(ours)
    ours_by_step = {e.step: e for e in ours}
    for e in kafka:
        o = ours_by_step.get(e.step)
        if o is None:
            out.append(Difference(e.step, e.api, e.version, "<step>", "ran", "missing"))
            continue
        for path, x, y in diff(e.response, o.response):
            out.append(Difference(e.step, e.api, e.version, path, x, y))
    return out


# ---------------------------------------------------------------------------- FINDINGS.md


@dataclass(frozen=True)
class Finding:
    """One row of a FINDINGS.md table: which differences it covers, and why."""

    table: str  # "accepted" or "bug"
    api: str
    versions: str
    path: str
    reason: str
    line: int
    absent_in: str | None = None  # "kafka" or "hyperkafka": only where that side has none

    def matches(self, d: Difference) -> bool:
        """Same api (or `*`), version in range, path glob matches, and the side named by
        `where X=<absent>` (if any) has no value there.

        A path written `step:path` matches only the differences of that script step
        (the step names are those of `run_script`; `*` works in them too).
        """
        if self.api not in ("*", d.api):
            return False
        if not _version_matches(self.versions, d.version):
            return False
        if self.absent_in == "kafka" and d.oracle != ABSENT:
            return False
        if self.absent_in == "hyperkafka" and d.hyperkafka != ABSENT:
            return False
        subject = f"{d.step}:{d.path}" if ":" in self.path else d.path
        return _glob(self.path).fullmatch(subject) is not None


def _version_matches(spec: str, version: int) -> bool:
    if spec.strip() == "*":
        return True
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(lo) <= version <= int(hi):
                return True
        elif part and int(part) == version:
            return True
    return False


def _glob(pattern: str) -> re.Pattern[str]:
    """`[*]` matches one array key (one element, not what is below it); any other `*`
    matches anything (dots and brackets included); everything else is literal."""
    parts = []
    for i, piece in enumerate(pattern.split("[*]")):
        if i:
            parts.append(r"\[[^\]]*\]")
        parts.append(".*".join(re.escape(p) for p in piece.split("*")))
    return re.compile("".join(parts))


_SECTIONS = {"## accepted differences": "accepted", "## hyperkafka bugs": "bug"}


def load_findings(path: Path = FINDINGS_PATH) -> list[Finding]:
    """The rows of the two tables in FINDINGS.md: `| api | version | field path | reason |`.

    Rows belong to the table under "## Accepted differences" or "## hyperkafka bugs"; a
    path cell may be wrapped in backticks, may use `*` as a wildcard (`[*]`: one array
    key), and may end with `where kafka=<absent>` or `where hyperkafka=<absent>`.
    """
    findings: list[Finding] = []
    table: str | None = None
    for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        low = line.strip().lower()
        if low.startswith("## "):
            table = next((v for k, v in _SECTIONS.items() if low.startswith(k)), None)
            continue
        if table is None or not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0].lower() == "api" or set(cells[0]) <= set("-: "):
            continue
        api, versions, fpath = cells[0], cells[1], cells[2]
        absent_in = None
        if m := re.fullmatch(r"(.*?)\s+where\s+(kafka|hyperkafka)=<absent>", fpath):
            fpath, absent_in = m.group(1), m.group(2)
        reason = " | ".join(cells[3:])
        findings.append(Finding(table, api, versions, fpath.strip("`"), reason, n, absent_in))
    return findings


def explain(
    diffs: list[Difference], findings: list[Finding]
) -> list[tuple[Difference, Finding | None]]:
    """Each difference with the finding that covers it (None: unexplained).

    Bug rows are tried first, so that a broad accepted row cannot hide a known bug.
    """
    ordered = sorted(findings, key=lambda f: (f.table != "bug", f.line))
    return [(d, next((f for f in ordered if f.matches(d)), None)) for d in diffs]

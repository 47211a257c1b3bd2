"""`hyperkafka audit`: check what a node serves over Kafka against its writer's signatures.

A consumer of an untrusted node (a mirror, say) reads a topic through that node's Kafka
port and, for every stored batch it received, asks the HTTP listener of any node holding
the archive for Hypercore's inclusion proof of that block (broker/archive_json.py). Each
proof must verify against the writer's key (the archive key `hyperkafka keys` prints on the
writer, pinned with --archive-key, else taken from the first answer and printed: trust on
first use), prove exactly the bytes Fetch
returned, and the blocks must follow one another from the log start up to the signed
head: so nothing was altered, inserted or left out below that head. A node can still
withhold (serve an older head, or nothing); it cannot forge.

Blocking (sockets, urllib): a command-line tool, never imported by the server. Imports
the protocol codec for Fetch and ListOffsets, and `storage.hypercore` to verify.
"""

from __future__ import annotations

import base64
import itertools
import json
import socket
import struct
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from broker.config import parse_host_port
from broker.protocol.codec import decode_response, encode_request
from broker.protocol.header import RequestHeader
from broker.shape import shape
from storage.hypercore import HypercoreError, archive_key, leaf_hash
from storage.hypercore.proofs import Proof, verify_proof

FETCH_VERSION = 12
METADATA_VERSION = 12


class AuditFailed(Exception):
    """What was served does not match what the writer signed."""


@dataclass
class PartitionAudit:
    partition: int
    archive_key: str = ""
    batches: int = 0
    first_offset: int = -1
    next_offset: int = -1
    signed_length: int = 0
    problems: list[str] = field(default_factory=list)


class _Kafka:
    """One blocking Kafka connection, just enough for Metadata and Fetch."""

    def __init__(self, bootstrap: str, timeout: float) -> None:
        host, port = parse_host_port(bootstrap)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.ids = itertools.count(1)

    def call(self, api: str, key: int, version: int, body: dict[str, Any]) -> Any:
        import importlib

        module = importlib.import_module(f"kio.schema.{api}.v{version}.request")
        cls = getattr(module, "".join(p.title() for p in api.split("_")) + "Request")
        cid = next(self.ids)
        data = encode_request(
            RequestHeader(key, version, cid, "hyperkafka-audit"), shape(cls, body)
        )
        self.sock.sendall(data)
        (size,) = struct.unpack(">i", self._exact(4))
        got, response = decode_response(self._exact(size), key, version)
        if got != cid:
            raise AuditFailed(f"answer to request {got} while waiting for {cid}")
        return response

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise AuditFailed("the node closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


def _batches(records: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos + 12 <= len(records):
        size = 12 + struct.unpack_from(">i", records, pos + 8)[0]
        if pos + size > len(records):
            break  # a partial last batch (max_bytes): fetched again next time
        out.append(records[pos : pos + size])
        pos += size
    return out


def _proof(http: str, topic: str, partition: int, offset: int, timeout: float) -> dict[str, Any]:
    url = f"{http.rstrip('/')}/v1/partitions/{topic}/{partition}/proof?offset={offset}"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def audit_partition(
    kafka: _Kafka, http: str, topic: str, partition: int, pinned: str | None, timeout: float
) -> PartitionAudit:
    result = PartitionAudit(partition)
    offset: int | None = None
    expect_block: int | None = None
    hwm = 0
    while True:
        fetch = kafka.call(
            "fetch",
            1,
            FETCH_VERSION,
            {
                "replica_id": -1,
                "max_wait": 0,
                "min_bytes": 0,
                "max_bytes": 1 << 20,
                "isolation_level": 0,
                "session_id": 0,
                "session_epoch": -1,
                "forgotten_topics_data": [],
                "rack_id": "",
                "topics": [
                    {
                        "topic": topic,
                        "partitions": [
                            {
                                "partition": partition,
                                "fetch_offset": 0 if offset is None else offset,
                                "partition_max_bytes": 1 << 20,
                                "log_start_offset": -1,
                            }
                        ],
                    }
                ],
            },
        )
        p = fetch.responses[0].partitions[0]
        if offset is None:
            if p.error_code == 1:  # OFFSET_OUT_OF_RANGE at 0: start at the log start
                offset = int(p.log_start_offset)
                continue
            offset = int(p.log_start_offset) if p.log_start_offset >= 0 else 0
        if p.error_code != 0:
            raise AuditFailed(
                f"{topic}-{partition}: fetch at {offset} answered error {int(p.error_code)}"
            )
        hwm = int(p.high_watermark)
        batches = _batches(bytes(p.records or b""))
        if not batches:
            break
        for batch in batches:
            base = struct.unpack_from(">q", batch, 0)[0]
            last = base + struct.unpack_from(">i", batch, 23)[0]
            doc = _proof(http, topic, partition, max(base, offset), timeout)
            key = doc["archive_key"]
            public_key = bytes.fromhex(doc["writer_public_key"])
            if archive_key(public_key).hex() != key:
                raise AuditFailed(
                    f"{topic}-{partition}: public key {public_key.hex()} is not archive {key}'s"
                )
            if pinned is None:
                pinned = key
            if key != pinned:
                raise AuditFailed(f"{topic}-{partition}: archive {key} served, expected {pinned}")
            result.archive_key = key
            try:
                _, proof = Proof.decode(base64.b64decode(doc["proof"]))
                verified = verify_proof(
                    proof, public_key=public_key, key=bytes.fromhex(key), fork=int(doc["fork"])
                )
            except (HypercoreError, ValueError) as exc:
                raise AuditFailed(
                    f"{topic}-{partition} offset {base}: the proof does not verify: {exc}"
                ) from None
            if verified.proven is None or verified.proven.hash != leaf_hash(batch):
                raise AuditFailed(
                    f"{topic}-{partition} offset {base}: the batch served over Kafka is not the signed one"
                )
            block = int(doc["block_index"])
            if expect_block is not None and block != expect_block:
                raise AuditFailed(
                    f"{topic}-{partition} offset {base}: block {block} follows block "
                    f"{expect_block - 1}: batches were left out"
                )
            expect_block = block + 1
            result.signed_length = max(result.signed_length, int(doc["length"]))
            if result.first_offset < 0:
                result.first_offset = base
            result.batches += 1
            offset = last + 1
        result.next_offset = offset
        if offset >= hwm:
            break
    if (
        expect_block is not None
        and expect_block < result.signed_length
        and offset is not None
        and offset < hwm
    ):
        result.problems.append(f"served up to offset {offset}, below the high watermark {hwm}")
    return result


def audit(
    bootstrap: str,
    http: str,
    topic: str,
    *,
    archive_keys: dict[int, str] | None = None,
    timeout: float = 30.0,
) -> list[PartitionAudit]:
    """Audit every partition of `topic` as `bootstrap` serves it; AuditFailed at the first
    batch that does not match its writer's signed tree."""
    kafka = _Kafka(bootstrap, timeout)
    try:
        md = kafka.call(
            "metadata",
            3,
            METADATA_VERSION,
            {
                "topics": [{"name": topic, "topic_id": None}],
                "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False,
            },
        )
        t = md.topics[0]
        if t.error_code != 0:
            raise AuditFailed(f"{topic}: metadata answered error {int(t.error_code)}")
        keys = archive_keys or {}
        return [
            audit_partition(
                kafka, http, topic, p.partition_index, keys.get(p.partition_index), timeout
            )
            for p in sorted(t.partitions, key=lambda p: p.partition_index)
        ]
    finally:
        kafka.close()


def audit_command(bootstrap: str, http: str, topic: str, pinned: list[str]) -> int:
    keys: dict[int, str] = {}
    for item in pinned:
        part, _, key = item.partition("=")
        keys[int(part)] = key.lower()
    try:
        results = audit(bootstrap, http, topic, archive_keys=keys)
    except (AuditFailed, OSError, ValueError, KeyError, TypeError) as exc:
        # (a node answering malformed JSON or proofs fails the audit, it never crashes it)
        print(
            f"AUDIT FAILED: {exc!r}" if not isinstance(exc, AuditFailed) else f"AUDIT FAILED: {exc}"
        )
        return 1
    bad = False
    for r in results:
        trust = "pinned" if r.partition in keys else "trusted on first use"
        print(
            f"{topic}-{r.partition}: {r.batches} batches, offsets {r.first_offset}..{r.next_offset - 1} "
            f"match the writer's signed tree (length {r.signed_length}; archive {r.archive_key}, {trust})"
        )
        for problem in r.problems:
            bad = True
            print(f"  WARNING {problem}")
    return 1 if bad else 0

"""The node catalog: topics, partition counts, config overrides, topic ids, archive keys.

The catalog is itself a signed archive (`<data_dir>/__catalog`, fsync `always`), one
record batch per change whose single record value is a msgpack map (storage/FORMAT.md
section 7). Replaying it from block 0 rebuilds the state. May import the standard library,
msgpack and `storage.batch`, `storage.errors`; no file I/O of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from storage.batch import build_batch, record_values
from storage.errors import StorageError


@dataclass(frozen=True)
class TopicRecord:
    name: str
    topic_id: uuid.UUID
    partitions: int
    configs: Mapping[str, str] = field(default_factory=dict)  # overrides only
    archive_keys: tuple[bytes, ...] = ()


def encode_change(change: Mapping[str, Any], timestamp_ms: int) -> bytearray:
    return build_batch([msgpack.packb(dict(change), use_bin_type=True)], timestamp_ms=timestamp_ms)


def decode_changes(batch: bytes) -> list[dict[str, Any]]:
    out = []
    for value in record_values(batch):
        change = msgpack.unpackb(value, raw=False)
        if not isinstance(change, dict) or "op" not in change:
            raise StorageError("catalog entry is not a change map")
        out.append(change)
    return out


def apply_change(topics: dict[str, TopicRecord], change: Mapping[str, Any]) -> None:
    """Fold one change into `topics` (in place)."""
    op = change["op"]
    name = change["name"]
    if op == "create":
        topics[name] = TopicRecord(
            name=name,
            topic_id=uuid.UUID(bytes=bytes(change["topic_id"])),
            partitions=int(change["partitions"]),
            configs=dict(change["configs"]),
            archive_keys=tuple(bytes(k) for k in change["keys"]),
        )
    elif op == "configs":
        old = topics[name]
        topics[name] = TopicRecord(old.name, old.topic_id, old.partitions,
                                   dict(change["configs"]), old.archive_keys)
    elif op == "partitions":  # CreatePartitions: the count grows, the first keys stay
        old = topics[name]
        keys = tuple(bytes(k) for k in change["keys"])
        if int(change["partitions"]) <= old.partitions or keys[: old.partitions] != old.archive_keys:
            raise StorageError(f"catalog: partitions change of {name} does not extend it")
        topics[name] = TopicRecord(old.name, old.topic_id, int(change["partitions"]), old.configs, keys)
    elif op == "delete":
        topics.pop(name, None)
    else:
        raise StorageError(f"unknown catalog op {op!r}")

"""The classic consumer's embedded protocol (Kafka's ConsumerProtocol): the subscription a
member puts in its JoinGroup metadata and the assignment SyncGroup hands it, both
non-flexible and versioned (an int16 first).

    Subscription v0: topics [string], user_data bytes; v1+: owned_partitions
        [topic string, partitions [int32]]; v2+: generation_id int32; v3+: rack_id string
    Assignment v0+: assigned_partitions [topic string, partitions [int32]], user_data bytes

Used by the online migration between classic and consumer groups (KIP-848): a classic
group's members become consumer-group members with the partitions their assignment named,
and classic members of a consumer group are read from and answered in these formats.
Pure: only `ValueError` escapes a decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Subscription:
    topics: tuple[str, ...]
    owned: dict[str, frozenset[int]]  # empty before v1 (an eager member owns nothing at join)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def num(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("consumer protocol data cut short")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return int(value)

    def count(self) -> int:
        n = self.num(">i")
        if n < 0 or n > len(self.data) - self.pos:
            raise ValueError("bad array length in consumer protocol data")
        return n

    def string(self) -> str:
        n = self.num(">h")
        if n < 0 or self.pos + n > len(self.data):
            raise ValueError("bad string in consumer protocol data")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(str(exc)) from None

    def skip_bytes(self) -> None:
        n = self.num(">i")
        if n > 0:
            if self.pos + n > len(self.data):
                raise ValueError("bad bytes in consumer protocol data")
            self.pos += n

    def partitions(self) -> dict[str, frozenset[int]]:
        out: dict[str, frozenset[int]] = {}
        for _ in range(self.count()):
            topic = self.string()
            parts = frozenset(self.num(">i") for _ in range(self.count()))
            out[topic] = out.get(topic, frozenset()) | parts
        return {t: ps for t, ps in out.items() if ps}


def decode_subscription(data: bytes) -> Subscription:
    r = _Reader(data)
    version = r.num(">h")
    if version < 0:
        raise ValueError(f"subscription version {version}")
    topics = tuple(r.string() for _ in range(r.count()))
    r.skip_bytes()  # user data
    owned = r.partitions() if version >= 1 and r.pos < len(data) else {}
    return Subscription(topics, owned)


def decode_assignment(data: bytes) -> dict[str, frozenset[int]]:
    if not data:
        return {}  # a member the leader gave nothing
    r = _Reader(data)
    if r.num(">h") < 0:
        raise ValueError("negative assignment version")
    return r.partitions()


def encode_assignment(assignment: Mapping[str, frozenset[int]]) -> bytes:
    """ConsumerProtocolAssignment v0 (every client reads it), no user data."""
    out = bytearray(struct.pack(">hi", 0, len(assignment)))
    for topic in sorted(assignment):
        name = topic.encode("utf-8")
        ps = sorted(assignment[topic])
        out += struct.pack(">h", len(name)) + name + struct.pack(">i", len(ps))
        out += b"".join(struct.pack(">i", p) for p in ps)
    out += struct.pack(">i", -1)
    return bytes(out)

"""Test records: deterministic generation, the JSON-lines exchange format, exact comparison.

Owns what a "record" is for every client worker (Python, kcat, node): key, value, headers
and an optional timestamp, with null distinct from empty. Exchange format, one JSON object
a line: {"k": base64|null, "v": base64|null, "h": [[name, base64|null], ...], "ts": int|null}
and, for consumed records, "o": offset. Imports only the standard library.
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

Header = tuple[str, bytes | None]


@dataclass(frozen=True)
class Record:
    key: bytes | None
    value: bytes | None
    headers: tuple[Header, ...] = ()
    timestamp: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class Profile:
    """What a client can express, so generated data uses all of it and nothing more."""

    null_key: bool = True
    null_value: bool = True
    null_both: bool = True  # kafka-python refuses a record with neither key nor value
    empty_distinct: bool = True  # kcat -Z turns empty into null, so it cannot send b""
    headers: bool = True
    header_null_value: bool = False
    duplicate_header_names: bool = True
    fixed_headers: tuple[tuple[str, bytes], ...] | None = None  # kcat: same -H for all
    forbidden: frozenset[int] = field(default_factory=frozenset)  # kcat delimiter bytes
    timestamps: bool = False


def _payload(rng: random.Random, size: int, forbidden: frozenset[int]) -> bytes:
    data = bytearray(rng.randbytes(size))
    if forbidden:
        allowed = [b for b in range(256) if b not in forbidden]
        for i, b in enumerate(data):
            if b in forbidden:
                data[i] = allowed[b % len(allowed)]
    return bytes(data)


def _size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.002:
        return rng.randint(20_000, 60_000)  # a few large records cross batch boundaries
    if roll < 0.05:
        return rng.randint(1_000, 4_000)
    return rng.randint(1, 200)


def generate(n: int, profile: Profile, seed: int = 1, base_ts: int | None = None) -> list[Record]:
    """n records exercising null/empty/binary keys and values and headers, deterministically."""
    rng = random.Random(seed)
    out: list[Record] = []
    for i in range(n):
        # A readable, unique prefix makes a mismatch report point at the record at once.
        key: bytes | None = b"key-%07d-" % i + _payload(rng, rng.randint(0, 24), profile.forbidden)
        value: bytes | None = b"val-%07d|" % i + _payload(rng, _size(rng), profile.forbidden)
        if profile.null_key and i % 97 == 5:
            key = None
        if profile.null_value and i % 89 == 7:
            value = None
        if profile.null_both and i % 997 == 11:
            key = value = None
        if profile.empty_distinct and i % 83 == 3:
            value = b""
        if profile.empty_distinct and i % 79 == 4:
            key = b""
        if not profile.null_both and key is None and value is None:
            value = b"val-%07d|" % i
        headers: tuple[Header, ...] = ()
        if profile.fixed_headers is not None:
            headers = profile.fixed_headers
        elif profile.headers and i % 3 != 0:
            hs: list[Header] = []
            for j in range(rng.randint(1, 3)):
                name = f"hk-h{j}"
                if profile.duplicate_header_names and i % 7 == 1:
                    name = "hk-dup"
                hv: bytes | None = _payload(rng, rng.randint(0, 40), profile.forbidden)
                if profile.header_null_value and i % 11 == 2 and j == 0:
                    hv = None
                hs.append((name, hv))
            headers = tuple(hs)
        ts = (base_ts + i * 10) if (profile.timestamps and base_ts is not None) else None
        out.append(Record(key=key, value=value, headers=headers, timestamp=ts))
    return out


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def to_json(r: Record) -> str:
    obj: dict[str, object] = {
        "k": _b64(r.key),
        "v": _b64(r.value),
        "h": [[name, _b64(v)] for name, v in r.headers],
        "ts": r.timestamp,
    }
    if r.offset is not None:
        obj["o"] = r.offset
    return json.dumps(obj, separators=(",", ":"))


def from_json(line: str) -> Record:
    obj = json.loads(line)
    return Record(
        key=_unb64(obj.get("k")),
        value=_unb64(obj.get("v")),
        headers=tuple((str(name), _unb64(v)) for name, v in obj.get("h") or ()),
        timestamp=obj.get("ts"),
        offset=obj.get("o"),
    )


def write_jsonl(path: Path, records: Iterable[Record]) -> None:
    with path.open("w", encoding="ascii") as f:
        for r in records:
            f.write(to_json(r))
            f.write("\n")


def read_jsonl(path: Path) -> list[Record]:
    with path.open(encoding="ascii") as f:
        return [from_json(line) for line in f if line.strip()]


def iter_jsonl(path: Path) -> Iterator[Record]:
    with path.open(encoding="ascii") as f:
        for line in f:
            if line.strip():
                yield from_json(line)


def _show(r: Record) -> str:
    def short(b: bytes | None) -> str:
        if b is None:
            return "NULL"
        return repr(b[:40]) + (f"...({len(b)} bytes)" if len(b) > 40 else "")

    return f"offset={r.offset} key={short(r.key)} value={short(r.value)} headers={r.headers!r:.120}"


def assert_same(
    produced: list[Record],
    consumed: list[Record],
    *,
    base_offset: int = 0,
    check_headers: bool = True,
    check_timestamps: bool = False,
) -> None:
    """Byte-exact, in order, exactly once: consumed[i] is produced[i] at offset base+i."""
    problems: list[str] = []
    if len(consumed) != len(produced):
        problems.append(f"count: produced {len(produced)}, consumed {len(consumed)}")
    offsets = [r.offset for r in consumed]
    seen: set[int | None] = set()
    dups = [o for o in offsets if o in seen or seen.add(o)]  # type: ignore[func-returns-value]
    if dups:
        problems.append(f"duplicate offsets (first few): {dups[:5]}")
    for i, (p, c) in enumerate(zip(produced, consumed, strict=False)):
        want_offset = base_offset + i
        if c.offset != want_offset:
            problems.append(
                f"record {i}: offset {c.offset}, expected {want_offset} (gap or reorder)"
            )
            break
        same = p.key == c.key and p.value == c.value
        if check_headers:
            same = same and tuple(p.headers) == tuple(c.headers)
        if check_timestamps and p.timestamp is not None:
            same = same and p.timestamp == c.timestamp
        if not same:
            problems.append(f"record {i} differs:\n  produced {_show(p)}\n  consumed {_show(c)}")
            break
    if problems:
        raise AssertionError("records do not round-trip:\n" + "\n".join(problems))


# ---------------------------------------------------------------------------- batch sizes

# A v2 record batch before its records: base offset (8), length (4), partition leader epoch
# (4), magic (1), crc (4), attributes (2), last offset delta (4), base and max timestamp
# (8 + 8), producer id (8), producer epoch (2), base sequence (4), record count (4). The
# broker's max.message.bytes bounds the whole batch, these 61 bytes included.
BATCH_HEADER_BYTES = 61
MAX_MESSAGE_BYTES = 1048588  # the broker's default max.message.bytes, as Kafka's


def varint_size(n: int) -> int:
    """Bytes of n as a zigzag varint (Kafka's record fields)."""
    z = (n << 1) ^ (n >> 63)
    size = 1
    while z >= 0x80:
        z >>= 7
        size += 1
    return size


def _bytes_field(b: bytes | None) -> int:
    return varint_size(-1) if b is None else varint_size(len(b)) + len(b)


def single_record_batch_bytes(r: Record) -> int:
    """The size of an uncompressed v2 batch holding `r` alone, as a producer sends it.

    The only record of a batch has timestamp and offset deltas 0.
    """
    body = 1 + varint_size(0) + varint_size(0) + _bytes_field(r.key) + _bytes_field(r.value)
    body += varint_size(len(r.headers))
    for name, value in r.headers:
        body += _bytes_field(name.encode()) + _bytes_field(value)
    return BATCH_HEADER_BYTES + varint_size(body) + body


def record_of_batch_size(
    batch_bytes: int, profile: Profile, seed: int, *, printable: bool = False
) -> Record:
    """A record (null key, the profile's fixed headers if any) whose single-record batch is
    exactly `batch_bytes`; its value is seeded random bytes, or printable ASCII."""
    headers: tuple[Header, ...] = profile.fixed_headers or ()
    rng = random.Random(seed)
    size = batch_bytes - single_record_batch_bytes(Record(None, b"", headers))
    # Longer values need longer length varints: shrink until the batch is exact.
    while single_record_batch_bytes(Record(None, b"\0" * size, headers)) > batch_bytes:
        size -= 1
    if single_record_batch_bytes(Record(None, b"\0" * size, headers)) != batch_bytes:
        raise ValueError(f"no single-record batch is exactly {batch_bytes} bytes")
    if printable:
        alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 -_.:;,!?/"
        value = bytes(rng.choices(alphabet, k=size))
    else:
        value = _payload(rng, size, profile.forbidden)
    return Record(None, value, headers)

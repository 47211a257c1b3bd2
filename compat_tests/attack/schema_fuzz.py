"""A schema-driven request fuzzer over every API version a broker advertises.

Frame `i` of mutation class `c` under seed `s` is a pure function of (s, c, i) and the
advertised versions: a random valid request for the (api, version) `i` selects, drawn from
kio's schema (`schema.Gen`), encoded by kio (`codec.encode_request`; our span encoder must
give the same bytes), then mutated by the class:

    valid           unchanged (every valid request must be answered, not only survived)
    truncated       the body cut short (at a field edge or anywhere); the frame size agrees
    bit-flips       1-4 bits flipped, half of them in lengths, counts and integers
    lying-counts    an array count or string/bytes length replaced by a lie: compact
                    0xF0000000 / 2^32-1 / over-long varints, int32 2^31-1, int16 32767, -2
    nulls           a field the schema says is not nullable sent as null
    huge-strings    32,767-byte client ids, group ids, names (100 KiB where compact)
    unknown-tags    tagged fields the schema does not know, sized right, or lying, or
                    repeated, in the header's or any struct's tag section
    header-version  request header v0/v1/v2 where another is due; client-id length lies
    unknown-api     unknown api keys, versions outside the advertised range
    int-extremes    integers set to -1, min, max
    evil-names      names such as "..", "a/b", "", NUL, invalid UTF-8, 300 characters
    repeated-entries  one array entry (a topic, a partition, a group...) repeated 1,000,
                    20,000 or 100,000 times (1 MiB at most) in a request that stays valid

`Runner` sends frames on raw sockets from a few threads, each followed on the same
connection by an ApiVersions v0 probe: the probe's answer (or the connection closing) ends
the frame. A frame whose connection stays silent past `deadline` is a hang, except on the
long-poll APIs (Fetch, JoinGroup, SyncGroup), where it is counted as parked. Imports kio,
broker.protocol and the standard library.
"""

from __future__ import annotations

import collections
import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.protocol.codec import encode_request, request_schema
from broker.protocol.header import RequestHeader, request_header_version
from broker.protocol.versions import API_NAMES

from . import batches
from .schema import Gen, Span, encode_with_spans, frame, request_header, uvarint

CLASSES = (
    "valid",
    "truncated",
    "bit-flips",
    "lying-counts",
    "nulls",
    "huge-strings",
    "unknown-tags",
    "header-version",
    "unknown-api",
    "int-extremes",
    "evil-names",
    "repeated-entries",
)
LONG_POLL_APIS = frozenset({1, 11, 14})  # Fetch, JoinGroup, SyncGroup may wait legitimately
PROBE_ID = 0x7A7A0000


@dataclass(frozen=True)
class Target:
    api_key: int
    version: int

    @property
    def name(self) -> str:
        return f"{api_name(self.api_key) or f'api{self.api_key}'} v{self.version}"

    def flexible(self) -> bool:
        return request_header_version(self.api_key, self.version) >= 2


def targets_from(ranges: dict[int, tuple[int, int]]) -> list[Target]:
    return [Target(k, v) for k in sorted(ranges) for v in range(ranges[k][0], ranges[k][1] + 1)]


def targets_for(cls: str, ranges: dict[int, tuple[int, int]]) -> list[Target]:
    """The (api, version) pairs class `cls` goes round: tags exist in flexible versions only."""
    targets = targets_from(ranges)
    if cls == "unknown-tags":
        return [t for t in targets if t.flexible()] or targets
    return targets


@dataclass
class FuzzFrame:
    seed: int
    cls: str
    index: int
    api_key: int
    version: int
    data: bytes  # the whole frame, size prefix included
    note: str = ""
    must_answer: bool = False  # a request Kafka answers: closing the connection is a bug

    def describe(self) -> str:
        return (f"seed={self.seed} class={self.cls} index={self.index} api={self.api_key} "
                f"v{self.version} ({self.note}) frame={self.data.hex()}")  # fmt: skip


# ---------------------------------------------------------------- building one frame


FIXED_TS = 1_764_000_000_000  # frames must not depend on the clock: they are replayed


def _records(rng: random.Random) -> bytes:
    n = rng.randint(1, 3)
    return batches.batch(batches.records(n), n, base_ts=FIXED_TS)


def valid_body(target: Target, rng: random.Random) -> tuple[bytes, list[Span], bool, Any]:
    """(body, spans, flexible, entity) of a random valid request for target."""
    key, version = target.api_key, target.version
    strip = 0
    try:
        schema = request_schema(key, version)
    except KeyError:
        if key == 0 and version < 3:
            # Produce v0-2 = v3 without its leading nullable transactional id.
            schema, strip = request_schema(0, 3), 2
        else:
            raise
    entity = Gen(rng, _records).entity(schema)
    if strip:
        entity = type(entity)(**{**_fields(entity), "transactional_id": None})
    body, spans = encode_with_spans(entity)
    if not strip:
        # The frame is kio's; our encoder only tells where its fields lie.
        header = RequestHeader(key, version, 0, None)
        theirs = encode_request(header, entity)[
            4 + len(request_header(key, version, 0, None, request_header_version(key, version))) :
        ]
        if theirs != body:
            raise AssertionError(f"span encoder differs from kio for {target.name}")
    else:
        body = body[strip:]
        spans = [_shift(s, -strip) for s in spans if s.start >= strip]
    return body, spans, bool(schema.__flexible__), entity


def _fields(entity: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(entity, f.name) for f in dataclasses.fields(entity)}


def _shift(s: Span, d: int) -> Span:
    return Span(s.kind, s.start + d, s.prefix_end + d, s.content_end + d, s.compact, s.nullable,
                s.path, s.fmt)  # fmt: skip


@dataclass
class Draft:
    """A frame being mutated: header fields and body bytes with their spans."""

    target: Target
    body: bytearray
    spans: list[Span]
    flexible: bool
    api_key: int
    version: int
    client_id: bytes | None = b"hk-fuzz"
    header_version: int = 1
    header_raw: bytes | None = None  # replaces the header entirely when set
    well_formed: bool = False  # the mutation keeps the request valid (KIP-482 unknown tags)
    notes: list[str] = field(default_factory=list)

    def replace(self, start: int, end: int, new: bytes) -> None:
        """Replace body[start:end]: spans after it move, spans enclosing it grow or shrink,
        spans overlapping it (the one replaced, say) are dropped."""
        d = len(new) - (end - start)
        self.body[start:end] = new
        kept = []
        for s in self.spans:
            if s.content_end <= start:
                kept.append(s)
            elif s.start >= end:
                kept.append(_shift(s, d))
            elif s.prefix_end <= start and s.content_end >= end:
                kept.append(Span(s.kind, s.start, s.prefix_end, s.content_end + d, s.compact,
                                 s.nullable, s.path, s.fmt))  # fmt: skip
        self.spans = kept

    def build(self, correlation_id: int) -> bytes:
        header = self.header_raw
        if header is None:
            header = request_header(self.api_key, self.version, correlation_id, self.client_id,
                                    self.header_version)  # fmt: skip
        return frame(header + bytes(self.body))


def _pick(rng: random.Random, spans: Sequence[Span], kinds: Sequence[str]) -> Span | None:
    c = [s for s in spans if s.kind in kinds]
    return rng.choice(c) if c else None


def _m_truncated(d: Draft, rng: random.Random) -> None:
    edges = sorted({p for s in d.spans for p in (s.start, s.prefix_end, s.content_end - 1)
                    if 0 <= p < len(d.body)})  # fmt: skip
    cut = rng.choice(edges) if edges and rng.random() < 0.6 else rng.randrange(max(len(d.body), 1))
    d.notes.append(f"cut at {cut}/{len(d.body)}")
    del d.body[cut:]


def _m_bit_flips(d: Draft, rng: random.Random) -> None:
    if not d.body:
        d.body += b"\x00"
    for _ in range(rng.randint(1, 4)):
        s = _pick(rng, d.spans, ("array", "string", "bytes", "tags", "int"))
        if s is not None and rng.random() < 0.5:
            pos = rng.randrange(s.start, max(s.prefix_end, s.start + 1))
        else:
            pos = rng.randrange(len(d.body))
        pos = min(pos, len(d.body) - 1)
        d.body[pos] ^= 1 << rng.randrange(8)
        d.notes.append(f"flip@{pos}")


def _lie(s: Span, rng: random.Random) -> bytes:
    if s.compact:
        return rng.choice([
            uvarint(0xF0000000), uvarint(0xFFFFFFFF), uvarint(0x7FFFFFFF), uvarint(1 << 28),
            uvarint(0x10000), b"\xff\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x80\x80\x00",
            b"\xff\xff\xff\xff\x0f",
        ])  # fmt: skip
    if s.prefix_end - s.start == 2:
        return struct.pack(">h", rng.choice((32767, -2, -32768, 0x4000)))
    return struct.pack(">i", rng.choice((2**31 - 1, 0x10000000, -2, -(2**31), 0x0FFFFFFF)))


def _m_lying_counts(d: Draft, rng: random.Random) -> None:
    for _ in range(rng.choice((1, 1, 1, 2))):
        s = _pick(rng, d.spans, ("array", "string", "bytes", "tags"))
        if s is None:
            d.body += _lie(Span("array", 0, 0, 0, d.flexible, False, "tail"), rng)
            d.notes.append("lie appended")
            return
        lie = _lie(s, rng)
        d.notes.append(f"{s.path}: {s.kind} count/length := {lie.hex()}")
        d.replace(s.start, s.prefix_end, lie)


def _null_of(s: Span) -> bytes:
    if s.compact:
        return b"\x00"
    if s.kind == "string":
        return struct.pack(">h", -1)
    return struct.pack(">i", -1)


def _m_nulls(d: Draft, rng: random.Random) -> None:
    cands = [s for s in d.spans if s.kind in ("array", "string", "bytes") and not s.nullable]
    if not cands:
        _m_lying_counts(d, rng)
        return
    for s in sorted(rng.sample(cands, min(len(cands), rng.choice((1, 1, 2, 3)))),
                    key=lambda s: -s.start):  # fmt: skip
        if any(s is t for t in d.spans):
            d.notes.append(f"{s.path} := null")
            d.replace(s.start, s.content_end, _null_of(s))


def _string_of(s: Span, content: bytes) -> bytes:
    if s.compact:
        return uvarint(len(content) + 1) + content
    if s.kind == "string":
        return struct.pack(">h", len(content)) + content
    return struct.pack(">i", len(content)) + content


def _m_huge_strings(d: Draft, rng: random.Random) -> None:
    if rng.random() < 0.6:
        d.client_id = b"c" * 32767
        d.notes.append("client id of 32767 bytes")
    strs = [s for s in d.spans if s.kind == "string"]
    if not strs:
        return
    chosen = strs if rng.random() < 0.3 else [rng.choice(strs)]
    for s in sorted(chosen, key=lambda s: -s.start):
        n = 32767 if not s.compact else rng.choice((32767, 100_000))
        d.notes.append(f"{s.path} of {n} bytes")
        d.replace(s.start, s.content_end, _string_of(s, b"g" * n))


def _m_unknown_tags(d: Draft, rng: random.Random) -> None:
    tags = [s for s in d.spans if s.kind == "tags"]
    in_header = not tags or rng.random() < 0.3
    entries = []
    well_formed = rng.random() < 0.3
    tag = 9999
    for _ in range(rng.randint(1, 3)):
        payload = rng.randbytes(rng.choice((0, 1, 8, 64)))
        if well_formed:  # ascending tags no schema knows, sized right: must be skipped
            tag += rng.randint(1, 1000)
            size = len(payload)
        else:
            tag = rng.choice((9999, 2**31 - 1, 0x0FFFFFFF, 0, 1, 2, rng.randint(3, 200)))
            size = rng.choice((len(payload),) * 3 + (0xF0000000, len(payload) + 1000, 2**31 - 1))
        entries.append(uvarint(tag) + uvarint(size) + payload)
    count = len(entries)
    if not well_formed and rng.random() < 0.15:
        count = rng.choice((0xF0000000, 2**31 - 1, count + 5))
    d.well_formed = well_formed
    section = uvarint(count) + b"".join(entries)
    d.notes.append(f"{'header' if in_header else 'body'} tags: {section[:24].hex()}")
    if in_header:
        d.header_version = 2
        d.header_raw = (struct.pack(">hhi", d.api_key, d.version, 7)
                        + struct.pack(">h", 7) + b"hk-fuzz" + section)  # fmt: skip
        return
    s = rng.choice(tags)
    d.replace(s.start, s.content_end, section)


def _m_header_version(d: Draft, rng: random.Random) -> None:
    choices = [hv for hv in (0, 1, 2) if hv != d.header_version]
    d.header_version = rng.choice(choices)
    d.notes.append(f"header v{d.header_version}")
    if rng.random() < 0.3:
        lie = rng.choice((32767, -2, 1000))
        d.header_raw = (struct.pack(">hhi", d.api_key, d.version, 9)
                        + struct.pack(">h", lie) + b"hk")  # fmt: skip
        d.notes.append(f"client id length {lie}")


def _m_unknown_api(d: Draft, rng: random.Random, ranges: dict[int, tuple[int, int]]) -> None:
    if rng.random() < 0.5:
        unknown = [k for k in range(-2, 120) if k not in ranges] + [-32768, 32767, 1000]
        d.api_key = rng.choice(unknown)
        d.version = rng.choice((0, 1, 5, -1, 32767))
    else:
        lo, hi = ranges[d.target.api_key]
        d.version = rng.choice((lo - 1, hi + 1, hi + 3, -1, 32767, -32768))
    if rng.random() < 0.4:
        d.body = bytearray(rng.randbytes(rng.randint(0, 64)))
        d.spans = []
    d.notes.append(f"api {d.api_key} v{d.version}")


_EXTREMES = {
    ">b": (-1, -128, 127), ">h": (-1, -32768, 32767), ">i": (-1, -(2**31), 2**31 - 1),
    ">q": (-1, -(2**63), 2**63 - 1), ">B": (255,), ">H": (65535,), ">I": (2**32 - 1,),
    ">Q": (2**64 - 1,),
}  # fmt: skip


def _m_int_extremes(d: Draft, rng: random.Random) -> None:
    ints = [s for s in d.spans if s.kind == "int"]
    if not ints:
        _m_bit_flips(d, rng)
        return
    for s in rng.sample(ints, min(len(ints), rng.randint(1, 4))):
        v = rng.choice(_EXTREMES[s.fmt])
        d.body[s.start : s.prefix_end] = struct.pack(s.fmt, v)
        d.notes.append(f"{s.path}={v}")


EVIL_NAMES = (b"..", b".", b"", b"a/b", b"../../../tmp/x", b"\x00", b"\xff\xfe", b"x" * 300,
              b"__consumer_offsets/../x", b"\xc3\xa9t\xc3\xa9", b" ", b"CON", b"a" * 249)  # fmt: skip


def _m_evil_names(d: Draft, rng: random.Random) -> None:
    strs = [s for s in d.spans if s.kind == "string"]
    if not strs:
        _m_int_extremes(d, rng)
        return
    for s in sorted(rng.sample(strs, min(len(strs), rng.randint(1, 3))), key=lambda s: -s.start):
        name = rng.choice(EVIL_NAMES)
        d.notes.append(f"{s.path}={name[:12]!r}")
        d.replace(s.start, s.content_end, _string_of(s, name))


def _arrays(entity: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, first element) of every non-empty array in `entity`, nested ones too."""
    import dataclasses

    out = []
    for f in dataclasses.fields(entity):
        v = getattr(entity, f.name)
        if isinstance(v, tuple) and v:
            out.append(((*path, f.name), v[0]))
            if dataclasses.is_dataclass(v[0]):
                out += _arrays(v[0], (*path, f.name, "0"))
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out += _arrays(v, (*path, f.name))
    return out


def _replace_at(entity: Any, path: tuple[str, ...], value: Any) -> Any:
    import dataclasses

    head, rest = path[0], path[1:]
    if not rest:
        return dataclasses.replace(entity, **{head: value})
    child = getattr(entity, head)
    if rest[0] == "0":  # into the first element of an array
        first = _replace_at(child[0], rest[1:], value)
        return dataclasses.replace(entity, **{head: (first, *child[1:])})
    return dataclasses.replace(entity, **{head: _replace_at(child, rest, value)})


def _m_repeated_entries(d: Draft, rng: random.Random, entity: Any) -> None:
    """One entry (a topic, a partition, a group, a config name...) repeated thousands of
    times in a request that stays valid: answers must not grow with it unbounded. The
    entry is encoded once and its bytes repeated (at most 1 MiB of them)."""
    arrays = _arrays(entity)
    if not arrays:
        return  # nothing to repeat: the request goes as it is
    path, first = rng.choice(arrays)
    body, spans = encode_with_spans(_replace_at(entity, path, (first,)))
    name = type(entity).__name__ + "".join("[0]" if p == "0" else f".{p}" for p in path)
    span = next((sp for sp in spans if sp.kind == "array" and sp.path == name), None)
    if span is None:
        return
    element = body[span.prefix_end : span.content_end]
    n = min(rng.choice((1_000, 20_000, 100_000)), max(1, (1 << 20) // max(len(element), 1)))
    count = uvarint(n + 1) if span.compact else struct.pack(">i", n)
    d.body = bytearray(body[: span.start] + count + element * n + body[span.content_end :])
    d.spans = []
    d.notes.append(f"{name} x{n}")


MUTATORS: dict[str, Callable[[Draft, random.Random], None]] = {
    "valid": lambda d, rng: None,
    "truncated": _m_truncated,
    "bit-flips": _m_bit_flips,
    "lying-counts": _m_lying_counts,
    "nulls": _m_nulls,
    "huge-strings": _m_huge_strings,
    "unknown-tags": _m_unknown_tags,
    "header-version": _m_header_version,
    "int-extremes": _m_int_extremes,
    "evil-names": _m_evil_names,
}


def make_frame(seed: int, cls: str, index: int, ranges: dict[int, tuple[int, int]]) -> FuzzFrame:
    """Frame `index` of class `cls` under `seed`: deterministic given the ranges."""
    rng = random.Random(f"{seed}:{cls}:{index}")
    targets = targets_for(cls, ranges)
    target = targets[index % len(targets)]
    body, spans, flexible, entity = valid_body(target, rng)
    d = Draft(target, bytearray(body), spans, flexible, target.api_key, target.version,
              header_version=request_header_version(target.api_key, target.version))  # fmt: skip
    if target.api_key == 0:
        d.notes.append(f"acks={entity.acks}")
    if (
        target.api_key == 3
        and target.version < 12
        and any(t.name is None for t in entity.topics or ())
    ):
        d.notes.append(BY_ID_NOTE)
    if cls == "unknown-api":
        _m_unknown_api(d, rng, ranges)
    elif cls == "repeated-entries":
        _m_repeated_entries(d, rng, entity)
    else:
        MUTATORS[cls](d, rng)
    ff = FuzzFrame(seed, cls, index, d.api_key, d.version, d.build(index & 0x7FFFFFFF),
                   "; ".join(d.notes)[:300])  # fmt: skip
    ff.must_answer = (cls == "valid" or d.well_formed) and not may_close(ff)
    return ff


# ---------------------------------------------------------------- sending frames


def probe_frame(n: int) -> tuple[bytes, int]:
    """An ApiVersions v0 request (every broker answers it) and its correlation id."""
    cid = PROBE_ID | (n & 0xFFFF)
    body = struct.pack(">hhih", 18, 0, cid, 5) + b"probe"
    return struct.pack(">i", len(body)) + body, cid


@dataclass
class Stats:
    frames: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    valid_closed: collections.Counter[str] = field(default_factory=collections.Counter)
    valid_closed_frames: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    recent: collections.deque[FuzzFrame] = field(
        default_factory=lambda: collections.deque(maxlen=24)
    )
    in_flight: dict[int, FuzzFrame] = field(default_factory=dict)

    def per_api(self) -> dict[str, int]:
        return dict(sorted(self.frames.items(), key=lambda kv: -kv[1]))


class Runner:
    """Sends frames of the given classes from `threads` connections until `stop` is set or
    `seconds` pass; `on_tick` (called about twice a second from the calling thread) may
    raise to end the run (the guard's liveness and bound checks)."""

    def __init__(self, host: str, port: int, ranges: dict[int, tuple[int, int]], seed: int,
                 classes: Sequence[str], *, threads: int = 4, deadline: float = 10.0) -> None:  # fmt: skip
        self.host, self.port = host, port
        self.ranges = ranges
        self.seed = seed
        self.classes = list(classes)
        self.threads = threads
        self.deadline = deadline
        self.stats = Stats()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._next = 0
        self.errors: list[str] = []

    def _take(self) -> tuple[str, int]:
        with self.lock:
            i = self._next
            self._next += 1
        return self.classes[i % len(self.classes)], i // len(self.classes)

    def run(self, seconds: float, on_tick: Callable[[], None] | None = None) -> Stats:
        workers = [threading.Thread(target=self._work, args=(w,), daemon=True)
                   for w in range(self.threads)]  # fmt: skip
        for w in workers:
            w.start()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not self.stop.is_set():
                time.sleep(0.5)
                if on_tick is not None:
                    on_tick()
        finally:
            self.stop.set()
            for w in workers:
                w.join(self.deadline + 5)
        return self.stats

    def _work(self, worker: int) -> None:
        sock: socket.socket | None = None
        n = 0
        try:
            while not self.stop.is_set():
                cls, index = self._take()
                ff = make_frame(self.seed, cls, index, self.ranges)
                if sock is None:
                    try:
                        sock = socket.create_connection((self.host, self.port), timeout=5)
                    except OSError as exc:
                        with self.lock:
                            self.stats.outcomes["connect-failed"] += 1
                            self.errors.append(f"connect failed: {exc}")
                        time.sleep(0.2)
                        continue
                with self.lock:
                    self.stats.in_flight[worker] = ff
                    self.stats.recent.append(ff)
                    self.stats.frames[_api_label(ff)] += 1
                probe, cid = probe_frame(n)
                n += 1
                outcome = _exchange(sock, ff.data + probe, cid, self.deadline)
                if outcome == "hung" and ff.api_key in LONG_POLL_APIS:
                    outcome = "parked"
                with self.lock:
                    self.stats.outcomes[f"{cls}:{outcome}"] += 1
                    self.stats.in_flight.pop(worker, None)
                    if outcome == "hung":
                        self.stats.hangs.append(ff.describe())
                    if ff.must_answer and outcome == "closed":
                        self.stats.valid_closed[_api_label(ff)] += 1
                        if len(self.stats.valid_closed_frames) < 20:
                            self.stats.valid_closed_frames.append(ff.describe())
                if outcome != "answered":
                    sock.close()
                    sock = None
        finally:
            if sock is not None:
                sock.close()


BY_ID_NOTE = "topic by id below Metadata v12"


def may_close(ff: FuzzFrame) -> bool:
    """Requests the schema allows that a broker may still answer by closing: Produce v0-2
    (advertised for old librdkafka, then refused, as Kafka 4 does), a failed Produce with
    acks=0 (the only way to tell that producer), and Metadata v10-11 naming a topic by id
    only (Kafka's KafkaApis throws InvalidRequestException: names may not be null below v12,
    and the answer of those versions cannot carry a null name)."""
    if ff.api_key == 3:
        return BY_ID_NOTE in ff.note
    return ff.api_key == 0 and (ff.version < 3 or "acks=0" in ff.note)


def api_name(key: int) -> str | None:
    from kio.schema.index import api_key_map

    if key in API_NAMES:
        return API_NAMES[key]
    known = api_key_map.get(key)
    return "".join(w.title() for w in known.split("_")) if known else None


def _api_label(ff: FuzzFrame) -> str:
    name = api_name(ff.api_key)
    return f"{name} v{ff.version}" if name else f"unknown api {ff.api_key}"


def _exchange(sock: socket.socket, data: bytes, probe_id: int, deadline: float) -> str:
    """Send, then read frames until the probe's answer ("answered"), EOF ("closed") or the
    deadline ("hung")."""
    end = time.monotonic() + deadline
    try:
        sock.settimeout(deadline)
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return "closed"
    except TimeoutError:
        return "hung"  # the broker stopped reading: its socket buffer is full
    buf = bytearray()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return "hung"
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return "hung"
        except (ConnectionResetError, OSError):
            return "closed"
        if not chunk:
            return "closed"
        buf += chunk
        while len(buf) >= 8:
            (size,) = struct.unpack_from(">i", buf)
            if len(buf) < 4 + size:
                break
            (cid,) = struct.unpack_from(">i", buf, 4)
            del buf[: 4 + size]
            if cid == probe_id:
                return "answered"


def replay(host: str, port: int, data: bytes, deadline: float = 10.0) -> str:
    """Send one frame (hex from a failure report) and a probe; the outcome."""
    probe, cid = probe_frame(0)
    with socket.create_connection((host, port), timeout=5) as s:
        return _exchange(s, data + probe, cid, deadline)


# ---------------------------------------------------------------- a campaign under a guard


@dataclass
class Campaign:
    """What one fuzz run found: counts, and the failure with the frame that caused it."""

    seed: int
    classes: list[str]
    stats: Stats
    failure: str | None = None
    culprit: FuzzFrame | None = None
    suspects: list[FuzzFrame] = field(default_factory=list)

    def frames_sent(self) -> int:
        return sum(self.stats.frames.values())

    def summary(self) -> str:
        per_api = collections.Counter[str]()
        for label, n in self.stats.frames.items():
            per_api[label.rsplit(" v", 1)[0]] += n
        lines = [
            f"seed {self.seed}, classes {','.join(self.classes)}: {self.frames_sent()} frames "
            f"over {len(self.stats.frames)} api versions",
            "frames per api: " + ", ".join(f"{k} {v}" for k, v in per_api.most_common()),
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.stats.outcomes.items())),
        ]
        if self.stats.hangs:
            lines.append(f"hangs: {len(self.stats.hangs)}, first: {self.stats.hangs[0][:600]}")
        if self.stats.valid_closed:
            lines.append(f"valid requests answered by a close: {dict(self.stats.valid_closed)}; "
                         f"first: {self.stats.valid_closed_frames[0][:600]}")  # fmt: skip
        if self.failure:
            lines.append(f"FAILURE: {self.failure.splitlines()[0]}")
            if self.culprit is not None:
                lines.append(f"the frame that does it on a fresh broker: {self.culprit.describe()}")
            else:
                lines.append(
                    "no single frame reproduces it on a fresh broker; the last frames sent:"
                )
                lines += [f"  {ff.describe()[:2000]}" for ff in self.suspects[-8:]]
            lines.append(
                f"replay: scripts/fuzz --replay <frame hex>   "
                f"rerun: scripts/fuzz --seed {self.seed} --class {','.join(self.classes)}"
            )
        return "\n".join(lines)


def find_culprit(frames: Sequence[FuzzFrame], start_broker: Callable[[], Any]) -> FuzzFrame | None:
    """Replay `frames` newest first, each on a fresh broker (`start_broker()` returns a
    started harness.Broker), and return the first that kills it."""
    for ff in reversed(frames):
        b = start_broker()
        try:
            with contextlib.suppress(OSError):
                replay(b.host, b.port, ff.data, deadline=5.0)
            time.sleep(0.3)
            if b.proc is not None and b.proc.poll() is not None:
                return ff
        finally:
            b.kill()
    return None

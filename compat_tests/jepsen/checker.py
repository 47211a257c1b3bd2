"""Verdicts over a nemesis run's histories: pure functions, no I/O.

Owns the checks and the unavailability table. Each check returns a list of violations
(human-readable strings, empty when the property held), so a report can list all of them:

* `lost_writes`: every acknowledged send is in the final read-back, at the offset and in
  the partition its acknowledgement named.
* `duplicates`: the producers are idempotent, so no value is read back twice.
* `two_writers`: no two acknowledged sends share a (partition, offset); and offsets
  respect real time: a send acknowledged before another was sent has the lower offset
  (one writer per partition appends in order; two writers each counting from their own
  end break one or the other).
* `lost_commits` (committed offsets, from the per-broker probe): a successful OffsetFetch
  never returns less than a commit acknowledged before the fetch was sent (commit values
  grow with real time, so a lower value is a lost or backwards commit); and the final
  committed offset is at least the last acknowledged one. The same final rule for the
  real consumer groups.
* `two_coordinators`: a round of the probe sends one OffsetCommit to every broker at once,
  and starts only after the previous round ended. If brokers X and Y both accepted a
  commit in round k and again in round k+1, two coordinators accepted at once: by the
  end of round k, Y had been elected; X's acceptance in round k+1 came after that, so a
  fenced coordinator would have refused it.
* `topics_agree`: every acknowledged CreateTopics is in every broker's final Metadata, and
  every topic any two brokers list has the same leader for each partition in both.
* `recovered`: after the last heal and a recovery time, each kind of client succeeds again.
* `unavailability`: per fault, the longest stretch without a successful send, without a
  successful commit (real groups) and without a successful CreateTopics (the admin), from
  the fault's start until the next fault (the last one: until the clients stop). A fault
  aimed at partition leaders names the partitions its victim led (`Fault.partitions`):
  its produce gap counts only sends to those.
* `failover_bound`: after each fault aimed at partition leaders, the producers write
  those partitions again within the bound (the session timeout plus a margin): its
  produce gap is at most that.

Quorum-signed partitions (the copies each broker holds, compat_tests/jepsen/archives.py):

* `quorum_heads_agree`: every copy verifies against its manifest (a quorum of its
  signers), and of any two copies of a partition whose heads are of one fork, the
  shorter one's leaves are a prefix of the longer one's (two quorum-signed heads that
  disagree within a fork are equivocation).
* `copies_follow_final_fork`: after the heal every broker holds a copy of every
  partition, on its final fork (a deposed leader follows the new fork).
* `acked_in_final_fork`: every acknowledged send lies, at its offset, under a
  quorum-signed head of the partition's final fork (the highest fork any copy's head
  has).

May import only the standard library.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Event = Mapping[str, Any]
NONE = 0  # Kafka's error code for success


def lost_writes(sends: Iterable[Event], final: Mapping[int, Mapping[int, str]]) -> list[str]:
    """`final`: partition -> offset -> value, read back after the heal."""
    out = []
    stored = {p: set(records.values()) for p, records in final.items()}
    for e in sends:
        if e["op"] != "send" or not e["ok"]:
            continue
        if e["offset"] is None:
            # Acknowledged without an offset: librdkafka reports a retry the broker knew
            # as a duplicate (DUPLICATE_SEQUENCE_NUMBER) so. It must be there, somewhere.
            if e["value"] not in stored.get(e["partition"], set()):
                out.append(
                    f"acknowledged {e['value']!r} (no offset) is not in partition {e['partition']}"
                )
            continue
        got = final.get(e["partition"], {}).get(e["offset"])
        if got != e["value"]:
            out.append(
                f"acknowledged {e['value']!r} at partition {e['partition']} offset {e['offset']}"
                f" (acked at t={e['t1']:.3f}) is {'missing' if got is None else repr(got)} after the heal"
            )
    return out


def duplicates(final: Mapping[int, Mapping[int, str]]) -> list[str]:
    """Idempotent producers: no value is stored twice (a retried batch is not appended again)."""
    where: dict[str, tuple[int, int]] = {}
    out = []
    for part, records in sorted(final.items()):
        for off, value in sorted(records.items()):
            if value in where:
                out.append(
                    f"{value!r} stored twice: partition {where[value][0]} offset {where[value][1]}"
                    f" and partition {part} offset {off}"
                )
            else:
                where[value] = (part, off)
    return out


def two_writers(sends: Iterable[Event]) -> list[str]:
    out = []
    by_part: dict[int, list[Event]] = defaultdict(list)
    for e in sends:
        if e["op"] == "send" and e["ok"] and e["offset"] is not None:
            by_part[e["partition"]].append(e)
    for part, acked in sorted(by_part.items()):
        seen: dict[int, Event] = {}
        for e in acked:
            other = seen.get(e["offset"])
            if other is not None and other["value"] != e["value"]:
                out.append(
                    f"partition {part} offset {e['offset']} acknowledged for two values: "
                    f"{other['value']!r} and {e['value']!r}"
                )
            seen[e["offset"]] = e
        # Real-time order: scan by send time, remembering the highest offset acknowledged
        # before each send began.
        by_t1 = sorted(acked, key=lambda e: e["t1"])
        i, best = 0, None
        for e in sorted(acked, key=lambda e: e["t0"]):
            while i < len(by_t1) and by_t1[i]["t1"] < e["t0"]:
                if best is None or by_t1[i]["offset"] > best["offset"]:
                    best = by_t1[i]
                i += 1
            if best is not None and e["offset"] < best["offset"]:
                out.append(
                    f"partition {part}: {e['value']!r} sent at t={e['t0']:.3f} got offset {e['offset']}, "
                    f"below {best['value']!r} at offset {best['offset']} acknowledged before (t={best['t1']:.3f})"
                )
    return out


def lost_commits(probe: Iterable[Event], final: int | None) -> list[str]:
    """One probe group's history; `final` is its committed offset read after the heal."""
    events = list(probe)
    commits = sorted(
        (e for e in events if e["op"] == "pcommit" and e["error"] == NONE), key=lambda e: e["t1"]
    )
    fetches = sorted(
        (e for e in events if e["op"] == "pfetch" and e["error"] == NONE), key=lambda e: e["t0"]
    )
    out = []
    i, best = 0, None
    for f in fetches:
        while i < len(commits) and commits[i]["t1"] < f["t0"]:
            if best is None or commits[i]["value"] > best["value"]:
                best = commits[i]
            i += 1
        if best is not None and f["value"] < best["value"]:
            out.append(
                f"broker {f['broker']} answered OffsetFetch at t={f['t0']:.3f} with {f['value']}, "
                f"below {best['value']} committed on broker {best['broker']} at t={best['t1']:.3f}"
            )
    if commits:
        top = max(commits, key=lambda e: e["value"])
        if final is None or final < top["value"]:
            out.append(
                f"after the heal the committed offset is {final}, below {top['value']} "
                f"acknowledged by broker {top['broker']} at t={top['t1']:.3f}"
            )
    return out


def group_commits_kept(commits: Iterable[Event], final: Mapping[int, int | None]) -> list[str]:
    """A real consumer group's acknowledged commits against its committed offsets read after
    the heal (partition -> offset). The group's only member commits its position, which
    only grows unless the group lost a commit and re-read from an older one."""
    top: dict[int, tuple[int, float]] = {}
    for e in commits:
        if e["op"] == "commit" and e["ok"]:
            for p, o in e["offsets"].items():
                p = int(p)
                if p not in top or o > top[p][0]:
                    top[p] = (o, e["t1"])
    return [
        f"group {p}: committed offset after the heal is {final.get(p)}, below {o} acknowledged at t={t:.3f}"
        for p, (o, t) in sorted(top.items())
        if (final.get(p) or -1) < o
    ]


def two_coordinators(probe: Iterable[Event]) -> list[str]:
    """The broadcast probe group's history."""
    accepted: dict[int, set[int]] = defaultdict(set)
    for e in probe:
        if e["op"] == "pcommit" and e["error"] == NONE:
            accepted[e["round"]].add(e["broker"])
    out = []
    for rnd in sorted(accepted):
        both = accepted[rnd] & accepted.get(rnd + 1, set())
        if len(both) >= 2:
            out.append(
                f"brokers {sorted(both)} each accepted the group's commits in rounds {rnd} and {rnd + 1}"
            )
    return out


def topics_agree(
    creates: Iterable[Event], views: Mapping[int, Mapping[str, Mapping[int, int]] | None]
) -> list[str]:
    """`views`: broker -> topic -> partition -> leader, from each broker's final Metadata.
    Acknowledged topics must be in every view; any topic in two views must have the same
    leaders in both (an auto-created topic whose creation was never acknowledged too)."""
    out = []
    first: dict[str, Event] = {}  # a topic named through several brokers is checked once
    for c in creates:
        if c["op"] == "create" and c["ok"]:
            first.setdefault(c["topic"], c)
    seen = {t for view in views.values() if view is not None for t in view}
    checked: list[tuple[str, Event | None]] = [*first.items()]
    checked += [(t, None) for t in sorted(seen - set(first))]
    for t, e in checked:
        leaders: dict[str, list[int]] = defaultdict(list)
        for broker, view in sorted(views.items()):
            if view is None or t not in view:
                if e is None:
                    continue  # a topic nobody was told exists: it need not be everywhere yet
                out.append(
                    f"topic {t} (created at t={e['t1']:.3f}) missing from broker {broker}'s Metadata"
                )
                continue
            leaders[repr(sorted(view[t].items()))].append(broker)
        if len(leaders) > 1:
            out.append(
                f"topic {t}: brokers disagree on its leaders: "
                + "; ".join(f"{k} by {v}" for k, v in leaders.items())
            )
    return out


def recovered(events: Iterable[Event], op: str, since: float, what: str) -> list[str]:
    """Liveness after the last heal: some `op` succeeded after `since`."""
    if any(e["op"] == op and e["ok"] and e["t1"] > since for e in events):
        return []
    return [f"no successful {what} after t={since:.3f} (the last heal plus the recovery time)"]


@dataclass
class Fault:
    name: str
    start: float
    healed: float  # when the nemesis undid it
    end: float  # the next fault's start, or the end of the run
    partitions: list[int] | None = None  # those its victim led, for a fault aimed at leaders


def longest_gap(times: Sequence[float], start: float, end: float) -> float:
    """Longest stretch of [start, end] with no time of `times` in it."""
    inside = sorted(t for t in times if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in itertools.pairwise(edges))


def unavailability(
    faults: Sequence[Fault],
    sends: Iterable[Event],
    commits: Iterable[Event],
    creates: Iterable[Event] = (),
) -> list[dict[str, Any]]:
    ok_sends = [(e["t1"], e["partition"]) for e in sends if e["op"] == "send" and e["ok"]]
    ok_commits = [e["t1"] for e in commits if e["op"] == "commit" and e["ok"]]
    ok_creates = [e["t1"] for e in creates if e["op"] == "create" and e["ok"]]
    return [
        {
            "fault": f.name,
            "at_t": round(f.start, 1),  # the clock of the histories, to place violations
            "held_s": round(f.healed - f.start, 1),
            "produce_gap_s": round(
                longest_gap(
                    [t for t, p in ok_sends if f.partitions is None or p in f.partitions],
                    f.start,
                    f.end,
                ),
                1,
            ),
            "commit_gap_s": round(longest_gap(ok_commits, f.start, f.end), 1),
            "create_topic_gap_s": round(longest_gap(ok_creates, f.start, f.end), 1),
        }
        for f in faults
    ]


def failover_bound(
    rows: Iterable[Mapping[str, Any]], faults: Sequence[Fault], bound: float
) -> list[str]:
    """`rows`: `unavailability(faults, ...)`. A fault aimed at leaders (with `partitions`)
    whose produce gap exceeds `bound` seconds is a violation."""
    return [
        f"{f.name} (at t={f.start:.1f}): no acknowledged send to partitions {f.partitions} "
        f"for {row['produce_gap_s']} s, more than {bound:.1f} s"
        for f, row in zip(faults, rows, strict=True)
        if f.partitions is not None and row["produce_gap_s"] > bound
    ]


def quorum_heads_agree(copies: Iterable[Event]) -> list[str]:
    """`copies`: every broker's copy of every partition (archives.read_copies): broker,
    partition, fork, length, leaves (one hash per block under the head), ok, why."""
    out = []
    by_part: dict[int, list[Event]] = defaultdict(list)
    for c in copies:
        if not c["ok"]:
            out.append(f"broker {c['broker']}'s copy of partition {c['partition']} does not "
                       f"verify: {c['why']} ({c['path']})")  # fmt: skip
            continue
        by_part[c["partition"]].append(c)
    for part, held in sorted(by_part.items()):
        for a, b in itertools.combinations(held, 2):
            if a["fork"] != b["fork"] or not a["length"] or not b["length"]:
                continue
            short, long = (a, b) if a["length"] <= b["length"] else (b, a)
            n = short["length"]
            if short["leaves"][:n] != long["leaves"][:n]:
                first = next(
                    (
                        i
                        for i, (x, y) in enumerate(
                            zip(short["leaves"], long["leaves"], strict=False)
                        )
                        if x != y
                    ),
                    min(len(short["leaves"]), len(long["leaves"])),
                )
                out.append(
                    f"partition {part} fork {a['fork']}: broker {short['broker']}'s head "
                    f"(length {n}) is not a prefix of broker {long['broker']}'s "
                    f"(length {long['length']}): they part at block {first}"
                )
    return out


def copies_follow_final_fork(
    copies: Iterable[Event], brokers: Iterable[int], partitions: Iterable[int]
) -> list[str]:
    """After the heal every broker holds a copy of every partition, on its final fork (a
    deposed leader, resumed or restarted, follows the new leader's fork and does not go
    on writing its own; a copy may lag in length, not in fork)."""
    good = [c for c in copies if c["ok"]]
    final: dict[int, int] = {}
    for c in good:
        final[c["partition"]] = max(final.get(c["partition"], -1), c["fork"])
    out = []
    for part in partitions:
        for b in brokers:
            held = [c for c in good if c["partition"] == part and c["broker"] == b]
            if not held:
                out.append(f"broker {b} holds no verified copy of partition {part}")
            elif all(c["fork"] != final[part] for c in held):
                out.append(
                    f"broker {b}'s copy of partition {part} is on fork "
                    f"{max(c['fork'] for c in held)}, not the final fork {final[part]}"
                )
    return out


def acked_in_final_fork(sends: Iterable[Event], copies: Iterable[Event]) -> list[str]:
    """Every acknowledged send is under a quorum-signed head of its partition's final fork
    (the copies' `records`: offset -> value under the head)."""
    final: dict[int, int] = {}
    held: dict[int, dict[int, str]] = defaultdict(dict)
    good = [c for c in copies if c["ok"] and c["length"]]
    for c in good:
        final[c["partition"]] = max(final.get(c["partition"], -1), c["fork"])
    for c in good:
        if c["fork"] == final[c["partition"]]:
            held[c["partition"]].update({int(o): v for o, v in c["records"].items()})
    out = []
    for e in sends:
        if e["op"] != "send" or not e["ok"]:
            continue
        records = held.get(e["partition"], {})
        where = f"partition {e['partition']}'s final fork ({final.get(e['partition'])})"
        if e["offset"] is None:
            if e["value"] not in records.values():
                out.append(f"acknowledged {e['value']!r} (no offset) is under no quorum-signed "
                           f"head of {where}")  # fmt: skip
        elif records.get(e["offset"]) != e["value"]:
            out.append(
                f"acknowledged {e['value']!r} at offset {e['offset']} (acked at t={e['t1']:.3f}) "
                f"is {records.get(e['offset'])!r} under the quorum-signed heads of {where}"
            )
    return out


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "(no faults)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(str(r[c]).ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(lines)

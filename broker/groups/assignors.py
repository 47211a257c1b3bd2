"""Server-side partition assignors of the KIP-848 consumer protocol: uniform and range.

An assignor is a pure function from the group's members (their subscriptions and current
target assignment) and the subscribed topics' metadata to a new target assignment. Kafka
4.x ships the same two (`group.consumer.assignors`, default "uniform,range"; a member
names one with `server_assignor`, else the first is used):

- uniform: spreads every subscribed partition so that members' counts differ by at most
  one among the members that could take it, and keeps each member's current partitions
  where that balance allows (sticky: a rebalance moves as few partitions as it can).
- range: per topic, the members subscribed to it sorted by member id, each given a
  contiguous range of partitions; the first `partitions % members` get one more. Members
  subscribed to the same topics get the same partition numbers of each (co-partitioning).
  Unlike Kafka's, not sticky: the ranges follow from the member ids alone.

Topics are keyed by topic id (a `uuid.UUID`), as Kafka's records and heartbeats are.
Imports only the standard library.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

# topic id -> partitions
Assignment = dict[uuid.UUID, frozenset[int]]


@dataclass(frozen=True)
class AssignorMember:
    member_id: str
    subscribed: frozenset[uuid.UUID]  # topic ids (already resolved from names and regex)
    current: Mapping[uuid.UUID, frozenset[int]]  # the member's present target assignment


class UnknownAssignor(ValueError):
    """A name not in group.consumer.assignors (Kafka: UNSUPPORTED_ASSIGNOR)."""


def uniform(
    members: list[AssignorMember], topics: Mapping[uuid.UUID, int]
) -> dict[str, Assignment]:
    """Balanced and sticky. `topics`: topic id -> partition count (topics that exist)."""
    ids = sorted(m.member_id for m in members)
    subscribed = {m.member_id: m.subscribed & topics.keys() for m in members}
    owned: dict[str, set[tuple[uuid.UUID, int]]] = {mid: set() for mid in ids}
    owner: dict[tuple[uuid.UUID, int], str] = {}
    # 1. Keep what each member had, if it still subscribes and the partition exists.
    for m in sorted(members, key=lambda m: m.member_id):
        for topic, parts in m.current.items():
            if topic not in subscribed[m.member_id]:
                continue
            for p in parts:
                tp = (topic, p)
                if 0 <= p < topics[topic] and tp not in owner:
                    owner[tp] = m.member_id
                    owned[m.member_id].add(tp)
    eligible: dict[uuid.UUID, list[str]] = {
        t: [mid for mid in ids if t in subscribed[mid]] for t in topics
    }
    # 2. Hand out the rest, the partitions with the fewest candidates first, each to the
    # candidate holding least.
    free = sorted(
        ((t, p) for t in topics for p in range(topics[t]) if (t, p) not in owner and eligible[t]),
        key=lambda tp: (len(eligible[tp[0]]), str(tp[0]), tp[1]),
    )
    for tp in free:
        mid = min(eligible[tp[0]], key=lambda m: (len(owned[m]), m))
        owner[tp] = mid
        owned[mid].add(tp)
    # 3. Balance: move a partition from a member to a candidate holding two fewer, until
    # no such move exists. Each move lowers the sum of squared counts, so this ends.
    moved = True
    while moved:
        moved = False
        for mid in sorted(ids, key=lambda m: (-len(owned[m]), m)):
            for tp in sorted(owned[mid], key=lambda tp: (str(tp[0]), -tp[1])):
                target = min(eligible[tp[0]], key=lambda m: (len(owned[m]), m))
                if len(owned[target]) < len(owned[mid]) - 1:
                    owned[mid].discard(tp)
                    owned[target].add(tp)
                    owner[tp] = target
                    moved = True
                    break
            if moved:
                break
    return {mid: _group(owned[mid]) for mid in ids}


def range_(members: list[AssignorMember], topics: Mapping[uuid.UUID, int]) -> dict[str, Assignment]:
    out: dict[str, dict[uuid.UUID, set[int]]] = {m.member_id: {} for m in members}
    for topic, count in topics.items():
        subscribers = sorted(m.member_id for m in members if topic in m.subscribed)
        if not subscribers:
            continue
        quota, extra = divmod(count, len(subscribers))
        start = 0
        for i, mid in enumerate(subscribers):
            n = quota + (1 if i < extra else 0)
            if n:
                out[mid][topic] = set(range(start, start + n))
            start += n
    return {mid: {t: frozenset(ps) for t, ps in a.items()} for mid, a in out.items()}


ASSIGNORS = {"uniform": uniform, "range": range_}


def assign(
    name: str, members: list[AssignorMember], topics: Mapping[uuid.UUID, int]
) -> dict[str, Assignment]:
    try:
        assignor = ASSIGNORS[name]
    except KeyError:
        raise UnknownAssignor(name) from None
    return assignor(members, topics)


def _group(tps: set[tuple[uuid.UUID, int]]) -> Assignment:
    out: dict[uuid.UUID, set[int]] = {}
    for t, p in tps:
        out.setdefault(t, set()).add(p)
    return {t: frozenset(ps) for t, ps in out.items()}

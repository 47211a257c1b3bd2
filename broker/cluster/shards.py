"""Sharded coordinators: a key -> a partition of an internal topic -> the broker coordinating it.

Owns the mapping Kafka uses for its internal topics (`partition_for`: the absolute value
of Java's ``String.hashCode`` of the group id, or the transactional id, modulo the
topic's partition count, as Kafka's GroupCoordinatorShard and TransactionStateManager),
`Shard` (the etcd record of one partition of an internal topic: the broker that
coordinates it, the broker whose offsets archive holds its latest state, and the record's
mod revision, which is that partition's epoch), `plan` (the controller's choice of
coordinators), `place_shards` (the controller's loop that records them in etcd) and
`follow_shards` (a coordinator's loop that takes over the partitions etcd names it and
gives up the others, for any `ShardHolder`: the group and the transaction coordinators).

Nothing here is specific to ``__consumer_offsets``: every function takes the topic name
and its partition count, so a transaction coordinator sharded by ``__transaction_state``
uses the same records (``internal/<topic>/<partition>`` in etcd) and the same loop.

Placement, as Kafka's controller places partition leaders: partition p prefers the broker
``known[p % len(known)]`` (every broker that ever registered, by id: the preferred
replica), and goes to the live broker coordinating the fewest partitions while that one is
dead; it moves back once the preferred broker is alive again (Kafka's
``auto.leader.rebalance.enable``, on by default). Every move is a transaction fenced by the
controller epoch and by each moved record's mod revision, so it never overwrites a change
it has not seen (a coordinator's claim, another controller's move).

The coordinator's side (broker/groups/coordinator.py, broker/transactions/coordinator.py):
`follow_shards` watches the records; the broker a record names `claim`s
it (a transaction comparing the revision it saw, which writes itself as the holder: a new
revision, its epoch), and every later act (a commit, a generation stored) is answered only
if a transaction comparing that revision succeeds (`Membership.check_shards`). The
controller moving the partition changes the revision: a paused or cut-off ex-coordinator
can then acknowledge nothing, and steps down when its transaction fails.

May import trio, `storage` (its error types), `broker.cluster.membership`,
`broker.cluster.etcd` and `broker.cluster.replicas` (for typing).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from broker.cluster.etcd import EtcdError
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.cluster.membership import Membership
    from broker.cluster.replicas import Cluster

log = logging.getLogger("hyperkafka.cluster")

PLACE_RETRY_S = 1.0  # after etcd failed, or to look again at time-only changes (a lease)
SHARDS_TICK_S = 0.1  # how often a coordinator looks at its partitions (a lease ends by time)
TAKEOVER_RETRY_S = 1.0  # after a takeover failed (its archive failed, say)
UNEXPECTED_RETRY_S = 10.0  # after it failed with an error none of the retriable ones
INT32_MIN = -(2**31)


def java_string_hash(s: str) -> int:
    """Java's ``String.hashCode``: s[0]*31^(n-1) + ... over UTF-16 code units, as an int32."""
    h = 0
    data = s.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(data), 2):
        h = (31 * h + (data[i] << 8 | data[i + 1])) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: str, partitions: int) -> int:
    """The partition of an internal topic of `partitions` partitions that `key` (a group id,
    a transactional id) maps to: Kafka's ``Utils.abs(key.hashCode()) % partitions``
    (``Utils.abs`` maps Integer.MIN_VALUE to 0)."""
    if partitions < 1:
        raise ValueError(f"an internal topic has at least one partition, not {partitions}")
    h = java_string_hash(key)
    return (0 if h == INT32_MIN else abs(h)) % partitions


@dataclass(frozen=True)
class Shard:
    """One partition of an internal topic, as etcd records it."""

    topic: str
    partition: int
    owner: int  # the broker that coordinates it (its leader)
    # The broker whose offsets archive holds this partition's latest state: the last
    # coordinator that loaded it (None: nobody yet). A new coordinator adopts from it.
    holder: int | None
    revision: int = 0  # the record's mod revision: this partition's epoch

    def encode(self) -> bytes:
        return json.dumps({"id": self.owner, "holder": self.holder}).encode()

    @classmethod
    def decode(cls, topic: str, partition: int, data: bytes, revision: int) -> Shard:
        d = json.loads(data)
        holder = d.get("holder")
        return cls(
            topic, partition, int(d["id"]), None if holder is None else int(holder), revision
        )


def plan(
    shards: Mapping[int, Shard],
    partitions: int,
    known: Sequence[int],
    live: Sequence[int],
    first_holder: int | None = None,
) -> dict[int, tuple[int, int | None]]:
    """The moves the controller makes now: partition -> (new owner, holder kept). A
    partition without a record, or whose owner is dead, goes to its preferred broker
    (``known[p % len(known)]``) when alive, else to the live broker owning the fewest; a
    partition away from its live preferred broker moves back to it. A partition placed
    for the first time gets `first_holder` as its holder (a cluster upgraded from
    unsharded groups: the broker whose archive holds them all)."""
    known = sorted(set(known) | set(live))
    live_set = set(live)
    if not live_set or not known:
        return {}
    load = Counter(s.owner for s in shards.values() if s.owner in live_set)
    moves: dict[int, tuple[int, int | None]] = {}
    for p in range(partitions):
        preferred = known[p % len(known)]
        current = shards.get(p)
        if (
            current is not None
            and current.owner in live_set
            and (current.owner == preferred or preferred not in live_set)
        ):
            continue
        owner = preferred if preferred in live_set else min(live_set, key=lambda i: (load[i], i))
        if current is not None and current.owner in live_set:
            load[current.owner] -= 1
        load[owner] += 1
        moves[p] = (owner, current.holder if current is not None else first_holder)
    return moves


async def place_shards(m: Membership, topic: str, partitions: int, *, legacy: bool = True) -> None:
    """The controller's loop for internal topic `topic` (run on every broker; it acts only
    while this broker is controller): record a coordinator for each of its partitions
    (`partitions` when the topic has none yet; afterwards the count etcd holds), and move
    those of dead brokers, as `plan` says. `legacy`: a partition placed for the first
    time gets `Membership.legacy_holder` as holder (groups of a cluster from before
    sharding; no such state exists for transactions)."""
    await m.ready.wait()
    while True:
        changed = m.changed
        if m.is_controller:
            current = dict(m.shards.get(topic, {}))
            count = max(current) + 1 if current else partitions
            known = sorted(set(m.known) | set(m.members) | {m.me.node_id})
            moves = plan(current, count, known, m.live_ids(), m.legacy_holder if legacy else None)
            if moves:
                try:
                    ok = await m.place_shards(topic, moves, current)
                except EtcdError as exc:
                    log.info("cluster: placing %s failed: %s; again", topic, exc)
                    ok = False
                if ok:
                    log.info(
                        "cluster: %s partitions placed: %s",
                        topic,
                        ", ".join(f"{p}->{o}" for p, (o, _) in sorted(moves.items())),
                    )
                    continue
        with trio.move_on_after(PLACE_RETRY_S):
            await changed.wait()


class TakeoverNotReady(Exception):
    """A takeover cannot adopt yet (no copy of the previous holder's archive here)."""


# What a takeover may meet that a later attempt can get past: no copy of the previous
# holder's archive yet, etcd not answering, our archive failing to take or make durable
# the adopted records in time. A holder adds its own (the node's TopicError, which this
# package may not import). Anything else is logged with its traceback and retried slowly (follow_shards).
TAKEOVER_ERRORS: tuple[type[Exception], ...] = (
    TakeoverNotReady,
    EtcdError,
    StorageError,
    OSError,
    trio.TooSlowError,
)


class ShardHolder(Protocol):
    """A coordinator sharded by an internal topic (groups, transactions): the partitions
    it serves (partition -> the revision it claimed it at), and how it takes some over
    and gives some up."""

    shards: dict[int, int]

    def resign(self, partitions: Iterable[int] | None = None) -> None: ...

    async def take_over(self, cluster: Cluster, wanted: dict[int, int]) -> bool: ...


def named_here(cluster: Cluster, topic: str) -> dict[int, int]:
    """Partitions of `topic` etcd names this broker coordinator of -> their record
    revision (none while our lease may have expired)."""
    if not cluster.membership.lease_valid():
        return {}
    return {p: s.revision for p, s in cluster.membership.shards.get(topic, {}).items() if s.owner == cluster.me}


def still_named(cluster: Cluster, topic: str, wanted: Mapping[int, int]) -> tuple[dict[int, int], dict[int, set[int]]]:
    """For a takeover of the partitions `wanted` of `topic` (partition -> the revision of
    the record naming us): those whose record still has that revision, and their
    previous holders other than us (holder -> its partitions), whose archives hold their
    latest state."""
    records = cluster.membership.shards.get(topic, {})
    named = {p: rev for p, rev in wanted.items() if (r := records.get(p)) is not None and r.revision == rev}
    by_holder: dict[int, set[int]] = {}
    for p in named:
        holder = records[p].holder
        if holder is not None and holder != cluster.me:
            by_holder.setdefault(holder, set()).add(p)
    return named, by_holder


async def follow_shards(
    cluster: Cluster,
    topic: str,
    holder: ShardHolder,
    retriable: tuple[type[Exception], ...] = TAKEOVER_ERRORS,
) -> None:
    """A coordinator's loop for internal topic `topic` (run on every broker of a cluster):
    `holder` gives up the partitions no longer named to it at the revision it serves them
    at, and takes over those newly named, again at every membership change (or tick: the
    lease ends by time alone). A takeover failing with one of the `retriable` errors is
    logged and tried again after `TAKEOVER_RETRY_S` (its partitions answer
    COORDINATOR_LOAD_IN_PROGRESS meanwhile); any other error is logged with its traceback
    and tried again after UNEXPECTED_RETRY_S."""
    while True:
        named = named_here(cluster, topic)
        gone = [p for p, rev in holder.shards.items() if named.get(p) != rev]
        if gone:
            holder.resign(gone)
        wanted = {p: rev for p, rev in named.items() if p not in holder.shards}
        changed = cluster.membership.changed
        if wanted:
            try:
                if await holder.take_over(cluster, wanted):
                    continue
            except retriable as exc:
                log.warning("cluster: taking over partitions of %s: %s; again", topic, exc)
                await trio.sleep(TAKEOVER_RETRY_S)
                continue
            except Exception:
                # A bug, or state nobody foresaw (a peer's archive, say): logged with its
                # traceback and tried again more slowly. Never the broker's end: every
                # broker named after it would take the same partitions over and die too.
                log.exception("cluster: taking over partitions of %s failed unexpectedly; "
                              "again in %.0f s", topic, UNEXPECTED_RETRY_S)
                await trio.sleep(UNEXPECTED_RETRY_S)
                continue
        with trio.move_on_after(SHARDS_TICK_S):
            await changed.wait()

"""The transaction coordinator's placement in a cluster: which broker coordinates a
transactional id, and how a broker takes over and gives up the ids of a partition of
``__transaction_state``.

Where the coordinator lives: `coordinator_node` (one function) names the broker that
coordinates a transactional id: the coordinator of its partition of `__transaction_state`
as the cluster names it (single-node, this one). Cluster mode follows the groups' model
(broker/groups/coordinator.py "Cluster mode"): a transactional id maps to a partition of
``__transaction_state`` (Kafka's hash over ``transaction.state.log.num.partitions``,
default 50); the controller names each partition's coordinator in etcd
(`broker.cluster.shards.place_shards`, started by `TxnCoordinator.run` as is
`follow_shards`); every broker keeps one ``__transaction_state`` archive (all the
partitions it coordinates write there), created at start, that every other broker copies (broker/mirror.py, `Cluster.copies`). A broker
named coordinator of a partition `take_over`s it: waits until its copies of the live
peers' archives are caught up, adopts from its copy of the previous holder's archive
every transactional id of that partition whose last word differs from its own (by log
order, `broker.groups.offsets.adopt`), writes them into its own archive, claims the
partition in etcd (a new revision: its epoch) and loads them; their requests answer
COORDINATOR_LOAD_IN_PROGRESS meanwhile. Loaded, a Prepare* transaction is completed and
an Ongoing one timed out exactly as after a restart. Every state change is answered only
once the in-sync peers hold it and a transaction in etcd confirms the partition's record
still has the revision we claimed (else NOT_COORDINATOR, and the partition is given up):
a paused or cut-off ex-coordinator acknowledges nothing.


Holds `coordinator_node`, `last_words` (an archive's last word per key) and `TxnShards`,
the part of `TxnCoordinator` (broker/transactions/coordinator.py) that serves partitions
of ``__transaction_state`` (`shard_of`, `refusal`, `resign`, `take_over`); the coordinator
supplies the archive (`_archive`, `_replay`, `_forget`). Imports trio, `broker.cluster`,
`broker.groups.offsets` (the archive reader and `adopt`), `broker.transactions.records`
and `broker.transactions.codes`; the node and the coordinator for typing only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from broker.cluster.shards import TakeoverNotReady, partition_for, still_named
from broker.groups.offsets import Word, adopt, read_records
from broker.transactions.codes import (
    COORDINATOR_LOAD_IN_PROGRESS,
    NONE,
    NOT_COORDINATOR,
    CoordinatorError,
)
from broker.transactions.records import RecordFormatError, build_state_batch, decode_key
from broker.transactions.settings import TxnSettings

if TYPE_CHECKING:
    from broker.cluster import Cluster
    from broker.node import Node, Partition
    from broker.transactions.coordinator import Txn
    from storage import PartitionLog

log = logging.getLogger("hyperkafka.transactions")

TXN_TOPIC = "__transaction_state"
# Time and size retention would drop live transactional ids: never drop segments here.
TXN_TOPIC_CONFIGS = {"retention.ms": "-1", "retention.bytes": "-1"}
OFFSETS_TOPIC = "__consumer_offsets"  # a group's offsets: its partition of it (AddOffsetsToTxn)
ADOPT_BATCH_RECORDS = 1000


def coordinator_node(node: Node, transactional_id: str) -> int | None:
    """The broker that coordinates `transactional_id` (None: none can now). The one place
    that decides it: as Kafka's TransactionStateManager, the id's partition of
    `__transaction_state` (``abs(hashCode) % partitions``, broker/cluster/shards.py) and
    the broker the cluster names for that partition, as groups are sharded by
    `__consumer_offsets`. Alone (`shard_count` None) this broker coordinates every
    partition; a cluster with no partition of `__transaction_state` placed (0) names
    nobody."""
    count = node.cluster.shard_count(TXN_TOPIC)
    if count is None:
        return node.cluster.coordinator(TXN_TOPIC, 0)
    if count < 1:
        return None
    return node.cluster.coordinator(TXN_TOPIC, partition_for(transactional_id, count))


def last_words(plog: PartitionLog, name: str = TXN_TOPIC) -> dict[bytes, Word]:
    """Every key's last word in a __transaction_state archive (ours or a peer's verified
    copy), tombstones included; records that do not parse are left out."""
    words: dict[bytes, Word] = {}
    for _, timestamp, key, value in read_records(plog, name=name):
        try:
            decode_key(key)
        except RecordFormatError:
            continue
        words[key] = Word(timestamp, key, value)
    return words


class TxnShards:
    """The partitions of __transaction_state a `TxnCoordinator` serves in a cluster (alone,
    `sharded` is None and every transactional id is served here)."""

    # (set by TxnCoordinator.__init__)
    node: Node
    settings: TxnSettings
    wall: Callable[[], int]
    txns: dict[str, Txn]
    # The etcd view whose partitions of __transaction_state this coordinator takes over
    # and serves (None alone).
    sharded: Cluster | None
    # Partitions of __transaction_state loaded and served here -> the revision of their
    # etcd record we claimed them at (every ack is fenced by it).
    shards: dict[int, int]
    takeovers: int
    _poke: trio.Event

    if TYPE_CHECKING:  # the archive, which TxnCoordinator keeps

        def _archive(self) -> Partition: ...

        def _replay(self, partitions: set[int] | None = None) -> None: ...

        def _forget(self, tid: str) -> None: ...

    def shard_of(self, tid: str) -> int:
        """The partition of __transaction_state `tid` maps to (cluster mode: how many
        partitions etcd records; before any, the configured count)."""
        count = self.node.cluster.shard_count(TXN_TOPIC) or self.settings.num_partitions
        return partition_for(tid, count)

    def refusal(self, tid: str) -> int:
        """NONE when this broker serves `tid` now; else NOT_COORDINATOR (another broker's
        partition, or our lease may be gone) or COORDINATOR_LOAD_IN_PROGRESS (named
        here, not loaded yet). Alone: always NONE."""
        cluster = self.sharded
        if cluster is None:
            return NONE
        p = self.shard_of(tid)
        record = cluster.membership.shards.get(TXN_TOPIC, {}).get(p)
        if record is None or record.owner != cluster.me or not cluster.membership.lease_valid():
            if p in self.shards:
                self.resign([p])
            return NOT_COORDINATOR
        if p in self.shards and self.shards[p] != record.revision:
            self.resign([p])  # moved away and back meanwhile: take it over again first
        return NONE if p in self.shards else COORDINATOR_LOAD_IN_PROGRESS

    def _fence(self, tids: Iterable[str]) -> dict[int, int]:
        """Cluster mode: the partitions of these ids -> the revision we serve them at
        (what `_append` has etcd compare); NOT_COORDINATOR when one is not served here.
        Alone: {}."""
        if self.sharded is None:
            return {}
        fence: dict[int, int] = {}
        for tid in tids:
            p = self.shard_of(tid)
            revision = self.shards.get(p)
            if revision is None:
                raise CoordinatorError(NOT_COORDINATOR, "This broker no longer coordinates this transactional id")
            fence[p] = revision
        return fence

    def resign(self, partitions: Iterable[int] | None = None) -> None:
        """Stop coordinating the transactional ids of these partitions of
        __transaction_state (all: None): another broker coordinates them now, from the
        state it adopted from our archive."""
        gone = set(self.shards) if partitions is None else set(partitions)
        served = gone & set(self.shards)
        for p in gone:
            self.shards.pop(p, None)
        for tid in [t for t in self.txns if partitions is None or self.shard_of(t) in gone]:
            self._forget(tid)
        if served:
            log.info("no longer the coordinator of %s partitions %s", TXN_TOPIC, sorted(served))

    async def take_over(self, cluster: Cluster, wanted: dict[int, int]) -> bool:
        """Become the coordinator of partitions `wanted` of __transaction_state (partition
        -> the revision of the record naming us), as the group coordinator takes over
        partitions of __consumer_offsets: wait (at most a session timeout) until our
        copies of the live peers' archives hold what they have; adopt from the copy of
        each partition's previous holder every key of its transactional ids whose last
        word differs from ours (`adopt`: log order, no clocks), into our own archive;
        claim the partitions in etcd (a new revision, their epoch); load them. Whether
        they were claimed (not: moved again meanwhile, or our lease is gone)."""
        started = trio.current_time()
        if not await cluster.wait_handed_over(cluster.session_s, TXN_TOPIC):
            log.warning("taking over transactions with copies of the peers' archives that may be behind")
        wanted, by_holder = still_named(cluster, TXN_TOPIC, wanted)
        if not wanted:
            return False
        adopted: list[Word] = []
        own = last_words(self._archive().log)
        for holder, parts in sorted(by_holder.items()):
            copy = cluster.copies[TXN_TOPIC].get(holder)
            if copy is None:
                raise TakeoverNotReady(f"no copy of the {TXN_TOPIC} archive of broker {holder}, the previous coordinator")
            theirs = {k: w for k, w in last_words(copy.log, f"{TXN_TOPIC} of broker {holder}").items()
                      if self._key_shard(k) in parts}
            adopted += adopt({k: w for k, w in own.items() if self._key_shard(k) in parts}, theirs)
        if adopted:
            # Durable here is enough to serve them (as the groups' takeover): the peers
            # copy them from our archive as they copy everything else.
            await self._append_adopted(adopted)
        revision = await cluster.membership.claim_shards(TXN_TOPIC, wanted)
        if revision is None:
            return False  # fenced: moved again meanwhile (the loop looks again at the next change)
        self.resign(wanted)  # (nothing of them should be in memory; a replay replaces all)
        self._replay(set(wanted))
        self.shards.update(dict.fromkeys(wanted, revision))
        self.takeovers += 1
        self._poke.set()  # Prepare* completed, Ongoing timed out: as after a restart
        log.info("transaction coordinator of %s partitions %s now, revision %d (took over in %.2fs): "
                 "%d records adopted from brokers %s", TXN_TOPIC, sorted(wanted), revision,
                 trio.current_time() - started, len(adopted), sorted(by_holder) or "-")
        return True

    def _key_shard(self, raw_key: bytes) -> int | None:
        try:
            return self.shard_of(decode_key(raw_key)[1])
        except RecordFormatError:
            return None

    async def _append_adopted(self, words: Sequence[Word]) -> None:
        partition = self._archive()
        last = -1
        for i in range(0, len(words), ADOPT_BATCH_RECORDS):
            chunk = words[i : i + ADOPT_BATCH_RECORDS]
            _, last = partition.log.append(build_state_batch([(w.key, w.value) for w in chunk], self.wall()))
            self.node.mark_dirty(partition)
        with trio.fail_after(max(self.settings.state_write_timeout_ms / 1000, 1) * 6):
            await partition.wait_durable(last)

"""Cluster mode: replicas, in-sync replicas and acks=all, over the etcd view.

Owns `Cluster`, the state every broker keeps about the others: the etcd view
(`membership`, broker/cluster/membership.py: who is alive, who is controller, where each
topic is placed), what it learned of each peer (node key), how far each peer's copy of
each archive written here has got, and from that the in-sync replicas and the acks=all
wait. Design, as Kafka and Hypercore each would have it:

* Membership, liveness and the controller come from etcd (docs/clusters.md): a broker is
  alive while its lease is; the brokers of the cluster are every broker that ever
  registered (``members/<id>`` in etcd, as KRaft keeps a fenced broker's registration).
  A dead broker leaves Metadata's broker list and every ISR at once (Kafka fences it).
* Every broker mirrors every other broker (the `--mirror` machinery, broker/mirror.py,
  with the node key from the peer's etcd registration pinned): the writer of an archive,
  the only holder of its key, is its leader; replicas are all brokers, writer first.
  Writes never move (an archive has one signer), so the leader epoch stays 0.
* Reads fail over, writes wait: a partition whose writer is dead is reported with the
  lowest live id of the ISR its writer last reported as leader (every broker computes the
  same from the same facts), so consumers keep reading that mirror's verified copy;
  a produce sent there is refused with NOT_LEADER_OR_FOLLOWER (retriable) as any mirror
  refuses it, since only the writer holds the key. When the writer is back it leads
  again. With no live in-sync replica the leader is -1 and the partition's error
  LEADER_NOT_AVAILABLE, as Kafka's offline partitions. A broker that started after the
  writer died takes its last ISR from a peer's Metadata (`take_metadata`, polled by
  broker/mirror.py `poll_leader_isr`: the writer is the authority on its ISR).
* The controller (elected in etcd) places topics and the partitions of ``__consumer_offsets``
  (each one's coordinator, broker/cluster/shards.py); its acts are fenced by its epoch,
  a coordinator's by its partition's record revision (broker/placement.py,
  broker/groups/coordinator.py).
* Committed offsets survive any broker (Kafka replicates ``__consumer_offsets``): every
  broker follows every peer's offsets archive (`PeerCopy`, kept by broker/mirror.py,
  never a Kafka topic); the coordinator's commits wait for the in-sync peers like an
  acks=all produce. A broker named coordinator of a partition of ``__consumer_offsets``
  loads it once `handed_over` (our copy of every live peer's archive holds what it has),
  adopting its state from the archive of its previous holder by log order
  (broker/groups/offsets.py `adopt`).
* Progress comes from the Hypercore protocol itself: a peer that stored blocks tells the
  writer with ``range`` (and ``bitfield``) messages, exactly as a Hypercore peer does after
  each download (`ReplicationSession.remote_contiguous_length`). Our mirrors announce a
  range only once a verified signed head covering it is stored (storage/follower.py), so
  "holds length L" means "holds a signed head of length >= L, verified and durable". The
  peer is identified by its Noise static key, which is its node key (as Hyperswarm peers
  use their identity key), mapped to a broker id through discovery.
* In-sync (Kafka's rule for ``replica.lag.time.max.ms``, default 30 s as since KIP-537): a follower is
  in sync while it holds at least what the leader had signed ``replica.lag.time.max.ms``
  ago, and it has had a replication connection within that time. The leader is always in
  sync. A mirror that went away therefore leaves the ISR after the lag time, or once its
  etcd lease expires (the session timeout), whichever comes first.
* acks=all, as Kafka's DelayedProduce: refused before the append with NOT_ENOUGH_REPLICAS
  when the ISR is smaller than the topic's ``min.insync.replicas`` (the leader counts);
  after the append the answer waits until every in-sync replica holds the batch (a
  replica that falls out of the ISR meanwhile stops being waited for), then answers
  NONE if at least ``min.insync.replicas`` replicas hold it, else
  NOT_ENOUGH_REPLICAS_AFTER_APPEND; the same when the request's timeout runs out first
  (Kafka says REQUEST_TIMED_OUT there; the batch is stored, which this code says).
* Reads (KIP-392): `preferred_read_replica` picks an in-sync follower in the consumer's
  rack as Kafka's RackAwareReplicaSelector; ``replica.selector.class`` may name Kafka's
  LeaderSelector to turn it off.

May import trio, `broker.config`, `broker.cluster.*` and `storage`; never the protocol codec
or the handlers.
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from broker.cluster import quorum
from broker.cluster.etcd import Etcd
from broker.cluster.membership import Member, Membership
from broker.config import RACK_AWARE_SELECTOR, BrokerConfig, ClusterBroker
from storage import PartitionLog
from storage.replication.session import ReplicationChannel

DEFAULT_REPLICA_LAG_MS = 30_000
DEFAULT_SESSION_TIMEOUT_MS = 9_000  # Kafka's broker.session.timeout.ms
NO_LEADER = -1
CLUSTER_PID_SHIFT = 40  # producer ids of broker N start at N << 40
# The internal topics whose archive every broker keeps (one each) and every other broker
# copies, for the coordinator that takes a partition of it over (groups, transactions).
OFFSETS_TOPIC = "__consumer_offsets"
TXN_TOPIC = "__transaction_state"
COPIED_TOPICS = (OFFSETS_TOPIC, TXN_TOPIC)
WAIT_TICK_MAX_S = 0.5


def signed_blocks(log: PartitionLog) -> int:
    """Blocks (batches) covered by the archive's last published signed head: the unit of
    Hypercore lengths, and of everything `Cluster` counts."""
    head = log.head
    return head.length if head is not None else 0


@dataclass
class _Progress:
    """One peer's copy of one archive, as the writer knows it."""

    length: int = 0  # contiguous length the peer said it holds (range/bitfield)
    # a quorum-signed archive: the longest head of the archive's newest fork this peer
    # signed as a replica (it fsyncs those blocks before its signature leaves)
    signed: int = 0
    connections: int = 0
    last_seen: float = float("-inf")  # monotonic time a connection was last open


@dataclass
class _Archive:
    """The writer's side of one archive it writes: its head history and its peers."""

    # (monotonic time, length) of published heads, oldest first; trimmed to the lag window
    # plus the newest entry older than it (that one gives "the head as of now - lag").
    heads: list[tuple[float, int]] = field(default_factory=list)
    peers: dict[int, _Progress] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)
    # quorum-signed (its replicas' signatures are reported, `signer_signed`): the newest
    # fork they were reported on; None for a single-signer archive
    quorum_fork: int | None = None


@dataclass(eq=False)
class PeerCopy:
    """This broker's verified copy of a peer's archive of an internal topic
    (``__consumer_offsets``, ``__transaction_state``), followed by broker/mirror.py and read only by a coordinator taking over; `channel` is
    the live follower channel while there is one (its ``remote_length`` is how long the
    peer says its archive is)."""

    log: PartitionLog
    channel: ReplicationChannel | None = None

    def caught_up(self) -> bool:
        """Whether a live channel is open and our stored signed head covers what the peer
        said it has."""
        ch = self.channel
        if ch is None or ch.done:
            return False
        remote = ch.remote_length
        return remote is not None and signed_blocks(self.log) >= remote


class Cluster:
    """This broker's view of its cluster (a `ClusterView`, broker/cluster/view.py). Lives
    on `Node.cluster` in cluster mode (alone: `NullCluster`, broker/cluster/null.py).

    Membership, the controller and placement come from etcd (`membership`,
    broker/cluster/membership.py); this class keeps what the brokers tell each other
    directly: node keys, progress of each copy, the ISR and the acks=all wait."""

    def __init__(
        self,
        membership: Membership,
        *,
        replica_lag_ms: int = DEFAULT_REPLICA_LAG_MS,
        session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
        rack_aware: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.membership = membership
        self.me = membership.me.node_id
        self.lag_s = replica_lag_ms / 1000
        self.session_s = session_timeout_ms / 1000
        self.rack_aware = rack_aware
        self.clock = clock
        self.node_keys: dict[int, bytes] = {}
        self._by_identity: dict[bytes, int] = {}
        self._archives: dict[bytes, _Archive] = {}
        # ISR of archives written by others, as their writer last told us (Metadata):
        # (topic, partition) -> isr ids.
        self.remote_isr: dict[tuple[str, int], list[int]] = {}
        self._isr_writer: dict[tuple[str, int], int] = {}  # whose own report each entry is
        # Our copies of the peers' archives of each internal topic (broker/mirror.py):
        # topic -> broker id -> copy. ``__consumer_offsets`` (the group coordinators') and
        # ``__transaction_state`` (the transaction coordinators').
        self.copies: dict[str, dict[int, PeerCopy]] = {t: {} for t in COPIED_TOPICS}
        self.offsets_copies = self.copies[OFFSETS_TOPIC]
        self._copies_changed = trio.Event()
        self._named_controller: dict[int, int] = {}  # the controller each peer last named
        self.placing: set[str] = set()  # topics this controller is placing and creating here now
        digest = hashlib.blake2b(membership.prefix, digest_size=16).digest()
        # Every broker of the cluster derives the same id from the same etcd prefix.
        self.cluster_id = base64.urlsafe_b64encode(digest).decode().rstrip("=")

    @classmethod
    def from_config(cls, config: BrokerConfig, node_key: bytes) -> Cluster:
        """The cluster view of a broker whose config names etcd."""
        host, port = config.advertised
        me = Member(config.node_id, host, port, config.rack, node_key.hex())
        membership = Membership(
            Etcd(config.cluster_etcd_endpoints),
            config.cluster_name,
            me,
            max(1, round(config.session_timeout_ms / 1000)),
        )
        return cls(
            membership,
            replica_lag_ms=config.replica_lag_ms,
            session_timeout_ms=config.session_timeout_ms,
            rack_aware=config.replica_selector == RACK_AWARE_SELECTOR,
        )

    # -- membership (etcd) --------------------------------------------------------

    @property
    def brokers(self) -> dict[int, ClusterBroker]:
        """The brokers of the cluster, alive or not (`alive` tells), this one included."""
        m = self.membership
        out = {
            i: ClusterBroker(b.node_id, b.host, b.port) for i, b in {**m.known, **m.members}.items()
        }
        if self.me not in out:
            out[self.me] = ClusterBroker(self.me, m.me.host, m.me.port)
        return out

    @property
    def racks(self) -> dict[int, str | None]:
        m = self.membership
        return {**{i: b.rack for i, b in m.members.items()}, self.me: m.me.rack}

    def take_metadata(
        self,
        peer: int,
        partitions: Iterable[tuple[str, int, list[int], list[int]]],
        controller: int | None = None,
    ) -> None:
        """A peer's Metadata answer, (topic, partition, replicas, isr) for each partition,
        and the controller it names: for what it writes (its id first among the replicas)
        its ISR is the truth and replaces what we had (a partition left out was deleted).
        For a partition whose writer is dead and whose ISR we never heard (we started
        after it died), the ISR this peer still shows is taken, so that we name the same
        read leader as the brokers that saw the writer's last report."""
        if controller is not None and self._named_controller.get(peer) != controller:
            self._named_controller[peer] = controller
            self.copy_changed()  # what `wait_handed_over` waits for
        own: dict[tuple[str, int], list[int]] = {}
        for topic, index, replicas, isr in partitions:
            key = (topic, index)
            writer = replicas[0] if replicas else None
            if writer == peer:
                own[key] = isr
            elif (
                writer is not None
                and writer != self.me
                and isr
                and key not in self.remote_isr
                and not self.alive(writer)
            ):
                self.remote_isr[key] = isr
        for key in [k for k, w in self._isr_writer.items() if w == peer and k not in own]:
            del self._isr_writer[key]
            self.remote_isr.pop(key, None)
        self.remote_isr.update(own)
        self._isr_writer.update(dict.fromkeys(own, peer))

    # -- the peers' offsets archives ------------------------------------------

    def copy_changed(self) -> None:
        """A copy of a peer's offsets archive grew, or its channel opened or closed, or a
        peer named another controller."""
        self._copies_changed.set()
        self._copies_changed = trio.Event()

    @property
    def copies_changed(self) -> trio.Event:
        """Set at the next `copy_changed` (take it before looking at the copies)."""
        return self._copies_changed

    def handed_over(self, topic: str = OFFSETS_TOPIC) -> bool:
        """Whether a coordinator taking partitions of internal `topic` over may load
        them: our copy of every live peer's archive of it holds what the peer said it
        has (what a previous coordinator acknowledged, it had replicated to its in-sync
        peers first). A dead peer's copy is what it is: nobody adds to it."""
        copies = self.copies[topic]
        return all(
            (c := copies.get(i)) is not None and c.caught_up()
            for i in self.live_ids()
            if i != self.me
        )

    async def wait_handed_over(self, timeout_s: float, topic: str = OFFSETS_TOPIC) -> bool:
        """Wait (at most `timeout_s`) until `handed_over(topic)`; whether it is."""
        return await _wait_until(lambda: self.handed_over(topic), lambda: self._copies_changed, timeout_s)

    @property
    def multi_broker(self) -> bool:
        return True

    @property
    def producer_id_base(self) -> int:
        # Any broker hands out ids (idempotent producers; the transaction coordinator of
        # each transactional id, wherever it moves) and any writer checks them: each
        # broker gets its own range, so two brokers never give one id to two producers,
        # without asking etcd (ids below 2**40 per broker, 2**23 brokers).
        return self.me << CLUSTER_PID_SHIFT

    def alive(self, node_id: int, now: float | None = None) -> bool:
        """Whether `node_id` holds a live etcd lease (this broker always counts itself)."""
        return node_id == self.me or node_id in self.membership.members

    def live_ids(self) -> list[int]:
        return sorted(set(self.membership.members) | {self.me})

    @property
    def controller_id(self) -> int:
        """The controller elected in etcd, or NO_LEADER while there is none."""
        c = self.membership.controller
        return NO_LEADER if c is None else c

    @property
    def is_controller(self) -> bool:
        return self.membership.is_controller

    def leadership(self, writer: int, isr: list[int]) -> tuple[int, list[int]]:
        """(leader, isr) to report for a partition written by `writer` whose ISR, as
        the writer last reported it, is `isr`: dead brokers leave the ISR; the writer
        leads while alive, else the lowest live id of that ISR serves reads as leader
        (every broker that saw the same report picks the same one), else nobody
        (`NO_LEADER`: Kafka's offline partition)."""
        live = [i for i in isr if self.alive(i)]
        if self.alive(writer):
            return writer, live
        return (min(live) if live else NO_LEADER), live

    # -- placement (etcd) -------------------------------------------------------

    def placed_writer(self, name: str) -> int | None:
        placed = self.membership.placements.get(name)
        return None if placed is None else placed.writer

    def placed_replicas(self, topic: str, index: int) -> list[int] | None:
        return quorum.placed_replicas(self, topic, index)

    def placed_leader(self, topic: str, index: int) -> int | None:
        return quorum.placed_leader(self, topic, index)

    def placed_epoch(self, topic: str, index: int) -> int:
        return quorum.placed_epoch(self, topic, index)

    async def unplace(self, name: str) -> bool | None:
        return await self.membership.unplace(name)

    def record_configs(self, name: str) -> tuple[str, dict[str, str]] | None:
        placed = self.membership.placements.get(name)
        if placed is None or not placed.authoritative:
            return None
        return placed.topic_id, dict(placed.configs)

    async def set_record_configs(self, name: str, configs: dict[str, str]) -> bool | None:
        placed = self.membership.placements.get(name)
        if placed is None or not placed.authoritative:
            return False
        return await self.membership.set_configs(placed, configs)

    # -- coordinators of internal topics (broker/cluster/shards.py) ----------------

    def shard_count(self, topic: str) -> int | None:
        shards = self.membership.shards.get(topic)
        return max(shards) + 1 if shards else 0

    def coordinator(self, topic: str, partition: int) -> int | None:
        shard = self.membership.shards.get(topic, {}).get(partition)
        return None if shard is None else shard.owner

    async def check_fence(self, topic: str, revisions: dict[int, int]) -> bool:
        return await self.membership.check_shards(topic, revisions)

    def peers(self) -> list[ClusterBroker]:
        return [b for i, b in self.brokers.items() if i != self.me]

    def replicas(self, leader: int) -> list[int]:
        """Every broker holds every archive: the leader first, then the others by id."""
        return [leader] + [i for i in sorted(self.brokers) if i != leader]

    def learn(self, node_id: int, node_key: bytes) -> None:
        """What discovery told us about a peer (its Kafka port's DescribeConfigs)."""
        old = self.node_keys.get(node_id)
        if old is not None and old != node_key:
            self._by_identity.pop(old, None)
        self.node_keys[node_id] = node_key
        self._by_identity[node_key] = node_id

    def broker_for_identity(self, public_key: bytes) -> int | None:
        """The cluster broker whose node key authenticated a replication connection."""
        node_id = self._by_identity.get(public_key)
        return node_id if node_id is not None and node_id != self.me else None

    # -- progress (writer side) -------------------------------------------------

    def _archive(self, key: bytes) -> _Archive:
        a = self._archives.get(key)
        if a is None:
            a = self._archives[key] = _Archive()
        return a

    def _wake(self, a: _Archive) -> None:
        a.changed.set()
        a.changed = trio.Event()

    def published(self, key: bytes, length: int) -> None:
        """The writer published a head of `length` for archive `key`."""
        a = self._archive(key)
        now = self.clock()
        if a.heads and a.heads[-1][1] >= length:
            return
        a.heads.append((now, length))
        # keep the newest entry at or before now - lag, and everything after it
        cut = bisect.bisect_right(a.heads, (now - self.lag_s, float("inf"))) - 1
        if cut > 0:
            del a.heads[:cut]

    def writes(self, key: bytes) -> bool:
        """Whether archive `key` is one this broker writes (its progress is tracked)."""
        return key in self._archives

    def connected(self, key: bytes, node_id: int) -> None:
        a = self._archives.get(key)
        if a is None:
            return
        p = a.peers.setdefault(node_id, _Progress())
        if p.connections == 0:
            # What it held before is no proof of what it holds now (its disk may have been
            # wiped): it says so again with a range as soon as the channel opens.
            p.length = 0
        p.connections += 1
        p.last_seen = self.clock()

    def disconnected(self, key: bytes, node_id: int) -> None:
        a = self._archives.get(key)
        if a is None:
            return
        p = a.peers.setdefault(node_id, _Progress())
        p.connections = max(0, p.connections - 1)
        p.last_seen = self.clock()
        self._wake(a)

    def acked(self, key: bytes, node_id: int, length: int) -> None:
        """A peer said (range/bitfield) it holds the first `length` blocks of `key`."""
        a = self._archives.get(key)
        if a is None:
            return
        p = a.peers.setdefault(node_id, _Progress())
        if length != p.length:
            p.length = length
            p.last_seen = self.clock()
            self._wake(a)

    def signer_signed(self, key: bytes, node_id: int, fork: int, length: int) -> None:
        """Replica `node_id` signed the head of `length` blocks on `fork` of quorum-signed
        archive `key` (written here): it holds those blocks durably. A newer fork forgets
        what was signed on older ones (a cut may have dropped blocks a replica signed)."""
        a = self._archive(key)
        if a.quorum_fork is None or fork > a.quorum_fork:
            a.quorum_fork = fork
            for p in a.peers.values():
                p.signed = 0
        elif fork < a.quorum_fork:
            return
        p = a.peers.setdefault(node_id, _Progress())
        if length > p.signed:
            p.signed = length
            self._wake(a)

    def _required(self, a: _Archive, now: float) -> int:
        """The head length the writer had published `lag` ago (the oldest it remembers
        when it has not been up that long: a peer must catch up with that first)."""
        if not a.heads:
            return 0
        i = bisect.bisect_right(a.heads, (now - self.lag_s, float("inf"))) - 1
        return a.heads[max(i, 0)][1]

    def in_sync(self, key: bytes, now: float | None = None) -> list[int]:
        """Ids of the followers of archive `key` that are in sync (the leader excluded)."""
        a = self._archives.get(key)
        if a is None:
            return []
        now = self.clock() if now is None else now
        need = self._required(a, now)
        return sorted(
            i
            for i, p in a.peers.items()
            if p.length >= need
            and (p.connections > 0 or now - p.last_seen <= self.lag_s)
            and self.alive(i, now)  # a dead broker leaves every ISR at once, as Kafka fences it
        )

    def isr(self, key: bytes) -> list[int]:
        return [self.me, *self.in_sync(key)]

    def short_of_insync(self, key: bytes, min_insync: int) -> list[int] | None:
        isr = self.isr(key)
        return isr if len(isr) < min_insync else None

    def acks_all_replicas(self, min_insync: int) -> int:
        return min_insync

    def produce_refusal(self, topic: str, index: int, log: PartitionLog, min_insync: int) -> str | None:
        # quorum-signed: its signers alive, or nothing is written
        return quorum.produce_refusal(self, topic, index, log.manifest, log.public_key,
                                      log.quorum_sign is not None, min_insync)

    def held_by(self, key: bytes, node_id: int) -> int:
        a = self._archives.get(key)
        p = a.peers.get(node_id) if a is not None else None
        return p.length if p is not None else 0

    async def wait_replicated(self, key: bytes, length: int, min_insync: int) -> bool:
        """acks=all after the append: wait until every in-sync follower holds `length`
        blocks (followers leaving the ISR meanwhile are not waited for), then tell whether
        at least `min_insync` replicas (the leader counts) hold them. The caller bounds
        the wait with the request's timeout.

        A quorum-signed archive needs no more than its quorum-signed head and
        `min_insync` replicas holding the blocks (the leader and every replica that
        signed them count, as does a mirror's range): acks=all means a quorum of
        independent brokers signed the batch (issue 17), and a slow third replica does
        not hold every producer up. False once too few replicas are alive to get there."""
        a = self._archive(key)
        if a.quorum_fork is not None:
            return await self._wait_holders(a, length, min_insync)
        while True:
            isr = self.in_sync(key)
            if all(a.peers[i].length >= length for i in isr):
                return 1 + len(isr) >= min_insync
            event = a.changed
            # a follower may leave the ISR by time alone: look again within the lag
            with trio.move_on_after(min(WAIT_TICK_MAX_S, max(self.lag_s / 10, 0.01))):
                await event.wait()

    async def _wait_holders(self, a: _Archive, length: int, min_insync: int) -> bool:
        while True:
            now = self.clock()
            alive = [p for i, p in a.peers.items() if self.alive(i, now)]
            if 1 + sum(max(p.length, p.signed) >= length for p in alive) >= min_insync:
                return True
            if 1 + len(alive) < min_insync:
                return False
            event = a.changed
            with trio.move_on_after(WAIT_TICK_MAX_S):  # a replica may die by time alone
                await event.wait()

    # -- read replicas (KIP-392) -------------------------------------------------

    def preferred_read_replica(self, key: bytes, client_rack: str) -> int | None:
        """A follower in the client's rack to fetch from, as Kafka's
        RackAwareReplicaSelector picks it: none when the leader is in that rack, else the
        in-sync follower there holding the most (ties: the lowest id). None always with
        Kafka's LeaderSelector (replica.selector.class)."""
        if not self.rack_aware or not client_rack or self.racks.get(self.me) == client_rack:
            return None
        a = self._archives.get(key)
        candidates = [i for i in self.in_sync(key) if self.racks.get(i) == client_rack]
        if a is None or not candidates:
            return None
        return max(candidates, key=lambda i: (a.peers[i].length, -i))


async def _wait_until(
    done: Callable[[], bool], changed: Callable[[], trio.Event], timeout_s: float
) -> bool:
    """Wait (at most `timeout_s`) until `done()`, waking at each `changed()` event (taken
    before each look, as it is replaced when set) and at least every WAIT_TICK_MAX_S,
    since a peer may die by time alone; whether `done()` holds at the end."""
    with trio.move_on_after(timeout_s):
        while not done():
            event = changed()
            with trio.move_on_after(WAIT_TICK_MAX_S):
                await event.wait()
    return done()

"""Cluster mode: the transport of the quorum-signing channel (broker/cluster/signing.py).

Owns the ``hyperkafka/quorum`` protomux channel on replication connections: the leader's
side (`QuorumLink`: one Noise connection to one replica broker's replication port, made
with this broker's node key as its static key, carrying proposals and bringing answers
back; `LinkPeers`: the links to every replica, as `signing.Peers`) and the replica's
side (`accept_proposals`: a channel a peer opens on the replication listener is taken
only from a broker of the cluster, identified by its Noise static key, which is its
published node key; its proposals are queued, boundedly, for `serve_proposals`).

Why a protomux channel of our own next to ``hypercore/alpha`` on the replication
connections (docs/clusters.md): the sender of a proposal must be authenticated (only the
placed leader may propose), and the Noise handshake already proves the peer's node key;
the replication port is already open between every pair of brokers; and stock
Hypercore peers are untouched: none of them opens this protocol, and protomux rejects a
protocol a peer does not know. A Hypercore ``extension`` message on the archive's own
channel was the other candidate; it rides on a session whose follower verifies every
block against a signed head and delivers them in order to the mirror's archive, while a
proposal carries blocks no head covers yet: the two would write one archive from two
state machines.

Bounded: a proposal is decoded within `MAX_PROPOSAL_BYTES` before anything is kept; at
most `QUEUE` proposals wait per connection, more are answered "busy"; an answer waits in
the leader's cancel scope (`QuorumAssembler` gives each replica `timeout_s`).

May import trio, `broker.cluster`, `broker.config`, `broker.node`, `broker.mirror`
(discovery) and `storage`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import trio

from broker.cluster import Cluster
from broker.cluster.failover import VOTE, VOTE_REQUEST, ReplicaVoter, VoteAnswer, VoteRequest
from broker.cluster.membership import Placement
from broker.cluster.quorum import is_quorum_signed, node_key, placed_leader, placed_replicas
from broker.cluster.signing import (
    ANSWER,
    MAX_PROPOSAL_BYTES,
    PROPOSE,
    PROTOCOL,
    Answer,
    MessageError,
    Proposal,
    QuorumAssembler,
    ReplicaSigner,
)
from broker.config import parse_host_port
from broker.mirror import discover_configs
from broker.node import Node
from storage import PartitionLog
from storage.follower import FollowerLog
from storage.hypercore import KeyPair
from storage.quorum import manifest_partition
from storage.replication.mux import Channel
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import Connection, ProtocolHandler
from storage.replication.trio_driver import ConnectionDriver

log = logging.getLogger("hyperkafka.quorum")

QUEUE = 64  # proposals waiting per connection on a replica
BUSY_POLL_S = 0.002  # a proposal waits for its archive's accept job, polling,
BUSY_POLLS = 1000  # this many times at most (2 s, within the leader's 5 s)
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0


# ----------------------------------------------------------------- the leader's side


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    answer: Answer | None = None


@dataclass
class _VoteWaiter:
    event: trio.Event = field(default_factory=trio.Event)
    answer: VoteAnswer | None = None


class _LinkHandler(ProtocolHandler):
    def __init__(self) -> None:
        self.channel: Channel | None = None
        self.opened = trio.Event()
        self.closed = False
        self.waiting: dict[tuple[bytes, int, int], _Waiter] = {}
        self.votes: dict[tuple[bytes, int], _VoteWaiter] = {}

    def on_open(self, conn: Connection, channel: Channel) -> None:
        self.channel = channel
        self.opened.set()

    def on_message(self, conn: Connection, channel: Channel, type_: int, payload: bytes) -> None:
        if type_ == VOTE:
            try:
                v = VoteAnswer.decode(payload)
            except MessageError as exc:
                log.info("quorum channel closed: %s", exc)
                conn.close_protocol(channel)
                return
            vw = self.votes.pop((v.archive, v.epoch), None)
            if vw is not None:
                vw.answer = v
                vw.event.set()
            return
        if type_ != ANSWER:
            return  # protomux ignores types a channel does not know
        try:
            a = Answer.decode(payload)
        except MessageError as exc:
            log.info("quorum channel closed: %s", exc)
            conn.close_protocol(channel)
            return
        w = self.waiting.pop((a.archive, a.fork, a.length), None)
        if w is not None:
            w.answer = a
            w.event.set()

    def on_close(self, conn: Connection, channel: Channel) -> None:
        self.closed = True
        self.opened.set()
        for w in self.waiting.values():
            w.event.set()
        self.waiting.clear()
        for vw in self.votes.values():
            vw.event.set()
        self.votes.clear()


class QuorumLink:
    """The leader's channel to one replica broker. `run` connects (`connect()` gives the
    stream) and lives until the connection ends; `propose` waits for it to be open."""

    def __init__(self, keypair: Ed25519KeyPair) -> None:
        self.keypair = keypair
        self.handler = _LinkHandler()
        self.conn: Connection | None = None
        self.driver: ConnectionDriver | None = None

    async def run(self, stream: trio.abc.Stream) -> None:
        conn = Connection(initiator=True, keypair=self.keypair)
        conn.open_protocol(PROTOCOL, None, self.handler)
        self.conn, self.driver = conn, ConnectionDriver(stream, conn)
        try:
            await self.driver.run()
        finally:
            self.handler.on_close(conn, self.handler.channel or Channel(PROTOCOL, None, 0))

    async def propose(self, proposal: Proposal) -> Answer:
        h = self.handler
        await h.opened.wait()
        if h.closed or h.channel is None or self.conn is None or self.driver is None:
            raise trio.BrokenResourceError("quorum channel closed")
        key = (proposal.archive, proposal.fork, proposal.length)
        if key in h.waiting:
            raise trio.BusyResourceError("a proposal of this head is already waiting")
        w = h.waiting[key] = _Waiter()
        try:
            self.conn.send_protocol(h.channel, PROPOSE, proposal.encode())
            self.driver.kick()
            await w.event.wait()
        finally:
            if h.waiting.get(key) is w:
                del h.waiting[key]
        if w.answer is None:
            raise trio.BrokenResourceError("quorum channel closed")
        return w.answer

    async def vote(self, request: VoteRequest) -> VoteAnswer:
        """Ask this replica's failover vote (broker/cluster/failover.py)."""
        h = self.handler
        await h.opened.wait()
        if h.closed or h.channel is None or self.conn is None or self.driver is None:
            raise trio.BrokenResourceError("quorum channel closed")
        key = (request.archive, request.epoch)
        if key in h.votes:
            raise trio.BusyResourceError("a vote of this epoch is already waiting")
        w = h.votes[key] = _VoteWaiter()
        try:
            self.conn.send_protocol(h.channel, VOTE_REQUEST, request.encode())
            self.driver.kick()
            await w.event.wait()
        finally:
            if h.votes.get(key) is w:
                del h.votes[key]
        if w.answer is None:
            raise trio.BrokenResourceError("quorum channel closed")
        return w.answer


class LinkPeers:
    """`signing.Peers` over `QuorumLink`s: a link per replica broker, (re)connected in
    the background through `connect(node_id)` with backoff while it is wanted."""

    def __init__(
        self,
        keypair: Ed25519KeyPair,
        connect: Callable[[int], Awaitable[trio.abc.Stream]],
        nursery: trio.Nursery,
    ) -> None:
        self.keypair = keypair
        self.connect = connect
        self.nursery = nursery
        self.links: dict[int, QuorumLink] = {}

    async def _keep(self, node_id: int) -> None:
        delay = RECONNECT_MIN_S
        while True:
            link = self.links[node_id]
            try:
                stream = await self.connect(node_id)
                delay = RECONNECT_MIN_S
                await link.run(stream)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("quorum link to broker %d: %s", node_id, exc)
            except Exception as exc:  # a peer breaking the protocol drops its link only
                log.warning("quorum link to broker %d failed: %s", node_id, exc)
            self.links[node_id] = QuorumLink(self.keypair)  # proposals wait for it
            await trio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)

    def _link(self, node_id: int) -> QuorumLink:
        if node_id not in self.links:
            self.links[node_id] = QuorumLink(self.keypair)
            self.nursery.start_soon(self._keep, node_id)
        return self.links[node_id]

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        return await self._link(node_id).propose(proposal)

    async def vote(self, node_id: int, request: VoteRequest) -> VoteAnswer:
        """`failover.Voters` over the same links."""
        return await self._link(node_id).vote(request)


# ----------------------------------------------------------------- the replica's side


Queued = tuple[Connection, Channel, int, Proposal | VoteRequest]


class _ServeHandler(ProtocolHandler):
    def __init__(self, sender: int, queue: trio.MemorySendChannel[Queued]) -> None:
        self.sender = sender
        self.queue = queue

    def on_message(self, conn: Connection, channel: Channel, type_: int, payload: bytes) -> None:
        if type_ == VOTE_REQUEST:
            try:
                v = VoteRequest.decode(payload)
            except MessageError as exc:
                log.info("broker %d's quorum channel closed: %s", self.sender, exc)
                conn.close_protocol(channel)
                return
            try:
                self.queue.send_nowait((conn, channel, self.sender, v))
            except trio.WouldBlock:
                conn.send_protocol(channel, VOTE, VoteAnswer(v.archive, v.epoch, reason="busy").encode())
            return
        if type_ != PROPOSE:
            return
        try:
            p = Proposal.decode(payload, MAX_PROPOSAL_BYTES)
        except MessageError as exc:
            log.info("broker %d's quorum channel closed: %s", self.sender, exc)
            conn.close_protocol(channel)
            return
        try:
            self.queue.send_nowait((conn, channel, self.sender, p))
        except trio.WouldBlock:
            busy = Answer(p.archive, p.fork, p.length, p.start, reason="busy")
            conn.send_protocol(channel, ANSWER, busy.encode())


def accept_proposals(
    conn: Connection,
    identify: Callable[[bytes], int | None],
    queue: trio.MemorySendChannel[Queued],
) -> Callable[[str, bytes | None], ProtocolHandler | None]:
    """`Connection.accept` of a replication connection: the quorum channel, opened by a
    broker of the cluster (`identify` maps the peer's Noise static key to its id)."""

    def accept(protocol: str, _id: bytes | None) -> ProtocolHandler | None:
        if protocol != PROTOCOL:
            return None
        sender = identify(conn.remote_public_key)
        if sender is None:
            log.info("quorum channel refused: the peer is no broker of this cluster")
            return None
        return _ServeHandler(sender, queue)

    return accept


async def serve_proposals(
    signer: ReplicaSigner,
    queue: trio.MemoryReceiveChannel[Queued],
    kick: Callable[[], None],
    voter: ReplicaVoter | None = None,
) -> None:
    """Answer the queued proposals (and failover votes, through `voter`; none: refused)
    one after the other. `ReplicaSigner.handle` runs on the event loop: the mirror's
    sessions write the same archives from it, and an archive is not safe for two threads
    (its fsyncs cost the loop a few milliseconds)."""
    async for conn, channel, sender, p in queue:
        if isinstance(p, VoteRequest):
            v = (
                voter.handle(sender, p)
                if voter is not None
                else VoteAnswer(p.archive, p.epoch, reason="this broker takes no votes")
            )
            conn.send_protocol(channel, VOTE, v.encode())
        else:
            # The mirror may be storing a head of this archive (its accept job, in a
            # worker thread): the tree of what it holds is known once that is published.
            # Waited for here, briefly (polled: the job belongs to the mirror), rather
            # than refused: under load the mirror is often mid-accept, and a refusal
            # costs the leader a backoff.
            for _ in range(BUSY_POLLS):
                if not signer.busy(p.archive):
                    break
                await trio.sleep(BUSY_POLL_S)
            a = signer.handle(sender, p)
            conn.send_protocol(channel, ANSWER, a.encode())
        kick()
        await trio.lowlevel.checkpoint()


# ----------------------------------------------------------------- a broker's role


SCAN_S = 0.2  # how soon a new (or reopened) quorum partition written here gets its signer
PROPOSAL_TIMEOUT_S = 5.0  # a replica's answer to one proposal


class QuorumRole:
    """A cluster broker's part in quorum-signed partitions
    (``hyperkafka.quorum.partitions.enable``), built by broker/compose.py:

    * as a replica: the copies of quorum-signed archives its mirrors keep (`register`,
      from broker/mirror.py) are signed through `signer` for proposals from each
      archive's placed leader, arriving on the replication listener
      (broker/replication_server.py: `accept` and `serve`);
    * as a leader: `run` gives every quorum-signed partition this broker writes its
      `PartitionLog.quorum_sign`: the commit job (in a worker thread) asks the loop for a
      head signed by a quorum (`QuorumAssembler` over `LinkPeers`)."""

    def __init__(
        self,
        node_id: int,
        keypair: KeyPair,
        cluster: Cluster,
        address_of: Callable[[int], Awaitable[tuple[str, int]]],
    ) -> None:
        self.node_id = node_id
        self.keypair = keypair
        self.cluster = cluster
        self.address_of = address_of  # a peer's replication port
        self.followers: dict[bytes, tuple[str, FollowerLog]] = {}
        self.signer = ReplicaSigner(keypair, self._follower, self._leader_of, self._epoch_of)
        self.voter = ReplicaVoter(self._follower, lambda: cluster.membership.controller)
        self.peers: LinkPeers | None = None
        self.assemblers: dict[bytes, QuorumAssembler] = {}
        # failover (broker/takeover.py): the mirror's session of each quorum-signed
        # archive it follows here (its cancel scope, and an event set when it ended), and
        # the archives this broker took over as their elected leader (never followed again)
        self.sessions: dict[bytes, tuple[trio.CancelScope, trio.Event]] = {}
        self.led: set[bytes] = set()
        # the live replication connection of the mirror of each peer broker (by id): an
        # archive a failover moved to that broker is followed on it
        self.links: dict[int, ConnectionDriver] = {}

    # -- replica side

    def register(self, topic: str, lg: FollowerLog) -> None:
        """A mirror opened its copy of an archive: signed here if it is quorum-signed."""
        if is_quorum_signed(lg.manifest, lg.public_key):
            self.followers[lg.key] = (topic, lg)

    def forget(self, topic: str) -> None:
        for key in [k for k, (t, _) in self.followers.items() if t == topic]:
            del self.followers[key]

    def leads(self, key: bytes) -> bool:
        """Whether this broker took archive `key` over (a failover elected it): the
        mirror does not follow it any more."""
        return key in self.led

    def moved(self, key: bytes) -> bool:
        """Whether a failover recorded a leader for archive `key` (held here as a copy):
        its writer's mirror does not follow it any more; this broker writes it, or
        follows it from that leader (broker/takeover.py)."""
        if key in self.led:
            return True
        placement, index = self._placement(key)
        return placement is not None and index is not None and placement.epoch_of(index) > 0

    def _placement(self, key: bytes) -> tuple[Placement | None, int | None]:
        entry = self.followers.get(key)
        if entry is None:
            return None, None
        manifest = entry[1].manifest
        index = manifest_partition(manifest) if manifest is not None else None
        return self.cluster.membership.placements.get(entry[0]), index

    async def stop_session(self, key: bytes) -> None:
        """End the session following archive `key` (if any) and wait until it ended."""
        entry = self.sessions.get(key)
        if entry is not None:
            entry[0].cancel()
            await entry[1].wait()

    @contextlib.contextmanager
    def following(self, key: bytes) -> Iterator[trio.CancelScope]:
        """The mirror's session of archive `key` runs in the scope this gives, which a
        takeover (`release`) cancels."""
        scope, ended = trio.CancelScope(), trio.Event()
        self.sessions[key] = (scope, ended)
        try:
            yield scope
        finally:
            if self.sessions.get(key, (None, None))[0] is scope:
                del self.sessions[key]
            ended.set()

    async def release(self, key: bytes) -> None:
        """Stop the mirror's session of archive `key` for good (this broker leads it
        now) and wait until it ended: nothing but the leader writes the archive after."""
        self.led.add(key)
        await self.stop_session(key)

    def _follower(self, key: bytes) -> FollowerLog | None:
        entry = self.followers.get(key)
        return entry[1] if entry is not None else None

    def _leader_of(self, key: bytes) -> int | None:
        """The placed leader of archive `key`: the partition's leader its placement
        records after a failover (broker/cluster/failover.py), else the topic's writer."""
        placement, index = self._placement(key)
        if placement is None:
            return None
        return placement.leader_of(index) if index is not None else placement.writer

    def _epoch_of(self, key: bytes) -> int:
        """The leader epoch the placement of archive `key` records (0: none, or unknown)."""
        placement, index = self._placement(key)
        if placement is None or index is None:
            return 0
        return placement.epoch_of(index)

    def identify(self, public_key: bytes) -> int | None:
        """The broker whose published node key (etcd) is this Noise static key."""
        m = self.cluster.membership
        for i in set(m.members) | set(m.known):
            if i != self.node_id and node_key(m, i) == public_key:
                return i
        return None

    def accept(
        self, conn: Connection, queue: trio.MemorySendChannel[Queued]
    ) -> Callable[[str, bytes | None], ProtocolHandler | None]:
        return accept_proposals(conn, self.identify, queue)

    async def serve(
        self, queue: trio.MemoryReceiveChannel[Queued], kick: Callable[[], None]
    ) -> None:
        await serve_proposals(self.signer, queue, kick, self.voter)

    async def vote(self, node_id: int, request: VoteRequest) -> VoteAnswer:
        """`failover.Voters` of the controller: its own copy answers here (a replica
        takes no quorum channel from itself), the others over their links."""
        if node_id == self.node_id:
            return self.voter.handle(node_id, request)
        if self.peers is None:
            raise trio.BrokenResourceError("the quorum links are not up yet")
        return await self.peers.vote(node_id, request)

    # -- leader side

    async def _connect(self, node_id: int) -> trio.abc.Stream:
        host, port = await self.address_of(node_id)
        return await trio.open_tcp_stream(host, port)

    async def run(self, topics: Callable[[], list[tuple[str, int, PartitionLog, bool]]]) -> None:
        """Keep `quorum_sign` set on every quorum-signed partition written here (`topics()`
        gives (topic, index, log, written here)), until cancelled."""
        token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self.peers = LinkPeers(
                Ed25519KeyPair(self.keypair.public_key, self.keypair.secret_key),
                self._connect,
                nursery,
            )
            while True:
                for name, index, lg, own in topics():
                    if own and _needs_signer(lg):
                        self._lead(name, index, lg, token)
                await trio.sleep(SCAN_S)

    def lead_created(self, name: str, logs: list[tuple[int, PartitionLog]]) -> None:
        """Sign the partitions (index, log) of topic `name`, just created here, by a quorum
        of their placed replicas from their first commit: at once, so that a produce
        right after CreateTopics is not refused NOT_ENOUGH_REPLICAS for want of a signer
        until `run`'s next scan. Before `run` started (or without a placement yet) the
        scan sets them up instead."""
        if self.peers is None:
            return
        token = trio.lowlevel.current_trio_token()
        for index, lg in logs:
            if _needs_signer(lg):
                self._lead(name, index, lg, token)

    def lead(self, name: str, index: int, lg: PartitionLog) -> None:
        """Sign partition `index` of `name` (written here: a takeover made `lg` its
        writer) by a quorum of its placed replicas from its next commit."""
        self._lead(name, index, lg, trio.lowlevel.current_trio_token())

    def _lead(
        self, name: str, index: int, lg: PartitionLog, token: trio.lowlevel.TrioToken
    ) -> None:
        replicas = placed_replicas(self.cluster, name, index)
        manifest = lg.manifest
        if replicas is None or manifest is None or self.peers is None:
            return
        if placed_leader(self.cluster, name, index) not in (None, self.node_id):
            return  # a failover moved it away: this copy steps down (broker/takeover.py)
        asm = QuorumAssembler(
            self.node_id,
            self.keypair,
            manifest,
            replicas,
            self.peers,
            lg.block,
            lambda: lg.published_length,
            timeout_s=PROPOSAL_TIMEOUT_S,
            on_signed=functools.partial(self.cluster.signer_signed, lg.key),
        )
        self.assemblers[lg.key] = asm

        def quorum_sign(th: bytes, length: int, fork: int) -> bytes:
            # the commit job's worker thread: the proposals go out from the loop
            return trio.from_thread.run(asm.sign, th, length, fork, trio_token=token)

        lg.quorum_sign = quorum_sign
        log.info("partition %s-%d is signed by a quorum of %s", name, index, replicas)


def _needs_signer(lg: PartitionLog) -> bool:
    """A quorum-signed partition written here (not a replica's copy) with no quorum
    signer set up yet."""
    return lg.quorum_sign is None and not lg.replica and is_quorum_signed(lg.manifest, lg.public_key)


def quorum_role(node: Node, cluster: Cluster) -> QuorumRole:
    """The quorum role of a cluster broker: its node key signs; a peer's replication
    port is what its Kafka port's DescribeConfigs says (broker/replication_server.py)."""

    async def address_of(node_id: int) -> tuple[str, int]:
        b = cluster.brokers.get(node_id)
        if b is None:
            raise OSError(f"broker {node_id} is not registered")
        values = await discover_configs(b.host, b.port)
        address = values.get("hyperkafka.replication.address")
        if not address:
            raise OSError(f"broker {node_id} serves no replication port")
        return parse_host_port(address)

    return QuorumRole(node.config.node_id, node.store.node_keypair, cluster, address_of)


def own_partitions(node: Node) -> list[tuple[str, int, PartitionLog, bool]]:
    """(topic, index, log, written here) of the partitions written here that lack their
    signer: topics are skipped by their first partition (all of a topic's partitions are
    quorum-signed or none are), so a scan costs about one step per topic."""
    out = []
    for t in list(node.topics.values()):
        if t.mirrored or not t.partitions:
            continue
        first = t.partitions[0].log
        if not is_quorum_signed(first.manifest, first.public_key):
            continue
        out += [
            (t.name, p.index, p.log, True)
            for p in t.partitions
            if p.log.quorum_sign is None and not p.log.replica  # (a leader that stepped down)
        ]
    return out

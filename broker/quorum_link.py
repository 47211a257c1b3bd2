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

May import trio, `broker.cluster` and `storage`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from broker.cluster.signing import (
    ANSWER,
    MAX_PROPOSAL_BYTES,
    PROPOSE,
    PROTOCOL,
    Answer,
    MessageError,
    Proposal,
    ReplicaSigner,
)
from storage.replication.mux import Channel
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import Connection, ProtocolHandler
from storage.replication.trio_driver import ConnectionDriver

log = logging.getLogger("hyperkafka.quorum")

QUEUE = 64  # proposals waiting per connection on a replica
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0


# ----------------------------------------------------------------- the leader's side


@dataclass
class _Waiter:
    event: trio.Event = field(default_factory=trio.Event)
    answer: Answer | None = None


class _LinkHandler(ProtocolHandler):
    def __init__(self) -> None:
        self.channel: Channel | None = None
        self.opened = trio.Event()
        self.closed = False
        self.waiting: dict[tuple[bytes, int, int], _Waiter] = {}

    def on_open(self, conn: Connection, channel: Channel) -> None:
        self.channel = channel
        self.opened.set()

    def on_message(self, conn: Connection, channel: Channel, type_: int, payload: bytes) -> None:
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

    async def propose(self, node_id: int, proposal: Proposal) -> Answer:
        if node_id not in self.links:
            self.links[node_id] = QuorumLink(self.keypair)
            self.nursery.start_soon(self._keep, node_id)
        return await self.links[node_id].propose(proposal)


# ----------------------------------------------------------------- the replica's side


Queued = tuple[Connection, Channel, int, Proposal]


class _ServeHandler(ProtocolHandler):
    def __init__(self, sender: int, queue: trio.MemorySendChannel[Queued]) -> None:
        self.sender = sender
        self.queue = queue

    def on_message(self, conn: Connection, channel: Channel, type_: int, payload: bytes) -> None:
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
    signer: ReplicaSigner, queue: trio.MemoryReceiveChannel[Queued], kick: Callable[[], None]
) -> None:
    """Answer the queued proposals one after the other. `ReplicaSigner.handle` runs on
    the event loop: the mirror's sessions write the same archives from it, and an
    archive is not safe for two threads (its fsyncs cost the loop a few milliseconds)."""
    async for conn, channel, sender, p in queue:
        a = signer.handle(sender, p)
        conn.send_protocol(channel, ANSWER, a.encode())
        kick()
        await trio.lowlevel.checkpoint()

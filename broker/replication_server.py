"""The replication port: every archive this node holds, over the Hypercore protocol.

Owns `serve_replication` (a TCP listener; `hyperkafka serve --replication-listen`) and
`replication_config_entries` (what DescribeConfigs on the BROKER resource adds so a mirror
can find us), and in cluster mode reports to `Node.cluster` how far each broker's copy
of each archive written here has got (broker/cluster/). One connection carries every
archive a peer replicates from us, as Hypercore does: the peer opens a ``hypercore/alpha``
channel per archive (id = its discovery key) and we serve whichever archive that names
(the catalog, any topic partition, or any archive this node itself mirrors); a channel
for an archive we do not hold is rejected, the others carry on. Each channel answers
requests with proofs from the stored tree and announces each new signed head (live
updates after every group commit). A mirror of P partitions holds one connection with
P + 1 channels. Requests are answered round-robin across channels, a budget of bytes at
a time (`storage.replication.session.Connection`), so a channel catching up does not
hold back another's live tail; a channel that breaks the protocol is closed alone.
``Node.replication_connections`` counts the connections accepted (each one is logged).

Discovery, read-only broker configs (Kafka DescribeConfigs, resource type BROKER):
``hyperkafka.node.key`` = the node's public key (hex; the catalog archive's signer) and
``hyperkafka.replication.address`` = HOST:PORT of this port (absent when not serving).

May import trio, `broker.node`, `broker.config` and `storage` (incl. its replication
package); never the protocol codec.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import trio

from broker.config import ConfigEntry, ConfigSource, ConfigType
from broker.node import Node
from broker.quorum_link import QUEUE, Queued
from storage import PartitionLog
from storage.hypercore import discovery_key
from storage.replication import PartitionLogSource, RemoteProtocolError
from storage.replication.session import Connection, ReplicationChannel
from storage.replication.sources import ArchiveSource
from storage.replication.trio_driver import ConnectionDriver

log = logging.getLogger("hyperkafka.replication")

ANNOUNCE_POLL_S = 0.5  # catalog changes do not pass through the group commit: poll
# The port is open to anyone: a peer that has not finished the Noise handshake and the
# secretstream headers by then (a few round trips) is dropped, not held forever.
HANDSHAKE_TIMEOUT_S = 10.0


def replication_config_entries(node: Node) -> list[ConfigEntry]:
    entries = [ConfigEntry("hyperkafka.node.key", node.store.node_public_key.hex(),
                           ConfigSource.DEFAULT_CONFIG, ConfigType.STRING,
                           "This node's public key: it signs the catalog archive, which lists every topic's archive key.",
                           read_only=True)]
    if node.replication_address is not None:
        entries.append(ConfigEntry("hyperkafka.replication.address", node.replication_address,
                                   ConfigSource.DEFAULT_CONFIG, ConfigType.STRING,
                                   "Where this node serves its archives over the Hypercore replication protocol.",
                                   read_only=True))
    return entries


def archives(node: Node) -> list[PartitionLog]:
    """Every archive this node can serve: its catalog and every partition (written here or
    mirrored: any holder of a verified copy may serve it)."""
    logs: list[PartitionLog] = [node.store.catalog_log]
    for topic in node.topics.values():
        logs.extend(p.log for p in topic.partitions)
    return logs


class _Lookup:
    """Discovery key -> source, rebuilt when a key is not found (topics come and go)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._by_dk: dict[bytes, PartitionLog] = {}

    def __call__(self, dk: bytes) -> ArchiveSource | None:
        lg = self._by_dk.get(dk)
        if lg is None or lg.closed:  # (closed: replaced by a reopen, Node.retry_offline)
            lg = self._rebuild().get(dk)
        return PartitionLogSource(lg) if lg is not None else None

    def _rebuild(self) -> dict[bytes, PartitionLog]:
        self._by_dk = {discovery_key(lg.key): lg for lg in archives(self.node)}
        return self._by_dk


class _Progress:
    """Cluster mode: reports what the peer says it holds of the archive of one channel
    (its Hypercore ``range``/``bitfield`` messages) to `Node.cluster`, once the peer is
    known to be a broker of the cluster (by its Noise static key, which is its node
    key)."""

    def __init__(self, node: Node, conn: Connection, channel: ReplicationChannel) -> None:
        self.node = node
        self.conn = conn
        self.channel = channel
        self.key: bytes | None = None
        self.broker: int | None = None
        self.reported = -1

    def update(self) -> None:
        cluster, source = self.node.cluster, self.channel.source
        if source is None:
            return
        if self.key is None:
            broker = cluster.broker_for_identity(self.conn.remote_public_key)
            if broker is None or not cluster.writes(source.key):
                return  # a stranger's mirror, an archive written elsewhere, or not discovered yet
            self.key, self.broker = source.key, broker
            cluster.connected(source.key, broker)
        assert self.broker is not None
        length = self.channel.remote_contiguous_length
        # Nothing is reported before the peer's first range: a fresh channel's 0 would
        # take a caught-up mirror out of the ISR until its range arrives.
        if length != self.reported and (length > 0 or self.reported > 0):
            self.reported = length
            cluster.acked(self.key, self.broker, length)

    def close(self) -> None:
        if self.key is not None and self.broker is not None:
            self.node.cluster.disconnected(self.key, self.broker)
            self.key = None


async def _connection(node: Node, lookup: _Lookup, stream: trio.SocketStream) -> None:
    node.replication_connections += 1
    peer = "?"
    with contextlib.suppress(OSError):
        host, port = stream.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    log.info("replication connection %d from %s", node.replication_connections, peer)
    conn = Connection(initiator=False, lookup=lookup)
    progress: dict[ReplicationChannel, _Progress] = {}

    def changed(channels: list[ReplicationChannel]) -> None:
        for ch in channels:
            p = progress.get(ch)
            if p is None:
                if ch.closed or ch.source is None:
                    continue
                p = progress[ch] = _Progress(node, conn, ch)
            if ch.error is not None:
                log.info("replication peer %s: channel closed: %s", peer, ch.error)
            if ch.closed:
                p.close()
                del progress[ch]
                node.metrics.channels.pop(ch, None)
            else:
                p.update()
                if ch not in node.metrics.channels and conn.stream.established:
                    node.metrics.channels[ch] = conn.remote_public_key.hex()[:16]  # /metrics

    driver = ConnectionDriver(stream, conn, changed)
    try:
        async with trio.open_nursery() as nursery:

            async def announcer() -> None:
                while True:
                    with trio.move_on_after(ANNOUNCE_POLL_S):
                        await node.wait_for_data()
                    conn.notify_append()
                    for p in progress.values():
                        p.update()  # (the peer may have become known meanwhile)
                    driver.kick()

            async def handshake_deadline() -> None:
                await trio.sleep(HANDSHAKE_TIMEOUT_S)
                if not conn.stream.established:
                    raise RemoteProtocolError(f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s")

            nursery.start_soon(announcer)
            nursery.start_soon(handshake_deadline)
            if node.quorum is not None:  # proposals of quorum-signed partitions' leaders
                send, recv = trio.open_memory_channel[Queued](QUEUE)
                conn.accept = node.quorum.accept(conn, send)
                nursery.start_soon(node.quorum.serve, recv, driver.kick)
            await driver.run()
            nursery.cancel_scope.cancel()
    except Exception as exc:  # one peer's failure (a group from the nursery) never stops the port
        # (leaves of nested groups too: a peer gone mid-write is a group of its own)
        leaves = _leaves(exc) if isinstance(exc, ExceptionGroup) else [exc]
        for e in leaves:
            if isinstance(e, RemoteProtocolError):
                log.info("replication peer %s dropped: %s", peer, e)
            elif not isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)):
                log.warning("replication connection failed", exc_info=e)
    finally:
        for ch, p in progress.items():
            p.close()
            node.metrics.channels.pop(ch, None)
        await trio.aclose_forcefully(stream)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


async def serve_replication(node: Node, host: str, port: int, *,
                            task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    shown = host if host not in ("0.0.0.0", "::", "") else node.config.advertised[0]
    node.replication_address = f"{shown}:{bound[1]}"
    log.info("serving archives over the Hypercore protocol on %s", node.replication_address)
    task_status.started(listeners)
    await trio.serve_listeners(partial(_connection, node, _Lookup(node)), listeners)

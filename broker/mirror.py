"""Mirrors: follow other nodes' archives, verify them, serve them read-only over Kafka.

Owns `run_replication` (started by `broker.compose.run_node` when `--replication-listen` or
`--mirror` is set) and `NodeMirror`, one per `--mirror HOST:PORT[@NODEKEY]`:

1. Discovery over Kafka: DescribeConfigs on the BROKER resource of HOST:PORT gives
   ``hyperkafka.node.key`` and ``hyperkafka.replication.address``
   (broker/replication_server.py). The key is pinned (``@NODEKEY``) or trusted on first
   use and then remembered in ``<data_dir>/__mirrors/peers.json``; a node presenting
   another key later is refused (logged, retried with backoff, nothing stored).
2. The catalog archive (key = archive_key(node key)) is followed live into a
   `storage.follower.FollowerLog`; every verified head is replayed into topics, and each
   new topic is attached to the node (`Node.attach_mirrored`) with one follower archive
   per partition, whose archive key comes from the verified catalog (so the whole chain
   of trust is the node key). The partition's signer key is learned from its Hypercore
   manifest, which must hash to that archive key.
3. Everything is followed over ONE replication connection to the node, as Hypercore
   does: a ``hypercore/alpha`` channel per archive (catalog included) on one Noise
   handshake (`storage.replication.session.Connection`, run by `ConnectionDriver`).
   New topics open channels on the live connection, deleted ones (cluster mode) close
   theirs. A channel that fails (a bad proof, say) is opened again with exponential
   backoff (0.2 s .. 5 s) while the others go on; when the connection is lost, every
   channel ends and `run` reconnects with the same backoff, then every archive
   resumes from its verified tree. Before following, a probe channel fetches the
   peer's signed head and compares it with ours (`FollowerLog.check_conflict`):
   disagreeing valid heads freeze the archive with evidence on disk. A block that fails
   authentication on read is fetched again (`ReplicationChannel.refetch`) and
   rewritten.
4. While the writer is unreachable everything already verified stays served; topics
   known from the local catalog copy are attached at start-up, before any connection.

Layout: ``<data_dir>/__mirrors/<node key hex>/{__catalog,<topic>-<partition>}`` (storage/
FORMAT.md section 10). A topic deleted on its writer stays served from the copy (logged);
in cluster mode the copy is deleted, as Kafka's replicas are. Not done: retention on
mirrors, mirroring a mirror's copy of a third node.

Cluster mode (broker/cluster/): `run_replication` starts one NodeMirror per other broker
registered in etcd (as it registers, its node key pinned from its registration), which
knows that broker's id (the leader of what it mirrors), connects
with this node's key as its Noise static key (the writer counts our `range` messages as
this broker's progress), tells `Node.cluster` the peer's key and rack once discovered,
and `poll_leader_isr` keeps the ISR the peer reports for what it writes (and the
controller it names). The peer's ``__consumer_offsets`` and ``__transaction_state``
archives, which are no Kafka topics here, are followed too, into ``<node key
hex>/<topic>-0`` (they cannot clash with our own, at the top of the data dir), and handed
to `Cluster.copies` for the coordinator that takes a partition over from that peer
(broker/groups/coordinator.py, broker/transactions/coordinator.py).

May import trio, `broker.node`, `broker.config`, `broker.protocol` (client side, for
discovery), `broker.shape`, `broker.replication_server` and `storage`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import shutil
import socket
import struct
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import trio

from broker.cluster import Cluster, PeerCopy, signed_blocks
from broker.cluster.liveness import open_peer_stream
from broker.cluster.membership import Member
from broker.cluster.replicas import COPIED_TOPICS
from broker.config import ClusterBroker, ConfigError, parse_host_port
from broker.node import Node, Topic
from broker.protocol.codec import decode_response, encode_request
from broker.protocol.errors import ProtocolError
from broker.protocol.header import RequestHeader
from broker.shape import shape
from storage import PartitionLog
from storage.catalog import TopicRecord, apply_change, decode_changes
from storage.errors import StorageError
from storage.follower import Equivocation, FollowerLog, ForkChanged, VerificationFailed
from storage.fs import OsFileSystem
from storage.hypercore import Node as TreeNode
from storage.hypercore.multisig import HeadSigner, head_manifest
from storage.manifest_file import MANIFEST_FILE, read_manifest
from storage.progress import Progress
from storage.replication import MemoryArchive, RemoteProtocolError, ReplicationError
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import Connection, ReplicationChannel
from storage.replication.trio_driver import ConnectionDriver
from storage.store import CATALOG_DIR, MIRRORS_DIR

log = logging.getLogger("hyperkafka.mirror")

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 30.0  # a probe (manifest, head) is a few round trips
REPAIR_POLL_S = 0.25
PROGRESS_INTERVAL_S = 5.0  # between log lines of an archive catching up
PEERS_FILE = "peers.json"
ISR_POLL_MIN_S = 0.1
ISR_POLL_MAX_S = 1.0


REQUEST_CORRELATION_ID = 1
# The client id of every request one broker sends another (`kafka_request`): a broker
# does not forward again what another broker forwarded to it (no loop between two
# brokers whose views of the controller differ for a moment).
BROKER_CLIENT_ID = "hyperkafka-mirror"
# Discovery answers (DescribeConfigs of one broker, Metadata) are kilobytes: a peer that
# announces more (or a negative size) is not a broker we talk to, and is not buffered.
MAX_DISCOVERY_RESPONSE = 1 << 20


class DiscoveryError(Exception):
    """The peer's Kafka port did not tell us its node key / replication address."""


@dataclasses.dataclass(frozen=True)
class MirrorTarget:
    host: str
    port: int
    pinned: bytes | None = None

    @classmethod
    def parse(cls, text: str) -> MirrorTarget:
        addr, _, key = text.partition("@")
        host, port = parse_host_port(addr)
        pinned = None
        if key:
            try:
                pinned = bytes.fromhex(key)
            except ValueError:
                raise ConfigError(f"--mirror {text}: node key must be hex") from None
            if len(pinned) != 32:
                raise ConfigError(f"--mirror {text}: node key must be 32 bytes")
        return cls(host, port, pinned)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# ---------------------------------------------------------------------------- discovery


async def kafka_request(host: str, port: int, api_key: int, version: int, schema: str,
                        body: dict[str, object]) -> Any:
    """One Kafka request (kio's `schema`, e.g. "describe_configs") to HOST:PORT on a fresh
    connection; returns the decoded response."""
    module = importlib.import_module(f"kio.schema.{schema}.v{version}.request")
    name = "".join(part.title() for part in schema.split("_")) + "Request"
    req = shape(getattr(module, name), body)
    header = RequestHeader(api_key, version, REQUEST_CORRELATION_ID, BROKER_CLIENT_ID)
    with trio.fail_after(CONNECT_TIMEOUT_S):
        stream = await open_peer_stream(host, port)
        try:
            await stream.send_all(encode_request(header, req))
            buf = bytearray()
            while len(buf) < 4 or len(buf) < 4 + struct.unpack_from(">i", buf)[0]:
                announced = struct.unpack_from(">i", buf)[0] if len(buf) >= 4 else 0
                if not 0 <= announced <= MAX_DISCOVERY_RESPONSE:
                    raise DiscoveryError(f"{host}:{port} announced a {announced}-byte answer")
                data = await stream.receive_some(1 << 16)
                if not data:
                    raise DiscoveryError(f"{host}:{port} closed the connection")
                buf += data
        finally:
            await trio.aclose_forcefully(stream)
    size = struct.unpack_from(">i", buf)[0]
    try:
        correlation_id, resp = decode_response(bytes(buf[4 : 4 + size]), api_key, version)
    except ProtocolError as exc:  # whatever answers there, it is not a Kafka broker
        raise DiscoveryError(f"{host}:{port} sent no Kafka response: {exc}") from None
    if correlation_id != REQUEST_CORRELATION_ID:
        raise DiscoveryError(f"{host}:{port} answered correlation id {correlation_id}, not {REQUEST_CORRELATION_ID}")
    return resp


async def discover_configs(host: str, port: int) -> dict[str, str]:
    """The node's broker configs (DescribeConfigs on the BROKER resource), by name."""
    resp = await kafka_request(host, port, 32, 1, "describe_configs", {
        "resources": [{"resource_type": 4, "resource_name": "", "configuration_keys": None}],
        "include_synonyms": False,
    })
    values: dict[str, str] = {}
    for result in resp.results:
        for c in result.configs:
            if c.value is not None:
                values[c.name] = c.value
    return values


def _node_key(host: str, port: int, values: dict[str, str]) -> bytes:
    key_hex = values.get("hyperkafka.node.key")
    if not key_hex:
        raise DiscoveryError(f"{host}:{port} does not publish hyperkafka.node.key (not a hyperkafka node?)")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        raise DiscoveryError(f"{host}:{port}: bad hyperkafka.node.key") from None
    if len(key) != 32:
        raise DiscoveryError(f"{host}:{port}: bad hyperkafka.node.key")
    return key


async def discover(host: str, port: int) -> tuple[bytes, str | None]:
    """(node key, replication address or None) from the node's Kafka listener."""
    values = await discover_configs(host, port)
    return _node_key(host, port, values), values.get("hyperkafka.replication.address")


# ---------------------------------------------------------------------------- one archive


class _Sink:
    """Delivers blocks into a FollowerLog; a verified head makes its blocks readable at
    once (`FollowerLog.reveal`, Kafka readers woken), then queues in `heads` and a task
    of `_drive` stores it (fsyncs in a worker thread) while the connection keeps
    receiving the next blocks."""

    def __init__(self, log_: FollowerLog, on_head: Callable[[], None]) -> None:
        self.log = log_
        self.on_head = on_head
        # set while the channel catches up to the length the peer announced; logs a
        # progress line every PROGRESS_INTERVAL_S then, and nothing once live
        self.progress: Progress | None = None
        self.catch_up_to: Callable[[], int | None] = lambda: None
        self.heads: list[tuple[int, int, bytes, list[TreeNode]]] = []
        self._wake = trio.Event()
        self._lock = trio.Lock()  # one stored head at a time (one job in flight per log)
        # a head over removed blocks whose offsets the next block kept tells (FollowerLog)
        self._deferred: tuple[int, int, bytes, list[TreeNode]] | None = None

    def put_block(self, index: int, value: bytes | memoryview, leaf: TreeNode) -> None:
        self.log.put_block(index, value, leaf)
        if self.progress is not None:
            self.progress.advance()
        if self._deferred is not None and self.log.head_ready(self._deferred[0]):
            deferred, self._deferred = self._deferred, None
            self.put_head(*deferred)

    def held_length(self) -> int:
        return self.log.held_length()

    def holds_tree(self, start: int, length: int, roots: Sequence[TreeNode]) -> bool:
        """The blocks under a verified head are held already (FollowerLog.holds_tree: a
        quorum-signed archive's replica took them in proposals): none is fetched again."""
        return self._deferred is None and self.log.holds_tree(start, length, roots)

    def put_removed(self, index: int, leaf: TreeNode) -> None:
        """A block the writer's cleaner removed: its verified leaf, no bytes (FollowerLog)."""
        self.log.put_removed(index, leaf)
        if self.progress is not None:
            self.progress.advance()

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[TreeNode]) -> None:
        if not self.log.head_ready(length):
            self._deferred = (length, fork, signature, list(roots))
            return
        self.heads.append((length, fork, signature, list(roots)))
        if self.progress is not None:
            if length >= (self.catch_up_to() or 0):
                self.progress.finish()  # caught up: live from here on
                self.progress = None
            else:
                self.progress.tick()
        self._wake.set()
        # Every block under the head is verified and written: readable now; storing the
        # head (fsyncs) follows in `run` and is no part of the replication lag.
        if self.log.reveal(length):
            self.on_head()

    def repair_block(self, index: int, value: bytes) -> None:
        self.log.repair_block(index, value)
        self.on_head()

    async def store_heads(self) -> None:
        async with self._lock:
            while self.heads:
                if len(self.heads) > 1:  # behind: the newest head covers the older ones
                    del self.heads[:-1]
                aj = self.log.prepare_accept(*self.heads.pop(0))
                if aj is None:
                    continue
                try:
                    # Shielded: trio delivers a pending cancel (shutdown, the channel's end)
                    # before it starts the worker thread, which left the prepared head
                    # unstored and its revealed blocks taken back. Once started, the thread
                    # is waited for anyway (not abandoned on cancel): a few fsyncs.
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(self.log.run_accept, aj)
                finally:  # publish, or forget a failed run (StorageError: poisoned)
                    self.log.finish_accept(aj)
                self.on_head()

    async def run(self, stored: Callable[[], Awaitable[None]]) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self.store_heads()
            await stored()


@contextlib.contextmanager
def _single_error() -> Iterator[None]:
    """A nursery wraps a task's exception in a group; callers here want the exception
    (the first one when several tasks failed the same way, e.g. every channel of a
    connection that was lost)."""
    try:
        yield
    except BaseExceptionGroup as group:
        errs = _leaves(group)
        if errs and all(isinstance(e, Exception) and type(e) is type(errs[0]) for e in errs):
            raise errs[0] from None
        # Being cancelled while the connection also broke (a shutdown closes both ends
        # at once): the cancellation wins, as if the break had come a moment later.
        # Otherwise the group would escape `NodeMirror.run`, which handles each error.
        cancelled = [e for e in errs if isinstance(e, trio.Cancelled)]
        if cancelled and all(isinstance(e, trio.Cancelled | Exception) for e in errs):
            raise cancelled[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions of `group` and of the groups nested in it."""
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


async def _drive(link: ConnectionDriver, ch: ReplicationChannel, *,
                 until: Callable[[], bool] | None = None,
                 repair_log: FollowerLog | None = None, sink: _Sink | None = None) -> None:
    """Run follower channel `ch` of `link` until it closes or `until()` holds, then close
    it; raises the channel's error if it failed, BrokenResourceError if the connection
    went. With `repair_log`, blocks of it that fail authentication on read are fetched
    again."""

    async def stored() -> None:
        # Tell the peer what a stored signed head now covers (a Hypercore `range`): the
        # writer of a cluster counts it for the ISR and acks=all.
        assert sink is not None
        ch.announce_stored(signed_blocks(sink.log.log))
        link.kick()

    async def repairer(lg: FollowerLog) -> None:
        asked: set[int] = set()
        while True:
            await trio.sleep(REPAIR_POLL_S)
            bad = lg.bad_block()
            if bad is not None and bad not in asked:
                asked.add(bad)
                log.warning("%s: block %d failed authentication on read; fetching it again",
                            lg.path, bad)
                ch.refetch(bad)
                link.kick()
            elif bad is None:
                asked.clear()

    try:
        with _single_error():
            async with trio.open_nursery() as nursery:
                if repair_log is not None:
                    nursery.start_soon(repairer, repair_log)
                if sink is not None:
                    nursery.start_soon(sink.run, stored)
                link.kick()
                while not ch.done and not (until is not None and until()):
                    await link.wait(ch)
                if ch.error is not None:
                    raise ch.error
                if sink is not None:
                    await sink.store_heads()  # what was verified before the channel closed
                nursery.cancel_scope.cancel()
    except Exception:
        if sink is not None and sink.heads:
            # their blocks are readable already (revealed): store them, or the next
            # channel's discard_unsigned would take them back from under readers
            with trio.CancelScope(shield=True):
                await sink.store_heads()
        raise
    finally:
        ch.close()
        link.kick()


async def _connect(address: str) -> trio.SocketStream:
    host, port = parse_host_port(address)
    with trio.fail_after(CONNECT_TIMEOUT_S):
        stream = await open_peer_stream(host, port)
    # A live connection may rightly see nothing for hours (an idle writer), so no read
    # timeout; TCP keepalive finds a writer whose host vanished (~25 s on Linux).
    sock = stream.socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return stream


async def _run_link(link: ConnectionDriver) -> None:
    """The connection's life, as an error when it ends: its channels cannot go on."""
    await link.run()
    raise trio.BrokenResourceError("the peer closed the replication connection")


@contextlib.asynccontextmanager
async def _link_to(target: str | ConnectionDriver,
                   keypair: Ed25519KeyPair | None = None) -> AsyncIterator[ConnectionDriver]:
    """`target` itself if it is a live connection, else a connection to address `target`
    for the duration of the block."""
    if isinstance(target, ConnectionDriver):
        yield target
        return
    link = ConnectionDriver(await _connect(target), Connection(initiator=True, keypair=keypair))
    with _single_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run_link, link)
            yield link
            nursery.cancel_scope.cancel()


async def learn_public_key(target: str | ConnectionDriver, key: bytes) -> HeadSigner:
    """The signer key of archive `key` (the whole manifest of a quorum-signed archive),
    from its manifest (verified to hash to `key`), on a channel of connection `target`
    (or a connection of its own to that address)."""
    async with _link_to(target) as link:
        ch = link.conn.follow(key, MemoryArchive(bytes(32)), window=0)
        with trio.fail_after(PROBE_TIMEOUT_S):
            await _drive(link, ch, until=lambda: ch.public_key is not None)
    if ch.public_key is None:
        raise RemoteProtocolError("peer did not send the archive's manifest")
    return ch.public_key


async def probe_head(target: str | ConnectionDriver, lg: FollowerLog) -> None:
    """Fetch the peer's current signed head and hold it against ours: raises Equivocation
    (frozen, evidence kept) when they disagree at any length, ForkChanged when the writer
    truncated, VerificationFailed when it is forged. A longer head comes with the proof
    of its tree at our length (Hypercore's conflict check). On a channel of connection
    `target` (or a connection of its own to that address)."""
    ours = lg.verified_tree().length
    async with _link_to(target) as link:
        ch = link.conn.follow(lg.key, MemoryArchive(lg.head_signer), window=0,
                              public_key=lg.head_signer, probe_at=ours or None)
        with trio.fail_after(PROBE_TIMEOUT_S):
            await _drive(link, ch,
                         until=lambda: ch.latest_head is not None or ch.remote_length == 0)
    head = ch.latest_head
    if head is not None:
        proof = ch.latest_proof if head[0] > ours else None
        lg.check_conflict(*head, proof=proof)


async def follow_once(link: ConnectionDriver, lg: FollowerLog, on_head: Callable[[], None],
                      channel: Callable[[ReplicationChannel | None], None] | None = None) -> None:
    """Probe, then follow archive `lg` live on a channel of `link` until the channel
    closes (raising its error if it failed). `channel` hears of the live channel when it
    opens (and None when it ends)."""
    await probe_head(link, lg)
    lg.discard_unsigned()  # blocks of an interrupted channel: their head never came
    sink = _Sink(lg, on_head)
    have = lg.verified_tree()
    ch = link.conn.follow(lg.key, sink, live=True, have=have,
                          public_key=lg.head_signer, fork=lg.follow_fork)
    sink.catch_up_to = lambda: ch.remote_length
    sink.progress = Progress(f"{lg.path}: catching up", lambda: (ch.remote_length or 0) - have.length,
                             unit="blocks", logger=log, interval=PROGRESS_INTERVAL_S)
    if channel is not None:
        channel(ch)
    try:
        await _drive(link, ch, repair_log=lg, sink=sink)
    finally:
        if channel is not None:
            channel(None)


async def follow_forever(link: ConnectionDriver, lg: FollowerLog, on_head: Callable[[], None],
                         name: str,
                         channel: Callable[[ReplicationChannel | None], None] | None = None) -> None:
    """Follow one archive live on a channel of `link`, opening it again with backoff
    when it fails, until frozen or cancelled. Raises BrokenResourceError when the
    connection is lost (the caller reconnects and follows every archive again)."""
    backoff = BACKOFF_MIN_S
    while True:
        if lg.frozen or lg.reorg_needed:
            # said at ERROR once, when found (or when the archive was opened frozen)
            log.debug("%s: not following: %s", name, lg.frozen or lg.reorg_needed)
            return
        started = trio.current_time()
        try:
            await follow_once(link, lg, on_head, channel)
        except Equivocation:
            return  # FollowerLog logged it (once, with where the evidence is)
        except ForkChanged as exc:
            log.error("%s: stopped following: %s", name, exc)
            return
        except (trio.TooSlowError, ReplicationError, VerificationFailed) as exc:
            log.info("%s: replication interrupted: %s", name, exc)
        except StorageError as exc:
            log.error("%s: stopped following: %s", name, exc)
            return
        if trio.current_time() - started > 10:
            backoff = BACKOFF_MIN_S
        await trio.sleep(backoff)
        backoff = min(backoff * 2, BACKOFF_MAX_S)


# ---------------------------------------------------------------------------- one node


class NodeMirror:
    """Everything this node mirrors from one other node."""

    def __init__(self, node: Node, target: MirrorTarget, broker_id: int | None = None,
                 cluster: Cluster | None = None) -> None:
        self.node = node
        self.target = target
        # Cluster mode: the peer's broker id (the leader of what it writes), and our node
        # key as the Noise static key, by which the writer tells our progress apart.
        self.broker_id = broker_id
        # Cluster mode: the etcd view of the cluster the peer belongs to (None: the
        # mirror of a node outside any cluster, a --mirror target).
        self.cluster = cluster
        self.keypair: Ed25519KeyPair | None = None
        if broker_id is not None:
            kp = node.store.node_keypair
            self.keypair = Ed25519KeyPair(kp.public_key, kp.secret_key)
        self.root = os.path.join(str(node.config.data_dir), MIRRORS_DIR)
        self.node_key: bytes | None = target.pinned
        self.catalog: FollowerLog | None = None
        self.topics: dict[str, TopicRecord] = {}
        self.attached: dict[str, tuple[TopicRecord, list[FollowerLog]]] = {}
        self.skipped: set[str] = set()  # names taken by a local topic (or another mirror)
        self._spawn: trio.Nursery | None = None
        self._scopes: dict[str, set[trio.CancelScope]] = {}  # per topic: its follow tasks
        self._link: ConnectionDriver | None = None  # the live connection to the writer
        self._catalog_changed = trio.Event()
        # Cluster mode: our copies of the peer's archives of the internal topics
        # (COPIED_TOPICS: its __consumer_offsets, its __transaction_state), by topic, for
        # the coordinator that takes a partition over from it; never Kafka topics here.
        self.copies: dict[str, PeerCopy] = {}
        self._copy_followers: dict[str, FollowerLog] = {}  # the sinks of the copies' logs
        if broker_id is not None:  # quorum-signed topics whose etcd record went (Node.drop_topic)
            node.topic_dropped.append(self._dropped)

    # -- persistence of the trusted key ---------------------------------------

    def _peers(self) -> dict[str, str]:
        with contextlib.suppress(OSError, ValueError), open(os.path.join(self.root, PEERS_FILE)) as f:
            data = json.load(f)
            if isinstance(data, dict):
                return {str(k): str(v) for k, v in data.items()}
        return {}

    def _remember(self, key: bytes) -> None:
        peers = self._peers()
        peers[self.target.address] = key.hex()
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, PEERS_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(peers, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, PEERS_FILE))

    @property
    def dir(self) -> str:
        assert self.node_key is not None
        return os.path.join(self.root, self.node_key.hex())

    # -- local copy --------------------------------------------------------------

    def open_local(self) -> None:
        """Open the catalog copy and attach every topic whose archives we hold."""
        assert self.node_key is not None
        if self.catalog is None:
            self.catalog = FollowerLog.open_replica(os.path.join(self.dir, CATALOG_DIR), self.node_key)
        self._replay_catalog()
        for name, rec in sorted(self.topics.items()):
            if name in self.attached or name in self.copies:
                continue
            keys: list[HeadSigner] = []
            for p in range(rec.partitions):
                pdir = self._partition_dir(name, p)
                kfile = os.path.join(pdir, "public_key")
                if os.path.exists(os.path.join(pdir, MANIFEST_FILE)):
                    manifest = read_manifest(OsFileSystem(), pdir)  # a quorum-signed archive
                    assert manifest is not None
                    keys.append(manifest)
                    continue
                if not os.path.exists(kfile):
                    break
                with open(kfile, "rb") as f:
                    keys.append(f.read())
            if not keys:
                continue
            if name in COPIED_TOPICS:
                self._open_copy(rec, keys[0])
            elif len(keys) < rec.partitions:
                # The writer grew the topic before we learned the new archives' keys:
                # serve the partitions we hold; `_follow_changes` adds the rest.
                self._attach(dataclasses.replace(rec, partitions=len(keys),
                                                 archive_keys=rec.archive_keys[: len(keys)]), keys)
            else:
                self._attach(rec, keys)

    def _partition_dir(self, topic: str, partition: int) -> str:
        return os.path.join(self.dir, f"{topic}-{partition}")

    def _replay_catalog(self) -> None:
        cat = self.catalog
        assert cat is not None
        topics: dict[str, TopicRecord] = {}
        offset = cat.log_start_offset
        while offset < cat.high_watermark:
            r = cat.read(offset, 1 << 20)
            data = r.read()
            pos = 0
            while pos < len(data):
                size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
                for change in decode_changes(data[pos : pos + size]):
                    apply_change(topics, change)
                pos += size
            offset = r.end_offset
        gone = set(self.topics) - set(topics)
        if self.broker_id is not None:
            # Cluster mode: a topic deleted on its writer (the controller) is deleted on
            # every broker, as in Kafka, so that Metadata agrees everywhere and the name
            # can be created again.
            for name in sorted(gone):
                self._detach(name)
            self.topics = topics
            return
        for name in gone:
            log.warning("mirror of %s: topic %s was deleted on its writer; keeping the copy served",
                        self.target.address, name)
        self.topics.update(topics)

    def _detach(self, name: str, why: str = "") -> None:
        """Stop following, stop serving and delete our copy of topic `name` (`why`: where
        the deletion was seen, for the log; its writer's catalog by default)."""
        self.topics.pop(name, None)
        self.skipped.discard(name)
        attached = self.attached.pop(name, None)
        if attached is None:
            return
        logs = [self._held(lg) for lg in attached[1]]  # (before the quorum role forgets them)
        for scope in self._scopes.pop(name, set()):
            scope.cancel()
        self.node.detach_mirrored(name)
        self.node.writer_catalogs.pop(name, None)
        if self.node.quorum is not None:
            self.node.quorum.forget(name)
        for p, lg in enumerate(logs):
            with contextlib.suppress(Exception):
                lg.close()
            shutil.rmtree(self._partition_dir(name, p), ignore_errors=True)
        log.info("topic %s was deleted %s; deleted our copy", name, why or f"on {self.target.address}")

    def _dropped(self, name: str, topic_id: uuid.UUID | None) -> None:
        """Cluster mode: quorum-signed topic `name` was deleted (its etcd record is gone,
        broker/placed_topics.py). `topic_id`: if it is the one we mirror, stop serving it
        and delete our copy (its writer may be dead, and never say so in its catalog).
        None: the name is free here again, so a topic of that name this mirror skipped
        (it clashed with the deleted one) is attached now."""
        if topic_id is None:
            if name in self.skipped:
                self.skipped.discard(name)
                self._catalog_changed.set()
            return
        attached = self.attached.get(name)
        if attached is not None and attached[0].topic_id == topic_id:
            self._detach(name, "in etcd (its record is gone)")

    def _attach(self, rec: TopicRecord, public_keys: list[HeadSigner]) -> bool:
        """Open the follower archives of `rec` and serve them. False on a name clash."""
        if rec.name.startswith("__"):
            return False  # the writer's internal topics (its group offsets) stay its own
        if rec.topic_id in self.node.dropped_ids:
            return False  # deleted in etcd; its old writer's catalog lists it until it drops it
        if rec.name in self.node.topics:
            log.error("mirror of %s: topic %s exists here already; not mirroring it",
                      self.target.address, rec.name)
            self.skipped.add(rec.name)
            return False
        logs = self._open_partitions(rec, 0, public_keys)
        plogs: list[PartitionLog] = [lg.log for lg in logs]
        topic: Topic = self.node.attach_mirrored(rec, plogs, leader_id=self.broker_id)
        if self.node_key is not None and self.catalog is not None:
            self.node.writer_catalogs[rec.name] = (self.node_key, self.catalog.log)
        self.attached[rec.name] = (rec, logs)
        log.info("mirroring topic %s (%d partitions) from %s", rec.name, rec.partitions, self.target.address)
        if self._spawn is not None and self._link is not None:
            for p, lg in enumerate(logs):
                self._spawn.start_soon(self._follow_partition, self._link, topic, p, lg)
        return True

    def _open_partitions(self, rec: TopicRecord, first: int, public_keys: list[HeadSigner]) -> list[FollowerLog]:
        """Follower archives of partitions `first`, `first + 1`... of `rec`, each key
        checked against the catalog's archive key, their files on the node's budget."""
        logs: list[FollowerLog] = []
        for p, pk in enumerate(public_keys, start=first):
            if head_manifest(pk).hash() != rec.archive_keys[p]:
                raise VerificationFailed(f"{rec.name}-{p}: signer key does not match the catalog's archive key")
            logs.append(FollowerLog.open_replica(self._partition_dir(rec.name, p), pk,
                                                 config=self.node.config.log_config(rec.configs)))
        if self.node.store.handles is not None:
            for lg in logs:
                lg.attach_handles(self.node.store.handles)
        if self.node.quorum is not None:  # a replica signs the quorum-signed ones
            for lg in logs:
                self.node.quorum.register(rec.name, lg)
        return logs

    async def _follow_changes(self, link: ConnectionDriver, rec: TopicRecord) -> None:
        """An attached topic whose catalog record changed on the writer: AlterConfigs
        (new overrides) or CreatePartitions (more partitions, each a new archive whose key
        we learn from the writer). Kafka never shrinks a topic, so fewer partitions than
        we serve is the writer's catalog contradicting itself: logged, not followed."""
        entry = self.attached[rec.name]
        old, logs = entry
        if rec == old:
            return
        if rec.partitions < len(logs) or rec.archive_keys[: len(logs)] != old.archive_keys[: len(logs)]:
            log.error("mirror of %s: topic %s: the catalog no longer lists the archives we follow; "
                      "keeping the copy served", self.target.address, rec.name)
            self.attached[rec.name] = (rec, logs)  # (logged once, not on every change)
            return
        keys = [await learn_public_key(link, rec.archive_keys[p]) for p in range(len(logs), rec.partitions)]
        if self.attached.get(rec.name) is not entry:
            return  # detached (or changed again) while we waited
        more = self._open_partitions(rec, len(logs), keys)
        plogs: list[PartitionLog] = [lg.log for lg in more]
        topic = self.node.update_mirrored(rec, plogs)
        self.attached[rec.name] = (rec, logs + more)
        if more:
            log.info("topic %s from %s grown to %d partitions", rec.name, self.target.address, rec.partitions)
        if old.configs != rec.configs:
            log.info("topic %s from %s: configs now %s", rec.name, self.target.address, dict(rec.configs))
        if self._spawn is not None:
            for p, lg in enumerate(more, start=len(logs)):
                self._spawn.start_soon(self._follow_partition, link, topic, p, lg)

    def _open_copy(self, rec: TopicRecord, public_key: HeadSigner) -> None:
        """Cluster mode: open our copy of the peer's archive of internal topic `rec`
        (under this mirror's directory, so it cannot clash with our own), hand it to
        `Cluster.copies` and follow it like any archive."""
        cluster = self.cluster
        if cluster is None or self.broker_id is None or rec.partitions != 1 or rec.name in self.copies:
            return
        if head_manifest(public_key).hash() != rec.archive_keys[0]:
            raise VerificationFailed(f"{rec.name}-0: signer key does not match the catalog's archive key")
        lg = FollowerLog.open_replica(self._partition_dir(rec.name, 0), public_key,
                                      config=self.node.config.log_config(rec.configs))
        copy = self.copies[rec.name] = PeerCopy(lg.log)
        self._copy_followers[rec.name] = lg
        cluster.copies[rec.name][self.broker_id] = copy
        cluster.copy_changed()
        log.info("following the %s archive of broker %d", rec.name, self.broker_id)
        if self._spawn is not None and self._link is not None:
            self._spawn.start_soon(self._follow_copy, self._link, rec.name)

    async def _follow_copy(self, link: ConnectionDriver, name: str) -> None:
        copy, cluster, lg = self.copies.get(name), self.cluster, self._copy_followers.get(name)
        assert copy is not None and cluster is not None and lg is not None

        def channel(ch: ReplicationChannel | None) -> None:
            copy.channel = ch
            cluster.copy_changed()

        await follow_forever(link, lg, cluster.copy_changed, f"{name} of broker {self.broker_id}", channel)

    # -- following ---------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.node_key is None:
            known = self._peers().get(self.target.address)
            self.node_key = bytes.fromhex(known) if known else None
        if self.node_key is not None:
            self.open_local()  # serve what we hold even if the writer never answers
        task_status.started()
        backoff = BACKOFF_MIN_S
        try:
            while True:
                if self.catalog is not None and (self.catalog.frozen or self.catalog.reorg_needed):
                    # the writer equivocated on its catalog (ERROR logged once by the
                    # catalog's FollowerLog): trust nothing new from it, serve what we hold
                    await trio.sleep_forever()
                started = trio.current_time()
                try:
                    values = await discover_configs(self.target.host, self.target.port)
                    key = _node_key(self.target.host, self.target.port, values)
                    address = values.get("hyperkafka.replication.address")
                    if self.node_key is not None and key != self.node_key:
                        log.error("mirror of %s: the node presents key %s but we trust %s; refusing it",
                                  self.target.address, key.hex(), self.node_key.hex())
                    elif address is None:
                        log.warning("mirror of %s: the node serves no replication port", self.target.address)
                    else:
                        if self.node_key is None:
                            self.node_key = key
                            self._remember(key)
                            log.info("mirror of %s: trusting node key %s on first use",
                                     self.target.address, key.hex())
                            self.open_local()
                        if self.broker_id is not None and self.cluster is not None:
                            self.cluster.learn(self.broker_id, key)
                        await self._follow(address)
                except Equivocation:  # the catalog itself (logged where found): frozen
                    pass
                except ForkChanged as exc:  # the catalog: a reorg we cannot follow
                    log.error("mirror of %s: stopped following: %s", self.target.address, exc)
                except (OSError, trio.TooSlowError, trio.BrokenResourceError, DiscoveryError,
                        ReplicationError, StorageError) as exc:
                    log.info("mirror of %s: %s: %s", self.target.address, type(exc).__name__, exc)
                except Exception:  # keep mirroring (and serving) whatever went wrong
                    log.exception("mirror of %s failed; retrying", self.target.address)
                if trio.current_time() - started > 10:
                    backoff = BACKOFF_MIN_S
                await trio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        finally:
            self.close()

    async def _follow(self, address: str) -> None:
        """Follow the catalog and every partition, each a channel of one connection to
        `address`, until that connection ends (then `run` reconnects with backoff and
        every channel resumes from what is stored)."""
        assert self.catalog is not None
        link = ConnectionDriver(await _connect(address),
                                Connection(initiator=True, keypair=self.keypair))
        self._link = link
        quorum = self.node.quorum
        if quorum is not None and self.broker_id is not None:
            quorum.links[self.broker_id] = link  # archives a failover moved to it follow it here
        try:
            with _single_error():
                async with trio.open_nursery() as nursery:
                    self._spawn = nursery
                    nursery.start_soon(_run_link, link)
                    for rec, logs in self.attached.values():
                        topic = self.node.topics[rec.name]
                        for p, lg in enumerate(logs):
                            nursery.start_soon(self._follow_partition, link, topic, p, lg)
                    for name in self.copies:
                        nursery.start_soon(self._follow_copy, link, name)
                    nursery.start_soon(self._sync_topics_loop, link)
                    await self._follow_catalog(link)
                    nursery.cancel_scope.cancel()
        finally:
            self._spawn = None
            self._link = None
            if quorum is not None and self.broker_id is not None and quorum.links.get(self.broker_id) is link:
                del quorum.links[self.broker_id]

    async def _follow_catalog(self, link: ConnectionDriver) -> None:
        cat = self.catalog
        assert cat is not None

        def changed() -> None:
            self._catalog_changed.set()

        self._catalog_changed.set()  # topics from the local copy may still lack archives
        backoff = BACKOFF_MIN_S
        while True:
            started = trio.current_time()
            try:
                await follow_once(link, cat, changed)
            except (trio.TooSlowError, ReplicationError, VerificationFailed) as exc:
                log.info("mirror of %s: catalog: %s", self.target.address, exc)
            if trio.current_time() - started > 10:
                backoff = BACKOFF_MIN_S
            await trio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _sync_topics_loop(self, link: ConnectionDriver) -> None:
        while True:
            await self._catalog_changed.wait()
            self._catalog_changed = trio.Event()
            self._replay_catalog()
            for name, rec in sorted(self.topics.items()):
                if (name in COPIED_TOPICS and self.broker_id is not None and name not in self.copies
                        and rec.partitions == 1):
                    try:
                        self._open_copy(rec, await learn_public_key(link, rec.archive_keys[0]))
                    except (trio.TooSlowError, ReplicationError, VerificationFailed) as exc:
                        log.info("mirror of %s: its %s archive not followed yet: %s", self.target.address, name, exc)
                        self._catalog_changed.set()
                        await trio.sleep(BACKOFF_MAX_S / 5)
                if name in self.skipped or name.startswith("__") or rec.topic_id in self.node.dropped_ids:
                    continue
                try:
                    if name in self.attached:
                        await self._follow_changes(link, rec)
                        continue
                    keys = [await learn_public_key(link, rec.archive_keys[p])
                            for p in range(rec.partitions)]
                    self._attach(rec, keys)
                except (trio.TooSlowError, ReplicationError, VerificationFailed) as exc:
                    log.info("mirror of %s: topic %s not attached yet: %s", self.target.address, name, exc)
                    self._catalog_changed.set()
                    await trio.sleep(BACKOFF_MAX_S / 5)

    async def _follow_partition(self, link: ConnectionDriver, topic: Topic, index: int,
                                lg: FollowerLog) -> None:
        partition = topic.partitions[index]

        def moved() -> None:
            partition.notify()
            self.node.notify_data()

        attached = self.attached.get(topic.name)
        if attached is None or lg not in attached[1]:
            return  # detached before this task started
        quorum = self.node.quorum
        if quorum is not None and quorum.moved(lg.key):
            return  # a failover moved its leader: followed from there (broker/takeover.py)
        scope = trio.CancelScope()
        scopes = self._scopes.setdefault(topic.name, set())
        scopes.add(scope)
        try:
            with scope:
                if quorum is None:
                    await follow_forever(link, lg, moved, f"{topic.name}-{index}")
                else:
                    with quorum.following(lg.key) as session, session:  # a takeover ends it
                        await follow_forever(link, lg, moved, f"{topic.name}-{index}")
        finally:
            scopes.discard(scope)

    def _held(self, lg: FollowerLog) -> FollowerLog:
        """The copy held now of the archive `lg` was opened for: a failover that elected
        this broker and a later one that deposed it reopen it (broker/takeover.py
        `step_down`), and the quorum role holds the reopened one."""
        entry = self.node.quorum.followers.get(lg.key) if self.node.quorum is not None else None
        return entry[1] if entry is not None else lg

    def close(self) -> None:
        for name, copy in self.copies.items():
            if self.broker_id is not None and self.cluster is not None:
                self.cluster.copies[name].pop(self.broker_id, None)
            with contextlib.suppress(Exception):
                copy.log.close()
        for _, logs in self.attached.values():
            for lg in logs:
                with contextlib.suppress(Exception):
                    self._held(lg).close()
        if self.catalog is not None:
            with contextlib.suppress(Exception):
                self.catalog.close()


async def run_replication(node: Node, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The replication port (if configured) and one NodeMirror per --mirror."""
    from broker.replication_server import serve_replication

    async with trio.open_nursery() as nursery:
        if node.config.replication_listen is not None:
            host, port = node.config.replication_listen
            await nursery.start(serve_replication, node, host, port)
        for text in node.config.mirrors:
            await nursery.start(NodeMirror(node, MirrorTarget.parse(text)).run)
        if isinstance(node.cluster, Cluster):  # every other member of an etcd cluster
            nursery.start_soon(_mirror_members, node, node.cluster, nursery)
        task_status.started()


async def _mirror_members(node: Node, cluster: Cluster, nursery: trio.Nursery) -> None:
    """Cluster mode: every broker mirrors every other one registered in etcd, from the
    moment it first registers (its node key, from its registration, is pinned: the chain
    of trust starts in etcd, not at first use). A broker of the cluster that is down
    (``members/<id>`` only) is mirrored too when this broker holds copies of its
    archives: they are opened and served at once (`NodeMirror.open_local`), so a broker
    started while a topic's writer is down still votes, signs and leads for the
    quorum-signed partitions a failover moved away from that writer
    (broker/takeover.py); the mirror connects once that broker is back at the address it
    last registered."""
    started: set[int] = set()
    root = os.path.join(str(node.config.data_dir), MIRRORS_DIR)
    while True:
        changed = cluster.membership.changed
        live = cluster.membership.members
        down = _holding_copies(root, [m for i, m in cluster.membership.known.items() if i not in live])
        for member in [*live.values(), *down]:
            if member.node_id == cluster.me or member.node_id in started:
                continue
            try:
                pinned = bytes.fromhex(member.node_key)
            except ValueError:
                pinned = b""
            if len(pinned) != 32:  # no key we could pin: not mirrored (it registers again)
                log.error("cluster: broker %d registered no valid node key; not mirroring it", member.node_id)
                continue
            started.add(member.node_id)
            peer = ClusterBroker(member.node_id, member.host, member.port)
            await nursery.start(NodeMirror(node, MirrorTarget(member.host, member.port, pinned), member.node_id,
                                              cluster).run)
            nursery.start_soon(poll_leader_isr, cluster, peer)
        await changed.wait()


def _holding_copies(root: str, members: Sequence[Member]) -> list[Member]:
    """The `members` whose archives this broker holds copies of (under `root`)."""
    return [m for m in members
            if len(m.node_key) == 64 and os.path.isdir(os.path.join(root, m.node_key.lower()))]


async def poll_leader_isr(cluster: Cluster, peer: ClusterBroker) -> None:
    """Cluster mode: the ISR of what `peer` writes, as it says in its Metadata, for our own
    Metadata answers (the writer is the authority on its ISR, as Kafka's controller is;
    we pull it, Kafka's controller pushes it). Liveness is not this: it is the etcd lease.)"""
    interval = min(ISR_POLL_MAX_S, max(min(cluster.lag_s, cluster.session_s) / 4, ISR_POLL_MIN_S))
    while True:
        try:
            resp = await kafka_request(peer.host, peer.port, 3, 1, "metadata", {"topics": None})
            cluster.take_metadata(peer.node_id, [
                (str(t.name), int(p.partition_index), [int(i) for i in p.replica_nodes], [int(i) for i in p.isr_nodes])
                for t in resp.topics for p in t.partitions], int(resp.controller_id))
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, DiscoveryError, ValueError) as exc:
            # (a peer killed mid-answer resets the connection: BrokenResourceError)
            log.debug("cluster: metadata from broker %d: %s", peer.node_id, exc)
        await trio.sleep(interval)

"""Membership, controller election and fencing through etcd.

Owns `Membership`: this broker's session in etcd and its view of everyone else's, and
`Member`/`Placement`, the records it keeps there. Keys, under ``/<hyperkafka.cluster.name>/``:

* ``brokers/<id>``: a live broker's registration (id, Kafka address, rack, node key),
  attached to its lease; ``members/<id>``: the same, without a lease (the brokers that
  belong to the cluster, alive or not: every archive's replicas). Liveness is the lease, as Kafka's broker.session.timeout.ms is
  the KRaft controller's heartbeat deadline: a broker whose lease expires (killed, paused,
  cut off from etcd) leaves the cluster at once in every broker's view. The lease of
  ``brokers/<id>`` is that broker's session (`Membership.sessions`): a broker that
  registers again (restarted, or back after losing its lease) does on a new lease. A
  restarted broker whose registration of before still lives (its lease not expired yet)
  replaces it in one transaction: it never looks gone meanwhile.
* ``controller``: the elected controller's id, created only if absent (a transaction)
  and attached to its lease. Its create revision is the controller epoch: every act of a
  controller (placing or deleting a topic) and of the group coordinator (acknowledging a
  commit) is a transaction that compares it, so an old controller whose lease expired
  cannot act any more, and learns it from the failed comparison (it then steps down).
  A controller also stops acting by itself once its lease may have expired by its own
  clock (the time it sent its last successful keep-alive plus the TTL): a broker that
  was paused knows, when it resumes, that it must not act before asking etcd.
* ``topics/<name>``: placement, one record per topic (writer, partitions, configs), created
  only if absent by the controller under its epoch: one name never has two writers. A
  quorum-signed topic's also holds its replicas, its topic id and, after a failover, its
  leaders; it is the truth of that topic's existence and configs (broker/placed_topics.py).
* ``internal/<topic>/<partition>``: who coordinates each partition of an internal topic
  (``__consumer_offsets``: the groups that map to it) and whose archive holds its latest
  state (`Shard`, broker/cluster/shards.py). Moved by the controller under its epoch;
  claimed by the coordinator it names. The record's mod revision is that partition's
  epoch: every act of its coordinator is a transaction comparing it (`check_shards`).
  ``groups/coordinator``, left by the version before sharded groups, is read only to
  give the first placement its holder (`legacy_holder`).

Everything is learnt by one watch of the whole prefix (no polling); when the watch ends it
is re-read and watched again. Never etcd's lock API: leases and transactions only.

May import trio and `broker.cluster.etcd`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from broker.cluster.etcd import Compare, Etcd, EtcdError, Event, KeyValue, Op
from broker.cluster.shards import Shard

log = logging.getLogger("hyperkafka.cluster")

RETRY_MIN_S = 0.2
RETRY_MAX_S = 2.0
SHARD_TXN_OPS = 64  # below etcd's default --max-txn-ops (128)


@dataclass(frozen=True)
class Member:
    node_id: int
    host: str
    port: int
    rack: str | None = None
    node_key: str = ""  # hex: a restarted broker recognises its own stale registration

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def encode(self) -> bytes:
        return json.dumps(
            {
                "id": self.node_id,
                "host": self.host,
                "port": self.port,
                "rack": self.rack,
                "node_key": self.node_key,
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Member:
        d = json.loads(data)
        return cls(
            int(d["id"]), str(d["host"]), int(d["port"]), d.get("rack"), str(d.get("node_key", ""))
        )


@dataclass(frozen=True)
class Placement:
    """Where a topic lives: its one writer, chosen by the controller, and, for a topic
    whose partitions are quorum-signed (broker/cluster/quorum.py), each partition's
    replicas in placement order, writer first (empty: every broker mirrors it)."""

    name: str
    writer: int
    partitions: int
    configs: dict[str, str] = field(default_factory=dict)
    replication_factor: int = -1
    replicas: tuple[tuple[int, ...], ...] = ()
    # a quorum-signed topic after a failover (broker/cluster/failover.py): each
    # partition's leader and leader epoch (empty: the writer, epoch 0), and the session
    # (`Membership.sessions`) the leader was elected in (0: not known): a leader that
    # registered again since (a restart) leads no more until a vote elects it again
    leaders: tuple[int, ...] = ()
    leader_epochs: tuple[int, ...] = ()
    leader_sessions: tuple[int, ...] = ()
    # A quorum-signed topic's id, chosen by the controller (its writer makes the topic
    # with it): the record is then the truth of the topic's existence and configs
    # (broker/placed_topics.py); "" for a single-signer topic or an older record.
    topic_id: str = ""

    @property
    def authoritative(self) -> bool:
        """Whether this record, not the writer's catalog, holds the topic's configs."""
        return bool(self.replicas) and self.topic_id != ""

    def leader_of(self, partition: int) -> int:
        return self.leaders[partition] if partition < len(self.leaders) else self.writer

    def epoch_of(self, partition: int) -> int:
        e = self.leader_epochs
        return e[partition] if partition < len(e) else 0

    def session_of(self, partition: int) -> int:
        """The session its recorded leader was elected in (0: not known)."""
        s = self.leader_sessions
        return s[partition] if partition < len(s) else 0

    def with_leader(self, partition: int, leader: int, epoch: int, session: int = 0) -> Placement:
        """This placement with `leader` (elected in its session `session`) in leader
        epoch `epoch` for `partition`."""
        n = self.partitions
        leaders = [self.leader_of(p) for p in range(n)]
        epochs = [self.epoch_of(p) for p in range(n)]
        sessions = [self.session_of(p) for p in range(n)]
        leaders[partition], epochs[partition], sessions[partition] = leader, epoch, session
        return replace(self, leaders=tuple(leaders), leader_epochs=tuple(epochs),
                       leader_sessions=tuple(sessions))  # fmt: skip

    def encode(self) -> bytes:
        d: dict[str, Any] = {
            "writer": self.writer,
            "partitions": self.partitions,
            "configs": self.configs,
            "replication_factor": self.replication_factor,
        }
        if self.replicas:
            d["replicas"] = [list(r) for r in self.replicas]
        if self.leaders:
            d["leaders"] = list(self.leaders)
            d["leader_epochs"] = list(self.leader_epochs)
            d["leader_sessions"] = list(self.leader_sessions)
        if self.topic_id:
            d["topic_id"] = self.topic_id
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, name: str, data: bytes) -> Placement:
        d = json.loads(data)
        return cls(
            name,
            int(d["writer"]),
            int(d["partitions"]),
            {str(k): str(v) for k, v in d.get("configs", {}).items()},
            int(d.get("replication_factor", -1)),
            tuple(tuple(int(i) for i in r) for r in d.get("replicas", ())),
            tuple(int(i) for i in d.get("leaders", ())),
            tuple(int(i) for i in d.get("leader_epochs", ())),
            tuple(int(i) for i in d.get("leader_sessions", ())),
            str(d.get("topic_id", "")),
        )


class LeaseLost(Exception):
    """Our lease expired (or etcd could not be reached for its whole TTL)."""


class Membership:
    """This broker's session in etcd, and what it sees of the cluster there."""

    def __init__(
        self,
        etcd: Etcd,
        cluster_name: str,
        me: Member,
        ttl_s: int,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.etcd = etcd
        self.prefix = f"/{cluster_name}/".encode()
        self.me = me
        self.ttl_s = max(1, ttl_s)
        self.clock = clock
        self.members: dict[int, Member] = {}  # live: registered on a lease
        # each live broker's session: the lease its registration is attached to
        self.sessions: dict[int, int] = {}
        # Every broker that ever registered (a key without lease, as KRaft keeps a fenced
        # broker's registration): the replicas of every archive, alive or not.
        self.known: dict[int, Member] = {}
        self.placements: dict[str, Placement] = {}
        self.controller: int | None = None
        self.controller_epoch = 0  # create revision of the controller key (0: none)
        # internal topic -> partition -> its coordinator (broker/cluster/shards.py)
        self.shards: dict[str, dict[int, Shard]] = {}
        # ``groups/coordinator``, written by brokers of the version before sharded groups:
        # the broker whose archive held every group's state (the first placement of the
        # partitions of __consumer_offsets names it their holder, so nothing is lost).
        self.legacy_holder: int | None = None
        self.lease = 0
        self._lease_deadline = float("-inf")  # by our clock, the lease may have expired after this
        self._changed = trio.Event()
        self._watch_scope: trio.CancelScope | None = None
        self.ready = trio.Event()  # set once registered and the first view is read
        self.elections = 0  # times this broker became controller

    # -- keys ----------------------------------------------------------------------

    def _key(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    @property
    def controller_key(self) -> bytes:
        return self._key("controller")

    def broker_key(self, node_id: int) -> bytes:
        return self._key("brokers", str(node_id))

    def topic_key(self, name: str) -> bytes:
        return self._key("topics", name)

    def shard_key(self, topic: str, partition: int) -> bytes:
        return self._key("internal", topic, str(partition))

    # -- the view ------------------------------------------------------------------

    @property
    def changed(self) -> trio.Event:
        """Set at the next change of the view (take it before looking)."""
        return self._changed

    def poke(self) -> None:
        """Wake whoever waits on `changed` (something outside etcd changed)."""
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def lease_valid(self) -> bool:
        return self.lease != 0 and self.clock() < self._lease_deadline

    @property
    def is_controller(self) -> bool:
        """Whether this broker is the controller as far as it knows now (its acts are still
        fenced in etcd: this is what it believes, not a licence)."""
        return (
            self.controller == self.me.node_id and self.controller_epoch != 0 and self.lease_valid()
        )

    def live_ids(self) -> list[int]:
        ids = set(self.members)
        if self.lease_valid():
            ids.add(self.me.node_id)
        return sorted(ids)

    def _apply(self, kv: KeyValue, deleted: bool) -> None:
        rel = kv.key[len(self.prefix) :].decode(errors="replace")
        kind, _, rest = rel.partition("/")
        try:
            if kind in ("brokers", "members"):
                node_id = int(rest)
                table = self.members if kind == "brokers" else self.known
                if deleted:
                    table.pop(node_id, None)
                    if kind == "brokers":
                        self.sessions.pop(node_id, None)
                else:
                    table[node_id] = Member.decode(kv.value)
                    if kind == "brokers":
                        self.sessions[node_id] = kv.lease
            elif rel == "controller":
                if deleted:
                    self.controller, self.controller_epoch = None, 0
                else:
                    self.controller, self.controller_epoch = (
                        int(json.loads(kv.value)["id"]),
                        kv.create_revision,
                    )
            elif kind == "topics":
                if deleted:
                    self.placements.pop(rest, None)
                else:
                    self.placements[rest] = Placement.decode(rest, kv.value)
            elif rel == "groups/coordinator":
                self.legacy_holder = None if deleted else int(json.loads(kv.value)["id"])
            elif kind == "internal":
                topic, _, index = rest.rpartition("/")
                shards = self.shards.setdefault(topic, {})
                p = int(index)
                old = shards.get(p)
                if old is not None and old.revision > kv.mod_revision:
                    pass  # older than what our own transaction already told us
                elif deleted:
                    shards.pop(p, None)
                else:
                    shards[p] = Shard.decode(topic, p, kv.value, kv.mod_revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("cluster: ignoring a malformed etcd record %r: %s", kv.key, exc)

    # -- the session -----------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register, keep the lease alive, watch, campaign; start over when the lease is
        lost. `task_status.started()` once the first session is up."""
        backoff = RETRY_MIN_S
        started = False
        while True:
            try:
                await self._session(task_status if not started else trio.TASK_STATUS_IGNORED)
            except* (EtcdError, LeaseLost) as group:  # (from the session's tasks: a group)
                log.warning(
                    "cluster: etcd session of broker %d ended: %s",
                    self.me.node_id,
                    "; ".join(str(e) for e in group.exceptions),
                )
            started = started or self.ready.is_set()
            if self.controller == self.me.node_id:
                self.controller, self.controller_epoch = None, 0
            self.lease = 0
            self._lease_deadline = float("-inf")
            self._notify()
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_MAX_S)

    async def _session(self, task_status: trio.TaskStatus[None]) -> None:
        sent = self.clock()
        lease = await self.etcd.grant(self.ttl_s)
        self.lease = lease
        self._lease_deadline = sent + self.ttl_s
        try:
            await self._register()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive)
                await nursery.start(self._watch)
                nursery.start_soon(self._campaign)
                self.ready.set()
                task_status.started()
        finally:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1),
                contextlib.suppress(EtcdError),
            ):
                await self.etcd.revoke(lease)

    async def _register(self) -> None:
        key = self.broker_key(self.me.node_id)
        while True:
            r = await self.etcd.txn(
                [Compare.absent(key)],
                [
                    Op.put(key, self.me.encode(), self.lease),
                    Op.put(self._key("members", str(self.me.node_id)), self.me.encode()),
                ],
                [Op.get(key)],
            )
            if r.succeeded:
                log.info(
                    "cluster: broker %d registered in etcd (lease %x, TTL %d s)",
                    self.me.node_id,
                    self.lease,
                    self.ttl_s,
                )
                return
            old = r.ranges[0][0] if r.ranges and r.ranges[0] else None
            if old is not None:
                try:
                    same = (
                        Member.decode(old.value).node_key == self.me.node_key
                        and self.me.node_key != ""
                    )
                except (ValueError, KeyError, TypeError):
                    same = False
                if same:
                    # our own registration from before a restart: replace it, in one
                    # transaction (deleted first, we would look gone for a moment, and a
                    # controller could fail over what we lead meanwhile)
                    r = await self.etcd.txn(
                        [Compare.mod_revision(key, old.mod_revision)],
                        [
                            Op.put(key, self.me.encode(), self.lease),
                            Op.put(self._key("members", str(self.me.node_id)), self.me.encode()),
                        ],
                    )
                    if r.succeeded:
                        log.info(
                            "cluster: broker %d registered in etcd again (lease %x, TTL %d s)",
                            self.me.node_id,
                            self.lease,
                            self.ttl_s,
                        )
                        return
                    continue
                log.error(
                    "cluster: node.id %d is registered by another broker (%s); waiting for it to leave",
                    self.me.node_id,
                    old.value[:200],
                )
            await trio.sleep(1.0)

    async def _keepalive(self) -> None:
        interval = max(self.ttl_s / 3, 0.1)
        while True:
            await trio.sleep(interval)
            sent = self.clock()
            if sent >= self._lease_deadline:
                raise LeaseLost(f"no keep-alive answered within the lease TTL ({self.ttl_s} s)")
            failovers = self.etcd.failovers
            try:
                ttl = await self.etcd.keepalive(self.lease)
            except EtcdError as exc:
                log.info("cluster: keep-alive failed: %s", exc)
                self._rewatch()
                continue
            if self.etcd.failovers != failovers:
                self._rewatch()
            if ttl <= 0:
                raise LeaseLost("etcd says our lease is gone")
            self._lease_deadline = sent + ttl

    def _rewatch(self) -> None:
        """The keep-alive failed, or had to move to another etcd member: the watch may be
        on a member we cannot reach, where it would wait in silence for ever (nothing is
        sent on it): start it again."""
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    async def _watch(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            try:
                kvs, revision = await self.etcd.get(self.prefix, prefix=True)
            except EtcdError as exc:  # the lease decides when to give up, not this
                log.info("cluster: reading the view failed (%s); again", exc)
                await trio.sleep(RETRY_MIN_S)
                continue
            self.members.clear()
            self.sessions.clear()
            self.known.clear()
            self.placements.clear()
            self.shards.clear()
            self.legacy_holder = None
            self.controller, self.controller_epoch = None, 0
            for kv in kvs:
                self._apply(kv, False)
            self._notify()
            if first:
                first = False
                task_status.started()
            # A keep-alive that fails cancels this scope: a watch on a member we can no
            # longer reach would otherwise wait, silent, for ever (nothing is sent on it).
            with trio.CancelScope() as self._watch_scope:
                try:
                    async for events in self.etcd.watch(
                        self.prefix, prefix=True, start_revision=revision + 1
                    ):
                        self._on_events(events)
                except EtcdError as exc:
                    log.info("cluster: watch ended (%s); reading again", exc)
                    await trio.sleep(RETRY_MIN_S)
            self._watch_scope = None

    def _on_events(self, events: list[Event]) -> None:
        for e in events:
            self._apply(e.kv, e.type == "DELETE")
        self._notify()

    async def _campaign(self) -> None:
        """Whenever there is no controller, try to become it (create-if-absent)."""
        key = self.controller_key
        while True:
            if self.controller is None and self.lease_valid():
                value = json.dumps({"id": self.me.node_id}).encode()
                r = await self.etcd.txn([Compare.absent(key)], [Op.put(key, value, self.lease)])
                if r.succeeded:
                    # the key's create revision is the txn's revision: our epoch
                    self.controller, self.controller_epoch = self.me.node_id, r.revision
                    self.elections += 1
                    log.info(
                        "cluster: broker %d is controller, epoch %d", self.me.node_id, r.revision
                    )
                    self._notify()
            changed = self._changed
            await changed.wait()

    # -- fenced acts -----------------------------------------------------------------

    async def fenced(
        self,
        compare: list[Compare],
        success: list[Op],
        failure: list[Op] | None = None,
        *,
        epoch: int | None = None,
    ) -> bool | None:
        """Run a transaction as controller of `epoch` (default: the current one): it
        succeeds only while that epoch is the controller key's create revision. None when
        we are not (any more) that controller (we step down: the view says no controller
        until the watch tells who is); else whether `compare` held."""
        if epoch is None:
            epoch = self.controller_epoch
        if not self.is_controller or epoch != self.controller_epoch:
            return None
        fence = Compare.create_revision(self.controller_key, epoch)
        # Two steps would race: one transaction, whose failure branch tells why it failed.
        r = await self.etcd.txn(
            [fence, *compare], success, [Op.get(self.controller_key), *(failure or [])]
        )
        if r.succeeded:
            return True
        ctl = r.ranges[0] if r.ranges else []
        if not ctl or ctl[0].create_revision != epoch:
            self._step_down(epoch)
            return None
        return False

    def _step_down(self, epoch: int) -> None:
        if self.controller == self.me.node_id and self.controller_epoch == epoch:
            log.warning(
                "cluster: broker %d is no longer controller (epoch %d fenced)",
                self.me.node_id,
                epoch,
            )
            self.controller, self.controller_epoch = None, 0
            self._notify()

    async def check_epoch(self, epoch: int) -> bool:
        """Whether this broker still is the controller of `epoch`, asked of etcd (a fenced
        no-op transaction)."""
        return await self.fenced([], [], epoch=epoch) is True

    async def place(self, placement: Placement) -> bool | None:
        """Record a new topic's placement (controller only): True, False when the name is
        taken, None when we are not the controller."""
        key = self.topic_key(placement.name)
        ok = await self.fenced([Compare.absent(key)], [Op.put(key, placement.encode())])
        if ok:
            self.placements[placement.name] = placement
        return ok

    async def record_leader(
        self, name: str, partition: int, leader: int, epoch: int, session: int = 0
    ) -> bool | None:
        """Record `leader` (voted for in its session `session`) in leader epoch `epoch`
        for `partition` of quorum-signed topic `name` (controller only, after a failover
        vote): one transaction, fenced by the controller's epoch and by the placement
        being the one this view holds (a concurrent change fails it). False when it
        changed or `epoch` is not newer than the recorded one; None when we are not the
        controller."""
        old = self.placements.get(name)
        if old is None or not 0 <= partition < old.partitions:
            return False
        if epoch <= old.epoch_of(partition):
            return False
        new = old.with_leader(partition, leader, epoch, session)
        key = self.topic_key(name)
        ok = await self.fenced([Compare.value(key, old.encode())], [Op.put(key, new.encode())])
        if ok and self.placements.get(name) == old:
            self.placements[name] = new
        return ok

    async def unplace(self, name: str) -> bool | None:
        key = self.topic_key(name)
        ok = await self.fenced([Compare.create_revision(key, 0, "GREATER")], [Op.delete(key)])
        if ok:
            self.placements.pop(name, None)
        return ok

    async def read_placement(self, name: str) -> Placement | None:
        """Topic `name`'s record as etcd holds it now (a linearizable read, not the
        watched view, which may lag): None when there is none. Raises EtcdError when etcd
        cannot be read (then nothing may be concluded from absence)."""
        kvs, _ = await self.etcd.get(self.topic_key(name))
        return Placement.decode(name, kvs[0].value) if kvs else None

    async def set_configs(self, old: Placement, configs: dict[str, str]) -> bool | None:
        """Record new configs of a quorum-signed topic (controller only): one transaction,
        fenced by the controller's epoch and by the record being `old` (a concurrent
        change fails it: False). None when we are not the controller."""
        new = replace(old, configs=dict(configs))
        key = self.topic_key(old.name)
        ok = await self.fenced([Compare.value(key, old.encode())], [Op.put(key, new.encode())])
        if ok and self.placements.get(old.name) == old:
            self.placements[old.name] = new
        return ok

    async def place_shards(
        self, topic: str, moves: dict[int, tuple[int, int | None]], seen: dict[int, Shard]
    ) -> bool | None:
        """Record new coordinators of partitions of internal topic `topic` (controller
        only), partition -> (owner, holder), each only if its record is still the one
        `seen` (absent when not in it): True, False when one changed meanwhile, None when
        we are not the controller. At most SHARD_TXN_OPS per transaction (etcd's
        --max-txn-ops)."""
        items = sorted(moves.items())
        for i in range(0, len(items), SHARD_TXN_OPS):
            compare, ops = [], []
            for p, (owner, holder) in items[i : i + SHARD_TXN_OPS]:
                key = self.shard_key(topic, p)
                old = seen.get(p)
                compare.append(
                    Compare.absent(key) if old is None else Compare.mod_revision(key, old.revision)
                )
                ops.append(Op.put(key, Shard(topic, p, owner, holder).encode()))
            ok = await self.fenced(compare, ops)
            if not ok:
                return ok
        return True

    async def claim_shards(self, topic: str, seen: dict[int, int]) -> int | None:
        """This broker, named coordinator of the partitions `seen` (partition -> the
        revision of the record naming it), says it holds their state now: one
        transaction, only if every record is still at that revision and our lease lives.
        The new revision (their epoch from now on), or None when fenced."""
        if not self.lease_valid():
            return None
        compare = [Compare.create_revision(self.broker_key(self.me.node_id), 0, "GREATER")]
        ops = []
        for p, revision in sorted(seen.items()):
            key = self.shard_key(topic, p)
            compare.append(Compare.mod_revision(key, revision))
            shard = Shard(topic, p, self.me.node_id, self.me.node_id)
            ops.append(Op.put(key, shard.encode()))
        r = await self.etcd.txn(compare, ops)
        if not r.succeeded:
            return None
        shards = self.shards.setdefault(topic, {})
        for p in seen:
            shards[p] = Shard(topic, p, self.me.node_id, self.me.node_id, r.revision)
        self._notify()
        return r.revision

    async def check_shards(self, topic: str, revisions: dict[int, int]) -> bool:
        """Whether this broker still coordinates these partitions at these revisions
        (their epochs), asked of etcd: a transaction comparing each, and that our lease
        lives (our registration is on it)."""
        if not self.lease_valid():
            return False
        compare = [Compare.create_revision(self.broker_key(self.me.node_id), 0, "GREATER")]
        compare += [
            Compare.mod_revision(self.shard_key(topic, p), rev) for p, rev in revisions.items()
        ]
        return (await self.etcd.txn(compare, [])).succeeded

    def statistics(self) -> dict[str, Any]:
        return {
            "members": sorted(self.members),
            "controller": self.controller,
            "epoch": self.controller_epoch,
            "lease_valid": self.lease_valid(),
            "topics": len(self.placements),
        }

"""Cluster mode: the failover of quorum-signed partitions, run by a broker (issue 17
item 3, docs/clusters.md "Failover"). Part of the quorum role: it runs only with
``hyperkafka.quorum.partitions.enable``.

Owns `run_failover`, two loops woken by every change of the etcd view (and a tick):

* the controller's (`_controller_loop`): a quorum-signed partition whose leader
  (its placement's recorded leader, else the topic's writer) holds no lease any more,
  or restarted since the vote that elected it (`failover.leader_lost`), is failed over by `broker.cluster.failover.fail_over`: a vote of its live replicas for
  the next leader epoch, over the ``hyperkafka/quorum`` links (the controller's own copy
  answers in process), and the winner and epoch recorded in the placement, fenced by
  the controller's epoch. Tried again every `RETRY_S` while it fails (no majority
  answered yet, a link not up yet).
* every broker's (`_takeover_loop`): a partition the placement names this broker
  leader of, in an epoch this broker does not write yet, by a vote of its current etcd
  session (never of a session before a restart: that one may have appended past what it
  stored and had blocks signed that it no longer holds; it waits for the vote its restart
  brings), held here as a mirror's copy, is taken over (a copy it still writes on an
  older fork, an elected leader whose lease was lost and taken again, first steps down): the mirror's session of that archive ends (`QuorumRole.release`: only
  the leader writes it from then on), the copy answers its vote again (the same epoch:
  its longest head, which the election saw or a longer one), `PartitionLog.take_over`
  makes it the writer on fork = epoch (cutting what no quorum signed), the producer and
  transaction state are rebuilt from the log (idempotent producers retry their
  in-flight batches here and get DUPLICATE or the next sequence, as at any leader
  change), the partition takes produces (`Partition.led`), and `QuorumRole.lead` has a
  quorum of its placed replicas sign its commits, the first of which re-signs the kept
  blocks on the new fork.

* every broker's (`_follow_moved_loop`): a copy held here of an archive a failover moved
  to another broker follows that leader's heads, on this broker's mirror connection to
  it, instead of the writer's; and `step_down`: a leader a later failover deposed (back
  from a pause, a cut or a restart) reopens its archive as a replica, which cuts what no
  quorum signed, and follows the new leader's fork.

May import trio, `broker.node`, `broker.mirror`, `broker.quorum_link`, `broker.cluster`
and `storage`.
"""

from __future__ import annotations

import logging

import trio

from broker.cluster import Cluster, signed_blocks
from broker.cluster.failover import fail_over, leader_lost
from broker.cluster.quorum import is_quorum_signed
from broker.idempotence import ProducerStates
from broker.mirror import follow_forever
from broker.node import Node, Partition, producer_headers
from broker.quorum_link import QuorumRole
from broker.transactions.partition import rebuild_txns
from storage.errors import StorageError
from storage.follower import FollowerLog
from storage.quorum import manifest_partition
from storage.replication.trio_driver import ConnectionDriver

log = logging.getLogger("hyperkafka.failover")

RETRY_S = 1.0  # a failover that could not be done is tried again after this long
TICK_S = 1.0  # the loops look again at least this often (a link may come up meanwhile)


async def run_failover(node: Node, cluster: Cluster, role: QuorumRole) -> None:
    """The failover of this broker's cluster, until cancelled."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_controller_loop, node, cluster, role)
        nursery.start_soon(_takeover_loop, node, cluster, role)
        nursery.start_soon(_follow_moved_loop, node, cluster, role)
        nursery.start_soon(_resume_loop, node, cluster)


async def _resume_loop(node: Node, cluster: Cluster) -> None:
    """A leader whose commit no quorum signed takes its partition back once a quorum of
    its replicas is alive (`Node.retry_offline`): looked at as soon as the view changes
    (a replica registered again), not only at the retry loop's next tick."""
    while True:
        await cluster.membership.changed.wait()
        node.wake_offline()


async def _controller_loop(node: Node, cluster: Cluster, role: QuorumRole) -> None:
    running: set[tuple[str, int]] = set()
    next_try: dict[tuple[str, int], float] = {}

    async def attempt(name: str, index: int) -> None:
        try:
            p = node.partition(name, index)
            if p is None or p.log.manifest is None:
                return
            await fail_over(
                cluster.membership, cluster.alive, name, index, p.log.manifest, role
            )
        except Exception:  # one partition's failure must not stop the others'
            log.exception("failover of %s-%d failed; trying again", name, index)
        finally:
            running.discard((name, index))

    async with trio.open_nursery() as nursery:
        while True:
            changed = cluster.membership.changed
            if cluster.is_controller:
                now = trio.current_time()
                for name, index in dead_leaders(node, cluster):
                    key = (name, index)
                    if key in running or now < next_try.get(key, 0.0):
                        continue
                    running.add(key)
                    next_try[key] = now + RETRY_S
                    nursery.start_soon(attempt, name, index)
            with trio.move_on_after(TICK_S):
                await changed.wait()


def dead_leaders(node: Node, cluster: Cluster) -> list[tuple[str, int]]:
    """(topic, partition) of every quorum-signed partition held here whose leader holds
    no etcd lease, or restarted since it was elected."""
    out = []
    membership = cluster.membership
    for name, placement in list(membership.placements.items()):
        if not placement.replicas:
            continue
        for index in range(len(placement.replicas)):
            if not leader_lost(membership, cluster.alive, placement, index):
                continue
            p = node.partition(name, index)
            if p is not None and is_quorum_signed(p.log.manifest, p.log.public_key):
                out.append((name, index))
    return out


async def _takeover_loop(node: Node, cluster: Cluster, role: QuorumRole) -> None:
    failed: set[tuple[str, int, int]] = set()  # (topic, partition, epoch) said once
    while True:
        changed = cluster.membership.changed
        for name, placement in list(cluster.membership.placements.items()):
            for index in range(len(placement.leaders)):
                epoch = placement.epoch_of(index)
                if epoch < 1:
                    continue
                try:
                    if placement.leader_of(index) == cluster.me:
                        if placement.session_of(index) not in (0, cluster.membership.lease):
                            continue  # elected before this broker restarted: a vote comes
                        p = node.partition(name, index)
                        if p is not None and not p.log.replica and p.log.fork < epoch:
                            await step_down(node, role, name, index)  # (then leads epoch)
                        await take_over(node, cluster, role, name, index, epoch)
                    else:
                        await step_down(node, role, name, index)
                except (StorageError, OSError) as exc:
                    said = (name, index, placement.epoch_of(index))
                    if said not in failed:  # (tried again every tick: said once per epoch)
                        failed.add(said)
                        log.error("change of leader of %s-%d here failed: %s", name, index, exc)
        with trio.move_on_after(TICK_S):
            await changed.wait()


async def take_over(
    node: Node, cluster: Cluster, role: QuorumRole, name: str, index: int, epoch: int
) -> bool:
    """Make this broker's mirror copy of partition `index` of `name` its writer in leader
    epoch `epoch` (a failover elected it). False when there is nothing to take over here
    (no such copy, or it is written here already); raises StorageError."""
    p = node.partition(name, index)
    if p is None or p.led or not p.log.replica or node.topics.get(name) is not p.topic:
        return False
    follower = role.followers.get(p.log.key)
    if follower is None or follower[0] != name:
        return False
    lg = follower[1]
    await role.release(lg.key)  # the mirror's session of it ends: only the leader writes it
    async with p.lock:
        if p.led or node.topics.get(name) is not p.topic:
            return False
        v = lg.vote(epoch)  # (answered again: the same epoch, after its promise)
        lg.log.take_over(node.store.node_keypair, epoch, v.length)
        p.producers = ProducerStates()
        p.producers.rebuild(producer_headers(lg.log))
        p.txns = rebuild_txns(lg.log)
        p.led = True
    role.lead(name, index, lg.log)
    cluster.published(lg.key, signed_blocks(lg.log))
    node.mark_dirty(p)  # the first commit re-signs the kept blocks on the new fork
    log.warning(
        "partition %s-%d: this broker leads it in epoch %d from %d blocks (%d offsets)",
        name, index, epoch, v.length, lg.log.log_end_offset,
    )  # fmt: skip
    node.notify_data()
    return True


async def _follow_moved_loop(node: Node, cluster: Cluster, role: QuorumRole) -> None:
    """A copy held here of an archive a failover moved to another broker is followed from
    that leader (the writer's mirror no longer follows it: `QuorumRole.moved`), on the
    live connection of this broker's mirror of it (`QuorumRole.links`), again at each
    change of the leader or of that connection. The leader's heads are on its new fork,
    whose first head keeps the blocks the vote elected (the copy's conflict probe finds
    them agreeing and follows the fork, cutting only what no quorum signed)."""
    running: dict[bytes, tuple[int, int, trio.CancelScope, object]] = {}

    async def follow(key: bytes, name: str, lg: FollowerLog, link: ConnectionDriver,
                     scope: trio.CancelScope) -> None:
        p = node.partition(name, manifest_partition(lg.manifest) or 0) if lg.manifest else None

        def moved() -> None:
            if p is not None:
                p.notify()
            node.notify_data()

        try:
            with scope, role.following(key) as session, session:
                await follow_forever(link, lg, moved, f"{name} (archive {key.hex()[:12]})")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.info("%s: following its leader ended: %s", name, exc)
        finally:
            entry = running.get(key)
            if entry is not None and entry[2] is scope:
                del running[key]

    async with trio.open_nursery() as nursery:
        while True:
            changed = cluster.membership.changed
            for key, (name, lg) in list(role.followers.items()):
                if key in role.led or lg.manifest is None:
                    continue
                index = manifest_partition(lg.manifest)
                placement = cluster.membership.placements.get(name)
                if index is None or placement is None or placement.epoch_of(index) < 1:
                    continue
                lead, epoch = placement.leader_of(index), placement.epoch_of(index)
                link = role.links.get(lead)
                entry = running.get(key)
                if entry is not None and entry[:2] == (lead, epoch) and entry[3] is link:
                    continue
                if entry is not None:
                    entry[2].cancel()
                    running.pop(key, None)
                if lead == cluster.me or link is None:
                    continue
                await role.stop_session(key)  # (the writer's mirror's, or an older leader's)
                scope = trio.CancelScope()
                running[key] = (lead, epoch, scope, link)
                nursery.start_soon(follow, key, name, lg, link, scope)
            with trio.move_on_after(TICK_S):
                await changed.wait()


async def step_down(node: Node, role: QuorumRole, name: str, index: int) -> bool:
    """The old leader back (a failover recorded another leader of partition `index` of
    `name`, which this broker wrote): its archive is reopened as a replica, which cuts
    the batches no quorum signed (never acknowledged: a quorum of its replicas promised
    the new epoch and refused them), and follows the new leader's fork from then on
    (`_follow_moved_loop`). The partition is a new `Partition` object: produces still
    waiting on the old one are answered NOT_LEADER_OR_FOLLOWER, never by a head of the
    new leader's log that happens to reach their offsets. False when there is nothing
    to do (no such partition written here)."""
    p = node.partition(name, index)
    if p is None or p.log.replica or p.log.manifest is None or node.topics.get(name) is not p.topic:
        return False
    manifest = p.log.manifest
    if not is_quorum_signed(manifest, p.log.public_key):
        return False
    async with p.lock:
        if node.partition(name, index) is not p:
            return False
        why = f"broker {node.config.node_id} no longer leads it"
        p.failed, p.failed_code, p.retry = why, 6, False  # NOT_LEADER_OR_FOLLOWER
        p.end_generation(6, why)  # waiters of batches not published yet are answered now
        old = p.log
        old.quorum_sign = None
        old.discard()  # (writes nothing: its unsigned tail is for the replica's open to cut)
        config = node.config.log_config(p.topic.configs)
        lg = await trio.to_thread.run_sync(
            lambda: FollowerLog.open_replica(old.path, manifest, config=config)
        )
        if p.topic.mirrored:
            # A copy its mirror keeps (a failover had elected this broker, a later one
            # deposed it): not the store's, which knows only the topics it writes. The
            # quorum role holds it (`register`), as any mirror's copy.
            if node.store.handles is not None:
                lg.attach_handles(node.store.handles)
        else:
            node.store.swap_log(name, index, lg.log)
        new = Partition(p.topic, index, lg.log)
        new.producers.rebuild(producer_headers(lg.log))
        new.txns = rebuild_txns(lg.log)
        p.topic.partitions[index] = new
        role.led.discard(lg.key)  # (a leader elected by a failover, deposed by the next)
        role.register(name, lg)
    p.notify()
    node.notify_data()
    log.warning(
        "partition %s-%d: this broker no longer leads it; its copy follows the new leader "
        "from %d blocks", name, index, lg.length,
    )  # fmt: skip
    return True

"""Cluster mode: a quorum-signed topic's etcd record is the truth of its existence and
configs, on every broker.

Owns `follow_records`, run by every cluster broker. A quorum-signed topic outlives its
first writer (a failover elects other leaders for its partitions), but only that writer
signs its catalog: a topic whose writer is dead could not be deleted or altered while
those went through the catalog. So, for the topics whose partitions are quorum-signed
(single-signer topics keep their writer's catalog as their truth, untouched):

* **Existence**: the controller deletes the record (DeleteTopics, broker/handlers/admin.py)
  in a transaction fenced by its epoch; every broker holding the topic, written here,
  mirrored here or led here after a failover, deletes it (`Node.drop_topic`) once it
  learns the record is gone, or names another topic id (the name was created again).
  A writer that comes back (a restart, a SIGCONT after its lease expired) finds it gone
  the same way and deletes its own copy and catalog entry, so it neither serves it nor
  hands it to any mirror again; and a topic of the same name created meanwhile has
  another id, which no broker confuses with it.
* **Configs**: a record that carries its topic id (those the controller placed since
  this change) holds the topic's configs: the controller writes AlterConfigs and
  IncrementalAlterConfigs there (broker/handlers/configs.py), and every broker applies
  them (`Node.set_placed_configs`) in place of its catalog's. An older record without a
  topic id leaves the configs to the writer's catalog, as before (it may hold changes
  the record never saw).

A deletion must never be concluded from what a broker cannot see: the watched view is
only a hint. Absence (or another topic id) in the view is confirmed by a linearizable
read of the record, made after this broker held the topic; since a quorum-signed topic
is made only after its record was written, that read shows the record unless it was
deleted since. A read that fails (etcd unreachable, this broker cut off) concludes
nothing, and a broker whose view is stale keeps everything.

May import trio, `broker.node`, `broker.cluster`.
"""

from __future__ import annotations

import logging

import trio

from broker.cluster import Cluster
from broker.cluster.etcd import EtcdError
from broker.cluster.membership import Placement
from broker.cluster.quorum import is_quorum_signed
from broker.node import INTERNAL_TOPICS, Node, Topic

log = logging.getLogger("hyperkafka.cluster")

TICK_S = 5.0  # looked at again at least this often (a read that failed is tried again)


def quorum_topic(topic: Topic) -> bool:
    """Whether `topic`'s partitions are quorum-signed (all of a topic's are, or none)."""
    if not topic.partitions or topic.name in INTERNAL_TOPICS:
        return False
    first = topic.partitions[0].log
    return is_quorum_signed(first.manifest, first.public_key)


def same_topic(placement: Placement | None, topic: Topic) -> bool:
    """Whether `placement` is the record of `topic` (a record without a topic id, from
    before topic ids were recorded, is taken as its)."""
    return placement is not None and placement.topic_id in ("", str(topic.topic_id))


async def follow_records(node: Node, cluster: Cluster) -> None:
    """Delete every quorum-signed topic held here whose record is gone, and apply the
    record's configs to the others; at every change of the etcd view."""
    membership = cluster.membership
    await membership.ready.wait()
    said: set[str] = set()  # failed reads, logged once per topic
    while True:
        changed = membership.changed
        for topic in list(node.topics.values()):
            if not quorum_topic(topic):
                continue
            name = topic.name
            placement = membership.placements.get(name)
            if same_topic(placement, topic):
                assert placement is not None
                if placement.authoritative and topic.placed_configs != placement.configs:
                    node.set_placed_configs(topic, placement.configs)
                continue
            if node.creating(name) or name in cluster.placing:
                continue
            try:  # the view says gone: etcd itself must say so
                now = await membership.read_placement(name)
            except EtcdError as exc:
                if name not in said:
                    said.add(name)
                    log.info("topic %s: its record could not be read (%s); kept", name, exc)
                continue
            said.discard(name)
            if same_topic(now, topic) or node.topics.get(name) is not topic:
                continue
            log.info(
                "topic %s (id %s): its etcd record is %s; deleting it here", name,
                topic.topic_id, "gone" if now is None else f"another topic's ({now.topic_id})",
            )  # fmt: skip
            await node.drop_topic(topic)
            membership.poke()  # (a record naming this broker writer of the new topic)
        with trio.move_on_after(TICK_S):
            await changed.wait()

"""The failover of a quorum-signed partition, run by brokers (broker/takeover.py): the
controller fails over a partition whose leader's lease is gone, the elected replica
takes its mirror copy over and takes produces, Metadata names it everywhere. Three
brokers in this process on a test etcd. The parts below (the vote, the takeover in
storage): test_failover.py, storage/tests/test_takeover.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from broker import compose
from broker.protocol import records
from broker.takeover import step_down
from broker.tests.quorum_fixtures import Brokers, create_q, three_brokers
from broker.tests.test_cluster import _metadata, _until
from broker.tests.test_server import fetch_body
from compat_tests.etcd import EtcdServer
from storage.batch import build_batch

ON = {"hyperkafka.quorum.partitions.enable": "true"}
PID = 7 << 40 | 1  # an idempotent producer's id (any id: the writer checks sequences only)


async def _produce(c: Any, value: bytes, seq: int) -> tuple[int, int]:
    """acks=all, an idempotent batch of one record with sequence `seq`: (error, offset)."""
    batch = bytes(build_batch([value], timestamp_ms=1_700_000_000_000, producer_id=PID,
                              producer_epoch=0, base_sequence=seq))
    r = await c.call("produce", 8, {"acks": -1, "timeout": 10000, "transactional_id": None,
                                    "topic_data": [{"name": "q", "partition_data": [{"index": 0, "records": batch}]}]})
    p = r.responses[0].partition_responses[0]
    return int(p.error_code), int(p.base_offset)


async def _values(c: Any) -> list[bytes | None]:
    f = await c.call("fetch", 12, fetch_body("q", 0))
    part = f.responses[0].partitions[0]
    if part.error_code == 6:  # NOT_LEADER_OR_FOLLOWER: the copy was being reopened (step_down)
        return []
    assert part.error_code == 0, part
    return [r.value for b in records.split_batches(bytes(part.records or b"")) for r in records.decode_records(b)]


async def _epochs(c: Any) -> list[int]:
    """The leader epoch each stored batch is stamped with."""
    f = await c.call("fetch", 12, fetch_body("q", 0))
    part = f.responses[0].partitions[0]
    return [records.parse_batch_header(b).partition_leader_epoch
            for b in records.split_batches(bytes(part.records or b""))]


async def test_the_controller_fails_a_dead_leader_over_and_the_elected_replica_writes(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """Broker 1 writes q-0 (replicas 1, 2, 3) and stops: once its lease is gone the
    controller (2 or 3) has the live replicas vote, the elected one (the longest head,
    ties to the lowest id) takes its copy over in epoch 1 and answers acks=all produces
    signed by 2 and 3; every acknowledged record is read once, in order, from it; an
    idempotent producer's retry of its last batch is a duplicate there, not a second
    record; every broker's Metadata names it leader in epoch 1; the other replica
    follows its heads; broker 1 back (its data dir kept) steps down: its copy, reopened
    as a replica, follows the new leader. Then that leader fails too: epoch 2 among the
    other two, and the deposed leader of epoch 1, back, follows epoch 2."""
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            brokers = Brokers(nursery, tmp_path, etcd.endpoint, session_ms=2000, **ON)
            clients = await three_brokers(brokers)
            c1, c2, c3 = clients[1], clients[2], clients[3]
            await create_q(c1)

            async def first() -> bool:
                return (await _produce(c1, b"v0", 0))[0] == 0

            await _until(first)  # once the topic exists everywhere and the links are up
            for seq in (1, 2):
                assert await _produce(c1, b"v%d" % seq, seq) == (0, seq)
            # (a produce to a replica is refused: it is no leader; UNKNOWN_TOPIC_OR_PARTITION
            # until its mirror attached the topic, since one replica's signature is enough)
            async def refused_at_2() -> bool:
                return (await _produce(c2, b"no", 3))[0] == 6

            await _until(refused_at_2)
            brokers.stop(1)  # the leader stops

            async def failed_over() -> bool:
                md = await _metadata(c2, "q")
                p = md.topics[0].partitions[0]
                return 1 not in [b.node_id for b in md.brokers] and p.leader_id in (2, 3) and p.leader_epoch == 1

            await _until(failed_over)
            # the longest head wins, ties to the lowest id: 2, unless 3 signed more
            lead = int((await _metadata(c2, "q")).topics[0].partitions[0].leader_id)
            cl, co = (c2, c3) if lead == 2 else (c3, c2)
            other = 5 - lead
            # the producer retries its last batch at the new leader: a duplicate of offset 2
            assert await _produce(cl, b"v2", 2) == (0, 2)
            for seq in (3, 4):
                assert await _produce(cl, b"v%d" % seq, seq) == (0, seq)
            assert await _values(cl) == [b"v0", b"v1", b"v2", b"v3", b"v4"]
            # (batches written in epoch 1 carry it: a consumer validates its position with it)
            assert await _epochs(cl) == [0, 0, 0, 1, 1]
            md = await _metadata(co, "q")
            p = md.topics[0].partitions[0]
            assert (p.error_code, p.leader_id, p.leader_epoch) == (0, lead, 1)
            assert list(p.replica_nodes) == [1, 2, 3] and list(p.offline_replicas) == [1]
            assert (await _produce(co, b"no", 5))[0] == 6  # NOT_LEADER_OR_FOLLOWER at a replica

            # the other replica follows the new leader's heads (on the new fork)
            async def followed() -> bool:
                return await _values(co) == [b"v0", b"v1", b"v2", b"v3", b"v4"]

            await _until(followed)
            # the old leader back (same data dir): it names the new leader, refuses
            # produces, and its copy, reopened as a replica, follows the new fork
            c1 = await brokers.start(1)

            async def back() -> bool:
                p = (await _metadata(c1, "q")).topics[0].partitions[0]
                return (p.leader_id, p.leader_epoch) == (lead, 1)

            await _until(back)
            assert (await _produce(c1, b"no", 5))[0] == 6

            async def old_follows() -> bool:
                return await _values(c1) == [b"v0", b"v1", b"v2", b"v3", b"v4"]

            await _until(old_follows)
            assert (await _produce(cl, b"v5", 5)) == (0, 5)

            async def old_follows_on() -> bool:
                return len(await _values(c1)) == 6

            await _until(old_follows_on)
            # the new leader fails in turn: epoch 2, among broker 1 and the other replica
            clients = {1: c1, 2: c2, 3: c3}
            brokers.stop(lead)

            async def second() -> bool:
                p = (await _metadata(c1, "q")).topics[0].partitions[0]
                return p.leader_epoch == 2 and p.leader_id in (1, other)

            await _until(second)
            lead2 = int((await _metadata(c1, "q")).topics[0].partitions[0].leader_id)
            assert await _produce(clients[lead2], b"v6", 6) == (0, 6)
            # the deposed leader of epoch 1 back: it steps down and follows epoch 2
            clients[lead] = await brokers.start(lead)

            async def deposed_follows() -> bool:
                return len(await _values(clients[lead])) == 7

            await _until(deposed_follows)
            # a quorum of 2 signs: with the two others gone, nothing is written
            for i in (1, 2, 3):
                if i != lead2:
                    brokers.stop(i)

            async def alone() -> bool:
                return [b.node_id for b in (await _metadata(clients[lead2], "q")).brokers] == [lead2]

            await _until(alone)
            assert (await _produce(clients[lead2], b"v7", 7))[0] == 19  # NOT_ENOUGH_REPLICAS
            assert await _values(clients[lead2]) == [b"v%d" % i for i in range(7)]
            nursery.cancel_scope.cancel()


async def test_a_deposed_elected_leader_steps_down_in_place(
    tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader a failover elected (its copy was its mirror's) and a later failover
    deposed while it ran (a pause past the session timeout, then SIGCONT: the Jepsen
    quorum run's case) steps down where it runs: `step_down` reopens that copy as a
    replica, held by the quorum role and served as the partition's log. Before, it asked
    the store, which knows only the topics it writes, to hold the copy: UnknownTopic, the
    copy left discarded, and its votes refused ("log is closed"), so no later failover of
    the partition found a majority."""
    roles: dict[int, tuple[Any, Any]] = {}

    async def recording(node: Any, cluster: Any, role: Any) -> None:
        roles[node.config.node_id] = (node, role)
        await real_failover(node, cluster, role)

    real_failover = compose.run_failover
    monkeypatch.setattr(compose, "run_failover", recording)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            brokers = Brokers(nursery, tmp_path, etcd.endpoint, session_ms=2000, **ON)
            clients = await three_brokers(brokers)
            c1 = clients[1]
            await create_q(c1)

            async def first() -> bool:
                return (await _produce(c1, b"v0", 0))[0] == 0

            await _until(first)
            brokers.stop(1)  # the writer stops: a failover elects 2 or 3 in epoch 1

            async def failed_over() -> bool:
                p = (await _metadata(clients[2], "q")).topics[0].partitions[0]
                return p.leader_id in (2, 3) and p.leader_epoch == 1

            await _until(failed_over)
            lead = int((await _metadata(clients[2], "q")).topics[0].partitions[0].leader_id)
            assert await _produce(clients[lead], b"v1", 1) == (0, 1)
            node, role = roles[lead]
            held = node.partition("q", 0)
            assert held.led and held.topic.mirrored  # it writes its mirror's copy
            # What its takeover loop does once the placement names another leader:
            assert await step_down(node, role, "q", 0)
            now = node.partition("q", 0)
            assert now is not held and not now.led and now.log.replica
            copy = role.followers[now.log.key][1]
            assert copy.log is now.log and copy.length == 2  # v0 and v1, open and held
            assert copy.log.block(1)  # readable: not the discarded log
            nursery.cancel_scope.cancel()

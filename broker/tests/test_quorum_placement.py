"""Quorum-signed partitions, the placement side (broker/cluster/quorum.py): replication
factor, replicas, the placement record in etcd, the manifests the writer makes from the
replicas' node keys, and Metadata's replicas. The signing channel: test_quorum_signing.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.cluster.etcd import Etcd
from broker.cluster.membership import Placement
from broker.cluster.quorum import (
    QuorumPlacementError,
    assigned_replicas,
    choose_replicas,
    replication_factor,
)
from broker.config import BrokerConfig, apply_properties
from broker.protocol import records
from broker.tests.quorum_fixtures import Brokers, create_q, three_brokers
from broker.tests.test_cluster import _create, _metadata, _until
from broker.tests.test_server import fetch_body
from compat_tests.etcd import EtcdServer
from storage.batch import build_batch
from storage.fs import OsFileSystem
from storage.hypercore.multisig import majority
from storage.manifest_file import read_manifest
from storage.store import partition_key_name
from storage.verify import verify_partition


def test_the_setting_is_on_by_default_and_parsed() -> None:
    assert BrokerConfig().quorum_partitions is True
    off = apply_properties(BrokerConfig(), {"hyperkafka.quorum.partitions.enable": "false"})
    assert off.quorum_partitions is False
    on = apply_properties(off, {"hyperkafka.quorum.partitions.enable": "true"})
    assert on.quorum_partitions is True


def test_replication_factor_is_kafkas() -> None:
    assert replication_factor(-1, 3, 5) == 3  # default.replication.factor
    assert replication_factor(-1, 3, 2) == 2  # the broker default is capped by live brokers
    assert replication_factor(2, 3, 3) == 2
    with pytest.raises(QuorumPlacementError) as e:
        replication_factor(4, 1, 3)  # asked for more than the brokers: refused
    assert e.value.code == 38  # INVALID_REPLICATION_FACTOR


def test_replicas_start_with_the_writer_and_spread() -> None:
    r = choose_replicas(2, [1, 2, 3, 4], 3, 4)
    assert all(x[0] == 2 and len(set(x)) == 3 for x in r)
    assert r == ((2, 1, 3), (2, 3, 4), (2, 4, 1), (2, 1, 3))
    assert choose_replicas(1, [1], 1, 2) == ((1,), (1,))


def test_assignment_names_the_replicas() -> None:
    live = [1, 2, 3]
    assert assigned_replicas([(1, [2, 3]), (0, [2, 1])], 2, live) == ((2, 1), (2, 3))
    for bad in (
        [(0, [2, 1])],
        [(0, [2, 1]), (1, [3, 1])],
        [(0, [2, 2]), (1, [2, 1])],
        [(0, [2, 9]), (1, [2, 1])],
        [(0, [2, 1]), (1, [2, 1, 3])],
    ):
        with pytest.raises(QuorumPlacementError) as e:
            assigned_replicas(bad, 2, live)
        assert e.value.code == 39


def test_placement_record_keeps_the_replicas() -> None:
    p = Placement("t", 2, 2, {"a": "b"}, 3, ((2, 1, 3), (2, 3, 1)))
    assert Placement.decode("t", p.encode()) == p
    old = Placement("t", 2, 2)  # a record without replicas: every broker mirrors it
    assert b"replicas" not in old.encode() and Placement.decode("t", old.encode()).replicas == ()


async def test_a_quorum_topic_gets_a_manifest_of_its_replicas_keys(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """Three brokers with the setting on: CreateTopics with replication factor 3 is placed
    with each partition's replicas, the writer makes each archive with a v2 manifest of
    their node keys (placement order, majority quorum, userData naming the partition),
    and Metadata reports those replicas. Replication factor 4 is refused."""
    on = {"hyperkafka.quorum.partitions.enable": "true"}
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            c1 = (await three_brokers(Brokers(nursery, tmp_path, etcd.endpoint, **on)))[1]
            r = await _create(
                c1,
                [
                    {
                        "name": "q",
                        "num_partitions": 2,
                        "replication_factor": 3,
                        "assignments": [],
                        "configs": [],
                    },
                    {
                        "name": "q4",
                        "num_partitions": 1,
                        "replication_factor": 4,
                        "assignments": [],
                        "configs": [],
                    },
                ],
            )
            assert [t.error_code for t in r.topics] == [0, 38]
            client = Etcd([etcd.endpoint])
            placed, _ = await client.get(b"/hyperkafka/topics/q")
            rec = Placement.decode("q", placed[0].value)
            assert len(rec.replicas) == 2 and all(sorted(x) == [1, 2, 3] for x in rec.replicas)
            assert all(x[0] == rec.writer for x in rec.replicas)

            async def created() -> bool:
                md = await _metadata(c1, "q")
                return md.topics[0].error_code == 0 and len(md.topics[0].partitions) == 2

            await _until(created)
            md = await _metadata(c1, "q")
            for p in md.topics[0].partitions:
                assert list(p.replica_nodes) == list(rec.replicas[p.partition_index])
            keys = {}
            for i in (1, 2, 3):  # each broker's node key, as it published it in etcd
                kv, _ = await client.get(f"/hyperkafka/brokers/{i}".encode())
                keys[i] = bytes.fromhex(json.loads(kv[0].value)["node_key"])
            md10 = await c1.call(
                "metadata",
                10,
                {
                    "topics": [{"name": "q", "topic_id": uuid.UUID(int=0)}],
                    "allow_auto_topic_creation": False,
                    "include_cluster_authorized_operations": False,
                    "include_topic_authorized_operations": False,
                },
            )
            tid = md10.topics[0].topic_id
            assert isinstance(tid, uuid.UUID) and tid.int != 0
            for p in range(2):
                pdir = tmp_path / f"b{rec.writer}" / f"q-{p}"
                m = read_manifest(OsFileSystem(), str(pdir))
                assert m is not None and m.version == 2 and m.quorum == majority(3) == 2
                assert [s.public_key for s in m.signers] == [keys[i] for i in rec.replicas[p]]
                assert m.user_data == partition_key_name(tid, p)
            nursery.cancel_scope.cancel()


async def _produce(c: Any, topic: str, acks: int, value: bytes, index: int = 0) -> tuple[int, str | None]:
    batch = bytes(build_batch([value], timestamp_ms=1_700_000_000_000))
    r = await c.call(
        "produce",
        8,
        {
            "acks": acks,
            "timeout": 10000,
            "transactional_id": None,
            "topic_data": [{"name": topic, "partition_data": [{"index": index, "records": batch}]}],
        },
    )
    p = r.responses[0].partition_responses[0]
    return int(p.error_code), p.error_message


async def test_three_brokers_sign_acks_all_by_quorum(tmp_path: Path, etcd: EtcdServer) -> None:
    """acks=all to a quorum-signed partition is answered once its leader stored a head
    that 2 of the 3 replicas signed (the leader counting), over the hyperkafka/quorum
    channel of real replication connections; the head verifies against the manifest;
    each replica's signing record holds what it signed; with two replicas' brokers gone
    a produce is refused NOT_ENOUGH_REPLICAS before anything is written."""
    on = {"hyperkafka.quorum.partitions.enable": "true"}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            brokers = Brokers(nursery, tmp_path, etcd.endpoint, **on)
            c1 = (await three_brokers(brokers))[1]
            await create_q(c1)

            async def acked() -> bool:
                code, _ = await _produce(c1, "q", -1, b"v0")
                return code == 0

            await _until(acked)  # once the topic exists everywhere and the links are up
            pdir = tmp_path / "b1" / "q-0"
            for i in (2, 3):
                assert (await _produce(c1, "q", -1, b"v%d" % i))[0] == 0
            manifest = read_manifest(OsFileSystem(), str(pdir))
            assert manifest is not None and manifest.quorum == 2
            res = verify_partition(str(pdir), manifest)  # the leader's quorum heads
            assert res.ok and res.signed_length >= 3, res
            signed = [i for i in (2, 3) if list((tmp_path / f"b{i}").rglob("q-0/signed"))]
            assert signed, "no replica signed"
            brokers.stop(3)  # one replica gone: 2 of 3 still sign

            async def gone(i: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return i not in [b.node_id for b in (await _metadata(c1, "q")).brokers]

                return check

            await _until(await gone(3))
            assert (await _produce(c1, "q", -1, b"after-one"))[0] == 0
            brokers.stop(2)
            await _until(await gone(2))
            code, msg = await _produce(c1, "q", -1, b"after-two")
            assert code == 19 and msg is not None and "live replicas" in msg  # NOT_ENOUGH_REPLICAS
            code, _ = await _produce(c1, "q", 1, b"after-two-acks1")
            assert code == 19  # nothing can be signed: nothing is written
            # consumers read exactly the four acknowledged batches, all under quorum heads
            f = await c1.call("fetch", 12, fetch_body("q", 0))
            part = f.responses[0].partitions[0]
            assert (part.error_code, part.high_watermark) == (0, 4)
            values = [
                r.value
                for b in records.split_batches(bytes(part.records))
                for r in records.decode_records(b)
            ]
            assert values == [b"v0", b"v2", b"v3", b"after-one"]
            nursery.cancel_scope.cancel()


async def test_a_new_topic_takes_its_first_produce_at_once(tmp_path: Path, etcd: EtcdServer) -> None:
    """With the default settings a cluster's new topic is quorum-signed, and its writer
    sets up each partition's signer as it creates it, so the first produce, sent as soon
    as CreateTopics answered, is acknowledged (not refused NOT_ENOUGH_REPLICAS because the
    signer would come with the next scan for unsigned partitions)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            c1 = (await three_brokers(Brokers(nursery, tmp_path, etcd.endpoint)))[1]
            for name in ("q", "r"):  # written by broker 1 (the controller: made as it answers)
                r = await _create(c1, [{"name": name, "num_partitions": -1, "replication_factor": -1,
                                        "assignments": [{"partition_index": 0, "broker_ids": [1, 2, 3]},
                                                        {"partition_index": 1, "broker_ids": [1, 3, 2]}],
                                        "configs": []}])  # fmt: skip
                assert r.topics[0].error_code == 0
                for index in (0, 1):  # (acks=1: it is answered on a quorum-signed head too)
                    assert await _produce(c1, name, 1, b"first", index=index) == (0, None)
                manifest = read_manifest(OsFileSystem(), str(tmp_path / "b1" / f"{name}-0"))
                assert manifest is not None and (len(manifest.signers), manifest.quorum) == (3, 2)
            nursery.cancel_scope.cancel()

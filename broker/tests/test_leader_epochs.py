"""Leader epochs in Kafka's answers (broker/handlers/cluster.py, offsets.py, fetch.py):
a quorum-signed partition's epoch is its archive's fork, which a failover moves on;
requests naming a current_leader_epoch are checked against it as Kafka's leader does,
and OffsetForLeaderEpoch answers from the partition's leader-epoch checkpoint."""

from __future__ import annotations

import types
import uuid
from pathlib import Path

import pytest

from broker.handlers import errors
from broker.handlers.cluster import LEADER_EPOCH, epoch_error, leader_epoch
from broker.handlers.offsets import end_offset_for
from broker.tests.conftest import Broker
from storage.epochs import EpochCache
from storage.fs import OsFileSystem
from storage.hypercore import KeyPair, Manifest
from storage.quorum import partition_manifest

KPS = [KeyPair.from_seed(bytes([0x71 + i]) * 32) for i in range(3)]


def test_epoch_checks_as_kafka_answers_them() -> None:
    assert epoch_error(-1, 5) == errors.NONE  # no epoch named: no check
    assert epoch_error(5, 5) == errors.NONE
    assert epoch_error(4, 5) == errors.FENCED_LEADER_EPOCH  # the client is behind
    assert epoch_error(6, 5) == errors.UNKNOWN_LEADER_EPOCH  # this broker is behind
    assert epoch_error(1, 0) == errors.UNKNOWN_LEADER_EPOCH  # as before for epoch 0


def test_a_quorum_partitions_epoch_is_its_fork() -> None:
    quorum = partition_manifest([k.public_key for k in KPS], uuid.uuid4(), 0)
    single = types.SimpleNamespace(manifest=None, public_key=KPS[0].public_key, fork=3)
    default = types.SimpleNamespace(
        manifest=Manifest.default(KPS[0].public_key), public_key=KPS[0].public_key, fork=3
    )
    q = types.SimpleNamespace(manifest=quorum, public_key=KPS[0].public_key, fork=3)
    # a single signer's fork moves at recovery (FORMAT.md section 8): no leader change
    assert leader_epoch(single) == leader_epoch(default) == LEADER_EPOCH
    assert leader_epoch(q) == 3


def test_offset_for_leader_epoch_answers(tmp_path: Path) -> None:
    # no failover yet: one epoch, the whole log
    assert end_offset_for(0, None, 40, 0) == (0, 40)
    assert end_offset_for(0, None, 40, 1) == (-1, -1)
    # epochs 0 from 0, 2 from 12 (a takeover kept 12 offsets), high watermark 30
    cache = EpochCache(OsFileSystem(), str(tmp_path))
    cache.assign(0, 0)
    cache.assign(2, 12)
    assert end_offset_for(2, cache, 30, 0) == (0, 12)  # a follower of epoch 0 truncates to 12
    assert end_offset_for(2, cache, 30, 1) == (0, 12)  # an epoch that never led: the one before
    assert end_offset_for(2, cache, 30, 2) == (2, 30)
    assert end_offset_for(2, cache, 30, 3) == (-1, -1)
    assert end_offset_for(2, cache, 8, 0) == (0, 8)  # never past the high watermark


async def test_kafka_answers_of_a_partition_whose_epoch_moved(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition in leader epoch 2 (as a takeover leaves it: epoch 0 from 0, 2 from
    offset 1): Metadata names epoch 2; a Fetch or ListOffsets naming an older current
    epoch is fenced, a newer one unknown; OffsetForLeaderEpoch answers epoch 0's end; a
    Fetch whose last fetched epoch 0 is past that end gets the diverging epoch and no
    records, one within it its records. (Which partitions move epochs is a takeover's
    business: here the epoch of this one topic's log is set to 2.)"""
    import broker.handlers.cluster as cluster_handlers
    import broker.handlers.fetch as fetch_handlers
    import broker.handlers.offsets as offsets_handlers
    from broker.tests.test_server import batch, create, fetch_body, produce

    await create(broker, "moved")
    c = await broker.connect()
    for v in (b"a", b"b", b"c"):
        assert (await produce(c, "moved", batch([v]))).error_code == 0
    path = broker.config.data_dir / "moved-0"
    cache = EpochCache(OsFileSystem(), str(path))
    cache.assign(0, 0)
    cache.assign(2, 1)

    def epoch(log: object) -> int:
        return 2 if str(getattr(log, "path", "")).endswith("moved-0") else leader_epoch(log)

    for m in (cluster_handlers, fetch_handlers, offsets_handlers):
        monkeypatch.setattr(m, "leader_epoch", epoch)

    md = await c.call("metadata", 12, {"topics": [{"name": "moved", "topic_id": None}],
                                       "allow_auto_topic_creation": False,
                                       "include_topic_authorized_operations": False})  # fmt: skip
    assert md.topics[0].partitions[0].leader_epoch == 2

    async def fetch(current: int, last: int, offset: int):  # type: ignore[no-untyped-def]
        body = fetch_body("moved", offset)
        part = body["topics"][0]["partitions"][0]
        part.update(current_leader_epoch=current, last_fetched_epoch=last)
        return (await c.call("fetch", 12, body)).responses[0].partitions[0]

    assert (await fetch(1, -1, 0)).error_code == errors.FENCED_LEADER_EPOCH
    assert (await fetch(3, -1, 0)).error_code == errors.UNKNOWN_LEADER_EPOCH
    d = await fetch(2, 0, 3)
    assert d.error_code == 0 and (d.diverging_epoch.epoch, d.diverging_epoch.end_offset) == (0, 1)
    assert not d.records
    ok = await fetch(2, 0, 1)
    assert ok.error_code == 0 and ok.diverging_epoch.epoch == -1 and ok.records
    ofle = await c.call("offset_for_leader_epoch", 4, {"replica_id": -1, "topics": [{"topic": "moved", "partitions": [
        {"partition": 0, "current_leader_epoch": 2, "leader_epoch": 0},
        {"partition": 0, "current_leader_epoch": -1, "leader_epoch": 2},
        {"partition": 0, "current_leader_epoch": 0, "leader_epoch": 0},
    ]}]})  # fmt: skip
    a, b, fenced = ofle.topics[0].partitions
    assert (a.error_code, a.leader_epoch, a.end_offset) == (0, 0, 1)
    assert (b.leader_epoch, b.end_offset) == (2, 3)
    assert fenced.error_code == errors.FENCED_LEADER_EPOCH
    lo = await c.call("list_offsets", 7, {"replica_id": -1, "isolation_level": 0, "topics": [
        {"name": "moved", "partitions": [{"partition_index": 0, "current_leader_epoch": 1, "timestamp": -1}]}]})  # fmt: skip
    assert lo.topics[0].partitions[0].error_code == errors.FENCED_LEADER_EPOCH

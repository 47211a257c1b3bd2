"""Leader epochs in Kafka's answers (broker/handlers/cluster.py, offsets.py, fetch.py):
a quorum-signed partition's epoch is its archive's fork, which a failover moves on;
requests naming a current_leader_epoch are checked against it as Kafka's leader does,
and OffsetForLeaderEpoch answers from the partition's leader-epoch checkpoint."""

from __future__ import annotations

import types
import uuid
from pathlib import Path

from broker.handlers import errors
from broker.handlers.cluster import LEADER_EPOCH, epoch_error, leader_epoch
from broker.handlers.offsets import end_offset_for
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

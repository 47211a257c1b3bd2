"""Store: node seed, catalog archive, topics, keys, caching."""

from __future__ import annotations

import os
import stat
import uuid

import pytest
from storage_testutil import make_batch

from storage import FsyncPolicy, LogConfig, Store
from storage.errors import StorageError, TopicExists, UnknownTopic
from storage.store import CATALOG_DIR
from storage.verify import verify_partition


def test_seed_catalog_and_topics_survive_reopen(tmp_path):
    store = Store.open(tmp_path)
    seed = tmp_path / "node.seed"
    assert stat.S_IMODE(os.stat(seed).st_mode) == 0o600 and len(seed.read_bytes()) == 32
    rec = store.create_topic("a", 3, {"retention.ms": "1000"})
    assert rec.topic_id.int != 0 and rec.partitions == 3
    tid = uuid.UUID(int=12345)
    store.create_topic("b.c_d-e", 1, {}, topic_id=tid)
    with pytest.raises(TopicExists):
        store.create_topic("a", 1, {})
    with pytest.raises(StorageError):
        store.create_topic("bad/name", 1, {})
    store.set_topic_configs("a", {"retention.ms": "5", "segment.bytes": "4096"})
    lg = store.log("a", 2)
    assert store.log("a", 2) is lg  # cached
    assert lg.config.segment_bytes == 4096 and lg.config.retention_ms == 5
    assert lg.key == store.archive_key("a", 2)
    lg.append(make_batch())
    node_key = store.node_public_key
    keys = [store.archive_key("a", p) for p in range(3)]
    assert len(set(keys)) == 3
    store.close()  # commits pending data

    store = Store.open(tmp_path)
    assert store.node_public_key == node_key
    t = store.topics()
    assert set(t) == {"a", "b.c_d-e"}
    assert t["a"].topic_id == rec.topic_id and t["b.c_d-e"].topic_id == tid
    assert dict(t["a"].configs) == {"retention.ms": "5", "segment.bytes": "4096"}
    assert [store.archive_key("a", p) for p in range(3)] == keys
    assert store.log("a", 2).high_watermark == 1
    with pytest.raises(UnknownTopic):
        store.log("a", 3)
    with pytest.raises(UnknownTopic):
        store.log("zzz", 0)
    # the catalog is itself a signed archive, verifiable with the node key alone
    assert verify_partition(os.path.join(tmp_path, CATALOG_DIR), node_key).ok
    store.close()


def test_delete_and_recreate_gets_a_new_archive_key(tmp_path):
    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS)
    store.create_topic("t", 1, {})
    old_key = store.archive_key("t", 0)
    store.log("t", 0).append(make_batch())
    store.log("t", 0).commit()
    store.delete_topic("t")
    assert "t" not in store.topics()
    assert not os.path.exists(tmp_path / "t-0")
    with pytest.raises(UnknownTopic):
        store.delete_topic("t")
    store.create_topic("t", 1, {})
    assert store.archive_key("t", 0) != old_key  # never two histories under one key
    assert store.log("t", 0).high_watermark == 0
    store.close()


def test_orphan_partition_dirs_are_removed(tmp_path):
    store = Store.open(tmp_path)
    store.create_topic("t", 1, {})
    store.close()
    os.makedirs(tmp_path / "ghost-0")
    (tmp_path / "ghost-0" / "x").write_bytes(b"1")
    store = Store.open(tmp_path)
    assert not os.path.exists(tmp_path / "ghost-0")
    store.close()


def test_explicit_log_config_wins(tmp_path):
    store = Store.open(tmp_path)
    store.create_topic("t", 1, {"segment.bytes": "100000"})
    lg = store.log("t", 0, LogConfig(segment_bytes=777))
    assert lg.config.segment_bytes == 777
    store.close()

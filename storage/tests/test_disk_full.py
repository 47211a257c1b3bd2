"""A full disk (ENOSPC injected through the filesystem seam): what storage keeps and serves.

- Recovery that must write (sign a tail written but never signed) and cannot opens the
  archive read-only, serving every signed batch; a reopen with room recovers it whole.
- A catalog change whose commit failed is never applied, and the next change (after
  room returned) goes through; a restart does not resurrect the failed one.
- A topic whose partitions cannot be made is not recorded, and leaves no directory.
"""

from __future__ import annotations

import os
import uuid

import pytest
from storage_testutil import KEYPAIR, make_batch

from storage import FsyncPolicy, LogConfig, PartitionLog, Store
from storage.errors import RecoveryFailed, StorageError
from storage.fs import FaultyFileSystem
from storage.store import CATALOG_DIR
from storage.verify import verify_partition


def test_recovery_that_cannot_write_opens_read_only_with_every_signed_batch(tmp_path):
    fs = FaultyFileSystem()
    path = str(tmp_path / "p")
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.INTERVAL, fs=fs)
    for i in range(3):
        lg.append(make_batch(seed=i))
    lg.commit()
    signed = lg.high_watermark
    served = lg.read_bytes(0, 1 << 20)
    lg.append(make_batch(seed=9))  # written, never signed: recovery signs it
    fs.crash("keep")  # the process dies; the page cache survives

    fs.fail_write = lambda p: True  # the disk is full
    ro = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.INTERVAL, fs=fs)
    assert isinstance(ro.damage, RecoveryFailed)
    assert ro.high_watermark == signed
    assert ro.read_bytes(0, 1 << 20) == served  # authenticated on read
    with pytest.raises(StorageError):
        ro.append(make_batch())
    ro.close()

    fs.fail_write = None  # room again
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.INTERVAL, fs=fs)
    assert lg.damage is None and lg.high_watermark == signed + 1
    lg.append(make_batch(seed=10))
    lg.commit()
    assert lg.high_watermark == signed + 2
    lg.close()
    assert verify_partition(path, KEYPAIR.public_key).ok


def test_a_catalog_change_that_failed_is_never_applied(tmp_path):
    fs = FaultyFileSystem()
    store = Store.open(tmp_path, fs=fs)
    store.create_topic("a", 1, {})
    catalog = os.path.abspath(tmp_path / CATALOG_DIR)
    fs.fail_fsync = lambda p: p.startswith(catalog)  # the catalog's commit fails
    with pytest.raises(StorageError):
        store.create_topic("b", 1, {})
    assert set(store.topics()) == {"a"}
    assert not (tmp_path / "b-0").exists()
    fs.fail_fsync = None
    store.create_topic("c", 1, {})  # reopens the catalog, cutting the failed change
    store.delete_topic("a")
    assert set(store.topics()) == {"c"}
    store.close()

    store = Store.open(tmp_path, fs=fs)
    assert set(store.topics()) == {"c"}
    assert verify_partition(os.path.join(tmp_path, CATALOG_DIR), store.node_public_key).ok
    store.close()


def test_a_topic_whose_partitions_cannot_be_made_is_not_recorded(tmp_path):
    fs = FaultyFileSystem()
    store = Store.open(tmp_path, fs=fs)
    fs.fail_write = lambda p: os.path.basename(os.path.dirname(p)) == "x-2"  # the third partition
    tid = uuid.uuid4()
    with pytest.raises(StorageError):
        store.prepare_partitions("x", tid, 3, LogConfig())
    assert "x" not in store.topics()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("x-")]
    fs.fail_write = None
    made = store.prepare_partitions("x", tid, 3, LogConfig())
    store.create_topic("x", 3, {}, tid)
    store.adopt("x", made)
    assert store.log("x", 2) is made[2] and made[2].damage is None
    store.close()
    store = Store.open(tmp_path, fs=fs)
    assert store.topics()["x"].partitions == 3
    store.close()

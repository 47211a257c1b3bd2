"""Tampering below the signed head: verify catches it, the log refuses to serve it."""

from __future__ import annotations

import os
import struct

import crc32c
import pytest
from storage_testutil import crc_ok, split_batches

from storage import FsyncPolicy, Store
from storage.cli import keys_command, verify_command
from storage.errors import CorruptBatch
from storage.store import partition_dir


def build_store(tmp_path, n=8):
    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS)
    store.create_topic("events", 2, {})
    store.create_topic("other", 1, {"retention.ms": "-1"})
    from storage_testutil import make_batch

    batches = []
    lg = store.log("events", 1)
    for i in range(n):
        b = make_batch(3, value_size=40, seed=i, ts=1000 + i)
        lg.append(b)
        batches.append(bytes(b))
        lg.commit()
    store.log("other", 0).append(make_batch(1))
    store.close()
    return batches


def rewrite_record_with_valid_crc(seg_path, batch_pos, batch_len):
    """Flip a byte in the record payload and recompute the batch CRC-32C."""
    with open(seg_path, "r+b") as f:
        f.seek(batch_pos)
        b = bytearray(f.read(batch_len))
        b[-5] ^= 0x55
        struct.pack_into(">I", b, 17, crc32c.crc32c(bytes(b[21:])))
        assert crc_ok(bytes(b))
        f.seek(batch_pos)
        f.write(b)


def test_verify_ok_and_keys(tmp_path, capsys):
    build_store(tmp_path)
    assert verify_command(str(tmp_path), None) == 0
    assert verify_command(str(tmp_path), "events") == 0
    out = capsys.readouterr().out
    assert "ok events 1 8 blocks, 8 signed" in out
    assert keys_command(str(tmp_path)) == 0
    out = capsys.readouterr().out.splitlines()
    store = Store.open(tmp_path)
    assert out[0] == f"node\t{store.node_public_key.hex()}"
    assert f"events\t1\t{store.archive_key('events', 1).hex()}" in out
    assert f"other\t0\t{store.archive_key('other', 0).hex()}" in out
    assert store.log("events", 1).key == store.archive_key("events", 1)
    store.close()


def test_rewritten_record_with_valid_crc_is_caught(tmp_path, capsys):
    batches = build_store(tmp_path)
    seg = os.path.join(partition_dir(str(tmp_path), "events", 1), "00000000000000000000.log")
    bad = 5
    pos = sum(map(len, batches[:bad]))
    rewrite_record_with_valid_crc(seg, pos, len(batches[bad]))
    capsys.readouterr()
    assert verify_command(str(tmp_path), None) == 1
    out = capsys.readouterr().out
    assert f"BAD events 1 {bad * 3} " in out  # topic, partition, first bad offset
    assert "ok other 0" in out

    store = Store.open(tmp_path, fsync=FsyncPolicy.ALWAYS)
    lg = store.log("events", 1)
    # a read crossing the bad batch serves only the batches before it
    data = lg.read_bytes(0, 1 << 30)
    assert split_batches(data) == batches[:bad]
    with pytest.raises(CorruptBatch) as exc:
        lg.read(bad * 3 + 1, 1 << 20)
    assert exc.value.offset == bad * 3
    with pytest.raises(CorruptBatch):  # and nothing after it either
        lg.read((bad + 1) * 3, 1 << 20)
    store.close()


def test_tamper_with_index_and_tree_too_is_still_caught(tmp_path, capsys):
    """Even rewriting the index leaf hash (with its CRC) and the tree leaf node does not
    help: the path up to the signed root no longer hashes."""
    from storage.log import ENTRY_SIZE, IDX_HEADER_SIZE, NODE_SIZE, compute_leaf, encode_entry

    batches = build_store(tmp_path)
    d = partition_dir(str(tmp_path), "events", 1)
    bad = 2
    pos = sum(map(len, batches[:bad]))
    rewrite_record_with_valid_crc(os.path.join(d, "00000000000000000000.log"), pos,
                                  len(batches[bad]))
    with open(os.path.join(d, "00000000000000000000.log"), "rb") as f:
        f.seek(pos)
        nb = f.read(len(batches[bad]))
    leaf = compute_leaf(nb, len(nb))
    with open(os.path.join(d, "00000000000000000000.bidx"), "r+b") as f:
        f.seek(IDX_HEADER_SIZE + bad * ENTRY_SIZE)
        f.write(encode_entry(bad * 3, 1000 + bad, pos, len(nb), 2, leaf))
    with open(os.path.join(d, "tree"), "r+b") as f:
        f.seek(2 * bad * NODE_SIZE)
        f.write(len(nb).to_bytes(8, "little") + leaf)
    capsys.readouterr()
    assert verify_command(str(tmp_path), "events") == 1
    assert f"BAD events 1 {bad * 3} " in capsys.readouterr().out
    store = Store.open(tmp_path)
    lg = store.log("events", 1)
    assert split_batches(lg.read_bytes(0, 1 << 30)) == batches[:bad]
    store.close()


def _snapshot(root):
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[p] = fh.read()
    return out


def test_offline_commands_never_write(tmp_path, capsys):
    build_store(tmp_path)
    before = _snapshot(tmp_path)
    assert verify_command(str(tmp_path), None) == 0
    assert keys_command(str(tmp_path)) == 0
    assert _snapshot(tmp_path) == before
    capsys.readouterr()


def test_verify_unknown_topic_and_missing_seed(tmp_path, capsys):
    build_store(tmp_path)
    assert verify_command(str(tmp_path), "nope") == 1
    assert "BAD nope" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert keys_command(str(empty)) != 0
    assert verify_command(str(empty), None) != 0

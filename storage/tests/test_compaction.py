"""Compaction of local storage (storage/compaction.py, FORMAT.md 4a): whole blocks whose
every record is superseded go, offsets and the signed tree stay, survivors stay provable
against heads signed before the compaction, and a crash in the swap is finished or undone."""

from __future__ import annotations

import os
import struct

import pytest
from storage_testutil import KEYPAIR, split_batches

from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.batch import HEADER_SIZE, build_batch
from storage.compaction import CompactionPolicy, Records, TxnBatch, clean
from storage.hypercore.proofs import inclusion_proof, verify_proof
from storage.verify import verify_partition

NOW = 10_000_000
DAY = 86_400_000


def keys_of(batch: bytes) -> list[tuple[int, bytes, bool]] | None:
    """(offset, key, tombstone) of an uncompressed batch's records; None if one has no key."""
    base, count = struct.unpack_from(">q", batch, 0)[0], struct.unpack_from(">i", batch, 57)[0]
    pos = HEADER_SIZE

    def varint() -> int:
        nonlocal pos
        shift = z = 0
        while True:
            b = batch[pos]
            pos += 1
            z |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return (z >> 1) ^ -(z & 1)

    out = []
    for _ in range(count):
        length = varint()
        end = pos + length
        pos += 1
        varint()
        delta = varint()
        klen = varint()
        if klen < 0:
            return None
        key = bytes(batch[pos : pos + klen])
        pos += klen
        vlen = varint()
        out.append((base + delta, key, vlen < 0))
        pos = end
    return out


def records_of(data: bytes) -> list[tuple[int, bytes, bytes | None]]:
    out = []
    for b in split_batches(data):
        base = struct.unpack_from(">q", b, 0)[0]
        recs = keys_of(b)
        assert recs is not None
        values = _values(b)
        out += [(off, key, None if tomb else values[i]) for i, (off, key, tomb) in enumerate(recs)]
        assert recs[0][0] == base
    return out


def _values(batch: bytes) -> list[bytes]:
    from storage.batch import record_values

    return record_values(batch)


def open_log(path: object) -> PartitionLog:
    return PartitionLog.open(
        path,
        KEYPAIR,
        fsync=FsyncPolicy.ALWAYS,  # type: ignore[arg-type]
        config=LogConfig(segment_bytes=400, retention_ms=-1),
    )


def append(lg: PartitionLog, pairs: list[tuple[bytes, bytes | None]], ts: int = NOW) -> bytes:
    b = build_batch([v for _, v in pairs], keys=[k for k, _ in pairs], timestamp_ms=ts)
    lg.append(b)
    return bytes(b)


def read_all(lg: PartitionLog) -> bytes:
    out = b""
    offset = lg.log_start_offset
    while offset < lg.high_watermark:
        r = lg.read(offset, 1 << 20)
        out += r.read()
        offset = r.end_offset
    return out


POLICY = CompactionPolicy(delete_retention_ms=DAY)


def test_last_value_per_key_stays_with_its_offset(tmp_path: object) -> None:
    lg = open_log(tmp_path)
    for i in range(60):
        append(lg, [(b"k%d" % (i % 4), b"v%d" % i)])
    lg.commit()
    old_head = lg.head
    assert old_head is not None
    before = records_of(read_all(lg))
    assert len(before) == 60
    res = clean(lg, keys_of, POLICY, NOW)
    assert res is not None and res.removed_blocks > 0 and res.freed_bytes > 0
    after = records_of(read_all(lg))
    # offsets kept, gaps allowed; the last value of each key is there
    assert set(after) <= set(before)
    latest = {k: (off, v) for off, k, v in before}
    for k, (off, v) in latest.items():
        assert (off, k, v) in after
    assert len(after) < 30
    # nothing signed changed; survivors are provable against the head signed before
    assert lg.head == old_head
    off, _, _ = after[0]
    leaf = lg.leaf_of_offset(off)
    p = inclusion_proof(
        lg.node, old_head.length, old_head.fork, old_head.signature, leaf, lg.block(leaf)
    )
    assert (
        verify_proof(p, public_key=KEYPAIR.public_key, key=lg.key, fork=old_head.fork) is not None
    )
    removed = next(i for i in range(60) if i != leaf and lg.leaf_of_offset(i) == i and _gone(lg, i))
    with pytest.raises(KeyError):
        lg.block(removed)
    # reading from a removed offset starts at the next batch kept
    r = lg.read(removed, 1 << 20)
    assert r.base_offset > removed and records_of(r.read())[0][0] > removed
    v = verify_partition(str(tmp_path), KEYPAIR.public_key)
    assert v.ok and v.compacted == res.removed_blocks, v
    # the archive goes on: reopen, append, sign, verify
    lg.close()
    lg = open_log(tmp_path)
    assert records_of(read_all(lg)) == after
    append(lg, [(b"k0", b"new")])
    head = lg.commit()
    assert head is not None and head.length == 61
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()


def _gone(lg: PartitionLog, index: int) -> bool:
    try:
        lg.block(index)
    except KeyError:
        return True
    return False


def test_a_batch_with_one_live_record_stays_whole(tmp_path: object) -> None:
    lg = open_log(tmp_path)
    append(lg, [(b"a", b"1"), (b"b", b"1")])
    for i in range(10):
        append(lg, [(b"a", b"%d" % (i + 2))])
    lg.commit()
    clean(lg, keys_of, POLICY, NOW, force=True)
    after = records_of(read_all(lg))
    assert (0, b"a", b"1") in after and (1, b"b", b"1") in after  # pinned by b


def test_tombstones_go_after_delete_retention_and_only_when_nothing_older_stays(
    tmp_path: object,
) -> None:
    lg = open_log(tmp_path)
    append(lg, [(b"pin", b"x"), (b"t", b"old")])  # t's old value pinned by a live key
    append(lg, [(b"t", None)])
    append(lg, [(b"u", b"1")])
    append(lg, [(b"u", None)])
    for i in range(12):
        append(lg, [(b"fill%d" % (i % 2), b"y")])
    lg.commit()
    # before delete.retention.ms: both tombstones stay, and the pass says when they may go
    res = clean(lg, keys_of, POLICY, NOW + 1000, force=True)
    assert res is not None and res.tombstones_due_ms == NOW + DAY + 1
    got = records_of(read_all(lg))
    assert (2, b"t", None) in got and (4, b"u", None) in got
    # after it: u's tombstone goes (its value went); t's stays (the old value is pinned)
    clean(lg, keys_of, POLICY, NOW + DAY + 1, force=True)
    got = records_of(read_all(lg))
    assert (2, b"t", None) in got and (1, b"t", b"old") in got
    assert not any(k == b"u" for _, k, _ in got)
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()


def test_keyless_batches_stay_and_the_active_segment_is_never_cleaned(tmp_path: object) -> None:
    lg = open_log(tmp_path)
    lg.append(build_batch([b"no key"], timestamp_ms=NOW))
    for _ in range(12):
        append(lg, [(b"k", b"v")])
    lg.commit()
    clean(lg, keys_of, POLICY, NOW, force=True)
    got = records_of_any(read_all(lg))
    assert got[0] == 0  # the keyless batch
    assert got[-1] == 12  # the last k, in the active segment
    lg.close()


def test_transactions_are_compacted_by_their_outcome_below_the_stable_offset(
    tmp_path: object,
) -> None:
    """Storage sees only what the caller says of each batch: aborted data goes and
    supersedes nothing, committed data is compacted as any other, a marker stays while a
    batch of its transaction does and goes after delete.retention.ms once none does, and
    nothing at or past the stable offset is cleaned."""
    lg = open_log(tmp_path)
    # producer 7: 0 a (committed), 1 marker, 2 a (aborted), 3 marker, 4 b (committed),
    # 5 marker, 6 a (committed), 7 marker; then plain records of other keys
    txn: dict[int, str] = {0: "c", 1: "m", 2: "x", 3: "m", 4: "c", 5: "m", 6: "c", 7: "m"}
    for off in range(8):
        key = b"b" if off == 4 else b"a"
        append(lg, [(key, b"v%d" % off)])  # (markers: keyed stand-ins, never decoded)
    for i in range(10):
        append(lg, [(b"fill%d" % (i % 2), b"y")])
    lg.commit()

    def keys(batch: bytes) -> Records | TxnBatch | None:
        base = struct.unpack_from(">q", batch, 0)[0]
        kind = txn.get(base)
        if kind is None:
            return keys_of(batch)
        if kind == "m":
            return TxnBatch(7, marker=True)
        if kind == "x":
            return TxnBatch(7, aborted=True)
        return TxnBatch(7, keys_of(batch))

    # stable offset 6: the transaction at 6 is still open, nothing from 6 on is cleaned
    res = clean(lg, keys, POLICY, NOW + 1000, force=True, stable_offset=6)
    assert res is not None and res.cleaned_to <= 6
    # 2 (aborted) went and does not supersede 0; its marker 3 stays until
    # delete.retention.ms (the pass says when); 1 and 5 stay with their batches
    assert records_of_any(read_all(lg))[:6] == [0, 1, 3, 4, 5, 6]
    assert res.tombstones_due_ms == NOW + DAY + 1
    # all ended: 6 supersedes 0, whose marker then has no batch left and goes when old
    clean(lg, keys, POLICY, NOW + DAY + 1, force=True)
    got = records_of_any(read_all(lg))
    assert got[:4] == [4, 5, 6, 7], got  # b's transaction stays whole, a's last one too
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()


def test_batches_named_to_keep_stay_whole_with_their_transactions_marker(
    tmp_path: object,
) -> None:
    """`keep` (each producer's last batch, from the broker): a superseded batch named
    there stays, and an aborted one too, with its marker, long after delete.retention.ms."""
    lg = open_log(tmp_path)
    for off in range(4):  # 0 a (plain), 1 a (aborted, producer 7), 2 marker, 3 a
        append(lg, [(b"a", b"v%d" % off)])
    for i in range(10):
        append(lg, [(b"fill%d" % (i % 2), b"y")])
    lg.commit()

    def keys(batch: bytes) -> Records | TxnBatch | None:
        base = struct.unpack_from(">q", batch, 0)[0]
        if base == 1:
            return TxnBatch(7, aborted=True)
        if base == 2:
            return TxnBatch(7, marker=True)
        return keys_of(batch)

    clean(lg, keys, POLICY, NOW + 2 * DAY, force=True, keep=frozenset({0, 1}))
    assert records_of_any(read_all(lg))[:4] == [0, 1, 2, 3]
    clean(lg, keys, POLICY, NOW + 2 * DAY, force=True)
    assert records_of_any(read_all(lg))[:1] == [3]
    lg.close()


def records_of_any(data: bytes) -> list[int]:
    return [struct.unpack_from(">q", b, 0)[0] for b in split_batches(data)]


def test_min_compaction_lag_and_dirty_ratio(tmp_path: object) -> None:
    lg = open_log(tmp_path)
    for i in range(30):
        append(lg, [(b"k", b"%d" % i)], ts=NOW + i * 1000)
    lg.commit()
    young = CompactionPolicy(min_compaction_lag_ms=10**9)
    assert clean(lg, keys_of, young, NOW + 30_000) is None  # every segment too young
    res = clean(lg, keys_of, POLICY, NOW + 30_000)
    assert res is not None and res.removed_blocks > 0
    # everything below cleaned_to is clean now: not due again until new dirt
    assert clean(lg, keys_of, POLICY, NOW + 30_000, dirty_from=res.cleaned_to) is None
    lg.close()


class _Crash(Exception):
    pass


@pytest.mark.parametrize(
    ("renames_before_crash", "committed"), [(0, False), (1, False), (2, True), (3, True)]
)
def test_a_crash_in_the_swap_is_finished_or_undone(
    tmp_path: object, renames_before_crash: int, committed: bool
) -> None:
    lg = open_log(tmp_path)
    for i in range(30):
        append(lg, [(b"k%d" % (i % 2), b"%d" % i)])
    lg.commit()
    before = records_of(read_all(lg))
    real = lg.fs.rename
    calls = 0

    def rename(src: str, dst: str) -> None:
        nonlocal calls
        calls += 1
        if calls > renames_before_crash:
            raise _Crash
        real(src, dst)

    lg.fs.rename = rename  # type: ignore[method-assign]
    with pytest.raises(_Crash):
        clean(lg, keys_of, POLICY, NOW, force=True)
    lg.fs.rename = real  # type: ignore[method-assign]
    lg.close()
    lg = open_log(tmp_path)
    assert not [n for n in os.listdir(str(tmp_path)) if n.endswith((".swap", ".cleaned"))]
    got = records_of(read_all(lg))
    if committed:
        assert len(got) < len(before) and set(got) <= set(before)
    else:
        assert got == before
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg.close()


def test_recovery_after_a_reboot_checks_and_refolds_a_compacted_archive(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `never` writer not closed, then a reboot: recovery checks every entry (removed
    ones against the tree file) and rebuilds the tree from the index leaves, taking a
    removed leaf's size from the tree file: the same tree, signed under fork + 1."""
    lg = PartitionLog.open(
        tmp_path,
        KEYPAIR,
        fsync=FsyncPolicy.NEVER,  # type: ignore[arg-type]
        config=LogConfig(segment_bytes=400, retention_ms=-1),
    )
    for i in range(40):
        append(lg, [(b"k%d" % (i % 3), b"%d" % i)])
    head = lg.commit(force_sync=True)
    assert head is not None
    res = clean(lg, keys_of, POLICY, NOW, force=True)
    assert res is not None and res.removed_blocks > 10
    kept = records_of(read_all(lg))
    monkeypatch.setattr("storage.format.BOOT_ID", os.urandom(16))
    lg2 = PartitionLog.open(
        tmp_path,
        KEYPAIR,
        fsync=FsyncPolicy.NEVER,  # type: ignore[arg-type]
        config=LogConfig(segment_bytes=400, retention_ms=-1),
    )
    assert lg2.damage is None
    assert lg2.head is not None and lg2.head.fork == head.fork + 1
    assert (lg2.head.length, lg2.head.tree_hash) == (head.length, head.tree_hash)
    assert records_of(read_all(lg2)) == kept
    assert verify_partition(str(tmp_path), KEYPAIR.public_key).ok
    lg2.close()

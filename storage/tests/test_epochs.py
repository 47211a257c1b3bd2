"""Leader epochs of a partition (storage/epochs.py): Kafka's LeaderEpochFileCache
semantics, checked against Kafka's own cases, and the checkpoint's durability."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.epochs import (
    EPOCHS_FILE,
    UNDEFINED_EPOCH,
    EpochCache,
    EpochEntry,
    decode_entries,
    encode_entries,
)
from storage.errors import ArchiveDamaged
from storage.fs import FaultyFileSystem, OsFileSystem


def _cache(path: Path, *entries: tuple[int, int]) -> EpochCache:
    c = EpochCache(OsFileSystem(), str(path))
    for e, o in entries:
        c.assign(e, o)
    return c


def test_end_offsets_as_kafka_answers_them(tmp_path: Path) -> None:
    # Kafka's LeaderEpochFileCacheTest: epochs 2@6, 4@11 (log end 20)
    c = _cache(tmp_path, (2, 6), (4, 11))
    assert c.end_offset_for(4, 20) == (4, 20)  # the latest epoch ends at the log end
    assert c.end_offset_for(2, 20) == (2, 11)  # an older one where the next starts
    assert c.end_offset_for(3, 20) == (2, 11)  # a gap: the largest epoch below, its end
    assert c.end_offset_for(1, 20) == (1, 6)  # older than all: the first start
    assert c.end_offset_for(5, 20) == (UNDEFINED_EPOCH, -1)  # newer than the latest
    assert c.end_offset_for(-1, 20) == (UNDEFINED_EPOCH, -1)
    assert EpochCache(None, None).end_offset_for(0, 9) == (UNDEFINED_EPOCH, -1)
    assert [c.epoch_at(o) for o in (0, 6, 10, 11, 99)] == [UNDEFINED_EPOCH, 2, 2, 4, 4]


def test_assign_keeps_entries_increasing(tmp_path: Path) -> None:
    c = _cache(tmp_path, (0, 0), (1, 5), (3, 9))
    assert not c.assign(3, 12)  # the same epoch further on: no change
    assert c.assign(3, 7)  # the same epoch earlier: moved back
    assert c.entries == [EpochEntry(0, 0), EpochEntry(1, 5), EpochEntry(3, 7)]
    assert c.assign(2, 6)  # an older epoch: entries not below it are dropped
    assert c.entries == [EpochEntry(0, 0), EpochEntry(1, 5), EpochEntry(2, 6)]
    assert c.assign(4, 5)  # a start not above an entry's: that entry is dropped
    assert c.entries == [EpochEntry(0, 0), EpochEntry(4, 5)]
    with pytest.raises(ValueError):
        c.assign(-1, 3)
    assert _cache(tmp_path).entries == c.entries  # persisted


def test_truncation_from_either_end(tmp_path: Path) -> None:
    c = _cache(tmp_path, (0, 0), (2, 10), (5, 20))
    c.truncate_from_end(20)  # epoch 5's blocks were cut (a new fork)
    assert c.entries == [EpochEntry(0, 0), EpochEntry(2, 10)]
    c.truncate_from_start(12)
    assert c.entries == [EpochEntry(2, 12)]
    c.truncate_from_start(3)  # before every entry: nothing to drop
    assert c.entries == [EpochEntry(2, 12)]
    assert _cache(tmp_path).entries == [EpochEntry(2, 12)]


def test_the_checkpoint_is_kafkas_format_and_is_checked(tmp_path: Path) -> None:
    _cache(tmp_path, (0, 0), (7, 42))
    assert (tmp_path / EPOCHS_FILE).read_bytes() == b"0\n2\n0 0\n7 42\n"
    for bad in (b"1\n0\n", b"0\n2\n0 0\n", b"0\n2\n3 0\n2 9\n", b"0\n1\n0 0", b"\xff", b""):
        (tmp_path / EPOCHS_FILE).write_bytes(bad)
        with pytest.raises(ArchiveDamaged):
            EpochCache(OsFileSystem(), str(tmp_path))


def test_an_assignment_survives_a_crash(tmp_path: Path) -> None:
    fs = FaultyFileSystem()
    c = EpochCache(fs, str(tmp_path))
    c.assign(3, 100)
    fs.crash()
    assert EpochCache(OsFileSystem(), str(tmp_path)).entries == [EpochEntry(3, 100)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), max_size=12))
def test_entries_stay_increasing_and_round_trip(ops: list[tuple[int, int]]) -> None:
    c = EpochCache(None, None)
    for e, o in ops:
        c.assign(e, o)
        assert c.entries[-1] == EpochEntry(e, o) or c.entries[-1].epoch == e
        es = c.entries
        assert all(a.epoch < b.epoch and a.start_offset < b.start_offset for a, b in itertools.pairwise(es))
        assert decode_entries(encode_entries(es)) == es
        for q in range(-1, 8):
            got_e, got_o = c.end_offset_for(q, 99)
            if q > c.latest_epoch or q < 0:
                assert (got_e, got_o) == (UNDEFINED_EPOCH, -1)
            else:
                assert got_e <= q and (got_o == 99 or any(x.start_offset == got_o for x in es))

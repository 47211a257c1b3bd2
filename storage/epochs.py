"""Leader epochs of a partition: which offset each leader epoch started at (Kafka's
``leader-epoch-checkpoint``, docs/clusters.md "Failover", FORMAT.md section 11).

A quorum-signed partition changes leader by a failover vote; each new leader writes in
a new leader epoch, and continues the same archive on a Hypercore fork whose id is that
epoch (the blocks of the old leader that never reached a quorum are truncated). Kafka's
clients and followers find where two histories part by asking OffsetForLeaderEpoch
(API 23) the end offset of the last epoch they saw, and Fetch names the diverging epoch
the same way: both are answered from this cache (`end_offset_for`).

Owns `EpochCache`: (epoch, start offset) entries, strictly increasing in both, kept as
Kafka's `LeaderEpochFileCache` keeps them (`assign`, `truncate_from_end`,
`truncate_from_start`, `end_offset_for`), and persisted in Kafka's checkpoint text
format (version 0, count, one ``epoch offset`` line each) by `write_file_atomic`, so a
crash leaves the old file or the new one.

Sans-I/O apart from the file; may import the standard library and `storage.{fs,errors}`.
"""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass

from storage.errors import ArchiveDamaged
from storage.fs import FileSystem

EPOCHS_FILE = "leader-epoch-checkpoint"
VERSION = 0
UNDEFINED_EPOCH = -1
UNDEFINED_EPOCH_OFFSET = -1


@dataclass(frozen=True)
class EpochEntry:
    epoch: int
    start_offset: int


def encode_entries(entries: list[EpochEntry]) -> bytes:
    lines = [str(VERSION), str(len(entries))]
    lines += [f"{e.epoch} {e.start_offset}" for e in entries]
    return ("\n".join(lines) + "\n").encode()


def decode_entries(data: bytes) -> list[EpochEntry]:
    """ArchiveDamaged unless `data` is a checkpoint of strictly increasing entries."""
    try:
        lines = data.decode("ascii").split("\n")
        if lines[-1] != "":
            raise ValueError("no final newline")
        lines = lines[:-1]
        if int(lines[0]) != VERSION:
            raise ValueError(f"version {lines[0]}")
        n = int(lines[1])
        if n != len(lines) - 2:
            raise ValueError(f"{len(lines) - 2} entries, header says {n}")
        out = []
        for line in lines[2:]:
            e, o = line.split(" ")
            out.append(EpochEntry(int(e), int(o)))
    except (UnicodeDecodeError, ValueError, IndexError) as exc:
        raise ArchiveDamaged(f"leader epoch checkpoint does not parse: {exc}") from None
    for a, b in itertools.pairwise(out):
        if not (a.epoch < b.epoch and a.start_offset < b.start_offset):
            raise ArchiveDamaged(f"leader epoch checkpoint is not increasing at {a} {b}")
    if out and (out[0].epoch < 0 or out[0].start_offset < 0):
        raise ArchiveDamaged("leader epoch checkpoint has a negative entry")
    return out


class EpochCache:
    """The leader epochs of one partition, persisted in `path`/leader-epoch-checkpoint
    (`path` None: in memory only). Every change is durable before the method returns."""

    def __init__(self, fs: FileSystem | None, path: str | None) -> None:
        self.fs = fs
        self.file = os.path.join(path, EPOCHS_FILE) if path is not None else None
        self.entries: list[EpochEntry] = []
        if fs is not None and self.file is not None and fs.exists(self.file):
            self.entries = decode_entries(fs.read_file(self.file))

    def _flush(self) -> None:
        if self.fs is not None and self.file is not None:
            self.fs.write_file_atomic(self.file, encode_entries(self.entries))

    @property
    def latest_epoch(self) -> int:
        return self.entries[-1].epoch if self.entries else UNDEFINED_EPOCH

    def epoch_at(self, offset: int) -> int:
        """The epoch the record at `offset` was written in (UNDEFINED_EPOCH before all)."""
        starts = [e.start_offset for e in self.entries]
        i = bisect.bisect_right(starts, offset)
        return self.entries[i - 1].epoch if i else UNDEFINED_EPOCH

    def assign(self, epoch: int, start_offset: int) -> bool:
        """Epoch `epoch` starts at `start_offset` (a new leader's first offset). Entries
        that would no longer be increasing (an epoch not older, or a start not below) are
        dropped first, as Kafka does; the same epoch again at a start not below its own is
        no change. Returns whether anything changed."""
        if epoch < 0 or start_offset < 0:
            raise ValueError(f"epoch {epoch} at {start_offset}: both must be >= 0")
        if self.entries:
            last = self.entries[-1]
            if last.epoch == epoch and start_offset >= last.start_offset:
                return False
        self.entries = [
            e for e in self.entries if e.epoch < epoch and e.start_offset < start_offset
        ]
        self.entries.append(EpochEntry(epoch, start_offset))
        self._flush()
        return True

    def truncate_from_end(self, end_offset: int) -> None:
        """The log was cut to `end_offset`: epochs starting at or past it are dropped."""
        keep = [e for e in self.entries if e.start_offset < end_offset]
        if keep != self.entries:
            self.entries = keep
            self._flush()

    def truncate_from_start(self, start_offset: int) -> None:
        """Retention moved the log start to `start_offset`: epochs that ended before it
        are dropped, the one it falls in now starts there."""
        before = [e for e in self.entries if e.start_offset <= start_offset]
        if not before:
            return
        keep = [EpochEntry(before[-1].epoch, start_offset)]
        keep += [e for e in self.entries if e.start_offset > start_offset]
        if keep != self.entries:
            self.entries = keep
            self._flush()

    def end_offset_for(self, epoch: int, log_end_offset: int) -> tuple[int, int]:
        """OffsetForLeaderEpoch's answer (epoch, end offset) for the requested `epoch`,
        as Kafka's `endOffsetFor`: the latest epoch ends at the log end; an older one at
        the start of the next epoch, answered with the largest epoch not above it (the
        requested one itself when it is older than every entry); an epoch newer than the
        latest, or UNDEFINED_EPOCH, is (UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET)."""
        if epoch == UNDEFINED_EPOCH or not self.entries:
            return (UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET)
        if epoch == self.latest_epoch:
            return (epoch, log_end_offset)
        epochs = [e.epoch for e in self.entries]
        hi = bisect.bisect_right(epochs, epoch)
        if hi == len(self.entries):
            return (UNDEFINED_EPOCH, UNDEFINED_EPOCH_OFFSET)
        higher = self.entries[hi]
        if hi == 0:
            return (epoch, higher.start_offset)
        return (self.entries[hi - 1].epoch, higher.start_offset)

"""The node's file-descriptor budget, and the cache of partition logs that hold files open.

Owns: how many descriptors the process may open (RLIMIT_NOFILE, raised to its hard limit
at start), how that number is split between sockets and partition files (`FdBudget`),
and which partition logs keep their files open (`HandleCache`, least recently used first).

Why: a partition holds at least four files (head, tree, one segment's `.log` and `.bidx`),
so a node that kept every archive open ran out of descriptors at a few thousand
partitions, and the next accept() ended the process. Here the number of open partition
files is bounded whatever the number of partitions: a log that is needed and has no open
files makes room by closing the files of the least recently used idle logs
(`PartitionLog.park`), and reopens its own.

Rules (the threading of storage/log.py):
- Only the owner thread (the broker's event loop) reopens or parks a log that is on the
  budget: `make_room` runs there. A log not on it yet may be opened, and parked, in any
  thread (topic creation and restart do so). `touch` (mark as recently used) may run
  from any thread; the cache's own state is under a lock.
- A log is parked only when nothing refers to its descriptors: no commit job in flight,
  no background fsync running, no appended batch waiting for a job, no pin (`PartitionLog.pin`: a commit round that writes it
  from a worker thread). A Fetch that sends a file range by sendfile owns a dup of the
  descriptor (broker/sendfile.py), so parking never pulls a file from under a send.
- Pinned and busy logs may take the cache past its budget (a commit round pins its logs
  in slices of `pin_slice()` partitions, so this stays small); the next `make_room`, or
  the next publish of a head while over budget, parks those that are idle again.
- Shutdown takes every log off the budget (`PartitionLog.detach_handles`) and closes
  them from several threads; a restart recovers them from several threads, each parked
  once recovered (storage/store.py).

Imports only the standard library.
"""

from __future__ import annotations

import logging
import resource
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# Descriptors a process needs besides sockets and partition files: stdio, the epoll and
# wake-up descriptors of trio and of worker threads, the catalog archive (always open),
# the node seed, the producer-id file, temporary files and directory fsyncs, log files.
MISC_RESERVE = 64
# Fewest descriptors worth having for partition files: a dozen partitions open at once.
MIN_PARTITION_FILES = 48
# Descriptors one open partition holds in the common case (head, tree, .log, .bidx).
FDS_PER_PARTITION = 4


class Parkable(Protocol):
    """What the cache needs of a partition log (storage.log.PartitionLog)."""

    def open_fds(self) -> int: ...

    def parkable(self) -> bool: ...

    def park(self) -> None: ...


@dataclass(frozen=True)
class FdBudget:
    """How the process's descriptors are shared out."""

    limit: int  # RLIMIT_NOFILE (soft) after raising it
    sockets: int  # client connections, replication and mirror links, sendfile dups
    partition_files: int  # open partition files (the HandleCache budget)

    @classmethod
    def split(cls, limit: int, max_connections: int) -> FdBudget:
        """Half of what is left after MISC_RESERVE goes to sockets at most (each client
        connection needs one, plus a sendfile dup while a large Fetch answer is sent),
        the rest to partition files, never fewer than MIN_PARTITION_FILES."""
        free = max(0, limit - MISC_RESERVE)
        sockets = min(max_connections + MISC_RESERVE, free // 2)
        return cls(limit, sockets, max(MIN_PARTITION_FILES, free - sockets))

    @classmethod
    def of_process(cls, max_connections: int) -> FdBudget:
        """Raise the soft RLIMIT_NOFILE to the hard limit (as most servers do at start;
        the default soft limit of 1024 is a historical select() limit) and split it."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = _nr_open()
        if soft == resource.RLIM_INFINITY or soft < hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
                soft = hard
            except (ValueError, OSError) as exc:
                log.warning(
                    "could not raise the open-file limit from %s to %d: %s", soft, hard, exc
                )
        if soft == resource.RLIM_INFINITY:
            soft = hard
        return cls.split(int(soft), max_connections)

    def describe(self) -> str:
        return (
            f"{self.limit} file descriptors: {self.sockets} for sockets, "
            f"{self.partition_files} for partition files (about "
            f"{self.partition_files // FDS_PER_PARTITION} partitions open at once), "
            f"{MISC_RESERVE} spare"
        )


def _nr_open() -> int:
    """The kernel's per-process ceiling (Linux), when the hard limit says unlimited."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


class HandleCache:
    """Partition logs holding open files, least recently used first, within `budget`
    descriptors. Thread-safe bookkeeping; parking only from `make_room` (owner thread)."""

    def __init__(self, budget: int) -> None:
        if budget < 1:
            raise ValueError("a handle cache needs a positive budget")
        self.budget = budget
        self._lock = threading.Lock()
        self._open: OrderedDict[int, Parkable] = OrderedDict()  # by id(), LRU first
        self._fds: dict[int, int] = {}  # id() -> descriptors counted for it
        self.total = 0  # descriptors the cached logs hold, as last counted
        self.parks = 0  # logs parked to make room (statistics)
        self.overruns = 0  # times a log opened with nothing idle left to park
        self._overrun_logged = False

    def pin_slice(self) -> int:
        """How many partitions a caller may hold pinned at once and stay within budget."""
        return max(1, self.budget // (FDS_PER_PARTITION + 2))

    def touch(self, lg: Parkable) -> None:
        """`lg` holds open files and was just used: most recently used now, recounted."""
        key = id(lg)
        n = lg.open_fds()
        with self._lock:
            self.total += n - self._fds.get(key, 0)
            self._fds[key] = n
            self._open[key] = lg
            self._open.move_to_end(key)

    def forget(self, lg: Parkable) -> None:
        """`lg` closed (or parked) its files."""
        key = id(lg)
        with self._lock:
            self._open.pop(key, None)
            self.total -= self._fds.pop(key, 0)

    def make_room(self, need: int, keep: Parkable | None = None) -> None:
        """Owner thread: park idle logs, least recently used first, until `need` more
        descriptors fit in the budget (or nothing idle is left: then the cache runs over
        its budget, counted in `overruns`). `keep` is never parked."""
        while True:
            with self._lock:
                if self.total + need <= self.budget:
                    self._overrun_logged = False
                    return
                victim = None
                # Busy logs at the cold end move to the hot end, so a long run of them
                # is walked once, not on every open.
                for _ in range(len(self._open)):
                    key, cand = next(iter(self._open.items()))
                    if cand is not keep and cand.parkable():
                        victim = cand
                        break
                    self._open.move_to_end(key)
                if victim is None:
                    self.overruns += 1
                    if not self._overrun_logged:
                        self._overrun_logged = True
                        log.warning(
                            "partition files: %d descriptors open with %d more needed, "
                            "over the budget of %d (every open partition is busy)",
                            self.total,
                            need,
                            self.budget,
                        )
                    return
            victim.park()  # calls forget()
            self.parks += 1

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {
                "budget": self.budget,
                "open_fds": self.total,
                "open_logs": len(self._open),
                "parks": self.parks,
                "overruns": self.overruns,
            }

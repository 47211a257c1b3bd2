"""One data directory, one writer: the exclusive lock on `<data_dir>/.lock`.

Two brokers on one directory would both append to the same segments and sign different
trees at the same length (they share the node seed): records are lost and the archive
stops opening. As Kafka's `.lock` (FileChannel.tryLock), the writer holds a POSIX record
lock (fcntl) on the file for the life of the process, so the kernel drops it when the
process dies however it dies: a lock file left by a killed broker never blocks a restart.
The holder writes its pid into the file, for the message a second process prints.

Why fcntl and not flock: the holder's pid also comes from the kernel (F_GETLK), so a stale
pid in the file never misleads; and a record lock is per process, so a test that reopens
a store in the same process (after simulating a crash by dropping the old one) is not
refused by its own earlier lock. The price, stated: the lock is released by closing ANY
descriptor of `.lock` in the holding process, so nothing but this module opens it.

`probe` looks without taking the lock, for read-only commands (`hyperkafka verify`,
`keys`) that may run next to a live broker and must not block its start.
Imports only the standard library and `storage.errors`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import sys

from storage.errors import StorageError

LOCK_FILE = ".lock"
# Linux `struct flock`: l_type, l_whence (short), l_start, l_len (off_t), l_pid (pid_t),
# in the platform's alignment.
_FLOCK = "hhqqi" if sys.platform.startswith("linux") else ""


class DataDirLocked(StorageError):
    """Another process holds the data directory."""

    def __init__(self, data_dir: str, pid: int | None) -> None:
        who = f"process {pid}" if pid else "another process"
        where = os.path.abspath(data_dir)
        named = data_dir if where == data_dir else f"{data_dir} ({where})"
        super().__init__(
            f"data dir {named} is in use by {who} (another broker?); one data dir takes one broker"
        )
        self.data_dir = data_dir
        self.pid = pid


class DirLock:
    """The held lock. `acquire` it; it lasts until `release` or the process ends."""

    def __init__(self, data_dir: str, fd: int) -> None:
        self.data_dir = data_dir
        self._fd = fd

    @classmethod
    def acquire(cls, data_dir: str) -> DirLock:
        """Take the lock on an existing directory, or raise DataDirLocked at once. Nothing
        in the directory changes when it is refused (the pid is written after locking)."""
        path = os.path.join(data_dir, LOCK_FILE)
        # (no symlink followed: the pid goes into this file only)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            pid = _holder(fd) or _pid_in(fd)
            os.close(fd)
            raise DataDirLocked(data_dir, pid) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            # a full disk must not stop a broker from starting: the pid is only for the
            # message, and F_GETLK gives it anyway
            pass
        return cls(data_dir, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing drops the record lock


def probe(data_dir: str) -> int | None:
    """The pid of the process holding `data_dir` (0 when held but unknown), or None.
    Takes no lock and creates nothing."""
    path = os.path.join(data_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        pid = _holder(fd)
        if pid is not None:
            return pid
        if _FLOCK:
            return None  # F_GETLK answered: nobody holds it
        # no F_GETLK layout for this platform: a shared lock taken and dropped at once
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _pid_in(fd) or 0
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        # this process never holds the lock when it probes, so closing drops nothing
        os.close(fd)


def _holder(fd: int) -> int | None:
    """F_GETLK: the pid of a process whose lock conflicts with a write lock, or None."""
    if not _FLOCK:
        return None
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    with contextlib.suppress(OSError):
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query + bytes(8))
        l_type, _, _, _, pid = struct.unpack_from(_FLOCK, answer)
        if l_type != fcntl.F_UNLCK:
            return int(pid)
    return None


def _pid_in(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).split()[0])
    return None

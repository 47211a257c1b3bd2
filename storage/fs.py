"""Filesystem seam: every file operation the storage package performs goes through here.

`OsFileSystem` is the real thing (plain `os` calls on integer file descriptors, so a
`FileRange` can go straight to `os.sendfile`). `FaultyFileSystem` wraps it for tests and
models what a power loss does to a page cache: it remembers, per file, the content as of
the last successful fsync, and `crash()` rolls every file back to that (or to a torn mix of
old and new bytes), closes every descriptor, and lets a fresh open run recovery. It can
also fail fsyncs (EIO), fail writes (ENOSPC) and shorten writes. In the spirit of hashicorp/raft-wal's vfs.

Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
from collections.abc import Callable, Iterator

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
# Below this a pread (one copy into a fresh buffer) is cheaper than mapping and unmapping.
MAP_MIN = 256 * 1024


class FileSystem:
    """The operations storage needs. Descriptors are real OS file descriptors."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fsync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, _DIR_FLAGS)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # helpers built on the primitives (so a faulty subclass affects them too)

    def pwrite_all(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
        """pwrite until everything is written: a short write is legal and is not an error."""
        n = self.pwrite(fd, data, offset)
        if n == len(data):  # the usual case, without building a view
            return
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = memoryview(data).cast("B")[n:]
        offset += n
        while view:
            n = self.pwrite(fd, view, offset)
            if n <= 0:
                raise OSError(errno.EIO, "pwrite wrote nothing")
            view = view[n:]
            offset += n

    def pread_exact(self, fd: int, size: int, offset: int) -> bytes:
        """pread `size` bytes, or fewer only at end of file."""
        data = self.pread(fd, size, offset)
        if len(data) == size or not data:
            return data
        parts = [data]
        got = len(data)
        while got < size:
            more = self.pread(fd, size - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    @contextlib.contextmanager
    def read_view(self, fd: int, size: int, offset: int) -> Iterator[memoryview]:
        """A read-only view of `size` bytes at `offset` of the file, valid inside the `with`
        block; shorter only at end of file. Large ranges are a shared memory map of the page
        cache: no copy and no fresh buffer (whose page faults and zeroing cost more than
        the copy), so hashing just-written data reads it where the kernel keeps it.
        Callers must drop every slice of the view before the block ends."""
        if size < MAP_MIN:
            yield memoryview(self.pread_exact(fd, size, offset))
            return
        size = min(size, self.size(fd) - offset)
        if size <= 0:
            yield memoryview(b"")
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, size + offset - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start)
        try:
            with memoryview(mm) as whole:
                view = whole[offset - start :]
                try:
                    yield view
                finally:
                    view.release()
        finally:
            # a slice still held somewhere (a traceback) keeps the map alive; it is unmapped
            # when that goes, and the original exception is not masked by BufferError
            with contextlib.suppress(BufferError):
                mm.close()

    def read_file(self, path: str) -> bytes:
        fd = self.open(path, os.O_RDONLY)
        try:
            return self.pread_exact(fd, self.size(fd), 0)
        finally:
            self.close(fd)

    def write_file_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write to a temporary name, fsync, rename over `path`, fsync the directory."""
        tmp = path + ".tmp"
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            self.pwrite_all(fd, data, 0)
            self.fsync(fd)
        finally:
            self.close(fd)
        self.rename(tmp, path)
        self.fsync_dir(os.path.dirname(path) or ".")


class OsFileSystem(FileSystem):
    """The real filesystem."""


class FaultyFileSystem(FileSystem):
    """Test double: tracks durable (fsynced) file contents and can simulate a crash.

    Simplifications, stated: directory operations (create, unlink, rename) are durable at
    once; a file created and never fsynced survives a crash empty; a failed fsync leaves
    the durable content as it was (the kernel may have dropped the dirty pages).
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self._path_of: dict[int, str] = {}
        self._durable: dict[str, bytes] = {}
        self.fail_fsync: Callable[[str], bool] | None = None
        # A write to a path it accepts fails with ENOSPC before writing (a full disk).
        self.fail_write: Callable[[str], bool] | None = None
        self.short_writes = False
        self.fsyncs = 0

    def _real_content(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        path = os.path.abspath(path)
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        self._path_of[fd] = path
        if path not in self._durable:
            self._durable[path] = self._real_content(path) if existed else b""
        return fd

    def close(self, fd: int) -> None:
        self._path_of.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        if self.fail_write is not None and self.fail_write(self._path_of.get(fd, "")):
            raise OSError(errno.ENOSPC, f"injected: no space left for {self._path_of.get(fd)}")
        if self.short_writes and len(data) > 1:
            data = memoryview(data)[: max(1, len(data) // 2)]
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        path = self._path_of[fd]
        if self.fail_fsync is not None and self.fail_fsync(path):
            raise OSError(errno.EIO, f"injected fsync failure on {path}")
        super().fsync(fd)
        self.fsyncs += 1
        self._durable[path] = self._real_content(path)

    def ftruncate(self, fd: int, size: int) -> None:
        super().ftruncate(fd, size)

    def unlink(self, path: str) -> None:
        path = os.path.abspath(path)
        super().unlink(path)
        self._durable.pop(path, None)

    def rename(self, src: str, dst: str) -> None:
        src, dst = os.path.abspath(src), os.path.abspath(dst)
        super().rename(src, dst)
        self._durable[dst] = self._durable.pop(src, b"")

    def crash(self, mode: str = "drop") -> None:
        """Power loss. mode "drop": every file reverts to its last fsynced content.
        "tear": each file independently keeps its current bytes, reverts, or keeps a
        random prefix of its unsynced changes over the old content (a torn write).
        "keep": process crash only (page cache survives); just closes the descriptors."""
        for fd in list(self._path_of):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._path_of.clear()
        if mode == "keep":
            return
        for path, durable in list(self._durable.items()):
            if not os.path.exists(path):
                continue
            current = self._real_content(path)
            if current == durable:
                continue
            if mode == "drop":
                new = durable
            else:
                choice = self.rng.random()
                if choice < 0.25:
                    new = current
                elif choice < 0.5:
                    new = durable
                else:
                    # first byte where they differ; some prefix of the change reached disk
                    n = min(len(current), len(durable))
                    d = next((i for i in range(n) if current[i] != durable[i]), n)
                    k = self.rng.randint(d, len(current))
                    new = current[:k] + durable[k:]
            with open(path, "wb") as f:
                f.write(new)
            self._durable[path] = new

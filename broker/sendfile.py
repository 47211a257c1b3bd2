"""Fetch data that goes from a segment file to the socket with sendfile, never through Python.

A `FileSlice` is what the Fetch handler puts in a partition's `records` when the answer
travels over plain TCP and is large enough to be worth it: a range of a segment file,
with a descriptor of its own (`os.dup`), so a segment that retention or a topic deletion
drops and closes meanwhile is still read whole (an unlinked file lives on while open),
and a descriptor number reused for another file is never read by mistake. The bytes it
names are below the high watermark, so nothing ever rewrites them.

`send_parts` writes a response's pieces in order, never joining them into one copy of
the answer: over plain TCP the bytes-like pieces between two slices go out with one
vectored write (`sendmsg`, as writev), slices with `os.sendfile` on the socket
(non-blocking: both wait for writability as trio's own send does); over TLS small pieces
are joined up to COALESCE_BYTES and large ones written as they are. A slice closes its
descriptor once sent, and when dropped unsent (a throttled answer, a long poll that read
again, a connection that went away).

Imports trio and the standard library only.
"""

from __future__ import annotations

import os
from typing import Any

import trio

# Below this a pread into the response costs less than the dup, the extra syscalls and
# the separate send around a sendfile.
SENDFILE_MIN_BYTES = 64 * 1024


class FileSlice:
    """`size` bytes at `position` of a file, on a descriptor this object owns."""

    __slots__ = ("fd", "position", "size")

    def __init__(self, fd: int, position: int, size: int) -> None:
        self.fd = os.dup(fd)
        self.position = position
        self.size = size

    def __len__(self) -> int:
        return self.size

    def read(self) -> bytes:
        """The bytes (tests, and any path that cannot sendfile)."""
        data = os.pread(self.fd, self.size, self.position)
        if len(data) != self.size:
            raise OSError(f"file range of {self.size} bytes read short ({len(data)})")
        return data

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def release(pieces: Any) -> None:
    """Close the slices in a Fetch description's `responses` that will not be sent."""
    for topic in pieces:
        for p in topic["partitions"]:
            records = p.get("records")
            if isinstance(records, FileSlice):
                records.close()


# Over TLS, pieces below this are joined into one write (fewer records and syscalls);
# larger ones are written as they are, so an answer is never copied whole.
COALESCE_BYTES = 64 * 1024
# Buffers per sendmsg call (the kernel's IOV_MAX is 1024).
_IOV_MAX = 1024


async def send_parts(stream: trio.abc.Stream, parts: list[Any]) -> None:
    """Write `parts` in order; `FileSlice` pieces (plain TCP streams only) via sendfile."""
    if len(parts) == 1 and not isinstance(parts[0], FileSlice):
        await stream.send_all(parts[0])
        return
    try:
        if isinstance(stream, trio.SocketStream):
            run: list[Any] = []
            for piece in parts:
                if not isinstance(piece, FileSlice):
                    run.append(piece)
                    continue
                if run:
                    await _writev(stream, run)
                    run = []
                await _sendfile(stream, piece)
            if run:
                await _writev(stream, run)
        else:
            assert not any(isinstance(p, FileSlice) for p in parts), (
                "sendfile needs a plain TCP stream"
            )
            await _send_coalesced(stream, parts)
    finally:
        for piece in parts:
            if isinstance(piece, FileSlice):
                piece.close()


async def _writev(stream: trio.SocketStream, pieces: list[Any]) -> None:
    """All of `pieces` with vectored writes, no join (a partial write resumes mid-piece)."""
    if len(pieces) == 1:
        await stream.send_all(pieces[0])
        return
    views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
    sock = stream.socket
    first = 0
    while first < len(views):
        sent = await sock.sendmsg(views[first : first + _IOV_MAX])
        while sent:
            head = views[first]
            if sent >= len(head):
                sent -= len(head)
                first += 1
            else:
                views[first] = head[sent:]
                sent = 0


async def _send_coalesced(stream: trio.abc.Stream, pieces: list[Any]) -> None:
    run: list[Any] = []
    size = 0
    for piece in pieces:
        if len(piece) >= COALESCE_BYTES:
            if run:
                await stream.send_all(b"".join(run))
                run, size = [], 0
            await stream.send_all(piece)
            continue
        run.append(piece)
        size += len(piece)
        if size >= COALESCE_BYTES:
            await stream.send_all(b"".join(run))
            run, size = [], 0
    if run:
        await stream.send_all(b"".join(run))


async def _sendfile(stream: trio.SocketStream, piece: FileSlice) -> None:
    sock = stream.socket
    out = sock.fileno()
    position, left = piece.position, piece.size
    waited = False
    while left:
        try:
            sent = os.sendfile(out, piece.fd, position, left)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            waited = True
            continue
        if sent == 0:
            # The file ended before the range did: the connection cannot be answered
            # consistently any more (the frame's length prefix is already out).
            raise trio.BrokenResourceError(f"segment file ended {left} bytes before its range")
        position += sent
        left -= sent
    if not waited:
        await trio.lowlevel.checkpoint()  # as every trio send: a place to be cancelled

"""Fetch data that goes from a segment file to the socket with sendfile, never through Python.

A `FileSlice` is what the Fetch handler puts in a partition's `records` when the answer
travels over plain TCP and is large enough to be worth it: a range of a segment file,
with a descriptor of its own (`os.dup`), so a segment that retention or a topic deletion
drops and closes meanwhile is still read whole (an unlinked file lives on while open),
and a descriptor number reused for another file is never read by mistake. The bytes it
names are below the high watermark, so nothing ever rewrites them.

`send_parts` writes a response's pieces in order: bytes-like pieces joined into one send,
slices with `os.sendfile` on the socket (non-blocking: it waits for writability as
trio's own send does). A slice closes its descriptor once sent, and when dropped unsent
(a throttled answer, a long poll that read again, a connection that went away).

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


async def send_parts(stream: trio.abc.Stream, parts: list[Any]) -> None:
    """Write `parts` in order; `FileSlice` pieces (plain TCP streams only) via sendfile."""
    if not any(isinstance(p, FileSlice) for p in parts):
        await stream.send_all(b"".join(parts) if len(parts) > 1 else parts[0])
        return
    assert isinstance(stream, trio.SocketStream), "sendfile needs a plain TCP stream"
    run: list[Any] = []
    try:
        for piece in parts:
            if not isinstance(piece, FileSlice):
                run.append(piece)
                continue
            if run:
                await stream.send_all(b"".join(run))
                run = []
            await _sendfile(stream, piece)
        if run:
            await stream.send_all(b"".join(run))
    finally:
        for piece in parts:
            if isinstance(piece, FileSlice):
                piece.close()


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

"""FileSlice: the file ranges Fetch answers with over plain TCP (broker/sendfile.py).
The end-to-end path (byte-exact answers, descriptors closed) is in test_server.py."""

from __future__ import annotations

import os
import socket
import tracemalloc
from pathlib import Path
from typing import Any

import trio

from broker.sendfile import COALESCE_BYTES, FileSlice, send_parts


def test_file_slice_outlives_the_segment_it_was_cut_from(tmp_path: Path) -> None:
    # Retention may close and unlink a segment between Fetch reading it and the writer
    # sending it: the slice holds its own descriptor, so it still reads the stored bytes.
    path = tmp_path / "segment.log"
    path.write_bytes(b"x" * 10 + b"payload" + b"y" * 10)
    fd = os.open(path, os.O_RDONLY)
    piece = FileSlice(fd, 10, 7)
    os.close(fd)
    path.unlink()
    assert len(piece) == 7 and piece.read() == b"payload"
    piece.close()
    piece.close()  # idempotent
    assert piece.fd == -1


async def _send_and_read(parts: list[Any]) -> tuple[bytes, int]:
    """Send `parts` through send_parts over a socketpair; (bytes read, peak traced bytes)."""
    a, b = socket.socketpair()
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    reader = trio.SocketStream(trio.socket.from_stdlib_socket(b))
    expected = sum(len(p) for p in parts)
    got = bytearray(expected)  # before tracing: only the sender's allocations count
    view = memoryview(got)

    async def read() -> None:
        filled = 0
        while filled < expected:
            filled += await reader.socket.recv_into(view[filled:])

    tracemalloc.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            await send_parts(stream, parts)
            peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        await stream.aclose()
        await reader.aclose()
    return bytes(got), peak


async def test_an_answer_is_written_in_pieces_never_joined_whole(tmp_path: Path) -> None:
    path = tmp_path / "segment.log"
    path.write_bytes(b"F" * 300_000)
    fd = os.open(path, os.O_RDONLY)
    big = bytes(range(256)) * 16384  # 4 MiB in memory
    small = [b"%05d" % i for i in range(3000)]  # more buffers than one sendmsg takes
    parts: list[Any] = [
        b"head",
        memoryview(big),
        bytearray(b"mid"),
        FileSlice(fd, 0, 300_000),
        *small,
        big,
    ]
    os.close(fd)
    want = b"head" + big + b"mid" + b"F" * 300_000 + b"".join(small) + big
    got, peak = await _send_and_read(parts)
    assert got == want
    assert peak < 2 << 20, peak  # joining would have allocated a copy (4 MiB runs here)


async def test_over_tls_small_pieces_are_joined_and_large_ones_written_as_they_are() -> None:
    writes: list[int] = []

    class Recorder(trio.abc.SendStream):
        async def send_all(self, data: Any) -> None:
            writes.append(len(data))

        async def wait_send_all_might_not_block(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    parts: list[Any] = [b"a" * 100] * 1000 + [b"B" * (1 << 20), b"c" * 10]
    await send_parts(Recorder(), parts)  # type: ignore[arg-type]
    assert sum(writes) == 100 * 1000 + (1 << 20) + 10
    assert max(writes) == 1 << 20 and sorted(writes)[-2] < 2 * COALESCE_BYTES

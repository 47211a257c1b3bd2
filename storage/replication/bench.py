"""Throughput of Python-to-Python replication over loopback TCP.

Owns nothing others import: ``python -m storage.replication.bench [MiB] [block KiB]``
builds an in-memory archive, serves it from one Trio task and follows it from another
over 127.0.0.1, and prints MB/s. May import trio and `storage`.
"""

from __future__ import annotations

import hashlib
import sys
import time

import trio

from storage.hypercore import KeyPair
from storage.replication.sources import MemoryArchive
from storage.replication.trio_driver import follow_archive, serve_archive


async def run(total_mib: int, block_kib: int) -> None:
    size = block_kib * 1024
    n = total_mib * 1024 // block_kib
    src = MemoryArchive.create(KeyPair.from_seed(bytes([3]) * 32))
    seed = hashlib.sha256(b"bench").digest() * (size // 32)
    for i in range(0, n, 256):
        src.append(*[i.to_bytes(8, "little") + seed[8:] for i in range(i, min(n, i + 256))])
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    sink = MemoryArchive(src.public_key)
    async with trio.open_nursery() as nursery:

        async def serve_one() -> None:
            await serve_archive(await listeners[0].accept(), src)

        nursery.start_soon(serve_one)
        t0 = time.perf_counter()
        stats = await follow_archive(await trio.open_tcp_stream("127.0.0.1", port), src.key, sink)
        dt = time.perf_counter() - t0
    assert sink.blocks == src.blocks
    print(f"{stats.blocks} blocks, {stats.bytes / 1e6:.1f} MB in {dt:.2f} s: "
          f"{stats.bytes / dt / 1e6:.1f} MB/s ({block_kib} KiB blocks, one process)")


if __name__ == "__main__":
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    kib = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    trio.run(run, mib, kib)

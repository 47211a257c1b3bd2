"""Mirror catch-up throughput over loopback TCP (`scripts/bench replication`). Not a test.

Owns nothing others import: ``python -m storage.replication.bench [--mib N] [--block-kib K]
[--window W] [--processes 1|2] [--runs R]`` builds an in-memory signed archive, serves it
with `serve_archive` and follows it with `follow_archive` (every block verified against
the signed head), over 127.0.0.1, and prints MB/s plus CPU seconds per GB on each side
(CPU time is the figure to compare on a shared machine; wall time follows the load).

``--processes 2`` (the default) runs the writer in its own process, as a mirror and its
writer are in production; ``1`` runs both ends in one Trio loop, so both compete for one
core and one GIL. Writes a JSON file under bench-results/ (ignored by git).

What it measures is the wire and the verification: with two processes the follower's
sink keeps the verified tree and heads but drops the block bytes (`TreeSink`); keeping
hundreds of MB in memory would add the page faults of a RAM disk no mirror has. Storing
them (pwrite, fsync) is what `scripts/bench mirror` adds. ``--keep`` keeps them anyway;
one process always keeps them and compares them byte for byte with the source.

May import trio, the standard library and `storage`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from typing import Any

import trio

from storage.hypercore import Frontier, KeyPair, Node
from storage.replication.sources import MemoryArchive
from storage.replication.trio_driver import follow_archive, serve_archive

KEYPAIR = KeyPair.from_seed(bytes([3]) * 32)


def build_source(total_mib: int, block_kib: int) -> MemoryArchive:
    size = block_kib * 1024
    n = max(1, total_mib * 1024 // block_kib)
    src = MemoryArchive.create(KEYPAIR)
    seed = hashlib.sha256(b"bench").digest() * (size // 32 + 1)
    for i in range(0, n, 256):
        src.append(*[j.to_bytes(8, "little") + seed[8:size] for j in range(i, min(n, i + 256))])
    return src


class TreeSink:
    """An `ArchiveSink` that folds each verified block's leaf into a tree and checks every
    delivered head against it, then drops the bytes (see the module doc)."""

    def __init__(self) -> None:
        self.frontier = Frontier()
        self.blocks = 0
        self.heads: list[int] = []

    def put_block(self, index: int, value: bytes | memoryview, leaf: Node) -> None:
        if index != self.blocks:
            raise AssertionError(f"block {index} out of order")
        self.frontier.append(leaf.hash, leaf.size)
        self.blocks += 1

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> None:
        if self.frontier.length != length or self.frontier.roots() != list(roots):
            raise AssertionError("delivered blocks do not form the verified head")
        self.heads.append(length)


async def _serve_one(listener: trio.SocketListener, src: MemoryArchive) -> None:
    stream = await listener.accept()
    await serve_archive(stream, src)


async def _follow(port: int, window: int, keep: bool = True) -> tuple[Any, float, float, Any]:
    sink: Any = MemoryArchive(KEYPAIR.public_key) if keep else TreeSink()
    c0, t0 = time.process_time(), time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    stats = await follow_archive(stream, MemoryArchive.create(KEYPAIR).key, sink, window=window)
    return stats, time.perf_counter() - t0, time.process_time() - c0, sink


def _server_process(total_mib: int, block_kib: int, conn: Any) -> None:
    async def main() -> None:
        src = build_source(total_mib, block_kib)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        conn.send(listeners[0].socket.getsockname()[1])
        c0 = time.process_time()
        await _serve_one(listeners[0], src)
        conn.send(time.process_time() - c0)

    trio.run(main)


def run_two_processes(total_mib: int, block_kib: int, window: int, keep: bool = False) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server_process, args=(total_mib, block_kib, child), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        stats, wall, cpu, sink = trio.run(_follow, port, window, keep)
        server_cpu = parent.recv() if parent.poll(30) else float("nan")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return _result(stats, wall, cpu, server_cpu, sink, total_mib, block_kib, window, 2)


def run_one_process(total_mib: int, block_kib: int, window: int, keep: bool = True) -> dict[str, Any]:
    src = build_source(total_mib, block_kib)

    async def main() -> tuple[Any, float, float, MemoryArchive]:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_one, listeners[0], src)
            return await _follow(port, window)

    stats, wall, cpu, sink = trio.run(main)
    if sink.blocks != src.blocks:
        raise AssertionError("follower holds other blocks than the source")
    # one process: `cpu` covers both ends
    return _result(stats, wall, cpu, 0.0, sink, total_mib, block_kib, window, 1)


def _result(stats: Any, wall: float, cpu: float, server_cpu: float, sink: Any,
            total_mib: int, block_kib: int, window: int, processes: int) -> dict[str, Any]:
    n = max(1, total_mib * 1024 // block_kib)
    kept = isinstance(sink, MemoryArchive)
    held = len(sink.blocks) if kept else sink.blocks
    last = (sink.heads[-1].length if kept else sink.heads[-1]) if sink.heads else -1
    if stats.blocks != n or held != n or last != n:
        raise AssertionError(f"follower verified {stats.blocks} of {n} blocks")
    gb = stats.bytes / 1e9
    return {
        "processes": processes, "block_bytes": block_kib * 1024, "window": window,
        "sink": "memory" if kept else "tree",
        "blocks": stats.blocks, "bytes": stats.bytes, "seconds": wall,
        "MB_per_s": stats.bytes / wall / 1e6,
        "follower_cpu_s_per_GB": cpu / gb,
        "server_cpu_s_per_GB": server_cpu / gb,
        "load_avg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m storage.replication.bench")
    ap.add_argument("--mib", type=int, default=256, help="archive size")
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--window", type=int, default=128, help="block requests in flight")
    ap.add_argument("--processes", type=int, choices=(1, 2), default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true",
                    help="two processes: keep the blocks in memory (default: verify, fold, drop)")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args(argv)
    results = []
    for _ in range(args.runs):
        r = (run_two_processes(args.mib, args.block_kib, args.window, args.keep)
             if args.processes == 2 else run_one_process(args.mib, args.block_kib, args.window))
        results.append(r)
        side = ("both ends" if r["processes"] == 1
                else f"follower, server {r['server_cpu_s_per_GB']:.2f}")
        print(f"catch-up {r['bytes'] / 1e6:.0f} MB in {r['block_bytes'] // 1024} KiB blocks, "
              f"{r['processes']} process(es): {r['MB_per_s']:.1f} MB/s; CPU s/GB "
              f"{r['follower_cpu_s_per_GB']:.2f} ({side}); load {r['load_avg_1m']:.1f}",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"replication-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpus": os.cpu_count(),
                   "runs": results}, f, indent=2)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Storage benchmark (`scripts/bench storage`, or `python -m storage.bench`). Not a test.

Measures, on this machine's disk:
  * append MB/s and batches/s for 1 KiB, 16 KiB and 1 MiB batches under each fsync policy,
    with group commit driven as the broker drives it: the loop thread appends, and whenever
    no commit job is in flight and 5 ms passed (or 256 batches piled up) it prepares one,
    runs it in a worker thread (fsync + sign + head write) and publishes it when done;
  * read MB/s: whole log through `read()` + pread, first pass after reopen (includes the
    one-time authentication of old batches) and a second pass (page cache, nothing checked);
  * reopen time of a 1 GiB partition after a clean close and after a process crash;
  * leaf hashing GB/s on one core (the thread's CPU time): 16 KiB and 1 MiB blocks, many
    at once as a commit round hashes them (`storage.hashing.hash_many`), and one by one
    with hashlib for comparison.

Each append run also reports the CPU seconds per GB of the whole process and the load
average: on a shared machine MB/s follows the load, CPU-s/GB much less.

Writes a JSON file under bench-results/ (git ignores it) and prints a table.
Imports only the standard library and `storage`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

from storage.batch import build_batch
from storage.hashing import NATIVE_LEAVES, compute_leaf, hash_many
from storage.hypercore import derive_keypair
from storage.log import CommitJob, FsyncPolicy, LogConfig, PartitionLog

KEYPAIR = derive_keypair(bytes(32), b"bench")
MiB = 1 << 20


def make_batches(size: int, count: int = 8) -> list[bytearray]:
    """`count` distinct one-record batches of exactly `size` bytes."""
    out = []
    for i in range(count):
        overhead = len(build_batch([b""]))
        value = os.urandom(max(0, size - overhead - 3))
        b = build_batch([value], timestamp_ms=1_700_000_000_000 + i)
        while len(b) < size:
            value += b"\0"
            b = build_batch([value], timestamp_ms=1_700_000_000_000 + i)
        out.append(b)
    return out


def warm_page_cache(directory: str, mib: int) -> None:
    """Write and delete a scratch file, so that page-cache pages come from recycled guest
    memory: on a VM the first touch of never-used memory costs ~2 us per 4 KiB page,
    which a long-running broker does not pay (its page cache is recycled)."""
    path = os.path.join(directory, "warm.tmp")
    chunk = bytes(MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i in range(mib):
            os.pwrite(fd, chunk, i * MiB)
    finally:
        os.close(fd)
        os.unlink(path)


def append_run(path: str, policy: FsyncPolicy, batch_size: int, total_bytes: int,
               commit_ms: float = 5.0, commit_batches: int = 256) -> dict[str, object]:
    cfg = LogConfig(flush_interval_ms=1000)
    lg = PartitionLog.open(path, KEYPAIR, fsync=policy, config=cfg)
    batches = make_batches(batch_size)
    n = max(1, total_bytes // batch_size)
    pool = ThreadPoolExecutor(1)
    inflight: tuple[CommitJob, Future[None]] | None = None
    last_commit = time.perf_counter()
    since = 0
    commits = 0
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    for i in range(n):
        lg.append(batches[i & 7])
        since += 1
        if inflight is not None and inflight[1].done():
            inflight[1].result()
            lg.publish(inflight[0])
            inflight = None
        if inflight is None:
            now = time.perf_counter()
            if since >= commit_batches or (now - last_commit) * 1000 >= commit_ms:
                job = lg.prepare_commit()
                if job is not None:
                    inflight = (job, pool.submit(job.run))
                    commits += 1
                last_commit = now
                since = 0
    if inflight is not None:
        inflight[1].result()
        lg.publish(inflight[0])
    lg.commit()
    elapsed = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0
    assert lg.high_watermark == n
    lg.close()
    pool.shutdown()
    return {
        "policy": str(policy),
        "batch_bytes": batch_size,
        "batches": n,
        "seconds": elapsed,
        "MB_per_s": n * batch_size / elapsed / 1e6,
        "batches_per_s": n / elapsed,
        "commits": commits,
        # every thread of this process (appends, commit jobs, leaf hashing helpers, fsync):
        # steadier than MB/s on a shared machine, and what bounds MB/s when cores are busy
        "cpu_seconds": cpu,
        "cpu_s_per_GB": cpu / (n * batch_size / 1e9),
        "load_average": os.getloadavg()[0],
    }


def leaf_hash_run(block_bytes: int, total_bytes: int = 256 * MiB, repeats: int = 5) -> dict[str, float]:
    """GB/s of leaf hashing per core: thread CPU time, so other load on the machine does
    not count (the wall clock is reported beside it); the median of `repeats` passes."""
    blocks = [memoryview(b) for b in make_batches(block_bytes, max(1, (32 * MiB) // block_bytes))]
    rounds = max(1, total_bytes // (repeats * len(blocks) * block_bytes))
    gb = rounds * len(blocks) * block_bytes / 1e9
    out: dict[str, float] = {"block_bytes": block_bytes}
    one_by_one = lambda bs: [compute_leaf(b, b.nbytes) for b in bs]  # noqa: E731
    for name, fn in (("many", hash_many), ("hashlib", one_by_one)):
        fn(blocks)  # warm
        cpu, wall = [], []
        for _ in range(repeats):
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(rounds):
                fn(blocks)
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        out[f"{name}_GB_per_cpu_s"] = gb / sorted(cpu)[repeats // 2]
        out[f"{name}_GB_per_s_wall"] = gb / sorted(wall)[repeats // 2]
    return out


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def read_pass(lg: PartitionLog, max_bytes: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    off = lg.log_start_offset
    total = 0
    while off < lg.high_watermark:
        r = lg.read(off, max_bytes)
        total += len(r.read())
        off = r.end_offset
    return total, time.perf_counter() - t0


def read_run(path: str, max_bytes: int = MiB) -> dict[str, float]:
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.NEVER)
    total, first = read_pass(lg, max_bytes)
    _, second = read_pass(lg, max_bytes)
    # the FileRange computation alone (what Fetch does before sendfile)
    t0 = time.perf_counter()
    off, ranges = lg.log_start_offset, 0
    while off < lg.high_watermark:
        off = lg.read(off, max_bytes).end_offset
        ranges += 1
    index_only = time.perf_counter() - t0
    lg.close()
    return {
        "bytes": total,
        "first_read_MB_per_s": total / first / 1e6,
        "cached_read_MB_per_s": total / second / 1e6,
        "ranges_per_s": ranges / index_only,
        "max_bytes": max_bytes,
    }


def reopen_run(path: str, batch_size: int, total_bytes: int) -> dict[str, float]:
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.NEVER)
    batches = make_batches(batch_size)
    n = total_bytes // batch_size
    t0 = time.perf_counter()
    for i in range(n):
        lg.append(batches[i & 7])
        if i % 4096 == 4095:
            lg.commit()
    lg.commit()
    fill_s = time.perf_counter() - t0
    lg.close()
    t0 = time.perf_counter()
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.NEVER)
    clean_s = time.perf_counter() - t0
    assert lg.high_watermark == n
    # process crash: no clean close (the page cache survives), 1000 unpublished batches
    for i in range(1000):
        lg.append(batches[i & 7])
    lg._close_fds()  # abandon without committing or marking the head clean
    t0 = time.perf_counter()
    lg = PartitionLog.open(path, KEYPAIR, fsync=FsyncPolicy.NEVER)
    crash_s = time.perf_counter() - t0
    assert lg.high_watermark == n + 1000
    lg.close()
    return {"bytes": n * batch_size, "batch_bytes": batch_size, "fill_seconds": fill_s,
            "reopen_clean_seconds": clean_s, "reopen_after_crash_seconds": crash_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m storage.bench")
    ap.add_argument("--dir", default=None, help="where to write the logs (default: a temp dir)")
    ap.add_argument("--mb", type=int, default=256, help="MiB appended per append run")
    ap.add_argument("--reopen-gib", type=float, default=1.0)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--warm-mib", type=int, default=1024,
                    help="write+delete this much first so page-cache pages are recycled "
                         "(0: measure cold guest memory)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.reopen_gib = 16, 0.0625
    base = tempfile.mkdtemp(prefix="hk-bench-", dir=args.dir)
    results: dict[str, object] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                  "cpus": os.cpu_count()}
    appends = []
    try:
        if args.warm_mib:
            warm_page_cache(base, args.warm_mib)
        results["warmed_page_cache_mib"] = args.warm_mib
        hashing = []
        for size in (16 * 1024, MiB):
            h = leaf_hash_run(size, (args.mb * MiB) // 2)
            hashing.append(h)
            print(f"leaf hashing {size:>8} B blocks: many at once {h['many_GB_per_cpu_s']:.2f} GB/s "
                  f"per core ({'native' if NATIVE_LEAVES else 'no native core: hashlib'}), "
                  f"one by one (hashlib) {h['hashlib_GB_per_cpu_s']:.2f} GB/s per core", flush=True)
        results["leaf_hashing"] = hashing
        for size in (1024, 16 * 1024, MiB):
            for policy in FsyncPolicy:
                total = args.mb * MiB if size > 1024 else min(args.mb, 64) * MiB
                d = os.path.join(base, f"a-{size}-{policy}")
                r = append_run(d, policy, size, total)
                appends.append(r)
                print(f"append {size:>8} B  {policy!s:<8} {r['MB_per_s']:8.1f} MB/s "
                      f"{r['batches_per_s']:10.0f} batches/s  {r['cpu_s_per_GB']:5.2f} CPU-s/GB  "
                      f"({r['commits']} commits, load {r['load_average']:.1f})", flush=True)
                if not (size == 16 * 1024 and policy is FsyncPolicy.INTERVAL):
                    shutil.rmtree(d)
        results["append"] = appends
        rd = read_run(os.path.join(base, f"a-{16 * 1024}-interval"))
        results["read"] = rd
        print(f"read 16 KiB batches, 1 MiB ranges: first pass {rd['first_read_MB_per_s']:.0f} "
              f"MB/s (authenticates), cached {rd['cached_read_MB_per_s']:.0f} MB/s, "
              f"{rd['ranges_per_s']:.0f} ranges/s", flush=True)
        if args.reopen_gib > 0:
            ro = reopen_run(os.path.join(base, "reopen"), 16 * 1024, int(args.reopen_gib * 1024 * MiB))
            results["reopen"] = ro
            print(f"reopen {ro['bytes'] / 2**30:.2f} GiB of 16 KiB batches: clean "
                  f"{ro['reopen_clean_seconds']:.3f} s, after a process crash "
                  f"{ro['reopen_after_crash_seconds']:.3f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"storage-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

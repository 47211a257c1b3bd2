"""`scripts/bench broker [--quick] [--peers kafka,tansu,noida] [--runs N] [--brokers 3] ...`.

Parses the command line, runs `runner.run`, prints the table and writes results.json,
table.txt and chart.png into a new folder under bench-results/ (ignored by git); with
--profile also py-spy stacks of hyperkafka under produce and latency load, summarised by
`compat_tests.bench.profile`. Imports the standard library and compat_tests.bench only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from compat_tests import harness
from compat_tests.bench import runner
from compat_tests.bench.targets import ALL_TARGETS, CLUSTER_TARGETS


def parse(argv: list[str]) -> tuple[runner.Params, list[str], Path, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="scripts/bench broker", description=__doc__)
    size = ap.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help="64 MiB topics, 6 s latency runs, 16 MiB fan-out (minutes, not an hour)",
    )
    size.add_argument(
        "--tiny",
        action="store_true",
        help="seconds of traffic, 1 run: checks the machinery, measures nothing",
    )
    ap.add_argument(
        "--peers",
        default="kafka,tansu,noida",
        help="comma-separated peers to run beside hyperkafka, or 'none' "
        f"(known: {', '.join(ALL_TARGETS[1:])})",
    )
    ap.add_argument("--runs", type=int, help="runs of each workload per broker (default 3)")
    ap.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="brokers per target: 3 runs hyperkafka (on etcd, quorum-signed partitions) "
        "beside a 3-node Kafka, replication factor 3, acks=all; peers: kafka only, "
        f"workloads: {', '.join(runner.CLUSTER_WORKLOADS)}",
    )
    ap.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of {', '.join(runner.WORKLOADS)}",
    )
    ap.add_argument("--size-mib", type=int, help="bytes per throughput topic (default 1024)")
    ap.add_argument("--hk-fsync", default="interval", choices=("always", "interval", "never"))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="py-spy record hyperkafka while it takes produce and latency load",
    )
    ap.add_argument("--keep-data", action="store_true", help="keep the brokers' data dirs")
    ap.add_argument("--out", default=str(harness.ROOT / "bench-results"))
    ap.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib)")
    args = ap.parse_args(argv)  # fmt: skip

    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    params = runner.Params(**runner.PRESETS[size_name])
    cluster = args.brokers > 1
    if args.brokers < 1:
        ap.error("--brokers must be at least 1")
    if cluster:
        params = runner.cluster_params(params, size_name, args.brokers)
        if args.peers == ap.get_default("peers"):
            args.peers = "kafka"
    known = runner.CLUSTER_WORKLOADS if cluster else runner.WORKLOADS
    workloads = tuple(w for w in (args.workloads or ",".join(known)).split(",") if w)
    bad = [w for w in workloads if w not in known]
    if bad:
        ap.error(f"unknown workload(s) {bad}; known{' with --brokers' if cluster else ''}: "
                 f"{', '.join(known)}")  # fmt: skip
    changes: dict[str, object] = {"workloads": workloads, "hk_fsync": args.hk_fsync,
                                  "profile": args.profile}  # fmt: skip
    if args.runs is not None:
        if args.runs < 1:
            ap.error("--runs must be at least 1")
        changes["runs"] = args.runs
    if args.size_mib is not None:
        changes["throughput_bytes"] = args.size_mib * runner.MiB
    params = dataclasses.replace(params, **changes)  # type: ignore[arg-type]

    peers = [] if args.peers in ("", "none") else args.peers.split(",")
    allowed = CLUSTER_TARGETS[1:] if cluster else ALL_TARGETS[1:]
    unknown = [p for p in peers if p not in allowed]
    if unknown:
        ap.error(f"unknown peer(s) {unknown}; known{' with --brokers' if cluster else ''}: "
                 f"{', '.join(allowed)}")  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    outdir = Path(args.out) / (f"cluster{args.brokers}-{stamp}" if cluster else f"broker-{stamp}")
    return params, ["hyperkafka", *peers], outdir, args


def main(argv: list[str] | None = None) -> int:
    params, brokers, outdir, args = parse(sys.argv[1:] if argv is None else argv)
    print(f"bench: {', '.join(brokers)}; workloads {', '.join(params.workloads)}; "
          f"{params.runs} run(s); results in {outdir}", file=sys.stderr)  # fmt: skip
    report = runner.run(
        params,
        brokers,
        outdir,
        keep_data=args.keep_data,
        # results.json and table.txt so far after every pass (the chart only at the end)
        checkpoint=lambda r: runner.write(r, outdir, draw=False),
    )
    doc, text = runner.write(report, outdir, draw=not args.no_chart)
    print(text)
    if params.profile:
        from compat_tests.bench import profile

        pdir = outdir / "profile"
        pdir.mkdir(exist_ok=True)
        counts = pdir / "requests.json"
        requests = json.loads(counts.read_text()) if counts.exists() else {}
        summary = profile.summarise_dir(pdir, runner.PROFILE_HZ, requests)
        (outdir / "profile" / "summary.txt").write_text(summary + "\n")
        print("\n" + summary)
    print(f"\nwrote {outdir}/results.json, table.txt" + ("" if args.no_chart else ", chart.png"))
    # Non-zero when hyperkafka itself produced no figure at all: the bench is broken.
    ours = [e for e in doc["results"].values() if "hyperkafka" in e["brokers"]]
    return 0 if ours else 1


if __name__ == "__main__":
    sys.exit(main())

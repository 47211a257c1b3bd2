"""`python -m compat_tests.attack` (what scripts/fuzz runs): the attack suite's fuzzers, longer.

    --seconds N --seed S [--class C,C] [--threads T]   the schema fuzzer on a guarded broker
    --replay HEX                                       one frame (from a failure) on a fresh broker
    --atheris TARGET --seconds N [--seed S]            a coverage-guided target (codec, records)
    --write-corpus                                     regenerate the atheris seed corpus

Exit status 0 when the broker came through, 1 when it did not (the report says how, with
the seed and the frame to replay), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from compat_tests import harness

from .guard import AttackFailed


def _fuzz(args: argparse.Namespace) -> int:
    from .run import fuzz
    from .schema_fuzz import CLASSES

    classes = args.cls.split(",") if args.cls else list(CLASSES)
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        print(f"unknown class {unknown}; classes: {', '.join(CLASSES)}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    workdir = Path(tempfile.mkdtemp(prefix="hk-fuzz-"))
    print(f"fuzzing {','.join(classes)} for {args.seconds} s with seed {seed} (work dir {workdir})")
    try:
        fuzz(workdir, seed, classes, args.seconds, threads=args.threads,
             record=lambda k, v: print(f"  {k}: {v}"), on_report=print)  # fmt: skip
    except AttackFailed as exc:
        print(f"\nFAILED (seed {seed}; broker data and logs kept in {workdir}):\n{exc}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    print("the broker came through")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .schema_fuzz import replay

    data = bytes.fromhex(args.replay.strip())
    workdir = Path(tempfile.mkdtemp(prefix="hk-replay-"))
    b = harness.new_broker(workdir)
    b.start()
    try:
        outcome = replay(b.host, b.port, data)
        time.sleep(0.5)
        alive = b.proc is not None and b.proc.poll() is None
        print(f"frame of {len(data)} bytes: {outcome}; broker {'alive' if alive else 'DEAD'}")
        if not alive or outcome == "hung":
            print(b.log_tail(40))
            print(f"(log in {workdir})")
            return 1
        return 0
    finally:
        b.kill()


def _atheris(args: argparse.Namespace) -> int:
    from .atheris_targets import TARGETS, atheris_available, run_target

    if args.atheris not in TARGETS:
        print(f"unknown target {args.atheris}; targets: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if not atheris_available():
        print("atheris is not installed: pip install -e '.[fuzz]'", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix=f"hk-atheris-{args.atheris}-"))
    run = run_target(args.atheris, args.seconds, workdir, seed=args.seed or 0)
    print("\n".join(run.output.splitlines()[-12:]))
    print(
        f"{args.atheris}: {run.execs} executions, exit {run.returncode}; new inputs in {workdir}/corpus"
    )
    if run.crash is not None or run.returncode != 0:
        print(f"CRASH: {run.crash}\ninput: {run.crash_hex()}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--class", dest="cls", help="mutation classes, comma-separated (default all)")
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--replay", metavar="HEX")
    ap.add_argument("--atheris", metavar="TARGET")
    ap.add_argument("--write-corpus", action="store_true")
    args = ap.parse_args(argv)
    if args.write_corpus:
        from .atheris_targets import write_seed_corpus

        print(write_seed_corpus())
        return 0
    if args.replay:
        return _replay(args)
    if args.atheris:
        return _atheris(args)
    return _fuzz(args)


if __name__ == "__main__":
    sys.exit(main())

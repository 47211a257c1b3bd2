"""Attack runs shared by the tests and `scripts/fuzz`: the schema fuzzer under a guard.

`fuzz()` starts a guarded broker, runs `schema_fuzz.Runner` for the given classes and
seconds, and gives the guard's verdict. When the broker dies it replays the last frames sent,
each on a fresh broker, to name the one that kills it. Every failure message carries the
seed, the class and the frame in hex, so `scripts/fuzz --replay HEX` or `--seed S` repeats it.
Imports the standard library and the compat_tests modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from compat_tests import harness

from . import wire
from .guard import AttackFailed, Bounds, Guard
from .schema_fuzz import Campaign, Runner, find_culprit, targets_for

_culprit_runs = itertools.count()


def fuzz(
    workdir: Path,
    seed: int,
    classes: Sequence[str],
    seconds: float,
    *,
    threads: int = 3,
    bounds: Bounds | None = None,
    record: Callable[[str, Any], None] | None = None,
    on_report: Callable[[str], None] | None = None,
) -> Campaign:
    """Fuzz a guarded broker; raise AttackFailed (message = the campaign's summary) on any
    crash, hang, bound passed, valid request refused by a close, or failed final check."""
    name = "fuzz-" + "-".join(classes) if len(classes) <= 2 else "fuzz-mixed"
    with Guard(workdir, name, bounds or Bounds(), record=record) as g:
        ranges = wire.api_versions(g.host, g.port)
        runner = Runner(g.host, g.port, ranges, seed, classes, threads=threads)
        campaign = Campaign(seed, list(classes), runner.stats)
        try:
            runner.run(seconds, on_tick=lambda: g.check("the fuzz run"))
        except AttackFailed as exc:
            campaign.failure = str(exc)
        g.end_attack()
        stats = runner.stats
        g.record("frames", campaign.frames_sent())
        g.record("api_versions_covered", len(stats.frames))
        g.record("seed", seed)
        if campaign.failure and not g.alive():
            campaign.suspects = list(stats.recent)

            def fresh() -> harness.Broker:
                b = harness.new_broker(workdir / f"replay-{next(_culprit_runs)}")
                b.start()
                return b

            campaign.culprit = find_culprit(campaign.suspects, fresh)
        problems = []
        if stats.hangs:
            problems.append(f"{len(stats.hangs)} requests unanswered past the deadline")
        if stats.valid_closed:
            problems.append(
                f"{sum(stats.valid_closed.values())} valid requests answered by closing the "
                f"connection: {dict(stats.valid_closed)}"
            )
        expected = {
            t.api_key for c in classes if c != "unknown-api" for t in targets_for(c, ranges)
        }
        missing = expected - {k for k in _keys_sent(stats.frames) if k is not None}
        rounds = sum(len(targets_for(c, ranges)) for c in classes)
        if missing and campaign.frames_sent() >= rounds:
            problems.append(f"api keys never fuzzed: {sorted(missing)}")
        if on_report is not None:
            on_report(campaign.summary())
        if campaign.failure:
            raise AttackFailed(campaign.summary())
        try:
            g.finish(problems)
        except AttackFailed as exc:
            raise AttackFailed(f"{exc}\n{campaign.summary()}") from None
    return campaign


def _keys_sent(frames: dict[str, int]) -> list[int | None]:
    from .schema_fuzz import api_name

    by_name = {api_name(k): k for k in range(-1, 200)}
    return [by_name.get(label.rsplit(" v", 1)[0]) for label in frames]

"""Attack suite, coverage-guided part: atheris over the codec and record validation.

Each target (compat_tests.attack.atheris_targets) first replays its seed corpus, kept in
compat_tests/attack/corpus/<target>/, then fuzzes for HK_ATHERIS_SECONDS (default 15) in a
child process, so a native abort is a failure with the input saved, not the end of pytest.
Only the decoders' typed errors may escape. `scripts/fuzz --atheris TARGET --seconds N`
runs one longer; new inputs it finds can be copied into the corpus.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.attack.atheris_targets import CORPUS, TARGETS, atheris_available, run_target

SECONDS = float(os.environ.get("HK_ATHERIS_SECONDS", "15"))


def test_seed_corpus_is_kept_small() -> None:
    for target in TARGETS:
        files = list((CORPUS / target).iterdir())
        assert len(files) >= 20, f"{target}: {len(files)} seed inputs"
        assert sum(f.stat().st_size for f in files) < 256 * 1024
        assert max(f.stat().st_size for f in files) <= 8192


@pytest.mark.timeout(600)
@pytest.mark.matrix("attack-atheris-{target}", client="atheris")
@pytest.mark.parametrize("target", TARGETS)
def test_atheris(target: str, tmp_path: Path, record_property: Callable[[str, Any], None]) -> None:
    harness.require(atheris_available(), "atheris is not installed (pip install -e '.[fuzz]')")
    run = run_target(target, SECONDS, tmp_path)
    record_property("executions", run.execs)
    record_property("seconds", SECONDS)
    if run.crash is not None or run.returncode != 0:
        summary = [ln for ln in run.output.splitlines() if "ERROR" in ln or "SUMMARY" in ln
                   or "Uncaught" in ln or "Error" in ln][-6:]  # fmt: skip
        raise AssertionError(
            f"atheris {target}: exit {run.returncode}; {' | '.join(summary)}\n"
            f"input ({run.crash}): {run.crash_hex()}\n"
            f"rerun: python -m compat_tests.attack.atheris_targets {target} {run.crash}\n"
            + "\n".join(run.output.splitlines()[-25:])
        )

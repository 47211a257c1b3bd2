"""Attack suite, part d: a second broker on a data dir that a running broker holds.

While the guarded broker serves the good producer, `hyperkafka serve` is started again on
the same data dir: by its own path, and through a symlink to it. Each must exit at once
(within 10 s, before it ever answers a request) with a non-zero status and a line that
names the data dir and the pid of the broker holding it (Kafka's `.lock`). The first
broker must not notice: the good producer keeps being acknowledged, every acknowledged
record is read back, and `hyperkafka verify` passes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.attack.guard import Bounds, Guard

EXIT_WITHIN = 10.0


def _second_serve(g: Guard, data_dir: Path, workdir: Path) -> tuple[int | None, str, bool]:
    """(exit status or None if still running, its output, whether it ever answered)."""
    workdir.mkdir(parents=True, exist_ok=True)
    second = harness.new_broker(workdir, data_dir=data_dir)
    assert second.log_path is not None
    log = second.log_path.open("ab")
    proc = subprocess.Popen(second.argv, cwd=harness.ROOT, env=second.env, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    log.close()
    answered = False
    deadline = time.monotonic() + EXIT_WITHIN
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            answered = answered or harness.api_versions_v0_probe(second.host, second.port, 0.5)
            g.check("a second broker starting on the same data dir")
            time.sleep(0.1)
        status = proc.poll()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return status, second.log_path.read_text(errors="replace"), answered


@pytest.mark.timeout(120)
@pytest.mark.matrix("attack-second-broker-same-data-dir", client="raw-socket")
def test_second_broker_on_the_same_data_dir(
    tmp_path: Path, record_property: Callable[[str, Any], None]
) -> None:
    with Guard(tmp_path, "second-broker", Bounds(), record=record_property) as g:
        data_dir = g.broker.data_dir
        assert data_dir is not None
        link = tmp_path / "same-dir-link"
        os.symlink(data_dir, link)
        problems: list[str] = []
        for n, (label, path) in enumerate((("the same path", data_dir), ("a symlink to it", link))):
            started = time.monotonic()
            status, output, answered = _second_serve(g, path, tmp_path / f"second-{n}")
            took = round(time.monotonic() - started, 2)
            record_property(
                f"second_serve_via_{label.split()[1]}", f"status {status} after {took} s"
            )
            first_line = next(
                (ln for ln in output.splitlines() if str(data_dir) in ln or str(path) in ln), ""
            )
            if status is None:
                problems.append(
                    f"a second serve on {label} was still running after {EXIT_WITHIN} s"
                )
            elif status == 0:
                problems.append(f"a second serve on {label} exited 0")
            if answered:
                problems.append(f"a second serve on {label} answered requests")
            if status not in (None, 0) and (not first_line or str(g.pid) not in output):
                problems.append(
                    f"a second serve on {label} did not name the data dir and the holder's pid "
                    f"{g.pid}: {output.strip().splitlines()[-1:] or '(no output)'}"
                )
        g.end_attack()
        g.finish(problems)

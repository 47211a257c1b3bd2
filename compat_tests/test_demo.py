"""scripts/demo (one writer, two mirrors, a producer, a console consumer as local
processes) runs to completion: the console consumer on mirror 1 prints every record
produced to the writer, and mirror 2 reaches the same high watermark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compat_tests.harness import ROOT


@pytest.mark.timeout(150)
@pytest.mark.matrix("scripts/demo: writer + 2 mirrors + producer + console consumer", client="kafka-python")
def test_demo_script(workdir: Path) -> None:
    env = dict(os.environ, HK_PYTHON=sys.executable, HK_DEMO_DIR=str(workdir / "demo"))
    proc = subprocess.run([str(ROOT / "scripts" / "demo"), "--records", "500"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((workdir / "demo").glob("*.log")))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + logs
    assert "mirror-1 offset 499: demo record 499" in proc.stdout
    assert "demo OK: 500 records" in proc.stdout
    # every process the script started is gone: their logs say they shut down cleanly
    for name in ("writer", "mirror-1", "mirror-2"):
        assert "hyperkafka stopped" in (workdir / "demo" / f"{name}.log").read_text(), logs

"""kafka-python's own integration tests (from its 3.0.12 sdist) against a hyperkafka process.

The sdist (`pip download --no-binary :all: --no-deps kafka-python==3.0.12`, fetched by
scripts/test into compat_tests/.tools) ships test/integration/, and its fixtures accept an
external broker (KAFKA_URI=kafka://host:port with KAFKA_VERSION set), but as shipped they
cannot start, for three reasons that compat_tests/FINDINGS.md records:

1. test/integration/fixtures.py imports `test.service` (ExternalService, SpawnedService),
   and test/service.py is not in the sdist;
2. test/ has no __init__.py, so `import test.testutil` finds the standard library's own
   `test` package;
3. the fixture base class insists that a Kafka distribution directory (KAFKA_ROOT,
   default servers/<version>/kafka-bin) exists, even for an external broker.

This test unpacks the sdist into a temp dir, adds an empty test/__init__.py and a
test/service.py of our own (an ExternalService that does nothing, a SpawnedService that
refuses), points KAFKA_ROOT at an empty dir, and runs exactly the node ids listed in
compat_tests/kafka_python_allowlist.txt against a broker of its own (started with the
group session floor of kafka-python's test broker config: its group tests use 3 s
sessions). Every listed test must pass. KAFKA_VERSION=4.0.0: hyperkafka models a Kafka 4
broker, and the suite picks its expectations by that version.

Imports the standard library, pytest and compat_tests.harness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import Broker


def _installed_version() -> str:
    from importlib.metadata import version

    return version("kafka-python")


VERSION = _installed_version()  # the sdist of the very release the other tests run
SDIST = harness.TOOLS_DIR / f"kafka_python-{VERSION}.tar.gz"
ALLOWLIST = harness.COMPAT_DIR / "kafka_python_allowlist.txt"
SUITE_TIMEOUT = 240

# Our stand-in for the test/service.py the sdist does not ship: only the external-broker
# path is used, where the fixture merely keeps the object and never starts anything.
SERVICE_PY = '''"""Stand-in written by hyperkafka's compat_tests (the sdist lacks test/service.py)."""


class ExternalService:
    def __init__(self, host, port):
        self.host, self.port = host, port

    def start(self):
        pass

    def stop(self):
        pass

    def dump_logs(self):
        pass


class SpawnedService:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("this run uses an external broker (KAFKA_URI); spawning is not supported")
'''

# kafka-python's test broker runs with a low group session floor (its group tests ask for
# 3 s sessions; the Kafka and hyperkafka default floor is 6 s) and no initial rebalance delay.
BROKER_PROPERTIES = {"group.min.session.timeout.ms": "1000", "group.initial.rebalance.delay.ms": "0"}


def allowlist() -> list[str]:
    out = []
    for line in ALLOWLIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


@pytest.fixture
def kp_broker(tmp_path: Path) -> Iterator[Broker]:
    if harness.external_broker() is not None:
        pytest.skip("kafka-python's suite runs against a broker the harness starts with its config")
    with harness.configured_broker(tmp_path / "kp", BROKER_PROPERTIES, what="kafka-python's suite") as b:
        yield b


def unpack(into: Path) -> Path:
    harness.require(SDIST.exists(), f"{SDIST.relative_to(harness.ROOT)} missing (scripts/test downloads it from PyPI)")
    with tarfile.open(SDIST) as tar:
        tar.extractall(into, filter="data")
    root = into / f"kafka_python-{VERSION}"
    assert (root / "test" / "integration" / "conftest.py").exists(), "the sdist no longer ships test/integration"
    assert not (root / "test" / "service.py").exists(), "the sdist now ships test/service.py: drop the stand-in"
    (root / "test" / "__init__.py").touch()
    (root / "test" / "service.py").write_text(SERVICE_PY)
    return root


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
@pytest.mark.matrix("kafka-python suite (allow-list)", client="kafka-python")
def test_kafka_python_allowlisted_tests_pass(kp_broker: Broker, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    root = unpack(tmp_path / "sdist")
    names = allowlist()
    kafka_root = tmp_path / "no-kafka-distribution"
    kafka_root.mkdir()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the sdist's own tree, not ours, is what its tests import
    env.update(
        KAFKA_URI=f"kafka://{kp_broker.host}:{kp_broker.port}",
        KAFKA_VERSION="4.0.0",
        KAFKA_ROOT=str(kafka_root),
        PYTHONPATH=str(root),
    )
    report = tmp_path / "junit.xml"
    argv = [sys.executable, "-m", "pytest", *[f"test/integration/{n}" for n in names]]
    # -o addopts=: the sdist's own options need pytest-timeout, which this venv does not have.
    argv += ["-c", "pyproject.toml", "-o", "addopts=", "-o", "log_level=WARNING", "-p", "no:cacheprovider"]
    argv += ["-q", f"--junitxml={report}"]
    log = tmp_path / "kafka-python-suite.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.run(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT, check=False)
    took = time.monotonic() - started
    text = log.read_text(errors="replace")
    outcomes: dict[str, str] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").rsplit(".", 1)[-1]
            nodeid = f"{module}.py::{case.get('name')}"
            bad = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[nodeid] = bad[0] if bad else "passed"
    passed = [n for n in names if outcomes.get(n) == "passed"]
    request.node.user_properties.extend([("kp_passed", len(passed)), ("kp_allowlisted", len(names)), ("kp_seconds", round(took, 1))])
    print(f"\nKAFKA-PYTHON SUITE: {len(passed)}/{len(names)} allow-listed tests passed in {took:.0f}s (exit {proc.returncode})", file=sys.stderr)
    bad = {n: outcomes.get(n, "no result") for n in names if outcomes.get(n) != "passed"}
    if bad or proc.returncode != 0:
        raise AssertionError(
            f"kafka-python suite: {len(bad)} allow-listed test(s) did not pass: {bad} (exit {proc.returncode})\n"
            f"log tail ({log}):\n" + "\n".join(text.splitlines()[-60:])
        )

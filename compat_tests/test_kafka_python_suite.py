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
broker, and the suite picks its expectations by that version. A second test checks that
the allow-list and the per-test table of FINDINGS.md are the sdist's whole collected list.

Imports the standard library, pytest and compat_tests.harness.
"""

from __future__ import annotations

import os
import re
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
FINDINGS = harness.COMPAT_DIR / "FINDINGS.md"
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


def broker_properties(port: int) -> dict[str, str]:
    """BROKER_PROPERTIES and, as in the server.properties of the suite's own broker,
    advertised.listeners (test_describe_configs_broker_resource_returns_configs expects it
    to come from the file: STATIC_BROKER_CONFIG)."""
    return {**BROKER_PROPERTIES, "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}"}


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
    port = harness.free_port()
    with harness.configured_broker(tmp_path / "kp", broker_properties(port), port=port, what="kafka-python's suite") as b:
        yield b


def findings_rows() -> dict[str, str]:
    """Node id -> cause, from the per-test table of FINDINGS.md's kafka-python section."""
    text = FINDINGS.read_text()
    start = text.find("## kafka-python's own test suite")
    assert start >= 0, "FINDINGS.md has no \"kafka-python's own test suite\" section"
    end = text.find("\n## ", start + 1)
    section = text[start : end if end > 0 else len(text)]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(test_\w+\.py::[^`]+)` \| ([^|]+) \|", section, re.MULTILINE)}


def suite_env(root: Path, kafka_root: Path, bootstrap: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the sdist's own tree, not ours, is what its tests import
    env.update(KAFKA_URI=f"kafka://{bootstrap}", KAFKA_VERSION="4.0.0", KAFKA_ROOT=str(kafka_root), PYTHONPATH=str(root))
    return env


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
    env = suite_env(root, kafka_root, kp_broker.bootstrap)
    report = tmp_path / "junit.xml"
    argv = [sys.executable, "-m", "pytest", *[f"test/integration/{n}" for n in names]]
    # The sdist's own addopts (--timeout=300 --timeout-method=thread) use pytest-timeout,
    # which our test extra installs.
    argv += ["-c", "pyproject.toml", "-o", "log_level=WARNING", "-p", "no:cacheprovider"]
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


@pytest.mark.timeout(120)
def test_kafka_python_allowlist_and_findings_cover_the_suite(tmp_path: Path) -> None:
    """The allow-list and FINDINGS.md's table are the sdist's whole list of integration
    tests (as collected with KAFKA_VERSION=4.0.0), no name in both: a renamed, removed or
    new upstream test shows up here."""
    root = unpack(tmp_path / "sdist")
    kafka_root = tmp_path / "no-kafka-distribution"
    kafka_root.mkdir()
    env = suite_env(root, kafka_root, f"127.0.0.1:{harness.free_port()}")
    argv = [sys.executable, "-m", "pytest", "test/integration", "--collect-only", "-q", "-c", "pyproject.toml", "-p", "no:cacheprovider"]
    out = subprocess.run(argv, cwd=root, env=env, capture_output=True, timeout=90, check=False)
    prefix = "test/integration/"
    collected = {line[len(prefix) :] for line in out.stdout.decode().splitlines() if line.startswith(prefix)}
    assert collected, f"nothing collected: {out.stdout.decode()[-2000:]}{out.stderr.decode()[-2000:]}"
    names, rows = allowlist(), findings_rows()
    assert len(set(names)) == len(names), "duplicate names in the allow-list"
    assert not (set(names) & set(rows)), f"both allow-listed and in FINDINGS.md: {sorted(set(names) & set(rows))}"
    assert not (set(names) | set(rows)) - collected, f"not in the sdist's suite: {sorted((set(names) | set(rows)) - collected)}"
    assert not collected - set(names) - set(rows), f"neither allow-listed nor in FINDINGS.md: {sorted(collected - set(names) - set(rows))}"

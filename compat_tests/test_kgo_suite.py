"""franz-go's own integration tests (pkg/kgo) against a hyperkafka process of their own.

compat_tests/go/setup.sh compiles the test binary of the franz-go version that
compat_tests/go/go.mod pins (`go test -c github.com/twmb/franz-go/pkg/kgo`). This test
starts a fresh broker, runs exactly the tests named in compat_tests/kgo_allowlist.txt with
`-test.run '^(A|B|...)$'` and KGO_SEEDS at the broker, and fails unless each one reports
PASS. The suite's knobs: KGO_TEST_RF=1 (one broker), KGO_TEST_RECORDS (records per ETL
test; HK_KGO_RECORDS, default 10000, where franz-go's default is 500000),
KGO_LOG_LEVEL (HK_KGO_LOG_LEVEL, default none); the broker runs with
offsets.commit.timeout.ms=30000 (see BROKER_PROPERTIES). The tests that are not allow-listed are
listed with their causes in compat_tests/FINDINGS.md; a second test keeps that table and the
allow-list consistent with the binary's own test list.

Imports the standard library, pytest and compat_tests.harness.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import Broker

ALLOWLIST = harness.COMPAT_DIR / "kgo_allowlist.txt"
FINDINGS = harness.COMPAT_DIR / "FINDINGS.md"
SUITE_TIMEOUT = 270  # seconds for the whole go test run; CI budget is < 5 min
# -test.parallel stays at Go's default (GOMAXPROCS: 2 on a CI machine). Tried 8: under a
# load average of 12 the offsets archive then took longer than offsets.commit.timeout.ms
# (5 s) and OffsetCommit answered REQUEST_TIMED_OUT, failing TestGroupETL.
# JoinGroup (static members) and OffsetCommit wait until the offsets archive is durable, for
# at most offsets.commit.timeout.ms (5 s by default, as in Kafka), then answer
# REQUEST_TIMED_OUT. On a 2-core machine shared with other jobs (load average 11) an fsync
# took longer than that and failed TestGroupETL twice in four runs; this suite tests the
# protocol, not the disk, so its broker waits up to 30 s.
BROKER_PROPERTIES = {"offsets.commit.timeout.ms": "30000"}
_RESULT = re.compile(r"^--- (PASS|FAIL|SKIP): (\S+) \(([\d.]+)s\)", re.MULTILINE)


def allowlist() -> list[str]:
    names = []
    for line in ALLOWLIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def findings_rows() -> dict[str, str]:
    """Test name -> cause, from the FINDINGS.md table of kgo tests that are not allow-listed."""
    text = FINDINGS.read_text()
    start = text.find("## franz-go's own test suite")
    assert start >= 0, "FINDINGS.md has no \"franz-go's own test suite\" section"
    rows = {}
    for m in re.finditer(r"^\| `(Test\w+)` \| ([^|]+) \|", text[start:], re.MULTILINE):
        rows[m.group(1)] = m.group(2).strip()
    return rows


def _suite() -> tuple[str, Path]:
    found, why = harness.find_kgo_suite()
    harness.require(found is not None, why)
    assert found is not None
    return found


@pytest.fixture
def kgo_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker only the franz-go suite uses: it creates and deletes hundreds of topics."""
    ext = harness.external_broker()
    if ext is not None:
        ext.start(timeout=15)
        yield ext
        return
    with harness.configured_broker(tmp_path / "kgo", BROKER_PROPERTIES, what="the kgo suite") as b:
        yield b


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
@pytest.mark.matrix("kgo-suite (allow-list)", client="franz-go")
def test_kgo_allowlisted_tests_pass(kgo_broker: Broker, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    binary, pkg = _suite()
    names = allowlist()
    assert names, "empty allow-list"
    env = dict(os.environ)
    env.update(
        KGO_SEEDS=kgo_broker.bootstrap,
        KGO_TEST_RF="1",
        KGO_TEST_RECORDS=os.environ.get("HK_KGO_RECORDS", "10000"),
        KGO_LOG_LEVEL=os.environ.get("HK_KGO_LOG_LEVEL", "none"),
    )
    argv = [binary, "-test.run", "^(" + "|".join(names) + ")$", "-test.v", "-test.count", "1"]
    argv += ["-test.timeout", f"{SUITE_TIMEOUT}s"]
    log = tmp_path / "kgo-suite.log"
    started = time.monotonic()
    with log.open("wb") as out:
        # Run where `go test` would: in the package directory (some tests read files there).
        proc = subprocess.run(argv, cwd=pkg, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT + 30, check=False)
    took = time.monotonic() - started
    text = log.read_text(errors="replace")
    outcome = {name: state for state, name, _ in _RESULT.findall(text)}
    passed = [n for n in names if outcome.get(n) == "PASS"]
    request.node.user_properties.extend([("kgo_passed", len(passed)), ("kgo_allowlisted", len(names)), ("kgo_seconds", round(took, 1))])
    print(f"\nKGO SUITE: {len(passed)}/{len(names)} allow-listed franz-go tests passed in {took:.0f}s (exit {proc.returncode})", file=sys.stderr)
    bad = {n: outcome.get(n, "no result") for n in names if outcome.get(n) != "PASS"}
    if bad or proc.returncode != 0:
        raise AssertionError(
            f"franz-go suite: {len(bad)} allow-listed test(s) did not pass: {bad} (exit {proc.returncode})\n"
            f"log tail ({log}):\n" + "\n".join(text.splitlines()[-80:])
        )


@pytest.mark.timeout(60)
def test_kgo_allowlist_and_findings_name_real_tests() -> None:
    """Every allow-listed or FINDINGS-listed name is a test of this franz-go version, and no
    test is in both: a renamed or removed upstream test shows up here, not as a silent pass."""
    binary, pkg = _suite()
    listed = subprocess.run([binary, "-test.list", "^Test"], cwd=pkg, capture_output=True, check=True, timeout=50)
    real = set(listed.stdout.decode().split())
    names, rows = allowlist(), findings_rows()
    assert len(set(names)) == len(names), "duplicate names in the allow-list"
    assert not (set(names) - real), f"allow-listed but not in franz-go's suite: {sorted(set(names) - real)}"
    assert not (set(rows) - real), f"in FINDINGS.md but not in franz-go's suite: {sorted(set(rows) - real)}"
    assert not (set(names) & set(rows)), f"both allow-listed and listed as not passing: {sorted(set(names) & set(rows))}"

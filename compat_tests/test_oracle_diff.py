"""The differential oracle: the same raw request script against Apache Kafka and hyperkafka.

A real Apache Kafka KRaft node (the jars of compat_tests/java/pom.xml, started by
`java_tools.KafkaOracle`) and hyperkafka (a child process, node id 1 like the oracle)
each get the request script of `compat_tests.oracle` on a fresh data dir. Their answers,
normalised, must agree field by field, except where compat_tests/FINDINGS.md lists the
difference: in "Accepted differences" (with why it is fine), or in "hyperkafka bugs"
(reported as an expected failure until fixed). A FINDINGS row that no longer matches
anything fails too, so the file cannot go stale.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from compat_tests import oracle
from compat_tests.harness import new_broker
from compat_tests.java_tools import JavaTools, KafkaOracle, require_java


@dataclass
class Runs:
    kafka: list[oracle.Exchange]
    hyperkafka: list[oracle.Exchange]
    kafka_version: str
    seconds: dict[str, float]

    def differences(self) -> list[oracle.Difference]:
        return oracle.compare(self.kafka, self.hyperkafka)


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    lib = require_java()
    tools = JavaTools(lib)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hk-oracle-") as tmp:
        kafka = KafkaOracle(tools, Path(tmp) / "kafka", node_id=1)
        ours = new_broker(Path(tmp) / "hyperkafka", extra=("--node-id", "1"))
        t0 = time.monotonic()
        kafka.start()
        seconds["kafka start"] = time.monotonic() - t0
        try:
            ours.start()
            try:
                t0 = time.monotonic()
                theirs_ex = oracle.run_script("127.0.0.1", kafka.port)
                seconds["script on kafka"] = time.monotonic() - t0
                t0 = time.monotonic()
                ours_ex = oracle.run_script("127.0.0.1", ours.port)
                seconds["script on hyperkafka"] = time.monotonic() - t0
            finally:
                assert ours.stop() == 0, ours.log_tail()
        finally:
            t0 = time.monotonic()
            code = kafka.stop()
            seconds["kafka stop"] = time.monotonic() - t0
        # The JVM answers SIGTERM by running its shutdown hooks and exiting 143 (128+15).
        assert code in (0, 143), kafka.log_tail()
        yield Runs(theirs_ex, ours_ex, tools.version, seconds)


def test_both_brokers_ran_the_whole_script(runs: Runs) -> None:
    print(f"\nApache Kafka {runs.kafka_version}; " + ", ".join(f"{k} {v:.1f}s" for k, v in runs.seconds.items()))
    assert [e.step for e in runs.kafka] == [e.step for e in runs.hyperkafka]
    assert len(runs.kafka) >= 40


@pytest.mark.matrix("differential vs Apache Kafka", client="kafka-oracle")
def test_no_unexplained_differences(runs: Runs) -> None:
    explained = oracle.explain(runs.differences(), oracle.load_findings())
    missing = [d for d, f in explained if f is None]
    if missing:
        lines = "\n".join(f"  {d}" for d in missing)
        pytest.fail(
            f"{len(missing)} differences from Apache Kafka {runs.kafka_version} that "
            f"compat_tests/FINDINGS.md does not list (fix hyperkafka, or add a row saying "
            f"why the difference is fine):\n{lines}"
        )


def test_every_finding_still_occurs(runs: Runs) -> None:
    diffs = runs.differences()
    stale = [f for f in oracle.load_findings() if not any(f.matches(d) for d in diffs)]
    assert not stale, "FINDINGS.md rows that match no difference any more (remove them):\n" + "\n".join(
        f"  line {f.line}: {f.api} | {f.versions} | {f.path}" for f in stale
    )


@pytest.mark.matrix("known bugs vs Apache Kafka", client="kafka-oracle")
def test_known_hyperkafka_bugs(runs: Runs) -> None:
    bugs = [(d, f) for d, f in oracle.explain(runs.differences(), oracle.load_findings()) if f and f.table == "bug"]
    if bugs:
        pytest.xfail(
            f"{len(bugs)} differences are known hyperkafka bugs (FINDINGS.md):\n"
            + "\n".join(f"  {d}  <- line {f.line}" for d, f in bugs)
        )


# ------------------------------------------------------ the machinery itself (no broker)


def test_findings_table_is_well_formed() -> None:
    findings = oracle.load_findings()
    assert findings, "FINDINGS.md has no rows"
    names = set(oracle.API_NAMES.values()) | {"*"}
    for f in findings:
        assert f.api in names, f"line {f.line}: unknown api {f.api!r}"
        oracle._version_matches(f.versions, 0)  # parses, or raises ValueError
        assert f.path and f.reason, f"line {f.line}: empty path or reason"


def test_diff_matches_keyed_structs_and_reports_paths() -> None:
    a = {"topics": [{"name": "x", "partitions": [{"partition_index": 0, "e": 1}]}, {"name": "y"}]}
    b = {"topics": [{"name": "y"}, {"name": "x", "partitions": [{"partition_index": 0, "e": 2}]}]}
    assert list(oracle.diff(a, b)) == [("topics[x].partitions[0].e", 1, 2)]
    assert list(oracle.diff({"v": [1, 2]}, {"v": [1]})) == [("v.length", 2, 1)]
    assert list(oracle.diff({"k": None}, {"k": []})) == [("k", None, [])]


def test_finding_glob_and_versions() -> None:
    f = oracle.Finding("accepted", "Fetch", "4-12", "responses[*].partitions[*].high_watermark", "r", 1)
    d = oracle.Difference("s", "Fetch", 12, "responses[t].partitions[0].high_watermark", -1, 9)
    assert f.matches(d)
    assert not f.matches(oracle.Difference("s", "Fetch", 13, d.path, -1, 9))
    assert not f.matches(oracle.Difference("s", "Fetch", 12, d.path + "x", -1, 9))


def test_fixed_batch_is_valid_magic_2() -> None:
    batch = oracle.script_batch()
    (described,) = oracle.describe_records(batch)
    assert described["crc_valid"] and described["magic"] == 2
    assert described["records_count"] == 3 and described["last_offset_delta"] == 2
    assert described["max_timestamp"] == oracle.T0 + 20

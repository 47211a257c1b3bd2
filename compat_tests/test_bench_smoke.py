"""The broker benchmark's machinery in its tiniest mode.

Catches bit-rot in scripts/bench broker (clients, workloads, report, chart) in CI without
measuring anything: it asserts that every workload produced a figure, that the JSON, the
table and the PNG are written and consistent, never how fast anything was. The single
broker runs against hyperkafka only; cluster mode (`--brokers 3`) against three of ours on
etcd beside a three-node Apache Kafka, since both launchers are the code under test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.bench import profile, runner, targets
from compat_tests.etcd import etcd_binary
from compat_tests.java_tools import require_java

ETCD_MISSING = "etcd is not installed (Debian: apt-get install -y etcd-server etcd-client)"


@pytest.mark.timeout(60)
def test_bench_tiny_against_hyperkafka(tmp_path: Path) -> None:
    params = dataclasses.replace(runner.Params(**runner.PRESETS["tiny"]), runs=1)
    report = runner.run(params, ["hyperkafka"], tmp_path)
    doc, text = runner.write(report, tmp_path)

    assert doc["failures"] == {}, doc["failures"]
    expected = [m.key for m in runner.metrics_for(params)]
    assert list(doc["results"]) == expected
    for key, entry in doc["results"].items():
        ours = entry["brokers"].get("hyperkafka")
        assert ours is not None, f"no figure for {key}"
        assert ours["min"] <= ours["median"] <= ours["max"]
        assert len(ours["runs"]) == 1
    # Rates and sizes are real measurements, so they are positive; CPU may round to 0.
    for key in ("throughput.p1.produce_mb_s", "throughput.p1.consume_mb_s",
                "fanout.delivered_mb_s", "footprint.rss_mb", "latency.e2e_p99_ms"):  # fmt: skip
        assert doc["results"][key]["brokers"]["hyperkafka"]["median"] > 0, key

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["results"].keys() == doc["results"].keys()
    assert (tmp_path / "table.txt").read_text().strip() == text.strip()
    assert "produce 1p" in text and "hyperkafka" in text.splitlines()[0]
    png = (tmp_path / "chart.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # The brokers' data dirs are gone, their logs stay.
    assert not list((tmp_path / "work").glob("*/*/data"))


@pytest.mark.timeout(420)
def test_bench_tiny_cluster_against_kafka(tmp_path: Path) -> None:
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    require_java()
    params = runner.cluster_params(runner.Params(**runner.PRESETS["tiny"]), "tiny", 3)
    report = runner.run(params, ["hyperkafka", "kafka"], tmp_path)
    doc, text = runner.write(report, tmp_path, draw=False)

    assert doc["failures"] == {}, doc["failures"]
    assert [b["available"] for b in doc["brokers"]] == [True, True], doc["brokers"]
    assert doc["params"]["brokers"] == 3 and doc["params"]["throughput_acks"] == "all"
    assert list(doc["params"]["workloads"]) == ["throughput", "latency"]
    expected = [m.key for m in runner.metrics_for(params)]
    assert list(doc["results"]) == expected
    for key in ("throughput.p1.produce_mb_s", "throughput.p2.produce_mb_s",
                "latency.produce_p50_ms", "latency.produce_p99_ms"):  # fmt: skip
        assert key in expected
    for key, entry in doc["results"].items():
        for name in ("hyperkafka", "kafka"):
            figure = entry["brokers"].get(name)
            assert figure is not None, f"no {name} figure for {key}"
            assert len(figure["runs"]) == 1
        assert "kafka" in entry["paired_ratio_hyperkafka_over"], key
    for key in ("throughput.p1.produce_mb_s", "latency.produce_p99_ms"):
        for name in ("hyperkafka", "kafka"):
            assert doc["results"][key]["brokers"][name]["median"] > 0, (key, name)
    assert "produce 1p (acks=all)" in text and "hk/kafka" in text.splitlines()[0]
    notes = {b["name"]: b["notes"] for b in doc["brokers"]}
    assert "3 brokers + 1 etcd, quorum-signed" in notes["hyperkafka"]
    assert "3 nodes each broker+controller" in notes["kafka"]
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["results"].keys() == doc["results"].keys()
    # Every member's data (a broker's, a Kafka node's, etcd's) is gone, the logs stay.
    work = tmp_path / "work"
    assert list(work.glob("*/*/broker-*/broker.log")) and list(work.glob("*/*/node-*/kafka.log"))
    assert not [*work.glob("*/*/*/data"), *work.glob("*/*/*/logs")]


@pytest.mark.timeout(180)
def test_bench_cluster_topics_are_quorum_signed_by_three(tmp_path: Path) -> None:
    """What cluster mode measures is a quorum-signed partition of three replicas: the
    bench's own topic, made through its own launcher, has a 3-signer manifest."""
    harness.require(etcd_binary() is not None, ETCD_MISSING)
    from storage.hypercore import Manifest

    params = runner.cluster_params(runner.Params(**runner.PRESETS["tiny"]), "tiny", 3)
    cluster = targets.make_target("hyperkafka", tmp_path / "hk", brokers=3)
    assert isinstance(cluster, targets.HyperkafkaCluster)
    cluster.prepare()
    cluster.start()
    try:
        assert cluster.bootstrap.count(",") == 2
        ctx = runner.Context(params, tmp_path)
        topic = runner.bench_topic(ctx, cluster, 2, "quorum")
        found = {}
        for m in cluster.members:
            assert m.alive()
            for part in range(2):
                path = m.workdir / "data" / f"{topic}-{part}" / "manifest"
                if path.exists():
                    found[part] = Manifest.decode(path.read_bytes())
        assert sorted(found) == [0, 1], found
        for man in found.values():
            assert (man.version, len(man.signers), man.quorum) == (2, 3, 2)
        # CPU and RSS sum the three brokers and etcd
        assert cluster.usage().rss_bytes > sum(
            targets.procfs.usage(m.pid).rss_bytes for m in cluster.members
        )
    finally:
        cluster.stop()
    assert not cluster.alive()


def test_unavailable_peer_is_reported_not_dropped(tmp_path: Path) -> None:
    report = runner.Report(runner.Params(workloads=("footprint",), runs=1), "now", [])
    report.brokers = [runner.BrokerStatus("hyperkafka"),
                      runner.BrokerStatus("noida", available=False, reason="GLIBC too old")]  # fmt: skip
    report.add("hyperkafka", {"footprint.rss_mb": 50.0, "footprint.rss_start_mb": 40.0,
                              "footprint.idle_cpu_pct": 0.5}, 0)  # fmt: skip
    text = runner.table(runner.to_json(report))
    header = text.splitlines()[0]
    assert "noida" in header and "hk/noida" in header
    assert "unavailable" in text.splitlines()[2]
    assert "noida: UNAVAILABLE: GLIBC too old" in text


def test_profile_summary_groups_stacks() -> None:
    raw = (
        "<module> (broker/__main__.py:1);serve (broker/server.py:10);handle (handlers/produce.py:5) 30\n"
        "<module> (broker/__main__.py:1);serve (broker/server.py:10);append (storage/log.py:9) 10\n"
    )
    stacks = profile.parse(raw)
    assert sum(stacks.values()) == 40
    text = profile.summarise(stacks)
    assert "40 samples" in text
    assert "75.0%  handle (handlers/produce.py)" in text
    assert "100.0%  serve (broker/server.py)" in text
    # 40 samples at 100 Hz over 4 requests: 0.1 s per request, 75 ms of it in handle().
    per_req = profile.summarise(stacks, rate=100, requests=4)
    assert "75.0%  75.000 ms/req  handle (handlers/produce.py)" in per_req


def test_paired_ratio_pairs_runs_made_back_to_back() -> None:
    # Run 0 on a fast minute, run 1 on a slow one: the ratio of medians mixes the
    # minutes, the paired one compares like with like (and skips a run a peer lacks).
    by_run = {
        "hyperkafka": {0: 400.0, 1: 200.0, 2: 300.0},
        "kafka": {0: 500.0, 1: 250.0},
        "tansu": {},
    }
    assert runner.paired_ratios(by_run) == {"kafka": pytest.approx(0.8)}
    report = runner.Report(runner.Params(**runner.PRESETS["tiny"]), "now", [])
    report.add("hyperkafka", {"x": 1.0}, 0)
    report.add("kafka", {"x": 2.0}, 0)
    assert report.values["x"] == {"hyperkafka": {0: 1.0}, "kafka": {0: 2.0}}

"""The broker benchmark's machinery in its tiniest mode, against hyperkafka only.

Catches bit-rot in scripts/bench broker (clients, workloads, report, chart) in CI without
measuring anything: it asserts that every workload produced a figure, that the JSON, the
table and the PNG are written and consistent, never how fast anything was.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from compat_tests.bench import profile, runner


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

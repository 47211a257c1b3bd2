"""/metrics against a real Prometheus (Debian's `prometheus` package: the server and
`promtool`; scripts/test installs it when missing), and the alert rules shipped in
docker/prometheus/ evaluated by Prometheus itself.

1. promtool's unit tests of every alert rule (docker/prometheus/alerts_test.yml).
2. A broker with `--http-listen`: `promtool check metrics` finds nothing to lint in a
   scrape, and a real Prometheus scrapes it (target up) and answers queries for the
   records produced, with the shipped rules loaded and healthy.
3. A mirror killed: two brokers of a cluster mirror each other; Prometheus scrapes broker
   1 with the shipped rules; broker 2 is SIGKILLed; broker 1's
   kafka_server_replicamanager_underreplicatedpartitions rises and Prometheus fires
   UnderReplicatedPartitions. The scrapes before and after the kill also become the input
   series of a promtool unit test of the same rule.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.etcd import EtcdServer, etcd_binary
from compat_tests.harness import ROOT, Broker

RULES = ROOT / "docker" / "prometheus" / "alerts.yml"
RULES_TEST = ROOT / "docker" / "prometheus" / "alerts_test.yml"


def _tool(name: str) -> str:
    path = shutil.which(name)
    harness.require(path is not None, f"{name} not installed (apt-get install prometheus)")
    assert path is not None
    return path


def _wait(what: str, check: Callable[[], Any], timeout: float = 60, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {last!r})")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(r.read().decode())


def scrape_if(port: int, wanted: Callable[[str], bool]) -> str | None:
    text = scrape(port)
    return text if wanted(text) else None


def labelled(text: str, name: str) -> dict[str, float]:
    """{labels: value} of every sample of `name` that has labels."""
    return {
        line.split(" ")[0][len(name) :]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line == name:
            return float(line.split(" ")[-1])
    return None


@contextmanager
def prometheus(
    workdir: Path, target_port: int, *, rules: Path | None = RULES
) -> Iterator[Callable[[str, dict[str, str] | None], Any]]:
    """A real Prometheus scraping 127.0.0.1:target_port every second; yields `api(path,
    params)` for its HTTP API."""
    binary = _tool("prometheus")
    port = harness.free_port()
    conf = workdir / "prometheus.yml"
    rule_files = f"rule_files: [{json.dumps(str(rules))}]\n" if rules else ""
    conf.write_text(
        textwrap.dedent(f"""\
        global:
          scrape_interval: 1s
          evaluation_interval: 1s
        scrape_configs:
          - job_name: hyperkafka
            static_configs:
              - targets: ["127.0.0.1:{target_port}"]
        """)
        + rule_files
    )
    log = (workdir / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={conf}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def api(path: str, params: dict[str, str] | None = None) -> Any:
        url = f"http://127.0.0.1:{port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    try:
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def target_up(api: Callable[[str, dict[str, str] | None], Any]) -> bool:
    targets = api("targets", None)["activeTargets"]
    return bool(targets) and all(t["health"] == "up" for t in targets)


def query(api: Callable[[str, dict[str, str] | None], Any], expr: str) -> float | None:
    result = api("query", {"query": expr})["result"]
    return float(result[0]["value"][1]) if result else None


def test_alert_rules_unit_tests() -> None:
    promtool = _tool("promtool")
    out = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run(
        [promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _produce(bootstrap: str, topic: str, n: int) -> None:
    from kafka import KafkaProducer

    p = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=0)
    for i in range(n):
        p.send(topic, b"record-%d" % i, partition=0).get(timeout=30)
    p.close()


@pytest.mark.timeout(180)
def test_prometheus_scrapes_a_broker(workdir: Path) -> None:
    promtool = _tool("promtool")
    http_port = harness.free_port()
    b = harness.new_broker(workdir / "broker", extra=("--http-listen", f"127.0.0.1:{http_port}"))
    b.start()
    try:
        _produce(b.bootstrap, "scraped", 25)
        text = scrape(http_port)
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert (
            sample(text, 'kafka_server_brokertopicmetrics_messagesin_total{topic="scraped"}') == 25
        )
        with prometheus(workdir, http_port) as api:
            _wait("the broker's target up", lambda: target_up(api))
            got = _wait(
                "messages in queried",
                lambda: query(
                    api, 'kafka_server_brokertopicmetrics_messagesin_total{topic="scraped"}'
                ),
            )
            assert got == 25
            assert (
                query(api, 'hyperkafka_signed_blocks{topic="scraped"}') == 25
            )  # one batch per record
            assert query(api, "kafka_controller_kafkacontroller_activecontrollercount") == 1
            assert (
                query(api, 'sum(kafka_network_requestmetrics_requests_total{request="Produce"})')
                == 25
            )
            groups = _wait("the rules loaded", lambda: api("rules", None)["groups"])
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) >= 10 and all(r["health"] == "ok" for r in rules), rules
            assert not [a for a in api("alerts", None)["alerts"] if a["state"] == "firing"]
            # every query of the shipped Grafana dashboard parses and finds its series
            dashboard = json.loads((ROOT / "docker" / "grafana" / "hyperkafka.json").read_text())
            for panel in dashboard["panels"]:
                for target in panel["targets"]:
                    expr = (
                        target["expr"].replace("$instance", ".*").replace("$__rate_interval", "1m")
                    )
                    api("query", {"query": expr})  # (asserts status success)
            rate = dashboard["panels"][2]["targets"][0]["expr"]
            rate = rate.replace("$instance", ".*").replace("$__rate_interval", "1m")
            _wait("a rate of the dashboard over two scrapes", lambda: query(api, rate) is not None)
    finally:
        assert b.stop() == 0, b.log_tail()


def _cluster_properties(path: Path, node_id: int, etcd: EtcdServer, rport: int) -> Path:
    path.write_text(
        textwrap.dedent(f"""\
        node.id={node_id}
        hyperkafka.cluster.etcd.endpoints={etcd.endpoint}
        hyperkafka.replication.listen=127.0.0.1:{rport}
        replica.lag.time.max.ms=3000
        broker.session.timeout.ms=4000
        """)
    )
    return path


def _promtool_series(before: str, after: str, name: str) -> str:
    """A promtool unit test of UnderReplicatedPartitions whose input is `name` as broker
    1 reported it in two real scrapes (before the kill for a minute, then after)."""
    v0, v1 = sample(before, name), sample(after, name)
    assert v0 is not None and v1 is not None
    return textwrap.dedent(f"""\
        rule_files: [{json.dumps(str(RULES))}]
        evaluation_interval: 5s
        tests:
          - interval: 5s
            input_series:
              - series: '{name}{{instance="b1",job="hyperkafka"}}'
                values: '{v0:g}x12 {v1:g}x12'
            alert_rule_test:
              - eval_time: 55s
                alertname: UnderReplicatedPartitions
                exp_alerts: []
              - eval_time: 100s
                alertname: UnderReplicatedPartitions
                exp_alerts:
                  - exp_labels: {{severity: warning, instance: b1, job: hyperkafka}}
                    exp_annotations:
                      summary: "Kafka under replicated partitions"
                      description: "There are {v1:g} under replicated partitions on b1"
        """)


@pytest.mark.timeout(240)
def test_killed_mirror_fires_under_replicated_alert(workdir: Path) -> None:
    promtool = _tool("promtool")
    _tool("prometheus")
    harness.require(etcd_binary() is not None, "etcd (apt-get install -y etcd-server)")
    etcd = EtcdServer(workdir / "etcd")
    etcd.start()
    ports = [harness.free_port() for _ in range(2)]
    http_port = harness.free_port()
    brokers: list[Broker] = []
    for i in range(2):
        props = _cluster_properties(
            workdir / f"b{i + 1}.properties", i + 1, etcd, harness.free_port()
        )
        extra = ["--config", str(props)]
        if i == 0:
            extra += ["--http-listen", f"127.0.0.1:{http_port}"]
        brokers.append(harness.new_broker(workdir / f"broker-{i + 1}", port=ports[i], extra=extra))
    try:
        for b in brokers:
            b.start()
        leader, mirror = brokers
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": leader.bootstrap})
        # Replicas [1, 2]: broker 1 (the scraped one) writes, broker 2 mirrors it.
        topic = NewTopic("watched", 2, replica_assignment=[[1, 2], [1, 2]])
        for f in admin.create_topics([topic], operation_timeout=10).values():
            f.result(30)
        _produce(leader.bootstrap, "watched", 5)
        name = "kafka_server_replicamanager_underreplicatedpartitions"

        def caught_up(text: str) -> bool:
            # broker 2 mirrors broker 1: its channels report what it verified, nothing left
            verified = labelled(text, "hyperkafka_mirror_verified_blocks")
            lag = labelled(text, "hyperkafka_mirror_lag_blocks")
            return (
                sample(text, name) == 0
                and len(verified) == 1
                and sum(verified.values()) >= 5
                and list(lag.values()) == [0]
            )

        before = _wait("broker 2 in sync", lambda: scrape_if(http_port, caught_up))
        with prometheus(workdir, http_port) as api:
            _wait("the broker's target up", lambda: target_up(api))
            _wait("the rule evaluated", lambda: query(api, name) == 0)
            assert mirror.proc is not None
            os.kill(mirror.proc.pid, signal.SIGKILL)
            mirror.proc.wait()
            mirror.proc = None
            after = _wait(
                "broker 1 reports under-replicated partitions",
                lambda: scrape_if(http_port, lambda t: sample(t, name) == 2),
                timeout=60,
            )

            def firing() -> list[Any]:
                return [
                    a
                    for a in api("alerts", None)["alerts"]
                    if a["labels"]["alertname"] == "UnderReplicatedPartitions"
                    and a["state"] == "firing"
                ]

            alerts = _wait("UnderReplicatedPartitions firing in Prometheus", firing, timeout=90)
            assert alerts[0]["labels"]["instance"] == f"127.0.0.1:{http_port}"
            assert float(alerts[0]["value"]) == 2
        unit = workdir / "from_scrapes_test.yml"
        unit.write_text(_promtool_series(before, after, name))
        out = subprocess.run(
            [promtool, "test", "rules", str(unit)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        for b in brokers:
            b.kill()
        etcd.stop()

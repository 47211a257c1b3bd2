"""The Docker image and the compose demo (docker/), with a real Docker engine.

`test_compose_demo` starts (or uses) an engine (compat_tests/docker_engine.py), runs
docker/build (base image from Debian's packages when missing, wheels on the host, an image
build with no network), brings up docker/compose.yaml under its own project name and host
ports, and checks, from the host through the published 127.0.0.1 ports:
- a host client (kafka-python, and kcat where installed) produces to the writer and
  consumes from the writer and both mirrors (the EXTERNAL listeners advertise 127.0.0.1);
- the demo producer writes and the demo consumer prints through mirror-1 (INTERNAL names);
- with the writer stopped for longer than the old producer's 30 s, both mirrors still
  serve everything they hold and the producer container keeps running;
- once the writer is started again, the producer resumes with the next record number and
  the mirrors follow it: every record number from 0 on is in mirror-1, none missing.
Everything it started is removed by exact name (`compose down -v` of its project); the
images stay cached; a dockerd it started is stopped.

The cheap test at the end checks the image entrypoint's command line.

A warm run (an engine installed, the base image cached) takes about 2 minutes and runs
whenever the compat suite does; a cold one (installing docker.io, making the base image
from Debian's packages: about 7 minutes) runs only with scripts/test --docker-cold
(HK_DOCKER_COLD=1), and always under CI=true. HK_DOCKER_TEST=0 (scripts/test --no-docker)
skips it. Without root or a running engine it is skipped (a failure under CI=true).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.docker_engine import (
    EngineUnavailable,
    compose_command,
    docker_engine,
    engine_answers,
)
from compat_tests.harness import ROOT

PROJECT = "hyperkafka-compose-test"
IMAGE = "hyperkafka:compose-test"


class Demo:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.compose = [
            *compose_command(env),
            "-p",
            PROJECT,
            "-f",
            str(ROOT / "docker" / "compose.yaml"),
        ]
        self.ports = {name: harness.free_port() for name in ("writer", "mirror-1", "mirror-2")}
        self.env.update(
            HYPERKAFKA_IMAGE=IMAGE,
            HK_WRITER_PORT=str(self.ports["writer"]),
            HK_MIRROR1_PORT=str(self.ports["mirror-1"]),
            HK_MIRROR2_PORT=str(self.ports["mirror-2"]),
        )
        self.timings: dict[str, float] = {}

    def run(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            [*self.compose, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return proc.stdout

    def logs(self, *services: str, tail: int = 40) -> str:
        proc = subprocess.run(
            [*self.compose, "logs", "--no-color", f"--tail={tail}", *services],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        return proc.stdout + proc.stderr

    def container_state(self, service: str) -> str:
        cid = self.run("ps", "-q", service).strip()
        proc = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Status}}", cid],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return proc.stdout.strip()

    def bootstrap(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"


def _base_tag() -> str:
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith("ARG BASE="):
            return line.split("=", 1)[1]
    raise AssertionError("docker/Dockerfile pins no ARG BASE")


def _cold_skip(why: str) -> None:
    pytest.skip(
        f"Docker compose demo: {why}; a cold run (about 7 minutes: docker.io, the base image "
        "from Debian's packages, the image) needs scripts/test --docker-cold or HK_DOCKER_COLD=1"
    )


@pytest.fixture
def demo() -> Iterator[Demo]:
    if os.environ.get("HK_DOCKER_TEST") == "0":
        pytest.skip("HK_DOCKER_TEST=0")
    # A warm run (engine installed, base image cached) always runs; a cold one only when
    # asked for, and always under CI=true (a fresh machine has no cache to be warm from).
    cold_ok = os.environ.get("HK_DOCKER_COLD") == "1" or harness.IN_CI
    if not cold_ok and shutil.which("dockerd") is None and not engine_answers(dict(os.environ)):
        _cold_skip("Docker is not installed")
    t0 = time.monotonic()
    try:
        engine = docker_engine()
        env = engine.__enter__()
    except EngineUnavailable as exc:
        harness.require(False, f"Docker: {exc}")
        raise
    try:
        inspect = ["docker", "image", "inspect", _base_tag()]
        if not cold_ok and subprocess.run(inspect, env=env, capture_output=True).returncode != 0:
            _cold_skip(f"{_base_tag()} is not cached")
        d = Demo(env)
        d.timings["engine"] = time.monotonic() - t0
        d.run("down", "-v", "--remove-orphans")  # leftovers of an interrupted run, by name
        yield d
    finally:
        try:
            if "d" in locals():
                d.run("down", "-v", "--remove-orphans", "--timeout", "20")
        finally:
            engine.__exit__(None, None, None)


def _values(bootstrap: str, topic: str, until: int, timeout: float = 60) -> list[bytes]:
    """Every record value of topic/0 at offsets [0, until), read with kafka-python."""
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 0)
    deadline = time.monotonic() + timeout
    c = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, consumer_timeout_ms=1000
    )
    try:
        while not c.partitions_for_topic(topic):
            assert time.monotonic() < deadline, f"{bootstrap} never showed topic {topic}"
            time.sleep(0.5)
            c.topics()
        c.assign([tp])
        c.seek(tp, 0)
        out: list[bytes] = []
        while len(out) < until:
            assert time.monotonic() < deadline, (
                f"{bootstrap} served {len(out)} of {until} records of {topic}"
            )
            for m in c:
                assert m.offset == len(out), (
                    f"{bootstrap}: offset {m.offset} after {len(out)} records"
                )
                out.append(m.value)
                if len(out) >= until:
                    break
        return out
    finally:
        c.close()


def _end_offset(bootstrap: str, topic: str) -> int:
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, 0)
    c = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        if not c.partitions_for_topic(topic):
            return 0
        return int(c.end_offsets([tp])[tp])
    finally:
        c.close()


def _wait(what: str, check: Any, timeout: float, demo: Demo, *services: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (after {timeout:.0f} s)\n{demo.logs(*services)}", pytrace=False)
        time.sleep(1)


@pytest.mark.timeout(1200)
@pytest.mark.matrix(
    "docker compose demo: host clients, mirrors without the writer, producer resumes",
    client="kafka-python",
)
def test_compose_demo(demo: Demo) -> None:
    from kafka import KafkaProducer

    t = time.monotonic()
    env = dict(demo.env, HK_IMAGE=IMAGE, HK_PYTHON=sys.executable)
    proc = subprocess.run(
        [str(ROOT / "docker" / "build")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    demo.timings["build"] = time.monotonic() - t

    t = time.monotonic()
    demo.run("up", "-d")
    demo.timings["up"] = time.monotonic() - t
    writer, m1, m2 = (demo.bootstrap(s) for s in ("writer", "mirror-1", "mirror-2"))

    # A host client through the published ports: the writer's EXTERNAL listener must
    # advertise 127.0.0.1:PORT, or the client would be sent to "writer:9092" and fail.
    p = KafkaProducer(bootstrap_servers=writer, acks="all")
    for i in range(50):
        p.send("host-check", b"host record %d" % i)
    p.flush(timeout=60)
    p.close()
    want = [b"host record %d" % i for i in range(50)]
    assert _values(writer, "host-check", 50) == want
    assert _values(m1, "host-check", 50) == want
    assert _values(m2, "host-check", 50) == want
    kcat, why = harness.find_kcat("old")
    harness.require(kcat is not None, why)
    assert kcat is not None
    out = kcat.run(
        ["-b", m2, "-C", "-t", "host-check", "-o", "beginning", "-c", "50", "-e", "-q"], timeout=60
    )
    assert out.stdout.split(b"\n")[:50] == want, out.stdout[-500:]

    # The demo producer and consumer (container names: writer:9092, mirror-1:9092).
    _wait(
        "the demo producer never wrote 5 records",
        lambda: _end_offset(writer, "demo") >= 5,
        90,
        demo,
        "producer",
        "writer",
    )
    _wait(
        "the demo consumer printed nothing from mirror-1",
        lambda: "mirror-1:9092 offset 2: demo record 2" in demo.logs("consumer", tail=1000),
        90,
        demo,
        "consumer",
        "mirror-1",
    )

    # The writer stops for longer than the old producer lived without it (30 s).
    demo.run("stop", "writer")
    stopped = time.monotonic()
    held = _end_offset(m1, "demo")
    assert held >= 5
    for mirror in (m1, m2):
        values = _values(mirror, "demo", held)
        assert values == [b"demo record %d" % i for i in range(held)], (
            f"{mirror}: {values[:5]!r}..."
        )
    time.sleep(max(0.0, 40 - (time.monotonic() - stopped)))
    assert demo.container_state("producer") == "running", demo.logs("producer")
    assert "not acknowledged yet" in demo.logs("producer", tail=5), demo.logs("producer")
    assert _end_offset(m2, "demo") == held  # nothing new without the writer
    demo.timings["writer stopped"] = time.monotonic() - stopped

    demo.run("start", "writer")
    restarted = time.monotonic()
    _wait(
        "the producer did not resume through the restarted writer into mirror-1",
        lambda: _end_offset(m1, "demo") >= held + 5,
        120,
        demo,
        "producer",
        "writer",
        "mirror-1",
    )
    demo.timings["resumed"] = time.monotonic() - restarted
    assert "writer back after" in demo.logs("producer", tail=1000), demo.logs("producer")
    n = _end_offset(m1, "demo")
    numbers = [int(v.split()[-1]) for v in _values(m1, "demo", n)]
    # No record number is missing; one whose answer was lost in the restart may be stored
    # twice (the demo producer is not idempotent), never out of order.
    assert numbers == sorted(numbers) and set(numbers) == set(range(numbers[-1] + 1)), numbers
    _wait(
        "mirror-2 did not follow the restarted writer",
        lambda: _end_offset(m2, "demo") >= held + 5,
        60,
        demo,
        "mirror-2",
    )
    print(
        "docker demo timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in demo.timings.items()),
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------- entrypoint


def _entrypoint() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "hk_docker_entrypoint", ROOT / "docker" / "entrypoint.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_entrypoint_execs_the_broker_and_translates_nothing() -> None:
    # `hyperkafka serve` reads KAFKA_* itself (broker/tests/test_config_sources.py)
    cmd = _entrypoint().command
    env = {"KAFKA_LOG_DIRS": "/data", "KAFKA_HEAP_OPTS": "-Xmx1g", "KAFKA_NUM_PARTITIONS": "3"}
    assert cmd([], env) == ["hyperkafka", "serve"]
    assert cmd(["serve", "--log-level", "DEBUG"], env) == [
        "hyperkafka",
        "serve",
        "--log-level",
        "DEBUG",
    ]
    assert cmd(["verify"], env) == ["hyperkafka", "verify", "--data-dir", "/data"]
    assert cmd(["keys", "--data-dir", "/x"], env) == ["hyperkafka", "keys", "--data-dir", "/x"]
    assert cmd(["keys"], {}) == ["hyperkafka", "keys"]
    assert cmd(["bash", "-c", "true"], env) == ["bash", "-c", "true"]

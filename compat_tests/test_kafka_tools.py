"""`scripts/kafka-tools NAME ARGS...`: Apache Kafka's own tools by their usual names.

Runs the script as a user does (a child process, stdin and stdout its own) against a real
broker process: kafka-topics, the console producer and consumer, kafka-consumer-groups,
kafka-configs. Checks that every name it offers runs a class that is in the pinned jars,
that a wrong name is one `hyperkafka:` line, and that the first use fetches the jars (in a
copy of the few files the script needs, so the shared jar folder is never touched).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.harness import ROOT, Broker, new_broker, require
from compat_tests.java_tools import JAVA_DIR, KAFKA_TOOLS, require_java

SCRIPT = ROOT / "scripts" / "kafka-tools"


def kafka_tools(
    *args: str, stdin: bytes | None = None, script: Path = SCRIPT, timeout: float = 180
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(script), *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def lib() -> Path:
    return require_java()


@pytest.fixture(scope="module")
def hk(lib: Path) -> Iterator[Broker]:
    with tempfile.TemporaryDirectory(prefix="hk-kafka-tools-") as tmp:
        broker = new_broker(Path(tmp))
        broker.start()
        try:
            yield broker
        finally:
            code = broker.stop()
        assert code == 0, broker.log_tail()


def test_every_tool_name_runs_a_class_in_the_pinned_jars(lib: Path) -> None:
    classes: set[str] = set()
    for jar in lib.glob("*.jar"):
        with zipfile.ZipFile(jar) as z:
            classes.update(
                n[: -len(".class")].replace("/", ".") for n in z.namelist() if n.endswith(".class")
            )
    missing = {name: cls for name, cls in KAFKA_TOOLS.items() if cls not in classes}
    assert not missing
    for name in (
        "kafka-topics",
        "kafka-console-producer",
        "kafka-console-consumer",
        "kafka-consumer-groups",
        "kafka-configs",
    ):
        assert name in KAFKA_TOOLS


def test_the_usual_tools_against_a_broker(hk: Broker) -> None:
    b = hk.bootstrap
    made = kafka_tools(
        "kafka-topics",
        "--bootstrap-server",
        b,
        "--create",
        "--topic",
        "tools-t",
        "--partitions",
        "2",
    )
    assert made.returncode == 0, made.stderr.decode()
    listed = kafka_tools(
        "kafka-topics.sh", "--bootstrap-server", b, "--list"
    )  # the .sh name works too
    assert "tools-t" in listed.stdout.decode().split()
    sent = kafka_tools(
        "kafka-console-producer",
        "--bootstrap-server",
        b,
        "--topic",
        "tools-t",
        stdin=b"one\ntwo\nthree\n",
    )
    assert sent.returncode == 0, sent.stderr.decode()
    got = kafka_tools(
        "kafka-console-consumer",
        "--bootstrap-server",
        b,
        "--topic",
        "tools-t",
        "--group",
        "tools-g",
        "--from-beginning",
        "--max-messages",
        "3",
        "--timeout-ms",
        "60000",
    )
    assert got.returncode == 0, got.stderr.decode()
    assert sorted(got.stdout.decode().split()) == ["one", "three", "two"]
    groups = kafka_tools(
        "kafka-consumer-groups", "--bootstrap-server", b, "--describe", "--group", "tools-g"
    )
    assert groups.returncode == 0, groups.stderr.decode()
    assert "tools-t" in groups.stdout.decode()
    configs = kafka_tools(
        "kafka-configs",
        "--bootstrap-server",
        b,
        "--describe",
        "--all",
        "--entity-type",
        "topics",
        "--entity-name",
        "tools-t",
    )
    assert configs.returncode == 0, configs.stderr.decode()
    assert "retention.ms=604800000" in configs.stdout.decode()


def test_a_wrong_name_is_one_line() -> None:
    res = kafka_tools("kafka-nope", "--help")
    assert res.returncode == 2
    assert res.stdout == b""
    lines = res.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyperkafka: no Kafka tool named 'kafka-nope'")
    usage = kafka_tools("--help")
    assert usage.returncode == 0 and "kafka-console-consumer" in usage.stdout.decode().split()


def test_first_use_fetches_the_pinned_jars(lib: Path, tmp_path: Path) -> None:
    require(shutil.which("mvn") is not None, "mvn not installed (apt-get install maven)")
    # A checkout of just what the script needs, with no jars yet.
    for rel in ("scripts/kafka-tools", "compat_tests/java_tools.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    shutil.copytree(JAVA_DIR, tmp_path / "compat_tests" / "java")
    env = {k: v for k, v in os.environ.items() if k not in ("HK_JAVA_LIB", "CI")}
    res = subprocess.run(
        [str(tmp_path / "scripts" / "kafka-tools"), "kafka-topics", "--version"],
        capture_output=True,
        timeout=600,
        check=False,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr.decode()[-3000:]
    fetched = tmp_path / "compat_tests" / ".tools" / "java-lib"
    assert sorted(p.name for p in fetched.glob("kafka-tools-*.jar")) == sorted(
        p.name for p in lib.glob("kafka-tools-*.jar")
    )
    assert (
        res.stdout.decode()
        .strip()
        .startswith(
            next(lib.glob("kafka-clients-*.jar"))
            .name.removeprefix("kafka-clients-")
            .removesuffix(".jar")
        )
    )

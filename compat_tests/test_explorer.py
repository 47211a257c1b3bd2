"""The explorer page (broker/explorer.py, broker/static/) in headless Chromium.

Debian's `chromium`, driven by playwright-core from npm (explorer/package.json; no
browser of Playwright's own is downloaded); scripts/test installs both. A broker with
`--http-listen` gets records produced by kafka-python and a consumer group's commit; the
page (explorer/browser_test.mjs) shows the topic, its signed head and the group's lag,
and verifies a record in the browser with hypercore-crypto: the node's signed catalog
against the node key (taken from the node, then pinned), the partition's archive key
from it, the inclusion proof against that. A wrong pinned node key, a catalog block with
one byte changed, a proof whose batch has one byte changed and one whose proof node has
one byte changed (each served by intercepting the page's request) show as FAILED.

The same run takes docs/explorer.png when HK_EXPLORER_SCREENSHOT=1 (scripts/explorer-shot).

A second test checks that the committed bundle (broker/static/explorer.js) is what
esbuild builds from explorer/ with the locked packages: the artefact cannot drift from
its source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from compat_tests import harness
from compat_tests.harness import ROOT

EXPLORER = ROOT / "explorer"
BUNDLE = ROOT / "broker" / "static" / "explorer.js"

PRODUCE_AND_COMMIT = textwrap.dedent(
    """
    import sys
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.structs import OffsetAndMetadata
    bootstrap, topic = sys.argv[1], sys.argv[2]
    p = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    for i in range(6):  # one batch each: the proofs have nodes
        p.send(topic, key=b"k%d" % i, value=b"explorer-record-%d" % i).get(timeout=20)
    p.close()
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id="explorer-group", enable_auto_commit=False)
    c.commit({TopicPartition(topic, 0): OffsetAndMetadata(2, "", -1)})
    c.close()
    """
)


def _node_tools() -> tuple[str, str]:
    node = shutil.which("node")
    harness.require(node is not None, "node is not installed")
    chromium = os.environ.get("HK_CHROMIUM") or shutil.which("chromium")
    harness.require(chromium is not None, "chromium not installed (apt-get install -y chromium)")
    harness.require(
        (EXPLORER / "node_modules" / "playwright-core").exists(),
        "playwright-core missing: run `npm ci` in explorer/ (scripts/test does it)",
    )
    assert node is not None and chromium is not None
    return node, chromium


def _wait_high_watermark(http_port: int, topic: str, want: int) -> None:
    url = f"http://127.0.0.1:{http_port}/v1/topics"
    deadline = time.monotonic() + 30
    seen: list[int] = []
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as r:
            doc = json.load(r)
        seen = [
            p["high_watermark"]
            for t in doc["topics"]
            if t["topic"] == topic
            for p in t["partitions"]
        ]
        if seen == [want]:
            return
        time.sleep(0.3)
    raise AssertionError(f"{topic} at {seen} on the mirror, want [{want}]")


def _browse(http_port: int, topic: str, shot: Path | None = None, pin: str = "") -> dict[str, Any]:
    node, chromium = _node_tools()
    url = f"http://127.0.0.1:{http_port}/"
    run = subprocess.run(
        [node, str(EXPLORER / "browser_test.mjs"), url, topic, "4", *([str(shot)] if shot else [])],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=EXPLORER,
        env=dict(os.environ, HK_CHROMIUM=chromium, HK_PIN_KEY=pin),
    )
    assert run.returncode == 0, run.stderr
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    assert not out["errors"], out["errors"]
    return out


@pytest.mark.timeout(120)
@pytest.mark.matrix("explorer: records verify in Chromium, tampered proofs fail", client="chromium")
def test_explorer_verifies_in_the_browser(workdir: Path) -> None:
    _node_tools()
    http_port = harness.free_port()
    b = harness.new_broker(workdir / "broker", extra=("--http-listen", f"127.0.0.1:{http_port}"))
    topic = "explored"
    try:
        b.start()
        subprocess.run(
            [sys.executable, "-c", PRODUCE_AND_COMMIT, b.bootstrap, topic],
            check=True,
            timeout=60,
            cwd=ROOT,
        )
        shot = ROOT / "docs" / "explorer.png" if os.environ.get("HK_EXPLORER_SCREENSHOT") else None
        out = _browse(http_port, topic, shot)
    finally:
        b.stop()
    row = next(r for r in out["topics"] if r[0] == topic)
    assert row[1:5] == ["0", "0", "6", "6"]  # partition, log start, high watermark, signed length
    assert len(row[5]) == len(row[7]) == 64 and len(row[6]) == 136  # root, signature, key in full
    assert len(out["nodeKey"]) == 64
    assert ["explorer-group", "Empty", topic, "0", "2", "6", "4"] in out["groups"]
    for name in ("honest", "pinned"):
        assert out[name]["ok"], out[name]
        assert out[name]["verdict"].startswith("VERIFIED"), out[name]
        assert out[name]["records"] == [["4", "k4", "explorer-record-4"]]
    assert "pin the writer" in out["honest"]["verdict"]
    assert "pin the writer" not in out["pinned"]["verdict"]
    assert out["proofNodes"] > 0
    for name in ("wrongKey", "tamperedCatalog", "tamperedBatch", "tamperedNode"):
        assert not out[name]["ok"], out[name]
        assert out[name]["verdict"].startswith("FAILED"), out[name]
    assert "not signed by the trusted node key" in out["wrongKey"]["verdict"]
    assert "not signed by the trusted node key" in out["tamperedCatalog"]["verdict"]


@pytest.mark.timeout(120)
@pytest.mark.matrix(
    "explorer: a mirror's page verifies against the writer's node key", client="chromium"
)
def test_a_mirrors_page_verifies_against_the_writers_node_key(workdir: Path) -> None:
    """The page of a mirror (which holds no key of the topic): a record verifies with the
    WRITER's node key pinned (`hyperkafka keys` on the writer), through the mirror's copy
    of the writer's signed catalog; the mirror's own node key does not."""
    _node_tools()
    rport, http_port = harness.free_port(), harness.free_port()
    writer = harness.new_broker(
        workdir / "writer", extra=("--replication-listen", f"127.0.0.1:{rport}")
    )
    mirror = harness.new_broker(
        workdir / "mirror",
        extra=(
            "--mirror",
            writer.bootstrap,
            "--http-listen",
            f"127.0.0.1:{http_port}",
            "--no-auto-create",
        ),
    )
    topic = "copied"
    try:
        writer.start()
        assert writer.data_dir is not None
        keys = subprocess.run(
            [sys.executable, "-m", "broker", "keys", "--data-dir", str(writer.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=True,
        )
        writer_key = keys.stdout.split("\n")[0].split("\t")[1]
        subprocess.run(
            [sys.executable, "-c", PRODUCE_AND_COMMIT, writer.bootstrap, topic],
            check=True,
            timeout=60,
            cwd=ROOT,
        )
        mirror.start()
        _wait_high_watermark(http_port, topic, 6)
        out = _browse(http_port, topic, pin=writer_key)
    finally:
        mirror.stop()
        writer.stop()
    assert out["nodeKey"] != writer_key
    assert out["pinned"]["ok"] and out["pinned"]["records"] == [["4", "k4", "explorer-record-4"]]
    assert not out["pageNodeKey"]["ok"], out["pageNodeKey"]
    for name in ("tamperedCatalog", "tamperedBatch", "tamperedNode"):
        assert not out[name]["ok"], out[name]


def test_committed_bundle_is_built_from_its_source(tmp_path: Path) -> None:
    harness.require(shutil.which("node") is not None, "node is not installed")
    esbuild = EXPLORER / "node_modules" / ".bin" / "esbuild"
    harness.require(
        esbuild.exists(), "esbuild missing: run `npm ci` in explorer/ (scripts/test does it)"
    )
    pkg = json.loads((EXPLORER / "package.json").read_text())
    argv = pkg["scripts"]["build"].split()
    assert argv[0] == "esbuild"
    out = tmp_path / "explorer.js"
    argv = [
        str(esbuild),
        *(a for a in argv[1:] if not a.startswith("--outfile=")),
        f"--outfile={out}",
    ]
    subprocess.run(argv, check=True, cwd=EXPLORER, timeout=60, capture_output=True)
    assert out.read_bytes() == BUNDLE.read_bytes(), (
        "broker/static/explorer.js is stale: run `npm run build` in explorer/ and commit it"
    )

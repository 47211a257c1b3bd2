"""The explorer page (broker/explorer.py, broker/static/) in headless Chromium.

Debian's `chromium`, driven by playwright-core from npm (explorer/package.json; no
browser of Playwright's own is downloaded); scripts/test installs both. A broker with
`--http-listen` gets records produced by kafka-python and a consumer group's commit; the
page (explorer/browser_test.mjs) shows the topic, its signed head and the group's lag,
and verifies a record's inclusion proof in the browser with hypercore-crypto, both with
the key taken from the node and with it pinned. A wrong pinned key, a proof whose batch
has one byte changed, and one whose proof node has one byte changed (both served by
intercepting the page's request) each show as FAILED.

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
from pathlib import Path

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


@pytest.mark.timeout(120)
@pytest.mark.matrix("explorer: records verify in Chromium, tampered proofs fail", client="chromium")
def test_explorer_verifies_in_the_browser(workdir: Path) -> None:
    node, chromium = _node_tools()
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
        run = subprocess.run(
            [
                node,
                str(EXPLORER / "browser_test.mjs"),
                f"http://127.0.0.1:{http_port}/",
                topic,
                "4",
                *([str(shot)] if shot else []),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=EXPLORER,
            env=dict(os.environ, HK_CHROMIUM=chromium),
        )
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        b.stop()
    assert not out["errors"], out["errors"]
    row = next(r for r in out["topics"] if r[0] == topic)
    assert row[1:5] == ["0", "0", "6", "6"]  # partition, log start, high watermark, signed length
    assert len(row[5]) == len(row[7]) == 64 and len(row[6]) == 136  # root, signature, key in full
    assert len(out["nodeKey"]) == 64
    assert ["explorer-group", "Empty", topic, "0", "2", "6", "4"] in out["groups"]
    for name in ("honest", "pinned"):
        assert out[name]["ok"], out[name]
        assert out[name]["verdict"].startswith("VERIFIED"), out[name]
        assert out[name]["records"] == [["4", "k4", "explorer-record-4"]]
    assert "pin it" in out["honest"]["verdict"] and "pin it" not in out["pinned"]["verdict"]
    assert out["proofNodes"] > 0
    for name in ("wrongKey", "tamperedBatch", "tamperedNode"):
        assert not out[name]["ok"], out[name]
        assert out[name]["verdict"].startswith("FAILED"), out[name]
    assert "signer" in out["wrongKey"]["verdict"]


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

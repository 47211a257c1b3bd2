"""Every shell block of README.md and docs/*.md runs, as written, against real processes.

A page's blocks run in order, each in `bash -e -o pipefail` in a fresh copy of the
checkout (its .venv and compat_tests/.tools are the real ones), so that the data dirs a
page makes stay there. An HTML comment on the line before a block says how to run it:

- none: run to the end; it must exit 0;
- `<!-- runs until Ctrl-C; ready at HOST:PORT -->`: a command that serves (a broker, a
  mirror) runs in the background; the next block starts once HOST:PORT answers a Kafka
  ApiVersions request; when the page is done it gets SIGINT (a terminal's Ctrl-C) and must
  exit 0 without a traceback;
- `<!-- not run: REASON -->`: not run. Such blocks must stay rare (a test counts them).

The addresses a page names (127.0.0.1:PORT, localhost:PORT, also inside scripts/serve)
are mapped to free ports for the run, so a page can say 9092 and the test still runs
beside anything else.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from compat_tests.harness import ROOT, api_versions_v0_probe, free_port

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!--\s*(.*?)\s*-->\s*$")
READY = re.compile(r"runs until Ctrl-C; ready at (\S+):(\d+)$")
ADDRESS = re.compile(r"\b(127\.0\.0\.1|localhost):(\d{4,5})\b")
NOT_RUN_SHARE = 0.25  # at most this share of all shell blocks may be marked "not run"


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    mark: str  # the comment before the fence, "" if none

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> bool:
        return self.mark.startswith("not run:")


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        out.append(
            Block(
                page,
                text.count("\n", 0, m.start()) + 1,
                m.group(1),
                m.group(2),
                mark.group(1) if mark else "",
            )
        )
    return out


def shell_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELL]


def test_blocks_not_run_are_rare_and_say_why() -> None:
    every = [b for page in PAGES for b in shell_blocks(page)]
    assert len(every) >= 10, "the pages lost their examples?"
    skipped = [b for b in every if b.not_run]
    assert len(skipped) <= NOT_RUN_SHARE * len(every), [b.where for b in skipped]
    for b in every:
        assert (
            not b.mark
            or (b.not_run and len(b.mark) > len("not run: ") + 10)
            or READY.fullmatch(b.mark)
        ), f"{b.where}: unknown or empty marking {b.mark!r}"
    readme = shell_blocks(ROOT / "README.md")
    assert sum(not b.not_run for b in readme) >= 6, "the README tour has no runnable blocks?"


# Under pipefail a reader that stops early (grep -q, grep -m) fails the writer with
# SIGPIPE (curl exits 23) whenever the writer still had more than a pipe buffer to send:
# a block that passes or fails by timing.
EARLY_EXIT = re.compile(r"\|\s*grep\s+(-\w*[qm]\w*\b|--quiet|--silent|--max-count)")


def test_no_block_pipes_into_a_reader_that_stops_early() -> None:
    offenders = [
        f"{b.where}: {line.strip()}"
        for page in PAGES
        for b in shell_blocks(page)
        for line in b.text.splitlines()
        if EARLY_EXIT.search(line)
    ]
    assert not offenders, "read the whole input (grep without -q/-m), or not through a pipe: " + "; ".join(offenders)


def sandbox(tmp: Path) -> Path:
    """A copy of the checkout's files (not .git, not ignored ones) with the real .venv and tools."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    box = tmp / "checkout"
    for rel in listed.stdout.decode().split("\0"):
        src = ROOT / rel
        if not rel or not src.is_file() or rel.startswith("compat_tests/.tools"):
            continue
        (box / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, box / rel)
    (box / ".venv").symlink_to(ROOT / ".venv")
    tools = ROOT / "compat_tests" / ".tools"
    if tools.exists():
        (box / "compat_tests" / ".tools").symlink_to(tools.resolve())
    return box


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    todo = [b for b in shell_blocks(page) if not b.not_run]
    if not todo:
        pytest.skip(f"{page.name}: no runnable shell blocks")
    for tool in ("kcat", "java", "mvn"):
        if shutil.which(tool) is None and any(
            tool in b.text or "kafka-tools" in b.text for b in todo
        ):
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{tool} is required under CI for {page.name}")
            pytest.skip(f"{tool} not installed")
    box = sandbox(tmp_path)
    ports: dict[str, int] = {}

    def local(text: str) -> str:
        def swap(m: re.Match[str]) -> str:
            port = ports.setdefault(m.group(2), free_port())
            return f"{m.group(1)}:{port}"

        return ADDRESS.sub(swap, text)

    for b in todo:
        local(b.text)
    serve = box / "scripts" / "serve"
    serve.write_text(local(serve.read_text()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    env.pop("VIRTUAL_ENV", None)
    env["HK_NO_INSTALL"] = "1"  # the copy shares .venv: an install from it would repoint it
    running: list[tuple[Block, subprocess.Popen[bytes], Path]] = []
    try:
        for i, b in enumerate(todo):
            script = local(b.text)
            log = tmp_path / f"block-{i}.log"
            ready = READY.fullmatch(b.mark)
            if ready:
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        ["bash", "-e", "-o", "pipefail", "-c", script],
                        cwd=box,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                running.append((b, proc, log))
                host, port = ADDRESS.search(local(f"{ready.group(1)}:{ready.group(2)}")).groups()  # type: ignore[union-attr]
                deadline = time.monotonic() + 180
                while not api_versions_v0_probe(host, int(port)):
                    assert proc.poll() is None, (
                        f"{b.where} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
                    assert time.monotonic() < deadline, (
                        f"{b.where}: {host}:{port} did not answer\n{log.read_text()[-3000:]}"
                    )
                    time.sleep(0.2)
                continue
            res = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", script],
                cwd=box,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=600,
                check=False,
            )
            assert res.returncode == 0, (
                f"{b.where} exited {res.returncode}\n--- block\n{script}\n--- stdout\n{res.stdout.decode()[-3000:]}"
                f"\n--- stderr\n{res.stderr.decode()[-3000:]}"
            )
    finally:
        failures = []
        for b, proc, log in reversed(running):
            if proc.poll() is None:
                os.killpg(
                    proc.pid, signal.SIGINT
                )  # Ctrl-C, to the whole group as a terminal sends it
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
                failures.append(f"{b.where}: still running 60 s after Ctrl-C")
            text = log.read_text(errors="replace")
            if code not in (0, 130) or "Traceback" in text:
                failures.append(f"{b.where} ended with {code}:\n{text[-3000:]}")
    assert not failures, "\n".join(failures)


def test_properties_blocks_are_broker_configs(tmp_path: Path) -> None:
    """A `properties` block is a server.properties a reader copies as it is: the broker's
    own parser reads it, knows every key, and no value carries a trailing `# comment`
    (in a properties file that is part of the value)."""
    from broker.config import BrokerConfig, apply_properties, read_properties

    found = [b for page in PAGES for b in blocks(page) if b.lang == "properties"]
    assert found, "the pages lost their server.properties examples?"
    for b in found:
        conf = tmp_path / "server.properties"
        conf.write_text(b.text)
        props = read_properties(conf)
        for key, value in props.items():
            assert "#" not in value, f"{b.where}: {key}={value!r}: a comment after a value"
        apply_properties(BrokerConfig(), props)

"""pytest wiring for the compatibility tests: broker fixtures, timeouts, the result matrix.

Owns:
- `broker` (session): the broker under test. HK_COMPAT_BOOTSTRAP=host:port uses an external
  one; otherwise our broker is started as `python -m broker serve --data-dir <tmp> --listen
  127.0.0.1:<free port>` (or HK_COMPAT_BROKER_CMD, a template with {port} and {data_dir}),
  awaited until it answers ApiVersions, and stopped with SIGTERM at the end (exit 0 required).
- `fresh_broker` (function): a broker of its own for tests that stop and restart it.
- a per-test timeout: pytest-timeout's `@pytest.mark.timeout(seconds)` (setup and teardown
  included), DEFAULT_TIMEOUT for a test that names none (the unit tests' default in
  pyproject.toml is shorter). Its SIGALRM method suits these tests: they are synchronous
  and every client runs in a child process.
- the broker's log tail attached to every failed test that used a broker.
- `broker_log_check` (autouse): a test fails (at teardown) when a broker logged an internal
  error or a traceback while it ran, unless `@pytest.mark.broker_log_allows(pattern, ...)`
  names it (compat_tests/broker_logs.py); the session broker's own shutdown is checked too.
- a JSON results file (HK_COMPAT_RESULTS, default compat_tests/.tools/results.json) with one
  entry per test: client, scenario, outcome, seconds, and every matrix cell the collected
  tests fill (also with --collect-only); `python -m compat_tests.matrix` prints it.

Imports the standard library, pytest, compat_tests.harness and compat_tests.broker_logs only.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from compat_tests import broker_logs, harness
from compat_tests.harness import Broker, BrokerError

DEFAULT_TIMEOUT = 300


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "broker_log_allows(*patterns): this test provokes broker internal errors on purpose; "
        "the log records matching one of these regular expressions do not fail it",
    )
    config.addinivalue_line(
        "markers",
        "matrix(scenario, client=None): the cell this test fills in the client x scenario "
        "matrix; `scenario` may use {param} of the test's parameters; client defaults to "
        "the `client` parameter",
    )
    # kafka-python 3.0.12 loads its schemas through a deprecated importlib API.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:kafka.protocol.*")
    config.addinivalue_line("filterwarnings", "ignore:open_text is deprecated:DeprecationWarning")
    config.stash[_RESULTS] = {}
    config.stash[_CELLS] = {}
    config.stash[_EXTRA_ROWS] = []


_RESULTS = pytest.StashKey[dict[str, dict[str, Any]]]()
_CELLS = pytest.StashKey[dict[str, tuple[str, str]]]()
_EXTRA_ROWS = pytest.StashKey[list[dict[str, Any]]]()


# ---------------------------------------------------------------------------- brokers


@pytest.fixture(scope="session")
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    ext = harness.external_broker()
    if ext is not None:
        ext.start(timeout=15)
        print(f"\nusing external broker at {ext.bootstrap}", file=sys.stderr)
        yield ext
        return
    workdir = harness.tmp_workdir("hk-compat-")
    b = harness.new_broker(workdir)
    try:
        b.start()
    except BrokerError:
        b.kill()
        raise
    print(f"\nstarted broker pid {b.proc.pid if b.proc else '?'} at {b.bootstrap}", file=sys.stderr)
    try:
        yield b
    finally:
        # Its own row in the matrix: a teardown error alone would land on whichever test
        # happened to run last.
        row: dict[str, Any] = {
            "client": "broker",
            "scenario": "sigterm-exit-0",
            "outcome": "error",
            "seconds": 0.0,
        }
        _session_rows().append(row)
        if b.proc is not None and b.proc.poll() is not None:
            row.update(outcome="failed", message=f"died during the session: {b.proc.returncode}")
            raise BrokerError(
                f"broker died during the session with status {b.proc.returncode}\n" + b.log_tail()
            )
        started = time.monotonic()
        try:
            status = b.stop()
        except BrokerError as e:
            row.update(outcome="failed", message=str(e).splitlines()[0])
            raise
        row.update(seconds=round(time.monotonic() - started, 2))
        if status != 0:
            row.update(outcome="failed", message=f"exit status {status} after SIGTERM")
            raise BrokerError(f"broker exited {status} after SIGTERM (expected 0)\n" + b.log_tail())
        late = broker_logs.read_new([b.log_path]) if b.log_path is not None else []
        if late:
            row.update(outcome="failed", message=late[0].first_line()[:300])
            raise BrokerError(
                "the session broker logged internal errors after the last test:\n"
                + broker_logs.report(late)
            )
        row.update(outcome="passed")
        if request.session.testsfailed == 0 and not os.environ.get("HK_COMPAT_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"\nbroker data and log kept in {workdir}", file=sys.stderr)


def _session_rows() -> list[dict[str, Any]]:
    assert _config is not None
    return _config.stash[_EXTRA_ROWS]


@pytest.fixture
def fresh_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker only this test uses, restartable on the same data dir and port."""
    if harness.external_broker() is not None and not os.environ.get("HK_COMPAT_BROKER_CMD"):
        harness.require(
            not harness.IN_CI,
            "HK_COMPAT_BOOTSTRAP names an external broker that the harness cannot restart "
            "(set HK_COMPAT_BROKER_CMD to let it start its own)",
        )
        pytest.skip("external broker cannot be restarted by the harness")
    b = harness.new_broker(tmp_path / "fresh")
    b.start()
    try:
        yield b
    finally:
        b.kill()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(autouse=True)
def broker_log_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if a broker logged an internal error while it ran (set up before, and
    so torn down after, the test's own brokers: their logs are complete by then)."""
    # What was logged between tests (the session broker starting) is checked here.
    before = broker_logs.read_new()
    if before:
        pytest.fail("before this test, " + broker_logs.report(before), pytrace=False)
    yield
    allowed = [p for m in request.node.iter_markers("broker_log_allows") for p in m.args]
    found = broker_logs.unexpected(broker_logs.read_new(), allowed)
    if found:
        pytest.fail(broker_logs.report(found), pytrace=False)


# ---------------------------------------------------------------------------- reporting


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT))
    cells = config.stash[_CELLS]
    if any("broker" in getattr(item, "fixturenames", ()) for item in items):
        cells["(session)"] = ("broker", "sigterm-exit-0")  # the `broker` fixture's own row
    for item in items:
        m = item.get_closest_marker("matrix")
        if m is None:
            continue
        params: dict[str, Any] = dict(getattr(getattr(item, "callspec", None), "params", {}))
        scenario = str(m.args[0] if m.args else m.kwargs["scenario"]).format(**params)
        client = m.kwargs.get("client") or params.get("client") or "-"
        cells[item.nodeid] = (str(client), scenario)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report: pytest.TestReport = yield
    if report.failed:
        funcargs = getattr(item, "funcargs", {})
        for name in ("broker", "fresh_broker"):
            b = funcargs.get(name)
            if isinstance(b, Broker):
                state = "running" if b.alive() else "NOT running"
                report.sections.append((f"{name} log tail ({b.bootstrap}, {state})", b.log_tail()))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _config
    if config is None:
        return
    results = config.stash[_RESULTS]
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.when == "call" and report.user_properties:
        # Figures a test measured (rebalance time, peer-suite counts) for the matrix.
        entry["measured"] = {str(k): v for k, v in report.user_properties}
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry.setdefault("message", _short(report))
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        if isinstance(report.longrepr, tuple):
            entry["message"] = str(report.longrepr[2])


def _short(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


_config: pytest.Config | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _config
    _config = session.config
    session.config.stash[_RESULTS]["__started__"] = {"time": time.time()}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    results = config.stash[_RESULTS]
    cells = config.stash[_CELLS]
    started = results.pop("__started__", {}).get("time", time.time())
    out = []
    for nodeid, entry in results.items():
        client, scenario = cells.get(nodeid, ("-", nodeid.split("::")[-1]))
        out.append({"nodeid": nodeid, "client": client, "scenario": scenario, **entry})
    out += [{"nodeid": "(session)", **row} for row in config.stash[_EXTRA_ROWS]]
    ext = harness.external_broker()
    doc = {
        "broker": ext.bootstrap if ext else os.environ.get("HK_COMPAT_BROKER_CMD", "hyperkafka"),
        "external": ext is not None,
        "ci": harness.IN_CI,
        "wall_seconds": round(time.time() - started, 1),
        "exitstatus": int(exitstatus),
        "tests": out,
        # Every matrix cell some collected test fills (before -k deselection), run or not:
        # compat_tests.matrix checks that each grid cell is tested or explained.
        "collected": sorted(set(cells.values())),
    }
    path = Path(os.environ.get("HK_COMPAT_RESULTS") or harness.TOOLS_DIR / "results.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))

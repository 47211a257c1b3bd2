"""Broker logs read for internal errors: a client that reconnects and retries hides a handler
that crashed, so the tests read what every broker they started logged.

Owns: the list of broker log files started by the harness (each read on from where the last
check stopped), and the test of a log record for an internal error: a record that says
"internal error" or carries a traceback. A test that provokes one on purpose names it with
`@pytest.mark.broker_log_allows(pattern, ...)` (regular expressions searched in the whole
record, traceback included); compat_tests/conftest.py fails every other test whose brokers
logged one.

Imports the standard library only (compat_tests.harness registers its brokers here).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# broker/cli.py's format: "%(asctime)s %(levelname)s %(name)s: %(message)s".
_RECORD_START = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", re.MULTILINE)
_INTERNAL = re.compile(r"internal error|Traceback \(most recent call last\)")

# Read position in each watched log, in the order the brokers were created.
_watched: dict[Path, int] = {}


@dataclass(frozen=True)
class Incident:
    """One log record that reports an internal error (with its traceback, if any)."""

    log: Path
    text: str

    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def watch(log_path: Path) -> None:
    """Check this broker log from now on (from its current end: an earlier broker's lines
    in a shared log were checked with that broker)."""
    if log_path not in _watched:
        _watched[log_path] = log_path.stat().st_size if log_path.exists() else 0


def incidents_in(text: str, log: Path = Path("-")) -> list[Incident]:
    """The records of `text` (whole records: each starts with its timestamp; lines before
    the first one, e.g. an interpreter's dying words, form one record) that report an
    internal error."""
    data = text.encode("utf-8", "replace")
    starts = [m.start() for m in _RECORD_START.finditer(data)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    bounds = [*starts, len(data)]
    found = []
    for a, b in itertools.pairwise(bounds):
        record = data[a:b].decode("utf-8", "replace").rstrip("\n")
        if _INTERNAL.search(record):
            found.append(Incident(log, record))
    return found


def read_new(paths: Iterable[Path] | None = None) -> list[Incident]:
    """Incidents logged since the last call, in every watched log (or only `paths`). A record
    still being written (no newline yet) waits for the next call."""
    found: list[Incident] = []
    for path in list(_watched) if paths is None else paths:
        offset = _watched.get(path, 0)
        if not path.exists():
            continue
        with path.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        _watched[path] = offset + end
        found += incidents_in(data[:end].decode("utf-8", "replace"), path)
    return found


def unexpected(found: Iterable[Incident], allowed: Iterable[str]) -> list[Incident]:
    """The incidents that no allowed pattern matches."""
    patterns = [re.compile(p) for p in allowed]
    return [i for i in found if not any(p.search(i.text) for p in patterns)]


def report(found: list[Incident]) -> str:
    lines = [f"{len(found)} internal error(s) logged by the broker:"]
    for i in found:
        lines.append(f"--- {i.log}\n{i.text[-3000:]}")
    return "\n".join(lines)

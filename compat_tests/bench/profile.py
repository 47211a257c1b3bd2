"""Summaries of py-spy `--format raw` profiles (collapsed stacks: `frame;frame;... count`).

Answers "where does the time of a request go": the share of samples whose stack passes
through each of a few phases of the broker (reading requests, decoding, the produce
handler, storage appends, commit/fsync/sign, encoding and sending replies), plus the top
functions by own time. Imports the standard library only.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

# A py-spy frame reads "function (path/module.py:line)"; the line is dropped when grouping.
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


def parse(text: str) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = tuple(_short(f) for f in stack.split(";"))
        stacks[frames] += int(count)
    return stacks


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    # Keep the last two path parts: "handlers/produce.py", "trio/_core/_run.py" -> "_core/_run.py".
    tail = "/".join(path.replace("\\", "/").split("/")[-2:])
    return f"{m.group('func')} ({tail})"


def thread_of(frames: tuple[str, ...]) -> str:
    """The thread a stack ran on ("MainThread", "worker"), from py-spy's --threads frame."""
    if frames and frames[0].startswith("thread ("):
        name = frames[0].split(":", 1)[-1].strip()
        # Trio renames a worker thread after the job it runs: they are one pool.
        return name if name == "MainThread" else "worker threads (trio.to_thread)"
    return "(all threads)"


def summarise(
    stacks: Counter[tuple[str, ...]],
    *,
    top: int = 12,
    rate: float | None = None,
    requests: int | None = None,
) -> str:
    """Shares of the (non-idle) samples per thread, and the top functions of each.

    With the sampling `rate` (Hz) and the number of Produce `requests` the profile covers,
    every share is also given as milliseconds per request.
    """
    total = sum(stacks.values())
    if not total:
        return "(no samples)"
    per_req = rate is not None and bool(requests)

    def share(n: int) -> str:
        pct = f"{100 * n / total:5.1f}%"
        if per_req:
            assert rate is not None and requests
            return f"{pct} {1000 * n / rate / requests:7.3f} ms/req"
        return pct

    threads: dict[str, Counter[tuple[str, ...]]] = {}
    for frames, n in stacks.items():
        threads.setdefault(thread_of(frames), Counter())[frames] += n
    lines = [f"{total} samples (non-idle)" + (f", {requests} Produce requests" if per_req else "")]
    for name, sub in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"\n{name}: {share(sum(sub.values()))}")
        own: Counter[str] = Counter()
        incl: Counter[str] = Counter()
        for frames, n in sub.items():
            if frames:
                own[frames[-1]] += n
            for f in set(frames):
                incl[f] += n
        lines.append("  own time (leaf frames):")
        lines += [f"    {share(n)}  {f}" for f, n in own.most_common(top)]
        ours = [(f, n) for f, n in incl.most_common() if _is_ours(f) and n / total >= 0.02]
        if ours:
            lines.append("  broker/storage functions, inclusive (>= 2% of all samples):")
            lines += [f"    {share(n)}  {f}" for f, n in ours[:top]]
    return "\n".join(lines)


def _file_of(frame: str) -> str:
    m = re.search(r"\(([^()]*)\)$", frame)
    return m.group(1) if m else frame


def _is_ours(frame: str) -> bool:
    f = _file_of(frame)
    return f.split("/")[0] in {"broker", "storage", "handlers", "protocol", "groups", "hypercore",
                               "replication"} or f.startswith(("node.py", "server.py", "log.py"))  # fmt: skip


def summarise_dir(directory: Path, rate: float, requests: dict[str, int]) -> str:
    """One summary per profile in `directory` (`requests`: file stem -> Produce requests)."""
    files = sorted(directory.glob("*.txt")) if directory.is_dir() else []
    files = [f for f in files if f.name != "summary.txt"]
    parts = []
    for path in files:
        stacks = parse(path.read_text(errors="replace"))
        head = f"== py-spy profile of hyperkafka, {path.stem} ({rate:g} Hz)"
        parts.append(head + "\n" + summarise(stacks, rate=rate, requests=requests.get(path.stem)))
    return "\n\n".join(parts) or "(no profiles recorded)"

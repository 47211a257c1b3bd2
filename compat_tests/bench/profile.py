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


def summarise(stacks: Counter[tuple[str, ...]], top: int = 25) -> str:
    total = sum(stacks.values())
    if not total:
        return "(no samples)"
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for frames, n in stacks.items():
        if frames:
            own[frames[-1]] += n
            files[_file_of(frames[-1])] += n
        for f in set(frames):
            incl[f] += n
    lines = [f"{total} samples"]
    lines.append("\nown time by file (leaf frame):")
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in files.most_common(15)]
    lines.append(f"\ntop {top} functions by own time:")
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines.append("\nbroker functions by inclusive time (>= 2%):")
    ours = [(f, n) for f, n in incl.most_common() if _is_ours(f) and n / total >= 0.02]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in ours[:40]]
    return "\n".join(lines)


def _file_of(frame: str) -> str:
    m = re.search(r"\(([^()]*)\)$", frame)
    return m.group(1) if m else frame


def _is_ours(frame: str) -> bool:
    f = _file_of(frame)
    return f.split("/")[0] in {"broker", "storage", "handlers", "protocol", "groups", "hypercore",
                               "replication"} or f.startswith(("node.py", "server.py", "log.py"))  # fmt: skip


def summarise_dir(directory: Path) -> str:
    """Every produce profile in `directory`, merged (one summary for the produce path)."""
    stacks: Counter[tuple[str, ...]] = Counter()
    files = sorted(directory.glob("produce-*.txt")) if directory.is_dir() else []
    for path in files:
        stacks.update(parse(path.read_text(errors="replace")))
    head = f"py-spy profile of hyperkafka during produce ({len(files)} file(s) merged)"
    return head + "\n" + summarise(stacks)

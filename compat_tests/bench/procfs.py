"""RSS and CPU time of a process and all its descendants, read from /proc (Linux only).

A broker may be a wrapper plus a worker (a JVM, a Python launcher around a Rust binary),
so every figure sums the whole tree under the pid we started. Imports the standard library
only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    rss_bytes: int
    cpu_seconds: float  # user + system, summed over the tree


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ")".
    return text[text.rindex(")") + 2 :].split()


def tree(root: int) -> list[int]:
    """`root` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def usage(root: int) -> Usage:
    rss = 0
    cpu = 0.0
    for pid in tree(root):
        fields = _stat_fields(pid)
        if fields is None:
            continue
        # After the name: state(0) ppid(1) ... utime(11) stime(12) ... rss(21), in pages.
        cpu += (int(fields[11]) + int(fields[12])) / TICKS
        rss += int(fields[21]) * PAGE
    return Usage(rss_bytes=rss, cpu_seconds=cpu)


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine since boot, every core summed, from
    /proc/stat: the share of the machine a run left idle tells a CPU-bound run from a
    latency-bound one."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / TICKS, sum(fields[:8]) / TICKS

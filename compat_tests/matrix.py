"""Print the client x scenario result matrix from the JSON file the compat tests write.

Usage: python -m compat_tests.matrix [RESULTS.json]   (default compat_tests/.tools/results.json)
Rows are scenarios, columns clients; a cell is PASS, FAIL, ERR (setup/teardown), SKIP or
"." where the pair is not tested. Failures are listed below with their first line.
Imports only the standard library.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CLIENT_ORDER = [
    "kcat-old",
    "kcat-new",
    "confluent",
    "kafka-python",
    "aiokafka",
    "kafkajs",
    "franz-go",
    "sarama",
    "raw-socket",
    "broker",
]
CELL = {"passed": "PASS", "failed": "FAIL", "error": "ERR", "skipped": "SKIP"}
RANK = {"error": 3, "failed": 2, "skipped": 1, "passed": 0}


def render(doc: dict[str, object]) -> str:
    every = list(doc.get("tests", []))  # type: ignore[call-overload]
    # Tests without a matrix cell (the harness's self-tests) count below but get no row.
    tests = [t for t in every if t["client"] != "-"]
    clients = sorted(
        {t["client"] for t in tests},
        key=lambda c: (CLIENT_ORDER.index(c) if c in CLIENT_ORDER else len(CLIENT_ORDER), c),
    )
    scenarios: list[str] = []
    for t in tests:
        if t["scenario"] not in scenarios:
            scenarios.append(t["scenario"])
    cells: dict[tuple[str, str], str] = {}
    for t in tests:
        key = (t["scenario"], t["client"])
        old = cells.get(key)
        if old is None or RANK[t["outcome"]] > RANK[old]:
            cells[key] = t["outcome"]
    width = max([len(s) for s in scenarios] + [8]) + 2
    colw = max([len(c) for c in clients] + [5]) + 2
    lines = [
        f"compat matrix against {doc.get('broker')} "
        f"({'external' if doc.get('external') else 'started by the harness'}), "
        f"{doc.get('wall_seconds')} s",
        ("scenario".ljust(width) + "".join(c.ljust(colw) for c in clients)).rstrip(),
    ]
    for s in scenarios:
        row = s.ljust(width)
        for c in clients:
            outcome = cells.get((s, c))
            row += (CELL[outcome] if outcome else ".").ljust(colw)
        lines.append(row.rstrip())
    counts: dict[str, int] = {}
    for t in every:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    lines.append(
        "tests: "
        + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    )
    measured = [t for t in every if t.get("measured")]
    if measured:
        lines.append("measured:")
    for t in measured:
        figures = ", ".join(f"{k}={v}" for k, v in t["measured"].items())
        lines.append(f"  {t['client']:<12} {t['scenario']:<28} {figures}")
    bad = [t for t in every if t["outcome"] in ("failed", "error", "skipped")]
    for t in bad:
        msg = str(t.get("message", "")).replace("\n", " ")[:160]
        lines.append(f"  {CELL[t['outcome']]:4} {t['client']:<12} {t['scenario']:<28} {msg}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    path = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / ".tools" / "results.json"
    if not path.exists():
        print(f"no compat results at {path}", file=sys.stderr)
        return 1
    print(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""Print the client x scenario result matrix from the JSON file the compat tests write.

Usage: python -m compat_tests.matrix [RESULTS.json]   (default compat_tests/.tools/results.json)

Two parts:
- the grid: scenarios every client could be asked (rows) x the client libraries and the
  Java tools (columns). A cell is PASS, FAIL, ERR (setup/teardown), SKIP, "n/a[k]" where
  the pair cannot or need not be run (footnote k, from NOT_APPLICABLE and NOTES below), or
  "." where it is neither tested nor explained;
- single-subject checks: scenarios of one tool, one peer suite or one broker feature
  (SINGLE_SUBJECT), listed with the clients that ran them, not as rows of n/a cells.

`problems(cells)` names every grid cell neither tested nor explained, and every explanation
that no longer fits (a cell explained as n/a that is tested, a single-subject scenario that
no test has); test_harness_selftest.py fails on any, so the matrix stays honest as tests
are added. Failures are listed below with their first line. Imports only the standard library.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable
from pathlib import Path

GRID_CLIENTS = [
    "kcat-old",
    "kcat-new",
    "confluent",
    "kafka-python",
    "aiokafka",
    "kafkajs",
    "franz-go",
    "sarama",
    "java-tools",
]
CELL = {"passed": "PASS", "failed": "FAIL", "error": "ERR", "skipped": "SKIP"}
RANK = {"error": 3, "failed": 2, "skipped": 1, "passed": 0}

# Scenarios that test one tool, one peer suite or one broker feature, not something every
# client can be asked: scenario (fnmatch pattern) -> why it has no row of its own.
SINGLE_SUBJECT: dict[str, str] = {
    "kgo-suite (allow-list)": "franz-go's own pkg/kgo integration tests",
    "kafka-python suite (allow-list)": "kafka-python's own integration tests",
    "console 10k keyed lines (*)": "kafka-console-producer and -consumer",
    "producer-perf *": "kafka-producer-perf-test",
    "consumer-perf *": "kafka-consumer-perf-test",
    "kafka-consumer-groups": "kafka-consumer-groups on an empty broker",
    "kafka-topics error exit": "kafka-topics' exit status",
    "metadata-list": "kcat -L's listing (the other clients list topics in admin-topics)",
    "kcat-G": "kcat's balanced consumer (-G)",
    "*vs Apache Kafka": "the Apache Kafka broker as a differential oracle",
    "hostile-*": "the broker's defences against raw bytes: no client library",
    "attack-*": "the attack suite (compat_tests/attack): raw bytes beside a good producer",
    "decode-bounds-*": "the codec's bounds walk against lying frames, on a raw socket",
    "memory-*": "the broker's memory budget against raw-socket floods",
    "stalled-connections": "the broker's defences against raw bytes: no client library",
    "apiversions-unknown-version": "the broker's ApiVersions fallback, on a raw socket",
    "sigterm-exit-0": "the broker's own exit status",
    "streams exactly-once*": "a Kafka Streams (Java) app with exactly_once_v2, through crashes",
    "docker compose demo*": "the compose demo in a real Docker engine: one host client checks it",
    "mirrors: *": "hyperkafka mirrors, fed and read by the clients named",
    "cluster: *": "hyperkafka cluster mode (two or three brokers), checked with the clients named",
    "scripts/demo: *": "hyperkafka's demo script",
    "security refusal: *": "the broker's security rules, as the clients named report them",
    "security hostile: *": "the broker's limits on idle and trickling TLS connections",
    "sigkill-acks-all": "a broker feature (acks=all durability across SIGKILL)",
    "offsets-expiry-compaction": "a broker feature (offsets expiry, offsets archive compaction)",
    "tampered-record-refused": "a broker feature (signed archives refuse tampered bytes)",
    "compacted-topic": "a broker feature (log compaction), read back by confluent and kafka-python",
    "topic-compression-*": "a broker feature (a topic's compression.type, recompressed before "
    "signing), fed and read by confluent and kafka-python",
    "explorer: *": "the explorer page in headless Chromium, fed by kafka-python",
}

NOTES: dict[str, str] = {
    "a": "kcat has no admin API: no CreateTopics, DeleteTopics, DescribeConfigs or group "
    "admin, only -L metadata (row metadata-list)",
    "b": "kafkajs ships gzip only; snappy, lz4 and zstd are third-party codec packages the "
    "lab does not install",
    "c": "kcat -G and the console consumer join groups (rows kcat-G, console 10k keyed "
    "lines (group)) but cannot report their assignment per rebalance or be stopped between "
    "records, which these rows check",
    "d": "not idempotent by default (librdkafka enable.idempotence, aiokafka "
    "enable_idempotence, kafkajs idempotent, sarama Producer.Idempotent are false): row "
    "idempotent-on",
    "e": "idempotent by default: row idempotent-default",
    "f": "no KIP-848 consumer protocol (group.protocol=consumer) in this client: it "
    "speaks only the classic group protocol (rows group-*)",
}

# (scenario pattern, client) -> note key: grid cells that are not run, and why.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    **{(s, c): "a" for s in ("admin-topics", "describe-configs", "group-admin *") for c in ("kcat-old", "kcat-new")},
    **{(s, "kafkajs"): "b" for s in ("rt-snappy", "rt-lz4", "rt-zstd")},
    **{
        (s, c): "c"
        for s in ("group-split-*", "group-sigkill", "group-resume-after-restart")
        for c in ("kcat-old", "kcat-new", "java-tools")
    },
    **{
        ("idempotent-default", c): "d"
        for c in ("kcat-old", "kcat-new", "confluent", "aiokafka", "kafkajs", "sarama")
    },
    **{("idempotent-on", c): "e" for c in ("kafka-python", "franz-go", "java-tools")},
    **{("group-kip848", c): "c" for c in ("kcat-old", "kcat-new")},
    **{("group-kip848", c): "f" for c in ("kafka-python", "aiokafka", "kafkajs", "sarama")},
}


def single_subject(scenario: str) -> str | None:
    """Why `scenario` is a single-subject check, or None for a grid row."""
    for pattern, why in SINGLE_SUBJECT.items():
        if fnmatch.fnmatchcase(scenario, pattern):
            return why
    return None


def not_applicable(scenario: str, client: str) -> str | None:
    """The note key explaining why (scenario, client) is not run, if it is explained."""
    for (pattern, c), note in NOT_APPLICABLE.items():
        if c == client and fnmatch.fnmatchcase(scenario, pattern):
            return note
    return None


def problems(cells: Iterable[tuple[str, str]], *, complete: bool = True) -> list[str]:
    """What makes the matrix of these (client, scenario) test cells dishonest: grid cells
    neither tested nor explained, explanations of tested cells, unknown notes or columns,
    and (when `cells` are the whole suite's, `complete`) explanations that match no
    scenario any more."""
    tested = {(s, c) for c, s in cells if c != "-"}
    scenarios = {s for s, _c in tested}
    out: list[str] = []
    for scenario in sorted(scenarios):
        if single_subject(scenario) is not None:
            continue
        for client in sorted({c for s, c in tested if s == scenario} - set(GRID_CLIENTS)):
            out.append(f"{scenario!r} is a grid row but {client!r} is not a grid column")
        for client in GRID_CLIENTS:
            note = not_applicable(scenario, client)
            if (scenario, client) in tested:
                if note is not None:
                    out.append(f"{scenario!r} x {client}: tested, but explained as n/a[{note}]")
            elif note is None:
                out.append(f"{scenario!r} x {client}: neither tested nor explained")
            elif note not in NOTES:
                out.append(f"{scenario!r} x {client}: note {note!r} is not in NOTES")
    if not complete:
        return out
    for pattern in SINGLE_SUBJECT:
        if not any(fnmatch.fnmatchcase(s, pattern) for s in scenarios):
            out.append(f"single-subject {pattern!r} matches no scenario")
    for pattern, client in NOT_APPLICABLE:
        if not any(fnmatch.fnmatchcase(s, pattern) for s in scenarios):
            out.append(f"n/a for {pattern!r} x {client} matches no scenario")
    return out


def render(doc: dict[str, object]) -> str:
    every = list(doc.get("tests", []))  # type: ignore[call-overload]
    # Tests without a matrix cell (the harness's self-tests) count below but get no row.
    tests = [t for t in every if t["client"] != "-"]
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
    grid = [s for s in scenarios if single_subject(s) is None]
    single = [s for s in scenarios if single_subject(s) is not None]
    width = max([len(s) for s in grid] + [8]) + 2
    colw = max([len(c) for c in GRID_CLIENTS] + [7]) + 2
    lines = [
        f"compat matrix against {doc.get('broker')} "
        f"({'external' if doc.get('external') else 'started by the harness'}), "
        f"{doc.get('wall_seconds')} s",
        ("scenario".ljust(width) + "".join(c.ljust(colw) for c in GRID_CLIENTS)).rstrip(),
    ]
    used: set[str] = set()
    for s in grid:
        row = s.ljust(width)
        for c in GRID_CLIENTS:
            outcome = cells.get((s, c))
            note = not_applicable(s, c)
            if outcome:
                text = CELL[outcome]
            elif note is not None:
                text, _ = f"n/a[{note}]", used.add(note)
            else:
                text = "."
            row += text.ljust(colw)
        lines.append(row.rstrip())
    for key in sorted(used):
        lines.append(f"  [{key}] {NOTES.get(key, '?')}")
    if single:
        lines.append("single-subject checks (one tool, peer suite or broker feature):")
    for s in single:
        ran = ", ".join(f"{c} {CELL[o]}" for (sc, c), o in cells.items() if sc == s)
        lines.append(f"  {s}: {ran}  ({single_subject(s)})")
    counts: dict[str, int] = {}
    for t in every:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    lines.append(
        "tests: "
        + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    )
    collected = doc.get("collected")
    if isinstance(collected, list):
        # A run of part of the suite leaves stale-explanation checks to the self-test.
        found = problems(((str(c), str(s)) for c, s in collected), complete=False)
        lines.append(f"cells neither tested nor explained: {len(found)}")
        lines += [f"  {p}" for p in found]
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

"""The harness's own checks must be able to fail: no broker needed.

assert_same must catch a changed byte, a null turned empty, a lost header, a duplicate, a
gap and a reorder; generated data must be deterministic and honour a client's profile; the
kcat output parser must read binary keys and values containing newlines. Every cell of the
client x scenario matrix must be tested or explained (compat_tests/matrix.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from compat_tests import broker_logs, harness, java_tools, matrix
from compat_tests.clients import CLIENTS, KCAT_KEY_DELIM, KCAT_MSG_DELIM, parse_kcat_format
from compat_tests.records import Profile, Record, assert_same, from_json, generate, to_json


def _consumed(records: list[Record]) -> list[Record]:
    return [dataclasses.replace(r, offset=i) for i, r in enumerate(records)]


def test_generate_is_deterministic_and_covers_the_edge_cases() -> None:
    a, b = (
        generate(2000, Profile(header_null_value=True)),
        generate(2000, Profile(header_null_value=True)),
    )
    assert a == b
    assert any(r.key is None for r in a) and any(r.value is None for r in a)
    assert any(r.key is None and r.value is None for r in a)
    assert any(r.value == b"" for r in a) and any(r.key == b"" for r in a)
    assert any(v is None for r in a for _, v in r.headers)
    assert any(len({n for n, _ in r.headers}) < len(r.headers) for r in a)  # duplicate names
    assert any(r.value is not None and len(r.value) > 20_000 for r in generate(5000, Profile()))


def test_profiles_are_honoured() -> None:
    kcat = generate(3000, CLIENTS["kcat-new"].profile)
    banned = {KCAT_KEY_DELIM, KCAT_MSG_DELIM}
    assert not any(set(r.key or b"") & banned or set(r.value or b"") & banned for r in kcat)
    assert not any(r.key == b"" or r.value == b"" for r in kcat)
    kp = generate(3000, CLIENTS["kafka-python"].profile)
    assert not any(r.key is None and r.value is None for r in kp)


def test_json_lines_round_trip() -> None:
    for r in generate(500, Profile(header_null_value=True)):
        assert from_json(to_json(r)) == r


@pytest.mark.parametrize(
    "damage",
    ["byte", "null-to-empty", "header", "duplicate", "gap", "reorder", "missing-last"],
)
def test_assert_same_catches(damage: str) -> None:
    produced = generate(300, Profile())
    consumed = _consumed(produced)
    i = next(j for j, r in enumerate(produced) if r.value and r.headers and j > 10)
    if damage == "byte":
        v = bytearray(consumed[i].value or b"")
        v[-1] ^= 1
        consumed[i] = dataclasses.replace(consumed[i], value=bytes(v))
    elif damage == "null-to-empty":
        j = next(j for j, r in enumerate(produced) if r.key is None)
        consumed[j] = dataclasses.replace(consumed[j], key=b"")
    elif damage == "header":
        consumed[i] = dataclasses.replace(consumed[i], headers=consumed[i].headers[:-1])
    elif damage == "duplicate":
        consumed.insert(i, consumed[i])
    elif damage == "gap":
        del consumed[i]  # the offsets after it keep their values: a hole at i
    elif damage == "reorder":
        consumed[i], consumed[i + 1] = consumed[i + 1], consumed[i]
    elif damage == "missing-last":
        consumed.pop()
    assert_same(produced, _consumed(produced))  # the undamaged copy passes
    with pytest.raises(AssertionError):
        assert_same(produced, consumed)


def test_parse_kcat_format_reads_binary() -> None:
    out = b"0 3 -1 1000 hk-a=1,hk-b=two\nk\n\x00" + b"1 -1 4 1001 \n\n\n\xff\x00" + b"2 0 0 1002 \n"
    assert parse_kcat_format(out) == [
        Record(b"k\n\x00", None, (("hk-a", b"1"), ("hk-b", b"two")), 1000, 0),
        Record(None, b"\n\n\xff\x00", (), 1001, 1),
        Record(b"", b"", (), 1002, 2),
    ]


def test_every_matrix_cell_is_tested_or_explained(tmp_path: Path) -> None:
    """Collect the whole suite (as a child pytest, so -k here changes nothing) and check that
    each grid cell is filled by a test or explained as n/a with a note, and that no
    explanation has gone stale."""
    results = tmp_path / "collected.json"
    env = dict(os.environ, HK_COMPAT_RESULTS=str(results))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "compat_tests"],
        cwd=harness.ROOT,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout.decode()[-3000:] + proc.stderr.decode()[-3000:]
    cells = [(c, s) for c, s in json.loads(results.read_text())["collected"]]
    assert len(cells) > 100, f"collected only {len(cells)} matrix cells"
    assert matrix.problems(cells) == []


def test_matrix_problems_catch_a_gap_and_a_stale_explanation() -> None:
    full = [(c, "rt-snappy") for c in matrix.GRID_CLIENTS if c != "kafkajs"]
    assert matrix.problems(full, complete=False) == []  # kafkajs: n/a[b]
    gap = [cell for cell in full if cell[0] != "sarama"]
    assert matrix.problems(gap, complete=False) == ["'rt-snappy' x sarama: neither tested nor explained"]
    stale = [*full, ("kafkajs", "rt-snappy")]
    assert matrix.problems(stale, complete=False) == ["'rt-snappy' x kafkajs: tested, but explained as n/a[b]"]
    new_row = [("confluent", "brand-new-scenario")]
    assert len(matrix.problems(new_row, complete=False)) == len(matrix.GRID_CLIENTS) - 1


def test_kraft_cluster_ids_never_look_like_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """One random id in 64 starts with "-", which kafka-storage format takes for a flag."""
    draws = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" * 16)])
    monkeypatch.setattr(java_tools.uuid, "uuid4", lambda: next(draws))
    got = java_tools.random_cluster_id()
    assert got == "AQEBAQEBAQEBAQEBAQEBAQ"
    assert len(got) == 22 and not got.startswith("-")


_LOG = """\
2026-12-03 16:00:00,001 INFO hyperkafka: listening on 127.0.0.1:9092
2026-12-03 16:00:01,002 ERROR broker.server: internal error on a connection from ('127.0.0.1', 5); closing it
  + Exception Group Traceback (most recent call last):
  |   File "broker/server.py", line 280, in _serve
  | KeyError: 'x'
2026-12-03 16:00:02,003 WARNING broker.node: disk nearly full
2026-12-03 16:00:03,004 ERROR broker.groups.coordinator: offset expiry failed
Traceback (most recent call last):
  File "broker/groups/coordinator.py", line 590, in _expire
ValueError: boom
2026-12-03 16:00:04,005 INFO hyperkafka: stopped
"""


def test_broker_log_check_finds_internal_errors_and_tracebacks(tmp_path: Path) -> None:
    found = broker_logs.incidents_in(_LOG)
    assert [i.first_line()[24:] for i in found] == [
        "ERROR broker.server: internal error on a connection from ('127.0.0.1', 5); closing it",
        "ERROR broker.groups.coordinator: offset expiry failed",
    ]
    assert "KeyError: 'x'" in found[0].text and "ValueError: boom" in found[1].text
    assert broker_logs.unexpected(found, ["ValueError: boom"]) == [found[0]]
    assert broker_logs.unexpected(found, ["KeyError", "expiry"]) == []
    assert broker_logs.incidents_in("Traceback (most recent call last):\n  File x\nOSError\n")


def test_broker_log_check_reads_each_line_once(tmp_path: Path) -> None:
    log = tmp_path / "broker.log"
    log.write_text(_LOG)  # written before the broker was watched: an earlier broker's
    broker_logs.watch(log)
    assert broker_logs.read_new([log]) == []
    with log.open("a") as f:
        f.write(_LOG.splitlines(keepends=True)[1] + "2026-12-03 16:00:05,000 ERROR half a line")
    assert [i.text for i in broker_logs.read_new([log])] == [_LOG.splitlines()[1]]
    with log.open("a") as f:
        f.write(" of an internal error\n")
    assert len(broker_logs.read_new([log])) == 1
    assert broker_logs.read_new([log]) == []


def test_group_wait_fails_at_once_when_a_member_stops_on_its_own(tmp_path: Path) -> None:
    """The SIGKILL group test's "known flake": group workers stop by themselves after their
    --timeout; when a slow run outlived it, the survivors closed (status 0) and the test
    waited its full 90 s for records nobody read any more, then blamed the rebalance.
    wait_for must name the member that stopped instead."""
    import time

    from compat_tests.test_groups import Member, wait_for

    out = tmp_path / "m.jsonl"
    out.write_text('{"ev": "assigned", "parts": [0, 1], "t": 0}\n{"ev": "closed", "n": 0}\n')
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"m-1 stopped on its own while waiting for every record"):
        wait_for("every record", lambda: False, 30, [Member("m-1", proc, out)])
    assert time.monotonic() - started < 5

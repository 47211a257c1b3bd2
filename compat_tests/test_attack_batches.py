"""Attack suite, part b: record batches that lie, and compression bombs, through Produce.

Each attack class of compat_tests.attack.batches is one test with a broker of its own and
the good producer beside it. Every batch of the class is sent in a well-formed Produce
(the lowest and highest advertised versions from v3) to a topic of its own, and (but for
the bombs) once to the good producer's topic: the broker must answer each with a Kafka error for the
partition (not a closed connection, not a hang past 60 s), the partition's high watermark
must not move, and afterwards nothing malformed may be read back from any partition
(compat_tests.attack.guard). A header key that is not UTF-8 is the one lie Kafka stores;
if the broker stores it too, its own `iter_records` must read it back. RSS bound: 400 MiB, though the bombs inflate to 0.2-4 GiB.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compat_tests.attack import batches, wire
from compat_tests.attack.guard import Bounds, Guard

ANSWER_WITHIN = 60.0
# Kafka accepts these (its reader decodes a header key that is not UTF-8 with replacement
# characters): a broker may store them, but then its own decoder must read them back.
MAY_BE_STORED = {"bad-utf8-header-key"}


@pytest.mark.timeout(300)
@pytest.mark.matrix("attack-batches-{attack}", client="raw-socket")
@pytest.mark.parametrize("attack", list(batches.ATTACKS))
def test_lying_batches(
    attack: str, tmp_path: Path, record_property: Callable[[str, Any], None]
) -> None:
    catalog = batches.ATTACKS[attack]()
    built = {name: build() for name, build in catalog.items()}  # bombs take a second or two
    with Guard(tmp_path, f"batches-{attack}", Bounds(rss_mib=400), record=record_property) as g:
        topic = f"atk-{attack}"
        wire.create_topic(g.host, g.port, topic)
        lo, hi = wire.api_versions(g.host, g.port)[0]
        versions = sorted({max(lo, 3), hi})
        problems: list[str] = []
        outcomes: dict[str, str] = {}
        for name, data in built.items():
            targets = [(v, topic) for v in versions]
            if not attack.startswith("bomb-"):
                # Into the good topic too (its consumer then reads past it), except the bombs:
                # a stock consumer would inflate them in the test's own memory.
                targets.append((hi, g.good_topic))
            for version, target in targets:
                label = f"{name} (Produce v{version} to {'the good topic' if target == g.good_topic else target})"
                before = wire.high_watermarks(g.host, g.port, target, [0])[0]
                try:
                    with wire.Conn(g.host, g.port, ANSWER_WITHIN) as c:
                        code, message = wire.produce(
                            c, target, 0, data, version, timeout=ANSWER_WITHIN
                        )
                except wire.Closed:
                    code, message = None, "connection closed"
                except TimeoutError:
                    code, message = None, f"no answer within {ANSWER_WITHIN} s"
                g.check(label)
                after = wire.high_watermarks(g.host, g.port, target, [0])[0]
                outcomes[f"{name}/v{version}/{'good' if target == g.good_topic else 'own'}"] = (
                    f"error {code}" if code is not None else str(message)
                )
                if code == 0 and name in MAY_BE_STORED:
                    pass  # the read-back below decides
                elif code == 0:
                    problems.append(
                        f"{label}: acknowledged (error 0), high watermark {before} -> {after}"
                    )
                elif code is None:
                    problems.append(f"{label}: {message}, not a Kafka error")
                elif after != before and target != g.good_topic:
                    problems.append(
                        f"{label}: refused with {code} but the high watermark moved {before} -> {after}"
                    )
        g.end_attack()
        record_property("batches_sent", len(outcomes))
        record_property("wire_bytes", {n: len(d) for n, d in built.items()})
        refused = sum(1 for o in outcomes.values() if o.startswith("error ") and o != "error 0")
        record_property("refused", refused)
        print(f"{attack}: {refused}/{len(outcomes)} refused with a Kafka error; {outcomes}")
        g.finish(problems)

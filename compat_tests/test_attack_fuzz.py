"""Attack suite, part a: the schema-driven fuzzer over every API version the broker
advertises, one test per mutation class (compat_tests.attack.schema_fuzz says what each
class sends). Each test runs its own broker with the good producer beside it
(compat_tests.attack.guard) and fails on a crash, a request unanswered past 10 s (long
polls excepted), a valid request answered by a closed connection, RSS past 400 MiB, a
stalled producer, a malformed batch read back, a lost acknowledged record or a failed
`hyperkafka verify`.

HK_FUZZ_SEED (default 15) and HK_FUZZ_SECONDS (default 4 per class) set the run;
`scripts/fuzz --seconds N --seed S` runs the same classes longer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.protocol.codec import request_schema
from broker.protocol.versions import RECOMMENDED_RANGES
from compat_tests.attack import schema
from compat_tests.attack.run import fuzz
from compat_tests.attack.schema_fuzz import CLASSES, Target, make_frame, valid_body

SEED = int(os.environ.get("HK_FUZZ_SEED", "15"))
SECONDS = float(os.environ.get("HK_FUZZ_SECONDS", "4"))
RANGES = {**RECOMMENDED_RANGES, 17: (0, 1), 36: (0, 2)}  # + SASL, which the broker serves too


def test_span_encoder_equals_kio_for_every_version() -> None:
    """The fuzzer's spans are only right if its encoder writes kio's bytes exactly."""
    checked = 0
    for key, (lo, hi) in RANGES.items():
        for version in range(lo, hi + 1):
            for seed in range(12):
                # valid_body raises if our bytes differ from kio's encode_request.
                body, spans, _flex, _e = valid_body(Target(key, version), random.Random(seed))
                checked += 1
                for s in spans:
                    assert 0 <= s.start <= s.prefix_end <= s.content_end <= len(body), (
                        key,
                        version,
                        s,
                    )
    assert checked > 1500


def test_every_class_builds_frames_for_every_version() -> None:
    targets = sum(hi - lo + 1 for lo, hi in RANGES.values())
    for cls in CLASSES:
        sizes = [len(make_frame(1, cls, i, dict(RANGES)).data) for i in range(targets)]
        assert min(sizes) >= 4
    # A frame is a pure function of (seed, class, index).
    assert (
        make_frame(3, "bit-flips", 7, dict(RANGES)).data
        == make_frame(3, "bit-flips", 7, dict(RANGES)).data
    )


def test_lying_count_mutation_writes_the_issue_lie() -> None:
    """Item 1's frame: a compact array count of 0xF0000000 must be among the lies."""
    assert request_schema(3, 12).__flexible__
    lie = schema.uvarint(0xF0000000)
    assert lie == bytes.fromhex("808080800f")
    frames = [make_frame(5, "lying-counts", i, {3: (12, 12)}).data for i in range(200)]
    assert any(lie in f for f in frames)


@pytest.mark.timeout(240)
@pytest.mark.matrix("attack-fuzz-{cls}", client="raw-socket")
@pytest.mark.parametrize("cls", CLASSES)
def test_fuzz(cls: str, tmp_path: Path, record_property: Callable[[str, Any], None]) -> None:
    fuzz(tmp_path, SEED, [cls], SECONDS, record=record_property, on_report=print)

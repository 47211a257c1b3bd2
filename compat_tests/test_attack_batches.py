"""Attack suite, part b: record batches that lie, and compression bombs, through Produce.

Each attack class of compat_tests.attack.batches is one test with a broker of its own and
the good producer beside it. Every batch of the class is sent in a well-formed Produce
(the lowest and highest advertised versions from v3) to a topic of its own, and (but for
the bombs) once to the good producer's topic: the broker must answer each with a Kafka error for the
partition (not a closed connection, not a hang past 60 s), the partition's high watermark
must not move, and afterwards nothing malformed may be read back from any partition
(compat_tests.attack.guard). A header key that is not UTF-8 is the one lie Kafka stores;
if the broker stores it too, its own `iter_records` must read it back. The first lies of
each class are also sent as sequence k of a real idempotent producer, followed by a good
batch with sequence k, which must be accepted (a refusal leaves no producer state behind);
and each bomb class ends with one Produce carrying its largest bomb to 16 partitions. RSS bound: 400 MiB, though the bombs inflate to 0.2-4 GiB.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest

from broker.protocol.codec import request_schema
from compat_tests.attack import batches, wire
from compat_tests.attack.guard import Bounds, Guard
from compat_tests.attack.schema import make

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
        problems += _idempotent_state_kept(g, topic, built, hi)
        if attack.startswith("bomb-"):
            problems += _bombs_in_one_request(g, attack, built, hi)
        g.end_attack()
        record_property("batches_sent", len(outcomes))
        record_property("wire_bytes", {n: len(d) for n, d in built.items()})
        refused = sum(1 for o in outcomes.values() if o.startswith("error ") and o != "error 0")
        record_property("refused", refused)
        print(f"{attack}: {refused}/{len(outcomes)} refused with a Kafka error; {outcomes}")
        g.finish(problems)


def _as_idempotent(batch: bytes, producer_id: int, epoch: int, sequence: int) -> bytes:
    """The batch with an idempotent producer's id, epoch and sequence (CRC kept right if
    it was right: a wrong CRC is the lie of its own variant)."""
    b = bytearray(batch)
    crc_was_right = (
        len(b) >= 61 and crc32c.crc32c(bytes(b[21:])) == struct.unpack_from(">I", b, 17)[0]
    )
    struct.pack_into(">qhi", b, 43, producer_id, epoch, sequence)
    if crc_was_right:
        struct.pack_into(">I", b, 17, crc32c.crc32c(bytes(b[21:])))
    return bytes(b)


def _idempotent_state_kept(
    g: Guard, topic: str, built: dict[str, bytes], version: int
) -> list[str]:
    """Each lying batch sent as sequence k of a real idempotent producer, then a good batch
    with the same sequence k: the refusal must leave no producer state behind (the good
    one is accepted, not OUT_OF_ORDER_SEQUENCE or DUPLICATE_SEQUENCE_NUMBER)."""
    init = wire.call(g.host, g.port, 22, 4, {"transactional_id": None,
                                             "transaction_timeout": wire.ms(60_000),
                                             "producer_id": -1, "producer_epoch": -1})  # fmt: skip
    if int(init.error_code.value) != 0:
        return [f"InitProducerId failed: {init.error_code}"]
    pid, epoch = int(init.producer_id), int(init.producer_epoch)
    problems = []
    seq = 0
    with wire.Conn(g.host, g.port, ANSWER_WITHIN) as c:
        for name, data in list(built.items())[:6]:
            if len(data) < 61 or name in MAY_BE_STORED:
                continue
            try:
                lying, _ = wire.produce(c, topic, 0, _as_idempotent(data, pid, epoch, seq), version)
            except (wire.Closed, TimeoutError) as exc:
                problems.append(f"{name} as sequence {seq} of producer {pid}: {exc!r}")
                return problems
            if lying == 0:
                seq += int(struct.unpack_from(">i", data, 57)[0])  # it was stored: move on
                continue
            good = batches.batch(batches.records(1), 1, producer_id=pid, producer_epoch=epoch,
                                 base_sequence=seq)  # fmt: skip
            code, msg = wire.produce(c, topic, 0, good, version)
            if code != 0:
                problems.append(
                    f"after {name} was refused ({lying}) as sequence {seq} of producer {pid}, "
                    f"a good batch with that sequence got error {code} ({msg})"
                )
                return problems
            seq += 1
            g.check(f"{name} as an idempotent producer's batch")
    return problems


def _bombs_in_one_request(
    g: Guard, attack: str, built: dict[str, bytes], version: int
) -> list[str]:
    """Every bomb of the class into each of 16 partitions in one Produce: the work and the
    memory of refusing them must stay bounded (the guard's RSS bound and stall bound)."""
    topic = f"atk-{attack}-x16"
    wire.create_topic(g.host, g.port, topic, partitions=16)
    data = max(built.values(), key=len)
    req = make(request_schema(0, version), {
        "transactional_id": None, "acks": -1, "timeout": wire.ms(30_000),
        "topic_data": [{"name": topic, "partition_data": [
            {"index": p, "records": data} for p in range(16)]}],
    })  # fmt: skip
    try:
        with wire.Conn(g.host, g.port, 120) as c:
            resp = c.call(0, version, req, 120)
    except (wire.Closed, TimeoutError) as exc:
        return [f"16 bombs in one Produce: {exc!r}, not Kafka errors"]
    g.check("16 bombs in one Produce")
    codes = [int(p.error_code.value) for t in resp.responses for p in t.partition_responses]
    if any(code == 0 for code in codes):
        return [f"16 bombs in one Produce: {codes.count(0)} partitions acknowledged one"]
    return []

"""Fetch answers bounded as Kafka's ReplicaManager bounds them, at the edges.

The rule (ReplicaManager.readFromLog, LogSegment.read, KIP-74): the answer's records stay
within min(request max_bytes, broker fetch.max.bytes) and each partition within its
partition_max_bytes, except that the first partition that has data gets at least its
first batch whole, even above both, so a consumer always makes progress. We serve whole
batches only (Kafka may end a partition with a partial batch that the client drops), so a
batch that does not fit what is left is not sent this time.
"""

from __future__ import annotations

import random

import pytest

from broker.tests.conftest import Broker
from broker.tests.test_memory import fetch_of
from broker.tests.test_server import batch, create, produce

pytestmark = pytest.mark.usefixtures("broker")


async def sizes_of(c, named: list[tuple[str, int, int, int]], max_bytes: int) -> list[int]:  # type: ignore[no-untyped-def]
    r = await c.call("fetch", 12, fetch_of(named, max_bytes=max_bytes))
    assert r.error_code == 0
    return [len(p.records or b"") for t in r.responses for p in t.partitions]


async def test_the_answer_fits_exactly_at_the_boundary(broker: Broker) -> None:
    await create(broker, "edge", partitions=2)
    c = await broker.connect()
    b = batch([b"e" * 3000])
    n = len(b)
    for part in (0, 1):
        for _ in range(3):
            await produce(c, "edge", b, partition=part)
    named = [("edge", 0, 0, 1 << 20), ("edge", 1, 0, 1 << 20)]
    # Exactly three batches of room: all of partition 0, nothing of 1.
    assert await sizes_of(c, named, 3 * n) == [3 * n, 0]
    # One byte less: the third batch of partition 0 no longer fits.
    assert await sizes_of(c, named, 3 * n - 1) == [2 * n, 0]
    # Four batches of room: the fourth comes from partition 1.
    assert await sizes_of(c, named, 4 * n) == [3 * n, n]
    assert await sizes_of(c, named, 4 * n - 1) == [3 * n, 0]
    # Per partition, the same edge.
    per = [("edge", 0, 0, 2 * n), ("edge", 1, 0, 2 * n - 1)]
    assert await sizes_of(c, per, 1 << 20) == [2 * n, n]


async def test_only_the_first_partition_with_data_may_exceed(broker: Broker) -> None:
    await create(broker, "kip74", partitions=3)
    c = await broker.connect()
    big = batch([b"b" * 9000])
    for part in (1, 2):
        await produce(c, "kip74", big, partition=part)
        await produce(c, "kip74", big, partition=part)
    # Partition 0 is empty (at its end): partition 1 is the first with data and gets one
    # whole batch above both limits; partition 2 gets nothing.
    named = [("kip74", 0, 0, 100), ("kip74", 1, 0, 100), ("kip74", 2, 0, 100)]
    assert await sizes_of(c, named, 100) == [0, len(big), 0]
    # Only one batch above the limit, never a second one.
    assert await sizes_of(c, named, len(big) + 1) == [0, len(big), 0]
    # A zero or negative max_bytes still lets the first batch through, as Kafka does.
    assert await sizes_of(c, named, 0) == [0, len(big), 0]
    assert await sizes_of(c, named, -1) == [0, len(big), 0]
    zero = [("kip74", 1, 0, 0), ("kip74", 2, 0, 0)]
    assert await sizes_of(c, zero, 1 << 20) == [len(big), 0]


async def test_the_broker_fetch_max_bytes_caps_a_larger_request(broker: Broker) -> None:
    await create(broker, "cap2", partitions=1)
    c = await broker.connect()
    b = batch([b"c" * 2000])
    for _ in range(5):
        await produce(c, "cap2", b)
    broker.config.fetch_max_bytes = 2 * len(b)
    assert await sizes_of(c, [("cap2", 0, 0, 1 << 20)], 1 << 30) == [2 * len(b)]


async def test_random_fetches_keep_kafkas_bounds(broker: Broker) -> None:
    """Many random requests over partitions of random batches: every answer obeys the rule
    above, and holds as much as the rule allows in whole batches (nothing is cut short)."""
    rnd = random.Random(20261203)
    await create(broker, "rb", partitions=4)
    c = await broker.connect()
    stored: dict[int, list[tuple[int, int]]] = {}  # partition -> [(records, bytes)]
    for part in range(4):
        stored[part] = []
        for _ in range(rnd.randint(0, 5)):
            values = [bytes(rnd.randint(10, 70_000)) for _ in range(rnd.choice((1, 2, 4)))]
            b = batch(values)
            await produce(c, "rb", b, partition=part)
            stored[part].append((len(values), len(b)))

    def expected(named: list[tuple[str, int, int, int]], max_bytes: int) -> list[int]:
        out, total = [], 0
        for _, part, offset, pmax in named:
            base, sizes = 0, []
            for count, size in stored[part]:
                if base + count > offset:
                    sizes.append(size)
                base += count
            limit = min(pmax, max_bytes - total)
            got = 0
            for i, size in enumerate(sizes):
                if got + size <= limit or (i == 0 and total == 0):
                    got += size
                else:
                    break
            out.append(got)
            total += got
        return out

    for _ in range(150):
        parts = rnd.sample(range(4), rnd.randint(1, 4))
        named = [
            (
                "rb",
                p,
                rnd.randint(0, sum(n for n, _ in stored[p])),
                rnd.choice((1, 5000, 80_000, 1 << 20)),
            )
            for p in parts
        ]
        max_bytes = rnd.choice((1, 20_000, 100_000, 250_000, 1 << 20))
        assert await sizes_of(c, named, max_bytes) == expected(named, max_bytes), (named, max_bytes)

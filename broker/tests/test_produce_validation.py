"""Produce refuses batches whose records lie, over a real socket: the Kafka code, the
first bad record in record_errors (v8+), and nothing stored or signed."""

from __future__ import annotations

import struct

import crc32c
import pytest
import zstandard

from broker.tests.conftest import Broker
from broker.tests.test_record_validation import batch as raw_batch
from broker.tests.test_record_validation import record
from broker.tests.test_server import NOW, batch, create, fetch, produce

pytestmark = pytest.mark.usefixtures("broker")


def lying(section: bytes, count: int, **kw: int) -> bytes:
    data = bytearray(raw_batch(section, count, base_ts=NOW, max_ts=NOW, **kw))
    return bytes(data)


CASES = [
    ("count 2^31-1, one record", lying(record(0), 2**31 - 1), 87, 1),
    ("offset deltas repeat", lying(record(0) + record(0), 2), 87, 1),
    ("length past the end", lying(record(0) + b"\x7f\x00", 2), 87, 1),
    (
        "a batch nested in zstd",
        lying(zstandard.ZstdCompressor().compress(batch([b"a", b"b"])), 2, codec=4),
        87,
        0,
    ),
    ("null header key", lying(record(0, headers=[(None, b"x")]), 1), 87, 0),
    ("timestamp a day ahead", lying(record(0, ts_delta=86_400_000), 1), 32, 0),
]


@pytest.mark.parametrize(("name", "data", "code", "index"), CASES, ids=[c[0] for c in CASES])
async def test_lying_batches_are_refused_and_not_stored(
    broker: Broker, name: str, data: bytes, code: int, index: int
) -> None:
    await create(broker, "lies")
    c = await broker.connect()
    r = await produce(c, "lies", data, version=9)
    assert r.error_code == code, (name, r)
    assert [(e.batch_index, e.batch_index_error_message) for e in r.record_errors] == [
        (index, r.error_message)
    ]
    assert f"record {index}" in r.error_message
    ok = await produce(c, "lies", batch([b"good"]))
    assert ok.error_code == 0 and ok.base_offset == 0  # the refused batch took no offsets
    p = await fetch(c, "lies", 0)
    assert p.high_watermark == 1 and bytes(p.records)[61:] == batch([b"good"])[61:]


async def test_bomb_past_64x_max_message_bytes_is_refused(broker: Broker) -> None:
    await create(broker, "bombs", configs={"max.message.bytes": "20000"})
    c = await broker.connect()
    section = b"".join(record(i, value=b"\x00" * 10_000) for i in range(200))  # 2 MB inflated
    bomb = lying(zstandard.ZstdCompressor().compress(section), 200, codec=4)
    assert len(bomb) < 20_000
    r = await produce(c, "bombs", bomb, version=11)
    assert r.error_code == 87 and "inflate past 1280000 bytes" in r.error_message
    assert (await fetch(c, "bombs", 0)).high_watermark == 0


async def test_record_errors_are_absent_before_v8(broker: Broker) -> None:
    await create(broker, "old")
    c = await broker.connect()
    r = await produce(c, "old", lying(record(0) + record(0), 2), version=7)
    assert r.error_code == 87


async def test_a_lying_max_timestamp_is_corrected_as_kafka_does(broker: Broker) -> None:
    await create(broker, "ts")
    c = await broker.connect()
    data = bytearray(batch([b"a", b"b"]))
    struct.pack_into(">q", data, 35, NOW + 10**9)  # maxTimestamp far above its records'
    struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
    assert (await produce(c, "ts", bytes(data))).error_code == 0
    stored = bytes((await fetch(c, "ts", 0)).records)
    assert struct.unpack_from(">q", stored, 35)[0] == NOW
    assert struct.unpack_from(">I", stored, 17)[0] == crc32c.crc32c(stored[21:])

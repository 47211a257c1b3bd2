"""compression.type per topic: the broker recompresses a produced batch to the topic's
codec before signing it, as Kafka's LogValidator does, and keeps every record and header
field; the codec framings are the ones every client reads (decoded here by our reader and,
in compat_tests/test_topic_compression.py, by real clients)."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import zstandard

from broker.config import ConfigError, validate_topic_configs
from broker.protocol import records
from broker.protocol.compression import compress, recompress_batch, topic_compression
from broker.tests.conftest import Broker
from broker.tests.test_record_validation import batch as raw_batch
from broker.tests.test_record_validation import record
from broker.tests.test_server import NOW, batch, create, fetch, produce

CODECS = [records.Compression(c) for c in range(5)]
SECTION = b"".join(record(i, key=b"key-%d" % i, value=b"value %d " % i * 50) for i in range(40))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("level", [None, 1])
def test_compress_round_trips_through_our_reader(
    codec: records.Compression, level: int | None
) -> None:
    data = SECTION * 30  # > 64 KiB: several lz4 blocks and xerial blocks
    out = compress(codec, data, level)
    assert records.decompress(codec, out) == data
    if codec != records.Compression.NONE:
        assert len(out) < len(data)


def test_snappy_is_xerial_framed_and_lz4_has_no_checksums() -> None:
    assert compress(records.Compression.SNAPPY, b"x" * 100)[:16] == b"\x82SNAPPY\x00" + struct.pack(
        ">ii", 1, 1
    )
    lz4 = compress(records.Compression.LZ4, b"x" * 100)
    assert lz4[:4] == b"\x04\x22\x4d\x18"
    # FLG: version 01, independent blocks, no block checksum, no size, no content checksum;
    # BD: 64 KiB blocks. What KafkaLZ4BlockOutputStream writes.
    assert lz4[4] == 0b0110_0000 and lz4[5] == 0x40


@pytest.mark.parametrize("source", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("target", CODECS, ids=lambda c: c.name)
def test_recompress_keeps_header_and_records(
    source: records.Compression, target: records.Compression
) -> None:
    original = bytearray(raw_batch(compress(source, SECTION), 40, codec=source, max_ts=NOW + 5))
    struct.pack_into(">qhi", original, 43, 77, 3, 1000)  # producer id, epoch, base sequence
    struct.pack_into(">I", original, 17, records.compute_crc(original))
    out = recompress_batch(original, target)
    records.verify_crc(out)
    before, after = records.parse_batch_header(original), records.parse_batch_header(out)
    assert after.size == len(out)
    assert after.compression == target
    same = {"crc": 0, "batch_length": 0, "attributes": 0}
    assert dataclasses.replace(after, **same) == dataclasses.replace(before, **same)
    assert after.attributes & ~7 == before.attributes & ~7
    assert records.decode_records(out) == records.decode_records(original)


def test_topic_compression_reads_codec_and_level() -> None:
    cfg = {
        "compression.type": "zstd",
        "compression.zstd.level": "7",
        "compression.gzip.level": "-1",
    }
    assert topic_compression(cfg.__getitem__) == (records.Compression.ZSTD, 7)
    assert topic_compression({"compression.type": "producer"}.__getitem__) == (None, None)
    assert topic_compression({"compression.type": "snappy"}.__getitem__) == (
        records.Compression.SNAPPY,
        None,
    )


@pytest.mark.parametrize("value", ["uncompressed", "zstd", "lz4", "snappy", "gzip", "producer"])
def test_every_kafka_compression_type_is_accepted(value: str) -> None:
    assert validate_topic_configs({"compression.type": value}) == {"compression.type": value}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("compression.type", "brotli"),
        ("compression.gzip.level", "0"),
        ("compression.gzip.level", "10"),
        ("compression.lz4.level", "18"),
        ("compression.zstd.level", "23"),
    ],
)
def test_bad_compression_configs_are_refused_naming_them(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        validate_topic_configs({name: value})


@pytest.mark.usefixtures("broker")
@pytest.mark.parametrize("target", ["zstd", "lz4", "gzip", "snappy", "uncompressed"])
async def test_broker_stores_batches_in_the_topics_codec(broker: Broker, target: str) -> None:
    await create(broker, "t", configs={"compression.type": target})
    c = await broker.connect()
    values = [b"v%d" % i * 100 for i in range(20)]
    plain = batch(values)
    gz = raw_batch(
        compress(records.Compression.GZIP, plain[61:]), 20, codec=1, base_ts=NOW, max_ts=NOW
    )
    for data in (plain, gz):
        r = await produce(c, "t", data, version=9)
        assert r.error_code == 0, r
    p = await fetch(c, "t", 0)
    stored = records.split_batches(bytes(p.records))
    assert len(stored) == 2
    codec = {"zstd": 4, "lz4": 3, "gzip": 1, "snappy": 2, "uncompressed": 0}[target]
    for b in stored:
        records.verify_crc(b)
        assert records.parse_batch_header(b).compression == codec
        assert [r.value for r in records.decode_records(b)] == values


@pytest.mark.usefixtures("broker")
async def test_producer_keeps_the_producers_codec(broker: Broker) -> None:
    await create(broker, "p")
    c = await broker.connect()
    gz = raw_batch(
        compress(records.Compression.GZIP, batch([b"a"])[61:]), 1, codec=1, base_ts=NOW, max_ts=NOW
    )
    assert (await produce(c, "p", gz)).error_code == 0
    p = await fetch(c, "p", 0)
    assert bytes(p.records)[12:] == gz[12:]  # byte for byte, past base offset


@pytest.mark.usefixtures("broker")
async def test_recompressed_batch_larger_than_max_message_bytes_is_refused(broker: Broker) -> None:
    await create(
        broker, "big", configs={"compression.type": "uncompressed", "max.message.bytes": "5000"}
    )
    c = await broker.connect()
    section = b"".join(record(i, value=b"\x00" * 1000) for i in range(20))  # 20 KB inflated
    small = raw_batch(
        zstandard.ZstdCompressor().compress(section), 20, codec=4, base_ts=NOW, max_ts=NOW
    )
    assert len(small) < 5000
    r = await produce(c, "big", small, version=9)
    assert r.error_code == 10 and "exceeds the maximum configured size of 5000" in r.error_message
    assert (await fetch(c, "big", 0)).high_watermark == 0


@pytest.mark.usefixtures("broker")
async def test_altering_compression_type_applies_to_the_next_batch(broker: Broker) -> None:
    await create(broker, "alt")
    c = await broker.connect()
    r = await c.call(
        "incremental_alter_configs",
        1,
        {
            "resources": [
                {
                    "resource_type": 2,
                    "resource_name": "alt",
                    "configs": [
                        {"name": "compression.type", "config_operation": 0, "value": "lz4"}
                    ],
                }
            ],
            "validate_only": False,
        },
    )
    assert r.responses[0].error_code == 0
    assert (await produce(c, "alt", batch([b"x"]))).error_code == 0
    p = await fetch(c, "alt", 0)
    assert records.parse_batch_header(bytes(p.records)).compression == records.Compression.LZ4

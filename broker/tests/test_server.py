"""The broker end to end over a real socket, with raw protocol messages.

Real clients are exercised in compat_tests/ against a broker process; these tests pin
the exact protocol behaviour (error codes, edge offsets, bad input) that clients only
show indirectly.
"""

from __future__ import annotations

import struct
import time
import uuid

import crc32c
import pytest
import trio

from broker.tests.conftest import Broker
from storage.batch import build_batch

pytestmark = pytest.mark.usefixtures("broker")

NOW = int(time.time() * 1000)


def batch(values: list[bytes], **kw: int) -> bytes:
    return bytes(build_batch(values, timestamp_ms=kw.pop("timestamp_ms", NOW), **kw))


async def create(broker: Broker, name: str, partitions: int = 1, configs: dict[str, str] | None = None) -> None:
    c = await broker.connect()
    r = await c.call(
        "create_topics",
        7,
        {
            "topics": [
                {
                    "name": name,
                    "num_partitions": partitions,
                    "replication_factor": 1,
                    "assignments": [],
                    "configs": [{"name": k, "value": v} for k, v in (configs or {}).items()],
                }
            ],
            "timeout": 5000,
            "validate_only": False,
        },
    )
    assert r.topics[0].error_code == 0, r


async def produce(c, topic: str, data: bytes, *, version: int = 9, acks: int = -1, partition: int = 0):  # type: ignore[no-untyped-def]
    r = await c.call(
        "produce",
        version,
        {"acks": acks, "timeout": 5000, "topic_data": [{"name": topic, "partition_data": [{"index": partition, "records": data}]}]},
    )
    return r.responses[0].partition_responses[0]


def fetch_body(topic: str, offset: int, *, max_wait: int = 0, min_bytes: int = 0, max_bytes: int = 1 << 20, partition_max: int = 1 << 20):  # type: ignore[no-untyped-def]
    return {
        "replica_id": -1,
        "max_wait": max_wait,
        "min_bytes": min_bytes,
        "max_bytes": max_bytes,
        "isolation_level": 0,
        "session_id": 0,
        "session_epoch": -1,
        "topics": [
            {"topic": topic, "partitions": [{"partition": 0, "fetch_offset": offset, "partition_max_bytes": partition_max, "log_start_offset": -1}]}
        ],
        "forgotten_topics_data": [],
        "rack_id": "",
    }


async def fetch(c, topic: str, offset: int, **kw: int):  # type: ignore[no-untyped-def]
    r = await c.call("fetch", 12, fetch_body(topic, offset, **kw))
    return r.responses[0].partitions[0]


async def test_api_versions_advertises_kafka_4_minimums(broker: Broker) -> None:
    c = await broker.connect()
    r = await c.call("api_versions", 3, {"client_software_name": "raw-test", "client_software_version": "1.0"})
    assert r.error_code == 0
    ranges = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
    assert ranges[0] == (0, 11)  # Produce advertised from 0 for old librdkafka
    assert ranges[1] == (4, 12)
    assert ranges[18] == (0, 4)
    assert ranges[3] == (0, 12)
    assert r.supported_features == () and r.finalized_features == ()


async def test_unsupported_api_versions_gets_v0_fallback_and_connection_stays(broker: Broker) -> None:
    c = await broker.connect()
    # ApiVersions v9 does not exist: hand-build the header, the body must not be parsed.
    payload = struct.pack(">hhih", 18, 9, 42, 3) + b"abc" + b"\x00garbage-body"
    await c.stream.send_all(struct.pack(">i", len(payload)) + payload)
    frame = await c.read_frame()
    correlation_id, error, count = struct.unpack_from(">ihi", frame)
    assert (correlation_id, error) == (42, 35)
    keys = {struct.unpack_from(">h", frame, 10 + 6 * i)[0] for i in range(count)}
    assert 18 in keys
    r = await c.call("api_versions", 0, {})
    assert r.error_code == 0


async def test_invalid_software_name_is_invalid_request(broker: Broker) -> None:
    c = await broker.connect()
    r = await c.call("api_versions", 3, {"client_software_name": "-bad name-", "client_software_version": "1"})
    assert r.error_code == 42


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">i", 2**31 - 1) + b"x" * 10,  # absurd size: refused before allocating
        struct.pack(">i", -5),
        struct.pack(">ihhi", 10, 999, 0, 1) + b"\x00\x00",  # unknown api key
        struct.pack(">ihhi", 10, 0, 1, 1) + b"\x00\x00",  # Produce v1: removed in Kafka 4.0
        struct.pack(">i", 8) + b"\x00\x03\x00\x09\x00\x00\x00\x01",  # Metadata v9 body missing
    ],
)
async def test_hostile_bytes_close_only_that_connection(broker: Broker, garbage: bytes) -> None:
    bad = await broker.connect()
    await bad.stream.send_all(garbage)
    assert await bad.closed()
    good = await broker.connect()
    r = await good.call("api_versions", 0, {})
    assert r.error_code == 0


async def test_produce_fetch_round_trip_is_byte_exact(broker: Broker) -> None:
    await create(broker, "t")
    c = await broker.connect()
    b1 = batch([b"a", b"b", b"c"])
    b2 = batch([b"d"])
    r1 = await produce(c, "t", b1)
    r2 = await produce(c, "t", b2)
    assert (r1.error_code, r1.base_offset, r2.base_offset) == (0, 0, 3)
    p = await fetch(c, "t", 0)
    assert p.error_code == 0 and p.high_watermark == 4
    stored = bytes(p.records)
    # The broker wrote base offset and leader epoch (outside the CRC); the rest is as sent.
    expected = bytearray(b1 + b2)
    for position, base_offset in ((0, 0), (len(b1), 3)):
        struct.pack_into(">q", expected, position, base_offset)
        struct.pack_into(">i", expected, position + 12, 0)
    assert stored == bytes(expected)
    # A mid-batch offset returns the whole batch holding it.
    mid = await fetch(c, "t", 1)
    assert bytes(mid.records).startswith(stored[: len(b1)])
    # At the high watermark: empty but present; past it: OFFSET_OUT_OF_RANGE.
    end = await fetch(c, "t", 4)
    assert (end.error_code, bytes(end.records)) == (0, b"")
    past = await fetch(c, "t", 5)
    assert past.error_code == 1


async def test_fetch_returns_one_whole_batch_above_max_bytes(broker: Broker) -> None:
    await create(broker, "big")
    c = await broker.connect()
    data = batch([b"x" * 5000])
    await produce(c, "big", data)
    await produce(c, "big", data)
    p = await fetch(c, "big", 0, max_bytes=100, partition_max=100)
    assert len(p.records) == len(data)


async def test_fetch_long_poll_waits_for_data(broker: Broker) -> None:
    await create(broker, "poll")
    waiter = await broker.connect()
    writer = await broker.connect()
    got = {}

    async def poll() -> None:
        start = trio.current_time()
        got["p"] = await fetch(waiter, "poll", 0, max_wait=5000, min_bytes=1)
        got["t"] = trio.current_time() - start

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.sleep(0.3)
            await produce(writer, "poll", batch([b"late"]))
    assert got["p"].high_watermark == 1 and len(got["p"].records) > 0
    assert 0.25 < got["t"] < 4


async def test_fetch_long_poll_gives_up_after_max_wait(broker: Broker) -> None:
    await create(broker, "quiet")
    c = await broker.connect()
    start = trio.current_time()
    p = await fetch(c, "quiet", 0, max_wait=300, min_bytes=1)
    elapsed = trio.current_time() - start
    assert p.error_code == 0 and bytes(p.records) == b""
    assert 0.25 < elapsed < 3


async def test_produce_rejections(broker: Broker) -> None:
    await create(broker, "r", configs={"max.message.bytes": "2000"})
    c = await broker.connect()
    good = batch([b"v"])
    corrupt = bytearray(good)
    corrupt[-1] ^= 0xFF
    assert (await produce(c, "r", bytes(corrupt))).error_code == 2  # CORRUPT_MESSAGE
    assert (await produce(c, "r", batch([b"v" * 3000]))).error_code == 10  # MESSAGE_TOO_LARGE
    bad_count = bytearray(good)
    struct.pack_into(">i", bad_count, 57, 2)
    struct.pack_into(">I", bad_count, 17, crc32c.crc32c(bytes(bad_count[21:])))
    assert (await produce(c, "r", bytes(bad_count))).error_code == 87  # INVALID_RECORD
    zstd = bytearray(good)
    struct.pack_into(">h", zstd, 21, 4)
    struct.pack_into(">I", zstd, 17, crc32c.crc32c(bytes(zstd[21:])))
    assert (await produce(c, "r", bytes(zstd), version=6)).error_code == 76
    assert (await produce(c, "r", good + good)).error_code in (2, 87)  # two batches
    assert (await produce(c, "missing-partition", good, partition=5)).error_code == 3
    assert (await produce(c, "r", good)).error_code == 0


async def test_log_append_time_topic_stamps_batches(broker: Broker) -> None:
    await create(broker, "lat", configs={"message.timestamp.type": "LogAppendTime"})
    c = await broker.connect()
    r = await produce(c, "lat", batch([b"v"], timestamp_ms=1000))
    assert r.error_code == 0 and r.log_append_time is not None
    stored = bytes((await fetch(c, "lat", 0)).records)
    attributes, max_ts = struct.unpack_from(">h", stored, 21)[0], struct.unpack_from(">q", stored, 35)[0]
    assert attributes & 0x08 and abs(max_ts - NOW) < 600_000
    assert struct.unpack_from(">I", stored, 17)[0] == crc32c.crc32c(stored[21:])


async def test_idempotent_producer_duplicates_and_gaps(broker: Broker) -> None:
    await create(broker, "idem")
    c = await broker.connect()
    init = await c.call("init_producer_id", 4, {"transactional_id": None, "transaction_timeout": 60000, "producer_id": -1, "producer_epoch": -1})
    assert init.error_code == 0 and init.producer_id >= 0
    pid, epoch = init.producer_id, init.producer_epoch
    first = batch([b"a", b"b"], producer_id=pid, producer_epoch=epoch, base_sequence=0)
    assert (await produce(c, "idem", first)).base_offset == 0
    retry = await produce(c, "idem", first)
    assert (retry.error_code, retry.base_offset) == (0, 0)
    gap = await produce(c, "idem", batch([b"c"], producer_id=pid, producer_epoch=epoch, base_sequence=5))
    assert gap.error_code == 45
    nxt = await produce(c, "idem", batch([b"c"], producer_id=pid, producer_epoch=epoch, base_sequence=2))
    assert (nxt.error_code, nxt.base_offset) == (0, 2)
    p = await fetch(c, "idem", 0)
    assert p.high_watermark == 3
    other = await c.call("init_producer_id", 4, {"transactional_id": None, "transaction_timeout": 60000, "producer_id": -1, "producer_epoch": -1})
    assert other.producer_id != pid


async def test_acks_zero_gets_no_response(broker: Broker) -> None:
    await create(broker, "fire")
    c = await broker.connect()
    await c.send("produce", 9, {"acks": 0, "timeout": 5000, "topic_data": [{"name": "fire", "partition_data": [{"index": 0, "records": batch([b"x"])}]}]})
    # The next response on the connection belongs to the next request.
    r = await c.call("api_versions", 0, {})
    assert r.error_code == 0
    # The batch was appended: a long poll for it returns at once.
    with trio.fail_after(5):
        p = await fetch(c, "fire", 0, max_wait=4000, min_bytes=1)
    assert p.high_watermark == 1


async def test_list_offsets(broker: Broker) -> None:
    await create(broker, "lo")
    c = await broker.connect()
    await produce(c, "lo", batch([b"a", b"b"], timestamp_ms=NOW - 2000))
    await produce(c, "lo", batch([b"c"], timestamp_ms=NOW - 1000))

    async def lookup(ts: int) -> tuple[int, int, int]:
        r = await c.call(
            "list_offsets",
            7,
            {"replica_id": -1, "isolation_level": 0, "topics": [{"name": "lo", "partitions": [{"partition_index": 0, "timestamp": ts}]}]},
        )
        p = r.topics[0].partitions[0]
        return p.error_code, p.offset, p.timestamp

    assert (await lookup(-1))[:2] == (0, 3)
    assert (await lookup(-2))[:2] == (0, 0)
    assert await lookup(NOW - 1500) == (0, 2, NOW - 1000)
    assert await lookup(NOW - 5000) == (0, 0, NOW - 2000)
    assert await lookup(NOW) == (0, -1, -1)
    assert (await lookup(-3))[:2] == (0, 2)


async def test_metadata_lists_auto_creates_and_respects_the_flag(broker: Broker) -> None:
    await create(broker, "m1", partitions=3)
    c = await broker.connect()
    everything = await c.call("metadata", 12, {"topics": None, "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    names = {t.name: t for t in everything.topics}
    assert len(names["m1"].partitions) == 3 and names["m1"].topic_id != uuid.UUID(int=0)
    assert everything.controller_id == 0 and [b.node_id for b in everything.brokers] == [0]
    assert everything.cluster_id
    empty = await c.call("metadata", 12, {"topics": [], "allow_auto_topic_creation": True, "include_topic_authorized_operations": False})
    assert empty.topics == ()
    refused = await c.call("metadata", 12, {"topics": [{"name": "nope", "topic_id": None}], "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})
    assert refused.topics[0].error_code == 3
    made = await c.call("metadata", 12, {"topics": [{"name": "auto", "topic_id": None}], "allow_auto_topic_creation": True, "include_topic_authorized_operations": False})
    assert made.topics[0].error_code == 0 and len(made.topics[0].partitions) == 1
    again = await c.call("metadata", 12, {"topics": [{"name": "auto", "topic_id": None}], "allow_auto_topic_creation": True, "include_topic_authorized_operations": False})
    assert again.topics[0].topic_id == made.topics[0].topic_id
    bad = await c.call("metadata", 4, {"topics": [{"name": "bad name!"}], "allow_auto_topic_creation": True})
    assert bad.topics[0].error_code == 17
    v0 = await c.call("metadata", 0, {"topics": []})
    assert {t.name for t in v0.topics} >= {"m1", "auto"}


async def test_create_delete_and_describe_topics(broker: Broker) -> None:
    c = await broker.connect()
    body = {
        "topics": [{"name": "adm", "num_partitions": -1, "replication_factor": -1, "assignments": [], "configs": [{"name": "retention.ms", "value": "1000"}]}],
        "timeout": 5000,
        "validate_only": False,
    }
    r = await c.call("create_topics", 7, body)
    t = r.topics[0]
    assert (t.error_code, t.num_partitions, t.replication_factor) == (0, 1, 1)
    assert {x.name: x.value for x in t.configs}["retention.ms"] == "1000"
    assert (await c.call("create_topics", 7, body)).topics[0].error_code == 36
    bad = dict(body, topics=[dict(body["topics"][0], name="adm2", configs=[{"name": "no.such", "value": "1"}])])  # type: ignore[index]
    assert (await c.call("create_topics", 7, bad)).topics[0].error_code == 40
    rf = dict(body, topics=[dict(body["topics"][0], name="adm3", replication_factor=3, configs=[])])  # type: ignore[index]
    assert (await c.call("create_topics", 7, rf)).topics[0].error_code == 38

    d = await c.call("describe_configs", 4, {"resources": [{"resource_type": 2, "resource_name": "adm", "configuration_keys": None}], "include_synonyms": True, "include_documentation": True})
    configs = {x.name: x for x in d.results[0].configs}
    assert configs["retention.ms"].value == "1000" and configs["retention.ms"].config_source == 1
    assert configs["max.message.bytes"].value == "1048588" and configs["max.message.bytes"].config_source == 5
    assert len(configs) > 20
    brokers = await c.call("describe_configs", 1, {"resources": [{"resource_type": 4, "resource_name": "0", "configuration_keys": None}], "include_synonyms": False})
    assert brokers.results[0].error_code == 0 and brokers.results[0].configs

    cluster = await c.call("describe_cluster", 1, {"include_cluster_authorized_operations": False, "endpoint_type": 1})
    assert cluster.error_code == 0 and cluster.brokers[0].port == broker.port

    gone = await c.call("delete_topics", 6, {"topics": [{"name": "adm", "topic_id": None}, {"name": "never", "topic_id": None}], "timeout": 5000})
    assert [x.error_code for x in gone.responses] == [0, 3]
    old = await c.call("delete_topics", 1, {"topic_names": ["adm"], "timeout": 5000})
    assert old.responses[0].error_code == 3


async def test_offset_for_leader_epoch(broker: Broker) -> None:
    await create(broker, "ofle")
    c = await broker.connect()
    await produce(c, "ofle", batch([b"a", b"b"]))
    r = await c.call(
        "offset_for_leader_epoch",
        4,
        {"replica_id": -1, "topics": [{"topic": "ofle", "partitions": [{"partition": 0, "current_leader_epoch": 0, "leader_epoch": 0}, {"partition": 0, "current_leader_epoch": -1, "leader_epoch": 7}]}]},
    )
    a, b = r.topics[0].partitions
    assert (a.error_code, a.leader_epoch, a.end_offset) == (0, 0, 2)
    assert (b.leader_epoch, b.end_offset) == (-1, -1)


async def test_acks_zero_error_closes_the_connection(broker: Broker) -> None:
    await create(broker, "fire0")
    c = await broker.connect()
    corrupt = bytearray(batch([b"x"]))
    corrupt[-1] ^= 1
    await c.send("produce", 9, {"acks": 0, "timeout": 5000, "topic_data": [{"name": "fire0", "partition_data": [{"index": 0, "records": bytes(corrupt)}]}]})
    assert await c.closed()


@pytest.mark.parametrize("size", [100 * 1024, 700 * 1024])
async def test_large_produce_requests_on_both_decoder_paths(broker: Broker, size: int) -> None:
    # Frames of 64 KiB or more come out of the frame decoder writable; below 512 KiB kio
    # decodes them, above it the fast path does. Both must take them.
    await create(broker, f"large{size}")
    c = await broker.connect()
    data = batch([bytes([i % 251]) * (size // 4) for i in range(4)])
    r = await produce(c, f"large{size}", data)
    assert (r.error_code, r.base_offset) == (0, 0)
    stored = bytes((await fetch(c, f"large{size}", 0, max_bytes=2 << 20, partition_max=2 << 20)).records)
    assert stored[16:] == data[16:]


async def test_internal_topic_is_written_by_the_broker_alone(broker: Broker) -> None:
    c = await broker.connect()
    r = await produce(c, "__consumer_offsets", batch([b"forged"]))
    assert r.error_code == 17
    gone = await c.call("delete_topics", 6, {"topics": [{"name": "__consumer_offsets", "topic_id": None}], "timeout": 5000})
    assert gone.responses[0].error_code == 17


async def test_group_timer_loop_sleeps_when_nothing_is_due(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    # The coordinator's timer loop once woke itself after every tick: a busy loop that
    # took a whole core and starved rebalances. Idle, it must not tick at all.
    from broker.groups.state import Groups

    ticks = 0
    real_tick = Groups.tick

    def counting_tick(self: Groups, now: int) -> None:
        nonlocal ticks
        ticks += 1
        real_tick(self, now)

    monkeypatch.setattr(Groups, "tick", counting_tick)
    c = await broker.connect()
    join = {"group_id": "idle", "session_timeout": 10000, "rebalance_timeout": 10000, "member_id": "",
            "protocol_type": "consumer", "protocols": [{"name": "range", "metadata": b""}]}
    r = await c.call("join_group", 4, join)  # a group request wakes the loop once
    assert r.error_code == 79  # MEMBER_ID_REQUIRED
    ticks = 0
    await trio.sleep(0.5)
    assert ticks <= 2, f"the group timer loop ticked {ticks} times in 0.5 s while idle"


async def test_pipelined_produces_keep_order_across_commit_rounds(broker: Broker) -> None:
    # Many requests in flight on one connection, to two partitions, idempotent, sizes on
    # both sides of the inline-round threshold (64 KiB), and a retry of an earlier batch
    # while it may still be queued: offsets follow admission order, the retry gets the
    # first offsets back, responses come in request order, and the log holds each batch
    # once, byte for byte.
    await create(broker, "pipe", partitions=2)
    c = await broker.connect()
    init = await c.call("init_producer_id", 4, {"transactional_id": None, "transaction_timeout": 60000, "producer_id": -1, "producer_epoch": -1})
    pid = init.producer_id
    seq = [0, 0]
    sent = []
    batches: list[list[bytes]] = [[], []]
    for i in range(24):
        part = i % 2
        size = 90 * 1024 if i % 3 == 0 else 300
        values = [bytes([i]) * size, bytes([i + 1]) * 10]
        data = batch(values, producer_id=pid, producer_epoch=0, base_sequence=seq[part])
        seq[part] += len(values)
        batches[part].append(data)
        body = {"acks": -1, "timeout": 10000, "topic_data": [{"name": "pipe", "partition_data": [{"index": part, "records": data}]}]}
        sent.append(await c.send("produce", 9, body))
        if i == 6:
            retry = {"acks": -1, "timeout": 10000, "topic_data": [{"name": "pipe", "partition_data": [{"index": 0, "records": batches[0][1]}]}]}
            sent.append(await c.send("produce", 9, retry))
    with trio.fail_after(30):
        answers = [await c.receive(s) for s in sent]
    bases = [a.responses[0].partition_responses[0] for a in answers]
    assert all(b.error_code == 0 for b in bases)
    retried = bases.pop(7)
    assert retried.base_offset == 2  # the second batch of partition 0, offsets 2-3
    assert [b.base_offset for b in bases[0::2]] == [2 * k for k in range(12)]
    assert [b.base_offset for b in bases[1::2]] == [2 * k for k in range(12)]
    for part in (0, 1):
        r = await c.call("fetch", 12, {**fetch_body("pipe", 0, max_bytes=8 << 20, partition_max=8 << 20), "topics": [
            {"topic": "pipe", "partitions": [{"partition": part, "fetch_offset": 0, "partition_max_bytes": 8 << 20, "log_start_offset": -1}]}
        ]})
        p = r.responses[0].partitions[0]
        assert p.high_watermark == 24
        stored = bytes(p.records)
        expected = bytearray(b"".join(batches[part]))
        position = 0
        for k, b in enumerate(batches[part]):
            struct.pack_into(">q", expected, position, 2 * k)
            struct.pack_into(">i", expected, position + 12, 0)
            position += len(b)
        assert stored == bytes(expected)


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


async def test_large_fetches_go_out_by_sendfile_byte_exact_and_close_their_descriptors(broker: Broker) -> None:
    # Batches above SENDFILE_MIN_BYTES travel as file ranges: the answer must be the very
    # bytes stored (v4 and v12 framing around them), a long poll that reads again must not
    # leak the ranges it read first, and nothing stays open afterwards.
    from broker.sendfile import SENDFILE_MIN_BYTES

    await create(broker, "big")
    c = await broker.connect()
    values = [bytes([i]) * (SENDFILE_MIN_BYTES // 2) for i in range(3)]
    data = batch(values)
    assert len(data) > SENDFILE_MIN_BYTES
    assert (await produce(c, "big", data)).error_code == 0
    waiter = await broker.connect()
    before = _open_fds()
    for version in (4, 12):
        body = fetch_body("big", 0, max_bytes=8 << 20, partition_max=8 << 20)
        r = await c.call("fetch", version, body)
        p = r.responses[0].partitions[0]
        stored = bytearray(data)
        struct.pack_into(">q", stored, 0, 0)  # the base offset the log gave it
        struct.pack_into(">i", stored, 12, 0)
        assert p.error_code == 0 and bytes(p.records) == bytes(stored)
    # min_bytes above what is there: the long poll reads, waits, reads again.
    got = {}

    async def poll() -> None:
        got["p"] = await fetch(waiter, "big", 0, max_wait=5000, min_bytes=len(data) + 1, max_bytes=8 << 20, partition_max=8 << 20)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(poll)
            await trio.sleep(0.2)
            assert (await produce(c, "big", batch(values))).error_code == 0
    assert len(got["p"].records) == 2 * len(data)
    assert _open_fds() == before


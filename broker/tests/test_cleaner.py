"""Compacted topics over the wire: keyless records refused as Kafka's LogValidator does
(nothing signed), the cleaner leaving the last record per key with its offset, tombstones
gone after delete.retention.ms, retention never dropping a compact-only topic's data,
transactions compacted by their outcome below the LSO (and rebuilt right after a restart)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from broker.config import BrokerConfig
from broker.protocol import records
from broker.tests.conftest import Broker
from broker.tests.test_server import NOW, create, fetch, produce
from storage.batch import build_batch


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(
        data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2, log_cleaner_backoff_ms=20
    )


def keyed(pairs: list[tuple[bytes | None, bytes | None]]) -> bytes:
    return bytes(build_batch([v for _, v in pairs], keys=[k for k, _ in pairs], timestamp_ms=NOW))


async def read_all(c, topic: str) -> list[tuple[int, bytes | None, bytes | None]]:  # type: ignore[no-untyped-def]
    out: list[tuple[int, bytes | None, bytes | None]] = []
    offset = 0
    while True:
        p = await fetch(c, topic, offset)
        data = bytes(p.records or b"")
        if not data:
            return out
        for b in records.split_batches(data):
            out += [(r.offset, r.key, r.value) for r in records.decode_records(b)]
            offset = records.parse_batch_header(b).last_offset + 1


COMPACT = {"cleanup.policy": "compact", "segment.bytes": "14", "min.cleanable.dirty.ratio": "0.01"}


async def test_keyless_records_are_refused_on_a_compacted_topic(broker: Broker) -> None:
    await create(broker, "c", configs=COMPACT)
    c = await broker.connect()
    r = await produce(c, "c", keyed([(b"k", b"v"), (None, b"no key")]), version=9)
    assert r.error_code == 87
    assert (
        r.error_message
        == "Compacted topic cannot accept message without key in topic partition c-0"
    )
    assert [e.batch_index for e in r.record_errors] == [1]
    assert (await fetch(c, "c", 0)).high_watermark == 0  # nothing stored or signed
    # the same batch goes to a delete topic
    await create(broker, "d")
    assert (await produce(c, "d", keyed([(b"k", b"v"), (None, b"no key")]))).error_code == 0


async def test_the_cleaner_keeps_the_last_value_per_key_at_its_offset(broker: Broker) -> None:
    await create(broker, "c", configs={**COMPACT, "delete.retention.ms": "0", "retention.ms": "1"})
    c = await broker.connect()
    for i in range(40):
        key = b"k%d" % (i % 5)
        value = None if i == 37 else b"v%d" % i  # k2's last record (37) is a tombstone
        assert (await produce(c, "c", keyed([(key, value)]))).error_code == 0
    assert (await produce(c, "c", keyed([(b"last", b"x")]))).error_code == 0  # active segment
    with trio.fail_after(10):
        # the cleaner runs in the broker's own loop, on its timer: poll what a consumer sees
        while len(got := await read_all(c, "c")) > 5:  # noqa: ASYNC110
            await trio.sleep(0.05)
    # k2's tombstone went (delete.retention.ms=0) with every older k2; the others keep
    # their last value at its original offset; retention.ms=1 dropped nothing (no delete)
    assert got == [
        (35, b"k0", b"v35"),
        (36, b"k1", b"v36"),
        (38, b"k3", b"v38"),
        (39, b"k4", b"v39"),
        (40, b"last", b"x"),
    ]
    p = await fetch(c, "c", 0)
    assert p.log_start_offset == 0 and p.high_watermark == 41


def test_retention_drops_segments_only_when_the_policy_says_delete() -> None:
    cfg = BrokerConfig()
    assert cfg.log_config({"cleanup.policy": "compact", "retention.ms": "1"}).retention_ms == -1
    assert (
        cfg.log_config({"cleanup.policy": "compact", "retention.bytes": "1"}).retention_bytes == -1
    )
    assert (
        cfg.log_config({"cleanup.policy": "compact,delete", "retention.ms": "1"}).retention_ms == 1
    )
    assert cfg.log_config({"retention.ms": "1"}).retention_ms == 1


async def test_compact_delete_is_accepted_and_described(broker: Broker) -> None:
    await create(
        broker,
        "cd",
        configs={**COMPACT, "cleanup.policy": "compact,delete", "retention.ms": "1000"},
    )
    c = await broker.connect()
    for i in range(3):
        data = bytes(build_batch([b"v"], keys=[b"k%d" % i], timestamp_ms=NOW - 10_000))
        assert (await produce(c, "cd", data)).error_code == 0
    assert (await produce(c, "cd", keyed([(b"z", b"z")]))).error_code == 0
    r = await c.call(
        "describe_configs",
        4,
        {
            "resources": [
                {
                    "resource_type": 2,
                    "resource_name": "cd",
                    "configuration_keys": ["cleanup.policy"],
                }
            ],
            "include_synonyms": False,
            "include_documentation": False,
        },
    )
    entry = r.results[0].configs[0]
    assert (entry.name, entry.value, int(entry.config_source)) == (
        "cleanup.policy",
        "compact,delete",
        1,
    )


@pytest.mark.parametrize("codec", [0, 1, 4])
def test_keyless_record_scan_agrees_with_decoding(codec: int) -> None:
    import random

    from broker.cleaner import keyless_record
    from broker.protocol.compression import recompress_batch

    rnd = random.Random(codec)
    for _ in range(200):
        n = rnd.randint(1, 30)
        keys: list[bytes | None] = [
            rnd.choice([None, b"", b"k", rnd.randbytes(rnd.randint(60, 300))]) for _ in range(n)
        ]
        if rnd.random() < 0.5:
            keys = [k if k is not None else b"x" for k in keys]
        values = [rnd.choice([None, rnd.randbytes(rnd.randint(0, 200))]) for _ in range(n)]
        b = build_batch(
            values, keys=keys, timestamps=[NOW + rnd.randint(0, 10**6) for _ in range(n)]
        )
        if codec:
            b = recompress_batch(b, codec)
        truth = next((i for i, r in enumerate(records.decode_records(b)) if r.key is None), None)
        assert keyless_record(b) == truth


def test_control_and_transactional_batches_stay_whole_and_supersede_nothing() -> None:
    import struct

    from broker.cleaner import keys_of
    from broker.protocol.records import compute_crc

    plain = build_batch([b"v"], keys=[b"k"], timestamp_ms=NOW)
    assert keys_of(bytes(plain)) == [(0, b"k", False)]
    for attr in (0x10, 0x20):  # transactional, control
        b = bytearray(plain)
        struct.pack_into(">h", b, 21, attr)
        struct.pack_into(">I", b, 17, compute_crc(b))
        assert keys_of(bytes(b)) is None


def keyed_txn(pid: int, seq: int, pairs: list[tuple[bytes, bytes]], ts: int) -> bytes:
    """A transactional batch of keyed records of producer `pid` (epoch 0)."""
    import struct

    from broker.protocol.records import compute_crc

    b = build_batch(
        [v for _, v in pairs],
        keys=[k for k, _ in pairs],
        timestamp_ms=ts,
        producer_id=pid,
        producer_epoch=0,
        base_sequence=seq,
    )
    struct.pack_into(">h", b, 21, 0x10)
    struct.pack_into(">I", b, 17, compute_crc(b))
    return bytes(b)


async def test_the_cleaner_compacts_transactions_by_their_outcome(
    broker_config: BrokerConfig,
) -> None:
    """Below the LSO only: an aborted transaction's batch goes and supersedes nothing, a
    committed one's is compacted as any other, a marker goes once its transaction has no
    batch left (delete.retention.ms=0), and after a restart the transactions rebuilt
    from what stayed leave no transaction open (the LSO is the high watermark)."""
    import time

    from broker.server import run
    from broker.tests.test_transactions import add, end, init
    from broker.tests.test_transactions import fetch as txn_fetch
    from broker.tests.test_transactions import produce as txn_produce

    async def seen(c, isolation: int = 0) -> list[tuple[int, bool, bytes | None]]:  # type: ignore[no-untyped-def]
        """(offset, is control, key) of every record a fetch from 0 on returns."""
        out: list[tuple[int, bool, bytes | None]] = []
        offset = 0
        while data := bytes((await txn_fetch(c, "t", isolation, offset)).records or b""):
            for b in records.split_batches(data):
                h = records.parse_batch_header(b)
                out += [(r.offset, h.is_control, r.key) for r in records.decode_records(b)]
                offset = h.last_offset + 1
        return out

    async def offsets(c) -> list[int]:  # type: ignore[no-untyped-def]
        return [o for o, _, _ in await seen(c)]

    now = int(time.time() * 1000)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        await create(b, "t", configs={**COMPACT, "delete.retention.ms": "0"})
        c = await b.connect()
        pid = (await init(c)).producer_id
        for seq, (key, commit) in enumerate([(b"k", True), (b"k", False), (b"k2", True)]):
            assert await add(c, pid, 0, "t") == 0
            batch = keyed_txn(pid, seq, [(key, b"v%d" % seq)], now)
            assert (await txn_produce(c, "t", batch)).error_code == 0
            assert await end(c, pid, 0, commit) == 0
        # 0 k committed, 1 marker, 2 k aborted, 3 marker, 4 k2 committed, 5 marker;
        # then 6 k in a transaction left open, 7 k2 outside transactions
        assert await add(c, pid, 0, "t") == 0
        assert (await txn_produce(c, "t", keyed_txn(pid, 3, [(b"k", b"v3")], now))).error_code == 0
        assert (await produce(c, "t", keyed([(b"k2", b"plain")]))).error_code == 0
        with trio.fail_after(10):
            # the aborted batch and its marker go; k at 0 stays: 2 (aborted) does not
            # supersede it, 6 is past the LSO (6)
            while await offsets(c) != [0, 1, 4, 5, 6, 7]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert await end(c, pid, 0, True) == 0  # 8: the marker of the one at 6
        assert (await produce(c, "t", keyed([(b"last", b"x")]))).error_code == 0  # 9
        with trio.fail_after(10):
            # now 6 supersedes 0 (whose marker then goes too), 7 supersedes 4 (so 5 goes)
            while await offsets(c) != [6, 7, 8, 9]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        f = await txn_fetch(c, "t", 1)
        assert (f.high_watermark, f.last_stable_offset) == (10, 10)
        assert await seen(c, 1) == [
            (6, False, b"k"),
            (7, False, b"k2"),
            (8, True, b"\x00\x00\x00\x01"),  # a COMMIT marker's key (version 0, type 1)
            (9, False, b"last"),
        ]
        nursery.cancel_scope.cancel()


async def test_the_cleaner_keeps_each_producers_last_batch_so_a_retry_stays_a_duplicate(
    broker_config: BrokerConfig,
) -> None:
    """An idempotent producer's only batch is superseded by later records of its key,
    yet stays (as Kafka's cleaner keeps it): after a restart its retry is answered as a
    duplicate at the offset it was first given, not appended a second time."""
    from broker.server import run
    from broker.tests.test_transactions import init

    async def kept(c) -> list[int]:  # type: ignore[no-untyped-def]
        return [o for o, _, _ in await read_all(c, "t")]

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        b = Broker(broker_config, listeners[0].socket.getsockname()[1])
        await create(b, "t", configs=COMPACT)
        c = await b.connect()
        pid = (await init(c, tid=None)).producer_id  # type: ignore[arg-type]
        first = bytes(
            build_batch(
                [b"v0"],
                keys=[b"k"],
                timestamp_ms=NOW,
                producer_id=pid,
                producer_epoch=0,
                base_sequence=0,
            )
        )
        assert (await produce(c, "t", first)).base_offset == 0
        for i in range(1, 6):
            assert (await produce(c, "t", keyed([(b"k", b"v%d" % i)]))).error_code == 0
        assert (await produce(c, "t", keyed([(b"last", b"x")]))).error_code == 0  # 6
        with trio.fail_after(10):
            while await kept(c) != [0, 5, 6]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        retry = await produce(c, "t", first)
        assert (retry.error_code, retry.base_offset) == (0, 0)
        assert (await fetch(c, "t", 0)).high_watermark == 7
        nursery.cancel_scope.cancel()

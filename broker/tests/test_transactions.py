"""Transactions end to end over a real socket with raw protocol messages, and the pure
pieces (records, a partition's transaction index) on their own.

Pins what clients only show indirectly: the coordinator's error codes (fencing, state),
that a transactional batch is refused outside its transaction, that markers are control
batches in the archive, the last stable offset and aborted transactions in Fetch and
ListOffsets, TxnOffsetCommit's offsets appearing only on commit, and recovery after a
restart (prepared transactions completed, open ones aborted on their timeout).
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import crc32c
import pytest
import trio

from broker.config import BrokerConfig
from broker.groups.codes import UNKNOWN_MEMBER_ID, UNSTABLE_OFFSET_COMMIT
from broker.groups.consumer_group import STALE_MEMBER_EPOCH
from broker.protocol import records as batches
from broker.server import run
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_consumer_group_handlers import hb_body
from broker.transactions.partition import PartitionTxns, last_stable_offset, rebuild_txns
from broker.transactions.records import (
    MarkerType,
    Status,
    TxnOffset,
    TxnValue,
    control_batch,
    decode_key,
    decode_offsets,
    decode_value,
    encode_offsets,
    encode_value,
    marker_coordinator_epoch,
    marker_type,
    offsets_key,
    state_key,
)
from storage.batch import build_batch

CONCURRENT_TRANSACTIONS, INVALID_TXN_STATE, PRODUCER_FENCED, INVALID_PRODUCER_EPOCH = 51, 48, 90, 47
INVALID_PRODUCER_ID_MAPPING, INVALID_RECORD, INVALID_TRANSACTION_TIMEOUT = 49, 87, 50
UNKNOWN_TOPIC_OR_PARTITION, INVALID_TOPIC_EXCEPTION, TRANSACTIONAL_ID_NOT_FOUND = 3, 17, 105


# ------------------------------------------------------------------ pure pieces


def test_state_records_round_trip() -> None:
    v = TxnValue(7, 3, 60000, Status.ONGOING, (("a", 0), ("a", 2), ("b", 1)), 111, 100)
    assert decode_value(encode_value(v)) == v
    assert decode_key(state_key("tid")) == (0, "tid")
    assert decode_key(offsets_key("tid")) == (100, "tid")
    offsets = [TxnOffset("g", "t", 1, 42, -1, "meta"), TxnOffset("g2", "u", 0, 7, 3, "")]
    assert decode_offsets(encode_offsets(7, 3, offsets)) == (7, 3, offsets)
    assert Status.PREPARE_COMMIT.kafka_name == "PrepareCommit"


def test_control_batch_is_a_valid_transactional_control_batch() -> None:
    batch = control_batch(MarkerType.ABORT, 9, 2, 0, 1000)
    header = batches.parse_batch_header(batch)
    assert header.is_control and header.is_transactional
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (9, 2, -1)
    batches.verify_crc(batch)
    [rec] = list(batches.iter_records(batch))
    assert marker_type(rec.key) is MarkerType.ABORT
    assert marker_type(b"\x00\x00\x00\x07") is None


def test_partition_index_lso_and_aborted() -> None:
    t = PartitionTxns()
    t.on_data(1, 0)
    t.on_data(2, 3)
    t.on_data(1, 5)  # same transaction: the first offset stays
    assert t.lso(10) == 0
    t.on_marker(1, MarkerType.ABORT, 10)
    assert t.lso(10) == 0  # the marker is not under the high watermark yet
    assert t.lso(11) == 3
    t.on_marker(2, MarkerType.COMMIT, 11)
    assert t.lso(12) == 12
    assert [(a.producer_id, a.first_offset) for a in t.aborted_in(0, 12)] == [(1, 0)]
    assert t.aborted_in(11, 20) == []  # the aborted transaction ended before
    t.forget_below(11)
    assert t.aborted_in(0, 12) == []


def test_the_coordinator_epoch_of_markers_is_kept_per_producer_and_rebuilt() -> None:
    """Each marker's control record carries its coordinator's epoch; the partition keeps
    the newest per producer id (an equal one is the same coordinator's retry), and a
    rebuild from the stored batches finds it again."""
    batch = control_batch(MarkerType.COMMIT, 9, 2, 41, 1000)
    [rec] = list(batches.iter_records(batch))
    assert marker_coordinator_epoch(rec.value) == 41 and marker_coordinator_epoch(None) == -1
    t = PartitionTxns()
    assert not t.coordinator_fenced(9, 0)  # no marker yet: any epoch (an admin's 0 too)
    t.on_data(9, 0)
    t.on_marker(9, MarkerType.COMMIT, 1, 41)
    assert t.coordinator_fenced(9, 40) and not t.coordinator_fenced(9, 41)
    assert not t.coordinator_fenced(8, 0)  # per producer id
    stored_batches = {0: txn_batch(9, 2, 0, b"x"), 1: bytes(control_batch(MarkerType.COMMIT, 9, 2, 41, 1000))}
    headers = []
    for offset, b in stored_batches.items():
        raw = bytearray(b[:61])
        struct.pack_into(">q", raw, 0, offset)
        headers.append(bytes(raw))

    def marker_at(offset: int) -> tuple[MarkerType, int] | None:
        [r] = list(batches.iter_records(stored_batches[offset]))
        kind = marker_type(r.key)
        return None if kind is None else (kind, marker_coordinator_epoch(r.value))

    rebuilt = PartitionTxns()
    rebuilt.rebuild(headers, marker_at)
    assert rebuilt.coordinator_epochs == {9: 41} and rebuilt.ongoing == {}


def test_marker_epoch_records_of_the_offsets_archive() -> None:
    """The group coordinator's record of a marker's coordinator epoch (key version 101):
    round trip, replayed as the last word, tombstone drops it."""
    from broker.groups.offsets import Replayed, decode_any_key
    from broker.groups.records import MarkerKey, decode_marker_value, marker_key, marker_value

    key = decode_any_key(marker_key(7, 1 << 40))
    assert key == MarkerKey(7, 1 << 40)
    assert decode_marker_value(marker_value(12, 3)) == (12, 3)
    r = Replayed()
    r.apply(0, key, marker_value(5, 0))
    r.apply(1, key, marker_value(12, 0))
    assert r.marker_epochs == {(7, 1 << 40): 12}
    r.apply(2, key, None)
    assert r.marker_epochs == {}
    # A takeover adopts it with its partition of __consumer_offsets (not by a group).
    from broker.groups.coordinator import GroupCoordinator

    in_shards: Any = GroupCoordinator._in_shards
    assert in_shards(None, marker_key(7, 1), {7: 0}) and not in_shards(None, marker_key(7, 1), {8: 0})


# ------------------------------------------------------------------ over the wire


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)
    config.static.update({"transaction.abort.timed.out.transaction.cleanup.interval.ms": "100"})
    return config


async def create(c: RawClient, name: str, partitions: int = 1) -> None:
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
                    "configs": [],
                }
            ],
            "timeout": 5000,
            "validate_only": False,
        },
    )
    assert r.topics[0].error_code == 0


def txn_batch(
    pid: int,
    epoch: int,
    seq: int,
    *values: bytes,
    transactional: bool = True,
    control: bool = False,
) -> bytes:
    batch = build_batch(
        list(values),
        timestamp_ms=1_700_000_000_000,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=seq,
    )
    attributes = (0x10 if transactional else 0) | (0x20 if control else 0)
    struct.pack_into(">h", batch, 21, attributes)
    struct.pack_into(">I", batch, 17, crc32c.crc32c(bytes(batch[21:])))
    return bytes(batch)


async def produce(c: RawClient, topic: str, data: bytes, tid: str | None = "tid") -> Any:
    r = await c.call(
        "produce",
        8,
        {
            "acks": -1,
            "timeout": 5000,
            "transactional_id": tid,
            "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": data}]}],
        },
    )
    return r.responses[0].partition_responses[0]


async def fetch(c: RawClient, topic: str, isolation: int, offset: int = 0) -> Any:
    r = await c.call(
        "fetch",
        11,
        {
            "replica_id": -1,
            "max_wait": 0,
            "min_bytes": 0,
            "max_bytes": 1 << 20,
            "isolation_level": isolation,
            "session_id": 0,
            "session_epoch": -1,
            "rack_id": "",
            "forgotten_topics_data": [],
            "topics": [
                {
                    "topic": topic,
                    "partitions": [
                        {
                            "partition": 0,
                            "current_leader_epoch": -1,
                            "fetch_offset": offset,
                            "log_start_offset": -1,
                            "partition_max_bytes": 1 << 20,
                        }
                    ],
                }
            ],
        },
    )
    return r.responses[0].partitions[0]


async def list_latest(c: RawClient, topic: str, isolation: int) -> int:
    r = await c.call(
        "list_offsets",
        5,
        {
            "replica_id": -1,
            "isolation_level": isolation,
            "topics": [
                {
                    "name": topic,
                    "partitions": [
                        {"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}
                    ],
                }
            ],
        },
    )
    return int(r.topics[0].partitions[0].offset)


async def init(
    c: RawClient, tid: str = "tid", txn_timeout: int = 60000, pid: int = -1, epoch: int = -1
) -> Any:
    return await c.call(
        "init_producer_id",
        4,
        {
            "transactional_id": tid,
            "transaction_timeout": txn_timeout,
            "producer_id": pid,
            "producer_epoch": epoch,
        },
    )


async def add(c: RawClient, pid: int, epoch: int, topic: str, tid: str = "tid") -> int:
    r = await c.call(
        "add_partitions_to_txn",
        3,
        {
            "v3_and_below_transactional_id": tid,
            "v3_and_below_producer_id": pid,
            "v3_and_below_producer_epoch": epoch,
            "v3_and_below_topics": [{"name": topic, "partitions": [0]}],
        },
    )
    return int(r.results_by_topic_v3_and_below[0].results_by_partition[0].partition_error_code)


async def end(c: RawClient, pid: int, epoch: int, commit: bool, tid: str = "tid") -> int:
    r = await c.call(
        "end_txn",
        3,
        {"transactional_id": tid, "producer_id": pid, "producer_epoch": epoch, "committed": commit},
    )
    return int(r.error_code)


async def txn_commit(
    c: RawClient,
    pid: int,
    group: str,
    topic: str,
    offset: int,
    *,
    generation: int = -1,
    member: str = "",
) -> int:
    """TxnOffsetCommit v3 of one partition (`topic`, 0): its error code."""
    r = await c.call(
        "txn_offset_commit",
        3,
        {
            "transactional_id": "tid",
            "group_id": group,
            "producer_id": pid,
            "producer_epoch": 0,
            "generation_id": generation,
            "member_id": member,
            "group_instance_id": None,
            "topics": [
                {
                    "name": topic,
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": offset,
                            "committed_leader_epoch": -1,
                            "committed_metadata": "",
                        }
                    ],
                }
            ],
        },
    )
    return int(r.topics[0].partitions[0].error_code)


def stored(records: bytes) -> list[tuple[int, bool, list[bytes | None]]]:
    """(base offset, is control, values) of every batch of a fetch answer."""
    return [
        (
            batches.parse_batch_header(b).base_offset,
            batches.parse_batch_header(b).is_control,
            [r.value for r in batches.iter_records(b)],
        )
        for b in batches.split_batches(records)
    ]


async def test_transactional_batch_only_inside_its_transaction(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "t")
    r = await init(c)
    assert (r.error_code, r.producer_epoch) == (0, 0)
    pid = r.producer_id
    # Not added to the transaction: refused (KIP-890 part 1) before the log, nothing stored.
    refused = await produce(c, "t", txn_batch(pid, 0, 0, b"a"))
    assert (refused.error_code, refused.log_start_offset) == (INVALID_TXN_STATE, -1)
    # Transactional records in a request without a transactional id: Kafka's ACL check.
    anonymous = await produce(c, "t", txn_batch(pid, 0, 0, b"a"), tid=None)
    assert (anonymous.error_code, anonymous.log_start_offset) == (53, -1)
    # A control batch from a client: refused whatever its state.
    assert (
        await produce(c, "t", txn_batch(pid, 0, 0, b"x", control=True))
    ).error_code == INVALID_RECORD
    # A transactional batch of a producer id no transactional id has.
    assert (
        await produce(c, "t", txn_batch(pid + 50, 0, 0, b"a"))
    ).error_code == INVALID_PRODUCER_ID_MAPPING
    assert await add(c, pid, 0, "t") == 0
    assert (await produce(c, "t", txn_batch(pid, 0, 0, b"a", b"b"))).error_code == 0
    assert await add(c, pid, 1, "t") == PRODUCER_FENCED
    assert await add(c, pid + 1, 0, "t") == INVALID_PRODUCER_ID_MAPPING
    assert (await init(c, txn_timeout=10**9)).error_code == INVALID_TRANSACTION_TIMEOUT


async def test_abort_then_commit_read_committed_and_lso(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "rc")
    pid = (await init(c)).producer_id
    assert await add(c, pid, 0, "rc") == 0
    assert (await produce(c, "rc", txn_batch(pid, 0, 0, b"a1", b"a2"))).error_code == 0
    open_ = await fetch(c, "rc", 1)
    assert (open_.high_watermark, open_.last_stable_offset, open_.records) == (2, 0, b"")
    assert await list_latest(c, "rc", 1) == 0 and await list_latest(c, "rc", 0) == 2
    uncommitted = await fetch(c, "rc", 0)
    assert (
        stored(uncommitted.records) == [(0, False, [b"a1", b"a2"])]
        and uncommitted.last_stable_offset == 0
    )
    assert await end(c, pid, 0, False) == 0
    assert await end(c, pid, 0, False) == 0  # a retried abort: already complete
    assert await end(c, pid, 0, True) == INVALID_TXN_STATE
    # Second transaction, committed.
    assert await add(c, pid, 0, "rc") == 0
    assert (await produce(c, "rc", txn_batch(pid, 0, 2, b"c1"))).error_code == 0
    assert await end(c, pid, 0, True) == 0
    done = await fetch(c, "rc", 1)
    assert (done.high_watermark, done.last_stable_offset) == (5, 5)
    assert stored(done.records) == [
        (0, False, [b"a1", b"a2"]),
        (2, True, [struct.pack(">hi", 0, 0)]),
        (3, False, [b"c1"]),
        (4, True, [struct.pack(">hi", 0, 0)]),
    ]
    assert [(a.producer_id, a.first_offset) for a in done.aborted_transactions] == [(pid, 0)]
    # read_uncommitted lists no aborted transactions (the client shows everything).
    assert not (await fetch(c, "rc", 0)).aborted_transactions
    assert not (await fetch(c, "rc", 1, offset=3)).aborted_transactions  # past the aborted one
    assert await list_latest(c, "rc", 1) == 5


async def test_fencing_aborts_the_open_transaction(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "f")
    pid = (await init(c)).producer_id
    assert await add(c, pid, 0, "f") == 0
    assert (await produce(c, "f", txn_batch(pid, 0, 0, b"zombie"))).error_code == 0
    # (an Empty transaction's start time is -1, which kio's decoder refuses: described Ongoing)
    d = await c.call("describe_transactions", 0, {"transactional_ids": ["tid", "nope"]})
    s0 = d.transaction_states[0]
    assert (s0.transaction_state, s0.producer_id, s0.producer_epoch) == ("Ongoing", pid, 0)
    assert [(t.topic, list(t.partitions)) for t in s0.topics] == [("f", [0])]
    assert s0.transaction_timeout.total_seconds() == 60 and s0.transaction_start_time.year >= 2024
    assert d.transaction_states[1].error_code == 105  # TRANSACTIONAL_ID_NOT_FOUND
    dp = await c.call(
        "describe_producers", 0, {"topics": [{"name": "f", "partition_indexes": [0]}]}
    )
    [active] = dp.topics[0].partitions[0].active_producers
    assert (active.producer_id, active.current_txn_start_offset) == (pid, 0)
    # A new producer with the same id: the open transaction is aborted with a bumped
    # epoch, and the caller retries.
    assert (await init(c)).error_code == CONCURRENT_TRANSACTIONS
    again = await init(c)
    assert (again.error_code, again.producer_id, again.producer_epoch) == (0, pid, 2)
    assert await end(c, pid, 0, True) == PRODUCER_FENCED
    assert (
        await produce(c, "f", txn_batch(pid, 0, 1, b"late"))
    ).error_code == INVALID_PRODUCER_EPOCH
    f = await fetch(c, "f", 1)
    assert f.last_stable_offset == 2 and [
        (a.producer_id, a.first_offset) for a in f.aborted_transactions
    ] == [(pid, 0)]
    # KIP-360: a producer naming an old epoch is fenced.
    assert (await init(c, pid=pid, epoch=0)).error_code == PRODUCER_FENCED


async def test_txn_offsets_visible_only_on_commit(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "src")
    pid = (await init(c)).producer_id

    async def offsets(value: int) -> int:
        r = await c.call(
            "add_offsets_to_txn",
            3,
            {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "g"},
        )
        assert r.error_code == 0
        assert await txn_commit(c, pid, "g", "src", value) == 0
        f = await c.call(
            "offset_fetch",
            5,
            {"group_id": "g", "topics": [{"name": "src", "partition_indexes": [0]}]},
        )
        return int(f.topics[0].partitions[0].committed_offset)

    assert await offsets(5) == -1  # pending: not visible
    # Alone, __consumer_offsets is one partition (Metadata lists partition 0): the
    # transaction names that one, whatever partition the group would hash to among 50.
    d = await c.call("describe_transactions", 0, {"transactional_ids": ["tid"]})
    assert {(t.topic, tuple(t.partitions)) for t in d.transaction_states[0].topics} == {
        ("__consumer_offsets", (0,))
    }
    assert await end(c, pid, 0, False) == 0
    f = await c.call(
        "offset_fetch", 5, {"group_id": "g", "topics": [{"name": "src", "partition_indexes": [0]}]}
    )
    assert f.topics[0].partitions[0].committed_offset == -1  # aborted: dropped
    assert await offsets(7) == -1
    assert await end(c, pid, 0, True) == 0
    f = await c.call(
        "offset_fetch", 5, {"group_id": "g", "topics": [{"name": "src", "partition_indexes": [0]}]}
    )
    assert f.topics[0].partitions[0].committed_offset == 7
    # TxnOffsetCommit outside a transaction that added the group's offsets.
    assert await txn_commit(c, pid, "g", "src", 9) == INVALID_TXN_STATE
    lst = await c.call(
        "list_transactions",
        1,
        {
            "state_filters": ["CompleteCommit", "Bogus"],
            "producer_id_filters": [],
            "duration_filter": -1,
        },
    )
    assert [(t.transactional_id, t.transaction_state) for t in lst.transaction_states] == [
        ("tid", "CompleteCommit")
    ]
    assert list(lst.unknown_state_filters) == ["Bogus"]


async def test_require_stable_answers_unstable_offset_commit(broker: Broker) -> None:
    """OffsetFetch v7+ with require_stable (read_committed consumers): a partition with a
    transactional offset commit not yet completed answers UNSTABLE_OFFSET_COMMIT, as
    Kafka does; without require_stable (and for the other partitions) the last committed
    offset; once the transaction is complete, the new offset."""
    c = await broker.connect()
    await create(c, "src", partitions=2)
    pid = (await init(c)).producer_id
    for value, commit in ((3, True), (5, None)):
        r = await c.call(
            "add_offsets_to_txn",
            3,
            {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "g"},
        )
        assert r.error_code == 0
        assert await txn_commit(c, pid, "g", "src", value) == 0
        if commit:
            assert await end(c, pid, 0, True) == 0
    wanted = [{"name": "src", "partition_indexes": [0, 1]}]

    def parts(topics: Any) -> list[tuple[int, int, int]]:
        return [(p.partition_index, p.committed_offset, p.error_code) for t in topics for p in t.partitions]

    for stable, expect0 in ((True, (0, -1, UNSTABLE_OFFSET_COMMIT)), (False, (0, 3, 0))):
        f7 = await c.call("offset_fetch", 7, {"group_id": "g", "topics": wanted, "require_stable": stable})
        assert f7.error_code == 0
        assert parts(f7.topics) == [expect0, (1, -1, 0)]
        f8 = await c.call("offset_fetch", 8, {"groups": [{"group_id": "g", "topics": None}], "require_stable": stable})
        assert parts(f8.groups[0].topics) == [expect0]
    f6 = await c.call("offset_fetch", 6, {"group_id": "g", "topics": wanted})
    assert parts(f6.topics) == [(0, 3, 0), (1, -1, 0)]  # no require_stable before v7
    other = await c.call("offset_fetch", 7, {"group_id": "other", "topics": wanted, "require_stable": True})
    assert parts(other.topics) == [(0, -1, 0), (1, -1, 0)]  # another group's offsets are not pending
    assert await end(c, pid, 0, True) == 0
    f7 = await c.call("offset_fetch", 7, {"group_id": "g", "topics": wanted, "require_stable": True})
    assert parts(f7.topics) == [(0, 5, 0), (1, -1, 0)]
    # An aborted transaction's offsets stop being pending as well.
    r = await c.call(
        "add_offsets_to_txn",
        3,
        {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "g"},
    )
    assert r.error_code == 0 and await txn_commit(c, pid, "g", "src", 9) == 0
    f7 = await c.call("offset_fetch", 7, {"group_id": "g", "topics": wanted, "require_stable": True})
    assert parts(f7.topics)[0] == (0, -1, UNSTABLE_OFFSET_COMMIT)
    assert await end(c, pid, 0, False) == 0
    f7 = await c.call("offset_fetch", 7, {"group_id": "g", "topics": wanted, "require_stable": True})
    assert parts(f7.topics) == [(0, 5, 0), (1, -1, 0)]


async def test_a_consumer_protocol_member_commits_in_a_transaction(broker: Broker) -> None:
    """KIP-447 with a KIP-848 group: TxnOffsetCommit (no v9 exists) is checked on the
    member and its epoch, not refused as an old OffsetCommit would be. franz-go's
    TestTxnEtl takes this path."""
    c = await broker.connect()
    await create(c, "src")
    joined = await c.call("consumer_group_heartbeat", 1, hb_body("cg", "m1", 0, topics=("src",)))
    assert joined.error_code == 0 and joined.member_epoch >= 1
    pid = (await init(c)).producer_id
    r = await c.call(
        "add_offsets_to_txn",
        3,
        {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "cg"},
    )
    assert r.error_code == 0
    stale = await txn_commit(
        c, pid, "cg", "src", 3, generation=joined.member_epoch + 1, member="m1"
    )
    assert stale == STALE_MEMBER_EPOCH
    assert (
        await txn_commit(c, pid, "cg", "src", 3, member="stranger", generation=1)
        == UNKNOWN_MEMBER_ID
    )
    assert (
        await txn_commit(c, pid, "cg", "src", 3, generation=joined.member_epoch, member="m1") == 0
    )
    assert await end(c, pid, 0, True) == 0
    f = await c.call(
        "offset_fetch", 5, {"group_id": "cg", "topics": [{"name": "src", "partition_indexes": [0]}]}
    )
    assert f.topics[0].partitions[0].committed_offset == 3


async def test_write_txn_markers_aborts_an_open_transaction(broker: Broker) -> None:
    """WriteTxnMarkers (what `kafka-transactions abort` sends): an ABORT marker closes the
    producer's open transaction at the partition (the LSO moves past it, read_committed
    drops its records); an older epoch, an unknown partition and the internal topics are
    refused per partition."""
    c = await broker.connect()
    await create(c, "hang")
    pid = (await init(c)).producer_id
    assert await add(c, pid, 0, "hang") == 0
    assert (await produce(c, "hang", txn_batch(pid, 0, 0, b"h1", b"h2"))).error_code == 0
    assert await list_latest(c, "hang", 1) == 0

    async def markers(epoch: int, topics: list[tuple[str, list[int]]]) -> list[tuple[str, int, int]]:
        r = await c.call(
            "write_txn_markers",
            1,
            {
                "markers": [
                    {
                        "producer_id": pid,
                        "producer_epoch": epoch,
                        "transaction_result": False,
                        "coordinator_epoch": 0,
                        "topics": [{"name": t, "partition_indexes": ps} for t, ps in topics],
                    }
                ]
            },
        )
        (m,) = r.markers
        assert m.producer_id == pid
        return [(t.name, p.partition_index, p.error_code) for t in m.topics for p in t.partitions]

    assert await markers(-1, [("hang", [0])]) == [("hang", 0, INVALID_PRODUCER_EPOCH)]
    assert await list_latest(c, "hang", 1) == 0  # nothing written
    # no producer has id -1, no coordinator epoch -1: a marker for them would be a
    # malformed control batch signed for ever
    for bad in ({"producer_id": -1}, {"coordinator_epoch": -1}):
        r = await c.call("write_txn_markers", 1, {"markers": [{
            "producer_id": pid, "producer_epoch": 0, "transaction_result": False, "coordinator_epoch": 0,
            "topics": [{"name": "hang", "partition_indexes": [0]}], **bad}]})  # fmt: skip
        assert [p.error_code for t in r.markers[0].topics for p in t.partitions] == [42], bad
    assert await list_latest(c, "hang", 1) == 0
    markers_out = await markers(
        0, [("hang", [0, 5]), ("nope", [0]), ("__consumer_offsets", [0]), ("__transaction_state", [0])]
    )
    assert markers_out == [
        ("hang", 0, 0),
        ("hang", 5, UNKNOWN_TOPIC_OR_PARTITION),
        ("nope", 0, UNKNOWN_TOPIC_OR_PARTITION),
        # a group's offsets partition takes markers, as Kafka's: nothing of this producer
        # is pending in its groups, so nothing changes
        ("__consumer_offsets", 0, 0),
        ("__transaction_state", 0, INVALID_TOPIC_EXCEPTION),
    ]
    assert await list_latest(c, "hang", 1) == 3  # h1, h2, the ABORT marker
    # Again (a retry whose answer was lost), and for a producer with nothing open: success,
    # and nothing more is signed into the partition.
    assert await markers(0, [("hang", [0])]) == [("hang", 0, 0)]
    assert await list_latest(c, "hang", 1) == 3
    f = await fetch(c, "hang", 1)
    assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 0)]
    # The coordinator still ends its transaction; its own marker closes nothing more.
    assert await end(c, pid, 0, False) == 0
    assert await list_latest(c, "hang", 1) == 4
    f = await fetch(c, "hang", 1)
    assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 0)]


async def test_restart_aborts_the_open_transaction_and_keeps_the_epoch(
    broker_config: BrokerConfig,
) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        await create(c, "r")
        pid = (await init(c, txn_timeout=500)).producer_id
        assert await add(c, pid, 0, "r") == 0
        assert (await produce(c, "r", txn_batch(pid, 0, 0, b"done"))).error_code == 0
        assert await end(c, pid, 0, True) == 0
        assert await add(c, pid, 0, "r") == 0
        assert (await produce(c, "r", txn_batch(pid, 0, 1, b"open"))).error_code == 0
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        # Replayed: the open transaction still holds the LSO (rebuilt from the log) ...
        assert await list_latest(c, "r", 1) == 2
        # ... until its timeout aborts it (with a bumped epoch: the old producer is fenced).
        with trio.fail_after(10):
            while await list_latest(c, "r", 1) != 4:  # noqa: ASYNC110 (a broker in this process: no event to wait on)
                await trio.sleep(0.05)
        f = await fetch(c, "r", 1)
        assert [(a.producer_id, a.first_offset) for a in f.aborted_transactions] == [(pid, 2)]
        assert (
            await produce(c, "r", txn_batch(pid, 0, 2, b"late"))
        ).error_code == INVALID_PRODUCER_EPOCH
        again = await init(c, txn_timeout=500)
        assert (again.error_code, again.producer_id, again.producer_epoch) == (0, pid, 2)
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        f = await fetch(c, "r", 1)
        # The aborted-transaction index is rebuilt from the markers in the log.
        assert f.last_stable_offset == 4 and [
            (a.producer_id, a.first_offset) for a in f.aborted_transactions
        ] == [(pid, 2)]
        nursery.cancel_scope.cancel()


async def test_kafka_error_details_by_version(broker: Broker) -> None:
    c = await broker.connect()
    await create(c, "v")
    assert (await init(c, tid="")).error_code == 42  # INVALID_REQUEST, as Kafka
    pid = (await init(c)).producer_id
    assert await end(c, pid, 0, False) == INVALID_TXN_STATE  # nothing to abort: Empty
    r = await c.call(
        "end_txn",
        1,
        {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 5, "committed": True},
    )
    assert r.error_code == INVALID_PRODUCER_EPOCH  # PRODUCER_FENCED only from v2 (KIP-588)
    assert await end(c, pid, 5, True) == PRODUCER_FENCED
    r = await init(c, pid=pid, epoch=7)
    assert r.error_code == PRODUCER_FENCED
    r = await c.call(
        "init_producer_id",
        3,
        {
            "transactional_id": "tid",
            "transaction_timeout": 60000,
            "producer_id": pid,
            "producer_epoch": 7,
        },
    )
    assert r.error_code == INVALID_PRODUCER_EPOCH
    # read_committed answers list aborted transactions (an empty list), read_uncommitted null.
    assert (await fetch(c, "v", 1)).aborted_transactions == ()
    assert (await fetch(c, "v", 0)).aborted_transactions is None


class _FakeCopy:
    """A mirror's verified copy, as `PartitionTxns.follow` reads it."""

    def __init__(self) -> None:
        self.batches: list[bytes] = []
        self.high_watermark = 0
        self.log_start_offset = 0

    def add(self, batch: bytes | bytearray) -> None:
        b = bytearray(batch)
        struct.pack_into(">q", b, 0, self.high_watermark)
        self.batches.append(bytes(b))
        self.high_watermark += struct.unpack_from(">i", b, 23)[0] + 1

    def batch_headers(self, start: int) -> Any:
        for b in self.batches:
            if struct.unpack_from(">q", b, 0)[0] + struct.unpack_from(">i", b, 23)[0] >= start:
                yield b[:61]

    def read_bytes(self, offset: int, max_bytes: int) -> bytes:
        return next(b for b in self.batches if struct.unpack_from(">q", b, 0)[0] == offset)


def test_a_deposed_leaders_copy_follows_the_new_leaders_transactions() -> None:
    """A quorum-signed partition whose leader a failover deposed (broker/takeover.py
    step_down): its copy is a replica's log, of a topic this broker wrote (not
    `mirrored`), and follows the new leader's batches; its LSO and aborted transactions
    follow them too. (They stayed where the step-down's rebuild left them: a transaction
    open then held every read_committed consumer of it there for good, and ListOffsets
    answered that LSO as its end: compat_tests/test_txn_cluster.py's coordinator kill
    with quorum-signed partitions.) What the rebuild took in is not counted twice."""
    copy = _FakeCopy()
    copy.add(txn_batch(7, 0, 0, b"a"))
    copy.add(control_batch(MarkerType.ABORT, 7, 0, 0, 1))
    copy.add(txn_batch(7, 0, 1, b"b", b"c"))  # open when its leader stepped down
    copy.replica = True  # type: ignore[attr-defined]
    p = SimpleNamespace(topic=SimpleNamespace(mirrored=False), log=copy,
                        txns=rebuild_txns(copy))  # type: ignore[arg-type]
    assert last_stable_offset(p) == 2  # type: ignore[arg-type]
    copy.add(control_batch(MarkerType.COMMIT, 7, 0, 0, 1))  # the new leader's marker
    assert last_stable_offset(p) == 5  # type: ignore[arg-type]
    copy.add(txn_batch(7, 0, 3, b"d"))
    copy.add(control_batch(MarkerType.ABORT, 7, 0, 0, 1))
    assert last_stable_offset(p) == 7  # type: ignore[arg-type]
    assert [(a.first_offset, a.last_offset) for a in p.txns.aborted_in(0, 7)] == [(0, 1), (5, 6)]


def test_a_mirror_follows_the_writers_transactions() -> None:
    copy, t = _FakeCopy(), PartitionTxns()
    copy.add(txn_batch(7, 0, 0, b"a", b"b"))
    t.follow(copy)  # type: ignore[arg-type]
    assert t.lso(copy.high_watermark) == 0
    copy.add(control_batch(MarkerType.ABORT, 7, 0, 0, 1))
    copy.add(txn_batch(7, 0, 2, b"c"))
    t.follow(copy)  # type: ignore[arg-type]
    assert t.lso(copy.high_watermark) == 3
    assert [(a.producer_id, a.first_offset, a.last_offset) for a in t.aborted_in(0, 4)] == [
        (7, 0, 2)
    ]
    copy.add(control_batch(MarkerType.COMMIT, 7, 0, 0, 1))
    t.follow(copy)  # type: ignore[arg-type]
    t.follow(copy)  # type: ignore[arg-type]  (nothing new: nothing counted twice)
    assert t.lso(copy.high_watermark) == 5 and len(t.aborted_in(0, 5)) == 1


async def test_a_prepared_commit_is_completed_after_a_restart(
    broker_config: BrokerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from broker.transactions import coordinator

    async def crash(self: Any, txn: Any) -> None:  # the broker dies between the two phases
        raise coordinator.CoordinatorError(56, "simulated crash after PrepareCommit")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        await create(c, "p")
        pid = (await init(c)).producer_id
        assert await add(c, pid, 0, "p") == 0
        assert (await produce(c, "p", txn_batch(pid, 0, 0, b"x"))).error_code == 0
        r = await c.call(
            "add_offsets_to_txn",
            3,
            {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "pg"},
        )
        assert r.error_code == 0
        r = await c.call(
            "txn_offset_commit",
            3,
            {"transactional_id": "tid", "group_id": "pg", "producer_id": pid, "producer_epoch": 0, "generation_id": -1, "member_id": "",
             "group_instance_id": None, "topics": [{"name": "p", "partitions": [{"partition_index": 0, "committed_offset": 11,
                                                                                   "committed_leader_epoch": -1, "committed_metadata": ""}]}]},
        )  # fmt: skip
        assert r.topics[0].partitions[0].error_code == 0
        monkeypatch.setattr(coordinator.TxnCoordinator, "complete", crash)
        assert await end(c, pid, 0, True) == 0  # decided: PrepareCommit is durable
        assert await list_latest(c, "p", 1) == 0  # ... but no marker was written
        nursery.cancel_scope.cancel()
    monkeypatch.undo()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()

        async def state() -> str:
            d = await c.call("describe_transactions", 0, {"transactional_ids": ["tid"]})
            return str(d.transaction_states[0].transaction_state)

        with trio.fail_after(10):
            while await state() != "CompleteCommit":  # noqa: ASYNC110 (a broker in this process: no event to wait on)
                await trio.sleep(0.05)
        assert await list_latest(c, "p", 1) == 2  # the marker is there
        f = await c.call(
            "offset_fetch",
            5,
            {"group_id": "pg", "topics": [{"name": "p", "partition_indexes": [0]}]},
        )
        assert (
            f.topics[0].partitions[0].committed_offset == 11
        )  # the offsets kept with PrepareCommit
        nursery.cancel_scope.cancel()


async def test_a_cluster_broker_coordinates_no_transaction_yet() -> None:
    from types import SimpleNamespace

    from broker.transactions.coordinator import NOT_COORDINATOR, CoordinatorError, TxnCoordinator

    node = SimpleNamespace(
        config=SimpleNamespace(static={}, node_id=3), topics={},
        # an etcd view: no coordinator of __transaction_state is placed there
        cluster=SimpleNamespace(shard_count=lambda _topic: 0, coordinator=lambda _topic, _partition: None),
    )
    coordinator = TxnCoordinator(node)  # type: ignore[arg-type]
    with pytest.raises(CoordinatorError) as info:
        await coordinator.init_producer_id("tid", 60000)
    assert info.value.code == NOT_COORDINATOR and not node.topics  # no __transaction_state made


async def test_end_txn_and_the_sweep_complete_a_transaction_once(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EndTxn completes its transaction itself; the background sweep, reaching the same
    prepared transaction while the markers are being made durable (a loaded machine
    makes that window long), must not complete it again: that wrote a second marker and
    then CompleteCommit over the producer's next transaction, whose batches were refused
    with INVALID_TXN_STATE from then on (franz-go's TestTxnEtl in CI)."""
    from broker.transactions import coordinator

    original = coordinator.TxnCoordinator.complete
    raced: list[bool] = []

    async def with_the_sweep(self: Any, txn: Any) -> None:
        if raced:
            await original(self, txn)
            return
        raced.append(True)
        async with trio.open_nursery() as n:
            n.start_soon(original, self, txn)  # EndTxn's own completion, and meanwhile
            await self.sweep()  # the sweep finds the transaction prepared

    monkeypatch.setattr(coordinator.TxnCoordinator, "complete", with_the_sweep)
    c = await broker.connect()
    await create(c, "p")
    pid = (await init(c)).producer_id
    assert await add(c, pid, 0, "p") == 0
    assert (await produce(c, "p", txn_batch(pid, 0, 0, b"one"))).error_code == 0
    assert await end(c, pid, 0, True) == 0
    assert raced
    # The next transaction of the same producer goes on.
    assert await add(c, pid, 0, "p") == 0
    assert (await produce(c, "p", txn_batch(pid, 0, 1, b"two"))).error_code == 0
    assert await end(c, pid, 0, True) == 0
    f = await fetch(c, "p", 0)
    assert [(control, values) for _, control, values in stored(f.records)] == [
        (False, [b"one"]),
        (True, [b"\x00\x00\x00\x00\x00\x00"]),
        (False, [b"two"]),
        (True, [b"\x00\x00\x00\x00\x00\x00"]),
    ]


async def test_idle_transactional_ids_expire_with_a_tombstone(broker_config: BrokerConfig) -> None:
    """transactional.id.expiration.ms: an id idle (Empty, CompleteCommit, CompleteAbort) for
    longer is forgotten and tombstoned in __transaction_state, so a restart does not bring
    it back; an id with an open transaction is kept; InitProducerId afterwards starts
    afresh with a new producer id."""
    broker_config.static["transactional.id.expiration.ms"] = "1500"
    broker_config.static["transaction.remove.expired.transaction.cleanup.interval.ms"] = "50"

    async def states(c: RawClient) -> dict[str, str]:
        r = await c.call(
            "list_transactions", 1, {"state_filters": [], "producer_id_filters": [], "duration_filter": -1}
        )
        return {t.transactional_id: t.transaction_state for t in r.transaction_states}

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        await create(c, "x")
        gone = (await init(c, tid="gone")).producer_id
        done = (await init(c, tid="done")).producer_id
        assert await add(c, done, 0, "x", tid="done") == 0
        assert await end(c, done, 0, True, tid="done") == 0
        busy = (await init(c, tid="busy")).producer_id
        assert await add(c, busy, 0, "x", tid="busy") == 0
        assert await states(c) == {"gone": "Empty", "done": "CompleteCommit", "busy": "Ongoing"}
        with trio.fail_after(10):
            while await states(c) != {"busy": "Ongoing"}:  # noqa: ASYNC110 (a broker in this process: no event to wait on)
                await trio.sleep(0.05)
        d = await c.call("describe_transactions", 0, {"transactional_ids": ["gone"]})
        assert d.transaction_states[0].error_code == TRANSACTIONAL_ID_NOT_FOUND
        # The old producer id no longer maps to the id; a new InitProducerId starts afresh.
        assert await add(c, gone, 0, "x", tid="gone") == INVALID_PRODUCER_ID_MAPPING
        again = await init(c, tid="done")
        assert again.error_code == 0 and again.producer_id not in (gone, done, busy)
        assert again.producer_epoch == 0
        nursery.cancel_scope.cancel()
    # Restarted with the default expiration (7 days): the tombstones keep them forgotten.
    del broker_config.static["transactional.id.expiration.ms"]
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        assert await states(c) == {"busy": "Ongoing", "done": "Empty"}
        nursery.cancel_scope.cancel()


def _sharded_node(me: int, owner_of: dict[int, int], partitions: int = 50) -> Any:
    """A node whose cluster has `partitions` partitions of __transaction_state placed,
    partition p coordinated by owner_of.get(p, 2); brokers 1-3 alive."""
    from types import SimpleNamespace

    brokers = {i: SimpleNamespace(host=f"b{i}", port=9090 + i) for i in (1, 2, 3)}
    cluster = SimpleNamespace(
        shard_count=lambda topic: partitions if topic == "__transaction_state" else 0,
        coordinator=lambda topic, p: owner_of.get(p, 2) if topic == "__transaction_state" else None,
        alive=lambda i: i in brokers,
        brokers=brokers,
    )
    return SimpleNamespace(
        config=SimpleNamespace(static={}, node_id=me, advertised=(f"b{me}", 9090 + me)),
        topics={},
        cluster=cluster,
    )


def _ids_off_partition_zero() -> tuple[str, str, int, int]:
    """Two transactional ids on different, non-zero partitions of 50, with their partitions."""
    from broker.cluster.shards import partition_for

    ids = [f"txn-{i}" for i in range(100)]
    mine = next(t for t in ids if partition_for(t, 50) != 0)
    other = next(
        t for t in ids if partition_for(t, 50) not in (0, partition_for(mine, 50))
    )
    return mine, other, partition_for(mine, 50), partition_for(other, 50)


async def test_a_transactional_id_is_coordinated_by_its_transaction_state_partition() -> None:
    # As Kafka's TransactionStateManager: abs(hashCode) % transaction.state.log.num.partitions
    # names the partition, and the broker coordinating that partition serves the id; the
    # others answer NOT_COORDINATOR and FindCoordinator names the right broker from anywhere.
    from broker.handlers.transactions import find_transaction_coordinator
    from broker.transactions.coordinator import (
        NOT_COORDINATOR,
        CoordinatorError,
        TxnCoordinator,
        coordinator_node,
    )

    mine, other, p_mine, p_other = _ids_off_partition_zero()
    owners = {0: 1, p_mine: 3, p_other: 2}
    node = _sharded_node(3, owners)
    assert coordinator_node(node, mine) == 3
    assert coordinator_node(node, other) == 2

    coordinator = TxnCoordinator(node)
    with pytest.raises(CoordinatorError) as info:
        await coordinator.init_producer_id(other, 60000)
    assert info.value.code == NOT_COORDINATOR and not node.topics

    from types import SimpleNamespace

    ctx = SimpleNamespace(node=node, session=None)
    here = find_transaction_coordinator(ctx, mine)  # type: ignore[arg-type]
    assert (here["error_code"], here["node_id"], here["host"], here["port"]) == (0, 3, "b3", 9093)
    there = find_transaction_coordinator(ctx, other)  # type: ignore[arg-type]
    assert (there["error_code"], there["node_id"], there["host"], there["port"]) == (0, 2, "b2", 9092)

    # the named coordinator is dead: retriable, no address
    node.cluster.alive = lambda i: i != 2
    gone = find_transaction_coordinator(ctx, other)  # type: ignore[arg-type]
    assert (gone["error_code"], gone["node_id"]) == (15, -1)  # COORDINATOR_NOT_AVAILABLE


TRANSACTION_COORDINATOR_FENCED = 52


async def test_a_stale_coordinators_marker_is_refused_across_a_restart(
    broker_config: BrokerConfig,
) -> None:
    """Markers carry their coordinator's epoch (Kafka's EndTransactionMarker): once a
    coordinator of epoch 5 wrote a marker for the producer at a partition, a marker of
    epoch 3 (a coordinator that lost the transactional id and woke late) is refused
    TRANSACTION_COORDINATOR_FENCED and changes nothing, at a data partition and at the
    group's partition of __consumer_offsets; it would otherwise close the producer's next
    transaction there. The epoch is rebuilt from the archives after a restart."""

    gp = 0  # the group's partition of __consumer_offsets (alone, its one partition)

    async def markers(c: RawClient, pid: int, commit: bool, coordinator_epoch: int) -> list[int]:
        r = await c.call("write_txn_markers", 1, {"markers": [{
            "producer_id": pid, "producer_epoch": 0, "transaction_result": commit,
            "coordinator_epoch": coordinator_epoch,
            "topics": [{"name": "s", "partition_indexes": [0]},
                       {"name": "__consumer_offsets", "partition_indexes": [gp]}]}]})  # fmt: skip
        return [p.error_code for t in r.markers[0].topics for p in t.partitions]

    async def committed(c: RawClient) -> int:
        f = await c.call("offset_fetch", 5, {"group_id": "sg", "topics": [{"name": "s", "partition_indexes": [0]}]})
        return int(f.topics[0].partitions[0].committed_offset)

    async def producer_coordinator_epoch(c: RawClient, pid: int) -> int:
        r = await c.call("describe_producers", 0, {"topics": [{"name": "s", "partition_indexes": [0]}]})
        (state,) = [p for p in r.topics[0].partitions[0].active_producers if p.producer_id == pid]
        return int(state.coordinator_epoch)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        await create(c, "s")
        pid = (await init(c)).producer_id
        assert await add(c, pid, 0, "s") == 0
        r = await c.call("add_offsets_to_txn", 3,
                         {"transactional_id": "tid", "producer_id": pid, "producer_epoch": 0, "group_id": "sg"})  # fmt: skip
        assert r.error_code == 0
        assert (await produce(c, "s", txn_batch(pid, 0, 0, b"a"))).error_code == 0
        assert await txn_commit(c, pid, "sg", "s", 1) == 0
        # The current coordinator (epoch 5) commits the first transaction.
        assert await markers(c, pid, True, 5) == [0, 0]
        assert (await list_latest(c, "s", 1), await committed(c)) == (2, 1)
        assert await producer_coordinator_epoch(c, pid) == 5
        # The producer's next transaction (same epoch) at both partitions.
        assert (await produce(c, "s", txn_batch(pid, 0, 1, b"b"))).error_code == 0
        assert await txn_commit(c, pid, "sg", "s", 3) == 0
        # The stale coordinator's marker for the first transaction arrives late: refused.
        assert await markers(c, pid, True, 3) == [TRANSACTION_COORDINATOR_FENCED] * 2
        assert await list_latest(c, "s", 0) == 3  # nothing written
        assert (await list_latest(c, "s", 1), await committed(c)) == (2, 1)  # still open, pending
        nursery.cancel_scope.cancel()
    broker_config.listen_port = 0
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        c = await Broker(broker_config, listeners[0].socket.getsockname()[1]).connect()
        assert await producer_coordinator_epoch(c, pid) == 5  # from the control record
        assert await markers(c, pid, True, 3) == [TRANSACTION_COORDINATOR_FENCED] * 2
        assert (await list_latest(c, "s", 0), await list_latest(c, "s", 1), await committed(c)) == (3, 2, 1)
        # The single broker's own coordinator (epoch 0) is fenced there too: its EndTxn is
        # decided, but its markers write nothing.
        assert await end(c, pid, 0, True) == 0
        assert (await list_latest(c, "s", 0), await list_latest(c, "s", 1), await committed(c)) == (3, 2, 1)
        # A newer coordinator's marker is taken: the second transaction ends.
        assert await markers(c, pid, True, 6) == [0, 0]
        assert (await list_latest(c, "s", 0), await list_latest(c, "s", 1), await committed(c)) == (4, 4, 3)
        nursery.cancel_scope.cancel()

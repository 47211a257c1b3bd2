"""The differential oracle's transactions part, run by `oracle_flows.run_all` on each broker.

One transactional id through two transactions on one topic: FindCoordinator for the id,
InitProducerId, AddPartitionsToTxn (a transactional batch before it, an unknown topic),
a transactional produce, the last stable offset in Fetch and ListOffsets read_committed,
AddOffsetsToTxn and TxnOffsetCommit, DescribeTransactions and ListTransactions while it
is open, EndTxn abort (retried), then a committed one with its offsets, and the errors:
wrong epochs at old and new versions (INVALID_PRODUCER_EPOCH before KIP-588,
PRODUCER_FENCED after), an empty transactional id, a fenced producer. Every API at its
first, first flexible and last version we serve; OffsetFetch v7 with require_stable while
the transaction holds offsets; WriteTxnMarkers last.

Kafka completes a transaction (markers, offsets) after it answered EndTxn; before the
next recorded step the script waits, unrecorded, until DescribeTransactions says Complete*.

Imports the standard library and compat_tests.oracle.
"""

from __future__ import annotations

import struct
from typing import Any

import crc32c

from compat_tests.oracle import (
    RawClient,
    Session,
    _fetch_body,
    _list_offsets_body,
    _produce_body,
    _record,
    _topics_gone,
    _topics_ready,
    _wait,
    plain,
    script_batch,
)

TOPIC_T = "hk-oracle-t"
TID = "hk-oracle-tid"
GROUP = "hk-oracle-txn-group"


def _transactional(batch: bytes) -> bytes:
    """The batch with the transactional attribute (bit 4) and its CRC-32C again."""
    b = bytearray(batch)
    struct.pack_into(">h", b, 21, struct.unpack_from(">h", b, 21)[0] | 0x10)
    struct.pack_into(">I", b, 17, crc32c.crc32c(bytes(b[21:])))
    return bytes(b)


def _txn_produce(batch: bytes) -> dict[str, Any]:
    return {**_produce_body(TOPIC_T, 0, batch), "transactional_id": TID}


def _state(c: RawClient) -> str:
    r = plain(c.call("describe_transactions", 0, {"transactional_ids": [TID]}))
    return str(r["transaction_states"][0]["transaction_state"])


def _add_body(pid: int, epoch: int, topic: str = TOPIC_T) -> dict[str, Any]:
    return {"v3_and_below_transactional_id": TID, "v3_and_below_producer_id": pid,
            "v3_and_below_producer_epoch": epoch, "v3_and_below_topics": [{"name": topic, "partitions": [0]}]}  # fmt: skip


def _offsets_body(pid: int, epoch: int, offset: int) -> dict[str, Any]:
    return {"transactional_id": TID, "group_id": GROUP, "producer_id": pid, "producer_epoch": epoch,
            "generation_id": -1, "member_id": "", "group_instance_id": None,
            "topics": [{"name": TOPIC_T, "partitions": [{"partition_index": 0, "committed_offset": offset,
                                                          "committed_leader_epoch": -1, "committed_metadata": "m"}]}]}  # fmt: skip


def _end_body(pid: int, epoch: int, commit: bool) -> dict[str, Any]:
    return {
        "transactional_id": TID,
        "producer_id": pid,
        "producer_epoch": epoch,
        "committed": commit,
    }


def _offset_fetch(s: Session, c: RawClient, step: str) -> None:
    body = {"group_id": GROUP, "topics": [{"name": TOPIC_T, "partition_indexes": [0]}]}
    _record(s, c, step, "offset_fetch", 5, body, retry_top_level=True)


def _committed_batches(c: RawClient, offset: int) -> int:
    """Batches a read_committed fetch from `offset` answers (Kafka serves a marker a moment
    after its LSO moved past it)."""
    r = plain(c.call("fetch", 12, _fetch_body([(TOPIC_T, 0, offset)], isolation=1)))
    return len(r["responses"][0]["partitions"][0]["records"] or [])


def _latest_committed(c: RawClient) -> int:
    r = plain(c.call("list_offsets", 7, _list_offsets_body([(TOPIC_T, 0, -1)], isolation=1)))
    return int(r["topics"][0]["partitions"][0]["offset"])


def run(s: Session, c: RawClient) -> None:
    # (no time retention and no time roll: the script's batches are from 2023, and a
    # retention pass in the middle would drop them on one broker and not the other, and
    # Kafka would start a new segment at the first marker, which a fetch does not cross)
    _record(s, c, "txn-create-topic", "create_topics", 7,
            {"topics": [{"name": TOPIC_T, "num_partitions": 1, "replication_factor": 1, "assignments": [],
                         "configs": [{"name": "retention.ms", "value": "-1"},
                                     {"name": "segment.ms", "value": "31536000000000"}]}],
             "timeout": 30_000, "validate_only": False})  # fmt: skip
    _wait("transactions topic ready", lambda: _topics_ready(c, [TOPIC_T]))
    # Kafka makes __transaction_state on the first FindCoordinator for a transactional id.
    _wait(
        "a transaction coordinator",
        lambda: (
            plain(c.call("find_coordinator", 3, {"key": TID, "key_type": 1}))["error_code"] == 0
        ),
        timeout=60,
    )
    _record(s, c, "txn-find-coordinator-v1", "find_coordinator", 1, {"key": TID, "key_type": 1})
    _record(
        s,
        c,
        "txn-find-coordinator-v4",
        "find_coordinator",
        4,
        {"key_type": 1, "coordinator_keys": [TID]},
    )
    init = {
        "transactional_id": TID,
        "transaction_timeout": 60_000,
        "producer_id": -1,
        "producer_epoch": -1,
    }
    got = _record(
        s, c, "txn-init-producer-id-v4", "init_producer_id", 4, init, retry_top_level=True
    )
    pid, epoch = int(got["producer_id"]), int(got["producer_epoch"])
    _record(s, c, "txn-init-empty-id", "init_producer_id", 4, {**init, "transactional_id": ""})

    batch0 = _transactional(script_batch(producer_id=pid, producer_epoch=epoch, base_sequence=0))
    _record(s, c, "txn-produce-without-id", "produce", 9, _produce_body(TOPIC_T, 0, batch0))
    _record(s, c, "txn-produce-before-add", "produce", 9, _txn_produce(batch0))
    _record(s, c, "txn-add-partitions-v0", "add_partitions_to_txn", 0, _add_body(pid, epoch))
    _record(s, c, "txn-add-partitions-v3-again", "add_partitions_to_txn", 3, _add_body(pid, epoch))
    _record(
        s,
        c,
        "txn-add-partitions-v3-unknown",
        "add_partitions_to_txn",
        3,
        _add_body(pid, epoch, "hk-oracle-no-such"),
    )
    _record(
        s, c, "txn-add-partitions-v1-fenced", "add_partitions_to_txn", 1, _add_body(pid, epoch + 1)
    )
    _record(
        s, c, "txn-add-partitions-v2-fenced", "add_partitions_to_txn", 2, _add_body(pid, epoch + 1)
    )
    _record(s, c, "txn-produce", "produce", 9, _txn_produce(batch0))
    _record(
        s, c, "txn-fetch-open-committed", "fetch", 12, _fetch_body([(TOPIC_T, 0, 0)], isolation=1)
    )
    _record(s, c, "txn-fetch-open-uncommitted", "fetch", 12, _fetch_body([(TOPIC_T, 0, 0)]))
    _record(s, c, "txn-list-offsets-open", "list_offsets", 7,
            _list_offsets_body([(TOPIC_T, 0, -1)], isolation=1))  # fmt: skip

    # The group's coordinator must be up (Kafka makes __consumer_offsets on the first
    # FindCoordinator for a group).
    _wait(
        "a group coordinator",
        lambda: (
            plain(c.call("find_coordinator", 3, {"key": GROUP, "key_type": 0}))["error_code"] == 0
        ),
        timeout=60,
    )
    add_offsets = {
        "transactional_id": TID,
        "producer_id": pid,
        "producer_epoch": epoch,
        "group_id": GROUP,
    }
    for v in (0, 3, 4):
        _record(s, c, f"txn-add-offsets-v{v}", "add_offsets_to_txn", v, add_offsets)
    # (Kafka's group coordinator may still be loading the group's partition: 15)
    _wait(
        "TxnOffsetCommit accepted",
        lambda: (
            plain(c.call("txn_offset_commit", 3, _offsets_body(pid, epoch, 1)))["topics"][0][
                "partitions"
            ][0]["error_code"]
            == 0
        ),
    )
    for v in (0, 3, 4):
        _record(
            s, c, f"txn-offset-commit-v{v}", "txn_offset_commit", v, _offsets_body(pid, epoch, 1)
        )
    _offset_fetch(s, c, "txn-offset-fetch-pending")
    # require_stable (v7+): UNSTABLE_OFFSET_COMMIT while the transaction holds the offsets.
    _record(s, c, "txn-offset-fetch-pending-stable", "offset_fetch", 7,
            {"group_id": GROUP, "topics": [{"name": TOPIC_T, "partition_indexes": [0]}], "require_stable": True},
            retry_top_level=True)  # fmt: skip
    _record(
        s,
        c,
        "txn-describe",
        "describe_transactions",
        0,
        {"transactional_ids": [TID, "hk-oracle-no-tid"]},
    )
    _record(
        s,
        c,
        "txn-list-v0",
        "list_transactions",
        0,
        {"state_filters": ["Ongoing"], "producer_id_filters": []},
    )
    _record(s, c, "txn-list-v1", "list_transactions", 1,
            {"state_filters": ["Ongoing", "NoSuchState"], "producer_id_filters": [], "duration_filter": -1})  # fmt: skip

    _record(s, c, "txn-end-v0-fenced", "end_txn", 0, _end_body(pid, epoch + 1, False))
    _record(s, c, "txn-end-v3-fenced", "end_txn", 3, _end_body(pid, epoch + 1, False))
    _record(s, c, "txn-end-v0-abort", "end_txn", 0, _end_body(pid, epoch, False))
    _wait("the abort complete", lambda: _state(c) == "CompleteAbort")
    _record(s, c, "txn-end-v0-abort-again", "end_txn", 0, _end_body(pid, epoch, False))
    _record(s, c, "txn-end-commit-after-abort", "end_txn", 3, _end_body(pid, epoch, True))
    _offset_fetch(s, c, "txn-offset-fetch-aborted")
    _wait("the LSO past the abort", lambda: _latest_committed(c) == 4)
    _wait("the abort marker served", lambda: _committed_batches(c, 0) == 2)
    _record(s, c, "txn-fetch-aborted", "fetch", 12, _fetch_body([(TOPIC_T, 0, 0)], isolation=1))

    # The second transaction, committed.
    _record(s, c, "txn-add-partitions-v3", "add_partitions_to_txn", 3, _add_body(pid, epoch))
    batch1 = _transactional(script_batch(producer_id=pid, producer_epoch=epoch, base_sequence=3))
    _record(s, c, "txn-produce-2", "produce", 9, _txn_produce(batch1))
    _record(s, c, "txn-add-offsets-2", "add_offsets_to_txn", 4, add_offsets)
    _record(s, c, "txn-offset-commit-2", "txn_offset_commit", 4, _offsets_body(pid, epoch, 7))
    _record(s, c, "txn-end-v4-commit", "end_txn", 4, _end_body(pid, epoch, True))
    _wait("the commit complete", lambda: _state(c) == "CompleteCommit")
    _record(s, c, "txn-end-v4-commit-again", "end_txn", 4, _end_body(pid, epoch, True))
    _offset_fetch(s, c, "txn-offset-fetch-committed")
    _wait("the LSO past the commit", lambda: _latest_committed(c) == 8)
    _wait("the commit marker served", lambda: _committed_batches(c, 4) == 2)
    _record(s, c, "txn-fetch-committed", "fetch", 12, _fetch_body([(TOPIC_T, 0, 4)], isolation=1))
    _record(s, c, "txn-list-offsets-done", "list_offsets", 7,
            _list_offsets_body([(TOPIC_T, 0, -1)], isolation=1))  # fmt: skip

    # A new producer with the same id fences this one.
    again = _record(s, c, "txn-init-again", "init_producer_id", 4, init, retry_top_level=True)
    _record(
        s,
        c,
        "txn-init-v3-old-epoch",
        "init_producer_id",
        3,
        {**init, "producer_id": pid, "producer_epoch": epoch},
    )
    _record(s, c, "txn-add-offsets-v1-fenced", "add_offsets_to_txn", 1, add_offsets)
    _record(s, c, "txn-add-offsets-v2-fenced", "add_offsets_to_txn", 2, add_offsets)
    late = _transactional(script_batch(producer_id=pid, producer_epoch=epoch, base_sequence=6))
    _record(s, c, "txn-produce-fenced", "produce", 9, _txn_produce(late))
    assert int(again["producer_epoch"]) == epoch + 1 or int(again["error_code"]) != 0
    # WriteTxnMarkers (kafka-transactions abort): an ABORT marker for a producer with no
    # transaction here (Kafka writes a marker that closes nothing, and so do we the first
    # time a coordinator epoch of the producer is seen there: both answer success), and
    # an unknown topic. Last: it may move
    # the log end offset.
    _record(s, c, "txn-write-markers", "write_txn_markers", 1, {"markers": [{
        "producer_id": 424242, "producer_epoch": 0, "transaction_result": False, "coordinator_epoch": 0,
        "topics": [{"name": TOPIC_T, "partition_indexes": [0]}, {"name": "hk-oracle-no-topic", "partition_indexes": [0]}],
    }]})  # fmt: skip
    _record(
        s, c, "txn-delete-topic", "delete_topics", 4, {"topic_names": [TOPIC_T], "timeout": 30_000}
    )
    _wait("transactions topic deleted", lambda: _topics_gone(c, [TOPIC_T]))

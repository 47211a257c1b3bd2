"""The differential oracle's admin part: the APIs that change or describe a topic's
configs, partitions and records, the log dirs, producers, reassignments and ACLs.

Each API at its first accepted, first flexible and last version, with requests whose
answers say something: a topic config altered (whole and incrementally, with refusals)
then described; partitions added (with refusals) then seen in Metadata; records deleted
then the log start seen by ListOffsets and Fetch; the log dir of a topic; the producer
an idempotent produce left; reassignments (none); and ACL describe/create/delete on
brokers without an authorizer (SECURITY_DISABLED on both).

Where Kafka applies a change through its controller and publishes it to the broker a
moment later, an unrecorded wait comes before the recorded read.

Imports compat_tests.oracle.
"""

from __future__ import annotations

from typing import Any

from compat_tests import oracle
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

TOPIC_CFG = "hk-oracle-cfg"  # configs altered
TOPIC_P = "hk-oracle-p"  # partitions added
TOPIC_R = "hk-oracle-r"  # records deleted, producers described, log dirs
TOPIC_S = "hk-oracle-s"  # created with configs that change what is stored

TOPIC, BROKER = 2, 4  # config resource types
SET, DELETE, APPEND = 0, 1, 2  # IncrementalAlterConfigs operations


def run(s: Session, c: RawClient) -> None:
    body = {
        "topics": [
            {"name": n, "num_partitions": 1, "replication_factor": 1, "assignments": [], "configs": []}
            for n in (TOPIC_CFG, TOPIC_P, TOPIC_R)
        ],
        "timeout": 30_000,
        "validate_only": False,
    }  # fmt: skip
    _record(s, c, "admin-create-topics", "create_topics", 7, body)
    _wait("admin topics ready", lambda: _topics_ready(c, [TOPIC_CFG, TOPIC_P, TOPIC_R]))
    _configs(s, c)
    _stored_configs(s, c)
    _partitions(s, c)
    _records(s, c)
    _acls(s, c)
    dt = {"topic_names": [TOPIC_CFG, TOPIC_P, TOPIC_R], "timeout": 30_000}
    _record(s, c, "admin-delete-topics", "delete_topics", 4, dt)
    _wait("admin topics deleted", lambda: _topics_gone(c, [TOPIC_CFG, TOPIC_P, TOPIC_R]))


# ---------------------------------------------------------------------------- configs

_CFG_KEYS = ["retention.ms", "max.message.bytes", "cleanup.policy", "segment.ms"]


def _topic_configs(c: RawClient) -> dict[str, Any]:
    dc = {
        "resources": [
            {"resource_type": TOPIC, "resource_name": TOPIC_CFG, "configuration_keys": _CFG_KEYS}
        ],
        "include_synonyms": False,
        "include_documentation": False,
    }
    res = plain(c.call("describe_configs", 4, dc))["results"][0]
    return {x["name"]: x["value"] for x in res["configs"]}


def _describe_cfg(s: Session, c: RawClient, step: str, expect: dict[str, str]) -> None:
    """Wait (unrecorded) until the broker shows `expect`, then record DescribeConfigs."""
    _wait(
        f"{step}: configs visible",
        lambda: all(_topic_configs(c).get(k) == v for k, v in expect.items()),
    )
    dc = {
        "resources": [
            {"resource_type": TOPIC, "resource_name": TOPIC_CFG, "configuration_keys": _CFG_KEYS}
        ],
        "include_synonyms": True,
        "include_documentation": False,
    }
    _record(s, c, step, "describe_configs", 4, dc)


def _alter_body(
    resources: list[tuple[int, str, list[tuple[str, str | None]]]], validate_only: bool = False
) -> dict[str, Any]:
    return {
        "resources": [
            {
                "resource_type": t,
                "resource_name": n,
                "configs": [{"name": k, "value": v} for k, v in cs],
            }
            for t, n, cs in resources
        ],
        "validate_only": validate_only,
    }


def _incremental_body(
    resources: list[tuple[int, str, list[tuple[str, int, str | None]]]],
    validate_only: bool = False,
) -> dict[str, Any]:
    return {
        "resources": [
            {
                "resource_type": t,
                "resource_name": n,
                "configs": [{"name": k, "config_operation": op, "value": v} for k, op, v in cs],
            }
            for t, n, cs in resources
        ],
        "validate_only": validate_only,
    }


def _configs(s: Session, c: RawClient) -> None:
    # AlterConfigs replaces a topic's whole set of overrides.
    body = _alter_body(
        [
            (TOPIC, TOPIC_CFG, [("retention.ms", "3600000"), ("max.message.bytes", "65536")]),
            (TOPIC, oracle.MISSING, [("retention.ms", "1")]),
        ]
    )
    _record(s, c, "admin-alter-configs-v0", "alter_configs", 0, body)
    _describe_cfg(
        s,
        c,
        "admin-describe-after-alter-v0",
        {"retention.ms": "3600000", "max.message.bytes": "65536"},
    )
    body = _alter_body([(TOPIC, TOPIC_CFG, [("retention.ms", "7200000")])])
    _record(s, c, "admin-alter-configs-v2-replaces-all", "alter_configs", 2, body)
    _describe_cfg(s, c, "admin-describe-after-alter-v2", {"retention.ms": "7200000"})
    body = _alter_body(
        [
            (TOPIC, TOPIC_CFG, [("no.such.config", "1")]),
            (TOPIC, "hk-oracle-missing-2", [("retention.ms", "abc")]),
        ]
    )
    _record(s, c, "admin-alter-configs-v2-refused", "alter_configs", 2, body)
    body = _alter_body([(TOPIC, TOPIC_CFG, [("retention.ms", "1000")])], validate_only=True)
    _record(s, c, "admin-alter-configs-v0-validate-only", "alter_configs", 0, body)

    body = _incremental_body(
        [(TOPIC, TOPIC_CFG, [("segment.ms", SET, "600000"), ("retention.ms", DELETE, None)])]
    )
    _record(s, c, "admin-incremental-alter-configs-v0", "incremental_alter_configs", 0, body)
    _describe_cfg(
        s,
        c,
        "admin-describe-after-incremental-v0",
        {"segment.ms": "600000", "retention.ms": "604800000"},
    )
    body = _incremental_body(
        [
            (TOPIC, TOPIC_CFG, [("retention.ms", APPEND, "5")]),
            (TOPIC, "hk-oracle-missing-3", [("retention.ms", SET, "5")]),
        ]
    )
    _record(
        s, c, "admin-incremental-alter-configs-v1-refused", "incremental_alter_configs", 1, body
    )
    body = _incremental_body([(TOPIC, TOPIC_CFG, [("no.such.config", SET, "1")])])
    _record(
        s, c, "admin-incremental-alter-configs-v1-unknown", "incremental_alter_configs", 1, body
    )
    # A broker config Kafka can change at run time (validate only: nothing changes).
    body = _incremental_body([(BROKER, "1", [("log.retention.ms", SET, "3600000")])], True)
    _record(s, c, "admin-incremental-alter-configs-v1-broker", "incremental_alter_configs", 1, body)
    body = _incremental_body([(TOPIC, TOPIC_CFG, [("max.message.bytes", SET, "131072")])])
    _record(s, c, "admin-incremental-alter-configs-v1", "incremental_alter_configs", 1, body)
    _describe_cfg(s, c, "admin-describe-after-incremental-v1", {"max.message.bytes": "131072"})


def _stored_configs(s: Session, c: RawClient) -> None:
    """CreateTopics with compression.type and compaction configs (and refused values),
    DescribeConfigs of them, and a keyless record refused by the compacted topic."""

    def topic(name: str, configs: dict[str, str]) -> dict[str, Any]:
        return {"name": name, "num_partitions": 1, "replication_factor": 1, "assignments": [],
                "configs": [{"name": k, "value": v} for k, v in configs.items()]}  # fmt: skip

    stored = {
        "compression.type": "zstd",
        "compression.zstd.level": "9",
        "cleanup.policy": "compact,delete",
        "min.cleanable.dirty.ratio": "0.1",
        "delete.retention.ms": "1000",
        "min.compaction.lag.ms": "5",
        "max.compaction.lag.ms": "600000",
    }
    body = {
        "topics": [
            topic(TOPIC_S, stored),
            topic("hk-oracle-bad-codec", {"compression.type": "brotli"}),
            topic("hk-oracle-bad-policy", {"cleanup.policy": "compact,shred"}),
            topic("hk-oracle-bad-level", {"compression.gzip.level": "0"}),
            topic("hk-oracle-bad-ratio", {"min.cleanable.dirty.ratio": "1.5"}),
        ],
        "timeout": 30_000,
        "validate_only": False,
    }
    _record(s, c, "admin-create-topics-v7-stored-configs", "create_topics", 7, body)
    _wait("stored-configs topic ready", lambda: _topics_ready(c, [TOPIC_S]))
    dc = {
        "resources": [
            {"resource_type": TOPIC, "resource_name": TOPIC_S, "configuration_keys": sorted(stored)}
        ],
        "include_synonyms": True,
        "include_documentation": False,
    }
    _record(s, c, "admin-describe-stored-configs", "describe_configs", 4, dc)
    # the script's batch: its second record has no key
    _record(s, c, "admin-produce-keyless-to-compacted", "produce", 9,
            _produce_body(TOPIC_S, 0, script_batch()))  # fmt: skip
    dt = {"topic_names": [TOPIC_S], "timeout": 30_000}
    _record(s, c, "admin-delete-stored-configs-topic", "delete_topics", 4, dt)
    _wait("stored-configs topic deleted", lambda: _topics_gone(c, [TOPIC_S]))


# ---------------------------------------------------------------------------- partitions


def _partition_count(c: RawClient, topic: str) -> int:
    md = plain(
        c.call(
            "metadata",
            12,
            {
                "topics": [{"name": topic}],
                "allow_auto_topic_creation": False,
                "include_topic_authorized_operations": False,
            },
        )
    )
    return len(md["topics"][0]["partitions"])


def _partitions(s: Session, c: RawClient) -> None:
    def cp(topics: list[dict[str, Any]], validate_only: bool = False) -> dict[str, Any]:
        return {"topics": topics, "timeout": 30_000, "validate_only": validate_only}

    _record(s, c, "admin-create-partitions-v0", "create_partitions", 0,
            cp([{"name": TOPIC_P, "count": 3, "assignments": None},
                {"name": oracle.MISSING, "count": 2, "assignments": None}]))  # fmt: skip
    _wait("partitions added", lambda: _partition_count(c, TOPIC_P) == 3)
    _wait("new partitions ready", lambda: _topics_ready(c, [TOPIC_P]))
    md = {
        "topics": [{"name": TOPIC_P}],
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": False,
    }
    _record(s, c, "admin-metadata-after-create-partitions", "metadata", 12, md)
    _record(s, c, "admin-produce-to-new-partition", "produce", 9,
            _produce_body(TOPIC_P, 2, script_batch()))  # fmt: skip
    _record(s, c, "admin-create-partitions-v2-refused", "create_partitions", 2,
            cp([{"name": TOPIC_P, "count": 3, "assignments": None},
                {"name": TOPIC_CFG, "count": 3, "assignments": [{"broker_ids": [1]}]},
                {"name": TOPIC_R, "count": 2, "assignments": [{"broker_ids": [7]}]}]))  # fmt: skip
    _record(s, c, "admin-create-partitions-v2-fewer-and-duplicate", "create_partitions", 2,
            cp([{"name": TOPIC_P, "count": 2, "assignments": None},
                {"name": TOPIC_CFG, "count": 2, "assignments": None},
                {"name": TOPIC_CFG, "count": 2, "assignments": None}]))  # fmt: skip
    _record(s, c, "admin-create-partitions-v3-validate-only", "create_partitions", 3,
            cp([{"name": TOPIC_P, "count": 5, "assignments": None}], validate_only=True))  # fmt: skip
    _record(s, c, "admin-create-partitions-v3", "create_partitions", 3,
            cp([{"name": TOPIC_P, "count": 4, "assignments": [{"broker_ids": [1]}]}]))  # fmt: skip
    _wait("fourth partition added", lambda: _partition_count(c, TOPIC_P) == 4)
    _wait("fourth partition ready", lambda: _topics_ready(c, [TOPIC_P]))
    _record(s, c, "admin-metadata-after-create-partitions-v3", "metadata", 12, md)


# ---------------------------------------------------------------------------- records


def _records(s: Session, c: RawClient) -> None:
    """Two plain batches then an idempotent one on TOPIC_R (offsets 0-8), then
    DescribeProducers, DescribeLogDirs, DeleteRecords and what they change."""
    for i in range(2):
        _record(s, c, f"admin-produce-r-{i}", "produce", 9,
                _produce_body(TOPIC_R, 0, script_batch(10 * i)))  # fmt: skip
    init = {
        "transactional_id": None,
        "transaction_timeout": 60_000,
        "producer_id": -1,
        "producer_epoch": -1,
    }
    raw = plain(c.call("init_producer_id", 4, init))
    idem = script_batch(
        300, producer_id=raw["producer_id"], producer_epoch=raw["producer_epoch"], base_sequence=0
    )
    _record(s, c, "admin-produce-r-idempotent", "produce", 9, _produce_body(TOPIC_R, 0, idem))

    dp = {
        "topics": [
            {"name": TOPIC_R, "partition_indexes": [0, 5]},
            {"name": TOPIC_P, "partition_indexes": [0]},
            {"name": oracle.MISSING, "partition_indexes": [0]},
        ]
    }
    _record(s, c, "admin-describe-producers-v0", "describe_producers", 0, dp)

    ld = {
        "topics": [
            {"topic": TOPIC_R, "partitions": [0, 9]},
            {"topic": TOPIC_P, "partitions": [0, 1, 2, 3]},
            {"topic": oracle.MISSING, "partitions": [0]},
        ]
    }
    for v in (1, 2, 4):
        _record(s, c, f"admin-describe-log-dirs-v{v}", "describe_log_dirs", v, ld)

    lpr: dict[str, Any] = {"timeout": 30_000, "topics": None}
    _record(s, c, "admin-list-partition-reassignments-v0-all", "list_partition_reassignments", 0,
            lpr)  # fmt: skip
    lpr = {"timeout": 30_000, "topics": [{"name": TOPIC_P, "partition_indexes": [0, 1]}]}
    _record(s, c, "admin-list-partition-reassignments-v0-named", "list_partition_reassignments", 0,
            lpr)  # fmt: skip

    def dr(parts: list[tuple[str, int, int]]) -> dict[str, Any]:
        topics: dict[str, list[dict[str, Any]]] = {}
        for t, p, o in parts:
            topics.setdefault(t, []).append({"partition_index": p, "offset": o})
        return {
            "topics": [{"name": t, "partitions": ps} for t, ps in topics.items()],
            "timeout": 30_000,
        }

    _record(s, c, "admin-delete-records-v0", "delete_records", 0,
            dr([(TOPIC_R, 0, 4), (TOPIC_R, 3, 1), (oracle.MISSING, 0, 1)]))  # fmt: skip
    for label, ts in (
        ("earliest", -2),
        ("latest", -1),
        ("by-time-deleted", oracle.T0),
        ("by-time-cut-batch", oracle.T0 + 15),
        ("max-timestamp", -3),
    ):
        _record(s, c, f"admin-delete-records-list-offsets-{label}", "list_offsets", 7,
                _list_offsets_body([(TOPIC_R, 0, ts)]))  # fmt: skip
    # (one partition named twice: Kafka answers one INVALID_REQUEST for it)
    _record(s, c, "admin-list-offsets-duplicate-partition", "list_offsets", 7,
            _list_offsets_body([(TOPIC_R, 0, -2), (TOPIC_P, 0, -1), (TOPIC_R, 0, -1)]))  # fmt: skip
    _record(s, c, "admin-delete-records-fetch-out-of-range-below-start", "fetch", 12,
            _fetch_body([(TOPIC_R, 0, 1)]))  # fmt: skip
    _record(s, c, "admin-delete-records-fetch-at-start", "fetch", 12,
            _fetch_body([(TOPIC_R, 0, 4)]))  # fmt: skip
    _record(s, c, "admin-delete-records-v2-lower-and-beyond", "delete_records", 2,
            dr([(TOPIC_R, 0, 2), (TOPIC_P, 0, 50)]))  # fmt: skip
    _record(s, c, "admin-delete-records-v2-to-end", "delete_records", 2,
            dr([(TOPIC_R, 0, -1), (TOPIC_P, 2, -1)]))  # fmt: skip
    _record(s, c, "admin-delete-records-list-offsets-after-all", "list_offsets", 7,
            _list_offsets_body([(TOPIC_R, 0, -2), (TOPIC_P, 2, -2)]))  # fmt: skip
    # The batch with the largest timestamp wholly deleted: -3 and by-time answer from
    # what is left.
    _record(s, c, "admin-produce-p1-late", "produce", 9,
            _produce_body(TOPIC_P, 1, script_batch(10_000)))  # fmt: skip
    _record(s, c, "admin-produce-p1-early", "produce", 9,
            _produce_body(TOPIC_P, 1, script_batch()))  # fmt: skip
    _record(s, c, "admin-delete-records-p1-late-batch", "delete_records", 0,
            dr([(TOPIC_P, 1, 3)]))  # fmt: skip
    for label, ts in (("max-timestamp", -3), ("by-time-late", oracle.T0 + 5_000)):
        _record(s, c, f"admin-list-offsets-p1-{label}", "list_offsets", 7,
                _list_offsets_body([(TOPIC_P, 1, ts)]))  # fmt: skip
    _record(s, c, "admin-describe-log-dirs-after-delete", "describe_log_dirs", 4,
            {"topics": [{"topic": TOPIC_R, "partitions": [0]}]})  # fmt: skip


# ---------------------------------------------------------------------------- ACLs

# Kafka's codes: resource type ANY 1, TOPIC 2, GROUP 3; pattern ANY 1, MATCH 2, LITERAL 3,
# PREFIXED 4; operation ANY 1, READ 3, WRITE 4; permission ANY 1, ALLOW 3.


def _acls(s: Session, c: RawClient) -> None:
    any_filter = {
        "resource_type_filter": 1,
        "resource_name_filter": None,
        "pattern_type_filter": 1,
        "principal_filter": None,
        "host_filter": None,
        "operation": 1,
        "permission_type": 1,
    }
    named = {**any_filter, "resource_type_filter": 2, "resource_name_filter": TOPIC_R,
             "pattern_type_filter": 2, "principal_filter": "User:alice", "operation": 3,
             "permission_type": 3}  # fmt: skip
    creation = {
        "resource_type": 2,
        "resource_name": TOPIC_R,
        "resource_pattern_type": 3,
        "principal": "User:alice",
        "host": "*",
        "operation": 3,
        "permission_type": 3,
    }
    prefixed = {**creation, "resource_type": 3, "resource_name": "hk-", "resource_pattern_type": 4,
                "operation": 4}  # fmt: skip
    for v in (1, 2, 3):
        _record(s, c, f"admin-describe-acls-v{v}-any", "describe_acls", v, any_filter)
        _record(s, c, f"admin-describe-acls-v{v}-named", "describe_acls", v, named)
        _record(s, c, f"admin-create-acls-v{v}", "create_acls", v,
                {"creations": [creation, prefixed]})  # fmt: skip
        _record(s, c, f"admin-delete-acls-v{v}", "delete_acls", v,
                {"filters": [any_filter, named]})  # fmt: skip

"""The differential oracle's wider script, run after `oracle.run_script` on each broker.

Owns:
- the version sweep: every API we serve, at its first accepted, first flexible and last
  version (`TARGET_VERSIONS`, derived from the broker's registry and kio's schemas, so a
  newly served API or version is covered or the coverage test fails);
- compressed batches, one of each codec (gzip, snappy, lz4, zstd), produced, fetched back
  byte for byte, found by time, and refused when corrupt;
- the classic group flow at three version sets (join with MEMBER_ID_REQUIRED, a second
  member joining a stable group, sync with a follower the leader gave nothing, heartbeats,
  commits and fetches of offsets, describe, list, leave, delete), and the offsets API on a
  group that has no members;
- the KIP-848 consumer group flow: ConsumerGroupHeartbeat v0 (coordinator-chosen member
  id) and v1 (client-chosen) joins, an acknowledging heartbeat, a fenced epoch, a join
  without a subscription, ConsumerGroupDescribe v0/v1, OffsetCommit v9 with the member
  epoch and a stale one, leaving, describing the empty group, deleting it;
- SASL on the oracle's SASL_PLAINTEXT listener: handshakes (both versions), PLAIN and
  SCRAM-SHA-256 logins (SCRAM computed here, RFC 5802), refused credentials, an unknown
  mechanism, requests before authenticating, and SASL requests on a plain listener;
- then `compat_tests.oracle_admin`'s part (configs, partitions, records, log dirs,
  producers, reassignments, ACLs) and `compat_tests.oracle_txn`'s (transactions).

Imports the standard library, compat_tests.oracle and broker.api/broker.protocol (which
APIs and versions we serve).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
import uuid
import zlib
from typing import Any

from compat_tests import oracle, oracle_admin, oracle_txn
from compat_tests.oracle import (
    Exchange,
    RawClient,
    Session,
    _fetch_body,
    _list_offsets_body,
    _produce_body,
    _record,
    _topics_gone,
    _topics_ready,
    _wait,
    normalise,
    plain,
    script_batch,
)

SASL_USER, SASL_PASSWORD = "alice", "alice-secret"

TOPIC_S = "hk-oracle-s"  # the version sweep's topic (created at CreateTopics' first version)
TOPIC_S5 = "hk-oracle-s5"  # created at CreateTopics' first flexible version
TOPIC_Z = "hk-oracle-z"  # compressed batches
CODECS = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


# ---------------------------------------------------------------------------- coverage


def target_versions() -> dict[str, set[int]]:
    """API name -> the versions the oracle must compare: the first accepted, the first
    flexible (if any) and the last, of every API in the broker's registry."""
    import broker.server  # noqa: F401  (registers every handler)
    from broker.api import REGISTRY
    from broker.protocol.header import is_flexible_request

    out: dict[str, set[int]] = {}
    for a in REGISTRY.values():
        versions = {a.first_accepted, a.max_version}
        flexible = [
            v for v in range(a.first_accepted, a.max_version + 1) if is_flexible_request(a.key, v)
        ]
        if flexible:
            versions.add(flexible[0])
        out[a.name] = versions
    return out


def coverage(exchanges: list[Exchange]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for e in exchanges:
        out.setdefault(e.api, set()).add(e.version)
    return out


# ---------------------------------------------------------------------------- batches


def _xerial(block: bytes) -> bytes:
    """snappy-java's stream framing (what Java producers send): magic, version 1,
    compatible version 1, then length-prefixed raw snappy blocks."""
    return b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1) + struct.pack(">i", len(block)) + block


def compress(codec: str, data: bytes) -> bytes:
    """Deterministic compressed bytes, in the framing each Kafka codec reads."""
    if codec == "gzip":
        c = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip wrapper, mtime 0
        return c.compress(data) + c.flush()
    if codec == "snappy":
        import snappy  # type: ignore[import-untyped]

        return _xerial(bytes(snappy.compress(data)))
    if codec == "lz4":
        import lz4.frame  # type: ignore[import-untyped]

        # As Kafka's own lz4 writer: independent blocks, no content size or checksum.
        return bytes(
            lz4.frame.compress(data, block_linked=False, store_size=False, content_checksum=False)
        )
    if codec == "zstd":
        import zstandard

        return bytes(zstandard.ZstdCompressor(level=3).compress(data))
    raise ValueError(codec)


def compressed_batch(codec: str, base_delta: int = 0, *, corrupt: bool = False) -> bytes:
    """The script's three records (oracle.script_batch) with their records section
    compressed; `corrupt` damages the compressed bytes but keeps the CRC valid."""
    plain_batch = script_batch(base_delta)
    body = compress(codec, plain_batch[61:])
    if corrupt:
        body = body[: len(body) // 2] + bytes(b ^ 0x5A for b in body[len(body) // 2 :])
    head = bytearray(plain_batch[:61])
    struct.pack_into(">h", head, 21, CODECS[codec])  # attributes: the codec, CreateTime
    after_crc = bytes(head[21:]) + body
    import crc32c

    struct.pack_into(">i", head, 8, 4 + 1 + 4 + len(after_crc))
    struct.pack_into(">I", head, 17, crc32c.crc32c(after_crc))
    return bytes(head[:21]) + after_crc


# ---------------------------------------------------------------------------- the script


def run_all(host: str, port: int, sasl_port: int) -> list[Exchange]:
    """`oracle.run_script`, then this module's parts, on fresh connections."""
    exchanges = oracle.run_script(host, port)
    s = Session(host, port, exchanges)
    with s.client() as c:
        _sweep(s, c)
        _compressed(s, c)
        _groups(s, c)
        _consumer_groups(s, c)
        _cleanup(s, c)
        oracle_admin.run(s, c)
        oracle_txn.run(s, c)
    _sasl(s, sasl_port)
    return s.exchanges


def _create(name: str, partitions: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "num_partitions": partitions,
        "replication_factor": 1,
        "assignments": [],
        "configs": [],
    }


def _sweep(s: Session, c: RawClient) -> None:
    """The data and admin APIs at the versions `oracle.run_script` leaves out."""
    body = {"topics": [_create(TOPIC_S)], "timeout": 30_000, "validate_only": False}
    _record(s, c, "sweep-create-topics-v2", "create_topics", 2, body)
    body = {
        "topics": [_create(TOPIC_S5, 2), _create(TOPIC_S)],
        "timeout": 30_000,
        "validate_only": False,
    }
    _record(s, c, "sweep-create-topics-v5", "create_topics", 5, body)
    _wait("sweep topics ready", lambda: _topics_ready(c, [TOPIC_S, TOPIC_S5]))

    _record(s, c, "sweep-metadata-v0", "metadata", 0, {"topics": [{"name": TOPIC_S}]})
    md = {
        "topics": [{"name": TOPIC_S}, {"name": oracle.MISSING}],
        "allow_auto_topic_creation": False,
        "include_topic_authorized_operations": True,
        "include_cluster_authorized_operations": True,
    }
    _record(s, c, "sweep-metadata-v9", "metadata", 9, md)

    for v in (3, 11):
        _record(
            s, c, f"sweep-produce-v{v}", "produce", v, _produce_body(TOPIC_S, 0, script_batch(v))
        )
    _record(s, c, "sweep-produce-v3-acks1-other-topic", "produce", 3,
            _produce_body(TOPIC_S5, 1, script_batch(), acks=1))  # fmt: skip
    _record(s, c, "sweep-fetch-v4", "fetch", 4, _fetch_body([(TOPIC_S, 0, 0), (TOPIC_S5, 1, 0)]))
    _record(
        s, c, "sweep-fetch-v12-mid", "fetch", 12, _fetch_body([(TOPIC_S, 0, 4), (TOPIC_S5, 0, 0)])
    )
    for v in (1, 6):
        for label, ts in (("latest", -1), ("earliest", -2), ("by-time", oracle.T0 + 5)):
            _record(s, c, f"sweep-list-offsets-v{v}-{label}", "list_offsets", v,
                    _list_offsets_body([(TOPIC_S, 0, ts), (TOPIC_S5, 1, ts)]))  # fmt: skip
    oe = {
        "replica_id": -1,
        "topics": [
            {
                "topic": TOPIC_S,
                "partitions": [{"partition": 0, "current_leader_epoch": -1, "leader_epoch": 0}],
            }
        ],
    }
    _record(s, c, "sweep-offset-for-leader-epoch-v2", "offset_for_leader_epoch", 2, oe)
    dc = {
        "resources": [
            {"resource_type": 2, "resource_name": TOPIC_S,
             "configuration_keys": ["retention.ms", "cleanup.policy", "max.message.bytes"]},
            # (a key neither broker's configuration file sets)
            {"resource_type": 4, "resource_name": "1", "configuration_keys": ["message.max.bytes"]},
        ],
        "include_synonyms": False,
        "include_documentation": False,
    }  # fmt: skip
    _record(s, c, "sweep-describe-configs-v1", "describe_configs", 1, dc)
    _record(s, c, "sweep-describe-cluster-v0", "describe_cluster", 0,
            {"include_cluster_authorized_operations": True, "endpoint_type": 1})  # fmt: skip
    init = {
        "transactional_id": None,
        "transaction_timeout": 60_000,
        "producer_id": -1,
        "producer_epoch": -1,
    }
    for v in (0, 2, 5):
        _record(
            s, c, f"sweep-init-producer-id-v{v}", "init_producer_id", v, init, retry_top_level=True
        )


def _compressed(s: Session, c: RawClient) -> None:
    """One batch per codec: stored and served byte for byte, found by time, corrupt refused."""
    _record(s, c, "compressed-create-topic", "create_topics", 7,
            {"topics": [_create(TOPIC_Z)], "timeout": 30_000, "validate_only": False})  # fmt: skip
    _wait("compressed topic ready", lambda: _topics_ready(c, [TOPIC_Z]))
    for i, codec in enumerate(CODECS):
        batch = compressed_batch(codec, 1000 * i)
        _record(s, c, f"compressed-produce-{codec}", "produce", 9, _produce_body(TOPIC_Z, 0, batch))
    for codec in CODECS:
        bad = compressed_batch(codec, corrupt=True)
        _record(
            s,
            c,
            f"compressed-produce-corrupt-{codec}",
            "produce",
            9,
            _produce_body(TOPIC_Z, 0, bad),
        )
    _record(s, c, "compressed-fetch-v12-all", "fetch", 12, _fetch_body([(TOPIC_Z, 0, 0)]))
    _record(s, c, "compressed-fetch-v4-mid-batch", "fetch", 4, _fetch_body([(TOPIC_Z, 0, 7)]))
    for i, codec in enumerate(CODECS):
        ts = oracle.T0 + 1000 * i + 15  # the third record of that codec's batch
        _record(s, c, f"compressed-list-offsets-v7-by-time-{codec}", "list_offsets", 7,
                _list_offsets_body([(TOPIC_Z, 0, ts)]))  # fmt: skip
    _record(s, c, "compressed-list-offsets-v7-max-timestamp", "list_offsets", 7,
            _list_offsets_body([(TOPIC_Z, 0, -3)]))  # fmt: skip


# ---------------------------------------------------------------------------- groups


def subscription(*topics: str) -> bytes:
    """ConsumerProtocolSubscription v0: the consumer's JoinGroup metadata."""
    out = struct.pack(">hi", 0, len(topics))
    for t in topics:
        out += struct.pack(">h", len(t)) + t.encode()
    return out + struct.pack(">i", -1)


def assignment(parts: dict[str, list[int]]) -> bytes:
    """ConsumerProtocolAssignment v0: what the leader hands a member in SyncGroup."""
    out = struct.pack(">hi", 0, len(parts))
    for t, ps in parts.items():
        out += struct.pack(">h", len(t)) + t.encode() + struct.pack(">i", len(ps))
        out += b"".join(struct.pack(">i", p) for p in ps)
    return out + struct.pack(">i", -1)


# Version sets of the group flow: the first accepted, the first flexible and the last.
GROUP_VERSIONS = {
    "first": {"find_coordinator": 0, "join_group": 0, "sync_group": 0, "heartbeat": 0, "offset_commit": 2,
              "offset_fetch": 1, "describe_groups": 0, "list_groups": 0, "leave_group": 0, "delete_groups": 0},
    "flexible": {"find_coordinator": 3, "join_group": 6, "sync_group": 4, "heartbeat": 4, "offset_commit": 8,
                 "offset_fetch": 6, "describe_groups": 5, "list_groups": 3, "leave_group": 4, "delete_groups": 2},
    "last": {"find_coordinator": 6, "join_group": 9, "sync_group": 5, "heartbeat": 4, "offset_commit": 9,
             "offset_fetch": 9, "describe_groups": 5, "list_groups": 5, "leave_group": 5, "delete_groups": 2},
}  # fmt: skip


def _join_body(group: str, member: str, *, instance: str | None = None) -> dict[str, Any]:
    return {
        "group_id": group,
        "session_timeout": 10_000,
        "rebalance_timeout": 10_000,
        "member_id": member,
        "group_instance_id": instance,
        "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": subscription(TOPIC_S)}],
        "reason": "oracle",
    }


def _join(
    s: Session, c: RawClient, step: str, v: int, group: str, *, instance: str | None = None
) -> dict[str, Any]:
    """JoinGroup as a client does: from v4 a dynamic member is first told its member id
    (MEMBER_ID_REQUIRED) and joins again with it."""
    # (retried while a fresh Kafka still creates or loads __consumer_offsets)
    raw = _record(
        s, c, step, "join_group", v, _join_body(group, "", instance=instance), retry_top_level=True
    )
    if raw["error_code"] == 79:
        raw = _record(s, c, step + "-with-member-id", "join_group", v,
                      _join_body(group, raw["member_id"], instance=instance), retry_top_level=True)  # fmt: skip
    return raw


def _sync_body(group: str, generation: int, member: str, given: dict[str, bytes]) -> dict[str, Any]:
    return {
        "group_id": group,
        "generation_id": generation,
        "member_id": member,
        "group_instance_id": None,
        "protocol_type": "consumer",
        "protocol_name": "range",
        "assignments": [{"member_id": m, "assignment": a} for m, a in given.items()],
    }


def _member(group: str, generation: int, member: str) -> dict[str, Any]:
    return {
        "group_id": group,
        "generation_id": generation,
        "member_id": member,
        "group_instance_id": None,
    }


def _commit_body(
    group: str, generation: int, member: str, offsets: list[tuple[str, int, int]]
) -> dict[str, Any]:
    topics: dict[str, list[dict[str, Any]]] = {}
    for t, p, o in offsets:
        topics.setdefault(t, []).append(
            {
                "partition_index": p,
                "committed_offset": o,
                "committed_leader_epoch": -1,
                "commit_timestamp": -1,
                "committed_metadata": f"m{o}",
            }
        )
    return {
        "group_id": group,
        "generation_id_or_member_epoch": generation,
        "member_id": member,
        "group_instance_id": None,
        "retention_time": -1,
        "topics": [{"name": t, "partitions": ps} for t, ps in topics.items()],
    }


def _offset_fetch(
    s: Session,
    c: RawClient,
    step: str,
    v: int,
    group: str,
    parts: list[tuple[str, list[int]]] | None,
) -> None:
    topics = None if parts is None else [{"name": t, "partition_indexes": ps} for t, ps in parts]
    if v >= 8:
        body: dict[str, Any] = {
            "groups": [{"group_id": group, "topics": topics}],
            "require_stable": True,
        }
    else:
        body = {"group_id": group, "topics": topics, "require_stable": True}
    _record(s, c, step, "offset_fetch", v, body, retry_top_level=True)


def _find_coordinator(s: Session, c: RawClient, step: str, v: int, group: str) -> None:
    if v >= 4:
        body: dict[str, Any] = {"key_type": 0, "coordinator_keys": [group, "hk-oracle-other"]}
    else:
        body = {"key": group, "key_type": 0}
    _record(s, c, step, "find_coordinator", v, body, retry_top_level=True)


def _append(s: Session, step: str, api: str, version: int, raw: Any) -> None:
    s.exchanges.append(Exchange(step, api, version, normalise(raw)))


def _group_state(c: RawClient, group: str) -> str:
    """The group's state, by DescribeGroups (not recorded)."""
    return str(plain(c.call("describe_groups", 0, {"groups": [group]}))["groups"][0]["group_state"])


def _groups(s: Session, c: RawClient) -> None:
    for label, vs in GROUP_VERSIONS.items():
        _group_round(s, c, label, vs)
    # Offsets of a group that never had members (as Kafka's AdminClient alterConsumerGroupOffsets).
    _record(s, c, "groups-standalone-commit-v9", "offset_commit", 9,
            _commit_body("hk-oracle-standalone", -1, "", [(TOPIC_S, 0, 2)]))  # fmt: skip
    _record(s, c, "groups-standalone-commit-v9-bad-generation", "offset_commit", 9,
            _commit_body("hk-oracle-standalone", 7, "nobody", [(TOPIC_S, 0, 3)]))  # fmt: skip
    _offset_fetch(
        s, c, "groups-standalone-offset-fetch-v9", 9, "hk-oracle-standalone", [(TOPIC_S, [0, 1])]
    )
    od = {"group_id": "hk-oracle-standalone",
          "topics": [{"name": TOPIC_S, "partitions": [{"partition_index": 0}]}]}  # fmt: skip
    _record(s, c, "groups-offset-delete-v0", "offset_delete", 0, od)
    _offset_fetch(
        s, c, "groups-standalone-offset-fetch-after-delete", 9, "hk-oracle-standalone", None
    )
    od_missing = {"group_id": "hk-oracle-never", "topics": od["topics"]}
    _record(s, c, "groups-offset-delete-v0-unknown-group", "offset_delete", 0, od_missing)


def _group_round(s: Session, c: RawClient, label: str, vs: dict[str, int]) -> None:
    group = f"hk-oracle-g-{label}"
    p = f"group-{label}"
    _find_coordinator(
        s, c, f"{p}-find-coordinator-v{vs['find_coordinator']}", vs["find_coordinator"], group
    )
    jv, sv, hv = vs["join_group"], vs["sync_group"], vs["heartbeat"]
    a = _join(s, c, f"{p}-join-a-v{jv}", jv, group)
    gen, ma = a["generation_id"], a["member_id"]
    _record(
        s,
        c,
        f"{p}-sync-a-v{sv}",
        "sync_group",
        sv,
        _sync_body(group, gen, ma, {ma: assignment({TOPIC_S: [0]})}),
    )
    _record(s, c, f"{p}-heartbeat-v{hv}", "heartbeat", hv, _member(group, gen, ma))
    _record(
        s, c, f"{p}-heartbeat-v{hv}-unknown-member", "heartbeat", hv, _member(group, gen, "nobody")
    )
    _record(
        s, c, f"{p}-heartbeat-v{hv}-bad-generation", "heartbeat", hv, _member(group, gen + 5, ma)
    )

    # A second member joins the stable group: the first learns of it by heartbeat and
    # joins again; then the leader assigns everything to itself and nothing to the other.
    with s.client() as c2:
        pending = c2.send("join_group", jv, _join_body(group, ""))
        if jv >= 4:  # told its member id at once; the join with it waits for the rebalance
            b = plain(c2.receive(pending))
            _append(s, f"{p}-join-b-v{jv}", "JoinGroup", jv, b)
            pending = c2.send("join_group", jv, _join_body(group, b["member_id"]))
        _wait(f"{p}: rebalance begun", lambda: _group_state(c, group) == "PreparingRebalance")
        _record(s, c, f"{p}-heartbeat-a-sees-rebalance", "heartbeat", hv, _member(group, gen, ma))
        a = _record(s, c, f"{p}-rejoin-a-v{jv}", "join_group", jv, _join_body(group, ma))
        b = plain(c2.receive(pending))
        _append(s, f"{p}-join-b-v{jv}-waited", "JoinGroup", jv, b)
        gen, mb = a["generation_id"], b["member_id"]
        leader_sync = _sync_body(group, gen, ma, {ma: assignment({TOPIC_S: [0], TOPIC_S5: [0, 1]})})
        _record(s, c, f"{p}-sync-leader-v{sv}", "sync_group", sv, leader_sync)
        follower = plain(c2.call("sync_group", sv, _sync_body(group, gen, mb, {})))
        _append(s, f"{p}-sync-follower-given-nothing-v{sv}", "SyncGroup", sv, follower)
        follower_hb = plain(c2.call("heartbeat", hv, _member(group, gen, mb)))
        _append(s, f"{p}-heartbeat-follower", "Heartbeat", hv, follower_hb)

        cv, fv = vs["offset_commit"], vs["offset_fetch"]
        commit = _commit_body(
            group,
            gen,
            ma,
            [(TOPIC_S, 0, 5), (TOPIC_S5, 0, 0), (TOPIC_S5, 1, 1), (oracle.MISSING, 0, 1)],
        )
        _record(s, c, f"{p}-offset-commit-v{cv}", "offset_commit", cv, commit)
        stale = _commit_body(group, gen - 1, ma, [(TOPIC_S, 0, 6)])
        _record(s, c, f"{p}-offset-commit-v{cv}-stale-generation", "offset_commit", cv, stale)
        _offset_fetch(
            s, c, f"{p}-offset-fetch-v{fv}", fv, group, [(TOPIC_S, [0, 3]), (TOPIC_S5, [0, 1])]
        )
        if fv >= 2:  # null topics ("all") from v2
            _offset_fetch(s, c, f"{p}-offset-fetch-v{fv}-all", fv, group, None)

        dv, lv = vs["describe_groups"], vs["list_groups"]
        dg = {"groups": [group, "hk-oracle-never"], "include_authorized_operations": True}
        _record(s, c, f"{p}-describe-groups-v{dv}", "describe_groups", dv, dg)
        lg: dict[str, Any] = {"states_filter": [], "types_filter": []}
        _record(s, c, f"{p}-list-groups-v{lv}", "list_groups", lv, lg)
        if lv >= 4:
            lg = {"states_filter": ["Stable"], "types_filter": ["classic"] if lv >= 5 else []}
            _record(s, c, f"{p}-list-groups-v{lv}-filtered", "list_groups", lv, lg)

        # Leaving: one by one before v3, both in one request from v3.
        lvv = vs["leave_group"]
        if lvv >= 3:
            members = [
                {"member_id": m, "group_instance_id": None, "reason": "done"}
                for m in (ma, mb, "nobody")
            ]
            _record(
                s,
                c,
                f"{p}-leave-group-v{lvv}",
                "leave_group",
                lvv,
                {"group_id": group, "members": members},
            )
        else:
            _record(
                s,
                c,
                f"{p}-leave-group-v{lvv}-a",
                "leave_group",
                lvv,
                {"group_id": group, "member_id": ma},
            )
            _record(
                s,
                c,
                f"{p}-leave-group-v{lvv}-b",
                "leave_group",
                lvv,
                {"group_id": group, "member_id": mb},
            )
    _record(s, c, f"{p}-describe-groups-v{dv}-after-leave", "describe_groups", dv, dg)
    gv = vs["delete_groups"]
    _record(
        s,
        c,
        f"{p}-delete-groups-v{gv}",
        "delete_groups",
        gv,
        {"groups_names": [group, "hk-oracle-never"]},
    )
    _offset_fetch(s, c, f"{p}-offset-fetch-v{fv}-after-delete", fv, group, [(TOPIC_S, [0])])


def _cg_heartbeat(group: str, member: str, epoch: int, **kw: Any) -> dict[str, Any]:
    join = epoch == 0
    body: dict[str, Any] = {
        "group_id": group,
        "member_id": member,
        "member_epoch": epoch,
        "instance_id": None,
        "rack_id": None,
        "rebalance_timeout": 30_000 if join else -1,
        "subscribed_topic_names": [TOPIC_S] if join else None,
        "subscribed_topic_regex": None,
        "server_assignor": None,
        "topic_partitions": [] if join else None,
    }
    body.update(kw)
    return body


def _consumer_groups(s: Session, c: RawClient) -> None:
    """KIP-848 on both brokers: TOPIC_S has one partition, so every answer is determined."""
    g1, g0 = "hk-oracle-cg1", "hk-oracle-cg0"
    member = "hk-oracle-member-1"  # v1: the client names itself (KIP-1082)
    joined = _record(s, c, "cg-heartbeat-v1-join", "consumer_group_heartbeat", 1, _cg_heartbeat(g1, member, 0),
                     retry_top_level=True)  # fmt: skip
    owned = [{"topic_id": uuid.UUID(str(t["topic_id"])), "partitions": list(t["partitions"])}
             for t in (joined.get("assignment") or {}).get("topic_partitions", [])]  # fmt: skip
    epoch = joined["member_epoch"]
    _record(
        s,
        c,
        "cg-heartbeat-v1-ack",
        "consumer_group_heartbeat",
        1,
        _cg_heartbeat(g1, member, epoch, topic_partitions=owned),
    )
    _record(
        s,
        c,
        "cg-heartbeat-v1-fenced",
        "consumer_group_heartbeat",
        1,
        _cg_heartbeat(g1, member, epoch + 5),
    )
    _record(
        s,
        c,
        "cg-heartbeat-v1-unknown-member",
        "consumer_group_heartbeat",
        1,
        _cg_heartbeat(g1, "hk-oracle-nobody", 3),
    )
    _record(s, c, "cg-heartbeat-v1-join-without-subscription", "consumer_group_heartbeat", 1,
            _cg_heartbeat(g1, "hk-oracle-member-2", 0, subscribed_topic_names=None))  # fmt: skip
    _record(
        s,
        c,
        "cg-heartbeat-v1-empty-member-id",
        "consumer_group_heartbeat",
        1,
        _cg_heartbeat(g0, "", 0),
    )
    v0 = _record(
        s, c, "cg-heartbeat-v0-join", "consumer_group_heartbeat", 0, _cg_heartbeat(g0, "", 0)
    )
    for v in (0, 1):
        _record(s, c, f"cg-describe-v{v}", "consumer_group_describe", v,
                {"group_ids": [g1, "hk-oracle-never"], "include_authorized_operations": False})  # fmt: skip
    _record(
        s,
        c,
        "cg-describe-groups-v5",
        "describe_groups",
        5,
        {"groups": [g1], "include_authorized_operations": False},
    )
    _record(
        s,
        c,
        "cg-list-groups-v5",
        "list_groups",
        5,
        {"states_filter": [], "types_filter": ["consumer"]},
    )
    _record(s, c, "cg-classic-join-v9", "join_group", 9, _join_body(g1, ""))
    _record(
        s,
        c,
        "cg-offset-commit-v9",
        "offset_commit",
        9,
        _commit_body(g1, epoch, member, [(TOPIC_S, 0, 5)]),
    )
    _record(
        s,
        c,
        "cg-offset-commit-v9-stale-epoch",
        "offset_commit",
        9,
        _commit_body(g1, epoch - 1, member, [(TOPIC_S, 0, 6)]),
    )
    _record(
        s, c, "cg-heartbeat-v1-leave", "consumer_group_heartbeat", 1, _cg_heartbeat(g1, member, -1)
    )
    if v0.get("member_id"):
        _record(
            s,
            c,
            "cg-heartbeat-v0-leave",
            "consumer_group_heartbeat",
            0,
            _cg_heartbeat(g0, v0["member_id"], -1),
        )
    _record(
        s,
        c,
        "cg-describe-v1-empty",
        "consumer_group_describe",
        1,
        {"group_ids": [g1], "include_authorized_operations": False},
    )
    _offset_fetch(s, c, "cg-offset-fetch-v9-after-leave", 9, g1, [(TOPIC_S, [0])])
    _record(s, c, "cg-delete-groups", "delete_groups", 2, {"groups_names": [g1, g0]})


def _cleanup(s: Session, c: RawClient) -> None:
    dt = {"topic_names": [TOPIC_S, oracle.MISSING], "timeout": 30_000}
    _record(s, c, "sweep-delete-topics-v1", "delete_topics", 1, dt)
    dt = {"topic_names": [TOPIC_S5, TOPIC_Z], "timeout": 30_000}
    _record(s, c, "sweep-delete-topics-v4", "delete_topics", 4, dt)
    _wait("sweep topics deleted", lambda: _topics_gone(c, [TOPIC_S, TOPIC_S5, TOPIC_Z]))


# ---------------------------------------------------------------------------- SASL


def _exchange(s: Session, step: str, api: str, version: int, raw: dict[str, Any]) -> None:
    s.exchanges.append(Exchange(step, oracle.API_NAMES[_KEYS[api]], version, normalise(raw)))


_KEYS = {"sasl_handshake": 17, "sasl_authenticate": 36, "api_versions": 18, "metadata": 3}


def _call(
    s: Session, c: RawClient, step: str, api: str, version: int, body: dict[str, Any]
) -> dict[str, Any]:
    raw = dict(plain(c.call(api, version, body)))
    _exchange(s, step, api, version, raw)
    return raw


def _closed(s: Session, c: RawClient, step: str) -> None:
    s.exchanges.append(
        Exchange(step, "SaslAuthenticate", 0, {"connection_closed": c.closed_by_peer()})
    )


def _sasl(s: Session, sasl_port: int) -> None:
    host = s.host
    mech = {"mechanism": "PLAIN"}
    with RawClient(host, sasl_port) as c:
        _call(s, c, "sasl-api-versions-before-auth", "api_versions", 3,
              {"client_software_name": "hk-oracle", "client_software_version": "1.0"})  # fmt: skip
        _call(s, c, "sasl-handshake-v1-plain", "sasl_handshake", 1, mech)
        _call(s, c, "sasl-authenticate-v2-plain", "sasl_authenticate", 2,
              {"auth_bytes": f"\0{SASL_USER}\0{SASL_PASSWORD}".encode()})  # fmt: skip
        _call(s, c, "sasl-metadata-after-plain", "metadata", 12,
              {"topics": [], "allow_auto_topic_creation": False, "include_topic_authorized_operations": False})  # fmt: skip
    with RawClient(host, sasl_port) as c:
        _call(
            s,
            c,
            "sasl-handshake-v0-unknown-mechanism",
            "sasl_handshake",
            0,
            {"mechanism": "GSSAPI"},
        )
        _closed(s, c, "sasl-closed-after-unknown-mechanism")
    with RawClient(host, sasl_port) as c:
        _call(s, c, "sasl-handshake-v1-plain-wrong", "sasl_handshake", 1, mech)
        _call(s, c, "sasl-authenticate-v0-wrong-password", "sasl_authenticate", 0,
              {"auth_bytes": f"\0{SASL_USER}\0nope".encode()})  # fmt: skip
        _closed(s, c, "sasl-closed-after-wrong-password")
    with RawClient(host, sasl_port) as c:
        # A request other than ApiVersions/SaslHandshake before authenticating.
        c.send("metadata", 12, {"topics": [], "allow_auto_topic_creation": False,
                                "include_topic_authorized_operations": False})  # fmt: skip
        _closed(s, c, "sasl-metadata-before-auth-closes")
    with RawClient(host, sasl_port) as c:
        _scram(s, c)
    with RawClient(host, s.port) as c:
        _call(s, c, "sasl-handshake-v1-on-plaintext", "sasl_handshake", 1, mech)
        _call(
            s,
            c,
            "sasl-authenticate-v2-on-plaintext",
            "sasl_authenticate",
            2,
            {"auth_bytes": b"\0a\0b"},
        )


def _scram(s: Session, c: RawClient) -> None:
    """SCRAM-SHA-256 (RFC 5802/7677) from this side; the server's nonce, salt and
    signature are random, so what is compared is their shape and the server's verdicts."""
    _call(s, c, "sasl-handshake-v1-scram", "sasl_handshake", 1, {"mechanism": "SCRAM-SHA-256"})
    nonce = base64.b64encode(uuid.uuid4().bytes).decode()
    first_bare = f"n={SASL_USER},r={nonce}"
    raw = dict(plain(c.call("sasl_authenticate", 2, {"auth_bytes": f"n,,{first_bare}".encode()})))
    server_first = bytes.fromhex(raw["auth_bytes"]).decode()
    fields = dict(kv.split("=", 1) for kv in server_first.split(","))
    shape = {k: ("<client nonce + server nonce>" if k == "r" and v.startswith(nonce) and len(v) > len(nonce)
                 else "<salt>" if k == "s" else v) for k, v in fields.items()}  # fmt: skip
    _exchange(
        s, "sasl-authenticate-v2-scram-first", "sasl_authenticate", 2, {**raw, "auth_bytes": shape}
    )
    salt, iterations = base64.b64decode(fields["s"]), int(fields["i"])
    salted = hashlib.pbkdf2_hmac("sha256", SASL_PASSWORD.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored = hashlib.sha256(client_key).digest()
    final_bare = f"c=biws,r={fields['r']}"
    message = f"{first_bare},{server_first},{final_bare}".encode()
    signature = hmac.new(stored, message, hashlib.sha256).digest()
    proof = base64.b64encode(
        bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    ).decode()
    raw = dict(
        plain(c.call("sasl_authenticate", 0, {"auth_bytes": f"{final_bare},p={proof}".encode()}))
    )
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    expected = base64.b64encode(hmac.new(server_key, message, hashlib.sha256).digest()).decode()
    final = bytes.fromhex(raw["auth_bytes"]).decode() if raw["auth_bytes"] else ""
    verdict = "server signature verified" if final == f"v={expected}" else f"unexpected: {final!r}"
    _exchange(
        s,
        "sasl-authenticate-v0-scram-final",
        "sasl_authenticate",
        0,
        {**raw, "auth_bytes": verdict},
    )
    _call(s, c, "sasl-api-versions-after-scram", "api_versions", 3,
          {"client_software_name": "hk-oracle", "client_software_version": "1.0"})  # fmt: skip

"""Consumer-group APIs: FindCoordinator, Join/Sync/Heartbeat/LeaveGroup, OffsetCommit,
OffsetFetch, DescribeGroups, ListGroups, DeleteGroups, OffsetDelete.

Thin: translate the kio request of whatever version into calls on `node.groups` (the
`broker.groups.coordinator.GroupCoordinator`) and its answer into a version-agnostic
description. JoinGroup and SyncGroup that must wait for the rest of the group are answered
through `Deferred`, so the connection keeps reading (heartbeats, commits) meanwhile; the
reply still leaves in request order; so are the classic requests of a consumer group's
classic members (KIP-848's mixed group), answered once what they wrote is stored.
OffsetCommit/DeleteGroups/OffsetDelete wait for their
records in the offsets archive to be covered by a signed head (and, in a cluster, to be
held by the in-sync brokers).

Rights as in Kafka (broker.security): FindCoordinator, DescribeGroups and ListGroups
need DESCRIBE on the group (ListGroups leaves out the others), Join/Sync/Heartbeat/
LeaveGroup, OffsetCommit and OffsetFetch need READ on it, DeleteGroups and OffsetDelete
DELETE; OffsetCommit and OffsetDelete also READ on each topic, OffsetFetch DESCRIBE on
each topic. Denials are GROUP_AUTHORIZATION_FAILED / TOPIC_AUTHORIZATION_FAILED where
each version carries an error.

This node is the coordinator of every group when alone. In cluster mode groups are
sharded as in Kafka: a group maps to a partition of __consumer_offsets, whose coordinator
etcd names (broker/cluster/shards.py); FindCoordinator answers that broker, whichever
broker is asked, and the others answer the group's requests with NOT_COORDINATOR. A
broker that has not taken a partition over yet (it waits for the peers' offsets,
`GroupCoordinator.take_over`) answers its groups with COORDINATOR_LOAD_IN_PROGRESS, and
ListGroups with it as its error, as Kafka's loading coordinator does; clients retry both.
A FindCoordinator for a transactional id is answered by broker/handlers/transactions.py.
Groups of the KIP-848 consumer protocol (broker.handlers.consumer_groups) share the
OffsetCommit, OffsetFetch, ListGroups, DescribeGroups and DeleteGroups paths here.
"""

from __future__ import annotations

from typing import Any

from broker.api import Deferred, Reply, RequestContext, api
from broker.groups import codes
from broker.groups.coordinator import CommitEntry, GroupCoordinator, Waiter
from broker.groups.state import JoinResult, SyncResult
from broker.handlers.transactions import find_transaction_coordinator
from broker.security.authz import OPEN_OPERATIONS, Operation, Resource
from broker.security.session import authorize, authorize_group, authorized_operations
from broker.shape import field_of

GROUP_KEY, TRANSACTION_KEY = 0, 1
INT32_MIN = -(2**31)
# Everything a group allows when there is no authorizer, as Kafka reports it (READ,
# DELETE, DESCRIBE, DESCRIBE_CONFIGS, ALTER_CONFIGS).
GROUP_OPERATIONS = OPEN_OPERATIONS[Resource.GROUP]
GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED = 30, 29


def _coordinator(ctx: RequestContext) -> GroupCoordinator:
    return ctx.node.groups


def _refusal(ctx: RequestContext, group_id: str) -> int:
    """NONE, or why this broker does not serve requests for `group_id` now (cluster mode):
    NOT_COORDINATOR when it does not coordinate the group's partition of
    __consumer_offsets, COORDINATOR_LOAD_IN_PROGRESS while it takes the partition over
    (`GroupCoordinator.refusal`)."""
    return ctx.node.groups.refusal(group_id)


def _ms(value: Any) -> int:
    return int(value.total_seconds() * 1000) if hasattr(value, "total_seconds") else int(value)


def _client_host(ctx: RequestContext) -> str:
    host = ctx.peer.rsplit(":", 1)[0] if ":" in ctx.peer else ctx.peer
    return "/" + host  # Kafka prints the InetAddress, which starts with a slash


# ------------------------------------------------------------------ FindCoordinator


@api(10, "FindCoordinator", (0, 6))
async def find_coordinator(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    # The coordinator's address on the listener this request came in on, as Metadata.
    host, port = ctx.session.listener.advertised if ctx.session is not None else node.config.advertised
    key_type = field_of(req, "key_type", GROUP_KEY)

    def one(key: str) -> dict[str, Any]:
        if key_type == GROUP_KEY and not authorize_group(ctx, Operation.DESCRIBE, key):
            return {"key": key, "node_id": -1, "host": "", "port": -1, "error_code": GROUP_AUTHORIZATION_FAILED, "error_message": "Group authorization failed."}
        if key_type == GROUP_KEY:
            # Cluster mode: the coordinator etcd names for the group's partition of
            # __consumer_offsets (fenced by that record's revision), whichever broker is
            # asked, so a group never has two coordinators.
            coordinator_id = _coordinator(ctx).coordinator_of(key)
            address = (host, port) if coordinator_id == node.config.node_id else None
            if address is None and coordinator_id is not None and node.cluster.alive(coordinator_id):
                b = node.cluster.brokers.get(coordinator_id)
                address = None if b is None else (b.host, b.port)
            if coordinator_id is None or address is None:  # none named or alive right now: retriable
                return {"key": key, "node_id": -1, "host": "", "port": -1, "error_code": codes.COORDINATOR_NOT_AVAILABLE,
                        "error_message": "The group's coordinator is not available right now."}
            node.offsets_topic_in_use = True  # Kafka creates __consumer_offsets here, once authorized
            return {"key": key, "node_id": coordinator_id, "host": address[0], "port": address[1], "error_code": codes.NONE, "error_message": None}
        if key_type == TRANSACTION_KEY:
            return find_transaction_coordinator(ctx, key)
        return {"key": key, "node_id": -1, "host": "", "port": -1, "error_code": codes.INVALID_REQUEST,
                "error_message": f"Unknown key type {key_type}"}

    if ctx.api_version >= 4:
        return {"throttle_time": 0, "coordinators": [one(k) for k in req.coordinator_keys]}
    answer = one(req.key)
    answer["throttle_time"] = 0
    return answer


# ------------------------------------------------------------------ JoinGroup


def _join_description(result: JoinResult, version: int) -> dict[str, Any]:
    protocol_name = result.protocol_name
    if protocol_name is None and version < 7:
        protocol_name = ""  # null only exists from v7
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "generation_id": result.generation_id,
        "protocol_type": result.protocol_type,
        "protocol_name": protocol_name,
        "leader": result.leader,
        "skip_assignment": result.skip_assignment,
        "member_id": result.member_id,
        "members": [{"member_id": m.member_id, "group_instance_id": m.group_instance_id, "metadata": m.metadata} for m in result.members],
    }


@api(11, "JoinGroup", (0, 9))
async def join_group(ctx: RequestContext, req: Any) -> Reply:
    version = ctx.api_version
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return _join_description(JoinResult(GROUP_AUTHORIZATION_FAILED, req.member_id), version)
    if refusal := _refusal(ctx, req.group_id):
        return _join_description(JoinResult(refusal, req.member_id), version)
    session_ms = _ms(req.session_timeout)
    rebalance_ms = _ms(req.rebalance_timeout) if version >= 1 else session_ms
    answer = _coordinator(ctx).join(
        req.group_id,
        req.member_id,
        field_of(req, "group_instance_id"),
        req.protocol_type,
        [(p.name, bytes(p.metadata)) for p in req.protocols],
        session_timeout_ms=session_ms,
        rebalance_timeout_ms=rebalance_ms,
        require_known_member_id=version >= 4 and field_of(req, "group_instance_id") is None,
        supports_skip_assignment=version >= 9,
        client_id=ctx.client_id or "",
        client_host=_client_host(ctx),
    )
    if isinstance(answer, Waiter):
        waiter = answer

        async def finish() -> dict[str, Any]:
            result: JoinResult = await waiter.wait()
            return _join_description(result, version)

        return Deferred(finish)
    return _join_description(answer, version)


# ------------------------------------------------------------------ SyncGroup


def _sync_description(result: SyncResult) -> dict[str, Any]:
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "protocol_type": result.protocol_type,
        "protocol_name": result.protocol_name,
        "assignment": result.assignment,
    }


@api(14, "SyncGroup", (0, 5))
async def sync_group(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return _sync_description(SyncResult(GROUP_AUTHORIZATION_FAILED))
    if refusal := _refusal(ctx, req.group_id):
        return _sync_description(SyncResult(refusal))
    answer = _coordinator(ctx).sync(
        req.group_id,
        req.generation_id,
        req.member_id,
        field_of(req, "group_instance_id"),
        {a.member_id: bytes(a.assignment) for a in req.assignments},
        protocol_type=field_of(req, "protocol_type"),
        protocol_name=field_of(req, "protocol_name"),
    )
    if isinstance(answer, Waiter):
        waiter = answer

        async def finish() -> dict[str, Any]:
            result: SyncResult = await waiter.wait()
            return _sync_description(result)

        return Deferred(finish)
    return _sync_description(answer)


# ------------------------------------------------------------------ Heartbeat, LeaveGroup


@api(12, "Heartbeat", (0, 4))
async def heartbeat(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return {"throttle_time": 0, "error_code": GROUP_AUTHORIZATION_FAILED}
    if refusal := _refusal(ctx, req.group_id):
        return {"throttle_time": 0, "error_code": refusal}
    answer = _coordinator(ctx).heartbeat(req.group_id, req.generation_id, req.member_id, field_of(req, "group_instance_id"))
    if isinstance(answer, Waiter):
        waiter = answer

        async def finish() -> dict[str, Any]:
            return {"throttle_time": 0, "error_code": await waiter.wait()}

        return Deferred(finish)
    return {"throttle_time": 0, "error_code": answer}


@api(13, "LeaveGroup", (0, 5))
async def leave_group(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return {"throttle_time": 0, "error_code": GROUP_AUTHORIZATION_FAILED, "members": []}
    if refusal := _refusal(ctx, req.group_id):
        return {"throttle_time": 0, "error_code": refusal, "members": []}
    if ctx.api_version >= 3:
        leaving = [(m.member_id, field_of(m, "group_instance_id")) for m in req.members]
    else:
        leaving = [(req.member_id, None)]
    answer = _coordinator(ctx).leave(req.group_id, leaving)
    version = ctx.api_version

    def described(top: int, errors: list[int]) -> dict[str, Any]:
        if version < 3:
            # One member: its outcome is the top-level error (LeaveGroupResponse.getError).
            return {"throttle_time": 0, "error_code": top if top != codes.NONE or not errors else errors[0]}
        return {
            "throttle_time": 0,
            "error_code": top,
            "members": [
                {"member_id": member_id, "group_instance_id": instance_id, "error_code": error}
                for (member_id, instance_id), error in zip(leaving, errors, strict=False)
            ],
        }

    if isinstance(answer, Waiter):
        waiter = answer

        async def finish() -> dict[str, Any]:
            return described(*await waiter.wait())

        return Deferred(finish)
    return described(*answer)


# ------------------------------------------------------------------ offsets


@api(8, "OffsetCommit", (2, 9))
async def offset_commit(ctx: RequestContext, req: Any) -> Reply:
    coordinator = _coordinator(ctx)
    entries = [
        CommitEntry(t.name, p.partition_index, p.committed_offset, field_of(p, "committed_leader_epoch", -1), p.committed_metadata)
        for t in req.topics
        for p in t.partitions
    ]
    # Kafka: without READ on the group every partition fails; else each topic needs READ.
    if not authorize_group(ctx, Operation.READ, req.group_id):
        refused = dict.fromkeys(range(len(entries)), GROUP_AUTHORIZATION_FAILED)
    else:
        readable = {t.name: authorize(ctx, Operation.READ, t.name) for t in req.topics}
        refused = {i: TOPIC_AUTHORIZATION_FAILED for i, e in enumerate(entries) if not readable[e.topic]}
        # As Kafka's KafkaApis: a topic it does not know is refused before the group is
        # asked, so its partitions get UNKNOWN_TOPIC_OR_PARTITION whatever the group says.
        for i, e in enumerate(entries):
            if i not in refused and ctx.node.topics.get(e.topic) is None:
                refused[i] = codes.UNKNOWN_TOPIC_OR_PARTITION

    retention = field_of(req, "retention_time", -1)  # v2-v4 only
    retention_ms = -1 if retention is None else _ms(retention)

    async def finish() -> dict[str, Any]:
        if refusal := _refusal(ctx, req.group_id):
            refused.update({i: refused.get(i, refusal) for i in range(len(entries))})
        allowed = [e for i, e in enumerate(entries) if i not in refused]
        if allowed or not (entries or refusal):
            await coordinator.commit_offsets(
                req.group_id,
                req.generation_id_or_member_epoch,
                req.member_id,
                field_of(req, "group_instance_id"),
                allowed,
                api_version=ctx.api_version,
                retention_time_ms=retention_ms,
            )
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for i, e in enumerate(entries):
            by_topic.setdefault(e.topic, []).append({"partition_index": e.partition, "error_code": refused.get(i, e.error)})
        return {"throttle_time": 0, "topics": [{"name": n, "partitions": ps} for n, ps in by_topic.items()]}

    return Deferred(finish)


def _unfetched(topics: Any, error: int) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "partitions": [{"partition_index": i, "committed_offset": -1, "committed_leader_epoch": -1, "metadata": "", "error_code": error} for i in t.partition_indexes]}
        for t in topics
    ]


def _fetched_topics(ctx: RequestContext, group_id: str, topics: Any, require_stable: bool = False) -> list[dict[str, Any]]:
    # Kafka: a named topic the principal may not DESCRIBE answers TOPIC_AUTHORIZATION_FAILED
    # per partition; asking for all the group's offsets leaves such topics out.
    # require_stable (v7+, sent by read_committed consumers): a partition with a
    # transactional offset commit still pending answers UNSTABLE_OFFSET_COMMIT (the client
    # retries until the transaction is complete), as Kafka's OffsetMetadataManager does.
    unstable = (
        ctx.node.groups.pending_offsets(group_id) | ctx.node.transactions.pending_offsets(group_id)
        if require_stable
        else set()
    )
    if topics is None:
        wanted, denied = None, []
    else:
        visible = {t.name: authorize(ctx, Operation.DESCRIBE, t.name) for t in topics}
        wanted = [(t.name, list(t.partition_indexes)) for t in topics if visible[t.name]]
        denied = [t for t in topics if not visible[t.name]]
    out = []
    for topic, parts in _coordinator(ctx).fetch_offsets(group_id, wanted).items():
        if topics is None and not authorize(ctx, Operation.DESCRIBE, topic, quiet=True):
            continue
        partitions = []
        for index, committed in parts.items():
            if (topic, index) in unstable:
                partitions.append({"partition_index": index, "committed_offset": -1, "committed_leader_epoch": -1, "metadata": "", "error_code": codes.UNSTABLE_OFFSET_COMMIT})
            elif committed is None:
                partitions.append({"partition_index": index, "committed_offset": -1, "committed_leader_epoch": -1, "metadata": "", "error_code": codes.NONE})
            else:
                partitions.append(
                    {
                        "partition_index": index,
                        "committed_offset": committed.offset,
                        "committed_leader_epoch": committed.leader_epoch,
                        "metadata": committed.metadata,
                        "error_code": codes.NONE,
                    }
                )
        out.append({"name": topic, "partitions": partitions})
    return out + _unfetched(denied, TOPIC_AUTHORIZATION_FAILED)


@api(9, "OffsetFetch", (1, 9))
async def offset_fetch(ctx: RequestContext, req: Any) -> Reply:
    # v9's member_id/member_epoch (KIP-848) are checked only for consumer-protocol groups
    # (UNKNOWN_MEMBER_ID, STALE_MEMBER_EPOCH); for classic groups Kafka ignores them
    # (ClassicGroup.validateOffsetFetch fails only a Dead group, which answers like an
    # unknown one: every offset -1, no error).
    require_stable = bool(field_of(req, "require_stable", False))  # v7+
    if ctx.api_version >= 8:
        coordinator = _coordinator(ctx)
        groups = [
            {"group_id": g.group_id, "topics": [], "error_code": GROUP_AUTHORIZATION_FAILED}
            if not authorize_group(ctx, Operation.READ, g.group_id)
            else {"group_id": g.group_id, "topics": [], "error_code": refusal}
            if (refusal := _refusal(ctx, g.group_id))
            else {"group_id": g.group_id, "topics": [], "error_code": member_error}
            if (member_error := coordinator.groups.validate_offset_fetch(
                g.group_id, field_of(g, "member_id"), field_of(g, "member_epoch", -1)))
            else {"group_id": g.group_id, "topics": _fetched_topics(ctx, g.group_id, g.topics, require_stable), "error_code": codes.NONE}
            for g in req.groups
        ]
        return {"throttle_time": 0, "groups": groups}
    refusal = _refusal(ctx, req.group_id)
    if not authorize_group(ctx, Operation.READ, req.group_id):
        refusal = GROUP_AUTHORIZATION_FAILED
    if refusal:
        # v1 has no top-level error: Kafka puts it on every partition asked for.
        topics = _unfetched(req.topics or [], refusal) if ctx.api_version < 2 else []
        return {"throttle_time": 0, "topics": topics, "error_code": refusal}
    return {"throttle_time": 0, "topics": _fetched_topics(ctx, req.group_id, req.topics, require_stable), "error_code": codes.NONE}


# ------------------------------------------------------------------ admin


@api(15, "DescribeGroups", (0, 5))
async def describe_groups(ctx: RequestContext, req: Any) -> Reply:
    coordinator = _coordinator(ctx)
    include_ops = field_of(req, "include_authorized_operations", False)
    described = []
    for group_id in req.groups:
        if not authorize_group(ctx, Operation.DESCRIBE, group_id):
            described.append(
                {
                    "error_code": GROUP_AUTHORIZATION_FAILED,
                    "group_id": group_id,
                    "group_state": "",
                    "protocol_type": "",
                    "protocol_data": "",
                    "members": [],
                    "authorized_operations": INT32_MIN,
                }
            )
            continue
        if refusal := _refusal(ctx, group_id):
            described.append({"error_code": refusal, "group_id": group_id, "group_state": "",
                              "protocol_type": "", "protocol_data": "", "members": [],
                              "authorized_operations": INT32_MIN})
            continue
        s = coordinator.describe(group_id)
        ops = authorized_operations(ctx, group_id, Resource.GROUP)
        described.append(
            {
                "error_code": codes.NONE,
                "group_id": group_id,
                "group_state": s.state,
                "protocol_type": s.protocol_type,
                "protocol_data": s.protocol,
                "members": [
                    {
                        "member_id": m.member_id,
                        "group_instance_id": m.group_instance_id,
                        "client_id": m.client_id,
                        "client_host": m.client_host,
                        "member_metadata": m.metadata,
                        "member_assignment": m.assignment,
                    }
                    for m in s.members
                ],
                "authorized_operations": (GROUP_OPERATIONS if ops is None else ops) if include_ops else INT32_MIN,
            }
        )
    return {"throttle_time": 0, "groups": described}


@api(16, "ListGroups", (0, 5))
async def list_groups(ctx: RequestContext, req: Any) -> Reply:
    # A broker lists the groups it coordinates (Kafka's admin asks every broker): in cluster
    # mode, those of the partitions of __consumer_offsets it serves. While it takes one
    # over, COORDINATOR_LOAD_IN_PROGRESS, as Kafka's loading coordinator.
    refusal = _coordinator(ctx).refusal_all()
    listed = [] if refusal else _coordinator(ctx).list_groups(field_of(req, "states_filter", ()), field_of(req, "types_filter", ()))
    listed = [g for g in listed if authorize_group(ctx, Operation.DESCRIBE, g[0], quiet=True)]
    return {
        "throttle_time": 0,
        "error_code": codes.COORDINATOR_LOAD_IN_PROGRESS if refusal == codes.COORDINATOR_LOAD_IN_PROGRESS else codes.NONE,
        "groups": [
            {"group_id": gid, "protocol_type": ptype, "group_state": state, "group_type": _coordinator(ctx).groups.group_type(gid)}
            for gid, ptype, state in listed
        ],
    }


@api(42, "DeleteGroups", (0, 2))
async def delete_groups(ctx: RequestContext, req: Any) -> Reply:
    coordinator = _coordinator(ctx)
    names = list(req.groups_names)
    refused = {g for g in dict.fromkeys(names) if not authorize_group(ctx, Operation.DELETE, g)}

    async def finish() -> dict[str, Any]:
        allowed = [g for g in names if g not in refused]
        results = dict.fromkeys(refused, GROUP_AUTHORIZATION_FAILED)
        refusals = {g: r for g in allowed if (r := _refusal(ctx, g))}
        results.update(refusals)
        if served := [g for g in allowed if g not in refusals]:
            results.update(await coordinator.delete_groups(served))
        return {"throttle_time": 0, "results": [{"group_id": g, "error_code": results[g]} for g in dict.fromkeys(names)]}

    return Deferred(finish)


@api(47, "OffsetDelete", (0, 0))
async def offset_delete(ctx: RequestContext, req: Any) -> Reply:
    coordinator = _coordinator(ctx)
    node = ctx.node
    # Kafka: DELETE on the group, then READ on each topic.
    if not authorize_group(ctx, Operation.DELETE, req.group_id):
        return {"error_code": GROUP_AUTHORIZATION_FAILED, "throttle_time": 0, "topics": []}
    if refusal := _refusal(ctx, req.group_id):
        return {"error_code": refusal, "throttle_time": 0, "topics": []}
    requested = [(t.name, p.partition_index) for t in req.topics for p in t.partitions]
    readable = {t.name: authorize(ctx, Operation.READ, t.name) for t in req.topics}
    refused = {tp for tp in requested if not readable[tp[0]]}
    unknown = {tp for tp in requested if tp not in refused and node.partition(*tp) is None}

    async def finish() -> dict[str, Any]:
        error, per_partition = await coordinator.delete_offsets(req.group_id, [tp for tp in requested if tp not in unknown and tp not in refused])
        if error != codes.NONE:
            return {"error_code": error, "throttle_time": 0, "topics": []}
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for tp in requested:
            code = TOPIC_AUTHORIZATION_FAILED if tp in refused else codes.UNKNOWN_TOPIC_OR_PARTITION if tp in unknown else per_partition.get(tp, codes.NONE)
            by_topic.setdefault(tp[0], []).append({"partition_index": tp[1], "error_code": code})
        return {"error_code": codes.NONE, "throttle_time": 0, "topics": [{"name": n, "partitions": ps} for n, ps in by_topic.items()]}

    return Deferred(finish)

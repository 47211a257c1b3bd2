"""KIP-848 consumer groups: ConsumerGroupHeartbeat (68) and ConsumerGroupDescribe (69).

Thin, like broker.handlers.groups: the heartbeat becomes a `Heartbeat` for the group
coordinator (`node.groups.consumer_heartbeat`, which answers once the group's records are
stored), and its answer a version-agnostic description. Topics travel by topic id, as the
protocol has them. Rights as in Kafka: the heartbeat needs READ on the group and DESCRIBE
on each topic named in the subscription (TOPIC_AUTHORIZATION_FAILED names the others);
ConsumerGroupDescribe needs DESCRIBE on the group.

v0 and v1 are served: v1 (Kafka 4.0) has the client choose its member id (a v1 join with
an empty one is INVALID_REQUEST) and adds the regex subscription.
"""

from __future__ import annotations

import uuid
from typing import Any

from broker.api import Deferred, Reply, RequestContext, api
from broker.groups import codes
from broker.groups.consumer_group import Heartbeat, HeartbeatResult
from broker.security.authz import OPEN_OPERATIONS, Operation, Resource
from broker.security.session import authorize, authorize_group, authorized_operations
from broker.shape import field_of

GROUP_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED = 30, 29
INT32_MIN = -(2**31)


def _answer(result: HeartbeatResult) -> dict[str, Any]:
    assignment = None
    if result.assignment is not None:
        assignment = {
            "topic_partitions": [
                {"topic_id": t, "partitions": sorted(ps)}
                for t, ps in sorted(result.assignment.items(), key=lambda kv: str(kv[0]))
            ]
        }
    return {
        "throttle_time": 0,
        "error_code": result.error,
        "error_message": result.message,
        "member_id": result.member_id,
        "member_epoch": result.member_epoch,
        "heartbeat_interval": result.heartbeat_interval_ms,
        "assignment": assignment,
    }


def _refused(error: int, message: str, req: Any) -> dict[str, Any]:
    return _answer(HeartbeatResult(error, message))  # Kafka: no member id, epoch 0


def _ms(value: Any) -> int:
    return int(value.total_seconds() * 1000) if hasattr(value, "total_seconds") else int(value)


@api(68, "ConsumerGroupHeartbeat", (0, 1))
async def consumer_group_heartbeat(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return _refused(GROUP_AUTHORIZATION_FAILED, "Group authorization failed.", req)
    if refusal := ctx.node.groups.refusal(req.group_id):
        return _refused(refusal, "This broker does not coordinate the group now.", req)
    names = req.subscribed_topic_names
    if names is not None:
        denied = sorted(n for n in names if not authorize(ctx, Operation.DESCRIBE, n))
        if denied:
            return _refused(
                TOPIC_AUTHORIZATION_FAILED, f"Topic authorization failed for topics {denied}.", req
            )
    version = ctx.api_version
    if version >= 1 and not req.member_id:
        return _refused(codes.INVALID_REQUEST, "MemberId can't be empty.", req)
    if req.member_epoch < -2:
        return _refused(codes.INVALID_REQUEST, f"MemberEpoch {req.member_epoch} is invalid.", req)
    owned = req.topic_partitions
    hb = Heartbeat(
        group_id=req.group_id,
        member_id=req.member_id,
        member_epoch=req.member_epoch,
        instance_id=req.instance_id,
        rack_id=req.rack_id,
        rebalance_timeout_ms=_ms(req.rebalance_timeout),
        subscribed_topic_names=tuple(names) if names is not None else None,
        subscribed_topic_regex=field_of(req, "subscribed_topic_regex"),
        server_assignor=req.server_assignor,
        owned=None if owned is None else _owned(owned),
        client_id=ctx.client_id or "",
        client_host=_client_host(ctx),
        version=version,
    )
    coordinator = ctx.node.groups

    async def finish() -> dict[str, Any]:
        return _answer(await coordinator.consumer_heartbeat(hb))

    return Deferred(finish)


def _owned(topics: Any) -> dict[uuid.UUID, frozenset[int]]:
    out: dict[uuid.UUID, frozenset[int]] = {}
    for t in topics:
        if t.topic_id is not None and t.partitions:
            out[t.topic_id] = out.get(t.topic_id, frozenset()) | frozenset(t.partitions)
    return out


def _client_host(ctx: RequestContext) -> str:
    host = ctx.peer.rsplit(":", 1)[0] if ":" in ctx.peer else ctx.peer
    return "/" + host


@api(69, "ConsumerGroupDescribe", (0, 1))
async def consumer_group_describe(ctx: RequestContext, req: Any) -> Reply:
    coordinator = ctx.node.groups
    names = {t.topic_id: name for name, t in ctx.node.topics.items()}

    def partitions(assignment: dict[uuid.UUID, frozenset[int]]) -> dict[str, Any]:
        return {
            "topic_partitions": [
                {"topic_id": t, "topic_name": names[t], "partitions": sorted(ps)}
                for t, ps in sorted(assignment.items(), key=lambda kv: str(kv[0]))
                if t in names
            ]
        }

    def empty(group_id: str, error: int, message: str) -> dict[str, Any]:
        return {
            "error_code": error,
            "error_message": message,
            "group_id": group_id,
            "group_state": "",
            "group_epoch": 0,
            "assignment_epoch": 0,
            "assignor_name": "",
            "members": [],
            "authorized_operations": INT32_MIN,
        }

    described = []
    for group_id in req.group_ids:
        if not authorize_group(ctx, Operation.DESCRIBE, group_id):
            described.append(
                empty(group_id, GROUP_AUTHORIZATION_FAILED, "Group authorization failed.")
            )
            continue
        if refusal := coordinator.refusal(group_id):
            described.append(
                empty(group_id, refusal, "This broker does not coordinate the group now.")
            )
            continue
        group = coordinator.consumer_group(group_id)
        if group is None:
            message = (
                f"Group {group_id} is not a consumer group."
                if coordinator.groups.get(group_id)
                else f"Group {group_id} not found."
            )
            described.append(empty(group_id, codes.GROUP_ID_NOT_FOUND, message))
            continue
        ops = authorized_operations(ctx, group_id, Resource.GROUP)
        described.append(
            {
                "error_code": codes.NONE,
                "error_message": None,
                "group_id": group_id,
                "group_state": group.state.value,
                "group_epoch": group.group_epoch,
                "assignment_epoch": group.assignment_epoch,
                "assignor_name": group.assignor_name,
                "members": [
                    {
                        "member_id": m.member_id,
                        "instance_id": m.instance_id,
                        "rack_id": m.rack_id,
                        "member_epoch": m.member_epoch,
                        "client_id": m.client_id,
                        "client_host": m.client_host,
                        "subscribed_topic_names": list(m.subscribed_topic_names),
                        "subscribed_topic_regex": m.subscribed_topic_regex
                        or "",  # Kafka: "" when none
                        "assignment": partitions(m.assigned),
                        "target_assignment": partitions(group.target.get(m.member_id, {})),
                        # KIP-1099: 0 = a classic member (a mixed group), 1 = consumer protocol
                        "member_type": 0 if m.classic is not None else 1,
                    }
                    for m in group.members.values()
                ],
                "authorized_operations": (OPEN_OPERATIONS[Resource.GROUP] if ops is None else ops)
                if req.include_authorized_operations
                else INT32_MIN,
            }
        )
    return {"throttle_time": 0, "groups": described}

"""AlterConfigs and IncrementalAlterConfigs: changing a topic's config overrides.

A topic's overrides live in the node's catalog (a signed archive), so a change is durable
before the answer says so and survives restarts; it takes effect at once (the produce
path's limits, retention and segment sizes). Only the topic configs of `broker.config`'s
registry are accepted, each checked as CreateTopics checks it; an unknown name or a value
we cannot honour (`remote.storage.enable=true`, `unclean.leader.election.enable=true`...) refuses the
whole resource with INVALID_CONFIG, naming the config. Broker configs are static (the
properties file): altering them is refused with INVALID_REQUEST, as Kafka refuses a
read-only config.

Authorization: Kafka asks for ALTER_CONFIGS on the topic, which our rules do not model;
the principal that may CREATE a topic may alter it.

Cluster mode: only a topic's writer may sign its catalog: a change to a topic written
by another broker is forwarded to that broker (broker/forwarding.py), as Kafka's brokers
forward it to the controller since KIP-590 (a client sends it to any broker, or to the
controller, and would not know to ask the writer). Forwarded once: a request another
broker forwarded here for a topic not written here is refused, naming its writer.
A quorum-signed topic is the exception: its etcd record holds its configs
(broker/placed_topics.py), which the controller changes (`_alter_record`): its writer
may be dead.
"""

from __future__ import annotations

from typing import Any

import trio

from broker.api import Reply, RequestContext, api
from broker.cluster.etcd import EtcdError
from broker.config import TOPIC_CONFIGS, ConfigError, ConfigType, validate_topic_configs
from broker.forwarding import forward_to, forward_to_controller
from broker.handlers import errors
from broker.mirror import BROKER_CLIENT_ID
from broker.node import Node, Topic, TopicError
from broker.security.authz import Operation
from broker.security.session import authorize

RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4
RESOURCE_BROKER_LOGGER = 8
SET, DELETE, APPEND, SUBTRACT = 0, 1, 2, 3


def _topic(ctx: RequestContext, name: str) -> Topic | None:
    """The topic to alter; None if there is none (its configs are validated first)."""
    if not authorize(ctx, Operation.CREATE, name):
        raise TopicError(errors.TOPIC_AUTHORIZATION_FAILED, "Authorization failed.")
    topic = ctx.node.topics.get(name)
    if topic is None or name.startswith("__"):
        return None
    if topic.mirrored and _writer_to_ask(ctx, topic) is None:
        where = (
            f"broker {topic.leader_id}"
            if topic.leader_id is not None
            else "the node it is mirrored from"
        )
        raise TopicError(
            errors.INVALID_REQUEST, f"Topic {name} is written by {where}; alter its configs there"
        )
    return topic


def _writer_to_ask(ctx: RequestContext, topic: Topic) -> int | None:
    """The broker to forward a change of `topic` to: its writer, in cluster mode, unless
    another broker forwarded the request here (never twice)."""
    if ctx.client_id == BROKER_CLIENT_ID or not topic.mirrored:
        return None
    return topic.leader_id  # (None: mirrored from a node outside the cluster)


async def _forward(
    ctx: RequestContext, writer: int | None, r: Any, incremental: bool, validate_only: bool
) -> None:
    """Have `writer` (None: the controller) apply resource `r`; its refusal as a TopicError."""
    cluster = ctx.node.cluster
    if incremental:
        configs = [
            {"name": c.name, "config_operation": int(c.config_operation), "value": c.value}
            for c in r.configs
        ]
        api_key, version, schema = 44, 1, "incremental_alter_configs"
    else:
        configs = [{"name": c.name, "value": c.value} for c in r.configs]
        api_key, version, schema = 33, 2, "alter_configs"
    body = {
        "resources": [
            {
                "resource_type": RESOURCE_TOPIC,
                "resource_name": r.resource_name,
                "configs": configs,
            }
        ],
        "validate_only": validate_only,
    }
    if writer is None:
        resp = await forward_to_controller(cluster, api_key, version, schema, body)
    else:
        resp = await forward_to(cluster, writer, api_key, version, schema, body)
    answer = resp.responses[0]
    if answer.error_code:
        who = "The controller" if writer is None else f"Broker {writer}"
        raise TopicError(int(answer.error_code), answer.error_message or f"{who} refused the change")


async def _alter_record(ctx: RequestContext, r: Any, incremental: bool, validate_only: bool) -> None:
    """A quorum-signed topic whose etcd record holds its configs (broker/placed_topics.py):
    the controller validates the change as for any topic and writes it into the record
    (fenced by its epoch and by the record it read); every broker applies it from there,
    so it needs no writer alive. Another broker forwards it to the controller (once)."""
    node, name = ctx.node, r.resource_name
    if not authorize(ctx, Operation.CREATE, name):
        raise TopicError(errors.TOPIC_AUTHORIZATION_FAILED, "Authorization failed.")
    cluster = node.cluster
    if not cluster.is_controller:
        if ctx.client_id == BROKER_CLIENT_ID:
            raise TopicError(errors.NOT_CONTROLLER, "This broker is not the controller (any more); ask again.")
        await _forward(ctx, None, r, incremental, validate_only)
        return
    for _ in range(3):  # (again when another change of the record came first)
        record = cluster.record_configs(name)
        if record is None:
            raise TopicError(errors.UNKNOWN_TOPIC_OR_PARTITION, f"Topic {name} does not exist")
        topic_id, current = record
        overrides = _overrides(node, current, r, incremental)
        if validate_only or overrides == current:
            return
        try:
            ok = await cluster.set_record_configs(name, overrides)
        except EtcdError as exc:
            raise TopicError(errors.NOT_CONTROLLER, f"The controller cannot reach etcd: {exc}") from None
        if ok is None:
            raise TopicError(errors.NOT_CONTROLLER, "This broker is no longer the controller (its epoch was fenced).")
        if ok:
            topic = node.topics.get(name)
            if topic is not None and str(topic.topic_id) == topic_id and topic.placed_configs != overrides:
                node.set_placed_configs(topic, overrides)
            return
        await trio.sleep(0.1)  # the view learns the newer record from the watch
    raise TopicError(errors.INVALID_REQUEST, f"The configs of {name} changed meanwhile; try again.")


def _overrides(node: Node, current: dict[str, str], r: Any, incremental: bool) -> dict[str, str]:
    """The topic overrides resource `r` of an (Incremental)AlterConfigs asks for, over
    `current`, validated (INVALID_CONFIG otherwise)."""
    if incremental:
        wanted = _incremental(node, current, r.configs)
    else:
        wanted = {c.name: c.value for c in r.configs if c.value is not None}
    try:
        return validate_topic_configs(wanted)
    except ConfigError as exc:
        raise TopicError(errors.INVALID_CONFIG, str(exc)) from None


def _list(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _incremental(node: Node, existing: dict[str, str], changes: Any) -> dict[str, str]:
    overrides = dict(existing)
    seen: set[str] = set()
    for c in changes:
        if c.name in seen:
            raise TopicError(errors.INVALID_REQUEST, f"Config {c.name} is named twice")
        seen.add(c.name)
        d = TOPIC_CONFIGS.get(c.name)
        if d is None:
            raise TopicError(errors.INVALID_CONFIG, f"Unknown topic config name: {c.name}")
        op = int(c.config_operation)
        if op == SET:
            if c.value is None:
                raise TopicError(errors.INVALID_REQUEST, f"Null value not supported for : {c.name}")
            overrides[c.name] = c.value
        elif op == DELETE:
            overrides.pop(c.name, None)
        elif op in (APPEND, SUBTRACT):
            if d.type != ConfigType.LIST:
                raise TopicError(
                    errors.INVALID_CONFIG,
                    f"Config value append/subtract is not allowed for config {c.name} (not a list)",
                )
            current = _list(overrides.get(c.name, node.config.effective(overrides, c.name)))
            values = _list(c.value)
            if op == APPEND:
                current += [v for v in values if v not in current]
            else:
                current = [v for v in current if v not in values]
            overrides[c.name] = ",".join(current)
        else:
            raise TopicError(errors.INVALID_REQUEST, f"Unknown config operation {op} for {c.name}")
    return overrides


async def _alter(ctx: RequestContext, req: Any, incremental: bool) -> Reply:
    node = ctx.node
    responses = []
    seen: set[tuple[int, str]] = set()
    for r in req.resources:
        entry: dict[str, Any] = {
            "error_code": errors.NONE,
            "error_message": None,
            "resource_type": r.resource_type,
            "resource_name": r.resource_name,
        }
        responses.append(entry)
        try:
            if (r.resource_type, r.resource_name) in seen:
                raise TopicError(errors.INVALID_REQUEST, "Duplicate resource in the request")
            seen.add((r.resource_type, r.resource_name))
            if r.resource_type in (RESOURCE_BROKER, RESOURCE_BROKER_LOGGER):
                raise TopicError(
                    errors.INVALID_REQUEST,
                    "Broker configs are static on hyperkafka: set them in the broker's properties file and restart",
                )
            if r.resource_type != RESOURCE_TOPIC:
                raise TopicError(
                    errors.INVALID_REQUEST, f"Unsupported resource type {r.resource_type}"
                )
            if node.cluster.record_configs(r.resource_name) is not None:
                await _alter_record(ctx, r, incremental, req.validate_only)
                continue
            topic = _topic(ctx, r.resource_name)
            writer = None if topic is None else _writer_to_ask(ctx, topic)
            if writer is not None:  # its writer alone signs its catalog: it applies the change
                await _forward(ctx, writer, r, incremental, req.validate_only)
                continue
            current = dict(topic.record.configs) if topic is not None else {}
            overrides = _overrides(node, current, r, incremental)
            # As Kafka's controller: the configs are validated before the topic is
            # looked up, so a bad config on a missing topic is INVALID_CONFIG.
            if topic is None:
                raise TopicError(
                    errors.UNKNOWN_TOPIC_OR_PARTITION, f"Topic {r.resource_name} does not exist"
                )
            if not req.validate_only and overrides != dict(topic.record.configs):
                node.set_topic_configs(topic, overrides)
        except TopicError as exc:
            entry.update(error_code=exc.code, error_message=exc.message)
    return {"throttle_time": 0, "responses": responses}


@api(33, "AlterConfigs", (0, 2))
async def alter_configs(ctx: RequestContext, req: Any) -> Reply:
    return await _alter(ctx, req, incremental=False)


@api(44, "IncrementalAlterConfigs", (0, 1))
async def incremental_alter_configs(ctx: RequestContext, req: Any) -> Reply:
    return await _alter(ctx, req, incremental=True)

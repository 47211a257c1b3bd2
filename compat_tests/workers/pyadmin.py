"""Topic administration with one Python client's admin API, in its own process.

`python -m compat_tests.workers.pyadmin CLIENT OP --bootstrap H:P [--topic T]... [--partitions
N] [--group G]` with CLIENT confluent (AdminClient), aiokafka (AIOKafkaAdminClient) or
kafka-python (KafkaAdminClient) and OP one of create, list, describe, delete, configs (and
for aiokafka list-groups, describe-groups, offsets). Prints one JSON line in the shape the
Go driver's `hkgo CLIENT admin OP` prints, so one test serves all:

- create / delete: {"topics": {name: {"error_code": int}}}
- list: {"topics": [name, ...]}
- describe: {"topics": {name: {"error_code", "partitions": [{"partition", "leader",
  "replicas", "isr", "error_code"}]}}}
- configs: {"topics": {name: {"error_code", "configs": {key: {"value", "source"}}}}}
- list-groups: {"groups": {group: {"protocol_type": str}}}
- describe-groups: {"groups": {group: {"error_code", "state", "protocol_type", "members":
  [{"member_id", "assigned": {topic: [partition, ...]}}]}}}
- offsets: {"offsets": {partition: offset}} of the group's commits for --topic

Error codes are Kafka's, read from what the client surfaces (a KafkaError's code, an
exception's errno, a response field); `null` where the client surfaces none.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

OPS = ("create", "list", "describe", "delete", "configs", "list-groups", "describe-groups", "offsets")


# ---------------------------------------------------------------------------- confluent


def _ck_code(future: Any) -> int:
    from confluent_kafka import KafkaException

    try:
        future.result()
    except KafkaException as e:
        return int(e.args[0].code())
    return 0


def ck_admin(args: argparse.Namespace) -> dict[str, Any]:
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import (
        AdminClient,
        ConfigResource,
        ConfigSource,
        NewTopic,
        ResourceType,
    )

    a = AdminClient({"bootstrap.servers": args.bootstrap})
    timeout = args.timeout
    if args.op == "create":
        new = [NewTopic(t, num_partitions=args.partitions, replication_factor=1) for t in args.topic]
        futures = a.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        return {"topics": {t: {"error_code": _ck_code(f)} for t, f in futures.items()}}
    if args.op == "delete":
        futures = a.delete_topics(args.topic, operation_timeout=timeout, request_timeout=timeout)
        return {"topics": {t: {"error_code": _ck_code(f)} for t, f in futures.items()}}
    if args.op == "list":
        return {"topics": sorted(a.list_topics(timeout=timeout).topics)}
    if args.op == "describe":
        out: dict[str, Any] = {}
        futures = a.describe_topics(TopicCollection(args.topic), request_timeout=timeout)
        for name, f in futures.items():
            try:
                d = f.result()
            except KafkaException as e:
                out[name] = {"error_code": int(e.args[0].code()), "partitions": []}
                continue
            parts = [
                {
                    "partition": p.id,
                    "leader": p.leader.id if p.leader is not None else -1,
                    "replicas": [n.id for n in p.replicas],
                    "isr": [n.id for n in p.isr],
                    "error_code": 0,  # TopicPartitionInfo has no error; a failed topic raises
                }
                for p in sorted(d.partitions, key=lambda p: p.id)
            ]
            out[name] = {"error_code": 0, "partitions": parts}
        return {"topics": out}
    # configs
    out = {}
    resources = [ConfigResource(ResourceType.TOPIC, t) for t in args.topic]
    for res, f in a.describe_configs(resources, request_timeout=timeout).items():
        try:
            entries = f.result()
        except KafkaException as e:
            out[res.name] = {"error_code": int(e.args[0].code()), "configs": {}}
            continue
        configs = {
            k: {"value": e.value, "source": ConfigSource(e.source).name} for k, e in entries.items()
        }
        out[res.name] = {"error_code": 0, "configs": configs}
    return {"topics": out}


# ---------------------------------------------------------------------------- aiokafka

# DescribeConfigs config_source, as Kafka's ConfigEntry.ConfigSource names it.
CONFIG_SOURCES = {
    0: "UNKNOWN",
    1: "DYNAMIC_TOPIC_CONFIG",
    2: "DYNAMIC_BROKER_CONFIG",
    3: "DYNAMIC_DEFAULT_BROKER_CONFIG",
    4: "STATIC_BROKER_CONFIG",
    5: "DEFAULT_CONFIG",
    6: "DYNAMIC_BROKER_LOGGER_CONFIG",
    7: "CLIENT_METRICS_CONFIG",
    8: "GROUP_CONFIG",
}


async def ak_admin(args: argparse.Namespace) -> dict[str, Any]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    a = AIOKafkaAdminClient(bootstrap_servers=args.bootstrap, request_timeout_ms=int(args.timeout * 1000))
    await a.start()
    try:
        ms = int(args.timeout * 1000)
        if args.op == "create":
            new = [NewTopic(t, args.partitions, 1) for t in args.topic]
            res = await a.create_topics(new, timeout_ms=ms)
            return {"topics": {t[0]: {"error_code": t[1]} for t in res.topic_errors}}
        if args.op == "delete":
            res = await a.delete_topics(args.topic, timeout_ms=ms)
            return {"topics": {t[0]: {"error_code": t[1]} for t in res.topic_error_codes}}
        if args.op == "list":
            return {"topics": sorted(await a.list_topics())}
        if args.op == "describe":
            out: dict[str, Any] = {}
            for t in await a.describe_topics(args.topic):
                parts = [
                    {k: p[k] for k in ("partition", "leader", "replicas", "isr", "error_code")}
                    for p in sorted(t["partitions"], key=lambda p: p["partition"])
                ]
                out[t["topic"]] = {"error_code": t["error_code"], "partitions": parts}
            return {"topics": out}
        if args.op == "list-groups":
            return {"groups": {g[0]: {"protocol_type": g[1]} for g in await a.list_consumer_groups()}}
        if args.op == "describe-groups":
            from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

            groups: dict[str, Any] = {}
            for response in await a.describe_consumer_groups(args.group):
                for code, group, state, protocol_type, _protocol, members, *_rest in response.groups:
                    described = []
                    for member_id, _client_id, _host, _metadata, assignment in members:
                        assigned = ConsumerProtocolMemberAssignment.decode(assignment).assignment
                        described.append({"member_id": member_id, "assigned": dict(assigned)})
                    groups[group] = {
                        "error_code": code,
                        "state": state,
                        "protocol_type": protocol_type,
                        "members": described,
                    }
            return {"groups": groups}
        if args.op == "offsets":
            (group,) = args.group
            got = await a.list_consumer_group_offsets(group)
            return {"offsets": {tp.partition: om.offset for tp, om in got.items() if tp.topic in args.topic}}
        # configs
        out = {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in args.topic]
        for response in await a.describe_configs(resources):
            for code, _msg, _rtype, name, entries in response.resources:
                configs = {
                    e[0]: {"value": e[1], "source": CONFIG_SOURCES.get(e[3], str(e[3]))}
                    for e in entries
                }
                out[name] = {"error_code": code, "configs": configs}
        return {"topics": out}
    finally:
        await a.close()


# ---------------------------------------------------------------------------- kafka-python


def kp_admin(args: argparse.Namespace) -> dict[str, Any]:
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    a = KafkaAdminClient(bootstrap_servers=args.bootstrap, request_timeout_ms=int(args.timeout * 1000))
    try:
        if args.op != "configs":
            raise SystemExit(f"kafka-python's topic admin is tested in-process (test_metadata_admin): {args.op}")
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in args.topic]
        got = a.describe_configs(resources, config_filter="all").get("topic", {})
        # kafka-python 3.0.12 drops a resource's error code: a missing topic comes back as a
        # topic without configs, so its code is null here.
        out = {
            t: {
                "error_code": None,
                "configs": {
                    k: {"value": c["value"], "source": c["config_source"]} for k, c in got.get(t, {}).items()
                },
            }
            for t in args.topic
        }
        return {"topics": out}
    finally:
        a.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("client", choices=["confluent", "aiokafka", "kafka-python"])
    ap.add_argument("op", choices=OPS)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", action="append", default=[])
    ap.add_argument("--group", action="append", default=[])
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.op in ("list-groups", "describe-groups", "offsets") and args.client != "aiokafka":
        ap.error(f"{args.op}: the group admin of {args.client} is tested in-process (test_group_admin.py)")
    if args.client == "confluent":
        summary = ck_admin(args)
    elif args.client == "aiokafka":
        summary = asyncio.run(ak_admin(args))
    else:
        summary = kp_admin(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

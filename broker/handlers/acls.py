"""DescribeAcls, CreateAcls, DeleteAcls: our static authorization rules as Kafka ACLs.

The rules come from the properties file (`hyperkafka.acl.*`, broker/security/authz.py)
and never change at run time. DescribeAcls shows each as Kafka ACL bindings (one per
principal and operation, ALLOW, any host; `prefix*` as a PREFIXED pattern), so UIs and
`kafka-acls --list` show what is enforced, to `super.users` (Kafka asks for DESCRIBE on the
cluster; anyone else gets CLUSTER_AUTHORIZATION_FAILED). CreateAcls and DeleteAcls are refused for
every binding: with SECURITY_DISABLED on a node without security (as Kafka without an
authorizer), else CLUSTER_AUTHORIZATION_FAILED with a message saying where rules live.
Super users (`super.users`) are not ACLs in Kafka either and are not listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from broker.api import Reply, RequestContext, api
from broker.handlers import errors
from broker.security.authz import ACL_OPERATION_CODES, ANONYMOUS, Resource, Rule

SECURITY_DISABLED = 54
# Kafka's ResourceType, PatternType, AclOperation and AclPermissionType codes
ANY, MATCH, LITERAL, PREFIXED = 1, 2, 3, 4
RESOURCE_TYPE = {Resource.TOPIC: 2, Resource.GROUP: 3}
OP_ANY, OP_ALL = 1, 2
ALLOW = 3
_STATIC = "ACLs are static on hyperkafka: set hyperkafka.acl.* rules in the broker's properties file and restart"


def _secured(ctx: RequestContext) -> tuple[bool, tuple[Rule, ...]]:
    session = ctx.session
    if session is None or not session.security.settings.secured:
        return False, ()
    return True, session.security.authorizer.rules


def _may_describe(ctx: RequestContext) -> bool:
    """Kafka asks for DESCRIBE on the cluster, which our rules do not model: the rules are
    shown to `super.users` only, never to anyone who connects."""
    session = ctx.session
    if session is None:
        return True
    return (
        session.principal in session.security.authorizer.super_users
        and session.principal != ANONYMOUS
    )


def _bindings(rules: tuple[Rule, ...]) -> Iterator[tuple[int, str, int, str, int]]:
    """(resource type, name, pattern type, principal, operation) of every rule."""
    for rule in rules:
        prefix = rule.prefix
        if prefix is None or prefix == "":
            name, pattern = ("*" if prefix == "" else rule.pattern), LITERAL
        else:
            name, pattern = prefix, PREFIXED
        for principal in sorted(rule.principals):
            shown = "User:*" if principal == "*" else principal
            for op in sorted(rule.operations):
                yield RESOURCE_TYPE[rule.resource], name, pattern, shown, ACL_OPERATION_CODES[op]


def _matches(f: Any, rtype: int, name: str, pattern: int, principal: str, op: int) -> bool:
    if f.resource_type_filter not in (ANY, rtype):
        return False
    pf = f.pattern_type_filter
    if f.resource_name_filter is not None:
        if pf == MATCH:
            # a name matches literal rules of that name or "*", and prefixed rules it starts with
            if not (
                (pattern == LITERAL and name in (f.resource_name_filter, "*"))
                or (pattern == PREFIXED and f.resource_name_filter.startswith(name))
            ):
                return False
        elif name != f.resource_name_filter:
            return False
    if pf not in (ANY, MATCH, pattern):
        return False
    if f.principal_filter is not None and f.principal_filter != principal:
        return False
    if f.host_filter not in (None, "*"):
        return False
    if f.operation not in (OP_ANY, op):
        return False
    return f.permission_type in (ANY, ALLOW)


@api(29, "DescribeAcls", (1, 3))
async def describe_acls(ctx: RequestContext, req: Any) -> Reply:
    secured, rules = _secured(ctx)
    if not secured:
        return {
            "throttle_time": 0,
            "error_code": SECURITY_DISABLED,
            "error_message": "No authorizer is configured on the broker",
            "resources": [],
        }
    if not _may_describe(ctx):
        return {
            "throttle_time": 0,
            "error_code": errors.CLUSTER_AUTHORIZATION_FAILED,
            "error_message": "Only super.users may describe ACLs",
            "resources": [],
        }
    grouped: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for rtype, name, pattern, principal, op in _bindings(rules):
        if _matches(req, rtype, name, pattern, principal, op):
            grouped.setdefault((rtype, name, pattern), []).append(
                {"principal": principal, "host": "*", "operation": op, "permission_type": ALLOW}
            )
    resources = [
        {"resource_type": r, "resource_name": n, "pattern_type": p, "acls": acls}
        for (r, n, p), acls in grouped.items()
    ]
    return {
        "throttle_time": 0,
        "error_code": errors.NONE,
        "error_message": None,
        "resources": resources,
    }


def _refusal(ctx: RequestContext) -> tuple[int, str]:
    secured, _ = _secured(ctx)
    if not secured:
        return SECURITY_DISABLED, "No authorizer is configured on the broker"
    return errors.CLUSTER_AUTHORIZATION_FAILED, _STATIC


@api(30, "CreateAcls", (1, 3))
async def create_acls(ctx: RequestContext, req: Any) -> Reply:
    code, message = _refusal(ctx)
    return {
        "throttle_time": 0,
        "results": [{"error_code": code, "error_message": message} for _ in req.creations],
    }


@api(31, "DeleteAcls", (1, 3))
async def delete_acls(ctx: RequestContext, req: Any) -> Reply:
    code, message = _refusal(ctx)
    return {
        "throttle_time": 0,
        "filter_results": [
            {"error_code": code, "error_message": message, "matching_acls": []} for _ in req.filters
        ],
    }

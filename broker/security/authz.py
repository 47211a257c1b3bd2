"""Who may do what to which topic or consumer group: explicit rules, most specific first.

Owns `Resource`, `Operation`, `Rule`, `parse_rule` (the `hyperkafka.acl.*` property
syntax) and `Authorizer`. A rule names a resource kind (topic or group), a pattern (an
exact name, `prefix*`, or `*`), operations and the principals allowed. For a request the
most specific matching pattern of that kind and operation decides (exact name, then the
longest prefix, then `*`); principals are `User:NAME`, `User:*` (any authenticated
principal) or `*` (anyone, ANONYMOUS included).

Defaults once the node is secured (any TLS/SASL listener, rule or super user):
- topics: anyone may READ; WRITE, CREATE and DELETE need a rule or `super.users` and
  are never granted to `User:ANONYMOUS`;
- groups: anyone (ANONYMOUS included) may READ (join, commit, fetch offsets); DELETE
  (DeleteGroups, OffsetDelete) needs a rule or `super.users`, never ANONYMOUS;
- DESCRIBE of a topic is granted by a describe rule, or implied by READ, WRITE or DELETE
  on it; of a group, by a describe rule or implied by READ or DELETE on it (Kafka's
  implied DESCRIBE). So a topic nobody lets you read, write or describe is hidden.
A node with no security configuration at all is open: everything is allowed, as before
this package existed. Imports only the standard library.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ANONYMOUS = "User:ANONYMOUS"


class Resource(enum.StrEnum):
    TOPIC = "topic"
    GROUP = "group"


class Operation(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    CREATE = "create"
    DELETE = "delete"
    DESCRIBE = "describe"


# Kafka's AclOperation codes, for the authorized_operations bit fields of answers.
ACL_OPERATION_CODES = {Operation.READ: 3, Operation.WRITE: 4, Operation.CREATE: 5, Operation.DELETE: 6, Operation.DESCRIBE: 8}

_OPERATIONS = {
    Resource.TOPIC: frozenset(Operation),
    Resource.GROUP: frozenset({Operation.READ, Operation.DESCRIBE, Operation.DELETE}),
}
# What Kafka reports in authorized_operations where everything is allowed (no authorizer):
# every AclOperation Kafka defines for the resource type (topics: READ, WRITE, CREATE,
# DELETE, ALTER, DESCRIBE, DESCRIBE_CONFIGS, ALTER_CONFIGS; groups: READ, DELETE,
# DESCRIBE, DESCRIBE_CONFIGS, ALTER_CONFIGS; the cluster: CREATE to IDEMPOTENT_WRITE).
# An open node allows them all, served here or not, so it says the same.
OPEN_OPERATIONS = {Resource.TOPIC: 3576, Resource.GROUP: 3400}
OPEN_CLUSTER_OPERATIONS = 8096
_OPEN_BY_DEFAULT = frozenset({Operation.READ})  # DESCRIBE follows from READ (below)
_NEEDS_AUTHENTICATION = {
    Resource.TOPIC: frozenset({Operation.WRITE, Operation.CREATE, Operation.DELETE}),
    Resource.GROUP: frozenset({Operation.DELETE}),
}
# Kafka: READ, WRITE, DELETE (and ALTER) imply DESCRIBE.
_IMPLIES_DESCRIBE = {
    Resource.TOPIC: (Operation.READ, Operation.WRITE, Operation.DELETE),
    Resource.GROUP: (Operation.READ, Operation.DELETE),
}


class RuleError(ValueError):
    """A `hyperkafka.acl.*` property that does not parse."""


@dataclass(frozen=True)
class Rule:
    pattern: str  # "orders", "logs-*" or "*"
    operations: frozenset[Operation]
    principals: frozenset[str]
    resource: Resource = Resource.TOPIC

    @property
    def prefix(self) -> str | None:
        return self.pattern[:-1] if self.pattern.endswith("*") else None

    def specificity(self, topic: str) -> int:
        """-1 when the rule does not match; higher is more specific (exact beats any prefix)."""
        prefix = self.prefix
        if prefix is None:
            return 1_000_000 if topic == self.pattern else -1
        return len(prefix) if topic.startswith(prefix) else -1

    def grants(self, principal: str) -> bool:
        if "*" in self.principals or principal in self.principals:
            return True
        return "User:*" in self.principals and principal != ANONYMOUS


def parse_rule(key: str, value: str) -> Rule:
    """`topic|group.<pattern>.<op>[+<op>...]` = `User:a;User:b` (key without `hyperkafka.acl.`).

    Principals are separated by ";" as in Kafka's super.users: a certificate's
    distinguished name contains commas. A group rule allows read, describe, delete and
    all (= those three)."""
    kind, _, rest = key.partition(".")
    try:
        resource = Resource(kind)
    except ValueError:
        resource = None
    if resource is None or not rest:
        raise RuleError(f"hyperkafka.acl.{key}: expected hyperkafka.acl.topic.<pattern>.<operation> or hyperkafka.acl.group.<pattern>.<operation>")
    pattern, _, ops_text = rest.rpartition(".")
    if not pattern:
        raise RuleError(f"hyperkafka.acl.{key}: no {resource.value} pattern")
    if "*" in pattern[:-1]:
        raise RuleError(f"hyperkafka.acl.{key}: '*' may only end a pattern")
    valid = _OPERATIONS[resource]
    ops: set[Operation] = set()
    for op in ops_text.split("+"):
        if op == "all":
            ops.update(valid)
            continue
        try:
            operation = Operation(op)
        except ValueError:
            operation = None
        if operation is None or operation not in valid:
            names = ", ".join(sorted(o.value for o in valid))
            raise RuleError(f"hyperkafka.acl.{key}: unknown operation {op!r} for a {resource.value} ({names}, all)")
        ops.add(operation)
    principals = frozenset(p.strip() for p in value.split(";") if p.strip())
    for p in principals:
        if p != "*" and not p.startswith("User:"):
            raise RuleError(f"hyperkafka.acl.{key}: principal {p!r} must be User:NAME, User:* or *")
    return Rule(pattern, frozenset(ops), principals, resource)


class Authorizer:
    def __init__(self, rules: tuple[Rule, ...] = (), super_users: frozenset[str] = frozenset(), *, secured: bool = True) -> None:
        self.rules = rules
        self.super_users = super_users
        self.secured = secured

    def allowed(self, principal: str, operation: Operation, name: str, resource: Resource = Resource.TOPIC) -> bool:
        """May `principal` do `operation` to the topic (or group) `name`?"""
        if not self.secured:
            return True
        if principal in self.super_users:
            return principal != ANONYMOUS or operation not in _NEEDS_AUTHENTICATION[resource]
        if operation is Operation.DESCRIBE:
            rule = self._decisive(resource, operation, name)
            if rule is not None and rule.grants(principal):
                return True
            return any(self._decide(principal, op, name, resource) for op in _IMPLIES_DESCRIBE[resource])
        return self._decide(principal, operation, name, resource)

    def operations(self, principal: str, name: str, resource: Resource) -> int:
        """Kafka's authorized_operations bit field for this principal on `name`."""
        if not self.secured:
            return OPEN_OPERATIONS[resource]
        return sum(1 << ACL_OPERATION_CODES[op] for op in _OPERATIONS[resource] if self.allowed(principal, op, name, resource))

    def _decide(self, principal: str, operation: Operation, name: str, resource: Resource) -> bool:
        if operation in _NEEDS_AUTHENTICATION[resource] and principal == ANONYMOUS:
            return False
        rule = self._decisive(resource, operation, name)
        if rule is None:
            return operation in _OPEN_BY_DEFAULT
        return rule.grants(principal)

    def _decisive(self, resource: Resource, operation: Operation, name: str) -> Rule | None:
        """The most specific rule of this kind and operation that matches `name`."""
        best: Rule | None = None
        best_score = -1
        for rule in self.rules:
            if rule.resource is resource and operation in rule.operations:
                score = rule.specificity(name)
                if score > best_score:
                    best, best_score = rule, score
        return best

    def may_write_somewhere(self, principal: str) -> bool:
        """For InitProducerId: Kafka asks for IDEMPOTENT_WRITE or WRITE on some topic."""
        if not self.secured:
            return True
        if principal == ANONYMOUS:
            return False
        if principal in self.super_users:
            return True
        return any(r.resource is Resource.TOPIC and Operation.WRITE in r.operations and r.grants(principal) for r in self.rules)

"""Who may do what to which topic: explicit rules, most specific first.

Owns `Operation`, `Rule`, `parse_rule` (the `hyperkafka.acl.*` property syntax) and
`Authorizer`. A rule names a topic pattern (an exact name, `prefix*`, or `*`), one
operation and the principals allowed. For a request the most specific matching pattern
decides (exact name, then the longest prefix, then `*`); principals are `User:NAME`,
`User:*` (any authenticated principal) or `*` (anyone, ANONYMOUS included).

Defaults once the node is secured (any TLS/SASL listener, rule or super user): anyone
may READ and DESCRIBE; WRITE, CREATE and DELETE need a rule or `super.users`, and are
never granted to `User:ANONYMOUS`. A node with no security configuration at all is
open: everything is allowed, as before this package existed.
Imports only the standard library.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ANONYMOUS = "User:ANONYMOUS"


class Operation(enum.StrEnum):
    READ = "read"
    WRITE = "write"
    CREATE = "create"
    DELETE = "delete"
    DESCRIBE = "describe"


_OPEN_BY_DEFAULT = frozenset({Operation.READ, Operation.DESCRIBE})
_NEEDS_AUTHENTICATION = frozenset({Operation.WRITE, Operation.CREATE, Operation.DELETE})


class RuleError(ValueError):
    """A `hyperkafka.acl.*` property that does not parse."""


@dataclass(frozen=True)
class Rule:
    pattern: str  # "orders", "logs-*" or "*"
    operations: frozenset[Operation]
    principals: frozenset[str]

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
    """`topic.<pattern>.<op>[+<op>...]` = `User:a;User:b` (key without `hyperkafka.acl.`).

    Principals are separated by ";" as in Kafka's super.users: a certificate's
    distinguished name contains commas."""
    kind, _, rest = key.partition(".")
    if kind != "topic" or not rest:
        raise RuleError(f"hyperkafka.acl.{key}: expected hyperkafka.acl.topic.<pattern>.<operation>")
    pattern, _, ops_text = rest.rpartition(".")
    if not pattern:
        raise RuleError(f"hyperkafka.acl.{key}: no topic pattern")
    if "*" in pattern[:-1]:
        raise RuleError(f"hyperkafka.acl.{key}: '*' may only end a pattern")
    ops: set[Operation] = set()
    for op in ops_text.split("+"):
        if op == "all":
            ops.update(Operation)
            continue
        try:
            ops.add(Operation(op))
        except ValueError:
            raise RuleError(f"hyperkafka.acl.{key}: unknown operation {op!r} (read, write, create, delete, describe, all)") from None
    principals = frozenset(p.strip() for p in value.split(";") if p.strip())
    for p in principals:
        if p != "*" and not p.startswith("User:"):
            raise RuleError(f"hyperkafka.acl.{key}: principal {p!r} must be User:NAME, User:* or *")
    return Rule(pattern, frozenset(ops), principals)


class Authorizer:
    def __init__(self, rules: tuple[Rule, ...] = (), super_users: frozenset[str] = frozenset(), *, secured: bool = True) -> None:
        self.rules = rules
        self.super_users = super_users
        self.secured = secured

    def allowed(self, principal: str, operation: Operation, topic: str) -> bool:
        if not self.secured:
            return True
        if operation in _NEEDS_AUTHENTICATION and principal == ANONYMOUS:
            return False
        if principal in self.super_users:
            return True
        best: Rule | None = None
        best_score = -1
        for rule in self.rules:
            if operation in rule.operations:
                score = rule.specificity(topic)
                if score > best_score:
                    best, best_score = rule, score
        if best is None:
            return operation in _OPEN_BY_DEFAULT
        return best.grants(principal)

    def may_write_somewhere(self, principal: str) -> bool:
        """For InitProducerId: Kafka asks for IDEMPOTENT_WRITE or WRITE on some topic."""
        if not self.secured:
            return True
        if principal == ANONYMOUS:
            return False
        if principal in self.super_users:
            return True
        return any(Operation.WRITE in r.operations and r.grants(principal) for r in self.rules)

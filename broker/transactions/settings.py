"""The transaction coordinator's broker settings, with Kafka's names (checked by
broker/config.py at start, read by broker/transactions/coordinator.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class TxnSettings:
    """Kafka's broker settings of the transaction coordinator (names in NAMES)."""

    max_timeout_ms: int = 900_000
    abort_check_interval_ms: int = 10_000
    state_write_timeout_ms: int = 5_000
    # An id idle (no transaction open or being completed) for this long is forgotten, its
    # state tombstoned in __transaction_state (Kafka's default: 7 days).
    id_expiration_ms: int = 604_800_000
    expire_check_interval_ms: int = 3_600_000
    # Cluster mode: partitions of __transaction_state, each coordinated by one broker
    # (transactional ids map to them by Kafka's hash). Read once, when the controller
    # first places them (Kafka's default: 50).
    num_partitions: int = 50

    NAMES: ClassVar[dict[str, str]] = {
        "transaction.max.timeout.ms": "max_timeout_ms",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "abort_check_interval_ms",
        "transactional.id.expiration.ms": "id_expiration_ms",
        "transaction.remove.expired.transaction.cleanup.interval.ms": "expire_check_interval_ms",
        "transaction.state.log.num.partitions": "num_partitions",
    }

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> TxnSettings:
        values = {attr: int(props[name]) for name, attr in cls.NAMES.items() if name in props}
        for attr, value in values.items():
            if value < 1:
                raise ValueError(f"{attr} out of range: {value}")
        return cls(**values)

"""Kafka API handlers. Importing this package fills `broker.api.REGISTRY`."""

from broker.handlers import (  # noqa: F401
    acls,
    admin,
    cluster,
    configs,
    consumer_groups,
    fetch,
    groups,
    offsets,
    partitions,
    produce,
    transactions,
)
from broker.security import handlers as _sasl  # noqa: F401  (SaslHandshake, SaslAuthenticate)

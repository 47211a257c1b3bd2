"""Kafka API handlers. Importing this package fills `broker.api.REGISTRY`."""

from broker.handlers import admin, cluster, fetch, groups, offsets, produce  # noqa: F401
from broker.security import handlers as _sasl  # noqa: F401  (SaslHandshake, SaslAuthenticate)

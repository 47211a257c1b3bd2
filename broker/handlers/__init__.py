"""Kafka API handlers. Importing this package fills `broker.api.REGISTRY`."""

from broker.handlers import admin, cluster, fetch, groups, offsets, produce  # noqa: F401

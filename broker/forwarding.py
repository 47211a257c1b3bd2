"""Cluster mode: admin requests a broker cannot act on, sent on to the broker that can.

Owns `forward_to` (one request to one named broker, as another broker) and
`forward_to_controller`. Kafka's brokers forward admin requests to the controller since
KIP-590, because a client routes them by its last Metadata answer and librdkafka asks
again only on a new connection, never on NOT_CONTROLLER: a client whose controller moved
was refused for ever. Here the controller places and deletes topics
(broker/placement.py, broker/handlers/admin.py), and a topic's writer alone signs its
catalog, so config changes and new partitions go to the writer
(broker/handlers/configs.py, partitions.py); a quorum-signed topic's config changes go to
the controller, which writes them into its etcd record (broker/placed_topics.py).

A forwarded request carries `BROKER_CLIENT_ID` (broker/mirror.py) and is never forwarded
again: two brokers whose views of the cluster differ for a moment do not bounce it.

May import trio, `broker.node`, `broker.cluster`; `broker.mirror` at call time.
"""

from __future__ import annotations

from typing import Any

import trio

from broker.cluster import ClusterView
from broker.node import LEADER_NOT_AVAILABLE, NOT_CONTROLLER, TopicError

FORWARD_TIMEOUT_S = 5.0  # bounds one exchange with another broker


async def forward_to(
    cluster: ClusterView,
    broker_id: int,
    api_key: int,
    version: int,
    schema: str,
    body: dict[str, Any],
    timeout_s: float = FORWARD_TIMEOUT_S,
    unavailable: int = LEADER_NOT_AVAILABLE,
) -> Any:
    """Send one request (kio's `schema` at `version`) to broker `broker_id`, as another
    broker: its response. The error `unavailable` (a retriable one: the client asks
    again) when that broker is not registered now or does not answer in `timeout_s`."""
    from broker.mirror import kafka_request  # the client side of the mirror machinery

    b = cluster.brokers.get(broker_id)
    if b is None or not cluster.alive(broker_id):
        raise TopicError(unavailable, f"Broker {broker_id} is not registered now; ask again.")
    try:
        with trio.fail_after(timeout_s):
            return await kafka_request(b.host, b.port, api_key, version, schema, body)
    except Exception as exc:  # unreachable, reset, closed, slow: the client asks again
        raise TopicError(unavailable, f"Broker {broker_id} did not answer: {exc}") from None


async def forward_to_controller(
    cluster: ClusterView,
    api_key: int,
    version: int,
    schema: str,
    body: dict[str, Any],
    timeout_s: float = FORWARD_TIMEOUT_S,
) -> Any:
    """`forward_to` the controller (this broker is not the controller). NOT_CONTROLLER
    while no other broker is known to be controller (none elected now, or our view has
    not heard of it yet) or it does not answer: the client asks again, here, and is
    forwarded once the view knows."""
    controller = cluster.controller_id
    if controller == cluster.me or controller not in cluster.brokers:
        raise TopicError(NOT_CONTROLLER, "No controller is elected now; ask again.")
    return await forward_to(
        cluster, controller, api_key, version, schema, body, timeout_s, NOT_CONTROLLER
    )

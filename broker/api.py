"""The registry of Kafka APIs this broker serves, and what a handler is.

A handler is `async def handler(ctx, request) -> Reply`: it reads the decoded kio request
and answers with a version-agnostic description (a dict, see `broker.shape`) that the
server shapes into the response class of the negotiated version. A handler may instead
return `Deferred`: the part after an `await` it does not want to hold the connection for
(a produce waiting for its group commit); the server keeps responses in request order.
`NO_RESPONSE` means the request gets no answer (Produce with acks=0). A handler (or a
`Deferred`) on a hot path may answer with `Encoded`: the framed response bytes, already
encoded for the request's version and correlation id, which the server sends as they are.

ApiVersions is derived from this registry, so what is advertised is what is served.
Advertised ranges follow Kafka 4.0's minimums and stop below the topic-id versions
(reference/kafka-wire.md section 6); `accepted_min` is where we really start (Produce is
advertised from 0 because old librdkafka only enables compression when it sees v0, but
v0-2 are refused as Kafka 4.0 refuses them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.memory import AnswerMemory
    from broker.node import Node
    from broker.security.session import Session

Description = Mapping[str, Any]


class _NoResponse:
    def __repr__(self) -> str:
        return "NO_RESPONSE"


NO_RESPONSE = _NoResponse()


@dataclass(frozen=True, slots=True)
class Deferred:
    """The rest of a response, awaited by the connection's writer in request order.

    `ready()`, when given, says that `finish()` would return without waiting; the writer
    then sends it together with the answers before it."""

    finish: Callable[[], Awaitable[Description | Encoded | None]]
    ready: Callable[[], bool] | None = None


@dataclass(frozen=True, slots=True)
class Encoded:
    """A whole framed response (size prefix included), written to the socket as is.

    `with_throttle(ms)` encodes the same answer with a throttle time, for a quota that
    throttles the connection after the handler answered (KIP-219)."""

    frame: bytes
    with_throttle: Callable[[int], bytes] | None = None


Reply = Description | Deferred | _NoResponse | Encoded


@dataclass(slots=True)
class RequestContext:
    node: Node
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    peer: str
    session: Session | None = None  # the connection's listener and principal (broker.security)
    memory: AnswerMemory | None = None  # the budget for data a handler reads into its answer


Handler = Callable[[RequestContext, Any], Awaitable[Reply]]


@dataclass(frozen=True, slots=True)
class Api:
    key: int
    name: str
    min_version: int  # advertised
    max_version: int
    handler: Handler
    accepted_min: int | None = None

    @property
    def first_accepted(self) -> int:
        return self.min_version if self.accepted_min is None else self.accepted_min

    def accepts(self, version: int) -> bool:
        return self.first_accepted <= version <= self.max_version


REGISTRY: dict[int, Api] = {}


def api(key: int, name: str, versions: tuple[int, int], *, accepted_min: int | None = None) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        if key in REGISTRY:
            raise RuntimeError(f"api key {key} registered twice")
        REGISTRY[key] = Api(key, name, versions[0], versions[1], handler, accepted_min)
        return handler

    return register


def advertised() -> list[tuple[int, int, int]]:
    return [(a.key, a.min_version, a.max_version) for a in sorted(REGISTRY.values(), key=lambda a: a.key)]

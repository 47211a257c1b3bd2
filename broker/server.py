"""The Trio driver around the sans-I/O codec: listeners, connections, shutdown.

One task reads a connection: it feeds bytes to a `FrameDecoder`, decodes each request,
and runs its handler. A handler's reply goes into a bounded, ordered channel, and a
second task writes replies in request order, awaiting `Deferred` ones (a produce
waiting for its group commit) there, so a pipelining client keeps several produces in
flight while responses still leave in order. The reader runs one handler at a time, as
Kafka mutes a connection while it processes a request, so Fetch long-polls hold only
their own connection.

Two error planes (h11's): a `ProtocolError` (bad frame, unknown api, unsupported
version, a body that does not parse) gets one log line and closes that connection; a
Kafka-level problem is an error code inside the response. Anything else a handler
raises is a bug: it is logged with its traceback and the connection is closed, and the
broker lives on.

Shutdown: listeners close first; open connections get `shutdown_grace_s` to finish
the requests already read (in-flight produces are answered once their head is
published), then the node commits and closes its files.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import broker.handlers  # noqa: F401  (fills the registry)
from broker.api import NO_RESPONSE, REGISTRY, Deferred, Encoded, RequestContext, advertised
from broker.config import BrokerConfig
from broker.node import Node
from broker.protocol.codec import (
    decode_request,
    encode_api_versions_fallback,
    encode_response_parts,
    response_schema,
)
from broker.protocol.errors import ProtocolError, UnsupportedVersion
from broker.protocol.framing import FrameDecoder
from broker.protocol.header import RequestHeader
from broker.shape import shape

log = logging.getLogger("hyperkafka.server")

API_VERSIONS = 18
RECEIVE_SIZE = 256 * 1024
MAX_IN_FLIGHT = 16  # responses queued per connection before the reader waits

ACCEPTED = {a.key: (a.first_accepted, a.max_version) for a in REGISTRY.values()}
ADVERTISED = {key: (lo, hi) for key, lo, hi in advertised()}

Outgoing = Callable[[], Awaitable[list[Any] | None]]


_trace = False  # every request and response at DEBUG (--log-level DEBUG); set by run()


class Server:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.config: BrokerConfig = node.config
        self.connections = 0
        self._draining = trio.Event()
        self.stopped = trio.Event()
        self._idle: set[trio.CancelScope] = set()  # readers waiting for a next request

    async def serve(self, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or `shutdown()`; then drain connections within the grace period."""
        try:
            await self._serve(task_status)
        finally:
            self.stopped.set()

    async def _serve(self, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        async with trio.open_nursery() as connections:
            listeners = await trio.open_tcp_listeners(self.config.listen_port, host=self.config.listen_host)
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(self._accept_loop, listener, connections)
                task_status.started(listeners)
                await self._draining.wait()
                accepting.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            connections.cancel_scope.deadline = trio.current_time() + self.config.shutdown_grace_s

    def shutdown(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their request."""
        self._draining.set()
        for scope in self._idle:
            scope.cancel()

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            if self.connections >= self.config.max_connections:
                log.warning("refusing a connection: %d open (max.connections)", self.connections)
                await stream.aclose()
                continue
            connections.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        try:
            send, receive = trio.open_memory_channel[Outgoing](MAX_IN_FLIGHT)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, stream, receive, nursery.cancel_scope)
                try:
                    await self._read_loop(stream, peer, send)
                finally:
                    send.close()
        except* ProtocolError as group:
            log.info("closing connection from %s: %s", peer, group.exceptions[0])
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass  # the peer went away
        except* Exception:
            log.exception("internal error on a connection from %s; closing it", peer)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)

    async def _read_loop(self, stream: trio.SocketStream, peer: str, send: trio.MemorySendChannel[Outgoing]) -> None:
        decoder = FrameDecoder(self.config.socket_request_max_bytes)
        while not self._draining.is_set():
            with trio.CancelScope() as idle:
                self._idle.add(idle)
                try:
                    data = await stream.receive_some(RECEIVE_SIZE)
                finally:
                    self._idle.discard(idle)
            if idle.cancelled_caught:
                return
            if not data:
                if decoder.buffered:
                    raise ProtocolError(f"connection closed inside a frame ({decoder.buffered} bytes buffered)")
                return
            decoder.receive_data(data)
            while (payload := decoder.next_frame()) is not None:
                await send.send(await self._handle(payload, peer))
                if self._draining.is_set():
                    return

    async def _handle(self, payload: Any, peer: str) -> Outgoing:
        try:
            header, request = decode_request(payload, supported=ACCEPTED)
        except UnsupportedVersion as exc:
            if exc.api_key == API_VERSIONS:
                reply = encode_api_versions_fallback(exc.header.correlation_id, ADVERTISED)
                return _ready([reply])
            raise
        ctx = RequestContext(self.node, header.api_key, header.api_version, header.correlation_id, header.client_id, peer)
        api = REGISTRY[header.api_key]
        if _trace:
            log.debug("%s %s v%d #%d from %s: %.300r", peer, api.name, header.api_version, header.correlation_id, header.client_id, request)
        result = await api.handler(ctx, request)
        if result is NO_RESPONSE:
            return _ready(None)
        if isinstance(result, Deferred):
            finish = result.finish

            async def deferred() -> list[Any] | None:
                description = await finish()
                return None if description is None else _encode(header, description)

            return deferred
        return _ready(_encode(header, result))

    async def _write_loop(self, stream: trio.SocketStream, receive: trio.MemoryReceiveChannel[Outgoing], scope: trio.CancelScope) -> None:
        async with receive:
            async for outgoing in receive:
                parts = await outgoing()
                if parts:
                    await stream.send_all(b"".join(parts) if len(parts) > 1 else parts[0])
        scope.cancel()  # the reader ended and every reply is out


def _encode(header: RequestHeader, description: Any) -> list[Any]:
    if isinstance(description, Encoded):  # a hot path's own encoding (Produce)
        if _trace:
            log.debug("#%d answered: %d bytes, pre-encoded", header.correlation_id, len(description.frame))
        return [description.frame]
    response = shape(response_schema(header.api_key, header.api_version), description)
    if _trace:
        log.debug("#%d answered: %.300r", header.correlation_id, response)
    return encode_response_parts(header, response)


def _ready(parts: list[Any] | None) -> Outgoing:
    async def ready() -> list[Any] | None:
        return parts

    return ready


async def run(config: BrokerConfig, *, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the node, serve until SIGTERM/SIGINT (or cancellation), then shut down cleanly."""
    global _trace
    _trace = log.isEnabledFor(logging.DEBUG)
    node = await trio.to_thread.run_sync(Node.open, config)
    try:
        server = Server(node)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run_background)
            listeners = await nursery.start(server.serve)
            if config.listen_port == 0 and config.advertised_port is None:
                config.advertised_port = listeners[0].socket.getsockname()[1]
            for listener in listeners:
                host, port = listener.socket.getsockname()[:2]
                log.info("hyperkafka node %d listening on %s:%d (advertised %s:%d), data in %s", config.node_id, host, port, *config.advertised, config.data_dir)
            nursery.start_soon(_watch_signals, server)
            task_status.started(listeners)
            await server.stopped.wait()
            # Let the last produces see their heads published, then stop the loops.
            await node.commit_round()
            nursery.cancel_scope.cancel()
    finally:
        node.close()
        log.info("hyperkafka stopped; every acknowledged record is on disk")


async def _watch_signals(server: Server) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            server.shutdown()
            return

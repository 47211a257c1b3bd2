"""The Trio driver around the sans-I/O codec: listeners, connections, shutdown.

One task reads a connection: it feeds bytes to a `FrameDecoder`, decodes each request,
and runs its handler. A handler's reply goes into a bounded, ordered channel, and a
second task writes replies in request order, awaiting `Deferred` ones (a produce
waiting for its group commit) there, so a pipelining client keeps several produces in
flight while responses still leave in order. The reader admits every request of a
received chunk before yielding, so they share one commit round, which it then runs
itself when it is small (`Node.commit_after_chunk`), so the writer finds the answers
ready and sends them together in one write (large Fetch data by sendfile,
`broker.sendfile`). The rest of a large request is read straight into its frame buffer.
Idle connections and requests that trickle in are closed by one reaper task, not by a
deadline around every receive. The reader runs one handler at a time, as Kafka mutes a connection
while it processes a request, so Fetch long-polls hold only their own connection.

Two error planes (h11's): a `ProtocolError` (bad frame, unknown api, unsupported
version, a body that does not parse) gets one log line and closes that connection; a
Kafka-level problem is an error code inside the response. Anything else a handler
raises is a bug: it is logged with its traceback and the connection is closed, and the
broker lives on.

Listeners, TLS, SASL, authorization, connection limits, timeouts and quotas live in
`broker.security`; this module only calls into it: a `Session` per connection is the
gate in front of every request (`Session.admit`) and rides on the `RequestContext`.

Shutdown: listeners close first; open connections get `shutdown_grace_s` to finish
the requests already read (in-flight produces are answered once their head is
published), then the node commits and closes its files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

import broker.handlers  # noqa: F401  (fills the registry)
from broker.api import NO_RESPONSE, REGISTRY, Deferred, Encoded, RequestContext, advertised
from broker.compose import open_node, run_node
from broker.config import BrokerConfig
from broker.memory import AnswerMemory, ConnectionBudget, RequestPool, Ticket, memory_of
from broker.metrics import MAX_API_KEY, MAX_VERSION
from broker.node import Node
from broker.protocol.codec import (
    decode_request,
    encode_api_versions_fallback,
    encode_response_parts,
    response_schema,
)
from broker.protocol.errors import ProtocolError, UnsupportedVersion
from broker.protocol.fastpath import encode_fetch_description
from broker.protocol.framing import FrameDecoder, frame
from broker.protocol.header import RequestHeader
from broker.security.limits import raise_nofile_limit
from broker.security.sasl import SaslFailed
from broker.security.session import Security, Session
from broker.security.settings import Listener
from broker.sendfile import release, send_parts
from broker.shape import shape
from storage.errors import StorageError

log = logging.getLogger("hyperkafka.server")

API_VERSIONS = 18
RECEIVE_SIZE = 256 * 1024
# After an answer that ends the connection (a failed SASL authentication), the longest
# the broker waits for the client to close first (`_linger`).
CLOSE_LINGER_S = 2.0
LINGER_CHUNK = 4096
PRODUCE, FETCH = 0, 1
UNKNOWN_SERVER_ERROR = -1

ACCEPTED = {a.key: (a.first_accepted, a.max_version) for a in REGISTRY.values()}
# /metrics counts requests in fixed tables indexed by key and version (broker/metrics.py)
if max(ACCEPTED) > MAX_API_KEY or max(hi for _, hi in ACCEPTED.values()) > MAX_VERSION:
    raise RuntimeError("an API key or version beyond broker.metrics' request tables")
ADVERTISED = {key: (lo, hi) for key, lo, hi in advertised()}


class Outgoing:
    """One request's answer, queued for the writer in request order: `parts` now, or
    `finish()` to await (a `Deferred`), with `ready()` saying it would not block."""

    __slots__ = ("answer", "finish", "parts", "ready", "ticket", "unsent")

    def __init__(
        self,
        parts: list[Any] | None,
        finish: Callable[[], Awaitable[list[Any] | None]] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.parts = parts
        self.finish = finish
        self.ready = ready if ready is not None else (_never if finish is not None else _always)
        self.ticket: Ticket | None = None  # the request's bytes, while its answer waits
        self.answer: Ticket | None = None  # what the handler read into the answer, until sent
        self.unsent = 0  # bytes of `parts` counted in the connection's unsent answers


class _Reader:
    """A connection's reader as the reaper sees it: its scope, and while `receiving` the
    time past which it is closed (`partial`: inside a request, else idle)."""

    __slots__ = ("deadline", "partial", "receiving", "scope", "stalled")

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self.deadline = math.inf
        self.partial = False
        self.receiving = False
        self.stalled = False  # waiting for the client to read its answers


def _always() -> bool:
    return True


def _never() -> bool:
    return False


_trace = False  # every request and response at DEBUG (--log-level DEBUG); set by run()

# accept(2) failing for want of resources (descriptors, kernel memory): the process is
# overloaded, not broken. As trio's serve_listeners: wait a little and accept again.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_S = 0.1


async def accept_or_wait(listener: trio.abc.Listener[Any], name: str) -> Any:
    """The next connection of `listener`. While accept fails with one of
    ACCEPT_CAPACITY_ERRNOS, sleep ACCEPT_RETRY_S and try again (one warning per burst, and
    one line when it is over); any other error propagates."""
    failed = 0
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                raise
            if not failed:
                log.warning("accept on %s failed: %s (%s); accepting more slowly until it passes",
                            name, errno.errorcode.get(exc.errno or 0, exc.errno), exc.strerror)
            failed += 1
            await trio.sleep(ACCEPT_RETRY_S)
            continue
        if failed:
            log.warning("accept on %s works again after %d failed attempts", name, failed)
        return stream


class Server:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.config: BrokerConfig = node.config
        self.connections = 0
        self.security = Security(node.config)
        budget = node.fd_budget
        if budget is not None and budget.sockets < self.security.limiter.total:
            # past the sockets' share of RLIMIT_NOFILE a connection is refused at once
            # rather than failing accept (storage/handles.py)
            log.info("max.connections lowered from %d to %d: the open-file limit is %d",
                     self.security.limiter.total, budget.sockets, budget.limit)
            self.security.limiter.total = budget.sockets
        self._refusal_logged = -1e9
        self._draining = trio.Event()
        self.stopped = trio.Event()
        self._readers: set[_Reader] = set()  # every connection's reader, for the reaper
        self.pool = RequestPool(node.config.queued_max_request_bytes)  # queued.max.request.bytes
        # Records handlers read into answers (broker/memory.py): as much again, apart.
        self.answer_pool = RequestPool(node.config.queued_max_request_bytes)
        self._budgets: set[ConnectionBudget] = set()

    async def serve(self, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or `shutdown()`; then drain connections within the grace period."""
        try:
            await self._serve(task_status)
        finally:
            self.stopped.set()

    async def _serve(self, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        async with trio.open_nursery() as connections:
            opened: list[tuple[Listener, trio.SocketListener]] = []
            for spec in self.security.listeners:
                for sock in await trio.open_tcp_listeners(spec.port, host=spec.host or None):  # Kafka's "PLAINTEXT://:9092": every interface
                    opened.append((spec, sock))
                if spec.port == 0:  # tell clients the port the system picked
                    spec.port = opened[-1][1].socket.getsockname()[1]
            listeners = [sock for _, sock in opened]
            async with trio.open_nursery() as accepting:
                for spec, listener in opened:
                    accepting.start_soon(self._accept_loop, listener, spec, connections)
                accepting.start_soon(self._reap_loop)
                task_status.started(listeners)
                await self._draining.wait()
                accepting.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            connections.cancel_scope.deadline = trio.current_time() + self.config.shutdown_grace_s

    def statistics(self) -> dict[str, int]:
        """Memory the connections hold: request bytes in the pool, answers not yet sent."""
        pool = self.pool.statistics()
        return {
            "connections": self.connections,
            "request_bytes": pool["in_use"] if self.pool.bounded else sum(b.unframed for b in self._budgets),
            "request_pool_capacity": pool["capacity"],
            "answer_bytes": self.answer_pool.statistics()["in_use"],
            "unsent_bytes": sum(b.unsent for b in self._budgets),
            "max_unsent_bytes": max((b.unsent for b in self._budgets), default=0),
        }

    def shutdown(self) -> None:
        """Stop accepting; idle connections close now, busy ones after their request."""
        self._draining.set()
        for reader in self._readers:
            if reader.receiving:
                reader.scope.cancel()

    async def _reap_loop(self) -> None:
        """Close connections idle past connections.max.idle.ms, and those inside a request
        for longer than the request timeout. One task checks every reader a few times per
        timeout, instead of a deadline (a cancel scope) around every receive: that scope
        was about a tenth of the loop's time under a steady produce load."""
        settings = self.security.settings
        period = min(1.0, max(0.01, min(settings.idle_ms, settings.request_timeout_ms) / 4000))
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            for reader in self._readers:
                if reader.receiving and now >= reader.deadline:
                    reader.scope.cancel()

    async def _accept_loop(self, listener: trio.SocketListener, spec: Listener, connections: trio.Nursery) -> None:
        limiter = self.security.limiter
        while True:
            stream = await accept_or_wait(listener, spec.name)
            try:
                host, port = stream.socket.getpeername()[:2]
            except OSError:
                host, port = "?", 0
            refused = limiter.acquire(host)
            if refused is not None:
                now = trio.current_time()
                if now - self._refusal_logged >= 1.0:  # a flood must not flood the log too
                    self._refusal_logged = now
                    log.warning("refusing connections from %s on %s: %s", host, spec.name, refused)
                await trio.aclose_forcefully(stream)
                continue
            connections.start_soon(self._connection, stream, spec, host, f"{host}:{port}")

    async def _connection(self, raw: trio.SocketStream, spec: Listener, host: str, peer: str) -> None:
        self.connections += 1
        session = Session(self.security, spec, peer)
        stream: trio.abc.Stream = raw
        try:
            if spec.tls is not None:
                tls = trio.SSLStream(raw, self.security.tls[spec.name], server_side=True)
                stream = tls
                # A peer that never finishes its handshake must not hold the slot forever.
                with trio.fail_after(self.security.settings.request_timeout_ms / 1000):
                    try:
                        await tls.do_handshake()
                    except trio.BrokenResourceError as exc:
                        # No (or an untrusted) client certificate, plaintext on a TLS port, ...
                        log.info("TLS handshake with %s on %s failed: %s", peer, spec.name, exc.__cause__ or exc)
                        await _send_tls_alert(tls, raw)
                        return
                session.tls_principal(tls.getpeercert())
            session.sendfile = isinstance(stream, trio.SocketStream)
            send, receive = trio.open_memory_channel[Outgoing](self.security.settings.max_in_flight)
            budget = ConnectionBudget(self.pool, self.config.max_unsent_bytes_per_connection)
            self._budgets.add(budget)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, stream, receive, nursery.cancel_scope, budget)
                    try:
                        await self._read_loop(stream, session, send, budget)
                    finally:
                        send.close()
            finally:
                budget.close()
                self._budgets.discard(budget)
            if session.close_after_reply and not self._draining.is_set():
                await _linger(stream)
        except* trio.TooSlowError:
            log.info("closing connection from %s on %s: TLS handshake not finished in time", peer, spec.name)
        except* ProtocolError as group:
            log.info("closing connection from %s: %s", peer, group.exceptions[0])
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            pass  # the peer went away
        except* Exception:
            log.exception("internal error on a connection from %s; closing it", peer)
        finally:
            self.connections -= 1
            self.security.limiter.release(host)
            await trio.aclose_forcefully(stream)

    async def _read_loop(self, stream: trio.abc.Stream, session: Session, send: trio.MemorySendChannel[Outgoing],
                         budget: ConnectionBudget) -> None:
        settings = self.security.settings
        reader = _Reader(trio.CancelScope())
        self._readers.add(reader)
        try:
            with reader.scope:
                await self._read_requests(stream, session, send, reader, budget)
        finally:
            self._readers.discard(reader)
        if reader.scope.cancelled_caught and not self._draining.is_set():
            if reader.stalled:
                # (raised, so the writer stuck on a client that does not read ends too)
                raise ProtocolError(f"client left its answers unread for {settings.idle_ms} ms")
            if reader.partial:
                raise ProtocolError(f"request not complete after {settings.request_timeout_ms} ms")
            log.debug("closing %s: idle for %d ms (connections.max.idle.ms)", session.peer, settings.idle_ms)

    async def _read_requests(self, stream: trio.abc.Stream, session: Session, send: trio.MemorySendChannel[Outgoing],
                             reader: _Reader, budget: ConnectionBudget) -> None:
        decoder = FrameDecoder(self.config.socket_request_max_bytes)
        settings = self.security.settings
        node = self.node
        # Plain TCP: each read takes its bytes from the request pool first (broker/memory.py)
        # and large requests are read into their frame (FrameDecoder.receive_buffer).
        sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        fd = sock.fileno() if sock is not None else -1
        idle_s = settings.idle_ms / 1000
        partial_since: float | None = None  # when the request being received began
        held = False  # whole frames left in the decoder while answers piled up unread
        readable = False  # bytes are known to wait on the socket
        while not self._draining.is_set():
            if budget.over:
                # The client does not read its answers: read nothing more from it until it
                # does (or until connections.max.idle.ms, as an idle connection).
                await self._wait_client_reads(reader, budget.wait_sent, lambda: budget.over)
            # Idle: connections.max.idle.ms. Inside a request: it must be complete within
            # the request timeout, so a peer trickling bytes cannot hold a slot or memory.
            # The reaper (`_reap_loop`) cancels `reader.scope` past the deadline; it only
            # does while the reader waits here, never inside a handler.
            if partial_since is None:
                reader.deadline = trio.current_time() + idle_s
                reader.partial = False
            else:
                reader.deadline = partial_since + settings.request_timeout_ms / 1000
                reader.partial = True
            budget.release_ready()
            got = 1
            if held:
                held = False
            elif sock is None:
                reader.receiving = True
                try:
                    await budget.wait_room(decoder.buffered > 0)  # (TLS: charged once read)
                    data = await stream.receive_some(RECEIVE_SIZE)
                finally:
                    reader.receiving = False
                got = len(data)
                self.pool.force(got)
                budget.received(0, got)
                decoder.receive_data(data)
            elif decoder.receiving_large:
                # The rest of a large request goes straight into its frame buffer, grown
                # a chunk at a time with room taken from the pool, and only once bytes are
                # known to be waiting (a size prefix alone allocates nothing).
                if not decoder.room:
                    if not readable:
                        await self._wait_readable(sock, reader)
                        readable = True
                    granted = await budget.grant(decoder.growth, decoder.needed, True)
                    budget.received(granted, decoder.grow(granted))  # charged as allocated
                try:
                    room = decoder.receive_buffer()
                    assert room is not None
                    with room:  # released even if the read fails
                        got = os.readv(fd, [room])
                        readable = got == len(room)  # filled: more is likely waiting
                except BlockingIOError:
                    readable = False
                    await self._wait_readable(sock, reader)
                    readable = True
                    continue
                except OSError as exc:  # as SocketStream.receive_some reports it
                    raise trio.BrokenResourceError from exc
                decoder.received_into(got)
                await trio.lowlevel.cancel_shielded_checkpoint()  # as trio's own receive
            else:
                # Take room for the next bytes from the pool (waiting here, reading nothing,
                # while the pool is spent), then read at most that much.
                granted = await budget.grant(RECEIVE_SIZE, decoder.needed, decoder.buffered > 0)
                try:
                    data = os.read(fd, granted)
                except BlockingIOError:
                    # Nothing there yet: give the room back while waiting (an idle
                    # connection holds nothing of the pool).
                    budget.received(granted, 0)
                    readable = False
                    await self._wait_readable(sock, reader)
                    readable = True
                    continue
                except OSError as exc:  # as SocketStream.receive_some reports it
                    budget.received(granted, 0)
                    raise trio.BrokenResourceError from exc
                got = len(data)
                readable = got == granted
                budget.received(granted, got)
                decoder.receive_data(data)
                # As trio's own receive: a read that did not wait still lets others run.
                await trio.lowlevel.cancel_shielded_checkpoint()
            if not got:
                if decoder.buffered:
                    raise ProtocolError(f"connection closed inside a frame ({decoder.buffered} bytes buffered)")
                return
            completed = False
            try:
                while (payload := decoder.next_frame()) is not None:
                    completed = True
                    ticket = budget.frame_done(len(payload) + 4)
                    outgoing = await self._handle(payload, session, budget)
                    del payload
                    if outgoing.finish is None:
                        if ticket is not None:
                            ticket.release()  # handled: its answer no longer needs it
                        outgoing.unsent = memory_of(outgoing.parts)
                        budget.queued(outgoing.unsent)
                    else:
                        # A Produce: its batches are views into the frame until the commit
                        # round wrote them; the bytes go back once its answer is ready.
                        outgoing.ticket = ticket
                        budget.wait_for(ticket, outgoing.ready)
                    # Every request already received is admitted before anything else runs
                    # (no checkpoint while the channel has room): the produces of one chunk
                    # then share a commit round, and the writer finds their answers together.
                    try:
                        send.send_nowait(outgoing)
                    except trio.WouldBlock:
                        if node.round_owed:  # the writer may be waiting for that round
                            await node.commit_after_chunk()
                        # max_in_flight answers wait already: Kafka would not even have
                        # read this request. A client that never reads is closed as idle.
                        await self._wait_client_reads(reader, functools.partial(send.send, outgoing))
                    if self._draining.is_set() or session.close_after_reply:
                        return
                    if session.mute_until > trio.current_time():
                        # KIP-219: the throttled answer is out; read nothing more until it has passed.
                        if node.round_owed:
                            await node.commit_after_chunk()
                        await trio.sleep_until(session.mute_until)
                    if budget.over:
                        # Answers pile up unread: handle nothing more of what is buffered
                        # until the client reads (the check at the top of the loop).
                        held = True
                        break
                if node.round_owed:
                    # The chunk's produces, committed before the writer looks at their answers.
                    await node.commit_after_chunk()
            finally:
                if node.round_owed:  # leaving early: the commit loop runs the round
                    node.wake_commit()
            if not decoder.buffered:
                partial_since = None
            elif completed or partial_since is None:
                partial_since = trio.current_time()

    @staticmethod
    async def _wait_readable(sock: Any, reader: _Reader) -> None:
        reader.receiving = True
        try:
            await trio.lowlevel.wait_readable(sock)
        finally:
            reader.receiving = False

    async def _wait_client_reads(self, reader: _Reader, wait: Callable[[], Awaitable[None]],
                                 until: Callable[[], bool] | None = None) -> None:
        """Wait for the writer to get answers out to a client that is slow to read them; past
        connections.max.idle.ms the reaper closes the connection (`_read_loop`)."""
        reader.deadline = trio.current_time() + self.security.settings.idle_ms / 1000
        reader.receiving = reader.stalled = True
        try:
            await wait()
            while until is not None and until():
                await wait()
        finally:
            reader.receiving = reader.stalled = False

    async def _handle(self, payload: Any, session: Session, budget: ConnectionBudget) -> Outgoing:
        peer = session.peer
        if session.raw_sasl:
            # After SaslHandshake v0 the client sends bare SASL tokens, and so do we.
            try:
                token = await session.sasl_step(bytes(payload))
            except SaslFailed as exc:
                log.warning("SASL authentication failed for %s on %s: %s", peer, session.listener.name, exc)
                raise ProtocolError(f"SASL authentication failed: {exc}") from None
            return Outgoing([frame(token)])
        try:
            header, request = decode_request(payload, supported=ACCEPTED)
        except UnsupportedVersion as exc:
            if exc.api_key == API_VERSIONS:
                reply = encode_api_versions_fallback(exc.header.correlation_id, ADVERTISED)
                return Outgoing([reply])
            raise
        session.admit(header.api_key)
        if header.api_key != PRODUCE and self.node.round_owed:
            # Produces admitted earlier in this chunk are committed before a handler that
            # may wait (a Fetch long-poll) holds the reader.
            await self.node.commit_after_chunk()
        memory = AnswerMemory(self.answer_pool)
        ctx = RequestContext(self.node, header.api_key, header.api_version, header.correlation_id, header.client_id, peer, session, memory)
        api = REGISTRY[header.api_key]
        self.node.metrics.requests[header.api_key][header.api_version] += 1
        start = time.perf_counter()
        if _trace:
            log.debug("%s %s v%d #%d from %s as %s: %.300r", peer, api.name, header.api_version, header.correlation_id, header.client_id, session.principal, request)
        try:
            result = await api.handler(ctx, request)
        finally:
            answer = budget.hold(memory)  # (also when the handler failed: the close gives it back)
        outgoing = self._answer(header, result, session, len(payload), start)
        outgoing.answer = answer
        return outgoing

    def _answer(self, header: RequestHeader, result: Any, session: Session, size: int, start: float) -> Outgoing:
        metrics = self.node.metrics
        throttle_ms = 0
        if header.api_key == PRODUCE:
            throttle_ms = session.throttle_produce(size)
        elif header.api_key == FETCH and isinstance(result, dict):
            throttle_ms, send_data = session.throttle_fetch(_fetch_bytes(result))
            if not send_data:
                # Kafka answers a throttled fetch with no data at all (KIP-219).
                release(result["responses"])
                result = {**result, "responses": []}
        if result is NO_RESPONSE:
            metrics.observe_latency(header.api_key, time.perf_counter() - start)
            return Outgoing(None)
        if isinstance(result, Deferred):
            finish = result.finish

            async def deferred() -> list[Any] | None:
                description = await finish()
                metrics.observe_latency(header.api_key, time.perf_counter() - start)
                if description is not None and throttle_ms:
                    if isinstance(description, Encoded):
                        if description.with_throttle is not None:
                            description = Encoded(description.with_throttle(throttle_ms))
                    else:
                        description = {**description, "throttle_time": throttle_ms}
                return None if description is None else _encode(header, description)

            return Outgoing(None, deferred, result.ready)
        if throttle_ms and isinstance(result, dict):
            result = {**result, "throttle_time": throttle_ms}
        metrics.observe_latency(header.api_key, time.perf_counter() - start)
        return Outgoing(_encode(header, result))

    async def _write_loop(self, stream: trio.abc.Stream, receive: trio.MemoryReceiveChannel[Outgoing], scope: trio.CancelScope,
                          budget: ConnectionBudget) -> None:
        # Answers that are ready one after another leave in one send: a commit round
        # acknowledges every produce it covers at once, and one syscall (and one pass of
        # trio's send path) per round is what keeps a pipelining producer cheap.
        out: list[Any] = []
        counted = 0  # of budget.unsent, for the answers in `out`
        held: list[Ticket] = []  # what their handlers read into them, from the pool
        async with receive:
            async for outgoing in receive:
                while True:
                    if out and not outgoing.ready():
                        await send_parts(stream, out)  # don't hold ready answers while waiting
                        out = []
                        budget.sent(counted)
                        counted = 0
                        _release(held)
                    if outgoing.finish is None:
                        parts = outgoing.parts
                        counted += outgoing.unsent
                    else:
                        parts = await outgoing.finish()
                        if outgoing.ticket is not None:
                            outgoing.ticket.release()
                        n = memory_of(parts)
                        budget.queued(n)
                        counted += n
                    if parts:
                        out += parts
                    if outgoing.answer is not None:
                        held.append(outgoing.answer)
                    try:
                        outgoing = receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                if out:
                    await send_parts(stream, out)
                    out = []
                budget.sent(counted)
                counted = 0
                _release(held)
        scope.cancel()  # the reader ended and every reply is out


async def _send_tls_alert(tls: trio.SSLStream[trio.SocketStream], raw: trio.SocketStream) -> None:
    """Send the alert OpenSSL wrote when it failed the handshake, best effort.

    With it the client reports the reason ("certificate required", "unknown ca") instead
    of a bare end of stream. trio.SSLStream marks itself broken before flushing that
    record, and its outgoing buffer is private, hence the defensive lookup.
    """
    outgoing = getattr(tls, "_outgoing", None)
    alert = outgoing.read() if isinstance(outgoing, ssl.MemoryBIO) else b""
    if alert:
        # A client already gone has no one to tell.
        with trio.move_on_after(1.0), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await raw.send_all(alert)


def _release(tickets: list[Ticket]) -> None:
    for ticket in tickets:
        ticket.release()
    tickets.clear()


async def _linger(stream: trio.abc.Stream) -> None:
    """After a final answer, wait (at most CLOSE_LINGER_S) for the client to close first,
    discarding whatever it still sends.

    Closing right after the answer can cost the client that answer: kafka-python 3.0
    drops the bytes that reach it in the same read as the end of stream, which is what a
    client slow to read (a loaded machine) finds; and a close with bytes still unread in
    the kernel is a reset, which discards what was not yet transmitted. The answer is
    out; sending our FIN now (send_eof) would bring back the first case.
    """
    with trio.move_on_after(CLOSE_LINGER_S):
        while await stream.receive_some(LINGER_CHUNK):  # dropped: a small chunk, outside the pool
            pass


def _fetch_bytes(description: Any) -> int:
    return sum(len(p["records"] or b"") for t in description.get("responses", ()) for p in t["partitions"])


class UnencodableAnswer(ProtocolError):
    """An answer could not be encoded and the API has no error field to say so: close."""


def _encode(header: RequestHeader, description: Any) -> list[Any]:
    """The answer's frame pieces. An answer that cannot be encoded (a handler bug, or a
    value too large for its field) is logged once as an internal error and replaced by
    UNKNOWN_SERVER_ERROR where the response has a top-level error code; otherwise the
    connection closes. Either way the reader goes on with a consistent state: encoding
    runs after the handler, which must not have stored what it could not answer."""
    try:
        return _encode_description(header, description)
    except Exception as exc:
        log.error("internal error: cannot encode the answer to %s v%d #%d: %s: %.300s",
                  REGISTRY[header.api_key].name, header.api_version, header.correlation_id, type(exc).__name__, exc)
        cls = response_schema(header.api_key, header.api_version)
        if "error_code" in getattr(cls, "__dataclass_fields__", {}):
            with contextlib.suppress(Exception):
                return encode_response_parts(header, shape(cls, {"error_code": UNKNOWN_SERVER_ERROR}))
        raise UnencodableAnswer(f"answer to {REGISTRY[header.api_key].name} #{header.correlation_id} could not be encoded") from None


def _encode_description(header: RequestHeader, description: Any) -> list[Any]:
    if isinstance(description, Encoded):  # a hot path's own encoding (Produce)
        if _trace:
            log.debug("#%d answered: %d bytes, pre-encoded", header.correlation_id, len(description.frame))
        return [description.frame]
    if header.api_key == FETCH:
        parts = encode_fetch_description(header.correlation_id, header.api_version, description)
        if parts is not None:
            if _trace:
                log.debug("#%d answered: Fetch, %d pieces", header.correlation_id, len(parts))
            return parts
    response = shape(response_schema(header.api_key, header.api_version), description)
    if _trace:
        log.debug("#%d answered: %.300r", header.correlation_id, response)
    return encode_response_parts(header, response)


async def run(config: BrokerConfig, *, task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the node, serve until SIGTERM/SIGINT (or cancellation), then shut down cleanly."""
    global _trace
    _trace = log.isEnabledFor(logging.DEBUG)
    raise_nofile_limit()
    node = await trio.to_thread.run_sync(open_node, config)
    try:
        server = Server(node)
        async with trio.open_nursery() as nursery:
            await nursery.start(run_node, node)
            if config.http_listen is not None:
                # Before the Kafka listener: whoever waits for the Kafka port to answer
                # (scripts, orchestrators, tests) finds /metrics and the explorer up too.
                from broker.http import serve_http
                from broker.security.authz import ANONYMOUS, Operation

                authorizer = server.security.authorizer

                def readable(topic: str) -> bool:
                    return authorizer.allowed(ANONYMOUS, Operation.READ, topic)

                await nursery.start(serve_http, node, *config.http_listen, readable)
            listeners = await nursery.start(server.serve)
            if config.listen_port == 0 and config.advertised_port is None:
                config.advertised_port = listeners[0].socket.getsockname()[1]
            for spec in server.security.listeners:
                log.info("hyperkafka node %d listening on %s %s:%d (advertised %s:%d), data in %s", config.node_id, spec.protocol.value, spec.host, spec.port, *spec.advertised, config.data_dir)
            if server.security.settings.secured:
                log.info("secured: anyone may read; writes need an authenticated principal a rule allows")
            nursery.start_soon(_watch_signals, server)
            task_status.started(listeners)
            await server.stopped.wait()
            # Let the last produces see their heads published (quorum heads too, signed in
            # tasks of their own), then stop the loops.
            await node.commit_round()
            await node.wait_signed()
            nursery.cancel_scope.cancel()
    finally:
        try:
            node.close()
        except (StorageError, OSError) as exc:
            # A full disk at shutdown: every acknowledged record is under a signed head
            # already; only the clean-shutdown marks are missing, and the next start
            # recovers without them.
            log.error("closing the data dir failed (%s); the next start recovers it", exc)
        log.info("hyperkafka stopped; every acknowledged record is on disk")


async def _watch_signals(server: Server) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: shutting down", signal.Signals(signum).name)
            server.shutdown()
            return

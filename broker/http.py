"""The broker's HTTP listener (`hyperkafka.http.listeners`): /metrics for Prometheus,
/v1/partitions/... JSON of signed heads and inclusion proofs (broker/archive_json.py), and
the explorer page with its JSON (broker/explorer.py).

Owns `serve_http`, a deliberately small HTTP/1.1 responder on Trio in the broker's own
process and event loop (no threads, no framework): it reads one request head (at most
MAX_HEAD_BYTES, within HEAD_TIMEOUT_S), answers it and closes the connection, which is
all a Prometheus scrape needs. GET and HEAD only; anything else is 405, an unknown path
404, a malformed or oversized head 400/431. At most MAX_CONNECTIONS at once: the port is
meant for loopback or a monitoring network, and it must never cost the Kafka port
memory or descriptors.

May import trio, `broker.node`, `broker.metrics` and the JSON modules; never the protocol codec.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from functools import partial

import trio

from broker.archive_json import NotFound, answer_json
from broker.explorer import explorer_json, static_file
from broker.metrics import render
from broker.node import Node

log = logging.getLogger("hyperkafka.http")

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
# `readable(topic)` (from the server's authorizer): may an anonymous Kafka client read the
# topic? The listener authenticates nobody, so proofs (which carry batches) are served for
# those topics only. /metrics names every topic, as Kafka's JMX exporter does.
LINGER_S = 1.0
CONTENT_TYPE_METRICS = "text/plain; version=0.0.4; charset=utf-8"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _response(
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request head up to its blank line; None when it is too large."""
    buf = bytearray()
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        if len(buf) > MAX_HEAD_BYTES:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def answer(
    node: Node, head: bytes | None, readable: Callable[[str], bool] = lambda _: True
) -> bytes:
    """The whole response to one request head (sans I/O, for the tests). Whatever goes
    wrong while answering (a disk error reading a proof's nodes) is a 500 and a log line:
    the broker never dies of a request."""
    try:
        return _answer(node, head, readable)
    except Exception:
        log.exception("answering an HTTP request failed")
        return _response(500, b"internal error (logged)\n")


def _answer(node: Node, head: bytes | None, readable: Callable[[str], bool]) -> bytes:
    if head is None:
        return _response(431, b"request head too large\n")
    line = head.split(b"\n", 1)[0].strip()
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return _response(400, b"bad request line\n")
    method, target, _, query = parts[0], *parts[1].partition(b"?")
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"only GET and HEAD\n")
    head_only = method == b"HEAD"
    if target == b"/metrics":
        return _response(200, render(node).encode(), CONTENT_TYPE_METRICS, head_only=head_only)
    path = target.decode("ascii", "replace")
    page = static_file(path)
    if page is not None:
        return _response(200, page[0], page[1], head_only=head_only)
    if target.startswith(b"/v1/"):
        try:
            status, doc = (
                200,
                explorer_json(node, path, query.decode("ascii", "replace"), readable)
                or answer_json(node, path, query.decode("ascii", "replace"), readable),
            )
        except NotFound as exc:
            status, doc = 404, {"error": str(exc)}
        except ValueError as exc:
            status, doc = 400, {"error": str(exc)}
        return _response(status, json.dumps(doc).encode(), "application/json", head_only=head_only)
    return _response(404, b"not found\n", head_only=head_only)


async def _connection(
    node: Node,
    readable: Callable[[str], bool],
    limit: trio.CapacityLimiter,
    stream: trio.SocketStream,
) -> None:
    try:
        if limit.available_tokens == 0:
            await stream.send_all(_response(503, b"too many connections\n"))
            return
        async with limit:
            with trio.move_on_after(HEAD_TIMEOUT_S):
                head = await _read_head(stream)
                if head is None or head.strip():
                    await stream.send_all(answer(node, head, readable))
                    await stream.send_eof()
            # Unread request bytes would turn our close into a reset that can destroy the
            # answer before the client reads it: read (and drop) a little first.
            with trio.move_on_after(LINGER_S):
                drained = 0
                while drained < MAX_HEAD_BYTES * 8 and (chunk := await stream.receive_some(4096)):
                    drained += len(chunk)
    except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def serve_http(
    node: Node,
    host: str,
    port: int,
    readable: Callable[[str], bool] = lambda _: True,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    node.config.http_listen = (host, bound[1])  # (port 0: the one the system chose)
    log.info("serving /metrics over HTTP on %s:%d", bound[0], bound[1])
    task_status.started(listeners)
    await trio.serve_listeners(
        partial(_connection, node, readable, trio.CapacityLimiter(MAX_CONNECTIONS)), listeners
    )

"""Hostile bytes on raw sockets, then every client must still work.

What a Kafka broker does with bad input (SocketServer): a frame larger than
socket.request.max.bytes, a negative size, an unparsable header or an unknown api key
closes that connection; nothing else is affected. Each attack below must end with the
broker closing (or answering on) the attacking connection within a few seconds, the
broker still answering ApiVersions on a new connection, and, after all of them, every
client in the matrix passing a short round trip. An ApiVersions request at a version the
broker does not know must get error 35 in a v0 body (KIP-511), which clients rely on to
downgrade.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.clients import CLIENTS, create_topic
from compat_tests.harness import Broker, recv_exact
from compat_tests.records import assert_same, generate

CLOSE_WITHIN = 10.0


def _header(
    api_key: int, version: int, correlation_id: int, client_id: bytes = b"hk-hostile"
) -> bytes:
    return struct.pack(">hhih", api_key, version, correlation_id, len(client_id)) + client_id


def _closed_or_answered(s: socket.socket, timeout: float = CLOSE_WITHIN) -> str:
    """Wait until the peer closes ("closed") or sends something ("answered")."""
    s.settimeout(timeout)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return "hung"
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    return "closed" if not data else "answered"


def _assert_alive(broker: Broker) -> None:
    assert harness.api_versions_v0_probe(broker.host, broker.port, timeout=5.0), (
        "broker no longer answers ApiVersions on a new connection"
    )
    if broker.proc is not None:
        assert broker.proc.poll() is None, f"broker exited with {broker.proc.returncode}"


def _attack_garbage(s: socket.socket) -> None:
    # A plausible size followed by junk: the header cannot parse.
    junk = random.Random(1).randbytes(200)
    s.sendall(struct.pack(">i", len(junk)) + junk)


def _attack_random_stream(s: socket.socket) -> None:
    # Whatever the first four bytes say; the first two words are forced absurd so that
    # "wait for the rest of a huge frame" is not a legal reading.
    data = bytearray(random.Random(2).randbytes(64 * 1024))
    data[0:4] = b"\xde\xad\xbe\xef"
    s.sendall(bytes(data))


def _attack_huge_frame(s: socket.socket) -> None:
    s.sendall(struct.pack(">I", 0x7FFF_FFFF) + _header(18, 0, 1))  # 2 GiB - 1


def _attack_negative_frame(s: socket.socket) -> None:
    s.sendall(struct.pack(">I", 0x8000_0000) + _header(18, 0, 1))  # "2 GiB" read as int32


def _attack_truncated_frame(s: socket.socket) -> None:
    # Promise 1000 bytes, send a header's worth, then end our side of the stream.
    s.sendall(struct.pack(">i", 1000) + _header(3, 1, 2))
    s.shutdown(socket.SHUT_WR)


def _attack_truncated_body(s: socket.socket) -> None:
    # A complete frame whose Metadata v1 body stops inside the topics array.
    body = _header(3, 1, 3) + struct.pack(">i", 5) + struct.pack(">h", 40) + b"abc"
    s.sendall(struct.pack(">i", len(body)) + body)


def _attack_unknown_api_key(s: socket.socket) -> None:
    body = _header(9999, 0, 4)
    s.sendall(struct.pack(">i", len(body)) + body)


ATTACKS: dict[str, Callable[[socket.socket], None]] = {
    "garbage-frame": _attack_garbage,
    "random-stream": _attack_random_stream,
    "2GiB-frame": _attack_huge_frame,
    "negative-frame": _attack_negative_frame,
    "truncated-frame": _attack_truncated_frame,
    "truncated-body": _attack_truncated_body,
    "unknown-api-key": _attack_unknown_api_key,
}


@pytest.mark.timeout(120)
@pytest.mark.matrix("hostile-{attack}", client="raw-socket")
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_hostile_bytes(broker: Broker, attack: str) -> None:
    with harness.raw_connection(broker) as s:
        # The broker may hang up while we are still sending: that is fine.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            ATTACKS[attack](s)
        outcome = _closed_or_answered(s)
    assert outcome != "hung", (
        f"after {attack} the broker kept the connection open, silent, for {CLOSE_WITHIN}s"
    )
    _assert_alive(broker)


@pytest.mark.timeout(60)
@pytest.mark.matrix("stalled-connections", client="raw-socket")
def test_stalled_connections_do_not_block_others(broker: Broker) -> None:
    """50 connections each stuck mid-frame must not delay anyone else."""
    socks = []
    try:
        for i in range(50):
            s = socket.create_connection((broker.host, broker.port), timeout=5)
            s.sendall(struct.pack(">i", 100) + _header(18, 0, i)[:5])
            socks.append(s)
        started = time.monotonic()
        _assert_alive(broker)
        assert time.monotonic() - started < 2.0, "ApiVersions took >2 s beside stalled peers"
    finally:
        for s in socks:
            s.close()


@pytest.mark.timeout(30)
@pytest.mark.matrix("apiversions-unknown-version", client="raw-socket")
def test_apiversions_unknown_version_gets_v0_error(broker: Broker) -> None:
    """ApiVersions v127: error 35 and a v0 body listing at least ApiVersions (KIP-511)."""
    with harness.raw_connection(broker) as s:
        body = _header(18, 127, 77) + b"\x00garbage-a-future-version-might-send"
        s.sendall(struct.pack(">i", len(body)) + body)
        head = recv_exact(s, 4)
        assert head is not None, "broker closed the connection instead of answering error 35"
        (size,) = struct.unpack(">i", head)
        payload = recv_exact(s, size)
        assert payload is not None
    correlation_id, error_code, count = struct.unpack(">ihi", payload[:10])
    assert correlation_id == 77
    assert error_code == 35, f"error_code {error_code}, expected UNSUPPORTED_VERSION (35)"
    keys = {}
    for i in range(count):
        key, lo, hi = struct.unpack(">hhh", payload[10 + 6 * i : 16 + 6 * i])
        keys[key] = (lo, hi)
    assert 18 in keys, f"ApiVersions missing from the v0 error body: {keys}"


@pytest.mark.timeout(300)
@pytest.mark.matrix("after-hostile")
@pytest.mark.parametrize("client", list(CLIENTS))
def test_clients_work_after_hostile_bytes(broker: Broker, workdir: Path, client: str) -> None:
    c = CLIENTS[client]
    c.require()
    # Hit it once more right before, so this cell holds even when run on its own.
    for attack in ATTACKS.values():
        with harness.raw_connection(broker) as s, contextlib.suppress(OSError):
            attack(s)
    _assert_alive(broker)
    topic = f"after-hostile-{client}-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    records = generate(300, c.profile, seed=3)
    c.produce(broker, topic, records, workdir, timeout=120)
    consumed, _ = c.consume(broker, topic, len(records), workdir, timeout=120)
    assert_same(records, consumed)


@pytest.mark.timeout(180)
@pytest.mark.matrix("after-hostile", client="java-tools")
def test_console_tools_work_after_hostile_bytes(broker: Broker) -> None:
    """The same, for the Java console producer and consumer (text lines, their format)."""
    from compat_tests.java_tools import JavaTools, require_java

    java = JavaTools(require_java())
    for attack in ATTACKS.values():
        with harness.raw_connection(broker) as s, contextlib.suppress(OSError):
            attack(s)
    _assert_alive(broker)
    topic = f"after-hostile-java-{uuid.uuid4().hex[:8]}"
    create_topic(broker, topic)
    data = b"".join(b"k%03d\tafter hostile bytes %03d \xc3\xa4\xe2\x82\xac\n" % (i, i) for i in range(300))
    java.console_producer(broker.bootstrap, topic, data, reader_props={"parse.key": "true", "key.separator": "\t"})
    res = java.console_consumer(
        broker.bootstrap, topic, partition=0, offset="earliest", max_messages=300, timeout_ms=30_000,
        formatter_props={"print.key": "true", "key.separator": "\t"},
    )  # fmt: skip
    assert res.processed() == 300 and res.stdout == data, res.stderr_tail()

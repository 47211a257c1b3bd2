"""A few Kafka requests sent to one chosen broker, bypassing clients' routing.

Owns `Conn`: OffsetCommit v2, OffsetFetch v1, Metadata v1 and FindCoordinator v0, encoded by hand (they are
the old, non-flexible versions every broker of ours and Kafka's answers). The nemesis
tests need them because a real client sends a group's commits only to the coordinator
*it* found: to see whether two brokers accept a group's commits at once, the probe must
ask every broker itself. Every call is bounded by a socket timeout; any failure closes the
connection and is reported as the string ``"timeout"`` / ``"io"``, never raised.

May import only the standard library.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

OFFSET_COMMIT, OFFSET_FETCH, METADATA, FIND_COORDINATOR = 8, 9, 3, 10


def _str(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    b = s.encode()
    return struct.pack(">h", len(b)) + b


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> int:
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(v)

    def string(self) -> str | None:
        n = self.take(">h")
        if n < 0:
            return None
        s = self.data[self.pos : self.pos + n].decode()
        self.pos += n
        return s


@dataclass
class PartitionInfo:
    leader: int
    replicas: list[int]
    isr: list[int]
    error: int


@dataclass
class Metadata:
    brokers: dict[int, tuple[str, int]]
    controller: int
    topics: dict[str, dict[int, PartitionInfo]]  # name -> partition -> info
    topic_errors: dict[str, int]


class Conn:
    """One connection to one broker; reconnects on the next call after a failure."""

    def __init__(self, host: str, port: int, timeout: float = 1.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self.correlation = 0

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _call(self, api: int, version: int, body: bytes) -> _Reader | str:
        try:
            if self.sock is None:
                self.sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
                self.sock.settimeout(self.timeout)
            self.correlation += 1
            head = struct.pack(">hhi", api, version, self.correlation) + _str("hk-jepsen")
            msg = head + body
            self.sock.sendall(struct.pack(">i", len(msg)) + msg)
            size = struct.unpack(">i", self._recv(4))[0]
            data = self._recv(size)
            if struct.unpack_from(">i", data)[0] != self.correlation:
                raise OSError("correlation id mismatch")
            r = _Reader(data)
            r.pos = 4
            return r
        except TimeoutError:
            self.close()
            return "timeout"
        except (OSError, struct.error):
            self.close()
            return "io"

    def _recv(self, n: int) -> bytes:
        assert self.sock is not None
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise OSError("connection closed")
            buf += chunk
        return buf

    def commit(self, group: str, topic: str, partition: int, offset: int) -> int | str:
        """OffsetCommit v2 as a simple (generation -1) commit: the partition's error code."""
        body = (
            _str(group)
            + struct.pack(">i", -1)
            + _str("")
            + struct.pack(">q", -1)
            + struct.pack(">i", 1)
            + _str(topic)
            + struct.pack(">i", 1)
            + struct.pack(">iq", partition, offset)
            + _str(None)
        )
        r = self._call(OFFSET_COMMIT, 2, body)
        if isinstance(r, str):
            return r
        r.take(">i")
        r.string()
        r.take(">i")
        r.take(">i")
        return r.take(">h")

    def fetch(self, group: str, topic: str, partition: int) -> tuple[int, int] | str:
        """OffsetFetch v1: (error code, committed offset or -1)."""
        body = _str(group) + struct.pack(">i", 1) + _str(topic) + struct.pack(">ii", 1, partition)
        r = self._call(OFFSET_FETCH, 1, body)
        if isinstance(r, str):
            return r
        r.take(">i")
        r.string()
        r.take(">i")
        r.take(">i")
        offset = r.take(">q")
        r.string()
        return r.take(">h"), offset

    def coordinator(self, group: str) -> int | str:
        """FindCoordinator v0: the coordinator's node id (-1 with an error code)."""
        r = self._call(FIND_COORDINATOR, 0, _str(group))
        if isinstance(r, str):
            return r
        error, node = r.take(">h"), r.take(">i")
        return node if error == 0 else -1

    def metadata(self, topics: list[str] | None = None) -> Metadata | str:
        if topics is None:
            body = struct.pack(">i", -1)
        else:
            body = struct.pack(">i", len(topics)) + b"".join(_str(t) for t in topics)
        r = self._call(METADATA, 1, body)
        if isinstance(r, str):
            return r
        brokers = {}
        for _ in range(r.take(">i")):
            node = r.take(">i")
            host = r.string() or ""
            port = r.take(">i")
            r.string()
            brokers[node] = (host, port)
        controller = r.take(">i")
        topics_out: dict[str, dict[int, PartitionInfo]] = {}
        errors: dict[str, int] = {}
        for _ in range(r.take(">i")):
            err = r.take(">h")
            name = r.string() or ""
            r.take(">b")
            parts = {}
            for _ in range(r.take(">i")):
                perr = r.take(">h")
                pid = r.take(">i")
                leader = r.take(">i")
                replicas = [r.take(">i") for _ in range(r.take(">i"))]
                isr = [r.take(">i") for _ in range(r.take(">i"))]
                parts[pid] = PartitionInfo(leader, replicas, isr, perr)
            topics_out[name] = parts
            errors[name] = err
        return Metadata(brokers, controller, topics_out, errors)

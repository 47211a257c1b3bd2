"""Ports for the servers the tests start (brokers, etcd, Kafka, replication listeners).

`free_port` hands out a port below the kernel's ephemeral range: a port picked there is
free when picked, but any outgoing connection (a broker's to etcd, etcd's gateway to
itself, a client's) may take it as its local port before the server binds it, and the
server then fails with "Address already in use" (seen: a 3-broker cluster's broker 1,
one run in many). Below the range only a listener can hold it, and this process never
hands one out twice.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10_000
_given: set[tuple[str, int]] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now and no outgoing connection will
    take (below the ephemeral range when the kernel leaves room there)."""
    high = _ephemeral_low()
    for _ in range(200 if high - LOWEST > 1000 else 0):
        port = random.randrange(LOWEST, high)
        if (host, port) in _given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add((host, port))
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room: the kernel's
        s.bind((host, 0))
        return int(s.getsockname()[1])

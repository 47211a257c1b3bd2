"""Checks a broker makes before it touches its data dir.

Owns `check_addresses_free`: every address the broker will listen on (its Kafka listeners
and the replication port) is bound once and released, so that an address in use is one
line and an untouched disk instead of a data dir created, a node key made and a broker
started only to stop again. The listeners themselves are opened later by the server (a
port taken in between still fails cleanly there). Imports the standard library and
broker.config / broker.security.settings only.
"""

from __future__ import annotations

import contextlib
import socket

from broker.config import BrokerConfig


class AddressInUse(OSError):
    """A listener's address cannot be bound (in use, not local, or not allowed)."""


def listen_addresses(config: BrokerConfig) -> list[tuple[str, int]]:
    """(host, port) of every listener and of the replication port; "" means every interface."""
    from broker.security.settings import SecuritySettings

    settings = SecuritySettings.parse(
        config.security_props,
        (config.listen_host, config.listen_port),
        (config.advertised_host, config.advertised_port),
    )
    out = [(lst.host, lst.port) for lst in settings.listeners]
    if config.replication_listen is not None:
        out.append(config.replication_listen)
    return out


def check_addresses_free(config: BrokerConfig) -> None:
    """AddressInUse naming the first address that cannot be bound; port 0 always can."""
    for host, port in listen_addresses(config):
        if port == 0:
            continue
        try:
            infos = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as exc:
            raise AddressInUse(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        for family, type_, proto, _, addr in infos:
            with contextlib.closing(socket.socket(family, type_, proto)) as s:
                # As the server binds (trio sets SO_REUSEADDR): a port in TIME_WAIT is free.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.bind(addr)
                except OSError as exc:
                    raise AddressInUse(
                        f"cannot listen on {host or '*'}:{port}: {exc.strerror}"
                    ) from None

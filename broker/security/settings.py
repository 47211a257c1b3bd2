"""Security settings, read from the Kafka-style properties the broker was given.

Owns `SecuritySettings.parse`: listeners and advertised listeners with their security
protocols, TLS files per listener, enabled SASL mechanisms, super users, the per-topic
and per-group authorization rules, connection limits, timeouts and byte quotas. The names are Kafka's
where Kafka has one (`listeners`, `ssl.keystore.location`, `max.connections.per.ip`,
`connections.max.idle.ms`, ...); `hyperkafka.*` where it has none. Unknown names fail
here, at start, never at the first connection. Imports the standard library,
`broker.config` (ConfigError) and sibling modules without I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker.config import ConfigError
from broker.security.authz import Rule, RuleError, parse_rule
from broker.security.sasl import SUPPORTED as SASL_SUPPORTED


class Protocol(enum.StrEnum):
    PLAINTEXT = "PLAINTEXT"
    SSL = "SSL"
    SASL_PLAINTEXT = "SASL_PLAINTEXT"
    SASL_SSL = "SASL_SSL"

    @property
    def tls(self) -> bool:
        return self in (Protocol.SSL, Protocol.SASL_SSL)

    @property
    def sasl(self) -> bool:
        return self in (Protocol.SASL_PLAINTEXT, Protocol.SASL_SSL)


class ClientAuth(enum.StrEnum):
    NONE = "none"
    REQUESTED = "requested"
    REQUIRED = "required"


@dataclass(frozen=True)
class TlsSettings:
    keystore: Path  # PEM: the certificate chain and the private key (ssl.keystore.type=PEM)
    key_password: str | None
    truststore: Path | None  # PEM CA certificates that sign client certificates
    client_auth: ClientAuth


@dataclass
class Listener:
    """One listening socket. `advertised_port` is fixed up by the server when port was 0."""

    name: str
    protocol: Protocol
    host: str
    port: int
    advertised_host: str
    advertised_port: int
    tls: TlsSettings | None = None
    sasl_mechanisms: tuple[str, ...] = ()

    @property
    def advertised(self) -> tuple[str, int]:
        return self.advertised_host, self.advertised_port or self.port

    def __str__(self) -> str:
        return f"{self.name}://{self.host}:{self.port}"


@dataclass(frozen=True)
class Quotas:
    """Bytes per second per principal; None is unlimited."""

    producer_default: float | None = None
    consumer_default: float | None = None
    producer: Mapping[str, float] = field(default_factory=dict)
    consumer: Mapping[str, float] = field(default_factory=dict)

    def producer_rate(self, principal: str) -> float | None:
        return self.producer.get(principal, self.producer_default)

    def consumer_rate(self, principal: str) -> float | None:
        return self.consumer.get(principal, self.consumer_default)


@dataclass
class SecuritySettings:
    listeners: list[Listener]
    secured: bool  # any authenticated listener, rule or super user: anonymous may only read
    super_users: frozenset[str] = frozenset()
    rules: tuple[Rule, ...] = ()
    max_connections_per_ip: int = 2**31 - 1
    max_connections_per_ip_overrides: Mapping[str, int] = field(default_factory=dict)
    idle_ms: int = 600_000  # connections.max.idle.ms, Kafka's default
    request_timeout_ms: int = 30_000  # a started request (or TLS/SASL handshake) must finish in this
    reauth_ms: int = 0  # connections.max.reauth.ms: 0 = sessions never expire (Kafka's default)
    max_in_flight: int = 16  # requests read ahead of their responses, per connection
    quotas: Quotas = field(default_factory=Quotas)

    @classmethod
    def parse(
        cls,
        props: Mapping[str, str],
        listen: tuple[str, int] = ("127.0.0.1", 9092),
        advertised: tuple[str | None, int | None] = (None, None),
    ) -> SecuritySettings:
        """Settings from properties; without `listeners`, one PLAINTEXT listener on `listen`."""
        protocol_map = _protocol_map(props.get("listener.security.protocol.map"))
        if "listeners" in props:
            endpoints = _endpoints(props["listeners"], "listeners")
        else:
            endpoints = {"PLAINTEXT": listen}
            if advertised[0] is not None or advertised[1] is not None:
                host = advertised[0] or listen[0]
                props = {**props, "advertised.listeners": f"PLAINTEXT://{_bracket(host)}:{advertised[1] or listen[1]}"}
        adv = _endpoints(props["advertised.listeners"], "advertised.listeners") if props.get("advertised.listeners") else {}
        for name in adv:
            if name not in endpoints:
                raise ConfigError(f"advertised.listeners names {name}, which is not in listeners")
        listeners = []
        for name, (host, port) in endpoints.items():
            try:
                protocol = Protocol(protocol_map.get(name, name))
            except ValueError:
                raise ConfigError(f"listener {name}: unknown security protocol (set listener.security.protocol.map)") from None
            ahost, aport = adv.get(name, (host, port))
            if ahost in ("", "0.0.0.0", "::"):
                ahost = "127.0.0.1"
            listener = Listener(name, protocol, host, port, ahost, aport if name in adv else 0)
            if protocol.tls:
                listener.tls = _tls(props, name)
            if protocol.sasl:
                mechs = _per_listener(props, name, "sasl.enabled.mechanisms") or ",".join(SASL_SUPPORTED)
                listener.sasl_mechanisms = tuple(m.strip().upper() for m in mechs.split(",") if m.strip())
                for m in listener.sasl_mechanisms:
                    if m not in SASL_SUPPORTED:
                        raise ConfigError(f"listener {name}: SASL mechanism {m} is not supported (only {', '.join(SASL_SUPPORTED)})")
            listeners.append(listener)
        ports = [(lst.host, lst.port) for lst in listeners if lst.port]
        if len(set(ports)) != len(ports):
            raise ConfigError("two listeners on the same host and port")

        settings = cls(listeners, secured=any(lst.protocol is not Protocol.PLAINTEXT for lst in listeners))
        rules = []
        producer: dict[str, float] = {}
        consumer: dict[str, float] = {}
        for key, value in props.items():
            try:
                if key == "super.users":
                    # Kafka separates super users with ";" (a DN may contain commas).
                    settings.super_users = frozenset(p.strip() for p in value.split(";") if p.strip())
                elif key.startswith("hyperkafka.acl."):
                    rules.append(parse_rule(key[len("hyperkafka.acl.") :], value))
                elif key == "max.connections.per.ip":
                    settings.max_connections_per_ip = _positive(value)
                elif key == "max.connections.per.ip.overrides":
                    settings.max_connections_per_ip_overrides = {
                        h.strip(): int(n) for h, _, n in (item.rpartition(":") for item in value.split(",") if item.strip())
                    }
                elif key == "connections.max.idle.ms":
                    settings.idle_ms = _positive(value)
                elif key == "connections.max.reauth.ms":
                    settings.reauth_ms = int(value)
                    if settings.reauth_ms < 0:
                        raise ValueError
                elif key == "hyperkafka.request.timeout.ms":
                    settings.request_timeout_ms = _positive(value)
                elif key == "hyperkafka.max.in.flight.requests.per.connection":
                    settings.max_in_flight = _positive(value)
                elif key == "hyperkafka.quota.producer.byte.rate":
                    settings.quotas = _replace_quota(settings.quotas, producer_default=_rate(value))
                elif key == "hyperkafka.quota.consumer.byte.rate":
                    settings.quotas = _replace_quota(settings.quotas, consumer_default=_rate(value))
                elif key.startswith("hyperkafka.quota.producer.byte.rate."):
                    producer[key.rsplit(".rate.", 1)[1]] = _rate(value)
                elif key.startswith("hyperkafka.quota.consumer.byte.rate."):
                    consumer[key.rsplit(".rate.", 1)[1]] = _rate(value)
            except ConfigError:
                raise
            except RuleError as exc:
                raise ConfigError(str(exc)) from None
            except (ValueError, KeyError):
                raise ConfigError(f"bad value for {key}: {value!r}") from None
        settings.rules = tuple(rules)
        settings.quotas = _replace_quota(settings.quotas, producer=producer, consumer=consumer)
        if settings.rules or settings.super_users:
            settings.secured = True
        return settings


def _replace_quota(q: Quotas, **changes: object) -> Quotas:
    import dataclasses

    return dataclasses.replace(q, **changes)  # type: ignore[arg-type]


def _positive(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(value)
    return n


def _rate(value: str) -> float:
    n = float(value)
    if n <= 0:
        raise ValueError(value)
    return n


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _protocol_map(text: str | None) -> dict[str, str]:
    out = {p.value: p.value for p in Protocol}
    if text:
        for item in text.split(","):
            name, sep, protocol = item.strip().partition(":")
            if not sep:
                raise ConfigError(f"listener.security.protocol.map: expected NAME:PROTOCOL, got {item!r}")
            out[name.strip().upper()] = protocol.strip().upper()
    return out


def _endpoints(text: str, key: str) -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, rest = item.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or not colon or not port.isdigit() or not name:
            raise ConfigError(f"{key}: expected NAME://HOST:PORT, got {item!r}")
        name = name.upper()
        if name in out:
            raise ConfigError(f"{key}: listener {name} named twice")
        out[name] = (host.strip("[]"), int(port))
    if not out:
        raise ConfigError(f"{key}: no listener given")
    return out


def _per_listener(props: Mapping[str, str], name: str, key: str) -> str | None:
    return props.get(f"listener.name.{name.lower()}.{key}", props.get(key))


def _tls(props: Mapping[str, str], name: str) -> TlsSettings:
    keystore = _per_listener(props, name, "ssl.keystore.location")
    if not keystore:
        raise ConfigError(f"listener {name} uses TLS: set ssl.keystore.location (a PEM file with the certificate chain and key)")
    for key in ("ssl.keystore.type", "ssl.truststore.type"):
        kind = _per_listener(props, name, key)
        if kind is not None and kind.upper() != "PEM":
            raise ConfigError(f"{key}={kind}: only PEM files are read")
    truststore = _per_listener(props, name, "ssl.truststore.location")
    auth_text = (_per_listener(props, name, "ssl.client.auth") or "none").lower()
    try:
        client_auth = ClientAuth(auth_text)
    except ValueError:
        raise ConfigError(f"ssl.client.auth={auth_text}: expected none, requested or required") from None
    if client_auth is not ClientAuth.NONE and not truststore:
        raise ConfigError(f"listener {name}: ssl.client.auth={auth_text} needs ssl.truststore.location")
    return TlsSettings(Path(keystore), _per_listener(props, name, "ssl.key.password"), Path(truststore) if truststore else None, client_auth)


SECURITY_KEYS = frozenset(
    {
        "listener.security.protocol.map",
        "sasl.enabled.mechanisms",
        "super.users",
        "max.connections.per.ip",
        "max.connections.per.ip.overrides",
        "connections.max.idle.ms",
        "connections.max.reauth.ms",
        "ssl.keystore.location",
        "ssl.keystore.type",
        "ssl.key.password",
        "ssl.truststore.location",
        "ssl.truststore.type",
        "ssl.client.auth",
        "hyperkafka.request.timeout.ms",
        "hyperkafka.max.in.flight.requests.per.connection",
        "hyperkafka.quota.producer.byte.rate",
        "hyperkafka.quota.consumer.byte.rate",
    }
)
SECURITY_PREFIXES = ("listener.name.", "hyperkafka.acl.", "hyperkafka.quota.producer.byte.rate.", "hyperkafka.quota.consumer.byte.rate.")


def is_security_key(key: str) -> bool:
    return key in SECURITY_KEYS or key.startswith(SECURITY_PREFIXES)

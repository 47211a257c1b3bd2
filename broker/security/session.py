"""The broker-wide security state and each connection's session.

Owns `Security` (settings, the credential store, the authorizer, the connection limiter,
byte quotas and TLS contexts, built once at start) and `Session` (one connection: its
listener, principal, SASL exchange and re-authentication deadline, and the time it is
muted for after a throttled response), plus `authorize` (and `authorize_group`), the one
call a handler makes to ask whether the connection's principal may do something to a
topic (or a consumer group). A connection on a SASL listener that sends anything but
ApiVersions, SaslHandshake or SaslAuthenticate before it has authenticated (or after its
session expired, KIP-368) is closed, as Kafka closes it. Imports trio, the standard library, `broker.config`, `broker.protocol.errors`
and sibling modules; never `broker.server` or `broker.node`.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, Any

import trio

from broker.protocol.errors import ProtocolError
from broker.security.authz import (
    ANONYMOUS,
    OPEN_CLUSTER_OPERATIONS,
    Authorizer,
    Operation,
    Resource,
)
from broker.security.limits import ByteRateQuota, ConnectionLimiter
from broker.security.sasl import SaslServer
from broker.security.settings import Listener, SecuritySettings
from broker.security.tls import server_context
from broker.security.users import UserStore

if TYPE_CHECKING:
    from broker.api import RequestContext
    from broker.config import BrokerConfig

log = logging.getLogger("hyperkafka.security")

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
_BEFORE_AUTH = frozenset({API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE})


class AuthenticationRequired(ProtocolError):
    """A request other than ApiVersions/SASL before authentication: close, as Kafka does."""


class Security:
    def __init__(self, config: BrokerConfig) -> None:
        self.settings = SecuritySettings.parse(
            config.security_props,
            (config.listen_host, config.listen_port),
            (config.advertised_host, config.advertised_port),
        )
        s = self.settings
        self.users = UserStore.in_data_dir(config.data_dir)
        self.authorizer = Authorizer(s.rules, s.super_users, secured=s.secured)
        self.limiter = ConnectionLimiter(config.max_connections, s.max_connections_per_ip, s.max_connections_per_ip_overrides)
        self.produce_quota = ByteRateQuota()
        self.fetch_quota = ByteRateQuota()
        # Built now so a missing or wrong key file stops the broker at start.
        self.tls: dict[str, ssl.SSLContext] = {
            lst.name: server_context(lst.tls) for lst in s.listeners if lst.tls is not None
        }

    @property
    def listeners(self) -> list[Listener]:
        return self.settings.listeners


class Session:
    def __init__(self, security: Security, listener: Listener, peer: str) -> None:
        self.security = security
        self.listener = listener
        self.peer = peer
        self.principal = ANONYMOUS
        self.authenticated = not listener.protocol.sasl
        self.sasl: SaslServer | None = None
        self.raw_sasl = False  # SaslHandshake v0: the next frames are bare SASL tokens
        self.close_after_reply = False
        self.expires_at: float | None = None  # trio clock; set when re-authentication is on
        self.mute_until = 0.0
        # The stream is a plain TCP socket: Fetch may answer with file ranges (sendfile).
        self.sendfile = False

    # -- the gate in front of every request

    def admit(self, api_key: int) -> None:
        if api_key in _BEFORE_AUTH:
            return
        if not self.authenticated:
            raise AuthenticationRequired(f"api {api_key} before SASL authentication on listener {self.listener.name}")
        if self.expires_at is not None and trio.current_time() > self.expires_at:
            raise AuthenticationRequired(f"SASL session of {self.principal} expired (connections.max.reauth.ms)")

    # -- SASL

    def start_sasl(self, mechanism: str, raw: bool) -> None:
        self.sasl = SaslServer(mechanism, self.security.users.lookup)
        self.raw_sasl = raw

    async def sasl_step(self, token: bytes) -> bytes:
        """One client token through the exchange; SaslFailed propagates (the caller answers or closes)."""
        sasl = self.sasl
        assert sasl is not None
        try:
            # PLAIN recomputes a PBKDF2 key: keep it off the event loop.
            reply = await trio.to_thread.run_sync(sasl.step, token)
        except Exception:
            self.sasl, self.raw_sasl = None, False
            raise
        if sasl.complete:
            self._authenticated(sasl.principal, sasl.mechanism)
        return reply

    def _authenticated(self, principal: str, mechanism: str) -> None:
        from broker.security.sasl import SaslFailed

        self.sasl, self.raw_sasl = None, False
        if self.authenticated and self.principal != principal:
            raise SaslFailed("Cannot change principals during re-authentication")
        first = not self.authenticated
        self.principal, self.authenticated = principal, True
        reauth = self.security.settings.reauth_ms
        self.expires_at = trio.current_time() + reauth / 1000 if reauth else None
        log.log(logging.INFO if first else logging.DEBUG, "%s authenticated as %s with %s on %s", self.peer, principal, mechanism, self.listener.name)

    @property
    def session_lifetime_ms(self) -> int:
        return self.security.settings.reauth_ms

    def tls_principal(self, cert: dict[str, Any] | None) -> None:
        from broker.security.tls import principal_from_cert

        name = principal_from_cert(cert)
        if name is not None and not self.listener.protocol.sasl:
            self.principal = name

    # -- quotas (KIP-219: answer with the throttle time, then mute the connection)

    def throttle_produce(self, nbytes: int) -> int:
        rate = self.security.settings.quotas.producer_rate(self.principal)
        if rate is None:
            return 0
        return self._mute(self.security.produce_quota.record(self.principal, nbytes, rate, trio.current_time()))

    def throttle_fetch(self, nbytes: int) -> tuple[int, bool]:
        """(throttle ms, whether to send the data) for a fetch answer of nbytes.

        A principal already over its quota gets an empty answer and the remaining throttle
        time, and the bytes are not counted (Kafka's throttled fetch). Otherwise the data
        goes out, however large (so a fetch above the burst still makes progress, as
        Kafka's cap of a fetch at the quota window does), and its excess is the throttle.
        """
        rate = self.security.settings.quotas.consumer_rate(self.principal)
        if rate is None:
            return 0, True
        quota = self.security.fetch_quota
        now = trio.current_time()
        already = quota.excess(self.principal, now)
        if already > 0:
            return self._mute(already), False
        return self._mute(quota.record(self.principal, nbytes, rate, now)), True

    def _mute(self, seconds: float) -> int:
        if seconds <= 0:
            return 0
        self.mute_until = max(self.mute_until, trio.current_time() + seconds)
        return max(1, round(seconds * 1000))


def authorize(ctx: RequestContext, operation: Operation, topic: str, *, resource: Resource = Resource.TOPIC, quiet: bool = False) -> bool:
    """May the principal of this request's connection do `operation` to `topic` (or, with
    `resource=Resource.GROUP`, to that group)? Denials are logged; `quiet` ones (a
    listing that leaves out what the principal may not see) only at debug level."""
    session: Session | None = getattr(ctx, "session", None)
    if session is None:
        return True  # called outside a server (unit tests of handlers): no connection, no principal
    if session.security.authorizer.allowed(session.principal, operation, topic, resource):
        return True
    log.log(
        logging.DEBUG if quiet else logging.WARNING,
        "denied %s on %s %r to %s (%s, listener %s)",
        operation.value, resource.value, topic, session.principal, session.peer, session.listener.name,
    )
    return False


def authorize_group(ctx: RequestContext, operation: Operation, group: str, *, quiet: bool = False) -> bool:
    return authorize(ctx, operation, group, resource=Resource.GROUP, quiet=quiet)


def cluster_operations(ctx: RequestContext) -> int:
    """Kafka's authorized_operations bits on the cluster: all of them on an open node (or
    without a session); else DESCRIBE (Metadata and DescribeCluster are open to all), with
    IDEMPOTENT_WRITE for a principal that may write somewhere, and all for a super user."""
    session: Session | None = getattr(ctx, "session", None)
    authorizer = None if session is None else session.security.authorizer
    if session is None or authorizer is None or not authorizer.secured:
        return OPEN_CLUSTER_OPERATIONS
    if session.principal in authorizer.super_users and session.principal != ANONYMOUS:
        return OPEN_CLUSTER_OPERATIONS
    bits = 1 << 8  # DESCRIBE
    if authorizer.may_write_somewhere(session.principal):
        bits |= 1 << 12  # IDEMPOTENT_WRITE
    return bits


def authorized_operations(ctx: RequestContext, name: str, resource: Resource) -> int | None:
    """Kafka's authorized_operations bits for the connection's principal; None without a session."""
    session: Session | None = getattr(ctx, "session", None)
    if session is None:
        return None
    return session.security.authorizer.operations(session.principal, name, resource)


def authorize_idempotent_write(ctx: RequestContext) -> bool:
    session: Session | None = getattr(ctx, "session", None)
    if session is None or session.security.authorizer.may_write_somewhere(session.principal):
        return True
    log.warning("denied idempotent write (InitProducerId) to %s (%s)", session.principal, session.peer)
    return False

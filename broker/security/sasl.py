"""SASL mechanisms on the server side, sans-I/O: PLAIN and SCRAM-SHA-256/512.

Owns `SaslServer` (one exchange: feed client tokens to `step`, read `complete` and
`principal`), `SaslFailed`, and the list of mechanisms this broker implements. Credentials
come from a `lookup(mechanism, username)` callable, so this module never reads files.
Imports only the standard library and `.scram`.
"""

from __future__ import annotations

from collections.abc import Callable

from broker.security.scram import MECHANISMS as SCRAM_MECHANISMS
from broker.security.scram import ScramCredential, ScramError, ScramServer

PLAIN = "PLAIN"
SUPPORTED = (PLAIN, *SCRAM_MECHANISMS)

Lookup = Callable[[str, str], ScramCredential | None]
"""(mechanism, username) -> the stored credential, or None for an unknown user.

For PLAIN the mechanism asked for is "PLAIN"; the store answers with any SCRAM
credential of that user, against which the password is checked."""


class SaslFailed(Exception):
    """Authentication failed; the text is safe to send to the client (SASL_AUTHENTICATION_FAILED)."""


class SaslServer:
    def __init__(self, mechanism: str, lookup: Lookup) -> None:
        if mechanism not in SUPPORTED:
            raise ValueError(f"unsupported SASL mechanism {mechanism!r}")
        self.mechanism = mechanism
        self._lookup = lookup
        self._scram = ScramServer(mechanism, lambda user: lookup(mechanism, user)) if mechanism in SCRAM_MECHANISMS else None
        self.complete = False
        self.username: str | None = None
        self._failed = False

    @property
    def principal(self) -> str:
        assert self.complete and self.username is not None
        return f"User:{self.username}"

    def step(self, token: bytes) -> bytes:
        """Consume one client token; return the server token (b"" when there is none)."""
        if self._failed or self.complete:
            raise SaslFailed("Unexpected SASL token: the exchange is over")
        try:
            if self._scram is not None:
                reply = self._scram.step(token)
                if self._scram.complete:
                    self.username, self.complete = self._scram.username, True
                return reply
            return self._plain(token)
        except (ScramError, SaslFailed) as exc:
            self._failed = True
            raise SaslFailed(str(exc)) from None

    def _plain(self, token: bytes) -> bytes:
        # RFC 4616: [authzid] NUL authcid NUL passwd.
        parts = token.split(b"\x00")
        if len(parts) != 3:
            raise SaslFailed("Invalid SASL/PLAIN response: expected 3 tokens")
        try:
            authzid, user, password = (p.decode("utf-8") for p in parts)
        except UnicodeDecodeError:
            raise SaslFailed("Invalid SASL/PLAIN response: not UTF-8") from None
        if not user or not password:
            raise SaslFailed("Authentication failed: username or password is empty")
        if authzid and authzid != user:
            raise SaslFailed("Authentication failed: Client requested an authorization id that is different from username")
        credential = self._lookup(PLAIN, user)
        if credential is None or not credential.check_password(password):
            raise SaslFailed("Authentication failed: Invalid username or password")
        self.username, self.complete = user, True
        return b""

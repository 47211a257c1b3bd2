"""SCRAM (RFC 5802, RFC 7677) for the server side, sans-I/O.

Owns the salted credential (`ScramCredential`: salt, iterations, StoredKey, ServerKey;
never the password) and `ScramServer`, the two-step exchange Kafka's ScramSaslServer
runs: client-first -> server-first, client-final -> server-final. Imports only the
standard library.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

MECHANISMS = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
MIN_ITERATIONS = 4096  # Kafka's minimum (ScramMechanism.minIterations)
MAX_ITERATIONS = 16384  # and its maximum: a client may not make us burn CPU


class ScramError(Exception):
    """The exchange failed; `message` is what the client may be told."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ScramError("Invalid SCRAM message: bad base64") from None


@dataclass(frozen=True)
class ScramCredential:
    mechanism: str
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def to_json(self) -> dict[str, object]:
        return {
            "salt": _b64(self.salt),
            "iterations": self.iterations,
            "stored_key": _b64(self.stored_key),
            "server_key": _b64(self.server_key),
        }

    @classmethod
    def from_json(cls, mechanism: str, data: dict[str, object]) -> ScramCredential:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown SCRAM mechanism {mechanism!r}")
        return cls(
            mechanism,
            _unb64(str(data["salt"])),
            int(str(data["iterations"])),
            _unb64(str(data["stored_key"])),
            _unb64(str(data["server_key"])),
        )

    def check_password(self, password: str) -> bool:
        """PLAIN against a SCRAM credential: recompute StoredKey and compare in constant time."""
        other = make_credential(self.mechanism, password, self.iterations, self.salt)
        return hmac.compare_digest(other.stored_key, self.stored_key)


def _digest(mechanism: str) -> str:
    return MECHANISMS[mechanism]


def salted_password(mechanism: str, password: str, salt: bytes, iterations: int) -> bytes:
    # SASLprep is not applied: Kafka's ScramFormatter normalises nothing either.
    return hashlib.pbkdf2_hmac(_digest(mechanism), password.encode("utf-8"), salt, iterations)


def make_credential(mechanism: str, password: str, iterations: int = MIN_ITERATIONS, salt: bytes | None = None) -> ScramCredential:
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
    digest = _digest(mechanism)
    salt = secrets.token_bytes(32) if salt is None else salt
    salted = salted_password(mechanism, password, salt, iterations)
    client_key = hmac.digest(salted, b"Client Key", digest)
    stored_key = hashlib.new(digest, client_key).digest()
    server_key = hmac.digest(salted, b"Server Key", digest)
    return ScramCredential(mechanism, salt, iterations, stored_key, server_key)


def _unescape_name(name: str) -> str:
    # RFC 5802 saslname: "=2C" is ",", "=3D" is "=", any other "=" is malformed.
    if "=" in name.replace("=2C", "").replace("=3D", ""):
        raise ScramError("Invalid SCRAM message: bad username escape")
    return name.replace("=2C", ",").replace("=3D", "=")


def _attributes(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError(f"Invalid SCRAM message: bad attribute {part[:20]!r}")
        out.append((part[0], part[2:]))
    return out


class ScramServer:
    """One SCRAM exchange. Feed each client message to `step`; it returns the reply.

    `lookup(username)` returns that user's credential for this mechanism or None.
    After the second step `complete` is True and `username` is the authenticated name.
    Any failure raises `ScramError` and the exchange is over.
    """

    def __init__(self, mechanism: str, lookup: Callable[[str], ScramCredential | None], nonce: str | None = None) -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown SCRAM mechanism {mechanism!r}")
        self.mechanism = mechanism
        self._lookup = lookup
        self._server_nonce = nonce if nonce is not None else secrets.token_urlsafe(24)
        self._state = "first"
        self._credential: ScramCredential | None = None
        self._client_first_bare = ""
        self._server_first = ""
        self._gs2_header = ""
        self._nonce = ""
        self.username: str | None = None
        self.complete = False

    def step(self, message: bytes) -> bytes:
        try:
            text = message.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("Invalid SCRAM message: not UTF-8") from None
        if self._state == "first":
            self._state = "failed"
            reply = self._client_first(text)
            self._state = "final"
            return reply
        if self._state == "final":
            self._state = "failed"
            reply = self._client_final(text)
            self._state = "done"
            self.complete = True
            return reply
        raise ScramError("Invalid SCRAM state: the exchange is over")

    def _client_first(self, text: str) -> bytes:
        # gs2-header: "n,," or "y,," (no channel binding), optionally "n,a=authzid,".
        parts = text.split(",", 2)
        if len(parts) != 3:
            raise ScramError("Invalid SCRAM client-first message")
        cb, authzid, bare = parts
        if cb not in ("n", "y"):
            raise ScramError("Channel binding is not supported")
        if authzid and not authzid.startswith("a="):
            raise ScramError("Invalid SCRAM client-first message: bad authzid")
        attrs = _attributes(bare)
        if len(attrs) < 2 or attrs[0][0] != "n" or attrs[1][0] != "r" or not attrs[1][1]:
            raise ScramError("Invalid SCRAM client-first message")
        if any(k == "m" for k, _ in attrs):
            raise ScramError("Mandatory SCRAM extensions are not supported")
        username = _unescape_name(attrs[0][1])
        if authzid and _unescape_name(authzid[2:]) != username:
            raise ScramError("Authentication failed: authorization id must equal the username")
        # Kafka's extensions after r= are key=value pairs too; tokenauth would mean a
        # delegation token, which this broker does not issue.
        for key, value in attrs[2:]:
            if key == "t" or (key == "tokenauth" and value == "true"):
                raise ScramError("Delegation tokens are not supported")
        credential = self._lookup(username)
        if credential is None:
            raise ScramError("Authentication failed during authentication due to invalid credentials with SASL mechanism " + self.mechanism)
        self.username = username
        self._credential = credential
        self._gs2_header = f"{cb},{authzid},"
        self._client_first_bare = bare
        self._nonce = attrs[1][1] + self._server_nonce
        self._server_first = f"r={self._nonce},s={_b64(credential.salt)},i={credential.iterations}"
        return self._server_first.encode()

    def _client_final(self, text: str) -> bytes:
        assert self._credential is not None
        head, sep, proof_text = text.rpartition(",p=")
        if not sep:
            raise ScramError("Invalid SCRAM client-final message: no proof")
        attrs = _attributes(head)
        if len(attrs) < 2 or attrs[0][0] != "c" or attrs[1][0] != "r":
            raise ScramError("Invalid SCRAM client-final message")
        if _unb64(attrs[0][1]) != self._gs2_header.encode():
            raise ScramError("Invalid SCRAM client-final message: channel binding does not match")
        # Kafka's ScramSaslServer accepts a nonce that ends with the combined nonce, and
        # librdkafka relies on it: it sends its client nonce in front of the combined one.
        # The proof signs the message as sent, so this loosens nothing that is checked.
        if not attrs[1][1].endswith(self._nonce):
            raise ScramError("Invalid SCRAM client-final message: nonce does not match")
        digest = _digest(self.mechanism)
        auth_message = f"{self._client_first_bare},{self._server_first},{head}".encode()
        proof = _unb64(proof_text)
        signature = hmac.digest(self._credential.stored_key, auth_message, digest)
        if len(proof) != len(signature):
            raise ScramError("Authentication failed during authentication due to invalid credentials with SASL mechanism " + self.mechanism)
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.new(digest, client_key).digest(), self._credential.stored_key):
            raise ScramError("Authentication failed during authentication due to invalid credentials with SASL mechanism " + self.mechanism)
        server_signature = hmac.digest(self._credential.server_key, auth_message, digest)
        return f"v={_b64(server_signature)}".encode()


class ScramClient:
    """The client side, for tests and tools: `first()`, then `final(server_first)`, then `verify(server_final)`."""

    def __init__(self, mechanism: str, username: str, password: str, nonce: str | None = None) -> None:
        self.mechanism = mechanism
        self.username = username
        self.password = password
        self.nonce = nonce if nonce is not None else secrets.token_urlsafe(18)
        self._bare = ""
        self._auth_message = b""
        self._salted = b""

    def first(self) -> bytes:
        name = self.username.replace("=", "=3D").replace(",", "=2C")
        self._bare = f"n={name},r={self.nonce}"
        return f"n,,{self._bare}".encode()

    def final(self, server_first: bytes) -> bytes:
        attrs = dict(_attributes(server_first.decode()))
        if not attrs["r"].startswith(self.nonce):
            raise ScramError("server nonce does not extend ours")
        digest = _digest(self.mechanism)
        self._salted = salted_password(self.mechanism, self.password, _unb64(attrs["s"]), int(attrs["i"]))
        without_proof = f"c={_b64(b'n,,')},r={attrs['r']}"
        self._auth_message = f"{self._bare},{server_first.decode()},{without_proof}".encode()
        client_key = hmac.digest(self._salted, b"Client Key", digest)
        stored_key = hashlib.new(digest, client_key).digest()
        signature = hmac.digest(stored_key, self._auth_message, digest)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        return f"{without_proof},p={_b64(proof)}".encode()

    def verify(self, server_final: bytes) -> bool:
        digest = _digest(self.mechanism)
        server_key = hmac.digest(self._salted, b"Server Key", digest)
        expected = hmac.digest(server_key, self._auth_message, digest)
        return server_final.decode() == f"v={_b64(expected)}"

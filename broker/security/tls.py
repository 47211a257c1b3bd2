"""TLS for SSL and SASL_SSL listeners: the server context and the mTLS principal.

Owns `server_context(TlsSettings)` (TLS 1.2+, the listener's PEM certificate chain and
key, client certificates none/optional/required against a PEM trust store) and
`principal_from_cert`, which names a client the way Kafka's default principal builder
does: `User:` + the subject's distinguished name in RFC 2253 order
(`User:CN=writer,O=Example`). Imports the standard library and `.settings` only.
"""

from __future__ import annotations

import ssl
from typing import Any

from broker.security.settings import ClientAuth, TlsSettings

_RDN_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "streetAddress": "STREET",
    "domainComponent": "DC",
    "userId": "UID",
}


def server_context(settings: TlsSettings) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(settings.keystore), password=settings.key_password)
    if settings.client_auth is not ClientAuth.NONE:
        assert settings.truststore is not None
        ctx.load_verify_locations(cafile=str(settings.truststore))
        ctx.verify_mode = ssl.CERT_REQUIRED if settings.client_auth is ClientAuth.REQUIRED else ssl.CERT_OPTIONAL
    return ctx


def _escape(value: str) -> str:
    # RFC 2253 section 2.4 escapes.
    out = "".join("\\" + ch if ch in ',+"\\<>;=' else ch for ch in value)
    if out.startswith((" ", "#")):
        out = "\\" + out
    if out.endswith(" ") and not out.endswith("\\ "):
        out = out[:-1] + "\\ "
    return out


def principal_from_cert(cert: dict[str, Any] | None) -> str | None:
    """`User:<RFC 2253 subject>` of a verified peer certificate, or None without one."""
    if not cert or "subject" not in cert:
        return None
    rdns = []
    # getpeercert() lists RDNs in certificate order; RFC 2253 writes them last first.
    for rdn in reversed(cert["subject"]):
        rdns.append("+".join(f"{_RDN_NAMES.get(k, k)}={_escape(v)}" for k, v in rdn))
    return "User:" + ",".join(rdns) if rdns else None

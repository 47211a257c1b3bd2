"""SaslHandshake (17) v0-1 and SaslAuthenticate (36) v0-2.

Handshake v1 is followed by SaslAuthenticate requests carrying the SASL tokens;
handshake v0 by bare length-prefixed tokens with no Kafka header, which the server
feeds to `Session.sasl_step` itself. A failed authentication is answered with
SASL_AUTHENTICATION_FAILED and the connection is then closed, as Kafka does. Importing
this module registers both APIs. Imports `broker.api`, `broker.handlers.errors` and
`.session`.
"""

from __future__ import annotations

import logging
from typing import Any

from broker.api import Reply, RequestContext, api
from broker.security.sasl import SaslFailed
from broker.security.session import Session

log = logging.getLogger("hyperkafka.security")

UNSUPPORTED_SASL_MECHANISM = 33
ILLEGAL_SASL_STATE = 34
SASL_AUTHENTICATION_FAILED = 58


def _session(ctx: RequestContext) -> Session | None:
    session: Session | None = getattr(ctx, "session", None)
    if session is None or not session.listener.protocol.sasl:
        return None
    return session


@api(17, "SaslHandshake", (0, 1))
async def sasl_handshake(ctx: RequestContext, req: Any) -> Reply:
    session = _session(ctx)
    if session is None:
        return {"error_code": ILLEGAL_SASL_STATE, "mechanisms": []}
    mechanisms = list(session.listener.sasl_mechanisms)
    reauth = session.authenticated
    if session.sasl is not None or (reauth and (session.session_lifetime_ms == 0 or ctx.api_version < 1)):
        # Re-authentication is refused unless connections.max.reauth.ms enables it (KIP-368).
        session.close_after_reply = True
        return {"error_code": ILLEGAL_SASL_STATE, "mechanisms": mechanisms}
    if req.mechanism not in mechanisms:
        session.close_after_reply = True
        log.info("%s asked for SASL mechanism %r; enabled: %s", session.peer, req.mechanism, mechanisms)
        return {"error_code": UNSUPPORTED_SASL_MECHANISM, "mechanisms": mechanisms}
    session.start_sasl(req.mechanism, raw=ctx.api_version == 0)
    return {"error_code": 0, "mechanisms": mechanisms}


@api(36, "SaslAuthenticate", (0, 2))
async def sasl_authenticate(ctx: RequestContext, req: Any) -> Reply:
    session = _session(ctx)
    if session is None or session.sasl is None or session.raw_sasl:
        if session is not None:
            session.close_after_reply = True
        return {"error_code": ILLEGAL_SASL_STATE, "error_message": "SaslAuthenticate without a SaslHandshake v1 first", "auth_bytes": b"", "session_lifetime": 0}
    mechanism = session.sasl.mechanism
    try:
        token = await session.sasl_step(bytes(req.auth_bytes))
    except SaslFailed as exc:
        session.close_after_reply = True
        log.warning("SASL %s authentication failed for %s on %s: %s", mechanism, session.peer, session.listener.name, exc)
        return {"error_code": SASL_AUTHENTICATION_FAILED, "error_message": str(exc), "auth_bytes": b"", "session_lifetime": 0}
    lifetime = session.session_lifetime_ms if session.authenticated and session.sasl is None else 0
    return {"error_code": 0, "error_message": None, "auth_bytes": token, "session_lifetime": lifetime}

"""Typed errors of the Hypercore replication wire.

Owns: the exception hierarchy raised by `storage.replication`. Two planes, as in h11:
`RemoteProtocolError` (the peer broke the protocol or failed a check: close the
connection) and `LocalProtocolError` (our caller misused the API). Standard library only.
"""

from __future__ import annotations


class ReplicationError(Exception):
    """Base of every error `storage.replication` raises on purpose."""


class RemoteProtocolError(ReplicationError):
    """The peer sent something we must not accept; the connection is unusable."""


class HandshakeError(RemoteProtocolError):
    """The Noise handshake or the secretstream id header failed."""


class FramingError(RemoteProtocolError):
    """A transport frame that cannot be decrypted or is malformed."""


class MessageError(RemoteProtocolError):
    """A protomux or hypercore/alpha message that does not decode."""


class CapabilityError(RemoteProtocolError):
    """The remote's replication capability does not prove it knows the core key."""


class VerificationError(RemoteProtocolError):
    """Data from the peer failed Merkle or signature verification."""


class LocalProtocolError(ReplicationError):
    """This side misused the API (e.g. sent before the handshake completed)."""

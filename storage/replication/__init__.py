"""Hypercore replication wire protocol (phase 1 of issue 6).

Owns: the sans-I/O codec of Hypercore 11 replication as spoken by the npm stack
(hypercore 11.39.5, @hyperswarm/secret-stream 6.9.2, protomux 3.12.1): Noise XX with
Ed25519 DH (`noise`), secret-stream framing (`secretstream`), protomux (`mux`), the
``hypercore/alpha`` messages (`messages`), the per-connection state machine carrying
one serve/follow channel per archive (`session`), archive sources and sinks
(`sources`), and a small Trio driver
(`trio_driver`, the only module that imports trio; not imported here so the codec stays
Trio-free). Never imports `broker`.
"""

from storage.replication.errors import (
    CapabilityError,
    FramingError,
    HandshakeError,
    LocalProtocolError,
    MessageError,
    RemoteProtocolError,
    ReplicationError,
    VerificationError,
)
from storage.replication.noise import Ed25519KeyPair
from storage.replication.session import (
    Connection,
    ReplicationChannel,
    ReplicationSession,
    Stats,
    capability,
)
from storage.replication.sources import (
    ArchiveSink,
    ArchiveSource,
    MemoryArchive,
    PartitionLogSource,
    SignedHead,
)

__all__ = [
    "ArchiveSink",
    "ArchiveSource",
    "CapabilityError",
    "Connection",
    "Ed25519KeyPair",
    "FramingError",
    "HandshakeError",
    "LocalProtocolError",
    "MemoryArchive",
    "MessageError",
    "PartitionLogSource",
    "RemoteProtocolError",
    "ReplicationChannel",
    "ReplicationError",
    "ReplicationSession",
    "SignedHead",
    "Stats",
    "VerificationError",
    "capability",
]

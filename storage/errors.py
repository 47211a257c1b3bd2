"""Typed errors of the storage package. Imports nothing else from the project."""

from __future__ import annotations


class StorageError(Exception):
    """Base class: anything storage raises on purpose."""


class OffsetOutOfRange(StorageError):
    """The offset is below the log start offset or above the high watermark."""

    def __init__(self, offset: int, log_start_offset: int, high_watermark: int) -> None:
        super().__init__(
            f"offset {offset} outside [{log_start_offset}, {high_watermark}]"
        )
        self.offset = offset
        self.log_start_offset = log_start_offset
        self.high_watermark = high_watermark


class TopicExists(StorageError):
    pass


class UnknownTopic(StorageError):
    pass


class CorruptBatch(StorageError):
    """A batch is malformed (append) or its stored bytes fail authentication (read)."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message if offset is None else f"{message} (offset {offset})")
        self.offset = offset


class ArchiveDamaged(StorageError):
    """Signed history is missing or does not verify; the log is read-only below `offset`."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message if offset is None else f"{message} (first bad offset {offset})")
        self.offset = offset


class RecoveryFailed(ArchiveDamaged):
    """Recovery at open needed to write and could not (a full disk, EIO): the archive is
    read-only, serving what its signed head covers, until it is reopened. Not damage of
    the signed history: a reopen with room on the disk recovers it whole."""

    def __init__(self, message: str, offset: int | None = None, cause: OSError | None = None) -> None:
        ArchiveDamaged.__init__(self, message)
        self.offset = offset
        self.cause = cause  # the failed write (its errno tells a full disk from EIO)


class NotQuorumSigned(StorageError):
    """A quorum-signed archive's commit job got no quorum signature for its head
    (`PartitionLog.quorum_sign` raised; the cause is chained). Unlike any other failure
    of a job, the log is not poisoned: everything up to the head was written (and synced
    as the policy says) before the signature was asked, so the same head can be asked
    again by the next commit, on the same fork (docs/clusters.md)."""


class LogClosed(StorageError):
    """A read of a log that was closed or discarded: its partition was replaced (a
    replica reopened on a new fork, a topic deleted) and a request still held the old
    object. The successor, if any, serves it."""


class BlockRemoved(KeyError):
    """`PartitionLog.block` of a block the log's cleaner removed (FORMAT.md section 4a):
    its leaf is in the tree, its bytes are not held here. A KeyError, as any block not held."""

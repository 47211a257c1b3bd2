"""Signed, append-only partition archives in Hypercore 11's format.

Synchronous and Trio-free; never imports `broker` or protocol types. Layout and crash
semantics: storage/FORMAT.md. Public API: `Store`, `PartitionLog`, `FsyncPolicy`,
`LogConfig`, `TopicRecord`, `FileRange`, `CommitJob`, `hash_jobs`, `Head`; errors in `storage.errors`.
"""

from storage.catalog import TopicRecord
from storage.log import CommitJob, FileRange, FsyncPolicy, Head, LogConfig, PartitionLog, hash_jobs
from storage.store import Store

__all__ = [
    "CommitJob",
    "FileRange",
    "FsyncPolicy",
    "Head",
    "LogConfig",
    "PartitionLog",
    "Store",
    "TopicRecord",
    "hash_jobs",
]

"""The node's data directory: node seed, catalog archive, and a cache of partition logs.

Owns the directory layout of storage/FORMAT.md section 1, key derivation per partition,
and the catalog's life cycle. May import the standard library and the rest of `storage`;
never `broker`, trio or protocol types.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from storage.catalog import TopicRecord, apply_change, decode_changes, encode_change
from storage.dirlock import DirLock
from storage.errors import ArchiveDamaged, StorageError, TopicExists, UnknownTopic
from storage.fs import FileSystem, OsFileSystem
from storage.handles import HandleCache
from storage.hypercore import KeyPair, Manifest, archive_key, derive_keypair
from storage.log import FsyncPolicy, LogConfig, PartitionLog
from storage.manifest_file import read_manifest, write_manifest

log = logging.getLogger(__name__)

SEED_FILE = "node.seed"
CATALOG_DIR = "__catalog"
CATALOG_NAME = b"hyperkafka/catalog"
MIRRORS_DIR = "__mirrors"  # other nodes' archives this node mirrors (FORMAT.md section 10)
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
CLOSE_THREADS = 16  # logs closed at once at shutdown (each holds its four files meanwhile)
PREOPEN_THREADS = 8  # logs recovered at once at start (idem)


def partition_key_name(topic_id: uuid.UUID, partition: int) -> bytes:
    """The derivation name of a partition's key pair (FORMAT.md section 1): by topic id,
    so a re-created topic never reuses an archive key."""
    return b"hyperkafka/partition/" + topic_id.bytes + b"/" + str(partition).encode()


def partition_dir(data_dir: str, topic: str, partition: int) -> str:
    return os.path.join(data_dir, f"{topic}-{partition}")


def log_config_from(configs: Mapping[str, str], base: LogConfig | None = None) -> LogConfig:
    """Map Kafka topic configs onto LogConfig (unknown keys are the broker's business)."""
    b = base or LogConfig()

    def get(name: str, default: int) -> int:
        v = configs.get(name)
        return default if v is None else int(v)

    return LogConfig(
        segment_bytes=get("segment.bytes", b.segment_bytes),
        segment_ms=get("segment.ms", b.segment_ms),
        retention_ms=get("retention.ms", b.retention_ms),
        retention_bytes=get("retention.bytes", b.retention_bytes),
        flush_interval_ms=get("flush.ms", b.flush_interval_ms),
    )


def load_seed(fs: FileSystem, data_dir: str, create: bool) -> bytes:
    path = os.path.join(data_dir, SEED_FILE)
    if fs.exists(path):
        seed = fs.read_file(path)
        if len(seed) != 32:
            raise StorageError(f"{path}: node seed must be 32 bytes")
        return seed
    if not create:
        raise StorageError(f"{path}: no node seed")
    seed = secrets.token_bytes(32)
    fs.write_file_atomic(path, seed, mode=0o600)
    return seed


class Store:
    """A node's storage. Use `Store.open`."""

    def __init__(self, data_dir: str, seed: bytes, fsync: FsyncPolicy, fs: FileSystem,
                 handles: HandleCache | None = None) -> None:
        self.data_dir = data_dir
        # The budget of open partition files (None: unbounded, tests and tools); the
        # catalog stays open outside it.
        self.handles = handles
        self.fsync = fsync
        self.fs = fs
        self._seed = seed
        self._catalog_keys = derive_keypair(seed, CATALOG_NAME)
        self.node_public_key: bytes = self._catalog_keys.public_key
        self.catalog_key: bytes = archive_key(self.node_public_key)
        self._topics: dict[str, TopicRecord] = {}
        self._logs: dict[tuple[str, int], PartitionLog] = {}
        self._catalog: PartitionLog | None = None
        self._lock: DirLock | None = None

    @classmethod
    def open(cls, data_dir: str | os.PathLike[str], *, fsync: FsyncPolicy = FsyncPolicy.INTERVAL,
             fs: FileSystem | None = None, handles: HandleCache | None = None) -> Store:
        fs = fs or OsFileSystem()
        d = os.fspath(data_dir)
        fs.makedirs(d)
        # Before anything in the directory is read or written: a second broker on it
        # (DataDirLocked) must leave it exactly as it found it.
        lock = DirLock.acquire(d)
        try:
            self = cls(d, load_seed(fs, d, create=True), FsyncPolicy(fsync), fs, handles)
            self._lock = lock
            self._catalog = self._open_catalog()
            for batch in self._catalog_batches():
                for change in decode_changes(batch):
                    apply_change(self._topics, change)
            self._remove_orphans()
        except BaseException:
            lock.release()
            raise
        return self

    def _open_catalog(self) -> PartitionLog:
        # A change is applied only once its head is signed (`_append_change`), so a tail
        # never signed (a failed commit, a crash before the answer) is cut, not signed.
        return PartitionLog.open(os.path.join(self.data_dir, CATALOG_DIR), self._catalog_keys,
                                 fsync=FsyncPolicy.ALWAYS, fs=self.fs, cut_unsigned=True)

    def _writable_catalog(self) -> PartitionLog:
        """The catalog, reopened first when an earlier write failed (a full disk): the
        reopen cuts the unsigned change and finds the same signed topics."""
        cat = self._catalog
        assert cat is not None
        if cat.writable:
            return cat
        cat.close()
        self._catalog = cat = self._open_catalog()
        if not cat.writable:
            raise StorageError(f"the catalog cannot be written: {cat.damage}")
        return cat

    def _catalog_batches(self) -> Iterator[bytes]:
        cat = self._catalog
        assert cat is not None
        offset = cat.log_start_offset
        while offset < cat.high_watermark:
            r = cat.read(offset, 1 << 20)
            data = r.read()
            pos = 0
            while pos < len(data):
                size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
                yield data[pos : pos + size]
                pos += size
            offset = r.end_offset

    def _remove_orphans(self) -> None:
        """Partition directories no topic owns (a delete interrupted by a crash)."""
        for name in self.fs.listdir(self.data_dir):
            path = os.path.join(self.data_dir, name)
            if name in (CATALOG_DIR, MIRRORS_DIR) or not os.path.isdir(path):
                continue
            topic, _, part = name.rpartition("-")
            owned = (not name.endswith("-delete") and part.isdigit() and topic in self._topics
                     and int(part) < self._topics[topic].partitions)
            if not owned:
                log.warning("removing orphan partition directory %s", name)
                self._remove_dir(path)

    def _remove_dir(self, path: str) -> None:
        for n in self.fs.listdir(path):
            self.fs.unlink(os.path.join(path, n))
        os.rmdir(path)

    def _append_change(self, change: dict[str, object]) -> None:
        """Sign the change into the catalog, then apply it. When the append or commit
        fails (StorageError, OSError) nothing is applied, and the next change first
        reopens the catalog, cutting this one."""
        cat = self._writable_catalog()
        cat.append(encode_change(change, int(time.time() * 1000)))
        cat.commit()  # `always`: durable before we return
        apply_change(self._topics, change)

    # ------------------------------------------------------------------ catalog API

    def topics(self) -> Mapping[str, TopicRecord]:
        return dict(self._topics)

    def create_topic(self, name: str, partitions: int, configs: Mapping[str, str],
                     topic_id: uuid.UUID | None = None,
                     manifests: Sequence[Manifest] | None = None) -> TopicRecord:
        """Record a new topic. With `manifests` (one per partition) its partitions are
        quorum-signed: each archive key is its manifest's hash, and the manifest is
        stored in the partition directory before the catalog names it."""
        if not _TOPIC_RE.match(name) or name in (".", ".."):
            raise StorageError(f"illegal topic name {name!r}")
        if partitions < 1:
            raise StorageError("a topic needs at least one partition")
        if name in self._topics:
            raise TopicExists(name)
        tid = topic_id or uuid.uuid4()
        if tid.int == 0:
            raise StorageError("topic id must be non-zero")
        if manifests is None:
            keys = [archive_key(self._partition_keypair(tid, p).public_key) for p in range(partitions)]
        else:
            if len(manifests) != partitions:
                raise StorageError(f"{len(manifests)} manifests for {partitions} partitions")
            keys = [m.hash() for m in manifests]
            for p, m in enumerate(manifests):
                path = partition_dir(self.data_dir, name, p)
                if os.path.isdir(path) and self._prepared_with(path, m):
                    continue  # made by prepare_partitions with this very manifest
                if os.path.isdir(path):  # left by a creation that crashed: not in the catalog
                    self._remove_dir(path)
                self.fs.makedirs(path)
                write_manifest(self.fs, path, m)
        self._append_change({"op": "create", "name": name, "topic_id": tid.bytes,
                             "partitions": partitions, "configs": dict(configs), "keys": keys})
        return self._topics[name]

    def set_topic_configs(self, name: str, configs: Mapping[str, str]) -> TopicRecord:
        if name not in self._topics:
            raise UnknownTopic(name)
        self._append_change({"op": "configs", "name": name, "configs": dict(configs)})
        rec = self._topics[name]
        for (t, _p), lg in self._logs.items():
            if t == name:
                lg.set_config(log_config_from(rec.configs))
        return rec

    def prepare_more_partitions(self, name: str, count: int, config: LogConfig) -> list[PartitionLog]:
        """Any thread, CreatePartitions: make the archives that grow topic `name` to `count`
        partitions, before the catalog records them (`add_partitions`, owner thread;
        `discard_more` on failure). The caller makes sure nobody else grows `name`."""
        rec = self._topics.get(name)
        if rec is None:
            raise UnknownTopic(name)
        if count <= rec.partitions:
            raise StorageError(f"{name} has {rec.partitions} partitions already")
        logs: list[PartitionLog] = []
        try:
            for p in range(rec.partitions, count):
                path = partition_dir(self.data_dir, name, p)
                if os.path.isdir(path):  # left by a growth that crashed: not in the catalog
                    self._remove_dir(path)
                lg = PartitionLog.open(path, self._partition_keypair(rec.topic_id, p),
                                       fsync=self.fsync, config=config, fs=self.fs)
                logs.append(lg)
                if lg.damage is not None:
                    raise StorageError(f"cannot create partition {name}-{p}: {lg.damage}")
        except BaseException:
            self.discard_more(logs)
            raise
        return logs

    def discard_more(self, logs: list[PartitionLog]) -> None:
        for lg in logs:
            with contextlib.suppress(OSError, StorageError):
                lg.close()
                self._remove_dir(lg.path)

    def add_partitions(self, name: str, logs: list[PartitionLog]) -> TopicRecord:
        """Owner thread: record in the catalog the partitions `prepare_more_partitions`
        made (signed, durable before this returns) and serve them."""
        rec = self._topics[name]
        keys = [*rec.archive_keys, *(lg.key for lg in logs)]
        self._append_change({"op": "partitions", "name": name, "partitions": rec.partitions + len(logs), "keys": keys})
        for i, lg in enumerate(logs):
            if self.handles is not None:
                lg.attach_handles(self.handles)
            self._logs[(name, rec.partitions + i)] = lg
        return self._topics[name]

    def delete_topic(self, name: str) -> None:
        rec = self._topics.get(name)
        if rec is None:
            raise UnknownTopic(name)
        self._append_change({"op": "delete", "name": name, "topic_id": rec.topic_id.bytes})
        for p in range(rec.partitions):
            lg = self._logs.pop((name, p), None)
            if lg is not None:
                lg.close()
            path = partition_dir(self.data_dir, name, p)
            if os.path.isdir(path):
                doomed = f"{path}.{rec.topic_id.hex}-delete"
                self.fs.rename(path, doomed)
                self._remove_dir(doomed)

    # ------------------------------------------------------------------ partitions

    def _partition_keypair(self, topic_id: uuid.UUID, partition: int) -> KeyPair:
        return derive_keypair(self._seed, partition_key_name(topic_id, partition))

    def partition_keypair(self, topic: str, partition: int) -> KeyPair:
        rec = self._record(topic, partition)
        return self._partition_keypair(rec.topic_id, partition)

    def _record(self, topic: str, partition: int) -> TopicRecord:
        rec = self._topics.get(topic)
        if rec is None:
            raise UnknownTopic(topic)
        if not 0 <= partition < rec.partitions:
            raise UnknownTopic(f"{topic} has no partition {partition}")
        return rec

    def archive_key(self, topic: str, partition: int) -> bytes:
        return self._record(topic, partition).archive_keys[partition]

    def log(self, topic: str, partition: int, config: LogConfig | None = None) -> PartitionLog:
        """The partition's log, opened (and recovered) on first use, then cached."""
        lg = self._logs.get((topic, partition))
        if lg is not None:
            if config is not None:
                lg.set_config(config)
            return lg
        rec = self._record(topic, partition)
        lg = PartitionLog.open(
            partition_dir(self.data_dir, topic, partition),
            self._partition_keypair(rec.topic_id, partition),
            fsync=self.fsync,
            config=config or log_config_from(rec.configs),
            fs=self.fs,
        )
        if rec.archive_keys and lg.key != rec.archive_keys[partition]:
            # e.g. a `manifest` file that is not the one the catalog signed for
            lg.close()
            raise StorageError(f"{topic}-{partition}: archive key is not the catalog's")
        if self.handles is not None:
            lg.attach_handles(self.handles)
        self._logs[(topic, partition)] = lg
        return lg

    def preopen(self, wanted: list[tuple[str, int, LogConfig]]) -> int:
        """Open (recover) these partitions' logs in worker threads, each parked once open,
        so that `log()` finds them ready. A restart recovers every partition; one after
        the other, 100,000 of them took minutes, mostly waiting for directory listings
        and reads, and checking head signatures, which all release the GIL. A partition
        whose open fails here is left to `log()`, which opens it again and raises there.
        Returns how many were opened. Owner thread, before anything else uses the store."""
        todo = [(t, p, c) for t, p, c in wanted if (t, p) not in self._logs]
        if len(todo) < 2 * PREOPEN_THREADS:
            return 0

        def open_one(item: tuple[str, int, LogConfig]) -> PartitionLog | None:
            topic, partition, config = item
            try:
                rec = self._record(topic, partition)
                lg = PartitionLog.open(
                    partition_dir(self.data_dir, topic, partition),
                    self._partition_keypair(rec.topic_id, partition),
                    fsync=self.fsync, config=config, fs=self.fs,
                )
            except Exception:  # opened again by log(), which reports it
                return None
            if lg.parkable():
                lg.park()
            return lg

        opened = 0
        with ThreadPoolExecutor(PREOPEN_THREADS, thread_name_prefix="hk-recover") as pool:
            for (topic, partition, _), lg in zip(todo, pool.map(open_one, todo), strict=True):
                if lg is None:
                    continue
                if self.handles is not None:
                    lg.attach_handles(self.handles)
                self._logs[(topic, partition)] = lg
                opened += 1
        return opened

    def prepare_partitions(self, name: str, topic_id: uuid.UUID, partitions: int,
                           config: LogConfig,
                           manifests: Sequence[Manifest] | None = None) -> list[PartitionLog]:
        """Any thread: make the archives of topic `name` before the catalog records it
        (the slow part of creating a topic: a directory, files and fsyncs per partition).
        Each log is parked once made, so thousands of them hold no descriptor. Then
        `create_topic(..., topic_id)` and `adopt` on the owner thread; `discard` on
        failure. The caller makes sure nobody else creates `name` meanwhile.
        `manifests` (one per partition): quorum-signed archives, each manifest written
        into its directory before the archive is opened (pass the same to `create_topic`)."""
        if not _TOPIC_RE.match(name) or name in (".", ".."):
            raise StorageError(f"illegal topic name {name!r}")
        if name in self._topics:
            raise TopicExists(name)
        if manifests is not None and len(manifests) != partitions:
            raise StorageError(f"{len(manifests)} manifests for {partitions} partitions")
        logs: list[PartitionLog] = []
        try:
            for p in range(partitions):
                path = partition_dir(self.data_dir, name, p)
                if os.path.isdir(path):  # left by a creation that crashed: not in the catalog
                    self._remove_dir(path)
                if manifests is not None:
                    self.fs.makedirs(path)
                    write_manifest(self.fs, path, manifests[p])
                lg = PartitionLog.open(path, self._partition_keypair(topic_id, p),
                                       fsync=self.fsync, config=config, fs=self.fs)
                logs.append(lg)
                if lg.damage is not None:  # its genesis head could not be written
                    raise StorageError(f"cannot create partition {name}-{p}: {lg.damage}")
                lg.park()
        except BaseException:
            self.discard(name, logs)
            raise
        return logs

    def _prepared_with(self, path: str, manifest: Manifest) -> bool:
        try:
            return read_manifest(self.fs, path) == manifest
        except (ArchiveDamaged, OSError):
            return False

    def adopt(self, name: str, logs: list[PartitionLog]) -> None:
        """Owner thread, after `create_topic`: serve the logs `prepare_partitions` made."""
        for p, lg in enumerate(logs):
            if self.handles is not None:
                lg.attach_handles(self.handles)
            self._logs[(name, p)] = lg

    def discard(self, name: str, logs: list[PartitionLog]) -> None:
        """Close and remove prepared archives the catalog never recorded."""
        for p, lg in enumerate(logs):
            try:
                lg.close()
            except (OSError, StorageError) as exc:  # its clean head may not fit either
                log.warning("closing prepared partition %s-%d: %s", name, p, exc)
            path = partition_dir(self.data_dir, name, p)
            try:
                if os.path.isdir(path):
                    self._remove_dir(path)
            except OSError as exc:  # an orphan: removed at the next start
                log.warning("removing prepared partition %s-%d: %s", name, p, exc)

    def open_fresh_log(self, topic: str, partition: int, config: LogConfig | None = None) -> PartitionLog:
        """A second, newly recovered instance of a cached partition's log (any thread),
        for a partition a disk error took offline; `swap_log` then puts it in the cache."""
        rec = self._record(topic, partition)
        return PartitionLog.open(
            partition_dir(self.data_dir, topic, partition),
            self._partition_keypair(rec.topic_id, partition),
            fsync=self.fsync,
            config=config or log_config_from(rec.configs),
            fs=self.fs,
        )

    def swap_log(self, topic: str, partition: int, lg: PartitionLog) -> PartitionLog | None:
        """Cache `lg` as the partition's log; returns the one it replaces (the caller
        closes it once nothing reads it)."""
        self._record(topic, partition)
        old = self._logs.get((topic, partition))
        if self.handles is not None:
            lg.attach_handles(self.handles)
        self._logs[(topic, partition)] = lg
        return old

    @property
    def node_keypair(self) -> KeyPair:
        """The node key pair (the catalog's signer). A cluster broker also authenticates
        its replication connections with it (the Noise static key), so the writer knows
        whose progress it hears."""
        return self._catalog_keys

    @property
    def catalog_log(self) -> PartitionLog:
        """The catalog archive (served to mirrors; written only through this class)."""
        assert self._catalog is not None
        return self._catalog

    def open_logs(self) -> Mapping[tuple[str, int], PartitionLog]:
        return dict(self._logs)

    def close(self) -> None:
        """Commit pending data and close every file. Partition logs close in parallel:
        each close waits for a few fsyncs, which the filesystem completes together when
        they come at once (10,000 partitions took 30 s to close one after the other,
        almost all of it waiting for fdatasync)."""
        logs = list(self._logs.values())
        errors: list[BaseException] = []

        def close_one(lg: PartitionLog) -> None:
            try:
                lg.close()
            except BaseException as exc:  # close the rest, then report
                errors.append(exc)

        if len(logs) > 1:
            # worker threads reopen parked logs: none may park another meanwhile
            for lg in logs:
                lg.detach_handles()
            with ThreadPoolExecutor(CLOSE_THREADS, thread_name_prefix="hk-close") as pool:
                list(pool.map(close_one, logs))
        else:
            for lg in logs:
                close_one(lg)
        if self._catalog is not None:
            close_one(self._catalog)
        self._logs.clear()
        self._catalog = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if errors:
            raise StorageError(f"{len(errors)} logs failed to close: {errors[0]}") from errors[0]

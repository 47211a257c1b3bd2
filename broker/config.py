"""Broker and topic configuration, spelled the way Kafka spells it.

Owns: the broker's settings (`BrokerConfig`, read from a server.properties-style file
and command-line flags), the registry of topic configs with their Kafka defaults and the
broker settings they inherit from, and the mapping of a topic's effective configs onto
`storage.LogConfig`. Imports nothing from the protocol codec.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker.groups.consumer_group import ConsumerSettings
from broker.groups.state import GroupSettings
from broker.transactions.settings import TxnSettings
from storage import FsyncPolicy, LogConfig

LONG_MAX = 9223372036854775807
RACK_AWARE_SELECTOR = "org.apache.kafka.common.replica.RackAwareReplicaSelector"
LEADER_SELECTOR = "org.apache.kafka.common.replica.LeaderSelector"


class ConfigError(ValueError):
    """A config name or value that Kafka would refuse (INVALID_CONFIG)."""


class ConfigType(enum.IntEnum):
    # DescribeConfigs v3+ ConfigType codes.
    BOOLEAN = 1
    STRING = 2
    INT = 3
    SHORT = 4
    LONG = 5
    DOUBLE = 6
    LIST = 7
    CLASS = 8
    PASSWORD = 9


class ConfigSource(enum.IntEnum):
    # DescribeConfigs v1+ ConfigSource codes.
    UNKNOWN = 0
    DYNAMIC_TOPIC_CONFIG = 1
    DYNAMIC_BROKER_CONFIG = 2
    DYNAMIC_DEFAULT_BROKER_CONFIG = 3
    STATIC_BROKER_CONFIG = 4
    DEFAULT_CONFIG = 5


@dataclass(frozen=True)
class ConfigDef:
    name: str
    type: ConfigType
    default: str
    doc: str
    broker_synonym: str | None = None  # the broker setting a topic inherits this from
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    # Values outside [minimum, maximum] that are still valid (gzip's -1: zlib's default).
    also: tuple[int, ...] = ()


def _topic_configs() -> dict[str, ConfigDef]:
    L, INT, S, B, D, LS = (
        ConfigType.LONG,
        ConfigType.INT,
        ConfigType.STRING,
        ConfigType.BOOLEAN,
        ConfigType.DOUBLE,
        ConfigType.LIST,
    )
    defs = [
        ConfigDef("cleanup.policy", LS, "delete", "delete: old segments are dropped by retention; compact: superseded batches leave local storage, the signed tree stays (storage/FORMAT.md 4a); or both.", "log.cleanup.policy", ("compact", "delete")),
        ConfigDef("compression.gzip.level", INT, "-1", "Level at which the broker gzips batches of a gzip topic (-1: zlib's default).", "compression.gzip.level", minimum=1, maximum=9, also=(-1,)),
        ConfigDef("compression.lz4.level", INT, "9", "Level at which the broker compresses batches of an lz4 topic.", "compression.lz4.level", minimum=1, maximum=17),
        ConfigDef("compression.zstd.level", INT, "3", "Level at which the broker compresses batches of a zstd topic.", "compression.zstd.level", minimum=-131072, maximum=22),
        ConfigDef("compression.type", S, "producer", "producer stores batches as compressed by the producer; a codec makes the broker recompress other batches with it before signing.", "compression.type", ("uncompressed", "zstd", "lz4", "snappy", "gzip", "producer")),
        ConfigDef("delete.retention.ms", L, "86400000", "How long compaction keeps a tombstone (and the offsets archive's, in cluster mode).", "log.cleaner.delete.retention.ms", minimum=0),
        ConfigDef("file.delete.delay.ms", L, "60000", "Unused: segments are deleted at once.", "log.segment.delete.delay.ms", minimum=0),
        ConfigDef("flush.messages", L, str(LONG_MAX), "Unused: see the broker's --fsync policy.", "log.flush.interval.messages", minimum=1),
        ConfigDef("flush.ms", L, str(LONG_MAX), "Unused: see the broker's --fsync policy.", "log.flush.interval.ms", minimum=0),
        ConfigDef("follower.replication.throttled.replicas", LS, "", "Unused: no replication throttling."),
        ConfigDef("index.interval.bytes", INT, "4096", "Unused: the batch index is dense.", "log.index.interval.bytes", minimum=0),
        ConfigDef("leader.replication.throttled.replicas", LS, "", "Unused: no replication throttling."),
        ConfigDef("local.retention.bytes", L, "-2", "No tiered storage.", "log.local.retention.bytes", minimum=-2),
        ConfigDef("local.retention.ms", L, "-2", "No tiered storage.", "log.local.retention.ms", minimum=-2),
        ConfigDef("max.compaction.lag.ms", L, str(LONG_MAX), "A compacted partition whose first uncleaned batch is older than this is cleaned whatever its dirty ratio.", "log.cleaner.max.compaction.lag.ms", minimum=1),
        ConfigDef("max.message.bytes", INT, "1048588", "Largest record batch accepted, after compression.", "message.max.bytes", minimum=0),
        ConfigDef("message.timestamp.after.max.ms", L, "3600000", "How far ahead of the broker clock a CreateTime timestamp may be.", "log.message.timestamp.after.max.ms", minimum=0),
        ConfigDef("message.timestamp.before.max.ms", L, str(LONG_MAX), "How far behind the broker clock a CreateTime timestamp may be.", "log.message.timestamp.before.max.ms", minimum=0),
        ConfigDef("message.timestamp.type", S, "CreateTime", "CreateTime keeps the producer's timestamps; LogAppendTime stamps batches on append.", "log.message.timestamp.type", ("CreateTime", "LogAppendTime")),
        ConfigDef("min.cleanable.dirty.ratio", D, "0.5", "Share of uncleaned bytes at which a compacted partition is cleaned.", "log.cleaner.min.cleanable.ratio"),
        ConfigDef("min.compaction.lag.ms", L, "0", "Segments holding a batch younger than this are not compacted.", "log.cleaner.min.compaction.lag.ms", minimum=0),
        ConfigDef("min.insync.replicas", INT, "1", "Replicas that must hold a head before acks=all is answered.", "min.insync.replicas", minimum=1),
        ConfigDef("preallocate", B, "false", "Unused.", "log.preallocate"),
        ConfigDef("remote.log.copy.disable", B, "false", "No tiered storage.", None, ("false",)),
        ConfigDef("remote.log.delete.on.disable", B, "false", "No tiered storage.", None, ("false",)),
        ConfigDef("remote.storage.enable", B, "false", "No tiered storage.", None, ("false",)),
        ConfigDef("retention.bytes", L, "-1", "Size above which whole old segments are dropped; -1 keeps everything.", "log.retention.bytes"),
        ConfigDef("retention.ms", L, "604800000", "Age after which whole old segments are dropped; -1 keeps everything.", "log.retention.ms", minimum=-1),
        ConfigDef("segment.bytes", INT, "1073741824", "Size at which a new segment is started.", "log.segment.bytes", minimum=14),
        ConfigDef("segment.index.bytes", INT, "10485760", "Unused: index entries are fixed-size.", "log.index.size.max.bytes", minimum=4),
        ConfigDef("segment.jitter.ms", L, "0", "Unused.", "log.roll.jitter.ms", minimum=0),
        ConfigDef("segment.ms", L, "604800000", "Age at which a new segment is started.", "log.roll.ms", minimum=1),
        ConfigDef("unclean.leader.election.enable", B, "false", "Never: a signed archive is never rewritten.", "unclean.leader.election.enable", ("false",)),
    ]
    return {d.name: d for d in defs}


TOPIC_CONFIGS: Mapping[str, ConfigDef] = _topic_configs()


def _check_value(d: ConfigDef, value: str) -> str:
    if d.choices and d.type == ConfigType.LIST:
        items = [v.strip() for v in value.split(",")]
        if not all(items) or any(v not in d.choices for v in items):
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: each must be one of {list(d.choices)}")
        return ",".join(items)
    if d.choices and value not in d.choices:
        raise ConfigError(f"Invalid value {value} for configuration {d.name}: must be one of {list(d.choices)}")
    if d.type in (ConfigType.INT, ConfigType.LONG, ConfigType.SHORT):
        try:
            number = int(value)
        except ValueError:
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: not a number") from None
        if number not in d.also:
            if d.minimum is not None and number < d.minimum:
                raise ConfigError(f"Invalid value {value} for configuration {d.name}: must be at least {d.minimum}")
            if d.maximum is not None and number > d.maximum:
                raise ConfigError(f"Invalid value {value} for configuration {d.name}: must be at most {d.maximum}")
        if d.type == ConfigType.INT and number > 2**31 - 1:
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: out of int range")
    elif d.type == ConfigType.BOOLEAN:
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: expected true or false")
        value = value.lower()
    elif d.type == ConfigType.DOUBLE:
        try:
            number_f = float(value)
        except ValueError:
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: not a number") from None
        if d.name == "min.cleanable.dirty.ratio" and not 0 <= number_f <= 1:
            raise ConfigError(f"Invalid value {value} for configuration {d.name}: Value must be between 0 and 1")
    return value


def validate_topic_configs(configs: Mapping[str, str | None]) -> dict[str, str]:
    """Check topic config overrides as CreateTopics/AlterConfigs must; None values are dropped."""
    out: dict[str, str] = {}
    for name, value in configs.items():
        d = TOPIC_CONFIGS.get(name)
        if d is None:
            raise ConfigError(f"Unknown topic config name: {name}")
        if value is None:
            continue
        out[name] = _check_value(d, value)
    return out


@dataclass(frozen=True)
class ConfigEntry:
    name: str
    value: str
    source: ConfigSource
    type: ConfigType
    doc: str
    read_only: bool = False
    sensitive: bool = False
    synonyms: tuple[tuple[str, str, ConfigSource], ...] = ()


@dataclass
class BrokerConfig:
    """Everything `hyperkafka serve` is told, from flags and an optional properties file."""

    data_dir: Path = Path("hyperkafka-data")
    listen_host: str = "127.0.0.1"
    listen_port: int = 9092
    advertised_host: str | None = None
    advertised_port: int | None = None
    node_id: int = 0
    rack: str | None = None
    fsync: FsyncPolicy = FsyncPolicy.INTERVAL
    num_partitions: int = 1
    default_replication_factor: int = 1
    auto_create_topics: bool = True
    delete_topic_enable: bool = True
    socket_request_max_bytes: int = 100 * 1024 * 1024
    # Kafka's queued.max.request.bytes: the bytes of requests received and not yet handled,
    # all connections together (broker/memory.py). Kafka's default is -1 (no bound); ours
    # bounds it, at socket.request.max.bytes so that any accepted frame still fits.
    # <= 0: unbounded, as Kafka's -1.
    queued_max_request_bytes: int = 100 * 1024 * 1024
    # Kafka's broker-side fetch.max.bytes (55 MiB): a Fetch answer holds at most this much
    # record data whatever the client asks (a first batch larger than it still goes out).
    fetch_max_bytes: int = 55 * 1024 * 1024
    # Bytes of answers a connection may have waiting for its client to read them before
    # the broker stops reading that connection's requests (a client that pipelines
    # without reading). One answer larger than this is still sent. Produce answers are a
    # few hundred bytes, so pipelining producers never meet it; Kafka itself holds one.
    max_unsent_bytes_per_connection: int = 1024 * 1024
    max_connections: int = 10_000
    # KIP-578's max.broker.partitions: partitions this broker holds at most (each costs
    # memory for its index and producer state, and time at every restart; open files are
    # on a budget whatever the number, storage/handles.py). CreateTopics past it answers
    # POLICY_VIOLATION.
    max_broker_partitions: int = 100_000
    shutdown_grace_s: float = 10.0
    log_retention_check_ms: int = 300_000
    # Kafka's log.cleaner.enable and log.cleaner.backoff.ms: whether compacted topics are
    # cleaned, and the pause between two passes of the cleaner over them (broker/cleaner.py).
    log_cleaner_enable: bool = True
    log_cleaner_backoff_ms: int = 15_000
    # Mirrors (broker/mirror.py, broker/replication_server.py): where this node serves its
    # archives over the Hypercore protocol, and the nodes it mirrors ("HOST:PORT" of their
    # Kafka listener, optionally "@<node key hex>" to pin the key instead of trusting it
    # on first use).
    replication_listen: tuple[str, int] | None = None
    mirrors: list[str] = field(default_factory=list)
    # hyperkafka.http.listeners (broker/http.py): where /metrics is served. Off unless set:
    # Kafka itself serves no HTTP (operators add the JMX exporter on purpose), a fixed
    # default port would stop a second broker on the same host from starting, and an open
    # port is surface. A bare port (":9404") listens on loopback only.
    http_listen: tuple[str, int] | None = None
    # Cluster mode (broker/cluster/, docs/clusters.md): the etcd cluster that holds
    # membership, the controller and placement (hyperkafka.cluster.etcd.endpoints; none:
    # a single broker), the key prefix there (hyperkafka.cluster.name), and Kafka's
    # replica.lag.time.max.ms.
    cluster_etcd_endpoints: list[str] = field(default_factory=list)
    cluster_name: str = "hyperkafka"
    replica_lag_ms: int = 30_000
    # Kafka's broker.session.timeout.ms: the TTL of each broker's etcd lease; a broker
    # whose lease expires is dead (its partitions' reads move to a live mirror).
    session_timeout_ms: int = 9_000
    # hyperkafka.cluster.death.evidence.enable: a peer whose Kafka listener refuses
    # connections, after it answered in its current session, is dead (its process is
    # gone): its lease is revoked at once instead of expiring a session timeout later
    # (broker/cluster/liveness.py). False: only the lease decides.
    death_evidence: bool = True
    # KIP-392's replica.selector.class: rack-aware by default in a cluster (mirrors are
    # there to serve reads), Kafka's LeaderSelector to keep every fetch on the leader.
    replica_selector: str = RACK_AWARE_SELECTOR
    # hyperkafka.quorum.partitions.enable: a topic created in a cluster gets, per
    # partition, an archive signed by a quorum of its replicas (docs/clusters.md): it
    # takes writes while a quorum of its replicas signs, and a dead leader's partitions
    # elect a live replica. On by default (issue 17); false keeps single-signer topics,
    # whose writes wait for their one writer. A broker without etcd is not affected.
    quorum_partitions: bool = True
    # hyperkafka.quorum.unsigned.max.bytes: how many bytes a quorum-signed partition's
    # leader admits that no quorum-signed head covers yet before a produce to it waits
    # (the connection's reads with it) for its replicas to sign (Node.wait_room).
    quorum_unsigned_max_bytes: int = 64 * 1024 * 1024
    # Broker-level topic defaults (log.retention.ms, message.max.bytes, ...) by broker name.
    topic_defaults: dict[str, str] = field(default_factory=dict)
    # Every name set in the properties file, for DescribeConfigs on the broker resource.
    static: dict[str, str] = field(default_factory=dict)
    # Listener, TLS, SASL, authorization and limit settings, read by broker.security.
    security_props: dict[str, str] = field(default_factory=dict)

    @property
    def advertised(self) -> tuple[str, int]:
        host = self.advertised_host or self.listen_host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return host, self.advertised_port or self.listen_port

    def topic_default(self, d: ConfigDef) -> tuple[str, ConfigSource]:
        if d.broker_synonym and d.broker_synonym in self.topic_defaults:
            return self.topic_defaults[d.broker_synonym], ConfigSource.STATIC_BROKER_CONFIG
        return d.default, ConfigSource.DEFAULT_CONFIG

    def describe_topic(self, overrides: Mapping[str, str]) -> list[ConfigEntry]:
        """Every topic config with its effective value and where that value comes from."""
        entries = []
        for d in TOPIC_CONFIGS.values():
            default, default_source = self.topic_default(d)
            synonyms: list[tuple[str, str, ConfigSource]] = []
            if d.name in overrides:
                value, source = overrides[d.name], ConfigSource.DYNAMIC_TOPIC_CONFIG
                synonyms.append((d.name, value, source))
            else:
                value, source = default, default_source
            if d.broker_synonym and default_source == ConfigSource.STATIC_BROKER_CONFIG:
                synonyms.append((d.broker_synonym, default, default_source))
            synonyms.append((d.broker_synonym or d.name, d.default, ConfigSource.DEFAULT_CONFIG))
            entries.append(ConfigEntry(d.name, value, source, d.type, d.doc, synonyms=tuple(synonyms)))
        return entries

    def effective(self, overrides: Mapping[str, str], name: str) -> str:
        if name in overrides:
            return overrides[name]
        return self.topic_default(TOPIC_CONFIGS[name])[0]

    def log_config(self, overrides: Mapping[str, str]) -> LogConfig:
        def num(name: str) -> int:
            return int(self.effective(overrides, name))

        # cleanup.policy without delete (compact only): retention never drops a segment.
        deletes = "delete" in self.effective(overrides, "cleanup.policy").split(",")
        return LogConfig(
            segment_bytes=num("segment.bytes"),
            segment_ms=num("segment.ms"),
            retention_ms=num("retention.ms") if deletes else -1,
            retention_bytes=num("retention.bytes") if deletes else -1,
        )

    def describe_broker(self) -> list[ConfigEntry]:
        host, port = self.advertised
        values: list[tuple[str, str, ConfigType, str]] = [
            ("node.id", str(self.node_id), ConfigType.INT, "This broker's id."),
            ("broker.id", str(self.node_id), ConfigType.INT, "This broker's id."),
            ("listeners", self.security_props.get("listeners", f"PLAINTEXT://{self.listen_host}:{self.listen_port}"), ConfigType.STRING, "Where the broker listens."),
            ("advertised.listeners", self.security_props.get("advertised.listeners", f"PLAINTEXT://{host}:{port}"), ConfigType.STRING, "What clients are told to connect to."),
            ("log.dirs", str(self.data_dir), ConfigType.STRING, "The data directory."),
            ("hyperkafka.fsync", self.fsync.value, ConfigType.STRING, "always, interval or never."),
            ("num.partitions", str(self.num_partitions), ConfigType.INT, "Partitions of an auto-created topic."),
            ("default.replication.factor", str(self.default_replication_factor), ConfigType.INT, "Replication factor of an auto-created topic."),
            ("auto.create.topics.enable", str(self.auto_create_topics).lower(), ConfigType.BOOLEAN, "Create unknown topics on Metadata and Produce."),
            ("delete.topic.enable", str(self.delete_topic_enable).lower(), ConfigType.BOOLEAN, "Allow DeleteTopics."),
            ("socket.request.max.bytes", str(self.socket_request_max_bytes), ConfigType.INT, "Largest request frame accepted."),
            ("queued.max.request.bytes", str(self.queued_max_request_bytes), ConfigType.LONG,
             "Bytes of received requests not yet handled, all connections together, before the broker stops reading."),
            ("fetch.max.bytes", str(self.fetch_max_bytes), ConfigType.INT, "Most record bytes in one Fetch answer, whatever the client asks."),
            ("hyperkafka.connection.max.unsent.bytes", str(self.max_unsent_bytes_per_connection), ConfigType.LONG,
             "Answer bytes a connection may leave unread before the broker stops reading its requests."),
            ("max.broker.partitions", str(self.max_broker_partitions), ConfigType.INT, "Partitions this broker holds at most (KIP-578)."),
        ]
        if self.http_listen is not None:
            values.append(("hyperkafka.http.listeners", "http://{}:{}".format(*self.http_listen), ConfigType.STRING,
                           "Where /metrics is served over HTTP."))
        if self.rack is not None:
            values.append(("broker.rack", self.rack, ConfigType.STRING, "This broker's rack (KIP-392: consumers in it may fetch from it)."))
        if self.cluster_etcd_endpoints:
            values.append(("hyperkafka.cluster.etcd.endpoints", ",".join(self.cluster_etcd_endpoints),
                           ConfigType.LIST, "The etcd cluster of this broker cluster, http://HOST:PORT,..."))
            values.append(("hyperkafka.cluster.name", self.cluster_name, ConfigType.STRING,
                           "The key prefix of this cluster in etcd."))
            values.append(("replica.lag.time.max.ms", str(self.replica_lag_ms), ConfigType.LONG,
                           "A follower not holding what the leader signed this long ago leaves the ISR."))
            values.append(("broker.session.timeout.ms", str(self.session_timeout_ms), ConfigType.INT,
                           "A broker not heard from this long is dead: it leaves Metadata and every ISR."))
            values.append(("hyperkafka.cluster.death.evidence.enable", str(self.death_evidence).lower(),
                           ConfigType.BOOLEAN, "A broker whose listener refuses connections is dead at once "
                           "(its lease is revoked), not a session timeout later."))
            values.append(("replica.selector.class", self.replica_selector, ConfigType.CLASS,
                           "How the leader picks a replica for a consumer to fetch from (KIP-392)."))
            values.append(("hyperkafka.quorum.partitions.enable", str(self.quorum_partitions).lower(),
                           ConfigType.BOOLEAN, "New topics get archives signed by a quorum of their replicas."))
            values.append(("hyperkafka.quorum.unsigned.max.bytes", str(self.quorum_unsigned_max_bytes),
                           ConfigType.LONG, "Bytes a quorum-signed partition takes before its replicas "
                           "signed them; past it a produce waits (its connection is not read meanwhile)."))
        for d in TOPIC_CONFIGS.values():
            if d.broker_synonym:
                value, _ = self.topic_default(d)
                values.append((d.broker_synonym, value, d.type, d.doc))
        retention_ms = int(self.topic_default(TOPIC_CONFIGS["retention.ms"])[0])
        hours = str(retention_ms // 3_600_000) if retention_ms >= 0 else "-1"
        values.append(("log.retention.hours", hours, ConfigType.INT, "log.retention.ms in hours, as Kafka lists it."))
        seen: set[str] = set()
        entries = []
        for name, value, type_, doc in values:
            if name in seen:
                continue
            seen.add(name)
            source = ConfigSource.STATIC_BROKER_CONFIG if name in self.static else ConfigSource.DEFAULT_CONFIG
            entries.append(ConfigEntry(name, value, source, type_, doc, read_only=True, synonyms=((name, value, source),)))
        return entries


def parse_host_port(text: str) -> tuple[str, int]:
    if "://" in text:
        text = text.split("://", 1)[1]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]")
    return host, int(port)


def parse_http_listener(text: str) -> tuple[str, int]:
    """``http://HOST:PORT``, ``HOST:PORT`` or ``:PORT`` (loopback); one listener."""
    text = text.strip()
    if "," in text:
        raise ConfigError("hyperkafka.http.listeners: one listener only")
    if "://" in text and not text.lower().startswith("http://"):
        raise ConfigError(f"hyperkafka.http.listeners: only http:// is served, got {text!r}")
    host, port = parse_host_port(text)
    if not 0 <= port <= 65535:
        raise ConfigError(f"hyperkafka.http.listeners: bad port {port}")
    return host or "127.0.0.1", port


@dataclass(frozen=True)
class ClusterBroker:
    node_id: int
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_etcd_endpoints(text: str) -> list[str]:
    """``http://HOST:PORT,...``: etcd client URLs (plain HTTP: the v3 JSON gateway)."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if not item.startswith("http://"):
            raise ConfigError(f"hyperkafka.cluster.etcd.endpoints: expected http://HOST:PORT, got {item!r}")
        parse_host_port(item.removeprefix("http://").rstrip("/"))
        out.append(item.rstrip("/"))
    if not out:
        raise ConfigError("hyperkafka.cluster.etcd.endpoints: no endpoint listed")
    return out


def read_properties(path: Path) -> dict[str, str]:
    """A Java .properties subset: key=value or key: value, # and ! comments."""
    props: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        for sep in ("=", ":"):
            if sep in line:
                key, value = line.split(sep, 1)
                props[key.strip()] = value.strip()
                break
        else:
            raise ConfigError(f"{path}: cannot parse line {raw!r}")
    return props


_BOOL = {"true": True, "false": False}


def apply_properties(config: BrokerConfig, props: Mapping[str, str]) -> BrokerConfig:
    """Fold a server.properties mapping into `config`; unknown names are an error, and
    Kafka's own names that do not apply here are dropped with a warning (config_sources)."""
    from broker.config_sources import set_aside_kafka_only
    from broker.security.settings import is_security_key

    props = set_aside_kafka_only(props)
    broker_synonyms = {d.broker_synonym for d in TOPIC_CONFIGS.values() if d.broker_synonym}
    changes: dict[str, object] = {}
    for key, value in props.items():
        if key in ("listeners", "advertised.listeners") or is_security_key(key):
            config.security_props[key] = value  # checked as a whole by broker.security
    for key, value in props.items():
        try:
            if is_security_key(key):
                pass
            elif key in ("node.id", "broker.id"):
                changes["node_id"] = int(value)
            elif key == "listeners":
                changes["listen_host"], changes["listen_port"] = parse_host_port(value.split(",")[0])
            elif key == "advertised.listeners":
                changes["advertised_host"], changes["advertised_port"] = parse_host_port(value.split(",")[0])
            elif key in ("log.dirs", "log.dir"):
                changes["data_dir"] = Path(value.split(",")[0])
            elif key == "hyperkafka.fsync":
                changes["fsync"] = FsyncPolicy(value)
            elif key == "broker.rack":
                changes["rack"] = value
            elif key == "num.partitions":
                changes["num_partitions"] = int(value)
            elif key == "default.replication.factor":
                changes["default_replication_factor"] = int(value)
            elif key == "auto.create.topics.enable":
                changes["auto_create_topics"] = _BOOL[value.lower()]
            elif key == "delete.topic.enable":
                changes["delete_topic_enable"] = _BOOL[value.lower()]
            elif key == "socket.request.max.bytes":
                changes["socket_request_max_bytes"] = _at_least(key, value, 1)
            elif key == "queued.max.request.bytes":
                changes["queued_max_request_bytes"] = int(value)
            elif key == "fetch.max.bytes":
                changes["fetch_max_bytes"] = _at_least(key, value, 1024)  # Kafka's lower bound
            elif key == "hyperkafka.connection.max.unsent.bytes":
                changes["max_unsent_bytes_per_connection"] = _at_least(key, value, 1)
            elif key == "max.connections":
                changes["max_connections"] = int(value)
            elif key == "max.broker.partitions":
                changes["max_broker_partitions"] = int(value)
                if int(value) <= 0:
                    raise ConfigError("max.broker.partitions must be positive")
            elif key == "hyperkafka.replication.listen":
                changes["replication_listen"] = parse_host_port(value)
            elif key == "hyperkafka.http.listeners":
                changes["http_listen"] = parse_http_listener(value)
            elif key == "hyperkafka.cluster.brokers":
                raise ConfigError("hyperkafka.cluster.brokers (static membership) is gone: name the etcd cluster "
                                  "with hyperkafka.cluster.etcd.endpoints=http://HOST:PORT,... (docs/clusters.md)")
            elif key == "hyperkafka.cluster.etcd.endpoints":
                changes["cluster_etcd_endpoints"] = parse_etcd_endpoints(value)
            elif key == "hyperkafka.cluster.name":
                if not value or "/" in value:
                    raise ConfigError("hyperkafka.cluster.name must be non-empty and hold no '/'")
                changes["cluster_name"] = value
            elif key == "replica.selector.class":
                if value not in (RACK_AWARE_SELECTOR, LEADER_SELECTOR):
                    raise ConfigError(f"replica.selector.class must be {RACK_AWARE_SELECTOR} or {LEADER_SELECTOR}")
                changes["replica_selector"] = value
            elif key == "replica.lag.time.max.ms":
                changes["replica_lag_ms"] = int(value)
                if int(value) <= 0:
                    raise ConfigError("replica.lag.time.max.ms must be positive")
            elif key == "hyperkafka.quorum.partitions.enable":
                changes["quorum_partitions"] = _BOOL[value.lower()]
            elif key == "hyperkafka.cluster.death.evidence.enable":
                changes["death_evidence"] = _BOOL[value.lower()]
            elif key == "hyperkafka.quorum.unsigned.max.bytes":
                changes["quorum_unsigned_max_bytes"] = _at_least(key, value, 1)
            elif key == "broker.session.timeout.ms":
                changes["session_timeout_ms"] = int(value)
                if int(value) <= 0:
                    raise ConfigError("broker.session.timeout.ms must be positive")
            elif key == "hyperkafka.mirrors":
                changes["mirrors"] = [m.strip() for m in value.split(",") if m.strip()]
            elif key == "log.retention.check.interval.ms":
                changes["log_retention_check_ms"] = int(value)
            elif key == "log.cleaner.enable":
                changes["log_cleaner_enable"] = _BOOL[value.lower()]
            elif key == "log.cleaner.backoff.ms":
                changes["log_cleaner_backoff_ms"] = _at_least(key, value, 1)
            elif key in ("log.retention.hours", "log.retention.minutes"):
                factor = 3_600_000 if key.endswith("hours") else 60_000
                config.topic_defaults.setdefault("log.retention.ms", str(int(value) * factor))
            elif key in GroupSettings.NAMES:
                GroupSettings.from_properties({key: value})  # checked here, read by broker.groups
            elif key in ConsumerSettings.NAMES:
                ConsumerSettings.from_properties({key: value})  # KIP-848 groups (broker.groups.consumer_group)
            elif key in TxnSettings.NAMES:
                TxnSettings.from_properties({key: value})  # checked here, read by broker.transactions
            elif key in broker_synonyms:
                d = next(d for d in TOPIC_CONFIGS.values() if d.broker_synonym == key)
                config.topic_defaults[key] = _check_value(d, value)
            else:
                raise ConfigError(f"unknown broker config {key!r}")
        except (ValueError, KeyError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"bad value for {key}: {value!r}") from None
        config.static[key] = value
    frame_max = int(changes.get("socket_request_max_bytes", config.socket_request_max_bytes))  # type: ignore[call-overload]
    pool = int(changes.get("queued_max_request_bytes", config.queued_max_request_bytes))  # type: ignore[call-overload]
    if 0 < pool < frame_max:
        if "queued.max.request.bytes" in props:
            # As Kafka's KafkaConfig requires: any frame accepted must fit in the pool.
            raise ConfigError("queued.max.request.bytes must be at least socket.request.max.bytes (or -1: unbounded)")
        changes["queued_max_request_bytes"] = frame_max
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


def _at_least(key: str, value: str, low: int) -> int:
    n = int(value)
    if n < low:
        raise ConfigError(f"{key} must be at least {low}")
    return n

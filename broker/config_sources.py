"""Kafka-shaped configuration from outside: the environment, and Kafka's own keys.

Owns:
- `settings_from_env`: every broker setting may come from an environment variable, named
  as Apache Kafka's container images name them: `KAFKA_` and the setting's name in capitals
  with `.` as `_`, `_` as `__` and `-` as `___` (KAFKA_LOG_RETENTION_MS -> log.retention.ms,
  KAFKA_HYPERKAFKA_FSYNC -> hyperkafka.fsync). The variables Kafka's scripts and images
  read for themselves (KAFKA_HEAP_OPTS, ...) are not settings and are left alone.
- `KAFKA_ONLY`: the keys of a stock Kafka server.properties that configure machinery this
  broker does not have (a KRaft quorum, thread pools, replica fetchers, ...), each with the
  reason; `set_aside_kafka_only` drops them from a mapping with one warning line each, so a
  Kafka 4 config/server.properties starts a broker. Any other unknown key stays an error
  (broker.config.apply_properties). docs/configuration.md lists the same keys; a test holds
  the two together.

Imports the standard library only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger("hyperkafka.config")

ENV_PREFIX = "KAFKA_"

# Read by Kafka's own scripts and images (kafka-run-class.sh, the apache/kafka image), never
# settings: a container that also runs Kafka's tools may well have them set.
ENV_NOT_SETTINGS = frozenset(
    {
        "KAFKA_HEAP_OPTS",
        "KAFKA_OPTS",
        "KAFKA_JVM_PERFORMANCE_OPTS",
        "KAFKA_GC_LOG_OPTS",
        "KAFKA_JMX_OPTS",
        "KAFKA_LOG4J_OPTS",
        "KAFKA_LOG4J_LOGGERS",
        "KAFKA_LOG4J_ROOT_LOGLEVEL",
        "KAFKA_TOOLS_LOG4J_LOGLEVEL",
        "KAFKA_DEBUG",
        "KAFKA_HOME",
        "KAFKA_VERSION",
    }
)


def env_to_key(name: str) -> str:
    """KAFKA_LOG_RETENTION_MS -> log.retention.ms (`___` is `-`, `__` is `_`)."""
    body = name[len(ENV_PREFIX) :].lower()
    return (
        body.replace("___", "\0")
        .replace("__", "\1")
        .replace("_", ".")
        .replace("\0", "-")
        .replace("\1", "_")
    )


def env_name(key: str) -> str:
    """log.retention.ms -> KAFKA_LOG_RETENTION_MS (env_to_key's inverse)."""
    return ENV_PREFIX + key.replace("_", "__").replace("-", "___").replace(".", "_").upper()


def settings_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings named by KAFKA_* variables, as server.properties keys."""
    out: dict[str, str] = {}
    for name in sorted(environ):
        if (
            name.startswith(ENV_PREFIX)
            and name not in ENV_NOT_SETTINGS
            and len(name) > len(ENV_PREFIX)
        ):
            out[env_to_key(name)] = environ[name]
    return out


_KRAFT = "there is no KRaft quorum here: one broker needs none, and a cluster elects its controller through etcd (hyperkafka.cluster.etcd.endpoints)"
_INTER_BROKER = "brokers copy each other's archives over the Hypercore protocol (hyperkafka.replication.listen), not a Kafka listener"
_THREADS = "the broker is one Trio event loop, with no thread pools to size"
_SOCKET_BUFFERS = "the kernel's socket buffer sizes are used"
_INTERNAL = "__consumer_offsets is one signed archive per broker; share groups do not exist here yet"
_TXN_STATE = "__transaction_state is one signed archive per broker, copied by every other broker; its partitions (transaction.state.log.num.partitions) only shard the coordinators"
_LEADERS = "a partition's archive has one writer: there is no leadership to move"

KAFKA_ONLY: Mapping[str, str] = {
    "process.roles": _KRAFT,
    "controller.quorum.voters": _KRAFT,
    "controller.quorum.bootstrap.servers": _KRAFT,
    "controller.listener.names": _KRAFT + "; the listeners it names are not opened",
    "controller.quorum.election.timeout.ms": _KRAFT,
    "controller.quorum.fetch.timeout.ms": _KRAFT,
    "controller.quorum.election.backoff.max.ms": _KRAFT,
    "controller.quorum.request.timeout.ms": _KRAFT,
    "controller.quorum.retry.backoff.ms": _KRAFT,
    "controller.quorum.append.linger.ms": _KRAFT,
    "metadata.log.dir": _KRAFT,
    "metadata.log.segment.bytes": _KRAFT,
    "metadata.log.segment.ms": _KRAFT,
    "metadata.max.retention.bytes": _KRAFT,
    "metadata.max.retention.ms": _KRAFT,
    "inter.broker.listener.name": _INTER_BROKER,
    "security.inter.broker.protocol": _INTER_BROKER,
    "num.replica.fetchers": _INTER_BROKER,
    "replica.fetch.max.bytes": _INTER_BROKER,
    "replica.fetch.wait.max.ms": _INTER_BROKER,
    "replica.socket.timeout.ms": _INTER_BROKER,
    "num.network.threads": _THREADS,
    "num.io.threads": _THREADS,
    "background.threads": _THREADS,
    "num.recovery.threads.per.data.dir": _THREADS,
    "log.cleaner.threads": _THREADS,
    "socket.send.buffer.bytes": _SOCKET_BUFFERS,
    "socket.receive.buffer.bytes": _SOCKET_BUFFERS,
    "offsets.topic.replication.factor": _INTERNAL,
    "offsets.topic.segment.bytes": _INTERNAL,
    "transaction.state.log.replication.factor": _TXN_STATE,
    "transaction.state.log.min.isr": _TXN_STATE,
    "share.coordinator.state.topic.replication.factor": _INTERNAL,
    "share.coordinator.state.topic.min.isr": _INTERNAL,
    "share.coordinator.state.topic.num.partitions": _INTERNAL,
    "auto.leader.rebalance.enable": _LEADERS,
    "leader.imbalance.check.interval.seconds": _LEADERS,
    "leader.imbalance.per.broker.percentage": _LEADERS,
    "controlled.shutdown.enable": _LEADERS,
    "group.coordinator.rebalance.protocols": "both group protocols are always served, classic and consumer (KIP-848), as Kafka 4's default classic,consumer",
}


def set_aside_kafka_only(props: Mapping[str, str]) -> dict[str, str]:
    """`props` without the keys of KAFKA_ONLY (one warning each), and without the listeners
    that `controller.listener.names` names (a KRaft controller's, e.g. CONTROLLER://:9093)."""
    out = {k: v for k, v in props.items() if k not in KAFKA_ONLY}
    for key in props:
        if key in KAFKA_ONLY:
            log.warning("ignoring %s=%s: %s", key, props[key], KAFKA_ONLY[key])
    controller = {
        n.strip().upper()
        for n in props.get("controller.listener.names", "").split(",")
        if n.strip()
    }
    for key in ("listeners", "advertised.listeners"):
        if controller and key in out:
            kept = [
                e.strip()
                for e in out[key].split(",")
                if e.strip() and e.strip().split("://", 1)[0].upper() not in controller
            ]
            out[key] = ",".join(kept)
            if not kept:
                del out[key]
    return out

"""The broker's metrics: the counters the hot paths bump and their Prometheus text rendering.

Owns `TopicStats` (per-topic counters, one object per topic, bumped with plain int adds
by the produce and fetch handlers), `BrokerMetrics` (per-API request counts and latency,
the replication channels mirrors hold open) and `render`, which turns them and the
node's state into the Prometheus text exposition format (version 0.0.4) at scrape time.
Gauges (partition counts, under-replicated partitions, appended versus signed length,
mirrors' lag) are computed only when scraped, so they cost the hot path nothing.

Names: Kafka's own metrics as Prometheus' JMX exporter names them with the rules most
deployments use (Strimzi's kafka-metrics config): `kafka_<domain>_<type>_<name>`,
lower-cased, `_total` for meters' counts; so dashboards and alert rules written for Kafka
work unchanged. Ours are `hyperkafka_*`. Every metric is listed in docs/metrics.md.

Cardinality: labels are topics, API names and versions, and mirrors (one per peer node
key); never partitions, clients or connections.

May import `storage` and `broker.node`'s types (for rendering); never the protocol codec.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from storage import timing
from storage.timing import LATENCY_BUCKETS, Histogram

if TYPE_CHECKING:
    from broker.node import Node

KAFKA_STORAGE_ERROR = 56


class TopicStats:
    """Kafka's BrokerTopicMetrics of one topic (the handlers add to these directly)."""

    __slots__ = (
        "bytes_in",
        "bytes_out",
        "failed_fetch",
        "failed_produce",
        "fetch_requests",
        "messages_in",
        "produce_requests",
    )

    def __init__(self) -> None:
        self.bytes_in = 0
        self.messages_in = 0
        self.produce_requests = 0
        self.failed_produce = 0
        self.bytes_out = 0
        self.fetch_requests = 0
        self.failed_fetch = 0


class LoopHistogram:
    """A histogram only the event loop touches: no lock (measured: a third of the locked
    one's cost, which matters once per request)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[list[int], float, int]:
        return list(self.counts), self.sum, sum(self.counts)


MAX_API_KEY = 127
MAX_VERSION = 31


class BrokerMetrics:
    """What is counted outside topics. One per node (`Node.metrics`)."""

    def __init__(self) -> None:
        # [api key][version] -> requests received (Kafka's RequestsPerSec{request,version}):
        # lists, so that counting a request is two indexings and an add
        self.requests: list[list[int]] = [[0] * (MAX_VERSION + 1) for _ in range(MAX_API_KEY + 1)]
        # api key -> seconds from decode to answer ready
        self.latency: list[LoopHistogram | None] = [None] * (MAX_API_KEY + 1)
        # produce/fetch failures for no topic of ours (unknown topic, refused before lookup)
        self.other = TopicStats()
        # replication channels open on our port: channel -> the peer's node key (hex); the
        # replication server adds and removes them
        self.channels: dict[Any, str] = {}

    def observe_latency(self, api_key: int, seconds: float) -> None:
        h = self.latency[api_key]
        if h is None:
            h = self.latency[api_key] = LoopHistogram()
        h.observe(seconds)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str | int]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self, name: str, kind: str, doc: str, samples: Iterable[tuple[dict[str, str | int], float]]
    ) -> None:
        self.lines.append(f"# HELP {name} {doc}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def histogram(
        self,
        name: str,
        doc: str,
        series: Iterable[tuple[dict[str, str | int], Histogram | LoopHistogram]],
    ) -> None:
        self.lines.append(f"# HELP {name} {doc}")
        self.lines.append(f"# TYPE {name} histogram")
        for labels, h in series:
            counts, total, count = h.snapshot()
            running = 0
            for bound, n in zip((*h.bounds, math.inf), counts, strict=True):
                running += n
                le = "+Inf" if math.isinf(bound) else repr(bound)
                self.lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {running}")
            self.lines.append(f"{name}_sum{_labels(labels)} {_number(total)}")
            self.lines.append(f"{name}_count{_labels(labels)} {count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _topic_counter(out: _Out, node: Node, attr: str, name: str, doc: str) -> None:
    def samples() -> Iterator[tuple[dict[str, str | int], float]]:
        total = getattr(node.metrics.other, attr)
        for t in node.topics.values():
            v = getattr(t.stats, attr)
            total += v
            yield {"topic": t.name}, v
        # the all-topics meter, as Kafka's BrokerTopicMetrics without a topic tag
        yield {}, total

    out.family(name, "counter", doc, samples())


def render(node: Node) -> str:
    """Every metric of `node`, in the Prometheus text format."""
    from broker.api import REGISTRY

    out = _Out()
    m = node.metrics
    for attr, name, doc in (
        ("bytes_in", "bytesin", "Record batch bytes appended by produce requests."),
        ("messages_in", "messagesin", "Records appended by produce requests."),
        ("bytes_out", "bytesout", "Record bytes sent in fetch answers."),
        ("produce_requests", "totalproducerequests", "Produce requests per topic-partition."),
        ("fetch_requests", "totalfetchrequests", "Fetch requests per topic-partition."),
        (
            "failed_produce",
            "failedproducerequests",
            "Produce requests per topic-partition answered with an error.",
        ),
        (
            "failed_fetch",
            "failedfetchrequests",
            "Fetch requests per topic-partition that failed reading storage.",
        ),
    ):
        _topic_counter(out, node, attr, f"kafka_server_brokertopicmetrics_{name}_total", doc)

    names = {k: a.name for k, a in REGISTRY.items()}
    out.family(
        "kafka_network_requestmetrics_requests_total",
        "counter",
        "Requests received, by API and version.",
        (
            ({"request": names.get(k, str(k)), "version": v}, n)
            for k, versions in enumerate(m.requests)
            for v, n in enumerate(versions)
            if n
        ),
    )
    out.histogram(
        "hyperkafka_request_duration_seconds",
        "From a decoded request to its answer ready to send (a produce: its head published).",
        (({"request": names.get(k, str(k))}, h) for k, h in enumerate(m.latency) if h is not None),
    )

    own = [p for t in node.topics.values() if not t.mirrored for p in t.partitions]
    held = sum(len(t.partitions) for t in node.topics.values())
    cluster = node.cluster
    under = under_min_isr = offline = 0
    for p in own:
        if p.failed:
            offline += 1
        if not p.topic.name.startswith("__"):
            isr = len(cluster.isr(p.log.key))
            if isr < len(cluster.replicas(node.config.node_id)):
                under += 1
            if cluster.short_of_insync(p.log.key, p.topic.min_insync_replicas) is not None:
                under_min_isr += 1
    failed_dir = any(
        p.failed and p.failed_code == KAFKA_STORAGE_ERROR
        for t in node.topics.values()
        for p in t.partitions
    )
    controller = cluster.is_controller
    out.family(
        "kafka_server_replicamanager_partitioncount",
        "gauge",
        "Partitions this broker holds (written here or mirrored).",
        [({}, held)],
    )
    out.family(
        "kafka_server_replicamanager_leadercount",
        "gauge",
        "Partitions this broker writes.",
        [({}, len(own))],
    )
    out.family(
        "kafka_server_replicamanager_underreplicatedpartitions",
        "gauge",
        "Partitions written here whose in-sync replicas are fewer than their replicas.",
        [({}, under)],
    )
    out.family(
        "kafka_server_replicamanager_underminisrpartitioncount",
        "gauge",
        "Partitions written here with fewer in-sync replicas than min.insync.replicas.",
        [({}, under_min_isr)],
    )
    out.family(
        "kafka_server_replicamanager_offlinereplicacount",
        "gauge",
        "Partitions held here that are offline for writes (a failed disk or a damaged archive).",
        [({}, sum(1 for t in node.topics.values() for p in t.partitions if p.failed))],
    )
    out.family(
        "kafka_controller_kafkacontroller_activecontrollercount",
        "gauge",
        "1 on the broker that is the controller (a single broker is its own).",
        [({}, 1 if controller else 0)],
    )
    out.family(
        "kafka_controller_kafkacontroller_offlinepartitionscount",
        "gauge",
        "On the controller: partitions written here that take no writes.",
        [({}, offline if controller else 0)],
    )
    out.family(
        "kafka_log_logmanager_offlinelogdirectorycount",
        "gauge",
        "Log directories offline after a disk error (this broker has one).",
        [({}, 1 if failed_dir else 0)],
    )

    out.family(
        "hyperkafka_leaf_hashed_bytes_total",
        "counter",
        "Batch bytes leaf-hashed (BLAKE2b) by commits.",
        [({}, timing.LEAF_HASHED_BYTES.value)],
    )
    out.histogram(
        "hyperkafka_sign_seconds", "Time to sign one head (ed25519).", [({}, timing.SIGN_SECONDS)]
    )
    out.histogram(
        "hyperkafka_fsync_seconds",
        "Time of the fsyncs of one commit or one interval sync.",
        [({}, timing.FSYNC_SECONDS)],
    )

    appended: list[tuple[dict[str, str | int], float]] = []
    signed: list[tuple[dict[str, str | int], float]] = []
    equivocations = 0
    for t in node.topics.values():
        appended.append(({"topic": t.name}, sum(p.log.length for p in t.partitions)))
        signed.append(
            (
                {"topic": t.name},
                sum(p.log.head.length if p.log.head is not None else 0 for p in t.partitions),
            )
        )
        equivocations += sum(1 for p in t.partitions if getattr(p.log, "frozen", None))
    out.family(
        "hyperkafka_appended_blocks",
        "gauge",
        "Batches appended to the topic's archives (signed or not).",
        appended,
    )
    out.family(
        "hyperkafka_signed_blocks",
        "gauge",
        "Batches covered by the topic's last signed heads.",
        signed,
    )
    out.family(
        "hyperkafka_equivocations",
        "gauge",
        "Mirrored archives frozen on proof that their writer signed two different trees.",
        [({}, equivocations)],
    )

    verified: dict[str, int] = {}
    lag: dict[str, int] = {}
    for ch, peer in list(m.channels.items()):
        source = ch.source
        plog = getattr(source, "log", None)
        if plog is None or ch.closed:
            continue
        have = ch.remote_contiguous_length
        ours = plog.head.length if plog.head is not None else 0
        verified[peer] = verified.get(peer, 0) + have
        lag[peer] = lag.get(peer, 0) + max(0, ours - have)
    out.family(
        "hyperkafka_mirror_verified_blocks",
        "gauge",
        "Blocks each connected mirror holds verified, over every archive it replicates from us.",
        (({"mirror": k}, v) for k, v in sorted(verified.items())),
    )
    out.family(
        "hyperkafka_mirror_lag_blocks",
        "gauge",
        "Blocks our signed heads cover that each connected mirror does not hold yet.",
        (({"mirror": k}, v) for k, v in sorted(lag.items())),
    )
    out.family(
        "hyperkafka_mirror_channels",
        "gauge",
        "Replication channels (one per archive) mirrors hold open on our port.",
        [({}, len(m.channels))],
    )
    out.family(
        "hyperkafka_replication_connections_total",
        "counter",
        "Connections accepted on the replication port.",
        [({}, node.replication_connections)],
    )
    out.family(
        "hyperkafka_up_seconds",
        "gauge",
        "Seconds since this broker started.",
        [({}, round(time.monotonic() - node.started, 3))],
    )
    return out.text()

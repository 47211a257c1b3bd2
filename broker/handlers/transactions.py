"""Transaction APIs: InitProducerId with a transactional id, AddPartitionsToTxn (v0-v3, the
client form; v4+ is Kafka's broker-to-broker verification and is not advertised),
AddOffsetsToTxn, TxnOffsetCommit, EndTxn (v0-v4: KIP-890 part 2's v5 is not served),
DescribeTransactions, ListTransactions, WriteTxnMarkers (`kafka-transactions abort`), and
FindCoordinator for a transactional id.

Thin: translate the kio request into calls on `node.transactions`
(broker/transactions/coordinator.py) and its outcome into a description. TxnOffsetCommit
is served by the group's coordinator (`node.groups.txn_offset_commit`), as in Kafka; the
transaction is checked first (here, or asked of the transaction's coordinator).
WriteTxnMarkers also serves the transaction coordinators of other brokers (their markers
into the partitions this broker leads, and into the partitions of __consumer_offsets whose
groups it coordinates); DescribeTransactions answers NOT_COORDINATOR /
COORDINATOR_LOAD_IN_PROGRESS for an id another broker coordinates / one being loaded. Rights: a
transactional id needs no ACL of its own yet (there is no TransactionalId resource in the
authorizer): the operations that write need IDEMPOTENT_WRITE's test (a principal that may
write somewhere), AddOffsetsToTxn and TxnOffsetCommit READ on the group, and
AddPartitionsToTxn WRITE on each topic.
"""

from __future__ import annotations

import datetime
from typing import Any

from broker.api import Reply, RequestContext, api
from broker.groups.records import PendingOffset
from broker.handlers import errors
from broker.security.authz import Operation
from broker.security.session import (
    authorize,
    authorize_group,
    authorize_idempotent_write,
    cluster_operations,
)
from broker.shape import field_of
from broker.transactions.coordinator import (
    OFFSETS_TOPIC,
    OPERATION_NOT_ATTEMPTED,
    PRODUCER_FENCED,
    CoordinatorError,
    TxnCoordinator,
    coordinator_node,
)
from broker.transactions.records import Status

TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
GROUP_AUTHORIZATION_FAILED = 30
TRANSACTIONAL_ID_NOT_FOUND = 105
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def _time(ms: int) -> datetime.datetime:
    """A timestamp field that may be -1 (no transaction started): a datetime that kio
    writes as that many milliseconds, -1 included."""
    return _EPOCH + datetime.timedelta(milliseconds=ms)


def _fenced(ctx: RequestContext, code: int, first_version: int) -> int:
    """PRODUCER_FENCED (KIP-588) is answered from `first_version` on; older clients get
    INVALID_PRODUCER_EPOCH, which they handle alike (as Kafka's KafkaApis does)."""
    if code == PRODUCER_FENCED and ctx.api_version < first_version:
        return errors.INVALID_PRODUCER_EPOCH
    return code


def _coordinator(ctx: RequestContext) -> TxnCoordinator:
    return ctx.node.transactions


def _ms(value: Any) -> int:
    return int(value.total_seconds() * 1000) if hasattr(value, "total_seconds") else int(value)


def find_transaction_coordinator(ctx: RequestContext, key: str) -> dict[str, Any]:
    """FindCoordinator's answer for one transactional id (key type 1): the broker that
    coordinates its partition of __transaction_state (`coordinator_node`), whichever
    broker is asked; COORDINATOR_NOT_AVAILABLE (retriable) while none is named or the
    named one is not alive."""
    node = ctx.node
    where = coordinator_node(node, key)
    address: tuple[str, int] | None = None
    if where == node.config.node_id:
        # this broker's address on the listener the request came in on, as Metadata
        address = (
            ctx.session.listener.advertised if ctx.session is not None else node.config.advertised
        )
    elif where is not None and node.cluster.alive(where):
        b = node.cluster.brokers.get(where)
        address = None if b is None else (b.host, b.port)
    if where is None or address is None:
        return {
            "key": key,
            "node_id": -1,
            "host": "",
            "port": -1,
            "error_code": errors.COORDINATOR_NOT_AVAILABLE,
            "error_message": "The transaction coordinator is not available right now",
        }
    return {
        "key": key,
        "node_id": where,
        "host": address[0],
        "port": address[1],
        "error_code": errors.NONE,
        "error_message": None,
    }


async def init_transactional(ctx: RequestContext, req: Any) -> Reply:
    """InitProducerId with a transactional id (called by the InitProducerId handler)."""
    answer: dict[str, Any] = {
        "throttle_time": 0,
        "error_code": errors.NONE,
        "producer_id": -1,
        "producer_epoch": -1,
    }
    try:
        pid, epoch = await _coordinator(ctx).init_producer_id(
            req.transactional_id,
            _ms(req.transaction_timeout),
            field_of(req, "producer_id", -1),
            field_of(req, "producer_epoch", -1),
        )
    except CoordinatorError as exc:
        answer["error_code"] = _fenced(ctx, exc.code, 4)
        return answer
    answer.update(producer_id=pid, producer_epoch=epoch)
    return answer


@api(24, "AddPartitionsToTxn", (0, 3))
async def add_partitions_to_txn(ctx: RequestContext, req: Any) -> Reply:
    node = ctx.node
    wanted = [(t.name, int(p)) for t in req.v3_and_below_topics for p in t.partitions]
    codes: dict[tuple[str, int], int] = {}
    for topic, index in wanted:
        if not authorize(ctx, Operation.WRITE, topic):
            codes[(topic, index)] = errors.TOPIC_AUTHORIZATION_FAILED
        elif node.partition(topic, index) is None or topic.startswith("__"):
            codes[(topic, index)] = errors.UNKNOWN_TOPIC_OR_PARTITION
    if codes:
        # As Kafka: the partitions that were fine are not added either.
        for key in wanted:
            codes.setdefault(key, OPERATION_NOT_ATTEMPTED)
    else:
        code = errors.NONE
        if not authorize_idempotent_write(ctx):
            code = TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        else:
            try:
                await _coordinator(ctx).add_partitions(
                    req.v3_and_below_transactional_id,
                    req.v3_and_below_producer_id,
                    req.v3_and_below_producer_epoch,
                    wanted,
                )
            except CoordinatorError as exc:
                code = _fenced(ctx, exc.code, 2)
        codes = dict.fromkeys(wanted, code)
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for (topic, index), code in codes.items():
        by_topic.setdefault(topic, []).append(
            {"partition_index": index, "partition_error_code": code}
        )
    return {
        "throttle_time": 0,
        "results_by_topic_v3_and_below": [
            {"name": topic, "results_by_partition": parts} for topic, parts in by_topic.items()
        ],
    }


@api(25, "AddOffsetsToTxn", (0, 4))
async def add_offsets_to_txn(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_idempotent_write(ctx):
        return {"throttle_time": 0, "error_code": TRANSACTIONAL_ID_AUTHORIZATION_FAILED}
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return {"throttle_time": 0, "error_code": GROUP_AUTHORIZATION_FAILED}
    try:
        # As Kafka: the group's partition of __consumer_offsets joins the transaction; its
        # marker goes to the group's coordinator, which holds the pending offsets.
        await _coordinator(ctx).add_partitions(
            req.transactional_id,
            req.producer_id,
            req.producer_epoch,
            [(OFFSETS_TOPIC, ctx.node.groups.shard_of(req.group_id))],
        )
    except CoordinatorError as exc:
        return {"throttle_time": 0, "error_code": _fenced(ctx, exc.code, 2)}
    return {"throttle_time": 0, "error_code": errors.NONE}


@api(28, "TxnOffsetCommit", (0, 4))
async def txn_offset_commit(ctx: RequestContext, req: Any) -> Reply:
    def answer(code_of: Any) -> Reply:
        return {
            "throttle_time": 0,
            "topics": [
                {
                    "name": t.name,
                    "partitions": [
                        {"partition_index": p.partition_index, "error_code": code_of(t.name, p)}
                        for p in t.partitions
                    ],
                }
                for t in req.topics
            ],
        }

    if not authorize_idempotent_write(ctx):
        return answer(lambda _t, _p: TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    if not authorize_group(ctx, Operation.READ, req.group_id):
        return answer(lambda _t, _p: GROUP_AUTHORIZATION_FAILED)
    generation = field_of(req, "generation_id", -1)
    member = field_of(req, "member_id", "") or ""
    instance = field_of(req, "group_instance_id", None)
    groups = ctx.node.groups
    if generation >= 0 or member or instance is not None:
        # KIP-447: a producer that names its consumer's generation is checked against it.
        group, code = groups.groups.validate_offset_commit(
            groups.now(), req.group_id, generation, member, instance, transactional=True
        )
        if group is None:
            return answer(lambda _t, _p: code)
    denied = {t.name for t in req.topics if not authorize(ctx, Operation.READ, t.name)}
    offsets = [
        PendingOffset(
            t.name,
            p.partition_index,
            p.committed_offset,
            field_of(p, "committed_leader_epoch", -1),
            p.committed_metadata or "",
        )
        for t in req.topics
        if t.name not in denied
        for p in t.partitions
        if ctx.node.partition(t.name, p.partition_index) is not None
    ]
    # Sent to the group's coordinator (Kafka's clients find it by the group id): it keeps
    # the offsets pending until the transaction's marker. First the transaction is checked
    # to hold the group's partition of __consumer_offsets: here when this broker also
    # coordinates the transactional id, else by asking its coordinator, as a partition
    # leader checks a transactional batch (KIP-890's verification).
    code = groups.refusal(req.group_id)
    offsets_partition = (OFFSETS_TOPIC, groups.shard_of(req.group_id))
    if code == errors.NONE and coordinator_node(ctx.node, req.transactional_id) == ctx.node.config.node_id:
        try:
            _coordinator(ctx).verify_offsets(
                req.transactional_id, req.producer_id, req.producer_epoch, offsets_partition
            )
        except CoordinatorError as exc:
            code = exc.code
    elif code == errors.NONE:
        refused = await _coordinator(ctx).verify_produce(
            req.transactional_id, [(*offsets_partition, req.producer_id, req.producer_epoch)]
        )
        if offsets_partition in refused:
            code = refused[offsets_partition][0]
            if code == errors.NOT_ENOUGH_REPLICAS:  # (not an answer TxnOffsetCommit has)
                code = errors.COORDINATOR_NOT_AVAILABLE
    if code == errors.NONE and offsets:
        code = await groups.txn_offset_commit(
            req.group_id, req.producer_id, req.producer_epoch, offsets
        )

    def code_of(topic: str, p: Any) -> int:
        if topic in denied:
            return errors.TOPIC_AUTHORIZATION_FAILED
        if ctx.node.partition(topic, p.partition_index) is None:
            return errors.UNKNOWN_TOPIC_OR_PARTITION
        return code

    return answer(code_of)


@api(26, "EndTxn", (0, 4))
async def end_txn(ctx: RequestContext, req: Any) -> Reply:
    if not authorize_idempotent_write(ctx):
        return {"throttle_time": 0, "error_code": TRANSACTIONAL_ID_AUTHORIZATION_FAILED}
    try:
        await _coordinator(ctx).end_txn(
            req.transactional_id, req.producer_id, req.producer_epoch, req.committed
        )
    except CoordinatorError as exc:
        return {"throttle_time": 0, "error_code": _fenced(ctx, exc.code, 2)}
    return {"throttle_time": 0, "error_code": errors.NONE}


@api(65, "DescribeTransactions", (0, 0))
async def describe_transactions(ctx: RequestContext, req: Any) -> Reply:
    states = []
    for tid in req.transactional_ids:
        refused = _coordinator(ctx).describe_refusal(tid)
        txn = _coordinator(ctx).describe(tid) if refused == errors.NONE else None
        if txn is None or not authorize_idempotent_write(ctx):
            code = (
                (refused or TRANSACTIONAL_ID_NOT_FOUND)
                if txn is None
                else TRANSACTIONAL_ID_AUTHORIZATION_FAILED
            )
            states.append(
                {
                    "error_code": code,
                    "transactional_id": tid,
                    "transaction_state": "",
                    "transaction_timeout": 0,
                    "transaction_start_time": _time(0),  # as Kafka: a default entry
                    "producer_id": 0,
                    "producer_epoch": 0,
                    "topics": [],
                }
            )
            continue
        by_topic: dict[str, list[int]] = {}
        for topic, index in sorted(txn.partitions):
            by_topic.setdefault(topic, []).append(index)
        states.append(
            {
                "error_code": errors.NONE,
                "transactional_id": tid,
                "transaction_state": txn.status.kafka_name,
                "transaction_timeout": txn.timeout_ms,
                "transaction_start_time": _time(txn.start_ms),
                "producer_id": txn.producer_id,
                "producer_epoch": txn.producer_epoch,
                "topics": [{"topic": t, "partitions": ps} for t, ps in by_topic.items()],
            }
        )
    return {"throttle_time": 0, "transaction_states": states}


@api(66, "ListTransactions", (0, 1))
async def list_transactions(ctx: RequestContext, req: Any) -> Reply:
    known = {s.kafka_name for s in Status}
    wanted = set(req.state_filters)
    pids = set(req.producer_id_filters)
    min_age = field_of(req, "duration_filter", -1)
    now = _coordinator(ctx).wall()
    out = []
    if authorize_idempotent_write(ctx):
        for txn in _coordinator(ctx).listing():
            if wanted and txn.status.kafka_name not in wanted:
                continue
            if pids and txn.producer_id not in pids:
                continue
            if min_age >= 0 and (txn.status is not Status.ONGOING or now - txn.start_ms < min_age):
                continue  # KIP-994: only transactions running for longer than that
            out.append(
                {
                    "transactional_id": txn.transactional_id,
                    "producer_id": txn.producer_id,
                    "transaction_state": txn.status.kafka_name,
                }
            )
    return {
        "throttle_time": 0,
        "error_code": errors.NONE,
        "unknown_state_filters": sorted(wanted - known),
        "transaction_states": out,
    }


CLUSTER_ACTION_BIT = 1 << 9  # Kafka's AclOperation.CLUSTER_ACTION


@api(27, "WriteTxnMarkers", (1, 1))
async def write_txn_markers(ctx: RequestContext, req: Any) -> Reply:
    """Kafka's coordinators send this to partition leaders, and so do ours in a cluster
    (broker/transactions/markers.py `_send_markers`; alone the coordinator writes its
    own markers); it also serves `kafka-transactions abort` (Admin.abortTransaction: an
    ABORT marker for a hanging transaction found by `find-hanging`). CLUSTER_ACTION on the
    cluster is needed, as in Kafka (a super user, or a node without an authorizer). Each
    marker's coordinator_epoch is checked against the producer's last one at the
    partition (TRANSACTION_COORDINATOR_FENCED when older: `TxnCoordinator.write_markers`)."""
    allowed = bool(cluster_operations(ctx) & CLUSTER_ACTION_BIT)
    markers = []
    for m in req.markers:
        wanted = [(t.name, int(i)) for t in m.topics for i in t.partition_indexes]
        if not allowed:
            codes = dict.fromkeys(wanted, errors.CLUSTER_AUTHORIZATION_FAILED)
        elif m.producer_id < 0 or m.coordinator_epoch < 0:
            # no producer or coordinator has such an id or epoch: a marker for it would be a malformed
            # control batch signed for ever (the fuzz suite's int extremes found one)
            codes = dict.fromkeys(wanted, errors.INVALID_REQUEST)
        else:
            codes = await _coordinator(ctx).write_markers(
                m.producer_id, m.producer_epoch, m.transaction_result, wanted, m.coordinator_epoch
            )
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for (topic, index), code in codes.items():
            by_topic.setdefault(topic, []).append({"partition_index": index, "error_code": code})
        markers.append(
            {
                "producer_id": m.producer_id,
                "topics": [{"name": t, "partitions": ps} for t, ps in by_topic.items()],
            }
        )
    return {"markers": markers}

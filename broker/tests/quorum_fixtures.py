"""Set-ups the quorum-signed partition tests share.

- `Brokers` / `three_brokers` / `create_q`: brokers of a cluster served in this process
  on a test etcd, each in a cancel scope of its own (stopped and started again on the
  same data dir), the way test_takeover.py and test_quorum_placement.py start three of
  them and create a topic "q" whose one partition broker 1 writes, replicated on all.
- `open_quorum_node`, `open_replicas`, `replica_signers`, `assembler`, `wire`: a real node
  (broker `LEADER`) writing quorum-signed partitions whose replicas, brokers 2 and 3, are
  real follower archives answering through their ReplicaSigner over the in-process
  transport of test_quorum_signing.py (`Net`), as test_quorum_load.py and
  test_quorum_isolation.py use them; `send_produce` and `answer`, a Produce (v9) through
  the node's handler and its answer.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import trio

from broker.api import Deferred, Encoded, RequestContext
from broker.cluster.signing import QuorumAssembler, ReplicaSigner
from broker.compose import open_node
from broker.config import BrokerConfig
from broker.handlers.produce import produce
from broker.node import Node, Partition, ms_now
from broker.protocol.codec import decode_response
from broker.shape import shape
from broker.tests.conftest import request_class
from broker.tests.test_cluster import _controller, _create, _free_ports, _metadata, _serve, _until
from broker.tests.test_quorum_signing import KPS, LEADER, Net
from storage import PartitionLog
from storage.batch import build_batch
from storage.follower import FollowerLog
from storage.quorum import partition_manifest

# ----------------------------------------------------------------- brokers on etcd


class Brokers:
    """Brokers of the cluster on `endpoint`, served in `nursery` (serve options: `opts`);
    `start(i)` serves broker i (again after `stop(i)`: same data dir) and gives a client
    connected to it."""

    def __init__(self, nursery: trio.Nursery, tmp_path: Path, endpoint: str, **opts: Any) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.endpoint = endpoint
        self.opts = opts
        self.ports = _free_ports(3)
        self.scopes: dict[int, trio.CancelScope] = {}

    async def start(self, i: int) -> Any:
        scope = trio.CancelScope()
        self.scopes[i] = scope
        client: list[Any] = []

        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                async with trio.open_nursery() as inner:
                    client.append(await _serve(inner, self.tmp_path, i, self.ports, self.endpoint, **self.opts))
                    task_status.started()
                    await trio.sleep_forever()

        await self.nursery.start(serve)
        return client[0]

    def stop(self, i: int) -> None:
        self.scopes[i].cancel()


async def three_brokers(brokers: Brokers) -> dict[int, Any]:
    """Broker 1 started and elected controller (so it writes the topics created now),
    then brokers 2 and 3, until broker 1's Metadata lists all three: their clients."""
    c1 = await brokers.start(1)

    async def elected() -> bool:
        return await _controller(c1) == 1

    await _until(elected)
    clients = {1: c1, 2: await brokers.start(2), 3: await brokers.start(3)}

    async def three() -> bool:
        return len((await _metadata(c1, "x")).brokers) == 3

    await _until(three)
    return clients


async def create_q(c: Any) -> None:
    """Topic "q": one partition, replicas 1, 2 and 3 (quorum-signed with the setting on)."""
    r = await _create(c, [{"name": "q", "num_partitions": -1, "replication_factor": -1,
                           "assignments": [{"partition_index": 0, "broker_ids": [1, 2, 3]}],
                           "configs": []}])  # fmt: skip
    assert r.topics[0].error_code == 0


# ----------------------------------------------------------------- a node and its replicas


def open_quorum_node(tmp_path: Path, quorum_topic: str = "q") -> Node:
    """Node `LEADER` (data in tmp_path/data): the partitions of `quorum_topic` are
    quorum-signed by KPS[:3] (brokers 1, 2, 3), every other topic's single-signer."""
    keys = [kp.public_key for kp in KPS[:3]]
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    node.partition_manifests = lambda name, tid, count: (
        [partition_manifest(keys, tid, i) for i in range(count)] if name == quorum_topic else None
    )
    return node


def open_replicas(tmp_path: Path, partitions: Iterable[Partition]) -> dict[tuple[int, bytes], FollowerLog]:
    """Brokers 2 and 3's follower archives of these quorum-signed partitions, by
    (broker, archive key)."""
    replicas: dict[tuple[int, bytes], FollowerLog] = {}
    for p in partitions:
        manifest = p.log.manifest
        assert manifest is not None
        for i in (2, 3):
            replicas[i, p.log.key] = FollowerLog.open_replica(tmp_path / f"r{i}-{p.index}", manifest)
    return replicas


def replica_signers(replicas: Mapping[tuple[int, bytes], FollowerLog]) -> dict[int, ReplicaSigner]:
    """Brokers 2 and 3 signing for `LEADER` what they hold of `replicas`."""

    def archive(i: int) -> Callable[[bytes], FollowerLog | None]:
        return lambda key: replicas.get((i, key))

    return {i: ReplicaSigner(KPS[i - 1], archive(i), lambda _k: LEADER) for i in (2, 3)}


def assembler(net: Net, log: Callable[[], PartitionLog], timeout_s: float) -> QuorumAssembler:
    """The leader's QuorumAssembler of a partition (whose log `log()` is now, which a
    reopen replaces), asking brokers 2 and 3 over `net`."""
    first = log()
    manifest = first.manifest
    assert manifest is not None
    return QuorumAssembler(
        LEADER, KPS[0], manifest, [1, 2, 3], net,
        lambda i: log().block(i), lambda: log().published_length,
        timeout_s=timeout_s,
    )  # fmt: skip


def wire(log: PartitionLog, asm: QuorumAssembler) -> None:
    """Give the (possibly reopened) log its quorum signer, as QuorumRole.run does."""
    log.quorum_sign = lambda th, n, f: trio.from_thread.run(asm.sign, th, n, f)


async def send_produce(node: Node, topic: str, index: int, values: list[bytes], seq: int, *,
                       acks: int = -1, timeout_ms: int = 30_000, producer_id: int = 7) -> Any:
    """The produce handler's reply to a Produce (v9) of one idempotent batch of `values`
    (producer `producer_id`, epoch 0, base sequence `seq`)."""
    ctx = RequestContext(node, 0, 9, seq + 1, "test", "test")
    batch = build_batch(values, timestamp_ms=ms_now(), producer_id=producer_id, producer_epoch=0,
                        base_sequence=seq)  # fmt: skip
    req = shape(request_class("produce", 9), {
        "transactional_id": None, "acks": acks, "timeout": timeout_ms,
        "topic_data": [{"name": topic, "partition_data": [{"index": index, "records": batch}]}],
    })  # fmt: skip
    return await produce(ctx, req)


async def answer(d: Deferred) -> tuple[int, int]:
    """(error code, base offset) of a one-partition Produce answer."""
    enc = await d.finish()
    assert isinstance(enc, Encoded)
    frame = enc.frame
    (size,) = struct.unpack_from(">i", frame)
    _, r = decode_response(frame[4 : 4 + size], 0, 9)
    pr = r.responses[0].partition_responses[0]
    return pr.error_code, pr.base_offset

"""A quorum-signed topic's etcd record is the truth of its existence and configs
(broker/placed_topics.py): a topic whose first writer is dead is altered and deleted from
any broker, every broker drops it, the writer back does not resurrect it, and a topic of
the same name created meanwhile is left alone. CreatePartitions is refused for it. Three
brokers in this process on a test etcd (the fixtures of test_takeover.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from broker import compose
from broker.cluster.etcd import EtcdError
from broker.tests.test_cluster import _controller, _create, _free_ports, _metadata, _serve, _until
from broker.tests.test_takeover import ON, _produce, _values
from compat_tests.etcd import EtcdServer


def _resource(*configs: dict[str, Any]) -> dict[str, Any]:
    return {"resources": [{"resource_type": 2, "resource_name": "q", "configs": list(configs)}],
            "validate_only": False}


async def _configs(c: Any) -> dict[str, str]:
    """DescribeConfigs of topic q: its overrides (source: topic)."""
    d = await c.call("describe_configs", 4, {
        "resources": [{"resource_type": 2, "resource_name": "q", "configuration_keys": None}],
        "include_synonyms": False, "include_documentation": False})
    assert d.results[0].error_code == 0, d.results[0].error_message
    return {e.name: e.value for e in d.results[0].configs if e.config_source == 1}


def _archives(tmp_path: Path, i: int) -> list[Path]:
    """Broker i's files of a topic q: its own archives and its mirrors' copies."""
    root = tmp_path / f"b{i}"
    return [p for p in root.rglob("q-*") if p.is_dir()]


async def test_a_topic_whose_writer_is_dead_is_altered_and_deleted_for_good(
    tmp_path: Path, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broker 1 writes q (replicas 1, 2, 3) and stops; a failover elects 2 or 3. Then,
    from the surviving brokers: IncrementalAlterConfigs and AlterConfigs succeed and every
    survivor describes and applies the record's configs; CreatePartitions is refused;
    DeleteTopics succeeds. A broker that cannot read etcd keeps the topic (absence in
    its view is not enough) and drops it once it can. Broker 1 back (data dir kept)
    deletes its own copy and files, serves it nowhere, and a topic q created again,
    written by broker 2, is intact on every broker, broker 1 included."""
    nodes: dict[int, Any] = {}

    async def recording(node: Any, cluster: Any) -> None:
        nodes[node.config.node_id] = node
        await real_follow(node, cluster)

    real_follow = compose.follow_records
    monkeypatch.setattr(compose, "follow_records", recording)
    ports = _free_ports(3)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            scopes: dict[int, trio.CancelScope] = {}

            async def start(i: int) -> Any:
                scope = trio.CancelScope()
                scopes[i] = scope
                client: list[Any] = []

                async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                    with scope:
                        async with trio.open_nursery() as inner:
                            client.append(await _serve(inner, tmp_path, i, ports, etcd.endpoint, session_ms=2000, **ON))
                            task_status.started()
                            await trio.sleep_forever()

                await nursery.start(serve)
                return client[0]

            c1 = await start(1)

            async def elected() -> bool:
                return await _controller(c1) == 1

            await _until(elected)
            clients = {1: c1, 2: await start(2), 3: await start(3)}

            async def three() -> bool:
                return len((await _metadata(c1, "x")).brokers) == 3

            await _until(three)
            r = await _create(c1, [{"name": "q", "num_partitions": -1, "replication_factor": -1,
                                    "assignments": [{"partition_index": 0, "broker_ids": [1, 2, 3]}],
                                    "configs": [{"name": "retention.ms", "value": "600000"}]}])
            assert r.topics[0].error_code == 0

            async def first() -> bool:
                return (await _produce(c1, b"v0", 0))[0] == 0

            await _until(first)

            async def everywhere() -> bool:
                return [await _values(clients[i]) for i in (2, 3)] == [[b"v0"]] * 2

            await _until(everywhere)
            old_id = nodes[1].topics["q"].topic_id
            assert all(nodes[i].topics["q"].topic_id == old_id for i in (2, 3))
            scopes[1].cancel()  # the writer dies

            async def failed_over() -> bool:
                p = (await _metadata(clients[2], "q")).topics[0].partitions[0]
                return p.leader_id in (2, 3) and p.leader_epoch == 1

            await _until(failed_over)
            c2, c3 = clients[2], clients[3]
            # altered from either survivor (one is the controller, the other forwards)
            r = await c3.call("incremental_alter_configs", 1, _resource(
                {"name": "retention.ms", "config_operation": 0, "value": "1234567"},
                {"name": "max.message.bytes", "config_operation": 0, "value": "2000"}))
            assert r.responses[0].error_code == 0, r.responses[0].error_message
            want = {"retention.ms": "1234567", "max.message.bytes": "2000"}
            assert await _configs(c2) == want and await _configs(c3) == want

            async def applied() -> bool:
                return all(nodes[i].topics["q"].max_message_bytes == 2000 for i in (2, 3))

            await _until(applied)  # the produce path of every survivor follows the record
            r = await c2.call("alter_configs", 2, _resource({"name": "cleanup.policy", "value": "compact"}))
            assert r.responses[0].error_code == 0, r.responses[0].error_message
            assert await _configs(c3) == {"cleanup.policy": "compact"}
            r = await c2.call("incremental_alter_configs", 1, _resource(
                {"name": "remote.storage.enable", "config_operation": 0, "value": "true"}))
            assert r.responses[0].error_code == 40  # INVALID_CONFIG: validated as for any topic
            # grown: refused everywhere (its new partitions would be single-signer)
            for c in (c2, c3):
                r = await c.call("create_partitions", 3, {
                    "topics": [{"name": "q", "count": 2, "assignments": None}],
                    "timeout": 5000, "validate_only": False})
                assert r.results[0].error_code == 42 and "quorum-signed" in r.results[0].error_message
            # broker 3 cannot read etcd: it keeps the topic while the others drop it
            cut = nodes[3].cluster.membership

            async def unreadable(name: str) -> Any:
                raise EtcdError("cut off (test)")

            setattr(cut, "read_placement", unreadable)  # noqa: B010 (an instance's, undone below)
            r = await c2.call("delete_topics", 5, {"topic_names": ["q"], "timeout": 5000})
            assert r.responses[0].error_code == 0, r.responses[0].error_message

            async def gone_at_2() -> bool:
                return (await _metadata(c2, "q")).topics[0].error_code == 3

            await _until(gone_at_2)
            await trio.sleep(1.0)
            assert "q" in nodes[3].topics  # its view lacks the record: not enough
            delattr(cut, "read_placement")
            cut.poke()

            async def gone_at_3() -> bool:
                return (await _metadata(c3, "q")).topics[0].error_code == 3

            await _until(gone_at_3)
            assert _archives(tmp_path, 2) == [] and _archives(tmp_path, 3) == []
            # created again, written by broker 2, while broker 1 is down
            r = await _create(c2, [{"name": "q", "num_partitions": -1, "replication_factor": -1,
                                    "assignments": [{"partition_index": 0, "broker_ids": [2, 3]}],
                                    "configs": []}])
            assert r.topics[0].error_code == 0, r.topics[0].error_message
            # broker 1 back: it drops its own q (another id in etcd), files included
            c1 = clients[1] = await start(1)

            async def new_q_everywhere() -> bool:
                for i in (1, 2, 3):
                    t = (await _metadata(clients[i], "q")).topics[0]
                    if t.error_code or t.partitions[0].leader_id != 2:
                        return False
                return nodes[1].topics.get("q") is not None and nodes[1].topics["q"].topic_id != old_id

            await _until(new_q_everywhere)
            assert old_id not in {t.topic_id for n in nodes.values() for t in n.topics.values()}
            # no file of the old q is left in broker 1's data dir
            assert not (tmp_path / "b1" / "q-0").exists()

            async def written() -> bool:
                return (await _produce(c2, b"n0", 0))[0] == 0

            await _until(written)

            async def new_everywhere() -> bool:
                return [await _values(clients[i]) for i in (1, 2, 3)] == [[b"n0"]] * 3

            await _until(new_everywhere)
            assert await _configs(c1) == {}
            nursery.cancel_scope.cancel()

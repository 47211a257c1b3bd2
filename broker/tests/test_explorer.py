"""The explorer's page and JSON (broker/explorer.py) through the HTTP listener: the page
and its bundle are served, /v1/topics, /v1/groups and /v1/mirrors say what the node
holds, hide what anonymous clients may not read, and stay bounded. The page itself runs
in Chromium in compat_tests/test_explorer.py."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

import broker.explorer as explorer
from broker.compose import open_node
from broker.config import BrokerConfig
from broker.mirror import discover
from broker.tests.conftest import Broker, RawClient
from broker.tests.test_metrics import get_json, http
from broker.tests.test_server import batch, create, produce
from storage.catalog import decode_changes
from storage.hypercore import archive_key, verify_head


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(
        data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2, http_listen=("127.0.0.1", 0)
    )


async def test_the_page_and_its_bundle_are_served(broker: Broker) -> None:
    assert broker.config.http_listen is not None
    port = broker.config.http_listen[1]
    status, page = await http(port, b"GET / HTTP/1.1\r\n\r\n")
    assert status == 200 and b'<script src="/explorer.js">' in page
    status, js = await http(port, b"GET /explorer.js HTTP/1.1\r\n\r\n")
    assert status == 200 and b"hkexplorer" in js and len(js) > 10_000
    assert await http(port, b"HEAD / HTTP/1.1\r\n\r\n") == (200, b"")
    assert (await http(port, b"GET /index.html HTTP/1.1\r\n\r\n"))[0] == 404


async def _commit(c: RawClient, group: str, topic: str, offset: int) -> None:
    while True:
        r = await c.call(
            "offset_commit",
            8,
            {
                "group_id": group,
                "generation_id_or_member_epoch": -1,
                "member_id": "",
                "group_instance_id": None,
                "topics": [
                    {
                        "name": topic,
                        "partitions": [
                            {
                                "partition_index": 0,
                                "committed_offset": offset,
                                "committed_leader_epoch": -1,
                                "committed_metadata": None,
                            }
                        ],
                    }
                ],
            },
        )
        code = int(r.topics[0].partitions[0].error_code)
        if code != 14:  # COORDINATOR_LOAD_IN_PROGRESS
            assert code == 0
            return
        await trio.sleep(0.05)


async def test_topics_and_groups(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    await create(broker, "seen", partitions=2)
    c = await broker.connect()
    for values in ([b"a"], [b"b", b"c"]):
        assert (await produce(c, "seen", batch(values))).error_code == 0
    status, doc = await get_json(broker, "/v1/topics")
    assert status == 200 and doc["truncated"] is False
    assert len(doc["node_key"]) == 64
    [topic] = doc["topics"]  # no internal topic
    assert topic["topic"] == "seen" and topic["mirrored"] is False
    p0, p1 = topic["partitions"]
    assert (p0["high_watermark"], p0["length"], p0["log_start_offset"]) == (3, 2, 0)
    # a Hypercore 11 multiSignature of one signer
    assert len(p0["signature"]) == 136 and len(p0["tree_hash"]) == 64 and len(p0["archive_key"]) == 64
    assert (p1["high_watermark"], p1["length"], p1["signature"]) == (0, 0, None)
    _, head = await get_json(broker, "/v1/partitions/seen/0/head")
    assert (head["tree_hash"], head["signature"]) == (p0["tree_hash"], p0["signature"])

    await _commit(c, "g1", "seen", 1)
    status, doc = await get_json(broker, "/v1/groups")
    assert status == 200
    [group] = doc["groups"]
    assert group["group"] == "g1" and group["lag"] == 2
    assert group["offsets"] == [
        {"topic": "seen", "partition": 0, "committed": 1, "high_watermark": 3, "lag": 2}
    ]

    assert topic["configs"] == {}
    await create(broker, "more")
    monkeypatch.setattr(explorer, "MAX_ITEMS", 1)
    _, doc = await get_json(broker, "/v1/topics")
    assert doc["truncated"] is True and [t["topic"] for t in doc["topics"]] == ["more"]
    assert (await get_json(broker, "/v1/nope"))[0] == 404


def test_a_topic_shows_the_configs_in_effect() -> None:
    # a quorum-signed topic's configs are its etcd record's (Topic.placed_configs), not
    # the ones its writer's catalog signed when it was created
    topic = SimpleNamespace(topic_id=uuid.uuid4(), mirrored=True, partitions=[],
                            record=SimpleNamespace(configs={"retention.ms": "1000"}),
                            configs={"retention.ms": "60000"})  # fmt: skip
    [doc] = explorer._topics(SimpleNamespace(topics={"t": topic}), lambda name: True)  # type: ignore[arg-type]
    assert doc["configs"] == {"retention.ms": "60000"}


def _check_catalog(cat: dict[str, Any]) -> None:
    """The catalog document is whole and signed by its node key."""
    node_key = bytes.fromhex(cat["node_key"])
    assert cat["archive_key"] == archive_key(node_key).hex()
    assert len(cat["blocks"]) == cat["length"] > 0
    assert verify_head(
        node_key,
        archive_key(node_key),
        bytes.fromhex(cat["tree_hash"]),
        cat["length"],
        cat["fork"],
        bytes.fromhex(cat["signature"]),
    )


async def test_the_catalog_that_lists_a_topic(broker: Broker) -> None:
    await create(broker, "listed", partitions=2)
    status, cat = await get_json(broker, "/v1/catalog?topic=listed")
    assert status == 200 and cat["topic"] == "listed"
    _, topics = await get_json(broker, "/v1/topics")
    assert cat["node_key"] == topics["node_key"]
    _check_catalog(cat)
    changes = [c for b in cat["blocks"] for c in decode_changes(base64.b64decode(b))]
    [created] = [c for c in changes if c["name"] == "listed"]
    assert [bytes(k).hex() for k in created["keys"]] == [
        p["archive_key"] for p in topics["topics"][0]["partitions"]
    ]
    assert (await get_json(broker, "/v1/catalog?topic=nope"))[0] == 404
    assert (await get_json(broker, "/v1/catalog"))[0] == 404


async def test_topics_hidden_from_anonymous_readers_are_left_out(tmp_path: Path) -> None:
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    try:
        node.create_topic("private-x", 1)
        node.create_topic("pub", 1)
        topics = explorer.explorer_json(
            node, "/v1/topics", "", lambda name: not name.startswith("private-")
        )
        assert topics is not None and [t["topic"] for t in topics["topics"]] == ["pub"]
    finally:
        node.close()


async def test_mirrors_and_their_lag(tmp_path: Path) -> None:
    from broker.server import run
    from broker.tests.test_mirror import _client, _produce, _wait_hwm

    wcfg = BrokerConfig(
        data_dir=tmp_path / "w",
        listen_port=0,
        shutdown_grace_s=2,
        replication_listen=("127.0.0.1", 0),
        http_listen=("127.0.0.1", 0),
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, wcfg)
        writer = Broker(wcfg, listeners[0].socket.getsockname()[1])
        key, _ = await discover("127.0.0.1", writer.port)
        w = await _client(writer.port)
        await _produce(w, "copied", [b"a", b"b"])
        await _produce(w, "copied", [b"c"])
        mcfg = BrokerConfig(
            http_listen=("127.0.0.1", 0),
            data_dir=tmp_path / "m",
            listen_port=0,
            shutdown_grace_s=2,
            auto_create_topics=False,
            mirrors=[f"127.0.0.1:{writer.port}@{key.hex()}"],
        )
        mlisteners = await nursery.start(run, mcfg)
        m = await _client(mlisteners[0].socket.getsockname()[1])
        await _wait_hwm(m, "copied", 3)
        with trio.fail_after(10):
            while True:  # the writer learns the mirror's length from its messages
                _, doc = await get_json(writer, "/v1/mirrors")
                archives = {a["archive"]: a for mm in doc["mirrors"] for a in mm["archives"]}
                if archives.get("copied-0", {}).get("verified") == 2:
                    break
                await trio.sleep(0.05)
        [mirror] = doc["mirrors"]
        assert len(mirror["mirror"]) == 16 and mirror["lag"] == 0
        assert archives["copied-0"] == {"archive": "copied-0", "verified": 2, "signed": 2, "lag": 0}
        assert "__catalog" in archives
        # the mirror serves its copy of the WRITER's catalog for the topic: signed by the
        # writer's node key, not its own
        mirror_broker = Broker(mcfg, 0)
        status, cat = await get_json(mirror_broker, "/v1/catalog?topic=copied")
        assert status == 200 and cat["node_key"] == key.hex()
        _check_catalog(cat)
        nursery.cancel_scope.cancel()

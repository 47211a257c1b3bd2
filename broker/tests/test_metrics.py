"""/metrics on the HTTP listener: Kafka's JMX-exporter names and ours, counted by real
requests to a broker served in-process."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.compose import open_node
from broker.config import BrokerConfig, ConfigError, apply_properties, parse_http_listener
from broker.metrics import render
from broker.security.users import UserStore
from broker.server import run
from broker.tests.conftest import Broker
from broker.tests.test_security_server import authenticate
from broker.tests.test_server import batch, create, fetch, produce
from storage.hypercore import InvalidProof, leaf_hash
from storage.hypercore.proofs import Proof, verify_proof

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse(text: str) -> dict[str, float]:
    """name{labels} -> value, every sample line checked against the text format."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} twice"
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        key = m.group(1) + (m.group(2) or "")
        assert key not in out, f"sample {key} twice"
        out[key] = float(m.group(3))
    return out


async def http(port: int, request: bytes) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(request)
    data = bytearray()
    with trio.fail_after(5):
        while chunk := await stream.receive_some(1 << 16):
            data += chunk
    await stream.aclose()
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def scrape(broker: Broker) -> dict[str, float]:
    assert broker.config.http_listen is not None
    status, body = await http(
        broker.config.http_listen[1], b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert status == 200
    return parse(body.decode())


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(
        data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2, http_listen=("127.0.0.1", 0)
    )


def test_http_listener_settings() -> None:
    assert BrokerConfig().http_listen is None  # off unless asked for
    assert parse_http_listener(":9404") == ("127.0.0.1", 9404)  # a bare port: loopback
    assert parse_http_listener("http://0.0.0.0:9404") == ("0.0.0.0", 9404)
    assert apply_properties(
        BrokerConfig(), {"hyperkafka.http.listeners": "http://127.0.0.1:1"}
    ).http_listen == ("127.0.0.1", 1)
    for bad in ("https://h:1", "h:1,h:2", "nope"):
        with pytest.raises(ConfigError):
            parse_http_listener(bad)


async def test_produce_and_fetch_are_counted(broker: Broker) -> None:
    await create(broker, "t")
    c = await broker.connect()
    b1, b2 = batch([b"a", b"b"]), batch([b"c"])
    assert (await produce(c, "t", b1)).error_code == 0
    assert (await produce(c, "t", b2)).error_code == 0
    assert (await produce(c, "t", b1, partition=5)).error_code == 3  # no such partition
    got = await fetch(c, "t", 0)
    m = await scrape(broker)
    t = '{topic="t"}'
    assert m[f"kafka_server_brokertopicmetrics_bytesin_total{t}"] == len(b1) + len(b2)
    assert m[f"kafka_server_brokertopicmetrics_messagesin_total{t}"] == 3
    assert m[f"kafka_server_brokertopicmetrics_totalproducerequests_total{t}"] == 3
    assert m[f"kafka_server_brokertopicmetrics_failedproducerequests_total{t}"] == 1
    assert (
        m[f"kafka_server_brokertopicmetrics_bytesout_total{t}"]
        == len(got.records)
        == len(b1) + len(b2)
    )
    assert m[f"kafka_server_brokertopicmetrics_totalfetchrequests_total{t}"] == 1
    assert m["kafka_server_brokertopicmetrics_bytesin_total"] == len(b1) + len(b2)  # all topics
    assert m['kafka_network_requestmetrics_requests_total{request="Produce",version="9"}'] == 3
    assert m['kafka_network_requestmetrics_requests_total{request="Fetch",version="12"}'] == 1
    assert m['hyperkafka_request_duration_seconds_count{request="Produce"}'] == 3
    assert m['hyperkafka_request_duration_seconds_bucket{request="Produce",le="+Inf"}'] == 3
    assert m[f"hyperkafka_appended_blocks{t}"] == 2
    assert m[f"hyperkafka_signed_blocks{t}"] == 2
    assert m["hyperkafka_sign_seconds_count"] >= 1
    assert m["hyperkafka_leaf_hashed_bytes_total"] >= len(b1) + len(b2)
    assert m["kafka_server_replicamanager_partitioncount"] >= 1
    assert m["kafka_server_replicamanager_underreplicatedpartitions"] == 0
    assert m["kafka_controller_kafkacontroller_activecontrollercount"] == 1
    assert m["kafka_controller_kafkacontroller_offlinepartitionscount"] == 0
    assert m["kafka_log_logmanager_offlinelogdirectorycount"] == 0


async def test_offline_partition_and_log_dir_are_reported(tmp_path: Path) -> None:
    node = open_node(BrokerConfig(data_dir=tmp_path / "data"))
    try:
        topic = node.create_topic("t", 2)
        assert topic is not None
        m = parse(render(node))
        assert m["kafka_controller_kafkacontroller_offlinepartitionscount"] == 0
        node.fail_partition(topic.partitions[1], "commit failed: EIO (test)")
        m = parse(render(node))
        assert m["kafka_controller_kafkacontroller_offlinepartitionscount"] == 1
        assert m["kafka_log_logmanager_offlinelogdirectorycount"] == 1
        assert m["kafka_server_replicamanager_offlinereplicacount"] == 1
        assert m['hyperkafka_appended_blocks{topic="t"}'] == 0
    finally:
        node.close()


async def test_http_answers(broker: Broker) -> None:
    assert broker.config.http_listen is not None
    port = broker.config.http_listen[1]
    assert (await http(port, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
    assert (await http(port, b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
    assert (await http(port, b"garbage\r\n\r\n"))[0] == 400
    assert (await http(port, b"GET /" + b"x" * 20000 + b" HTTP/1.1\r\n\r\n"))[0] == 431
    status, body = await http(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b""


def _families(text: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            out |= (
                {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                if kind == "histogram"
                else {name}
            )
    return out


def test_shipped_dashboard_and_alerts_name_only_metrics_we_serve(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    node = open_node(BrokerConfig(data_dir=tmp_path / "data"))
    try:
        served = _families(render(node))
    finally:
        node.close()
    dashboard = json.loads((root / "docker" / "grafana" / "hyperkafka.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += re.findall(r"expr: (.*)", (root / "docker" / "prometheus" / "alerts.yml").read_text())
    assert len(exprs) > 20
    named = {n for e in exprs for n in re.findall(r"\b((?:kafka|hyperkafka)_[a-z_]+)", e)}
    assert named and named <= served, named - served
    documented = set(
        re.findall(r"`((?:kafka|hyperkafka)_[a-z_]+)`", (root / "docs" / "metrics.md").read_text())
    )
    assert {n for n in served if not n.endswith(("_bucket", "_sum", "_count"))} <= documented


async def get_json(broker: Broker, path: str) -> tuple[int, Any]:
    assert broker.config.http_listen is not None
    status, body = await http(
        broker.config.http_listen[1], b"GET " + path.encode() + b" HTTP/1.1\r\n\r\n"
    )
    return status, json.loads(body)


async def test_signed_head_and_inclusion_proof_as_json(broker: Broker) -> None:
    await create(broker, "pf")
    c = await broker.connect()
    batches = [batch([b"r%d" % i] * (i + 1)) for i in range(3)]  # offsets 0, 1-2, 3-5
    for b in batches:
        assert (await produce(c, "pf", b)).error_code == 0
    status, head = await get_json(broker, "/v1/partitions/pf/0/head")
    assert status == 200 and head["length"] == 3 and head["high_watermark"] == 6
    public_key, key = bytes.fromhex(head["writer_public_key"]), bytes.fromhex(head["archive_key"])
    status, doc = await get_json(broker, "/v1/partitions/pf/0/proof?offset=4")
    assert status == 200 and doc["block_index"] == 2
    served = (await fetch(c, "pf", 3)).records
    assert base64.b64decode(doc["batch"]) == served  # the proven value is what Fetch serves
    _, proof = Proof.decode(base64.b64decode(doc["proof"]))
    verified = verify_proof(proof, public_key=public_key, key=key, fork=head["fork"])
    assert verified.proven is not None and verified.proven.hash == leaf_hash(served)
    assert verified.head is not None and verified.head.tree_hash().hex() == head["tree_hash"]
    # a proof whose batch was changed, or checked against another key, fails
    assert proof.block is not None and proof.block.value is not None
    forged = dataclasses.replace(
        proof, block=dataclasses.replace(proof.block, value=proof.block.value[:-1] + b"X")
    )
    with pytest.raises(InvalidProof):
        verify_proof(forged, public_key=public_key, key=key, fork=head["fork"])
    with pytest.raises(InvalidProof):
        verify_proof(proof, public_key=bytes(32), key=key, fork=head["fork"])
    assert (await get_json(broker, "/v1/partitions/pf/0/proof?offset=6"))[
        0
    ] == 404  # not yet signed
    assert (await get_json(broker, "/v1/partitions/pf/7/head"))[0] == 404
    assert (await get_json(broker, "/v1/partitions/pf/0/proof"))[0] == 400


async def test_proofs_only_for_topics_anonymous_may_read(tmp_path: Path) -> None:
    data = tmp_path / "data"
    UserStore.in_data_dir(data).add("writer", "w-pw")
    props = {
        "listeners": "PLAINTEXT://127.0.0.1:0,SASL_PLAINTEXT://127.0.0.1:0",
        "hyperkafka.acl.topic.*.write+create": "User:writer",
        "hyperkafka.acl.topic.private-*.read": "User:writer",
    }
    config = BrokerConfig(
        data_dir=data,
        listen_port=0,
        shutdown_grace_s=2,
        security_props=props,
        http_listen=("127.0.0.1", 0),
    )
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, config)
        sasl = Broker(config, listeners[1].socket.getsockname()[1])
        c = await sasl.connect()
        assert (await authenticate(c, "SCRAM-SHA-256", "writer", "w-pw")).error_code == 0  # type: ignore[attr-defined]
        for name in ("private-x", "pub"):
            r = await c.call(
                "create_topics",
                7,
                {
                    "topics": [
                        {
                            "name": name,
                            "num_partitions": 1,
                            "replication_factor": 1,
                            "assignments": [],
                            "configs": [],
                        }
                    ],
                    "timeout": 5000,
                    "validate_only": False,
                },
            )
            assert r.topics[0].error_code == 0, r
            assert (await produce(c, name, batch([b"secret"]))).error_code == 0
        assert (await get_json(sasl, "/v1/partitions/pub/0/proof?offset=0"))[0] == 200
        assert (await get_json(sasl, "/v1/partitions/private-x/0/head"))[0] == 404
        assert (await get_json(sasl, "/v1/partitions/private-x/0/proof?offset=0"))[0] == 404
        nursery.cancel_scope.cancel()


async def test_a_failing_answer_is_a_500_and_the_broker_lives(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import broker.http as http_module

    def broken(*args: object) -> str:
        raise OSError("EIO (test)")

    monkeypatch.setattr(http_module, "render", broken)
    assert broker.config.http_listen is not None
    port = broker.config.http_listen[1]
    assert (await http(port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 500
    monkeypatch.undo()
    assert (await http(port, b"GET /metrics HTTP/1.1\r\n\r\n"))[0] == 200

"""broker.security through the in-process server on real sockets, with raw requests:
SASL handshakes (v0 bare tokens and v1 SaslAuthenticate), the gate before
authentication, per-listener Metadata endpoints, authorization errors, re-authentication,
idle and slow-request timeouts, produce quotas, and how a refused connection ends."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from broker.config import BrokerConfig
from broker.protocol.framing import frame
from broker.security.scram import ScramClient
from broker.security.users import UserStore
from broker.server import CLOSE_LINGER_S, run
from broker.tests.conftest import RawClient
from broker.tests.test_server import batch, produce


class Secured:
    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports

    async def connect(self, listener: str) -> RawClient:
        return RawClient(await trio.open_tcp_stream("127.0.0.1", self.ports[listener]))


EXTRA: dict[str, str] = {}


@pytest.fixture
async def secured(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Secured]:
    data = tmp_path / "data"
    store = UserStore.in_data_dir(data)
    store.add("writer", "w-pw")
    store.add("reader", "r-pw")
    props = {
        "listeners": "PLAINTEXT://127.0.0.1:0,SASL_PLAINTEXT://127.0.0.1:0",
        "hyperkafka.acl.topic.*.write+create": "User:writer",
        "hyperkafka.acl.topic.private-*.read": "User:writer",
        **getattr(request, "param", {}),
    }
    config = BrokerConfig(data_dir=data, listen_port=0, shutdown_grace_s=2, security_props=props)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, config)
        ports = [s.socket.getsockname()[1] for s in listeners]
        yield Secured(dict(zip(["PLAINTEXT", "SASL_PLAINTEXT"], ports, strict=True)))
        nursery.cancel_scope.cancel()


async def authenticate(c: RawClient, mechanism: str, user: str, password: str, version: int = 2) -> object:
    r = await c.call("sasl_handshake", 1, {"mechanism": mechanism})
    assert r.error_code == 0 and mechanism in r.mechanisms
    if mechanism == "PLAIN":
        return await c.call("sasl_authenticate", version, {"auth_bytes": f"\0{user}\0{password}".encode()})
    client = ScramClient(mechanism, user, password)
    r = await c.call("sasl_authenticate", version, {"auth_bytes": client.first()})
    assert r.error_code == 0, r
    r2 = await c.call("sasl_authenticate", version, {"auth_bytes": client.final(r.auth_bytes)})
    if r2.error_code == 0:
        assert client.verify(r2.auth_bytes)
    return r2


def metadata_body(topic: str | None = None) -> dict[str, object]:
    return {"topics": None if topic is None else [{"name": topic, "topic_id": None}], "allow_auto_topic_creation": True, "include_topic_authorized_operations": False}


async def test_api_versions_lists_sasl(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await c.call("api_versions", 3, {"client_software_name": "t", "client_software_version": "1"})
    keys = {k.api_key: (k.min_version, k.max_version) for k in r.api_keys}
    assert keys[17] == (0, 1) and keys[36] == (0, 2)


async def test_request_before_authentication_closes(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    await c.send("metadata", 12, metadata_body())
    assert await c.closed()


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_sasl_v1_then_produce_and_metadata_endpoint(secured: Secured, mechanism: str) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await authenticate(c, mechanism, "writer", "w-pw")
    assert r.error_code == 0  # type: ignore[attr-defined]
    m = await c.call("metadata", 12, metadata_body("t-" + mechanism.lower()))
    assert m.topics[0].error_code == 0
    # The endpoint of the listener this connection came in on.
    assert [(b.host, b.port) for b in m.brokers] == [("127.0.0.1", secured.ports["SASL_PLAINTEXT"])]
    p = await produce(c, "t-" + mechanism.lower(), batch([b"v"]))
    assert p.error_code == 0
    plain = await secured.connect("PLAINTEXT")
    m = await plain.call("metadata", 12, metadata_body())
    assert [b.port for b in m.brokers] == [secured.ports["PLAINTEXT"]]


@pytest.mark.parametrize("user,password", [("writer", "nope"), ("ghost", "w-pw")])
@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
async def test_bad_credentials_answer_58_then_close(secured: Secured, mechanism: str, user: str, password: str) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    if mechanism != "PLAIN" and user == "ghost":
        await c.call("sasl_handshake", 1, {"mechanism": mechanism})
        r = await c.call("sasl_authenticate", 2, {"auth_bytes": ScramClient(mechanism, user, password).first()})
    else:
        r = await authenticate(c, mechanism, user, password)
    assert r.error_code == 58 and "Authentication failed" in (r.error_message or "")  # type: ignore[attr-defined]
    assert await refused_then_closed(c)


async def refused_then_closed(c: RawClient) -> bool:
    """After an answer that ends the connection the broker waits for the client to close
    (every real client does on a refusal); then it closes too, at once."""
    await c.stream.send_eof()
    return await c.closed()


async def _after_answer(c: RawClient, within: float) -> str:
    """What follows an answer: "open" (nothing within `within` s), "eof" or "reset"."""
    with trio.move_on_after(within):
        try:
            while await c.stream.receive_some(1 << 16):
                pass  # what a refused client still sends, the broker never answers
        except (trio.BrokenResourceError, ConnectionError):
            return "reset"
        return "eof"
    return "open"


async def test_refusal_reaches_a_client_slow_to_read(secured: Secured) -> None:
    # kafka-python 3.0 drops what arrives in the same read as the end of stream; a client
    # on a loaded machine, late to read, found the refusal and the broker's close together
    # and reported "socket disconnected" instead of the failed authentication.
    c = await secured.connect("SASL_PLAINTEXT")
    await c.call("sasl_handshake", 1, {"mechanism": "PLAIN"})
    sent = await c.send("sasl_authenticate", 2, {"auth_bytes": b"\0writer\0nope"})
    await trio.sleep(0.5)  # late to read
    assert (await c.receive(sent)).error_code == 58
    assert await _after_answer(c, 0.3) == "open"  # the answer came alone
    assert await refused_then_closed(c)


async def test_refused_client_that_stays_is_closed_cleanly_later(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    await c.call("sasl_handshake", 1, {"mechanism": "PLAIN"})
    r = await c.call("sasl_authenticate", 2, {"auth_bytes": b"\0writer\0nope"})
    assert r.error_code == 58
    start = trio.current_time()
    # Bytes the broker never reads would turn its close into a reset, which can discard
    # an answer not yet transmitted; it reads and drops them while it waits.
    await c.send("api_versions", 0, {})
    with trio.fail_after(CLOSE_LINGER_S + 5):
        assert await _after_answer(c, CLOSE_LINGER_S + 4) == "eof"
    assert trio.current_time() - start >= CLOSE_LINGER_S * 0.9


async def test_sasl_handshake_v0_bare_tokens(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await c.call("sasl_handshake", 0, {"mechanism": "SCRAM-SHA-256"})
    assert r.error_code == 0
    client = ScramClient("SCRAM-SHA-256", "writer", "w-pw")
    await c.stream.send_all(frame(client.first()))
    server_first = await c.read_frame()
    await c.stream.send_all(frame(client.final(server_first)))
    assert client.verify(await c.read_frame())
    assert (await produce(c, "v0-topic", batch([b"x"]))).error_code == 0

    bad = await secured.connect("SASL_PLAINTEXT")
    await bad.call("sasl_handshake", 0, {"mechanism": "PLAIN"})
    await bad.stream.send_all(frame(b"\0writer\0wrong"))
    assert await bad.closed()


async def test_unsupported_mechanism_and_plaintext_handshake(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await c.call("sasl_handshake", 1, {"mechanism": "GSSAPI"})
    assert r.error_code == 33 and "PLAIN" in r.mechanisms
    assert await refused_then_closed(c)
    p = await secured.connect("PLAINTEXT")
    assert (await p.call("sasl_handshake", 1, {"mechanism": "PLAIN"})).error_code == 34


async def test_authorization_errors(secured: Secured) -> None:
    anon = await secured.connect("PLAINTEXT")
    m = await anon.call("metadata", 12, metadata_body("anon-made"))
    assert m.topics[0].error_code == 29  # may not auto-create
    w = await secured.connect("SASL_PLAINTEXT")
    await authenticate(w, "SCRAM-SHA-256", "writer", "w-pw")
    assert (await produce(w, "shared", batch([b"a"]))).error_code == 0
    assert (await produce(anon, "shared", batch([b"b"]))).error_code == 29
    r = await secured.connect("SASL_PLAINTEXT")
    await authenticate(r, "SCRAM-SHA-512", "reader", "r-pw")
    assert (await produce(r, "shared", batch([b"c"]))).error_code == 29
    ipid = await r.call("init_producer_id", 4, {"transactional_id": None, "transaction_timeout": 60000, "producer_id": -1, "producer_epoch": -1})
    assert ipid.error_code == 31
    d = await r.call("delete_topics", 6, {"topics": [{"name": "shared", "topic_id": None}], "timeout": 5000})
    assert d.responses[0].error_code == 29
    lo = await anon.call("list_offsets", 7, {"replica_id": -1, "isolation_level": 0, "topics": [{"name": "private-x", "partitions": [{"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1}]}]})
    assert lo.topics[0].partitions[0].error_code == 29
    # Reads stay open to everyone, ANONYMOUS included.
    f = await anon.call("fetch", 12, _fetch("shared"))
    assert f.responses[0].partitions[0].error_code == 0 and f.responses[0].partitions[0].records


def _fetch(topic: str) -> dict[str, object]:
    from broker.tests.test_server import fetch_body

    return fetch_body(topic, 0)  # type: ignore[no-any-return]


async def test_reauthentication_refused_by_default(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await authenticate(c, "PLAIN", "writer", "w-pw")
    assert r.session_lifetime.total_seconds() == 0  # type: ignore[attr-defined]
    assert (await c.call("sasl_handshake", 1, {"mechanism": "PLAIN"})).error_code == 34
    assert await refused_then_closed(c)


@pytest.mark.parametrize("secured", [{"connections.max.reauth.ms": "1500"}], indirect=True)
async def test_reauthentication_honoured(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    r = await authenticate(c, "SCRAM-SHA-256", "writer", "w-pw")
    assert r.session_lifetime.total_seconds() == pytest.approx(1.5)  # type: ignore[attr-defined]
    assert (await c.call("metadata", 12, metadata_body())).brokers
    r = await authenticate(c, "PLAIN", "writer", "w-pw")  # same principal, new mechanism: fine
    assert r.error_code == 0  # type: ignore[attr-defined]
    await trio.sleep(1.6)
    await c.send("metadata", 12, metadata_body())  # the session expired: Kafka closes
    assert await c.closed()
    other = await secured.connect("SASL_PLAINTEXT")
    await authenticate(other, "PLAIN", "writer", "w-pw")
    r = await authenticate(other, "PLAIN", "reader", "r-pw")
    assert r.error_code == 58  # type: ignore[attr-defined]


@pytest.mark.parametrize("secured", [{"connections.max.idle.ms": "300", "hyperkafka.request.timeout.ms": "500"}], indirect=True)
async def test_idle_and_trickling_connections_are_closed(secured: Secured) -> None:
    idle = await secured.connect("PLAINTEXT")
    with trio.fail_after(3):
        assert await _eof(idle)
    slow = await secured.connect("PLAINTEXT")
    body = struct.pack(">hhih", 18, 0, 1, 1) + b"x"
    payload = struct.pack(">i", len(body)) + body
    with trio.fail_after(5):
        for byte in payload[:-1]:
            try:
                await slow.stream.send_all(bytes([byte]))
            except (trio.BrokenResourceError, ConnectionError):
                break
            await trio.sleep(0.1)  # faster than idle, slower than the request timeout
        assert await _eof(slow)
    ok = await secured.connect("PLAINTEXT")
    assert (await ok.call("api_versions", 0, {})).error_code == 0


async def _eof(c: RawClient) -> bool:
    try:
        while await c.stream.receive_some(1 << 16):
            pass
    except (trio.BrokenResourceError, ConnectionError):
        pass
    return True


@pytest.mark.parametrize("secured", [{"hyperkafka.quota.producer.byte.rate": "2000", "hyperkafka.quota.consumer.byte.rate": "2000"}], indirect=True)
async def test_quotas_report_throttle_time(secured: Secured) -> None:
    c = await secured.connect("SASL_PLAINTEXT")
    await authenticate(c, "PLAIN", "writer", "w-pw")
    big = batch([b"x" * 3000])
    first = await c.call("produce", 9, {"acks": 1, "timeout": 5000, "topic_data": [{"name": "q", "partition_data": [{"index": 0, "records": big}]}]})
    assert first.throttle_time.total_seconds() > 0  # 3 KB against 2 KB/s with a 1 s burst
    assert first.responses[0].partition_responses[0].error_code == 0  # the data is still taken
    started = trio.current_time()
    await c.call("api_versions", 0, {})
    assert trio.current_time() - started >= first.throttle_time.total_seconds() * 0.8  # muted meanwhile
    reader = await secured.connect("PLAINTEXT")
    f1 = await reader.call("fetch", 12, _fetch("q"))
    # The same principal on a second connection (the first one is muted).
    f2 = await (await secured.connect("PLAINTEXT")).call("fetch", 12, _fetch("q"))
    # The first fetch is served (3 KB, above the burst) and sets the throttle time...
    assert f1.throttle_time.total_seconds() > 0 and f1.responses[0].partitions[0].records
    # ...the next one, still over quota, gets no data at all (KIP-219), only the time left.
    assert f2.throttle_time.total_seconds() > 0 and f2.responses == ()


# ---------------------------------------------------------------- group rights, hidden topics

GROUP_RULES = {
    "hyperkafka.acl.group.team-*.read": "User:writer",
    "hyperkafka.acl.group.team-*.delete": "User:writer",
}


def _commit(group: str, *topics: str, offset: int = 5) -> dict[str, object]:
    parts = [{"partition_index": 0, "committed_offset": offset, "committed_leader_epoch": -1, "committed_metadata": ""}]
    return {"group_id": group, "generation_id_or_member_epoch": -1, "member_id": "", "group_instance_id": None,
            "topics": [{"name": t, "partitions": parts} for t in topics]}


def _codes(response: object) -> dict[str, list[int]]:
    return {t.name: [p.error_code for p in t.partitions] for t in response.topics}  # type: ignore[attr-defined]


@pytest.mark.parametrize("secured", [GROUP_RULES], indirect=True)
async def test_group_rights(secured: Secured, caplog: pytest.LogCaptureFixture) -> None:
    from broker.tests.test_groups_handlers import join_body

    anon = await secured.connect("PLAINTEXT")
    w = await secured.connect("SASL_PLAINTEXT")
    await authenticate(w, "SCRAM-SHA-256", "writer", "w-pw")
    for topic in ("shared", "private-g"):
        assert (await produce(w, topic, batch([b"x"]))).error_code == 0

    # FindCoordinator needs DESCRIBE on the group: per key from v4, top level before.
    fc = await anon.call("find_coordinator", 4, {"key_type": 0, "coordinator_keys": ["team-a", "free"]})
    assert [(c.key, c.error_code) for c in fc.coordinators] == [("team-a", 30), ("free", 0)]
    assert (await anon.call("find_coordinator", 3, {"key": "team-a", "key_type": 0})).error_code == 30
    assert (await w.call("find_coordinator", 3, {"key": "team-a", "key_type": 0})).error_code == 0

    # Membership needs READ on the group.
    assert (await anon.call("join_group", 9, join_body("team-a"))).error_code == 30
    assert (await anon.call("join_group", 0, {**join_body("team-a"), "member_id": ""})).error_code == 30
    sync = {"group_id": "team-a", "generation_id": 1, "member_id": "m", "group_instance_id": None, "protocol_type": "consumer", "protocol_name": "range", "assignments": []}
    assert (await anon.call("sync_group", 5, sync)).error_code == 30
    assert (await anon.call("heartbeat", 4, {"group_id": "team-a", "generation_id": 1, "member_id": "m", "group_instance_id": None})).error_code == 30
    assert (await anon.call("leave_group", 5, {"group_id": "team-a", "members": [{"member_id": "m", "group_instance_id": None, "reason": None}]})).error_code == 30
    assert (await anon.call("leave_group", 1, {"group_id": "team-a", "member_id": "m"})).error_code == 30
    assert (await w.call("join_group", 9, join_body("team-a", session=10000))).error_code == 79  # MEMBER_ID_REQUIRED: admitted

    # OffsetCommit: the group's READ first, then READ on each topic.
    assert _codes(await anon.call("offset_commit", 9, _commit("team-a", "shared"))) == {"shared": [30]}
    assert _codes(await anon.call("offset_commit", 9, _commit("free", "shared", "private-g"))) == {"shared": [0], "private-g": [29]}
    assert _codes(await w.call("offset_commit", 9, _commit("team-a", "shared", "private-g", offset=7))) == {"shared": [0], "private-g": [0]}
    assert _codes(await w.call("offset_commit", 2, {**_commit("free", "private-g", offset=9), "retention_time": -1})) == {"private-g": [0]}

    # OffsetFetch: GROUP_AUTHORIZATION_FAILED where each version carries it...
    named = [{"name": "shared", "partition_indexes": [0]}, {"name": "private-g", "partition_indexes": [0]}]
    f7 = await anon.call("offset_fetch", 7, {"group_id": "team-a", "topics": named, "require_stable": False})
    assert f7.error_code == 30 and f7.topics == ()
    f1 = await anon.call("offset_fetch", 1, {"group_id": "team-a", "topics": named})
    assert _codes(f1) == {"shared": [30], "private-g": [30]}
    f8 = await anon.call("offset_fetch", 8, {"groups": [{"group_id": "team-a", "topics": None}, {"group_id": "free", "topics": named}], "require_stable": False})
    assert [(g.group_id, g.error_code) for g in f8.groups] == [("team-a", 30), ("free", 0)]
    # ...and a topic the principal may not DESCRIBE: refused when named, left out of "all".
    free = f8.groups[1]
    assert {t.name: [(p.committed_offset, p.error_code) for p in t.partitions] for t in free.topics} == {"shared": [(5, 0)], "private-g": [(-1, 29)]}
    everything = await anon.call("offset_fetch", 7, {"group_id": "free", "topics": None, "require_stable": False})
    assert [t.name for t in everything.topics] == ["shared"]
    mine = await w.call("offset_fetch", 7, {"group_id": "free", "topics": None, "require_stable": False})
    assert sorted((t.name, t.partitions[0].committed_offset) for t in mine.topics) == [("private-g", 9), ("shared", 5)]

    # DescribeGroups / ListGroups need DESCRIBE; ListGroups leaves the others out.
    d = await anon.call("describe_groups", 5, {"groups": ["team-a", "free"], "include_authorized_operations": True})
    assert [(g.group_id, g.error_code) for g in d.groups] == [("team-a", 30), ("free", 0)]
    assert d.groups[1].authorized_operations == (1 << 3) | (1 << 8)  # READ | DESCRIBE, no DELETE for ANONYMOUS
    dw = await w.call("describe_groups", 5, {"groups": ["team-a"], "include_authorized_operations": True})
    assert dw.groups[0].error_code == 0 and dw.groups[0].authorized_operations == (1 << 3) | (1 << 6) | (1 << 8)
    listed = {g.group_id for g in (await anon.call("list_groups", 5, {"states_filter": [], "types_filter": []})).groups}
    assert "free" in listed and "team-a" not in listed
    assert "team-a" in {g.group_id for g in (await w.call("list_groups", 0, {})).groups}

    # DeleteGroups and OffsetDelete need DELETE on the group (a rule; never ANONYMOUS).
    od = await anon.call("offset_delete", 0, {"group_id": "free", "topics": [{"name": "shared", "partitions": [{"partition_index": 0}]}]})
    assert od.error_code == 30
    odw = await w.call("offset_delete", 0, {"group_id": "team-a", "topics": [{"name": "shared", "partitions": [{"partition_index": 0}]}]})
    assert odw.error_code == 0 and _codes(odw) == {"shared": [0]}
    dg = await anon.call("delete_groups", 2, {"groups_names": ["free", "team-a"]})
    assert [(r.group_id, r.error_code) for r in dg.results] == [("free", 30), ("team-a", 30)]
    dg = await w.call("delete_groups", 2, {"groups_names": ["team-a", "free"]})
    assert [(r.group_id, r.error_code) for r in dg.results] == [("team-a", 0), ("free", 30)]
    assert "denied read on group 'team-a' to User:ANONYMOUS" in caplog.text
    assert "denied delete on group 'free' to User:writer" in caplog.text


async def test_topics_hidden_from_who_may_not_describe(secured: Secured) -> None:
    anon = await secured.connect("PLAINTEXT")
    w = await secured.connect("SASL_PLAINTEXT")
    await authenticate(w, "PLAIN", "writer", "w-pw")
    for topic in ("private-hidden", "seen"):
        assert (await produce(w, topic, batch([b"x"]))).error_code == 0
    # All topics: what the principal may not describe is left out.
    names = {t.name for t in (await anon.call("metadata", 12, metadata_body())).topics}
    assert "seen" in names and "private-hidden" not in names
    assert {"seen", "private-hidden"} <= {t.name for t in (await w.call("metadata", 12, metadata_body())).topics}
    # Named: TOPIC_AUTHORIZATION_FAILED, whether or not the topic exists.
    for name in ("private-hidden", "private-never"):
        m = await anon.call("metadata", 12, metadata_body(name))
        assert (m.topics[0].error_code, m.topics[0].partitions) == (29, ())
    assert (await anon.call("metadata", 1, {"topics": [{"name": "private-hidden"}]})).topics[0].error_code == 29
    assert (await w.call("metadata", 12, metadata_body("private-hidden"))).topics[0].error_code == 0
    # DescribeConfigs (DESCRIBE_CONFIGS maps to describe) and OffsetForLeaderEpoch.
    dc = await anon.call("describe_configs", 4, {"resources": [{"resource_type": 2, "resource_name": n, "configuration_keys": None} for n in ("private-hidden", "seen")], "include_synonyms": False, "include_documentation": False})
    assert [(r.resource_name, r.error_code) for r in dc.results] == [("private-hidden", 29), ("seen", 0)]
    assert dc.results[1].configs
    epoch = {"replica_id": -1, "topics": [{"topic": n, "partitions": [{"partition": 0, "current_leader_epoch": -1, "leader_epoch": 0}]} for n in ("private-hidden", "seen")]}
    e = await anon.call("offset_for_leader_epoch", 4, epoch)
    assert [(t.topic, t.partitions[0].error_code) for t in e.topics] == [("private-hidden", 29), ("seen", 0)]

"""broker.security without sockets: SCRAM (RFC 7677 vectors), PLAIN, the credential
file, authorization rules, settings parsing, limits, quotas and certificate principals."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest

from broker.config import BrokerConfig, ConfigError, apply_properties
from broker.security.authz import ANONYMOUS, Authorizer, Operation, Resource, RuleError, parse_rule
from broker.security.limits import ByteRateQuota, ConnectionLimiter
from broker.security.sasl import SaslFailed, SaslServer
from broker.security.scram import (
    ScramClient,
    ScramCredential,
    ScramError,
    ScramServer,
    make_credential,
)
from broker.security.settings import ClientAuth, Protocol, SecuritySettings
from broker.security.tls import principal_from_cert
from broker.security.users import UserStore, UserStoreError

# RFC 7677 section 3.
RFC7677_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC7677_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC7677_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC7677_SERVER_FIRST = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC7677_CLIENT_FINAL = b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
RFC7677_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def rfc_credential() -> ScramCredential:
    return make_credential("SCRAM-SHA-256", "pencil", 4096, RFC7677_SALT)


def test_scram_sha256_server_matches_rfc7677() -> None:
    server = ScramServer("SCRAM-SHA-256", lambda u: rfc_credential() if u == "user" else None, nonce=RFC7677_SERVER_NONCE)
    assert server.step(RFC7677_CLIENT_FIRST) == RFC7677_SERVER_FIRST
    assert server.step(RFC7677_CLIENT_FINAL) == RFC7677_SERVER_FINAL
    assert server.complete and server.username == "user"


def test_scram_client_matches_rfc7677() -> None:
    client = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    assert client.first() == RFC7677_CLIENT_FIRST
    assert client.final(RFC7677_SERVER_FIRST) == RFC7677_CLIENT_FINAL
    assert client.verify(RFC7677_SERVER_FINAL)


def test_scram_wrong_proof_is_refused() -> None:
    server = ScramServer("SCRAM-SHA-256", lambda u: rfc_credential(), nonce=RFC7677_SERVER_NONCE)
    server.step(RFC7677_CLIENT_FIRST)
    bad = RFC7677_CLIENT_FINAL[:-6] + b"AAAAA="
    with pytest.raises(ScramError, match="invalid credentials"):
        server.step(bad)
    with pytest.raises(ScramError):
        server.step(RFC7677_CLIENT_FINAL)  # a failed exchange stays failed


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
@pytest.mark.parametrize("password,ok", [("s3cret", True), ("wrong", False)])
def test_scram_round_trip(mechanism: str, password: str, ok: bool) -> None:
    cred = make_credential(mechanism, "s3cret")
    server = SaslServer(mechanism, lambda m, u: cred if (m, u) == (mechanism, "al,i=ce") else None)
    client = ScramClient(mechanism, "al,i=ce", password)
    final = client.final(server.step(client.first()))
    if ok:
        assert client.verify(server.step(final))
        assert server.principal == "User:al,i=ce"
    else:
        with pytest.raises(SaslFailed):
            server.step(final)
        assert not server.complete


@pytest.mark.parametrize(
    "first",
    [b"p=tls-unique,,n=user,r=abc", b"n,,r=abc,n=user", b"n,a=other,n=user,r=abc", b"n,,n=us=er,r=abc", b"n,,n=user,r=abc,tokenauth=true", b"garbage"],
)
def test_scram_malformed_first_messages(first: bytes) -> None:
    server = ScramServer("SCRAM-SHA-256", lambda u: rfc_credential())
    with pytest.raises(ScramError):
        server.step(first)


def test_scram_final_checks_nonce_and_channel_binding() -> None:
    for final in (
        RFC7677_CLIENT_FINAL.replace(b"c=biws", b"c=eSws"),
        RFC7677_CLIENT_FINAL.replace(b"k0,p=", b"k1,p="),
        b"c=biws,r=x",
    ):
        server = ScramServer("SCRAM-SHA-256", lambda u: rfc_credential(), nonce=RFC7677_SERVER_NONCE)
        server.step(RFC7677_CLIENT_FIRST)
        with pytest.raises(ScramError):
            server.step(final)


def test_unknown_scram_user_is_refused() -> None:
    server = SaslServer("SCRAM-SHA-512", lambda m, u: None)
    with pytest.raises(SaslFailed, match="invalid credentials"):
        server.step(b"n,,n=ghost,r=abc")


def test_plain() -> None:
    cred = make_credential("SCRAM-SHA-512", "pw")

    def lookup(m: str, u: str) -> ScramCredential | None:
        return cred if u == "bob" else None

    ok = SaslServer("PLAIN", lookup)
    assert ok.step(b"\x00bob\x00pw") == b"" and ok.principal == "User:bob"
    assert SaslServer("PLAIN", lookup).step(b"bob\x00bob\x00pw") == b""
    for token in (b"\x00bob\x00nope", b"\x00eve\x00pw", b"alice\x00bob\x00pw", b"bob\x00pw", b"\x00bob\x00"):
        with pytest.raises(SaslFailed):
            SaslServer("PLAIN", lookup).step(token)


def test_user_store_keeps_no_password_and_is_private(tmp_path: Path) -> None:
    store = UserStore.in_data_dir(tmp_path)
    store.add("alice", "correct horse")
    text = store.path.read_text()
    assert "correct horse" not in text
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    doc = json.loads(text)
    assert set(doc["users"]["alice"]) == {"SCRAM-SHA-256", "SCRAM-SHA-512"}
    assert set(doc["users"]["alice"]["SCRAM-SHA-256"]) == {"salt", "iterations", "stored_key", "server_key"}
    # A second store (the broker) sees changes made by the first (the CLI).
    broker_view = UserStore.in_data_dir(tmp_path)
    cred = broker_view.lookup("PLAIN", "alice")
    assert cred is not None and cred.check_password("correct horse") and not cred.check_password("x")
    store.add("bob", "pw2")
    assert broker_view.names() == ["alice", "bob"]
    assert store.remove("alice") and not store.remove("alice")
    assert broker_view.lookup("SCRAM-SHA-256", "alice") is None
    with pytest.raises(UserStoreError):
        store.add("a,b", "pw")
    with pytest.raises(UserStoreError):
        store.add("carol", "")


def test_authorizer_defaults_and_specificity() -> None:
    rules = (
        parse_rule("topic.*.write", "User:alice"),
        parse_rule("topic.logs-*.write+create", "User:bob"),
        parse_rule("topic.logs-audit.write", "User:carol"),
        parse_rule("topic.private-*.read", "User:alice;User:CN=x,O=y"),
        parse_rule("topic.open.v1.write", "User:*"),
    )
    a = Authorizer(rules, frozenset({"User:root"}))
    W, R, C, D = Operation.WRITE, Operation.READ, Operation.CREATE, Operation.DELETE
    assert a.allowed("User:alice", W, "orders")
    assert not a.allowed("User:bob", W, "orders")
    assert a.allowed("User:bob", W, "logs-app") and not a.allowed("User:alice", W, "logs-app")
    assert a.allowed("User:carol", W, "logs-audit") and not a.allowed("User:bob", W, "logs-audit")
    assert a.allowed("User:bob", C, "logs-new") and not a.allowed("User:alice", C, "orders")
    assert a.allowed(ANONYMOUS, R, "orders")  # reads are open by default
    assert not a.allowed(ANONYMOUS, R, "private-x") and a.allowed("User:CN=x,O=y", R, "private-x")
    assert a.allowed("User:anyone", W, "open.v1") and not a.allowed(ANONYMOUS, W, "open.v1")
    assert a.allowed("User:root", D, "anything") and not a.allowed("User:alice", D, "orders")
    assert a.may_write_somewhere("User:bob") and not a.may_write_somewhere(ANONYMOUS)
    assert a.may_write_somewhere("User:dave")  # through the User:* rule on open.v1
    assert not Authorizer(rules[:4]).may_write_somewhere("User:dave")
    opened = Authorizer(secured=False)
    assert opened.allowed(ANONYMOUS, W, "x") and opened.may_write_somewhere(ANONYMOUS)


def test_group_rules_parse_and_most_specific_wins() -> None:
    G = Resource.GROUP
    R, D, X = Operation.READ, Operation.DESCRIBE, Operation.DELETE
    assert parse_rule("group.team-*.all", "User:a").operations == {R, D, X}
    assert parse_rule("group.g.read+describe", "*").resource is G
    assert parse_rule("topic.t.read", "*").resource is Resource.TOPIC
    rules = (
        parse_rule("group.*.delete", "User:ops"),
        parse_rule("group.team-*.read", "User:alice;User:bob"),
        parse_rule("group.team-x.read", "User:bob"),
        parse_rule("group.audit.describe", "User:auditor"),
        parse_rule("topic.team-x.read", "User:nobody"),  # a topic rule says nothing of groups
    )
    a = Authorizer(rules, frozenset({"User:root"}))
    # No group rule matches: anyone may use the group, ANONYMOUS included...
    assert a.allowed(ANONYMOUS, R, "free", G) and a.allowed(ANONYMOUS, D, "free", G)
    # ...but deleting needs a rule, and never ANONYMOUS even through "*".
    assert not a.allowed(ANONYMOUS, X, "free", G) and not a.allowed("User:alice", X, "free", G)
    assert a.allowed("User:ops", X, "free", G) and a.allowed("User:root", X, "free", G)
    assert not Authorizer((parse_rule("group.*.delete", "*"),)).allowed(ANONYMOUS, X, "g", G)
    # Most specific wins: team-x is bob's only, other team-* are alice's and bob's.
    assert a.allowed("User:alice", R, "team-y", G) and not a.allowed("User:carol", R, "team-y", G)
    assert a.allowed("User:bob", R, "team-x", G) and not a.allowed("User:alice", R, "team-x", G)
    assert not a.allowed(ANONYMOUS, R, "team-x", G)
    # DESCRIBE: a describe rule, or implied by READ or DELETE on the group.
    assert a.allowed("User:alice", D, "team-y", G) and not a.allowed("User:alice", D, "team-x", G)
    assert a.allowed("User:ops", D, "team-x", G)  # through delete
    assert a.allowed("User:auditor", D, "audit", G) and a.allowed(ANONYMOUS, D, "audit", G)  # read is open there
    # Group rules do not touch topics of the same name, and the reverse.
    assert a.allowed("User:alice", R, "audit", Resource.TOPIC) and not a.allowed("User:alice", R, "team-x", Resource.TOPIC)
    assert a.operations("User:alice", "team-y", G) == (1 << 3) | (1 << 8)
    assert a.operations("User:ops", "team-x", G) == (1 << 6) | (1 << 8)
    assert Authorizer(rules, secured=False).allowed(ANONYMOUS, X, "team-x", G)


def test_topic_describe_follows_read_write_or_describe_rules() -> None:
    rules = (
        parse_rule("topic.*.write", "User:ingest"),
        parse_rule("topic.hidden-*.read", "User:reader"),
        parse_rule("topic.hidden-*.describe", "User:monitor"),
        parse_rule("topic.secret.read", "User:reader"),
    )
    a = Authorizer(rules)
    D = Operation.DESCRIBE
    assert a.allowed(ANONYMOUS, D, "public")  # read is open, so is describe
    assert not a.allowed(ANONYMOUS, D, "hidden-1") and not a.allowed("User:other", D, "secret")
    assert a.allowed("User:reader", D, "hidden-1") and a.allowed("User:reader", D, "secret")
    assert a.allowed("User:monitor", D, "hidden-1") and not a.allowed("User:monitor", Operation.READ, "hidden-1")
    assert not a.allowed("User:monitor", D, "secret")
    assert a.allowed("User:ingest", D, "secret")  # a writer sees what it writes to (Kafka: WRITE implies DESCRIBE)
    assert Authorizer(rules, frozenset({"User:root"})).allowed("User:root", D, "secret")


@pytest.mark.parametrize(
    "key,value",
    [
        ("cluster.x.read", "User:a"),
        ("topic.x.fly", "User:a"),
        ("topic.a*b.read", "User:a"),
        ("topic.x.read", "alice"),
        ("topic..read", "*"),
        ("group.g.write", "User:a"),  # a group is read, described or deleted, never written
        ("group.g.read+create", "User:a"),
        ("group..read", "User:a"),
        ("group.a*b.read", "User:a"),
    ],
)
def test_bad_rules(key: str, value: str) -> None:
    with pytest.raises(RuleError):
        parse_rule(key, value)


def test_settings_default_is_one_open_plaintext_listener() -> None:
    s = SecuritySettings.parse({}, ("0.0.0.0", 9092))
    [lst] = s.listeners
    assert (lst.name, lst.protocol, lst.port, lst.advertised) == ("PLAINTEXT", Protocol.PLAINTEXT, 9092, ("127.0.0.1", 9092))
    assert not s.secured
    s = SecuritySettings.parse({}, ("127.0.0.1", 9092), ("kafka.example", None))
    assert s.listeners[0].advertised == ("kafka.example", 9092)


def test_settings_several_listeners(tmp_path: Path) -> None:
    props = {
        "listeners": "PLAINTEXT://127.0.0.1:9092,INTERNAL://0.0.0.0:9093,SASL_SSL://127.0.0.1:9094",
        "advertised.listeners": "INTERNAL://broker.internal:19093",
        "listener.security.protocol.map": "INTERNAL:SASL_PLAINTEXT",
        "ssl.keystore.location": str(tmp_path / "k.pem"),
        "ssl.truststore.location": str(tmp_path / "ca.pem"),
        "listener.name.sasl_ssl.ssl.client.auth": "requested",
        "listener.name.internal.sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "max.connections.per.ip": "50",
        "connections.max.idle.ms": "1000",
        "hyperkafka.quota.producer.byte.rate": "1000000",
        "hyperkafka.quota.producer.byte.rate.User:bulk": "5000000",
    }
    s = SecuritySettings.parse(props)
    p, i, ss = s.listeners
    assert p.protocol is Protocol.PLAINTEXT and p.advertised == ("127.0.0.1", 9092)
    assert i.protocol is Protocol.SASL_PLAINTEXT and i.advertised == ("broker.internal", 19093)
    assert i.sasl_mechanisms == ("SCRAM-SHA-512",)
    assert ss.sasl_mechanisms == ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
    assert ss.tls is not None and ss.tls.client_auth is ClientAuth.REQUESTED
    assert s.secured and s.max_connections_per_ip == 50 and s.idle_ms == 1000
    assert s.quotas.producer_rate("User:x") == 1e6 and s.quotas.producer_rate("User:bulk") == 5e6
    assert s.quotas.consumer_rate("User:x") is None


@pytest.mark.parametrize(
    "props,match",
    [
        ({"listeners": "FOO://127.0.0.1:1"}, "unknown security protocol"),
        ({"listeners": "SSL://127.0.0.1:1"}, "ssl.keystore.location"),
        ({"listeners": "PLAINTEXT://127.0.0.1:1,PLAINTEXT://127.0.0.1:2"}, "named twice"),
        ({"listeners": "PLAINTEXT://127.0.0.1:1,X://127.0.0.1:1", "listener.security.protocol.map": "X:SASL_PLAINTEXT"}, "same host and port"),
        ({"listeners": "127.0.0.1:1"}, "NAME://HOST:PORT"),
        ({"advertised.listeners": "SSL://h:1"}, "not in listeners"),
        ({"listeners": "SASL_PLAINTEXT://127.0.0.1:1", "sasl.enabled.mechanisms": "GSSAPI"}, "not supported"),
        ({"max.connections.per.ip": "0"}, "bad value"),
        ({"hyperkafka.acl.topic.x.fly": "User:a"}, "unknown operation"),
        ({"hyperkafka.acl.group.g.write": "User:a"}, "unknown operation 'write' for a group"),
    ],
)
def test_settings_errors(props: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SecuritySettings.parse(props)


def test_properties_file_keys_reach_security() -> None:
    config = apply_properties(
        BrokerConfig(),
        {"listeners": "PLAINTEXT://127.0.0.1:9300,SASL_PLAINTEXT://127.0.0.1:9301", "super.users": "User:admin", "hyperkafka.acl.topic.*.write": "User:w"},
    )
    assert (config.listen_host, config.listen_port) == ("127.0.0.1", 9300)
    assert config.security_props["super.users"] == "User:admin"
    assert SecuritySettings.parse(config.security_props).secured


def test_connection_limiter() -> None:
    lim = ConnectionLimiter(total=3, per_ip=2, overrides={"10.0.0.9": 0})
    assert lim.acquire("a") is None and lim.acquire("a") is None
    assert "per.ip" in (lim.acquire("a") or "")
    assert lim.acquire("b") is None
    assert "max.connections" in (lim.acquire("c") or "")
    lim.release("a")
    assert lim.acquire("c") is None
    assert lim.acquire("10.0.0.9") is not None
    assert lim.open == 3 and lim.by_ip == {"a": 1, "b": 1, "c": 1}


def test_byte_rate_quota() -> None:
    q = ByteRateQuota(window_s=1.0)
    rate = 1000.0
    assert q.record("p", 1000, rate, now=0.0) == 0.0  # one second's worth is a free burst
    assert q.record("p", 1000, rate, now=0.0) == pytest.approx(1.0)
    assert q.record("other", 500, rate, now=0.0) == 0.0  # per principal
    assert q.record("p", 1, rate, now=10.0) == 0.0  # debt is paid off by time
    assert q.excess("p", now=10.0) == 0.0
    q.record("p", 3000, rate, now=10.0)
    assert q.excess("p", now=10.5) == pytest.approx(1.5, abs=0.01)
    q.forget_idle(now=20.0)
    assert q.record("p", 2000, rate, now=20.0) == pytest.approx(1.0)


def test_principal_from_certificate() -> None:
    cert = {"subject": ((("countryName", "DE"),), (("organizationName", "Ex, Inc"),), (("commonName", "writer"),))}
    assert principal_from_cert(cert) == "User:CN=writer,O=Ex\\, Inc,C=DE"
    assert principal_from_cert(None) is None and principal_from_cert({}) is None


def test_cli_listen_replaces_only_the_plaintext_listener(tmp_path: Path) -> None:
    from broker.cli import _parser, build_config

    conf = tmp_path / "server.properties"
    conf.write_text("listeners=PLAINTEXT://127.0.0.1:9092,SASL_PLAINTEXT://127.0.0.1:9093\nsuper.users=User:a\n")
    config = build_config(_parser().parse_args(["serve", "--config", str(conf), "--listen", "127.0.0.1:7000", "--advertised", "h:7001"]))
    s = SecuritySettings.parse(config.security_props)
    assert [(lst.name, lst.port, lst.advertised) for lst in s.listeners] == [
        ("PLAINTEXT", 7000, ("h", 7001)),
        ("SASL_PLAINTEXT", 9093, ("127.0.0.1", 9093)),
    ]
    config = build_config(_parser().parse_args(["serve", "--listen", "127.0.0.1:7000", "--listeners", "SASL_PLAINTEXT://127.0.0.1:7100", "--config", str(conf)]))
    assert config.security_props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:7100"  # --listeners wins
    with pytest.raises(ConfigError):
        build_config(_parser().parse_args(["serve", "--listeners", "SSL://127.0.0.1:7100"]))  # no keystore


def test_users_add_waits_for_another_writer_of_the_credential_file(tmp_path: Path) -> None:
    import fcntl
    import os
    import threading

    store = UserStore.in_data_dir(tmp_path)
    store.add("first", "pw1", iterations=4096)
    fd = os.open(str(store.path) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another `users add` holds the file
    done = threading.Event()
    worker = threading.Thread(target=lambda: (UserStore.in_data_dir(tmp_path).add("second", "pw2", iterations=4096), done.set()))
    worker.start()
    try:
        assert not done.wait(0.5)  # it waits instead of writing back a stale copy
        other = UserStore.in_data_dir(tmp_path)
        other._refresh()
        other._users["third"] = other._users["first"]  # what the holder writes meanwhile
        other._save()
    finally:
        os.close(fd)
    worker.join(10)
    assert done.is_set()
    assert UserStore.in_data_dir(tmp_path).names() == ["first", "second", "third"]

"""The differential oracle: the same raw request script against Apache Kafka and hyperkafka.

A real Apache Kafka KRaft node (the jars of compat_tests/java/pom.xml, started by
`java_tools.KafkaOracle`, with a SASL_PLAINTEXT listener too) and hyperkafka (child
processes, node id 1 like the oracle: one open, one with the same SASL listener) each get
the request script of `compat_tests.oracle`, `compat_tests.oracle_flows` and
`compat_tests.oracle_admin` on fresh data dirs. Their answers, normalised, must agree
field by field, except where compat_tests/FINDINGS.md lists the difference under
"Accepted differences" (with why it is fine). A difference listed under "hyperkafka bugs" still fails (the row only names
it), and so does one listed nowhere. A FINDINGS row that no longer matches anything
fails too, so the file cannot go stale. Every API served is compared at its first
accepted, first flexible and last version, or the coverage test fails.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from compat_tests import oracle, oracle_flows
from compat_tests.harness import Broker, free_port, new_broker
from compat_tests.java_tools import JavaTools, KafkaOracle, require_java
from compat_tests.security_env import add_user


@dataclass
class Runs:
    kafka: list[oracle.Exchange]
    hyperkafka: list[oracle.Exchange]
    kafka_version: str
    seconds: dict[str, float]

    def differences(self) -> list[oracle.Difference]:
        return oracle.compare(self.kafka, self.hyperkafka)


SASL_USER, SASL_PASSWORD = oracle_flows.SASL_USER, oracle_flows.SASL_PASSWORD


def kafka_oracle(tools: JavaTools, workdir: Path, sasl_port: int) -> KafkaOracle:
    """Apache Kafka with a second listener, SASL_PLAINTEXT (PLAIN and SCRAM-SHA-256, one
    user), as our broker gets in `our_broker`."""
    kafka = KafkaOracle(
        tools,
        workdir,
        node_id=1,
        format_args=("--add-scram", f"SCRAM-SHA-256=[name={SASL_USER},password={SASL_PASSWORD}]"),
    )
    plain_jaas = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'user_{SASL_USER}="{SASL_PASSWORD}";'
    )
    kafka.overrides.update(
        {
            "listeners": f"PLAINTEXT://127.0.0.1:{kafka.port},SASL_PLAINTEXT://127.0.0.1:{sasl_port},"
            f"CONTROLLER://127.0.0.1:{kafka.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{kafka.port},SASL_PLAINTEXT://127.0.0.1:{sasl_port}",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-256",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config": plain_jaas,
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
        }
    )
    return kafka


def our_broker(workdir: Path, sasl: bool = False) -> Broker:
    """hyperkafka, node id 1, with the oracle's group delay. With `sasl`, a second one
    whose SASL_PLAINTEXT listener has the oracle's user: a node with any security
    configuration never lets ANONYMOUS write (broker/security/authz.py), so the main
    script cannot share it, while Kafka without an authorizer stays open on PLAINTEXT."""
    data_dir = workdir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    props = {
        "listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "group.initial.rebalance.delay.ms": "0",  # as KafkaOracle's
    }
    if sasl:
        add_user(data_dir, SASL_USER, SASL_PASSWORD)
        props["listeners"] += f",SASL_PLAINTEXT://127.0.0.1:{free_port()}"
        props["listener.security.protocol.map"] = (
            "PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
        )
        props["sasl.enabled.mechanisms"] = "PLAIN,SCRAM-SHA-256"
    conf = workdir / "server.properties"
    conf.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    b = new_broker(
        workdir, data_dir=data_dir, port=port, extra=("--node-id", "1", "--config", str(conf))
    )
    i = b.argv.index("--listen")
    del b.argv[i : i + 2]
    return b


def sasl_port_of(b: Broker) -> int:
    conf = (b.data_dir.parent / "server.properties").read_text()
    return int(conf.split("SASL_PLAINTEXT://127.0.0.1:")[1].split(",")[0].split()[0])


@pytest.fixture(scope="module")
def runs() -> Iterator[Runs]:
    lib = require_java()
    tools = JavaTools(lib)
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hk-oracle-") as tmp:
        kafka_sasl = free_port()
        kafka = kafka_oracle(tools, Path(tmp) / "kafka", kafka_sasl)
        ours = our_broker(Path(tmp) / "hyperkafka")
        ours_secured = our_broker(Path(tmp) / "hyperkafka-sasl", sasl=True)
        t0 = time.monotonic()
        kafka.start()
        seconds["kafka start"] = time.monotonic() - t0
        try:
            ours.start()
            ours_secured.start()
            try:
                t0 = time.monotonic()
                theirs_ex = oracle_flows.run_all("127.0.0.1", kafka.port, kafka_sasl)
                seconds["script on kafka"] = time.monotonic() - t0
                t0 = time.monotonic()
                ours_ex = oracle_flows.run_all("127.0.0.1", ours.port, sasl_port_of(ours_secured))
                seconds["script on hyperkafka"] = time.monotonic() - t0
            finally:
                assert ours.stop() == 0, ours.log_tail()
                assert ours_secured.stop() == 0, ours_secured.log_tail()
        finally:
            t0 = time.monotonic()
            code = kafka.stop()
            seconds["kafka stop"] = time.monotonic() - t0
        # The JVM answers SIGTERM by running its shutdown hooks and exiting 143 (128+15).
        assert code in (0, 143), kafka.log_tail()
        yield Runs(theirs_ex, ours_ex, tools.version, seconds)


def test_both_brokers_ran_the_whole_script(runs: Runs) -> None:
    print(
        f"\nApache Kafka {runs.kafka_version}; "
        + ", ".join(f"{k} {v:.1f}s" for k, v in runs.seconds.items())
    )
    assert [e.step for e in runs.kafka] == [e.step for e in runs.hyperkafka]
    assert len(runs.kafka) >= 150


@pytest.mark.matrix("differential vs Apache Kafka", client="kafka-oracle")
def test_no_unexplained_differences(runs: Runs) -> None:
    explained = oracle.explain(runs.differences(), oracle.load_findings())
    missing = [d for d, f in explained if f is None]
    if missing:
        lines = "\n".join(f"  {d}" for d in missing)
        pytest.fail(
            f"{len(missing)} differences from Apache Kafka {runs.kafka_version} that "
            f"compat_tests/FINDINGS.md does not list (fix hyperkafka, or add a row saying "
            f"why the difference is fine):\n{lines}"
        )


def test_every_finding_still_occurs(runs: Runs) -> None:
    diffs = runs.differences()
    stale = [f for f in oracle.load_findings() if not any(f.matches(d) for d in diffs)]
    assert not stale, (
        "FINDINGS.md rows that match no difference any more (remove them):\n"
        + "\n".join(f"  line {f.line}: {f.api} | {f.versions} | {f.path}" for f in stale)
    )


@pytest.mark.matrix("known bugs vs Apache Kafka", client="kafka-oracle")
def test_known_hyperkafka_bugs(runs: Runs) -> None:
    """A difference that is our bug fails CI: listing it under "hyperkafka bugs" names it
    and its cause, it does not excuse it."""
    bugs = [
        (d, f)
        for d, f in oracle.explain(runs.differences(), oracle.load_findings())
        if f and f.table == "bug"
    ]
    if bugs:
        pytest.fail(
            f"{len(bugs)} differences are known hyperkafka bugs (FINDINGS.md); fix them:\n"
            + "\n".join(f"  {d}  <- line {f.line}" for d, f in bugs)
        )


def test_every_served_api_is_compared_at_its_first_flexible_and_last_versions(runs: Runs) -> None:
    """Every API in the broker's registry, at its first accepted, first flexible and last
    version, answered by both brokers (a newly served API or version must join the script)."""
    targets = oracle_flows.target_versions()
    for side, exchanges in (("kafka", runs.kafka), ("hyperkafka", runs.hyperkafka)):
        covered = oracle_flows.coverage(exchanges)
        missing = {
            api: sorted(v - covered.get(api, set()))
            for api, v in targets.items()
            if v - covered.get(api, set())
        }
        assert not missing, f"not compared on {side}: {missing}"
    pairs = sum(len(v) for v in oracle_flows.coverage(runs.kafka).values())
    print(
        f"\ncompared: {len(oracle_flows.coverage(runs.kafka))} APIs, {pairs} (api, version) pairs"
    )


# ------------------------------------------------------ the machinery itself (no broker)


def test_findings_table_is_well_formed() -> None:
    findings = oracle.load_findings()
    assert findings, "FINDINGS.md has no rows"
    names = set(oracle.API_NAMES.values()) | {"*"}
    for f in findings:
        assert f.api in names, f"line {f.line}: unknown api {f.api!r}"
        oracle._version_matches(f.versions, 0)  # parses, or raises ValueError
        assert f.path and f.reason, f"line {f.line}: empty path or reason"


def test_diff_matches_keyed_structs_and_reports_paths() -> None:
    a = {"topics": [{"name": "x", "partitions": [{"partition_index": 0, "e": 1}]}, {"name": "y"}]}
    b = {"topics": [{"name": "y"}, {"name": "x", "partitions": [{"partition_index": 0, "e": 2}]}]}
    assert list(oracle.diff(a, b)) == [("topics[x].partitions[0].e", 1, 2)]
    assert list(oracle.diff({"v": [1, 2]}, {"v": [1]})) == [("v.length", 2, 1)]
    assert list(oracle.diff({"k": None}, {"k": []})) == [("k", None, [])]


def test_finding_glob_and_versions() -> None:
    f = oracle.Finding(
        "accepted", "Fetch", "4-12", "responses[*].partitions[*].high_watermark", "r", 1
    )
    d = oracle.Difference("s", "Fetch", 12, "responses[t].partitions[0].high_watermark", -1, 9)
    assert f.matches(d)
    assert not f.matches(oracle.Difference("s", "Fetch", 13, d.path, -1, 9))
    assert not f.matches(oracle.Difference("s", "Fetch", 12, d.path + "x", -1, 9))


def test_fixed_batch_is_valid_magic_2() -> None:
    batch = oracle.script_batch()
    (described,) = oracle.describe_records(batch)
    assert described["crc_valid"] and described["magic"] == 2
    assert described["records_count"] == 3 and described["last_offset_delta"] == 2
    assert described["max_timestamp"] == oracle.T0 + 20


def test_bracket_star_matches_one_key_and_where_absent_narrows() -> None:
    whole = oracle.Finding("accepted", "ApiVersions", "3", "api_keys[*]", "r", 1, "hyperkafka")
    entry = oracle.Difference("s", "ApiVersions", 3, "api_keys[68]", {"api_key": 68}, oracle.ABSENT)
    assert whole.matches(entry)
    # Not a field inside an entry both have, nor an entry only hyperkafka has.
    assert not whole.matches(
        oracle.Difference("s", "ApiVersions", 3, "api_keys[11].min_version", 2, 0)
    )
    assert not whole.matches(
        oracle.Difference("s", "ApiVersions", 3, "api_keys[68]", oracle.ABSENT, {"api_key": 68})
    )
    deep = oracle.Finding("accepted", "Fetch", "12", "responses[*].partitions[*].x*", "r", 1)
    assert deep.matches(oracle.Difference("s", "Fetch", 12, "responses[t].partitions[0].x.y", 1, 2))


def test_findings_rows_parse_where_absent(tmp_path: Path) -> None:
    f = tmp_path / "F.md"
    f.write_text(
        "## Accepted differences\n| api | version | field path | reason |\n|---|---|---|---|\n"
        "| ApiVersions | 0-4 | `api_keys[*]` where hyperkafka=<absent> | why |\n"
        "| Fetch | 12 | `a.b` | why | more |\n"
    )
    rows = oracle.load_findings(f)
    assert [(r.path, r.absent_in, r.reason) for r in rows] == [
        ("api_keys[*]", "hyperkafka", "why"),
        ("a.b", None, "why | more"),
    ]


def test_member_ids_are_labelled_in_order_of_first_appearance() -> None:
    ex = [
        oracle.Exchange(
            "j",
            "JoinGroup",
            9,
            {"member_id": "c-1f", "leader": "c-1f", "members": [{"member_id": "c-1f"}]},
        ),
        oracle.Exchange(
            "k", "JoinGroup", 9, {"member_id": "c-2a", "leader": "c-1f", "members": []}
        ),
        oracle.Exchange("l", "LeaveGroup", 5, {"members": [{"member_id": ""}]}),
    ]
    got = [e.response for e in oracle.relabel_members(ex)]
    assert got[0] == {
        "member_id": "<member-1>",
        "leader": "<member-1>",
        "members": [{"member_id": "<member-1>"}],
    }
    assert got[1] == {"member_id": "<member-2>", "leader": "<member-1>", "members": []}
    assert got[2] == {"members": [{"member_id": ""}]}  # the empty id is meaningful: kept


@pytest.mark.parametrize("codec", sorted(oracle_flows.CODECS))
def test_compressed_batches_are_valid_and_decompress_to_the_script_records(codec: str) -> None:
    from broker.protocol.records import decode_records, parse_batch_header, verify_crc

    batch = oracle_flows.compressed_batch(codec)
    verify_crc(batch)
    header = parse_batch_header(batch)
    assert header.attributes & 0x07 == oracle_flows.CODECS[codec]
    assert [(r.key, r.value) for r in decode_records(batch)] == [
        (r.key, r.value) for r in decode_records(oracle.script_batch())
    ]
    bad = oracle_flows.compressed_batch(codec, corrupt=True)
    verify_crc(bad)  # still a valid CRC: only the compressed bytes are damaged


def test_consumer_protocol_bytes() -> None:
    assert oracle_flows.subscription("t") == bytes.fromhex("000000000001000174ffffffff")
    assert oracle_flows.assignment({"t": [0, 2]}) == bytes.fromhex(
        "000000000001000174000000020000000000000002ffffffff"
    )

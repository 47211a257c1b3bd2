"""The client matrix: one `Client` per real Kafka client, each able to produce and consume.

Owns how each client is driven (kcat, node and the Go driver hkgo as subprocesses, the
Python clients through compat_tests.workers.pyclient in their own process), what each can express (`Profile`) and
which codecs it is tested with. Also the small in-test admin helpers (create/delete a topic
through kafka-python's admin client). Imports the standard library, pytest and the
compat_tests modules; the Python Kafka clients only inside functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compat_tests import harness
from compat_tests.harness import Broker
from compat_tests.records import Profile, Record, read_jsonl, write_jsonl

ALL_CODECS = ("none", "gzip", "snappy", "lz4", "zstd")

# kcat splits its input on single delimiter bytes; generated data avoids these two.
KCAT_KEY_DELIM = 0x1F
KCAT_MSG_DELIM = 0x1E
KCAT_HEADERS = (("hk-a", b"1"), ("hk-b", b"two"))
# librdkafka's text for a broker error (rd_kafka_err2str) -> the Kafka error code.
KCAT_ERROR_CODES = {"Broker: Message size too large": 10}


@dataclass(frozen=True)
class Client:
    name: str
    profile: Profile
    codecs: tuple[str, ...]

    def available(self) -> tuple[bool, str]:
        if self.name in ("kcat-old", "kcat-new"):
            kc, why = harness.find_kcat(self.name.split("-")[1])
            return kc is not None, why
        if self.name == "kafkajs":
            node, why = harness.find_node_kafkajs()
            return node is not None, why
        if self.name in GO_CLIENTS:
            hkgo, why = harness.find_hkgo()
            return hkgo is not None, why
        module = {"kafka-python": "kafka", "confluent": "confluent_kafka", "aiokafka": "aiokafka"}[
            self.name
        ]
        try:
            __import__(module)
        except ImportError as e:
            return False, f"{self.name} not importable: {e}"
        return True, ""

    def require(self) -> None:
        ok, why = self.available()
        harness.require(ok, why)

    # -- produce / consume ---------------------------------------------------------------

    def produce(
        self,
        broker: Broker,
        topic: str,
        records: list[Record],
        workdir: Path,
        *,
        codec: str = "none",
        timeout: float = 240.0,
        extra: tuple[str, ...] = (),
        allow_errors: bool = False,
    ) -> dict[str, Any]:
        """Produce `records` to partition 0: {"n", "offsets": [first, last], ...}.

        With `allow_errors`, records the broker refuses are reported, not raised:
        {"n": delivered, "error_codes": {"code": count}, "errors": [text as the client
        surfaced it]} (the Go driver reports codes only). `extra` goes to the worker's command
        line (kcat's: e.g. ("-X", "enable.idempotence=true")).
        """
        if self.name.startswith("kcat"):
            return _kcat_produce(
                self, broker, topic, records, workdir, codec, timeout, allow_errors, extra
            )
        if allow_errors:
            extra = (*extra, "--allow-errors")
        infile = workdir / f"{self.name}-produce-{topic}.jsonl"
        write_jsonl(infile, records)
        args = [
            "produce",
            "--bootstrap",
            broker.bootstrap,
            "--topic",
            topic,
            "--codec",
            codec,
            "--infile",
            str(infile),
            *extra,
        ]
        return self._run_worker(args, timeout)

    def consume(
        self,
        broker: Broker,
        topic: str,
        count: int,
        workdir: Path,
        *,
        offset: int = 0,
        timeout: float = 240.0,
        extra: tuple[str, ...] = (),
    ) -> tuple[list[Record], int | None]:
        """Assign-mode read of partition 0 from `offset` until `count` records (or time out);
        `extra` goes to the worker's command line (not kcat's)."""
        if self.name.startswith("kcat"):
            return _kcat_consume(self, broker, topic, workdir, offset, timeout)
        outfile = workdir / f"{self.name}-consume-{topic}.jsonl"
        args = [
            "consume",
            "--bootstrap",
            broker.bootstrap,
            "--topic",
            topic,
            "--outfile",
            str(outfile),
            "--count",
            str(count),
            "--offset",
            str(offset),
            "--timeout",
            str(max(5.0, timeout - 20)),
            *extra,
        ]
        summary = self._run_worker(args, timeout)
        return read_jsonl(outfile), int(summary["high_watermark"])

    def _run_worker(self, args: list[str], timeout: float) -> dict[str, Any]:
        if self.name == "kafkajs":
            node, _ = harness.find_node_kafkajs()
            assert node is not None
            argv = [node, str(harness.JS_DIR / "worker.js"), *args]
            env = dict(os.environ, KAFKAJS_NO_PARTITIONER_WARNING="1")
        elif self.name in GO_CLIENTS:
            hkgo, why = harness.find_hkgo()
            if hkgo is None:
                raise AssertionError(why)
            argv = [hkgo, self.name, *args]
            env = dict(os.environ)
        else:
            argv = [sys.executable, "-m", "compat_tests.workers.pyclient", self.name, *args]
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p
            )
        return run_json(argv, timeout, env=env, label=f"{self.name} {args[0]}")


def go_admin(client: str, op: str, broker: Broker, *args: str, timeout: float = 60.0) -> dict[str, Any]:
    """One admin operation through franz-go (kadm) or sarama (ClusterAdmin): its JSON answer."""
    hkgo, why = harness.find_hkgo()
    if hkgo is None:
        raise AssertionError(why)
    argv = [hkgo, client, "admin", op, "--bootstrap", broker.bootstrap, *args]
    argv += ["--timeout", str(timeout - 10)]
    return run_json(argv, timeout, env=dict(os.environ), label=f"{client} admin {op}")


# Clients whose topic admin (create/list/describe/delete, describe configs) the tests drive
# through `client_admin`; kafka-python's topic admin runs in-process in
# test_metadata_admin.py, its describe configs here (the only op pyadmin has for it).
ADMIN_CLIENTS = ("confluent", "aiokafka", "kafkajs", "franz-go", "sarama")


def client_admin(client: str, op: str, broker: Broker, *args: str, timeout: float = 60.0) -> dict[str, Any]:
    """One admin operation (create, list, describe, delete, configs) through `client`'s own
    admin API, answered in one shape whatever the client (see compat_tests/workers/pyadmin.py)."""
    if client in GO_CLIENTS:
        return go_admin(client, op, broker, *args, timeout=timeout)
    tail = [op, "--bootstrap", broker.bootstrap, *args, "--timeout", str(timeout - 10)]
    if client == "kafkajs":
        node, why = harness.find_node_kafkajs()
        if node is None:
            raise AssertionError(why)
        argv = [node, str(harness.JS_DIR / "admin.js"), *tail]
        env = dict(os.environ)
    else:
        argv = [sys.executable, "-m", "compat_tests.workers.pyadmin", client, *tail]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p)
    return run_json(argv, timeout, env=env, label=f"{client} admin {op}")


def run_json(argv: list[str], timeout: float, *, env: dict[str, str], label: str) -> dict[str, Any]:
    """Run a worker; return the JSON on its last stdout line or raise with its stderr."""
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv, capture_output=True, timeout=timeout, env=env, cwd=harness.ROOT, check=False
        )
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode("utf-8", "replace")[-3000:]
        raise AssertionError(f"{label} timed out after {timeout}s\nstderr tail:\n{err}") from None
    err = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise AssertionError(f"{label} exited {proc.returncode}\nstderr tail:\n{err[-4000:]}")
    lines = proc.stdout.decode("utf-8", "replace").strip().splitlines()
    if not lines:
        raise AssertionError(f"{label} printed no summary\nstderr tail:\n{err[-4000:]}")
    summary: dict[str, Any] = json.loads(lines[-1])
    summary["seconds"] = round(time.monotonic() - started, 2)
    return summary


# ---------------------------------------------------------------------------- kcat


def _kcat(client: Client) -> harness.Kcat:
    kc, why = harness.find_kcat(client.name.split("-")[1])
    if kc is None:
        raise AssertionError(why)
    return kc


def _kcat_produce(
    client: Client,
    broker: Broker,
    topic: str,
    records: list[Record],
    workdir: Path,
    codec: str,
    timeout: float,
    allow_errors: bool = False,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    kc = _kcat(client)
    payload = bytearray()
    for r in records:
        if r.headers != KCAT_HEADERS:
            raise ValueError("kcat sends the same -H headers with every record")
        payload += r.key or b""
        payload.append(KCAT_KEY_DELIM)
        payload += r.value or b""
        payload.append(KCAT_MSG_DELIM)
    infile = workdir / f"{client.name}-produce-{topic}.bin"
    infile.write_bytes(bytes(payload))
    args = ["-b", broker.bootstrap, "-P", "-t", topic, "-p", "0", "-K", "\\x1f", "-D", "\\x1e"]
    args += ["-Z", "-X", "acks=all", "-X", "message.max.bytes=4194304", "-m", "30"]
    if codec != "none":
        args += ["-z", codec]
    for name, value in KCAT_HEADERS:
        args += ["-H", f"{name}={value.decode()}"]
    args += [*extra, "-l", str(infile)]
    started = time.monotonic()
    proc = kc.run(args, timeout=timeout, check=not allow_errors)
    err = proc.stderr.decode("utf-8", "replace")
    seconds = round(time.monotonic() - started, 2)
    # kcat prints one line per delivery report that failed (the broker's answer); what
    # librdkafka refuses before sending is "% ERROR: ..." or "Failed to produce".
    refused = [ln for ln in err.splitlines() if "Delivery failed for message" in ln]
    if allow_errors and not any(bad in err for bad in ("% ERROR", "Failed to produce")):
        codes: dict[str, int] = {}
        for ln in refused:
            code = str(KCAT_ERROR_CODES.get(ln.split(": ", 1)[-1].strip(), -1))
            codes[code] = codes.get(code, 0) + 1
        return {"n": len(records) - len(refused), "error_codes": codes, "errors": refused, "seconds": seconds}
    if any(bad in err for bad in ("Delivery failed", "% ERROR", "Failed to produce")):
        raise AssertionError(f"{client.name} produce reported errors:\n{err[-4000:]}")
    return {"n": len(records), "seconds": seconds}


def _kcat_consume(
    client: Client, broker: Broker, topic: str, workdir: Path, offset: int, timeout: float
) -> tuple[list[Record], int | None]:
    kc = _kcat(client)
    start = "beginning" if offset == 0 else str(offset)
    args = ["-b", broker.bootstrap, "-C", "-t", topic, "-p", "0", "-o", start, "-e", "-q"]
    args += ["-X", "fetch.message.max.bytes=4194304", "-m", "30"]
    args += ["-f", "%o %K %S %T %h\\n%k%s"]
    proc = kc.run(args, timeout=timeout)
    # kcat reports no high watermark; the tests read it through another client.
    return parse_kcat_format(proc.stdout), None


def parse_kcat_format(data: bytes) -> list[Record]:
    """Parse output of -f '%o %K %S %T %h\\n%k%s': a text line, then raw key and value."""
    out: list[Record] = []
    pos = 0
    while pos < len(data):
        nl = data.index(b"\n", pos)
        fields = data[pos:nl].decode("ascii").split(" ", 4)
        offset, klen, vlen, ts = (int(x) for x in fields[:4])
        hdr_text = fields[4] if len(fields) > 4 else ""
        pos = nl + 1
        key = None if klen < 0 else data[pos : pos + klen]
        pos += max(klen, 0)
        value = None if vlen < 0 else data[pos : pos + vlen]
        pos += max(vlen, 0)
        headers: list[tuple[str, bytes | None]] = []
        for item in filter(None, hdr_text.split(",")):
            name, _, v = item.partition("=")
            headers.append((name, v.encode()))
        out.append(Record(key, value, tuple(headers), ts, offset))
    return out


# ---------------------------------------------------------------------------- the matrix

# Driven by compat_tests/go (the hkgo binary): `hkgo CLIENT produce|consume|group|admin`.
GO_CLIENTS = ("franz-go", "sarama")

_KCAT_PROFILE = Profile(
    empty_distinct=False,
    duplicate_header_names=False,
    fixed_headers=KCAT_HEADERS,
    forbidden=frozenset({KCAT_KEY_DELIM, KCAT_MSG_DELIM}),
)

CLIENTS: dict[str, Client] = {
    c.name: c
    for c in (
        Client("kcat-old", _KCAT_PROFILE, ALL_CODECS),
        Client("kcat-new", _KCAT_PROFILE, ALL_CODECS),
        Client("confluent", Profile(header_null_value=True), ALL_CODECS),
        Client("kafka-python", Profile(null_both=False), ALL_CODECS),
        Client("aiokafka", Profile(null_both=False), ALL_CODECS),
        Client("kafkajs", Profile(duplicate_header_names=False), ("none", "gzip")),
        # Both keep null apart from empty for keys, values and header values.
        Client("franz-go", Profile(header_null_value=True), ALL_CODECS),
        Client("sarama", Profile(header_null_value=True), ALL_CODECS),
    )
}


# ---------------------------------------------------------------------------- admin helpers


def admin(broker: Broker) -> Any:
    from kafka.admin import KafkaAdminClient

    return KafkaAdminClient(
        bootstrap_servers=broker.bootstrap, client_id="hk-compat-admin", request_timeout_ms=20_000
    )


def create_topic(broker: Broker, name: str, partitions: int = 1) -> None:
    """Create a topic through the admin API (CreateTopics) and wait until Metadata has it."""
    from kafka.admin import NewTopic

    a = admin(broker)
    try:
        res = a.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)], timeout_ms=20_000
        )
        for t in _topic_results(res):
            if t.get("error_code", 0) not in (0,):
                raise AssertionError(f"CreateTopics {name}: {t}")
        deadline = time.monotonic() + 20
        while name not in a.list_topics():
            if time.monotonic() > deadline:
                raise AssertionError(f"topic {name} not in Metadata 20 s after CreateTopics")
            time.sleep(0.1)
    finally:
        a.close()


def _topic_results(res: Any) -> list[dict[str, Any]]:
    if isinstance(res, dict):
        return list(res.get("topics") or res.get("topic_errors") or [])
    topics = getattr(res, "topics", None) or getattr(res, "topic_errors", None) or []
    return [t if isinstance(t, dict) else {"error_code": t[1]} for t in topics]


def end_offset(broker: Broker, topic: str, partition: int = 0) -> int:
    """The partition's high watermark as ListOffsets(-1) reports it (through kafka-python)."""
    from kafka import KafkaConsumer, TopicPartition

    tp = TopicPartition(topic, partition)
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=None, enable_auto_commit=False)
    try:
        return int(c.end_offsets([tp])[tp])
    finally:
        c.close()

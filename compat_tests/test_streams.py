"""A Kafka Streams word count with exactly_once_v2 over hyperkafka, through crashes.

compat_tests/java/StreamsWordCount.java (Kafka Streams from the pinned jars) reads words
from a topic, regroups them by word (a repartition topic, purged with DeleteRecords),
counts them in a RocksDB store whose changelog is a compacted topic, and writes every new
count to an output topic; caching is off, so every word counted writes one count. The
words are produced here with an idempotent confluent-kafka producer, and only what was
acknowledged is counted. A read_committed consumer then reads the output: for every word,
the counts it shows must be exactly 1, 2, ..., n with n the number of times the word was
acknowledged: no count lost, none repeated, none from an aborted transaction. That holds:

1. across a kill -9 of the Streams process mid-run (restarted on its state dir, it resumes);
2. across a kill -9 of the broker mid-run (restarted on the same data dir and port);
3. after the local state dir is wiped, once the cleaner compacted the changelog (whose
   batches are all transactional): the store is restored from the compacted changelog
   exactly, and `hyperkafka verify` passes on the data dir.

Imports the standard library, pytest, confluent-kafka and the compat_tests modules.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from compat_tests.harness import ROOT, Broker, configured_broker, verified
from compat_tests.java_tools import LOG4J_CONFIG, java_binary, require_java

PARTITIONS = 3
VOCABULARY = [f"word{i:02d}" for i in range(30)]
CLASSES = ROOT / "compat_tests" / ".tools" / "java-classes"
BROKER_PROPERTIES = {"log.cleaner.backoff.ms": "200"}


@pytest.fixture(scope="module")
def classpath() -> str:
    lib = require_java()
    if not (CLASSES / "StreamsWordCount.class").is_file():
        why = "StreamsWordCount is not compiled: run compat_tests/java/setup.sh"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return f"{CLASSES}{os.pathsep}{lib.resolve()}/*"


class WordCount:
    """One StreamsWordCount process; its JSON lines go to a file the test reads."""

    def __init__(
        self, classpath: str, broker: Broker, app_id: str, state_dir: Path, out: Path
    ) -> None:
        self.argv = [
            java_binary() or "java",
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp",
            classpath,
            "StreamsWordCount",
            *("--bootstrap", broker.bootstrap, "--app-id", app_id),
            *("--input", f"{app_id}-words", "--output", f"{app_id}-counts"),
            *("--state-dir", str(state_dir), "--timeout", "240"),
        ]
        self.out = out
        self.runs = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.runs += 1
        self.log = self.out.with_suffix(f".{self.runs}.out")
        with (
            self.log.open("wb") as out,
            self.out.with_suffix(f".{self.runs}.err").open("wb") as err,
        ):
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL
            )

    def events(self) -> list[dict[str, object]]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def processed(self) -> int:
        return max([int(str(e["n"])) for e in self.events() if e["ev"] == "processed"], default=0)

    def wait_processed(self, n: int, timeout: float = 60) -> None:
        """Until this run counted at least `n` words (printed every 200)."""
        deadline = time.monotonic() + timeout
        while self.processed() < n:
            assert self.proc is not None and self.proc.poll() is None, (
                f"Streams app exited\n{self.tail()}"
            )
            assert time.monotonic() < deadline, (
                f"Streams app counted {self.processed()} < {n}\n{self.tail()}"
            )
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, (
            f"Streams app exited\n{self.tail()}"
        )
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM: a clean close (its state checkpointed). Must not have died before."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        alive = proc.poll() is None
        if alive:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert alive, f"Streams app died with status {proc.returncode}\n{self.tail()}"

    def tail(self) -> str:
        err = self.log.with_suffix(".err")
        text = err.read_text(errors="replace") if err.exists() else ""
        lines = [ln for ln in text.splitlines() if "ERROR" in ln or "Exception" in ln]
        return "\n".join((lines or text.splitlines())[-30:])


def create_topics(broker: Broker, app_id: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for name in (f"{app_id}-words", f"{app_id}-counts"):
        admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(timeout=30)


def produce(broker: Broker, app_id: str, n: int, rng: random.Random) -> Counter[str]:
    """`n` random words, idempotently; returns the words acknowledged (all, or it fails)."""
    import confluent_kafka as ck

    acked: Counter[str] = Counter()
    errors: list[object] = []

    def report(err, msg) -> None:  # type: ignore[no-untyped-def]
        if err is None:
            acked[msg.value().decode()] += 1
        else:
            errors.append(err)

    p = ck.Producer(
        {"bootstrap.servers": broker.bootstrap, "enable.idempotence": True, "linger.ms": 5}
    )
    for i in range(n):
        p.produce(f"{app_id}-words", key=str(i), value=rng.choice(VOCABULARY), on_delivery=report)
        p.poll(0)
    assert p.flush(60) == 0
    assert not errors, errors[:3]
    assert sum(acked.values()) == n
    return acked


def read_committed(broker: Broker, topic: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of `topic` a read_committed consumer sees, up to the end of
    each partition (its last stable offset)."""
    import confluent_kafka as ck

    c = ck.Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": f"streams-check-{uuid.uuid4().hex[:6]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    out: list[tuple[bytes, bytes]] = []
    try:
        c.assign([ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in range(PARTITIONS)])
        at_end: set[int] = set()
        deadline = time.monotonic() + 30
        while len(at_end) < PARTITIONS:
            assert time.monotonic() < deadline, f"{topic}: no end of partitions {at_end} in 30 s"
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                assert m.error().code() == ck.KafkaError._PARTITION_EOF, m.error()
                at_end.add(m.partition())
                continue
            at_end.discard(m.partition())
            out.append((bytes(m.key()), bytes(m.value())))
        return out
    finally:
        c.close()


def counts_seen(broker: Broker, app_id: str) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = {}
    for word, count in read_committed(broker, f"{app_id}-counts"):
        seen.setdefault(word.decode(), []).append(int(count))
    return seen


def wait_exact_counts(broker: Broker, app: WordCount, app_id: str, acked: Counter[str]) -> None:
    """Until the output shows every acknowledged word counted, then: each word's counts
    are exactly 1..n, in order (none lost, none twice, nothing of an aborted transaction)."""
    expected = {w: list(range(1, n + 1)) for w, n in acked.items()}
    deadline = time.monotonic() + 90
    while True:
        seen = counts_seen(broker, app_id)
        last = {w: c[-1] for w, c in seen.items()}
        if last == dict(acked) or time.monotonic() > deadline:
            break
        assert app.proc is not None and app.proc.poll() is None, f"Streams app exited\n{app.tail()}"
        time.sleep(0.5)
    wrong = {w: (seen.get(w, [])[-5:], n) for w, n in acked.items() if seen.get(w) != expected[w]}
    assert not wrong, f"word: (last counts seen, acknowledged) {wrong}\n{app.tail()}"
    assert seen.keys() == acked.keys()


@pytest.fixture
def app_id() -> str:
    return f"wc-{uuid.uuid4().hex[:8]}"


def exact_counts_across(
    fault: Callable[[Broker, WordCount], None], seed: int, workdir: Path, classpath: str, app_id: str
) -> None:
    """3000 words counted in part, `fault` mid-run (a transaction open, words left to
    count), 1000 more words: every word's counts are exactly 1..n of its acknowledged
    sends (`wait_exact_counts`)."""
    rng = random.Random(seed)
    with configured_broker(workdir / "broker", BROKER_PROPERTIES) as broker:
        create_topics(broker, app_id)
        acked = produce(broker, app_id, 3000, rng)
        app = WordCount(classpath, broker, app_id, workdir / "state", workdir / "app")
        try:
            app.start()
            app.wait_processed(800)
            fault(broker, app)
            acked += produce(broker, app_id, 1000, rng)
            wait_exact_counts(broker, app, app_id, acked)
        finally:
            app.stop()


def kill_app(broker: Broker, app: WordCount) -> None:
    app.kill()  # SIGKILL: its open transaction is aborted when the new instance fences it
    app.start()


def kill_broker(broker: Broker, app: WordCount) -> None:
    broker.kill()  # SIGKILL; the app keeps running and retries
    time.sleep(1)
    broker.start()


@pytest.mark.timeout(150)
@pytest.mark.matrix("streams exactly-once: app kill -9", client="java-streams")
def test_exact_counts_across_a_kill_of_the_streams_app(
    workdir: Path, classpath: str, app_id: str
) -> None:
    exact_counts_across(kill_app, 1, workdir, classpath, app_id)


@pytest.mark.timeout(150)
@pytest.mark.matrix("streams exactly-once: broker kill -9", client="java-streams")
def test_exact_counts_across_a_kill_of_the_broker(
    workdir: Path, classpath: str, app_id: str
) -> None:
    exact_counts_across(kill_broker, 2, workdir, classpath, app_id)


@pytest.mark.timeout(180)
@pytest.mark.matrix("streams exactly-once: restore from compacted changelog", client="java-streams")
def test_state_restored_from_the_compacted_changelog(
    workdir: Path, classpath: str, app_id: str
) -> None:
    rng = random.Random(3)
    state = workdir / "state"
    changelog = f"{app_id}-counts-changelog"
    with configured_broker(workdir / "broker", BROKER_PROPERTIES) as broker:
        create_topics(broker, app_id)
        acked = produce(broker, app_id, 3000, rng)
        app = WordCount(classpath, broker, app_id, state, workdir / "app")
        try:
            app.start()
            wait_exact_counts(broker, app, app_id, acked)
        finally:
            app.stop()

        # One changelog record per word counted, all in transactions; once the cleaner ran,
        # a read_committed reader sees far fewer, and the last of each word is its count.
        deadline = time.monotonic() + 60
        while len(records := read_committed(broker, changelog)) > 3000 // 3:
            assert time.monotonic() < deadline, f"changelog not compacted: {len(records)} records"
            time.sleep(0.5)
        print(f"changelog: {len(records)} of 3000 records left after compaction")
        # (the value: Serdes.Long, 8 bytes big-endian)
        restored = {w.decode(): int.from_bytes(v, "big", signed=True) for w, v in records}
        assert restored == dict(acked)

        shutil.rmtree(state)  # the store must come back from the compacted changelog alone
        acked += produce(broker, app_id, 1000, rng)
        try:
            app.start()
            wait_exact_counts(broker, app, app_id, acked)
        finally:
            app.stop()
        out = verified(broker.data_dir, "--topic", changelog)
        assert "compacted away" in out, out

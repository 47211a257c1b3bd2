"""Mirrors as real processes: one writer, two mirrors, stock clients.

One scenario, in steps that build on each other (each is slow to set up, so they share it):

1. writer `--replication-listen`, mirror A `--mirror WRITER` (trust on first use), mirror B
   `--mirror WRITER@NODEKEY` (pinned, the key read with `hyperkafka keys`);
2. 100,000 records produced to the writer (confluent-kafka); each mirror reaches the same
   high watermark, and its segment file is byte-identical to the writer's;
3. each mirror serves every record, byte-exact, to kcat and to kafka-python;
4. a produce to a mirror gets NOT_LEADER_OR_FOLLOWER (an error, not silent loss);
5. the writer is SIGKILLed: both mirrors still serve everything;
6. a byte is changed inside a batch on mirror B's disk while B is down; with the writer
   back, B refuses the damaged batch (never serves it), fetches it again, and serves
   every record; mirror A, up all along, resumes following the restarted writer and both
   get the records produced after it; `hyperkafka verify` on both data dirs passes;
7. a mirror pinned to another node key refuses the writer: nothing is mirrored.

Then, on their own: a longer fork of the writer is equivocation; a running mirror follows
AlterConfigs and CreatePartitions made on the writer.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import ROOT, Broker, hyperkafka

N_RECORDS = 100_000

PRODUCER = textwrap.dedent(
    """
    import sys
    from confluent_kafka import Producer
    bootstrap, topic, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 20,
                  "batch.num.messages": 2000, "compression.type": "none"})
    errors = []
    def delivered(err, msg):
        if err is not None:
            errors.append(str(err))
    for i in range(n):
        while True:
            try:
                p.produce(topic, value=b"value-%08d" % i, key=b"k%d" % (i % 97), on_delivery=delivered)
                break
            except BufferError:
                p.poll(0.01)
        p.poll(0)
    assert p.flush(60) == 0, "undelivered records"
    assert not errors, errors[:3]
    """
)

CONSUMER = textwrap.dedent(
    """
    import json, sys
    from kafka import KafkaConsumer, TopicPartition
    bootstrap, topic, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=15000,
                      enable_auto_commit=False, max_partition_fetch_bytes=4 << 20,
                      fetch_max_bytes=16 << 20)
    tp = TopicPartition(topic, 0)
    c.assign([tp])
    c.seek(tp, 0)
    got = []
    for m in c:
        got.append([m.offset, m.key.decode(), m.value.decode()])
        if len(got) >= n:
            break
    json.dump(got, open(out, "w"))
    """
)

PRODUCE_TO_MIRROR = textwrap.dedent(
    """
    import sys
    from kafka import KafkaProducer
    p = KafkaProducer(bootstrap_servers=sys.argv[1], retries=0, max_block_ms=10000)
    try:
        p.send(sys.argv[2], b"must not be stored").get(timeout=20)
        print("ACCEPTED")
    except Exception as exc:
        print(type(exc).__name__, exc)
    """
)


def _py(code: str, *args: str, timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], check=False, timeout=timeout, cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _expected() -> list[tuple[str, str]]:
    return [(f"k{i % 97}", f"value-{i:08d}") for i in range(N_RECORDS)]


def _kcat(kcat: harness.Kcat, b: Broker, topic: str) -> list[tuple[str, str]]:
    out = kcat.run(["-C", "-b", b.bootstrap, "-t", topic, "-p", "0", "-o", "beginning", "-e", "-q",
                    "-f", "%k %s\\n"], timeout=120).stdout.decode()
    return [tuple(line.split(" ", 1)) for line in out.splitlines()]  # type: ignore[misc]


def _high_watermark(b: Broker, topic: str) -> int:
    """The partition's high watermark as a client sees it, -1 if the topic is unknown."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=b.bootstrap, request_timeout_ms=5000)
    try:
        if not c.partitions_for_topic(topic):
            return -1
        tp = TopicPartition(topic, 0)
        return int(c.end_offsets([tp])[tp])
    except Exception:
        return -1
    finally:
        c.close()


def _wait_caught_up(b: Broker, topic: str, n: int, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    hw = -1
    while time.monotonic() < deadline:
        hw = _high_watermark(b, topic)
        if hw == n:
            return
        time.sleep(0.5)
    raise AssertionError(f"mirror {b.bootstrap} at high watermark {hw}, want {n}\n{b.log_tail()}")


def _segment(data_dir: Path, *parts: str) -> Path:
    return data_dir.joinpath(*parts, "00000000000000000000.log")


@pytest.mark.timeout(240)
@pytest.mark.matrix("mirrors: writer + 2 mirrors, byte-exact, writer killed, damage refetched", client="kcat+kafka-python")
def test_writer_and_two_mirrors(workdir: Path) -> None:
    kcat, why = harness.find_kcat("old")
    if kcat is None:
        kcat, why = harness.find_kcat("new")
    harness.require(kcat is not None, why)
    assert kcat is not None
    topic = "mirrored"
    last = [time.monotonic()]

    def step(name: str) -> None:
        now = time.monotonic()
        print(f"  {name}: {now - last[0]:.1f}s", file=sys.stderr)
        last[0] = now

    rport = harness.free_port()
    writer = harness.new_broker(workdir / "writer", extra=("--replication-listen", f"127.0.0.1:{rport}"))
    brokers: list[Broker] = [writer]
    try:
        writer.start()
        assert writer.data_dir is not None
        keys = hyperkafka("keys", "--data-dir", str(writer.data_dir))
        assert keys.returncode == 0, keys.stderr
        node_key = keys.stdout.split("\n")[0].split("\t")[1]
        a = harness.new_broker(workdir / "mirror-a", extra=("--mirror", writer.bootstrap))
        b = harness.new_broker(workdir / "mirror-b", extra=("--mirror", f"{writer.bootstrap}@{node_key}"))
        brokers += [a, b]
        a.start()
        b.start()
        assert a.data_dir is not None and b.data_dir is not None

        t0 = time.monotonic()
        _py(PRODUCER, writer.bootstrap, topic, str(N_RECORDS), timeout=120)
        produced_s = time.monotonic() - t0
        for m in (a, b):
            _wait_caught_up(m, topic, N_RECORDS)
        caught_up_s = time.monotonic() - t0
        print(f"\n100k records: produced in {produced_s:.1f}s, both mirrors caught up {caught_up_s:.1f}s after the start",
              file=sys.stderr)
        want = writer_bytes = _segment(writer.data_dir, f"{topic}-0").read_bytes()
        for m in (a, b):
            got = _segment(m.data_dir, "__mirrors", node_key, f"{topic}-0").read_bytes()  # type: ignore[arg-type]
            assert got == want, f"{m.bootstrap}: mirror segment differs from the writer's"
        assert len(writer_bytes) > N_RECORDS * 10

        step("setup+produce+catch-up")
        expected = _expected()
        # kafka-python (slow: pure Python) on both mirrors at once, kcat meanwhile
        outs = [workdir / f"kafka-python-{i}.json" for i in range(2)]
        consumers = [subprocess.Popen([sys.executable, "-c", CONSUMER, m.bootstrap, topic, str(out), str(N_RECORDS)],
                                      cwd=ROOT) for m, out in zip((a, b), outs, strict=True)]
        for m in (a, b):
            assert _kcat(kcat, m, topic) == expected, f"kcat on {m.bootstrap}"
        for m, proc, out in zip((a, b), consumers, outs, strict=True):
            assert proc.wait(120) == 0
            got = json.loads(out.read_text())
            assert [o for o, _, _ in got] == list(range(N_RECORDS)), "offsets must be dense from 0"
            assert [(k, v) for _, k, v in got] == expected, f"kafka-python on {m.bootstrap}"

        step("kcat+kafka-python x2")
        refused = _py(PRODUCE_TO_MIRROR, a.bootstrap, topic)
        assert "NotLeader" in refused, refused
        assert _high_watermark(a, topic) == N_RECORDS

        step("produce refused")
        # the writer dies: the mirrors still serve every record
        assert writer.proc is not None
        writer.proc.send_signal(signal.SIGKILL)
        writer.proc.wait()
        writer.proc = None
        for m in (a, b):
            assert _kcat(kcat, m, topic) == expected

        step("writer killed, mirrors serve")
        # a byte changed on mirror B's disk (inside a record value, CRC left as it was)
        assert b.stop() == 0
        seg = _segment(b.data_dir, "__mirrors", node_key, f"{topic}-0")
        data = bytearray(seg.read_bytes())
        pos = len(data) // 2
        data[pos] ^= 0x55
        seg.write_bytes(bytes(data))
        writer.start()  # the refetch needs a source
        b.start()
        assert _kcat(kcat, b, topic) == expected
        assert "fetched again" in (b.log_path.read_text() if b.log_path else "")
        assert _segment(b.data_dir, "__mirrors", node_key, f"{topic}-0").read_bytes() == want
        # mirror A stayed up through the writer's death: it resumes following by itself
        _py(PRODUCER, writer.bootstrap, topic, "1000", timeout=60)
        _wait_caught_up(a, topic, N_RECORDS + 1000)
        _wait_caught_up(b, topic, N_RECORDS + 1000)

        step("damage refetched")
        # a mirror pinned to another node key refuses this writer
        other = "ab" * 32
        c = harness.new_broker(workdir / "mirror-c", extra=("--mirror", f"{writer.bootstrap}@{other}", "--no-auto-create"))
        brokers.append(c)
        c.start()
        deadline = time.monotonic() + 15
        log_text = ""
        while time.monotonic() < deadline:
            log_text = c.log_path.read_text() if c.log_path else ""
            if "refusing it" in log_text:
                break
            time.sleep(0.2)
        assert "refusing it" in log_text, log_text[-2000:]
        assert _high_watermark(c, topic) == -1  # the topic is unknown there
        assert c.data_dir is not None
        assert not (c.data_dir / "__mirrors" / node_key).exists()

        step("wrong key refused")
        for m in (a, b):
            assert m.stop() == 0
            verified = hyperkafka("verify", "--data-dir", str(m.data_dir))
            assert verified.returncode == 0, verified.stdout + verified.stderr
            assert f"ok mirror:{node_key[:16]}/{topic} 0" in verified.stdout, verified.stdout
    finally:
        for br in brokers:
            try:
                br.stop()
            except Exception:
                br.kill()


PRODUCE_EACH = textwrap.dedent(
    """
    import sys
    from kafka import KafkaProducer
    p = KafkaProducer(bootstrap_servers=sys.argv[1], acks="all", max_block_ms=10000)
    for i in range(int(sys.argv[4])):
        p.send(sys.argv[2], (sys.argv[3] + "-%d" % i).encode()).get(timeout=20)  # a batch each
    p.close()
    """
)


def _log(b: Broker) -> str:
    return b.log_path.read_text(errors="replace") if b.log_path else ""


@pytest.mark.timeout(180)
@pytest.mark.matrix("mirrors: a longer fork of the writer (same key) is equivocation", client="kafka-python")
def test_a_longer_fork_of_the_writer_freezes_the_mirror(workdir: Path) -> None:
    """A copy of the writer's data dir (same key), taken earlier, appends other records
    and comes back at the writer's address LONGER than what the mirror verified: the
    mirror freezes that archive, keeps both heads as evidence (across a restart), logs one
    ERROR, keeps serving what it verified, and `hyperkafka verify` fails naming it."""
    import shutil

    topic = "forked"
    rport = harness.free_port()
    writer = harness.new_broker(workdir / "writer", extra=("--replication-listen", f"127.0.0.1:{rport}"))
    brokers: list[Broker] = [writer]
    try:
        writer.start()
        assert writer.data_dir is not None
        _py(PRODUCE_EACH, writer.bootstrap, topic, "honest", "3")
        assert writer.stop() == 0
        fork_dir = workdir / "fork-data"
        shutil.copytree(writer.data_dir, fork_dir)  # the same node seed: the same keys
        writer.start()
        _py(PRODUCE_EACH, writer.bootstrap, topic, "honest-later", "2")
        mirror = harness.new_broker(workdir / "mirror", extra=("--mirror", writer.bootstrap, "--no-auto-create"))
        brokers.append(mirror)
        mirror.start()
        _wait_caught_up(mirror, topic, 5)
        assert writer.stop() == 0
        # the copy, at the writer's address, goes its own way past the mirror's length
        (workdir / "fork").mkdir()
        fork = harness.new_broker(workdir / "fork", data_dir=fork_dir, port=writer.port,
                                  extra=("--replication-listen", f"127.0.0.1:{rport}"))
        brokers.append(fork)
        fork.start()
        _py(PRODUCE_EACH, fork.bootstrap, topic, "forged", "12")
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "EQUIVOCATION" not in _log(mirror):
            time.sleep(0.3)
        assert "EQUIVOCATION" in _log(mirror), mirror.log_tail()
        time.sleep(3)  # more reconnects: no more error lines, no retrying
        text = _log(mirror)
        assert text.count("EQUIVOCATION") == 1, mirror.log_tail()
        assert _high_watermark(mirror, topic) == 5  # serves what it verified, nothing forged
        assert mirror.stop() == 0
        verified = hyperkafka("verify", "--data-dir", str(mirror.data_dir))
        assert verified.returncode != 0, verified.stdout
        bad = [line for line in verified.stdout.splitlines() if line.startswith("BAD")]
        assert bad and f"/{topic} 0" in bad[0] and "equivocation" in bad[0] and "evidence" in bad[0], \
            verified.stdout
        mirror.start()  # the evidence survives a restart: still frozen, still serving
        _wait_caught_up(mirror, topic, 5)
        time.sleep(2)
        assert _high_watermark(mirror, topic) == 5
        assert "frozen" in _log(mirror)
    finally:
        for br in brokers:
            try:
                br.stop()
            except Exception:
                br.kill()


CHANGE_TOPIC = textwrap.dedent(
    """
    import sys
    from kafka import KafkaAdminClient, KafkaProducer
    from kafka.admin import ConfigResource, ConfigResourceType, NewPartitions
    bootstrap, topic = sys.argv[1], sys.argv[2]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=20000)
    admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs={"retention.ms": "86400000"})])
    admin.create_partitions({topic: NewPartitions(total_count=3)})
    admin.close()
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_block_ms=10000)
    for i in range(5):
        p.send(topic, b"p2-%d" % i, partition=2).get(timeout=20)
    p.close()
    """
)

DESCRIBE_AND_READ = textwrap.dedent(
    """
    import json, sys
    from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType
    bootstrap, topic = sys.argv[1], sys.argv[2]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=20000)
    described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    [by_name] = described.values()
    entry = by_name[topic].get("retention.ms")
    configs = {"retention.ms": entry["value"] if isinstance(entry, dict) else entry}
    admin.close()
    c = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=5000, enable_auto_commit=False)
    parts = sorted(c.partitions_for_topic(topic) or ())
    tp = TopicPartition(topic, 2)
    values = []
    if 2 in parts:
        c.assign([tp])
        c.seek(tp, 0)
        values = [m.value.decode() for m in c]
    c.close()
    print(json.dumps({"retention.ms": configs.get("retention.ms"), "partitions": parts, "values": values}))
    """
)


@pytest.mark.timeout(150)
@pytest.mark.matrix("mirrors: a running mirror follows AlterConfigs and CreatePartitions", client="kafka-python")
def test_a_running_mirror_follows_topic_changes(workdir: Path) -> None:
    """On the writer, while a mirror runs: AlterConfigs on a mirrored topic and
    CreatePartitions (1 -> 3), then records produced to the new partition 2. The mirror's
    DescribeConfigs shows the new value, its Metadata the three partitions, and it serves
    partition 2's records."""
    topic = "changing"
    rport = harness.free_port()
    writer = harness.new_broker(workdir / "writer", extra=("--replication-listen", f"127.0.0.1:{rport}"))
    brokers: list[Broker] = [writer]
    try:
        writer.start()
        _py(PRODUCE_EACH, writer.bootstrap, topic, "first", "3")
        mirror = harness.new_broker(workdir / "mirror", extra=("--mirror", writer.bootstrap, "--no-auto-create"))
        brokers.append(mirror)
        mirror.start()
        _wait_caught_up(mirror, topic, 3)
        _py(CHANGE_TOPIC, writer.bootstrap, topic)
        want = {"retention.ms": "86400000", "partitions": [0, 1, 2], "values": [f"p2-{i}" for i in range(5)]}
        assert json.loads(_py(DESCRIBE_AND_READ, writer.bootstrap, topic)) == want
        deadline = time.monotonic() + 40
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            seen = json.loads(_py(DESCRIBE_AND_READ, mirror.bootstrap, topic))
            if seen == want:
                break
            time.sleep(0.5)
        assert seen == want, f"{seen}\n{mirror.log_tail()}"
    finally:
        for br in brokers:
            try:
                br.stop()
            except Exception:
                br.kill()

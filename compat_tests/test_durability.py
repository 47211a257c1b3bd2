"""What the signed archive promises, checked through real processes.

- A broker killed with SIGKILL in the middle of an acks=all stream restarts with every
  acknowledged record intact, once each, and `hyperkafka verify` passes.
- A record rewritten on disk with a valid CRC-32C (what a careless or hostile disk
  editor would do) is caught by `hyperkafka verify` and never served: consumers get
  every record before the damaged batch and nothing from it on.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import crc32c
import pytest

from compat_tests.harness import ROOT, Broker, hyperkafka

PRODUCER = textwrap.dedent(
    """
    import json, sys, time
    from confluent_kafka import Producer
    bootstrap, topic, out, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    acked = []
    def delivered(err, msg):
        if err is None:
            acked.append(int(msg.value()))
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                  "linger.ms": 2, "message.timeout.ms": 8000})
    deadline, i = time.time() + seconds, 0
    while time.time() < deadline:
        try:
            p.produce(topic, b"%d" % i, on_delivery=delivered)
            i += 1
        except BufferError:
            pass
        p.poll(0)
    p.flush(10)
    json.dump({"sent": i, "acked": acked}, open(out, "w"))
    """
)

CONSUMER = textwrap.dedent(
    """
    import json, sys
    from kafka import KafkaConsumer, TopicPartition
    bootstrap, topic, out = sys.argv[1], sys.argv[2], sys.argv[3]
    c = KafkaConsumer(bootstrap_servers=bootstrap, consumer_timeout_ms=6000,
                      enable_auto_commit=False)
    c.assign([TopicPartition(topic, 0)])
    c.seek(TopicPartition(topic, 0), 0)
    json.dump([[m.offset, m.value.decode()] for m in c], open(out, "w"))
    """
)


def _run(code: str, *args: str, timeout: float = 120) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=timeout, cwd=ROOT)


def _consume(b: Broker, topic: str, workdir: Path) -> list[tuple[int, str]]:
    out = workdir / f"consumed-{uuid.uuid4().hex[:6]}.json"
    _run(CONSUMER, b.bootstrap, topic, str(out))
    return [(o, v) for o, v in json.loads(out.read_text())]


@pytest.mark.timeout(240)
@pytest.mark.matrix("sigkill-acks-all", client="confluent")
def test_sigkill_mid_stream_keeps_every_acknowledged_record(fresh_broker: Broker, workdir: Path) -> None:
    b = fresh_broker
    assert b.proc is not None and b.data_dir is not None
    topic = f"crash-{uuid.uuid4().hex[:8]}"
    out = workdir / "acked.json"
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, b.bootstrap, topic, str(out), "6"], cwd=ROOT)
    time.sleep(3)
    b.proc.send_signal(signal.SIGKILL)  # no shutdown, no final commit: a crash
    b.proc.wait()
    b.proc = None
    time.sleep(0.5)
    b.start()
    assert producer.wait(60) == 0
    result = json.loads(out.read_text())
    acked = result["acked"]
    assert len(acked) > 1000, f"too few records acknowledged before the kill: {len(acked)}"

    consumed = _consume(b, topic, workdir)
    values = [int(v) for _, v in consumed]
    assert [o for o, _ in consumed] == list(range(len(consumed))), "offsets must be dense"
    assert len(values) == len(set(values)), "a record was stored twice"
    missing = set(acked) - set(values)
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {sorted(missing)[:5]}"
    assert values == sorted(values), "records out of order"

    assert b.stop() == 0
    verified = hyperkafka("verify", "--data-dir", str(b.data_dir), "--topic", topic)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def _batches(segment: bytes) -> list[tuple[int, int, int]]:
    """(position, size, base offset) of every batch in a segment file."""
    out, pos = [], 0
    while pos + 12 <= len(segment):
        base, length = struct.unpack_from(">qi", segment, pos)
        out.append((pos, 12 + length, base))
        pos += 12 + length
    return out


@pytest.mark.timeout(240)
@pytest.mark.matrix("tampered-record-refused", client="kafka-python")
def test_record_rewritten_with_valid_crc_is_caught_and_never_served(fresh_broker: Broker, workdir: Path) -> None:
    b = fresh_broker
    assert b.data_dir is not None
    topic = f"tamper-{uuid.uuid4().hex[:8]}"
    out = workdir / "acked.json"
    _run(PRODUCER, b.bootstrap, topic, str(out), "1.5")
    before = _consume(b, topic, workdir)
    assert len(before) > 100
    assert b.stop() == 0

    segment_path = b.data_dir / f"{topic}-0" / ("0" * 20 + ".log")
    segment = bytearray(segment_path.read_bytes())
    batches = _batches(bytes(segment))
    assert len(batches) >= 3, "the stream should span several batches"
    pos, size, victim = batches[len(batches) // 2]
    # Change the last byte of the batch (inside the last record's value) and recompute the
    # CRC-32C, so a Kafka client's own check would pass: only the signed tree can tell.
    segment[pos + size - 1] ^= 0x01
    struct.pack_into(">I", segment, pos + 17, crc32c.crc32c(bytes(segment[pos + 21 : pos + size])))
    segment_path.write_bytes(bytes(segment))

    verified = hyperkafka("verify", "--data-dir", str(b.data_dir), "--topic", topic)
    assert verified.returncode != 0, verified.stdout
    assert f"{topic} 0 {victim}" in verified.stdout, verified.stdout

    b.start()
    after = _consume(b, topic, workdir)
    assert after == before[:victim], (
        f"served {len(after)} records; expected exactly the {victim} before the damaged batch"
    )

"""A mirror started after its writer compacted a topic (storage/FORMAT.md 4a and 10).

The writer (`--replication-listen`, cleaner every 200 ms) gets a compacted topic of 20 keys
x 30 updates, one record per batch; once its cleaner removed the superseded batches, a NEW
mirror (`--mirror WRITER`) starts. It must not stall at the first removed block: it takes
each removed block's leaf (no bytes) from the writer, reaches the writer's high watermark,
and serves consumers (confluent-kafka, kafka-python) exactly the writer's compacted view:
the same records at the same offsets, the latest value of every key. `hyperkafka verify`
on the mirror's data dir passes and reports the blocks compacted away.

Imports the standard library, pytest, the clients and the compat_tests modules.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import Broker, configured_broker, verified
from compat_tests.test_compaction import _produce, _read_confluent, _read_kafka_python

KEYS = 20
UPDATES = 30


@pytest.mark.timeout(240)
@pytest.mark.matrix("mirrors: a new mirror of a compacted topic", client="confluent+kafka-python")
def test_a_new_mirror_of_a_compacted_topic_serves_the_writers_view(workdir: Path) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    rport = harness.free_port()
    props = {"log.cleaner.backoff.ms": "200", "hyperkafka.replication.listen": f"127.0.0.1:{rport}"}
    with configured_broker(workdir / "writer", props) as writer:
        topic = f"compacted-{uuid.uuid4().hex[:8]}"
        a = AdminClient({"bootstrap.servers": writer.bootstrap})
        configs = {"cleanup.policy": "compact", "segment.bytes": "1024",
                   "min.cleanable.dirty.ratio": "0.01"}
        a.create_topics([NewTopic(topic, 1, 1, config=configs)])[topic].result(timeout=30)
        written = [(b"key-%02d" % k, b"value %d of key %d" % (u, k))
                   for u in range(UPDATES) for k in range(KEYS)]
        offsets = _produce(writer, topic, written)
        # the active segment is never cleaned: a last record moves the updates out of it
        tail = [(b"sentinel", b"x" * 1100), (b"sentinel", b"y")]
        offsets += _produce(writer, topic, tail)
        written += tail
        end = offsets[-1] + 1
        assert offsets == list(range(end))
        deadline = time.monotonic() + 60
        while len(view := _read_confluent(writer, topic)) > KEYS + 6:
            assert time.monotonic() < deadline, f"not compacted: {len(view)} records"
            time.sleep(0.3)
        view = _read_confluent(writer, topic)  # (the cleaner may have gone on meanwhile)

        mirror: Broker = harness.new_broker(
            workdir / "mirror", extra=("--mirror", writer.bootstrap, "--no-auto-create"))
        mirror.start()
        try:
            deadline = time.monotonic() + 60
            got: list[tuple[int, bytes, bytes | None]] = []
            while time.monotonic() < deadline:
                try:
                    got = _read_confluent(mirror, topic)
                except AssertionError:
                    got = []
                if got and got[-1][0] == end - 1:
                    break
                time.sleep(0.5)
            assert got and got[-1][0] == end - 1, f"mirror did not catch up: {got[-3:]}\n{mirror.log_tail()}"
            # the writer's compacted view, at the writer's offsets
            assert got == _read_confluent(writer, topic) or got == view
            for off, k, v in got:
                assert written[off] == (k, v), off
            table = {k: v for _, k, v in got}
            for k in range(KEYS):
                assert table[b"key-%02d" % k] == b"value %d of key %d" % (UPDATES - 1, k)
            assert len(got) < len(written) // 4
            assert _read_kafka_python(mirror, topic, end) == got
            mirror.stop()
            out = verified(mirror.data_dir)
            line = next(x for x in out.splitlines() if x.startswith("ok mirror:") and f"/{topic} 0 " in x)
            assert "compacted away" in line, out
        finally:
            if mirror.proc is not None and mirror.proc.poll() is None:
                mirror.kill()



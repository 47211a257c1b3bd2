"""`hyperkafka audit` as a consumer of an untrusted mirror runs it: a writer, a mirror
(`--mirror`, with its own HTTP listener), records produced to the writer; the audit reads
the topic through the mirror's Kafka port, takes the proofs from the mirror's HTTP
listener, and checks every batch against the archive key pinned from the writer
(`hyperkafka keys`). A wrong pinned key fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from compat_tests import harness
from compat_tests.harness import Broker, hyperkafka
from compat_tests.test_mirrors import _wait_caught_up


@pytest.mark.timeout(180)
def test_audit_through_a_mirror(workdir: Path) -> None:
    rport, http_port = harness.free_port(), harness.free_port()
    writer = harness.new_broker(
        workdir / "writer", extra=("--replication-listen", f"127.0.0.1:{rport}")
    )
    mirror = harness.new_broker(
        workdir / "mirror",
        extra=("--mirror", writer.bootstrap, "--http-listen", f"127.0.0.1:{http_port}"),
    )
    brokers: list[Broker] = [writer, mirror]
    try:
        writer.start()
        from kafka import KafkaProducer

        p = KafkaProducer(bootstrap_servers=writer.bootstrap, acks=1, linger_ms=0)
        for i in range(30):
            p.send("audited", b"value-%d" % i, partition=0).get(timeout=30)
        p.close()
        mirror.start()
        _wait_caught_up(mirror, "audited", 30)
        assert writer.data_dir is not None
        keys = hyperkafka("keys", "--data-dir", str(writer.data_dir))
        assert keys.returncode == 0, keys.stderr
        key = next(
            line.split("\t")[2]
            for line in keys.stdout.splitlines()
            if line.startswith("audited\t0\t")
        )
        http = f"http://127.0.0.1:{http_port}"
        ok = hyperkafka(
            "audit",
            "--bootstrap",
            mirror.bootstrap,
            "--http",
            http,
            "--topic",
            "audited",
            "--archive-key",
            f"0={key}",
        )
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert (
            f"audited-0: 30 batches, offsets 0..29 match the writer's signed tree (length 30; archive {key}, pinned)"
            in ok.stdout
        )
        bad = hyperkafka(
            "audit",
            "--bootstrap",
            mirror.bootstrap,
            "--http",
            http,
            "--topic",
            "audited",
            "--archive-key",
            f"0={'00' * 32}",
        )
        assert bad.returncode == 1 and "AUDIT FAILED" in bad.stdout, bad.stdout + bad.stderr
    finally:
        for b in brokers:
            b.kill()

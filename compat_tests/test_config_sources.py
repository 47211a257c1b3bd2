"""Apache Kafka 4's stock config/server.properties (KRaft, combined mode) starts hyperkafka
unchanged, with the environment overriding what must differ here, as a container would
(KAFKA_LOG_DIRS, KAFKA_LISTENERS, KAFKA_ADVERTISED_LISTENERS), and clients use it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from compat_tests.harness import ROOT, Broker, free_port

STOCK = ROOT / "compat_tests" / "data" / "kafka-4-server.properties"


def test_stock_server_properties_with_the_environment(tmp_path: Path) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    port, controller = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    env.update(
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
        KAFKA_LOG_DIRS=str(tmp_path / "data"),
        KAFKA_LISTENERS=f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://127.0.0.1:{port}",
        KAFKA_NUM_PARTITIONS="3",
    )
    broker = Broker(
        host="127.0.0.1",
        port=port,
        data_dir=tmp_path / "data",
        log_path=tmp_path / "broker.log",
        env=env,
        argv=[sys.executable, "-m", "broker", "serve", "--config", str(STOCK)],
    )
    broker.start()
    try:
        p = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        for i in range(10):
            p.send("stock", b"%d" % i)
        p.flush()
        p.close()
        c = KafkaConsumer(bootstrap_servers=broker.bootstrap, consumer_timeout_ms=5000)
        parts = c.partitions_for_topic("stock")
        assert parts == {0, 1, 2}  # KAFKA_NUM_PARTITIONS won over the file's num.partitions=1
        tps = [TopicPartition("stock", n) for n in parts]
        assert sum(c.end_offsets(tps).values()) == 10
        c.close()
    finally:
        code = broker.stop()
    log = broker.log_tail(200)
    assert code == 0, log
    assert (tmp_path / "data" / "node.seed").exists()  # log.dirs came from the environment
    warned = [line for line in log.splitlines() if "WARNING hyperkafka.config: ignoring " in line]
    assert any("ignoring process.roles=broker,controller" in line for line in warned), log
    assert len(warned) == len(
        {line.split("ignoring ", 1)[1].split("=", 1)[0] for line in warned}
    )  # one line each
    assert (
        f":{controller}" not in log.split("listening on", 1)[1].split("\n", 1)[0]
    )  # no controller listener

"""Settings from the environment (KAFKA_*) and Kafka's own keys that do not apply here."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from broker.cli import _parser, build_config
from broker.config import BrokerConfig, ConfigError, apply_properties, read_properties
from broker.config_sources import KAFKA_ONLY, env_name, env_to_key, settings_from_env

ROOT = Path(__file__).resolve().parents[2]
STOCK = ROOT / "compat_tests" / "data" / "kafka-4-server.properties"


def test_env_names_map_as_kafka_images_map_them() -> None:
    assert env_to_key("KAFKA_LOG_RETENTION_MS") == "log.retention.ms"
    assert env_to_key("KAFKA_HYPERKAFKA_FSYNC") == "hyperkafka.fsync"
    assert (
        env_to_key("KAFKA_LISTENER_NAME_EXTERNAL_SSL_KEY__PASSWORD")
        == "listener.name.external.ssl.key_password"
    )
    assert env_to_key("KAFKA_A___B") == "a-b"
    # (the Docker image's cases, from when its entrypoint translated them itself)
    assert env_to_key("KAFKA_HYPERKAFKA_REPLICATION_LISTEN") == "hyperkafka.replication.listen"
    assert (
        env_to_key("KAFKA_LISTENER_NAME_INTERNAL_SSL_KEYSTORE__LOCATION")
        == "listener.name.internal.ssl.keystore_location"
    )
    assert env_to_key("KAFKA_SOME___DASHED_KEY") == "some-dashed.key"
    for key in ("log.retention.ms", "listener.name.x.ssl.key_password", "a-b.c"):
        assert env_to_key(env_name(key)) == key
    env = {
        "KAFKA_NUM_PARTITIONS": "3",
        "KAFKA_HEAP_OPTS": "-Xmx1g",
        "KAFKA_OPTS": "-Dx",
        "KAFKA_": "",
        "PATH": "/bin",
    }
    assert settings_from_env(env) == {"num.partitions": "3"}


def test_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    conf = tmp_path / "server.properties"
    conf.write_text("num.partitions=2\nlog.retention.ms=1000\nhyperkafka.fsync=never\n")
    args = ["serve", "--config", str(conf)]
    env = {"KAFKA_NUM_PARTITIONS": "5", "KAFKA_HYPERKAFKA_FSYNC": "always"}
    config = build_config(_parser().parse_args(args), environ=env)
    assert config.num_partitions == 5  # the environment wins over the file
    assert config.fsync.value == "always"
    assert config.topic_defaults["log.retention.ms"] == "1000"  # the file wins over defaults
    config = build_config(_parser().parse_args([*args, "--num-partitions", "7"]), environ=env)
    assert config.num_partitions == 7  # flags win over both
    assert (
        build_config(_parser().parse_args(["serve"]), environ={}).num_partitions
        == BrokerConfig().num_partitions
    )


def test_unknown_names_still_fail_and_say_where_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown broker config 'log\.retention\.mss'"):
        apply_properties(BrokerConfig(), {"log.retention.mss": "1"})
    with pytest.raises(ConfigError, match=r"KAFKA_NUM_PARTITION\b"):
        build_config(_parser().parse_args(["serve"]), environ={"KAFKA_NUM_PARTITION": "3"})
    with pytest.raises(ConfigError, match=r"zookeeper\.connect"):  # Kafka 4 has no ZooKeeper either
        apply_properties(BrokerConfig(), {"zookeeper.connect": "localhost:2181"})


def test_a_stock_kafka_4_server_properties_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    props = read_properties(STOCK)
    caplog.set_level(logging.WARNING, logger="hyperkafka.config")
    config = apply_properties(BrokerConfig(), props)
    ignored = [k for k in props if k in KAFKA_ONLY]
    assert len(ignored) >= 10
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == len(ignored)  # one line each
    for key, line in zip(ignored, warnings, strict=True):
        assert line.startswith(f"ignoring {key}=") and "\n" not in line
    # the KRaft controller's listener is not opened; the broker's is
    assert config.security_props["listeners"] == "PLAINTEXT://:9092"
    assert config.security_props["advertised.listeners"] == "PLAINTEXT://localhost:9092"
    assert (config.listen_host, config.listen_port, config.node_id) == ("", 9092, 1)
    assert config.data_dir == Path("/tmp/kraft-combined-logs")
    assert config.topic_defaults["log.retention.ms"] == str(168 * 3_600_000)
    assert "process.roles" not in config.static


def test_docs_list_every_key_set_aside() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("## Kafka's settings that do not apply here", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z0-9._-]+)` \|", section, re.M)
    assert sorted(listed) == sorted(KAFKA_ONLY)

"""Broker settings from a properties file and flags; topic config validation."""

from pathlib import Path

import pytest

from broker.cli import _parser, build_config
from broker.config import (
    BrokerConfig,
    ConfigError,
    ConfigSource,
    apply_properties,
    read_properties,
    validate_topic_configs,
)
from storage import FsyncPolicy


def test_properties_file_and_flags(tmp_path: Path) -> None:
    props = tmp_path / "server.properties"
    props.write_text(
        "# a comment\n"
        "node.id=3\n"
        "listeners=PLAINTEXT://0.0.0.0:9999\n"
        "advertised.listeners=PLAINTEXT://kafka.example:9999\n"
        "num.partitions = 4\n"
        "auto.create.topics.enable=false\n"
        "log.retention.hours=2\n"
        "message.max.bytes=5000\n"
        "hyperkafka.fsync=always\n"
    )
    args = _parser().parse_args(["serve", "--config", str(props), "--node-id", "5", "--data-dir", str(tmp_path / "d")])
    config = build_config(args)
    assert config.node_id == 5  # the flag wins over the file
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", 9999)
    assert config.advertised == ("kafka.example", 9999)
    assert config.num_partitions == 4 and not config.auto_create_topics
    assert config.fsync is FsyncPolicy.ALWAYS
    entries = {e.name: e for e in config.describe_topic({})}
    assert entries["retention.ms"].value == "7200000"
    assert entries["retention.ms"].source == ConfigSource.STATIC_BROKER_CONFIG
    assert entries["max.message.bytes"].value == "5000"
    assert config.log_config({"retention.ms": "10"}).retention_ms == 10
    assert read_properties(props)["num.partitions"] == "4"


def test_unknown_or_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        apply_properties(BrokerConfig(), {"no.such.setting": "1"})
    with pytest.raises(ConfigError):
        apply_properties(BrokerConfig(), {"num.partitions": "many"})
    with pytest.raises(ConfigError):
        validate_topic_configs({"retention.ms": "-5"})
    with pytest.raises(ConfigError):
        validate_topic_configs({"message.timestamp.type": "Sometimes"})
    with pytest.raises(ConfigError):
        validate_topic_configs({"cleanup.policy": "compact,shred"})
    with pytest.raises(ConfigError, match=r"min\.cleanable\.dirty\.ratio"):
        validate_topic_configs({"min.cleanable.dirty.ratio": "1.5"})
    assert validate_topic_configs({"cleanup.policy": "delete, compact"}) == {"cleanup.policy": "delete,compact"}
    assert validate_topic_configs({"preallocate": "TRUE", "segment.ms": None}) == {"preallocate": "true"}


def test_advertised_defaults_to_a_reachable_host() -> None:
    assert BrokerConfig(listen_host="0.0.0.0", listen_port=1234).advertised == ("127.0.0.1", 1234)


def test_memory_budgets_from_properties() -> None:
    c = BrokerConfig()
    assert (c.queued_max_request_bytes, c.fetch_max_bytes) == (100 << 20, 57671680)  # Kafka's fetch.max.bytes
    c = apply_properties(BrokerConfig(), {"queued.max.request.bytes": "-1", "fetch.max.bytes": "1048576"})
    assert (c.queued_max_request_bytes, c.fetch_max_bytes) == (-1, 1 << 20)
    # Any frame accepted must fit in the pool (Kafka's KafkaConfig rule); an unset pool follows.
    assert apply_properties(BrokerConfig(), {"socket.request.max.bytes": str(200 << 20)}).queued_max_request_bytes == 200 << 20
    with pytest.raises(ConfigError, match=r"queued\.max\.request\.bytes"):
        apply_properties(BrokerConfig(), {"queued.max.request.bytes": "1000"})
    with pytest.raises(ConfigError, match=r"fetch\.max\.bytes"):
        apply_properties(BrokerConfig(), {"fetch.max.bytes": "0"})

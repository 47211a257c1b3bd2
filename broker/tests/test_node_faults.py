"""Disk errors in the node's background work: a partition goes offline, the broker lives."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from broker.config import BrokerConfig
from broker.node import Node


async def test_a_disk_error_in_retention_takes_one_partition_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node.open(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    try:
        topic = node.create_topic("t", 2)
        assert topic is not None
        bad, good = topic.partitions

        def broken(now_ms: int) -> int:
            raise OSError(errno.EIO, "injected fsync failure")

        monkeypatch.setattr(bad.log, "apply_retention", broken)
        # The retention loop calls this every check interval: it must not raise, or the
        # broker's background nursery (and the broker) would end.
        assert await node.apply_retention() == 0
        assert bad.failed is not None and "retention failed" in bad.failed
        assert good.failed is None
        # The next pass skips the offline partition instead of failing again.
        assert await node.apply_retention() == 0
    finally:
        node.close()

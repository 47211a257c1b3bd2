"""A commit round hashes the new batches of every partition in it in one native call."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.compose import open_node
from broker.config import BrokerConfig
from broker.node import ms_now
from storage import hashing
from storage.batch import build_batch


@pytest.mark.skipif(not hashing.NATIVE_LEAVES, reason="storage._native was not built")
async def test_one_round_one_leaf_hashing_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[bytes]] = []
    real = hashing.leaf_hashes

    def counting(blocks: list[memoryview]) -> list[bytes]:
        calls.append([bytes(b) for b in blocks])
        return real(blocks)

    monkeypatch.setattr(hashing, "leaf_hashes", counting)
    node = open_node(BrokerConfig(data_dir=tmp_path / "data", listen_port=0))
    try:
        topic = node.create_topic("t", 3)
        assert topic is not None
        calls.clear()  # (creating the topic committed the catalog)
        lasts = []
        for i, p in enumerate(topic.partitions):
            for j in range(i + 1):
                _, last = p.admit(build_batch([b"x" * (100 + j)], timestamp_ms=ms_now()), 0)
                lasts.append((p, last))
            node.mark_dirty(p)
        await node.commit_round()
        for p, last in lasts:
            await p.wait_durable(last)
        assert len(calls) == 1 and len(calls[0]) == 6
        # what was hashed is what is served, partition by partition
        assert b"".join(calls[0]) == b"".join(
            p.log.read_bytes(0, 1 << 20) for p in topic.partitions
        )
    finally:
        node.close()

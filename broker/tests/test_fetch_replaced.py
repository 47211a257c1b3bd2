"""A fetch that finds a partition's log closed under it: a leader stepping down closes its
log and reopens the archive as a replica (broker/takeover.py `step_down`, across an
await), and a fetch arriving in between still finds the old one. It is answered
NOT_LEADER_OR_FOLLOWER for that partition (the client asks Metadata again), never by
closing the connection on an internal error."""

from __future__ import annotations

from pathlib import Path

import trio

from broker.compose import open_node, run_node
from broker.config import BrokerConfig
from broker.server import Server
from broker.tests.conftest import Broker
from broker.tests.test_memory import fetch_of
from broker.tests.test_server import batch, create, produce


async def test_a_log_closed_under_the_fetch_answers_not_leader(tmp_path: Path) -> None:
    config = BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=1)
    node = await trio.to_thread.run_sync(open_node, config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_node, node)
            listeners = await nursery.start(Server(node).serve)
            broker = Broker(config, listeners[0].socket.getsockname()[1])
            await create(broker, "t", partitions=2)
            c = await broker.connect()
            for index in (0, 1):
                await produce(c, "t", batch([b"x"]), partition=index)
            p = node.partition("t", 0)
            assert p is not None
            p.log.discard()  # as step_down does before the replica's open
            named = [("t", 0, 0, 1 << 20), ("t", 1, 0, 1 << 20)]
            r = await c.call("fetch", 12, fetch_of(named, max_bytes=1 << 20))
            got = [(q.partition_index, q.error_code, bool(q.records)) for t in r.responses for q in t.partitions]
            assert got == [(0, 6, False), (1, 0, True)]
            nursery.cancel_scope.cancel()
    finally:
        node.close()

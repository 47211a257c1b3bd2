"""A broker served in-process on a free port, and a raw Kafka client to talk to it."""

from __future__ import annotations

import importlib
import itertools
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from broker.config import BrokerConfig
from broker.protocol.codec import decode_response, encode_request
from broker.protocol.header import RequestHeader
from broker.server import run
from broker.shape import shape
from compat_tests.etcd import etcd  # noqa: F401  (a fixture: a test etcd, for cluster mode)


def request_class(api: str, version: int) -> Any:
    module = importlib.import_module(f"kio.schema.{api}.v{version}.request")
    name = "".join(part.title() for part in api.split("_")) + "Request"
    return getattr(module, name)


class RawClient:
    """One connection speaking the Kafka protocol with kio messages."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._ids = itertools.count(1)
        self._buf = bytearray()

    async def send(self, api: str, version: int, body: dict[str, Any]) -> tuple[int, int, int]:
        cls = request_class(api, version)
        req = shape(cls, body)
        header = RequestHeader(cls.__api_key__, version, next(self._ids), "raw-test")
        await self.stream.send_all(encode_request(header, req))
        return header.api_key, version, header.correlation_id

    async def read_frame(self) -> bytes:
        while True:
            if len(self._buf) >= 4:
                (size,) = struct.unpack_from(">i", self._buf)
                if len(self._buf) >= 4 + size:
                    frame = bytes(self._buf[4 : 4 + size])
                    del self._buf[: 4 + size]
                    return frame
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise EOFError("connection closed")
            self._buf += data

    async def receive(self, sent: tuple[int, int, int]) -> Any:
        api_key, version, correlation_id = sent
        got, response = decode_response(await self.read_frame(), api_key, version)
        assert got == correlation_id
        return response

    async def call(self, api: str, version: int, body: dict[str, Any]) -> Any:
        return await self.receive(await self.send(api, version, body))

    async def closed(self) -> bool:
        """True when the broker closed this connection (EOF within a second)."""
        with trio.move_on_after(1):
            try:
                while await self.stream.receive_some(1 << 16):
                    pass
            except (trio.BrokenResourceError, ConnectionError):
                pass
            return True
        return False


class Broker:
    def __init__(self, config: BrokerConfig, port: int) -> None:
        self.config = config
        self.port = port

    async def connect(self) -> RawClient:
        return RawClient(await trio.open_tcp_stream("127.0.0.1", self.port))


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2)


@pytest.fixture
async def broker(broker_config: BrokerConfig) -> AsyncIterator[Broker]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(run, broker_config)
        port = listeners[0].socket.getsockname()[1]
        yield Broker(broker_config, port)
        nursery.cancel_scope.cancel()

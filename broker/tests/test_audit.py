"""`hyperkafka audit`: a topic read over Kafka, each batch checked against its writer's
signed tree through the HTTP listener's inclusion proofs; altered or omitted batches and
a wrong key are caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from broker import audit as audit_module
from broker.audit import AuditFailed, audit
from broker.config import BrokerConfig
from broker.tests.conftest import Broker
from broker.tests.test_server import batch, create, produce
from storage.hypercore import archive_key


@pytest.fixture
def broker_config(tmp_path: Path) -> BrokerConfig:
    return BrokerConfig(
        data_dir=tmp_path / "data", listen_port=0, shutdown_grace_s=2, http_listen=("127.0.0.1", 0)
    )


async def _filled(broker: Broker) -> tuple[str, str]:
    await create(broker, "au", partitions=2)
    c = await broker.connect()
    for i in range(5):
        assert (
            await produce(c, "au", batch([b"v%d" % i] * (i + 1)), partition=i % 2)
        ).error_code == 0
    assert broker.config.http_listen is not None
    return f"127.0.0.1:{broker.port}", f"http://127.0.0.1:{broker.config.http_listen[1]}"


async def test_audit_accepts_what_the_writer_signed(broker: Broker) -> None:
    bootstrap, http = await _filled(broker)
    results = await trio.to_thread.run_sync(lambda: audit(bootstrap, http, "au"))
    assert [
        (r.partition, r.batches, r.first_offset, r.next_offset, r.signed_length) for r in results
    ] == [(0, 3, 0, 9, 3), (1, 2, 0, 6, 2)]  # 1+3+5 and 2+4 records
    assert not any(r.problems for r in results)
    pinned = {r.partition: r.archive_key for r in results}
    assert await trio.to_thread.run_sync(lambda: audit(bootstrap, http, "au", archive_keys=pinned))
    wrong = {0: archive_key(bytes(32)).hex()}
    with pytest.raises(AuditFailed, match="expected"):
        await trio.to_thread.run_sync(lambda: audit(bootstrap, http, "au", archive_keys=wrong))


async def test_audit_catches_altered_and_omitted_batches(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap, http = await _filled(broker)
    honest = audit_module._batches

    def altered(records: bytes) -> list[bytes]:  # a node serving a changed record
        out = honest(records)
        if len(out) > 1:
            out[1] = out[1][:-1] + bytes([out[1][-1] ^ 1])
        return out

    monkeypatch.setattr(audit_module, "_batches", altered)
    with pytest.raises(AuditFailed, match="not the signed one"):
        await trio.to_thread.run_sync(lambda: audit(bootstrap, http, "au"))

    def omitted(records: bytes) -> list[bytes]:  # a node leaving a batch out
        out = honest(records)
        return out[:1] + out[2:] if len(out) > 2 else out

    monkeypatch.setattr(audit_module, "_batches", omitted)
    with pytest.raises(AuditFailed, match="left out"):
        await trio.to_thread.run_sync(lambda: audit(bootstrap, http, "au"))

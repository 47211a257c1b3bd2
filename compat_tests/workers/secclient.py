"""Produce or consume over a secured listener with confluent-kafka, kafka-python or aiokafka,
in its own process: `python -m compat_tests.workers.secclient CLIENT produce|consume --spec JSON`.

The spec is client-neutral: {"bootstrap", "protocol", "mechanism", "user", "password",
"ca", "cert", "key"}. Prints one JSON line: {"ok": true, "n": N} or {"ok": false,
"error": "<Kafka error name or exception class>", "detail": "..."}; the exit status is 0
either way, so the test decides what a refusal should look like.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any


def _confluent_conf(spec: dict[str, Any]) -> dict[str, Any]:
    conf: dict[str, Any] = {"bootstrap.servers": spec["bootstrap"], "security.protocol": spec["protocol"]}
    if spec.get("mechanism"):
        conf.update({"sasl.mechanism": spec["mechanism"], "sasl.username": spec["user"], "sasl.password": spec["password"]})
    if spec.get("ca"):
        conf["ssl.ca.location"] = spec["ca"]
    if spec.get("cert"):
        conf.update({"ssl.certificate.location": spec["cert"], "ssl.key.location": spec["key"]})
    return conf


def confluent(action: str, spec: dict[str, Any], topic: str, n: int, timeout: float) -> dict[str, Any]:
    from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

    errors: list[str] = []

    def on_error(err: KafkaError) -> None:
        errors.append(err.name())

    conf = {**_confluent_conf(spec), "error_cb": on_error}
    deadline = time.monotonic() + timeout
    if action == "produce":
        p = Producer({**conf, "message.timeout.ms": int(timeout * 1000), "enable.idempotence": True})
        results: list[Any] = []
        for i in range(n):
            p.produce(topic, f"{spec.get('tag', 'v')}-{i}".encode(), on_delivery=lambda e, m: results.append(e))
        while len(results) < n and time.monotonic() < deadline:
            p.poll(0.2)
            fatal = [e for e in errors if e in ("_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "_SSL", "_ALL_BROKERS_DOWN")]
            if fatal and not results:
                return {"ok": False, "error": fatal[0], "detail": errors[:5]}
        failed = [e for e in results if e is not None]
        if failed:
            return {"ok": False, "error": failed[0].name(), "detail": str(failed[0])}
        if len(results) < n:
            return {"ok": False, "error": errors[0] if errors else "TIMEOUT", "detail": errors[:5]}
        return {"ok": True, "n": n}
    c = Consumer({**conf, "group.id": "sec-unused", "enable.auto.commit": False})
    c.assign([TopicPartition(topic, 0, 0)])
    got = 0
    while got < n and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is None:
            if any(e in ("_AUTHENTICATION", "_SSL") for e in errors):
                break
            continue
        if m.error():
            if m.error().code() == KafkaError._PARTITION_EOF:
                continue
            c.close()
            return {"ok": False, "error": m.error().name(), "detail": str(m.error())}
        got += 1
    c.close()
    if got < n:
        return {"ok": False, "error": errors[0] if errors else "TIMEOUT", "n": got, "detail": errors[:5]}
    return {"ok": True, "n": got}


class _Seen(logging.Handler):
    """kafka-python retries a refused bootstrap until it times out; its log says why."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def cause(self) -> str | None:
        for name in ("SaslAuthenticationFailedError", "TopicAuthorizationFailedError", "ClusterAuthorizationFailedError", "SSLError", "SSL"):
            for m in self.messages:
                if name in m:
                    return name
        if any("Authentication failed" in m for m in self.messages):
            return "SaslAuthenticationFailedError"
        return None


def kafka_python(action: str, spec: dict[str, Any], topic: str, n: int, timeout: float) -> dict[str, Any]:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    seen = _Seen()
    logging.getLogger("kafka").addHandler(seen)
    kw: dict[str, Any] = {"bootstrap_servers": spec["bootstrap"], "security_protocol": spec["protocol"], "bootstrap_timeout_ms": int(timeout * 1000)}
    if spec.get("mechanism"):
        kw.update({"sasl_mechanism": spec["mechanism"], "sasl_plain_username": spec["user"], "sasl_plain_password": spec["password"]})
    if spec.get("ca"):
        kw["ssl_cafile"] = spec["ca"]
    if spec.get("cert"):
        kw.update({"ssl_certfile": spec["cert"], "ssl_keyfile": spec["key"]})
    try:
        if action == "produce":
            p = KafkaProducer(**kw, acks="all", max_block_ms=int(timeout * 1000), request_timeout_ms=int(timeout * 1000))
            futures = [p.send(topic, f"{spec.get('tag', 'v')}-{i}".encode()) for i in range(n)]
            for f in futures:
                f.get(timeout=timeout)
            p.close(timeout=5)
            return {"ok": True, "n": n}
        c = KafkaConsumer(**kw, enable_auto_commit=False, consumer_timeout_ms=int(timeout * 1000))
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        c.seek(tp, 0)
        got = 0
        for _ in c:
            got += 1
            if got >= n:
                break
        c.close()
        return {"ok": got >= n, "n": got, **({} if got >= n else {"error": "TIMEOUT"})}
    except Exception as exc:  # the test compares the class name with the refusal it expects
        name = type(exc).__name__
        if name == "KafkaTimeoutError":
            name = seen.cause() or name
        return {"ok": False, "error": name, "detail": str(exc)[:300], "log": [m for m in seen.messages if "ail" in m][:4]}


def aiokafka(action: str, spec: dict[str, Any], topic: str, n: int, timeout: float) -> dict[str, Any]:
    import asyncio

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.helpers import create_ssl_context

    kw: dict[str, Any] = {"bootstrap_servers": spec["bootstrap"], "security_protocol": spec["protocol"]}
    if spec.get("mechanism"):
        kw.update({"sasl_mechanism": spec["mechanism"], "sasl_plain_username": spec["user"], "sasl_plain_password": spec["password"]})
    if spec.get("ca"):
        kw["ssl_context"] = create_ssl_context(cafile=spec["ca"], certfile=spec.get("cert"), keyfile=spec.get("key"))

    async def run() -> dict[str, Any]:
        if action == "produce":
            p = AIOKafkaProducer(**kw, acks="all", request_timeout_ms=int(timeout * 1000))
            await p.start()
            try:
                for i in range(n):
                    await p.send_and_wait(topic, f"{spec.get('tag', 'v')}-{i}".encode())
            finally:
                await p.stop()
            return {"ok": True, "n": n}
        c = AIOKafkaConsumer(**kw, enable_auto_commit=False, auto_offset_reset="earliest")
        await c.start()
        try:
            tp = TopicPartition(topic, 0)
            c.assign([tp])
            c.seek(tp, 0)
            got = 0
            deadline = time.monotonic() + timeout
            while got < n and time.monotonic() < deadline:
                got += sum(len(msgs) for msgs in (await c.getmany(tp, timeout_ms=500)).values())
        finally:
            await c.stop()
        return {"ok": got >= n, "n": got, **({} if got >= n else {"error": "TIMEOUT"})}

    try:
        return asyncio.run(asyncio.wait_for(run(), timeout + 10))
    except Exception as exc:  # the test compares the class name with the refusal it expects
        return {"ok": False, "error": type(exc).__name__, "detail": str(exc)[:300]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("client", choices=["confluent", "kafka-python", "aiokafka"])
    ap.add_argument("action", choices=["produce", "consume"])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    run = {"confluent": confluent, "kafka-python": kafka_python, "aiokafka": aiokafka}[a.client]
    print(json.dumps(run(a.action, json.loads(a.spec), a.topic, a.n, a.timeout)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

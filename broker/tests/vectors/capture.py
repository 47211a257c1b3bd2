"""Dev-only tool: record real Kafka client traffic as golden protocol vectors.

Not part of the broker and never imported by tests. It owns three things:

* ``proxy``: a recording TCP proxy (asyncio; fine in a dev tool) that sits in front of a
  real broker, forwards every byte unchanged and writes each complete request frame
  (and the matching response frame) to ``<api>_<request|response>_v<N>_<client>_<NNN>.bin``.
  A file holds the frame exactly as it crossed the wire, 4-byte size prefix included.
* ``client <name>``: a scripted workload for one client library (kafka-python,
  confluent-kafka, aiokafka, kcat): create a topic, produce with keys, headers and
  compression, consume in a group, look offsets up by time, describe configs, list groups.
* ``run``: starts a broker per client (a tansu binary given on the command line, memory
  storage, loopback only, advertising the proxy's port), the proxy and the workload, and
  stops what it started by pid.

Usage (from the repository root)::

    python broker/tests/vectors/capture.py run --tansu PATH/TO/tansu --out broker/tests/vectors

Frames are de-duplicated by content and capped per (client, api, version, direction) so the
committed set stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_PER_KEY = 3
MAX_FILE_BYTES = 256 * 1024

API_NAMES = {
    0: "produce", 1: "fetch", 2: "list_offsets", 3: "metadata", 8: "offset_commit",
    9: "offset_fetch", 10: "find_coordinator", 11: "join_group", 12: "heartbeat",
    13: "leave_group", 14: "sync_group", 15: "describe_groups", 16: "list_groups",
    17: "sasl_handshake", 18: "api_versions", 19: "create_topics", 20: "delete_topics",
    21: "delete_records", 22: "init_producer_id", 23: "offset_for_leader_epoch",
    32: "describe_configs", 37: "create_partitions", 42: "delete_groups",
    47: "offset_delete", 60: "describe_cluster", 68: "consumer_group_heartbeat",
    75: "describe_topic_partitions",
}


# --------------------------------------------------------------------------- proxy


class Recorder:
    def __init__(self, out: Path, client: str) -> None:
        self.out = out
        self.client = client
        self.counts: dict[tuple[str, int, str], int] = {}
        self.seen: set[bytes] = set()

    def save(self, api_key: int, version: int, direction: str, frame: bytes) -> None:
        if len(frame) > MAX_FILE_BYTES:
            return
        # Ignore the correlation id so repeats of the same message are stored once.
        body = frame[12:] if direction == "request" else frame[8:]
        digest = hashlib.sha256(f"{api_key}/{version}/{direction}".encode() + body).digest()
        if digest in self.seen:
            return
        api = API_NAMES.get(api_key, f"api{api_key}")
        key = (api, version, direction)
        n = self.counts.get(key, 0)
        if n >= MAX_PER_KEY:
            return
        self.seen.add(digest)
        self.counts[key] = n + 1
        name = f"{api}_{direction}_v{version}_{self.client}_{n:03d}.bin"
        (self.out / name).write_bytes(frame)


def _strip_api_versions_tags(frame: bytes, version: int) -> bytes:
    """Re-encode an ApiVersions v3+ response without its default-valued tagged fields.

    tansu sends all four top-level tags (empty features, epoch -1, ...). librdkafka 2.0.x
    (Debian's kcat) fails on them with "Read underflow", so without this rewrite kcat
    could not get past ApiVersions. The recorded file keeps tansu's original bytes.
    """
    import io

    from kio.index import load_response_schema
    from kio.serial import entity_reader, entity_writer

    schema = load_response_schema(18, version)
    entity, _ = entity_reader(schema)(frame, 8)
    body = io.BytesIO()
    entity_writer(schema)(body, entity)
    payload = frame[4:8] + body.getvalue()
    return struct.pack(">i", len(payload)) + payload


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    on_frame: object,
) -> None:
    buf = bytearray()
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
            while len(buf) >= 4:
                (size,) = struct.unpack_from(">i", buf, 0)
                if len(buf) < 4 + size:
                    break
                frame = bytes(buf[: 4 + size])
                del buf[: 4 + size]
                writer.write(on_frame(frame))  # type: ignore[operator]
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _proxy_main(listen: int, upstream: int, recorder: Recorder) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            cw.close()
            return
        pending: dict[int, tuple[int, int]] = {}

        def on_request(frame: bytes) -> bytes:
            if len(frame) < 12:
                return frame
            api_key, version, corr = struct.unpack_from(">hhi", frame, 4)
            pending[corr] = (api_key, version)
            recorder.save(api_key, version, "request", frame)
            return frame

        def on_response(frame: bytes) -> bytes:
            if len(frame) < 8:
                return frame
            (corr,) = struct.unpack_from(">i", frame, 4)
            got = pending.pop(corr, None)
            if got is None:
                return frame
            recorder.save(got[0], got[1], "response", frame)
            if got[0] == 18 and got[1] >= 3:
                return _strip_api_versions_tags(frame, got[1])
            return frame

        await asyncio.gather(_pump(cr, uw, on_request), _pump(ur, cw, on_response))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


# --------------------------------------------------------------------------- workloads

TOPIC = "vectors"


def _kafka_python(bootstrap: str) -> None:
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="vectors-kp")
    with contextlib.suppress(Exception):
        admin.create_topics([NewTopic(TOPIC, 2, 1)])
    with contextlib.suppress(Exception):
        admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, TOPIC)])
    with contextlib.suppress(Exception):
        admin.describe_cluster()
    for codec in (None, "gzip"):
        producer = KafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, acks="all")
        for i in range(5):
            producer.send(TOPIC, key=f"k{i}".encode(), value=f"value-{i}".encode() * 3,
                          headers=[("h", b"v"), ("empty", b"")], partition=i % 2)
        producer.flush()
        producer.close()
    tps = [TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)]
    # assign() first: fetches without depending on the group protocol.
    plain = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                          auto_offset_reset="earliest", consumer_timeout_ms=3000)
    plain.assign(tps)
    print("kafka-python assign consumed", sum(1 for _ in plain))
    plain.close()
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id="vectors-kp-g",
                             auto_offset_reset="earliest", consumer_timeout_ms=4000)
    n = sum(1 for _ in consumer)
    print("kafka-python consumed", n)
    with contextlib.suppress(Exception):
        consumer.commit()
    with contextlib.suppress(Exception):
        consumer.offsets_for_times({tp: int(time.time() * 1000) - 60_000 for tp in tps})
    with contextlib.suppress(Exception):
        consumer.end_offsets(tps)
    consumer.close()
    with contextlib.suppress(Exception):
        admin.list_consumer_groups()
    with contextlib.suppress(Exception):
        admin.describe_consumer_groups(["vectors-kp-g"])
    with contextlib.suppress(Exception):
        admin.list_consumer_group_offsets("vectors-kp-g")
    with contextlib.suppress(Exception):
        admin.delete_topics([TOPIC])
    admin.close()


def _confluent(bootstrap: str) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with contextlib.suppress(Exception):
        for f in admin.create_topics([NewTopic(TOPIC, 2, 1)]).values():
            f.result(10)
    with contextlib.suppress(Exception):
        for f in admin.describe_configs([ConfigResource("topic", TOPIC)]).values():
            f.result(10)
    for codec in ("none", "snappy", "lz4", "zstd"):
        p = Producer({"bootstrap.servers": bootstrap, "compression.codec": codec,
                      "linger.ms": 50, "enable.idempotence": codec == "zstd"})
        for i in range(5):
            p.produce(TOPIC, key=f"k{i}".encode(), value=(f"{codec}-{i}" * 20).encode(),
                      headers=[("h", b"v")], partition=i % 2)
        p.flush(10)
    # assign() first: fetches without depending on the group protocol.
    a = Consumer({"bootstrap.servers": bootstrap, "group.id": "vectors-ck-assign",
                  "enable.auto.commit": False})
    a.assign([TopicPartition(TOPIC, p, -2) for p in (0, 1)])
    got, deadline = 0, time.time() + 8
    while time.time() < deadline and got < 20:
        m = a.poll(0.5)
        if m is not None and not m.error():
            got += 1
    print("confluent assign consumed", got)
    a.close()
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "vectors-ck-g",
                  "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
                  "max.poll.interval.ms": 8000})
    c.subscribe([TOPIC])
    got, deadline = 0, time.time() + 10
    while time.time() < deadline and got < 20:
        m = c.poll(0.5)
        if m is not None and not m.error():
            got += 1
    print("confluent consumed", got)
    with contextlib.suppress(Exception):
        c.commit(asynchronous=False)
    with contextlib.suppress(Exception):
        c.offsets_for_times([TopicPartition(TOPIC, 0, int(time.time() * 1000) - 60_000)], 5)
    with contextlib.suppress(Exception):
        c.get_watermark_offsets(TopicPartition(TOPIC, 0), 5)
    c.close()
    with contextlib.suppress(Exception):
        admin.list_topics(timeout=5)
    with contextlib.suppress(Exception):
        admin.list_consumer_groups().result(10)
    with contextlib.suppress(Exception):
        for f in admin.delete_topics([TOPIC]).values():
            f.result(10)


def _aiokafka(bootstrap: str) -> None:
    async def main() -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic
        from aiokafka.structs import TopicPartition

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        with contextlib.suppress(Exception):
            await admin.create_topics([NewTopic(TOPIC, 2, 1)])
        for codec in (None, "gzip", "lz4"):
            p = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec)
            await p.start()
            for i in range(5):
                await p.send_and_wait(TOPIC, key=f"k{i}".encode(), value=b"aio" * 10,
                                      headers=[("h", b"v")], partition=i % 2)
            await p.stop()
        c = AIOKafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id="vectors-aio-g",
                             auto_offset_reset="earliest")
        await c.start()
        try:
            got = 0
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(8):
                    async for _ in c:
                        got += 1
                        if got >= 15:
                            break
            print("aiokafka consumed", got)
            with contextlib.suppress(Exception):
                await c.commit()
            with contextlib.suppress(Exception):
                await c.offsets_for_times({TopicPartition(TOPIC, 0): 0})
        finally:
            await c.stop()
        with contextlib.suppress(Exception):
            await admin.delete_topics([TOPIC])
        await admin.close()

    asyncio.run(main())


def _kcat(bootstrap: str) -> None:
    kcat = shutil.which("kcat") or shutil.which("kafkacat")
    if kcat is None:
        print("kcat not installed; skipping")
        return

    def run(*args: str, data: bytes | None = None) -> None:
        subprocess.run([kcat, "-b", bootstrap, *args], input=data, timeout=30, check=False,
                       stdout=subprocess.DEVNULL)

    run("-L")
    run("-P", "-t", TOPIC, "-K", ":", "-H", "hk=hv", "-p", "0",
        data=b"a:one\nb:two\nc:three\n")
    run("-P", "-t", TOPIC, "-z", "snappy", "-p", "0", data=b"x\ny\nz\n")
    run("-C", "-t", TOPIC, "-o", "beginning", "-e", "-q")
    run("-Q", "-t", f"{TOPIC}:0:{int(time.time() * 1000) - 60_000}")
    run("-G", "vectors-kcat-g", "-o", "beginning", "-e", "-q", TOPIC)


CLIENTS = {"kafkapython": _kafka_python, "confluent": _confluent, "aiokafka": _aiokafka,
           "kcat": _kcat}


# --------------------------------------------------------------------------- orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(tansu: str, out: Path, clients: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    me = os.path.abspath(__file__)
    for name in clients:
        bport, pport = _free_port(), _free_port()
        with tempfile.TemporaryDirectory() as tmp:
            broker = subprocess.Popen(
                [tansu, "broker", "--listener-url", f"tcp://127.0.0.1:{bport}",
                 "--advertised-listener-url", f"tcp://127.0.0.1:{pport}",
                 "--storage-engine", "memory://tansu/"],
                cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            proxy = subprocess.Popen([sys.executable, me, "proxy", "--listen", str(pport),
                                      "--upstream", str(bport), "--client", name,
                                      "--out", str(out)])
            try:
                _wait_port(bport)
                _wait_port(pport)
                subprocess.run([sys.executable, me, "client", name,
                                "--bootstrap", f"127.0.0.1:{pport}"], timeout=180, check=False)
            finally:
                _stop(proxy)
                _stop(broker)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("proxy")
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--upstream", type=int, required=True)
    p.add_argument("--client", required=True)
    p.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("client")
    c.add_argument("name", choices=sorted(CLIENTS))
    c.add_argument("--bootstrap", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tansu", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--clients", default=",".join(CLIENTS))
    args = ap.parse_args()
    if args.cmd == "proxy":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_proxy_main(args.listen, args.upstream, Recorder(args.out, args.client)))
    elif args.cmd == "client":
        CLIENTS[args.name](args.bootstrap)
    else:
        _run(args.tansu, args.out, args.clients.split(","))


if __name__ == "__main__":
    main()

"""Dev-only benchmark: kio vs the fast path for Produce decode and Fetch encode.

    python broker/tests/vectors/bench_codec.py

Prints microseconds per request (best of 5 runs). Not a test: numbers depend on the host.
"""

from __future__ import annotations

import datetime
import io
import timeit
from typing import Any

from kio.schema.errors import ErrorCode
from kio.serial import entity_writer

from broker.protocol import (
    RequestHeader,
    decode_request,
    encode_request,
    encode_response_parts,
    request_schema,
    response_schema,
)

SIZES = [("1KiB", 1024), ("16KiB", 16 * 1024), ("1MiB", 1024 * 1024)]


def us(fn: Any, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def produce(version: int, size: int, partitions: int) -> bytes:
    mod = __import__(request_schema(0, version).__module__, fromlist=["x"])
    req = mod.ProduceRequest(
        acks=-1,
        timeout=datetime.timedelta(seconds=30),
        topic_data=(
            mod.TopicProduceData(
                name="bench-topic",
                partition_data=tuple(
                    mod.PartitionProduceData(index=i, records=b"r" * size)
                    for i in range(partitions)
                ),
            ),
        ),
    )
    return encode_request(RequestHeader(0, version, 1, "bench"), req)[4:]


def fetch(version: int, size: int, partitions: int) -> Any:
    mod = __import__(response_schema(1, version).__module__, fromlist=["x"])
    parts = tuple(
        mod.PartitionData(
            partition_index=i,
            error_code=ErrorCode.none,
            high_watermark=1000,
            last_stable_offset=1000,
            log_start_offset=0,
            aborted_transactions=None,
            records=b"r" * size,
        )
        for i in range(partitions)
    )
    kw: dict[str, Any] = {"error_code": ErrorCode.none, "session_id": 0}
    return mod.FetchResponse(
        throttle_time=datetime.timedelta(0),
        responses=(mod.FetchableTopicResponse(topic="bench-topic", partitions=parts),),
        **kw,
    )


def kio_fetch(resp: Any) -> bytes:
    out = io.BytesIO()
    out.write(b"\0\0\0\0\0\0\0\1\0")
    entity_writer(type(resp))(out, resp)
    return out.getvalue()


def main() -> None:
    print(f"{'case':40s} {'kio µs':>10s} {'fast µs':>10s}")
    for version in (7, 9, 11):
        for label, size in SIZES:
            for parts in (1, 10):
                payload = produce(version, size, parts)
                n = 200 if size * parts <= 1 << 20 else 20
                slow = us(lambda p=payload: decode_request(p, fast=False), n)
                fast = us(lambda p=payload: decode_request(p, fast=True), n)
                print(f"Produce v{version} decode {parts}x{label:6s}{'':14s} {slow:10.1f} {fast:10.1f}")
    for version in (11, 12):
        for label, size in SIZES:
            for parts in (1, 10):
                resp = fetch(version, size, parts)
                header = RequestHeader(1, version, 1, None)
                n = 200 if size * parts <= 1 << 20 else 20
                slow = us(lambda r=resp: kio_fetch(r), n)
                fast = us(lambda r=resp, h=header: encode_response_parts(h, r), n)
                print(f"Fetch v{version} encode {parts}x{label:6s}{'':16s} {slow:10.1f} {fast:10.1f}")


if __name__ == "__main__":
    main()

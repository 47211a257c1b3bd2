"""Fuzz: whatever bytes arrive, decoders raise only their typed errors.

Inputs are random bytes and mutations (bit flips, truncations, insertions) of the golden
vectors, so the fuzzer reaches deep into real message shapes.
"""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.protocol import (
    RECOMMENDED_RANGES,
    FrameDecoder,
    ProtocolError,
    RecordBatchError,
    decode_request,
    parse_request_header,
)
from broker.protocol import records as rec
from broker.protocol.fastpath import decode_produce_request

VECTORS = Path(__file__).parent / "vectors"
REQUESTS = [p.read_bytes()[4:] for p in sorted(VECTORS.glob("*_request_*.bin"))]
BATCHES = [
    bytes(b)
    for p in sorted(VECTORS.glob("produce_request_*.bin"))
    for t in decode_request(p.read_bytes()[4:])[1].topic_data
    for part in t.partition_data
    for b in rec.split_batches(part.records)
]
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def mutated(draw: st.DrawFn, corpus: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "set"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "set" and data:
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF]))
    return bytes(data)


def requests() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), mutated(REQUESTS))


@FUZZ
@given(requests(), st.booleans())
def test_decode_request_raises_only_protocol_errors(payload: bytes, fast: bool) -> None:
    with contextlib.suppress(ProtocolError):
        decode_request(payload, supported=RECOMMENDED_RANGES, fast=fast)
    try:  # the hand-written Produce decoder, whatever the frame size
        if len(payload) >= 8:
            decode_produce_request(payload, 8, 3 + payload[0] % 9)
    except ProtocolError:
        pass


@FUZZ
@given(requests())
def test_parse_header_raises_only_protocol_errors(payload: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_request_header(payload)


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 100))
def test_frame_decoder_raises_only_protocol_errors(data: bytes, limit: int) -> None:
    dec = FrameDecoder(max_frame_size=limit, large_frame_size=8)
    try:
        for i in range(0, len(data), 5):
            dec.receive_data(data[i : i + 5])
            while dec.next_frame() is not None:
                pass
    except ProtocolError:
        pass


def batches() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=120), mutated(BATCHES))


@FUZZ
@given(batches())
def test_record_decoders_raise_only_record_errors(data: bytes) -> None:
    for fn in (
        rec.parse_batch_header,
        rec.verify_crc,
        rec.split_batches,
        rec.decode_records,
        rec.validate_batch,
        lambda b: rec.find_offset_for_timestamp(b, 0),
    ):
        with contextlib.suppress(RecordBatchError):
            fn(data)


@FUZZ
@given(st.sampled_from(range(8)), st.binary(max_size=100))
def test_decompress_raises_only_record_errors(codec: int, data: bytes) -> None:
    with contextlib.suppress(RecordBatchError):
        rec.decompress(codec, data, max_size=1000)


def test_corpora_are_not_empty() -> None:
    assert len(REQUESTS) > 50 and len(BATCHES) > 5
    assert struct.unpack_from(">h", REQUESTS[0])[0] >= 0

"""Golden vectors: frames recorded from real clients (and the tansu broker's answers).

Recorded by `vectors/capture.py` from kafka-python 3.0.12, confluent-kafka 2.16.1
(librdkafka 2.16), aiokafka 0.14.0 and kcat 1.7.1 (librdkafka 2.0.2). Each file is one
frame, size prefix included. Every frame is decoded whole and byte by byte through
`FrameDecoder`; requests are re-encoded byte-identical. Responses (tansu's) are
re-encoded and must decode to the same entity; they are byte-identical unless tansu sent
tagged fields holding default values, which we (like Kafka) never write.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from broker.protocol import (
    FrameDecoder,
    RequestHeader,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from broker.protocol.records import split_batches, validate_batch

VECTORS = Path(__file__).parent / "vectors"
NAME = re.compile(r"(?P<api>[a-z_0-9]+)_(?P<dir>request|response)_v(?P<v>\d+)_(?P<client>[a-z]+)_\d{3}\.bin")
KEYS = {
    "produce": 0, "fetch": 1, "list_offsets": 2, "metadata": 3, "offset_commit": 8,
    "offset_fetch": 9, "find_coordinator": 10, "join_group": 11, "heartbeat": 12,
    "leave_group": 13, "sync_group": 14, "describe_groups": 15, "list_groups": 16,
    "api_versions": 18, "create_topics": 19, "delete_topics": 20, "init_producer_id": 22,
    "describe_configs": 32, "describe_cluster": 60, "api71": 71,
}  # fmt: skip

FILES = sorted(VECTORS.glob("*.bin"))


def test_vectors_present() -> None:
    clients = {NAME.fullmatch(f.name).group("client") for f in FILES}  # type: ignore[union-attr]
    assert {"kafkapython", "confluent", "aiokafka", "kcat"} <= clients
    assert len(FILES) > 100


def _payload_through_decoder(data: bytes, byte_by_byte: bool, trailing: int = 0) -> bytes:
    dec = FrameDecoder(large_frame_size=256)
    frames = []
    chunks = [data[i : i + 1] for i in range(len(data))] if byte_by_byte else [data]
    for c in chunks:
        dec.receive_data(c)
        while (f := dec.next_frame()) is not None:
            frames.append(bytes(f))
    assert dec.buffered == trailing
    assert len(frames) == 1
    return frames[0]


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_vector(path: Path) -> None:
    m = NAME.fullmatch(path.name)
    assert m, path.name
    key, version = KEYS[m.group("api")], int(m.group("v"))
    data = path.read_bytes()
    assert struct.unpack_from(">i", data)[0] == len(data) - 4
    payload = _payload_through_decoder(data, byte_by_byte=False)
    assert _payload_through_decoder(data, byte_by_byte=True) == payload
    assert _payload_through_decoder(data + b"\x00\x00", False, trailing=2) == payload
    if m.group("dir") == "request":
        header, entity = decode_request(payload)
        assert (header.api_key, header.api_version) == (key, version)
        assert encode_request(header, entity) == data
        if key == 0:
            for topic in entity.topic_data:
                for part in topic.partition_data:
                    for batch in split_batches(part.records):
                        validate_batch(batch)  # CRC, counts, every record decodes
    else:
        corr, entity = decode_response(payload, key, version)
        again = encode_response(RequestHeader(key, version, corr, None), entity)
        assert decode_response(again[4:], key, version) == (corr, entity)
        if again != data:
            # Only tagged fields at their default may be dropped: we are shorter.
            assert len(again) < len(data), path.name

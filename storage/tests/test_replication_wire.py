"""Replication wire codec: known-answer vectors from the pinned JS, framing byte by byte,
message round trips and a fuzz test that only typed errors escape."""

from __future__ import annotations

import json
from pathlib import Path

import nacl.bindings as sodium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.replication import messages as M
from storage.replication.errors import (
    FramingError,
    HandshakeError,
    MessageError,
    ReplicationError,
)
from storage.replication.mux import (
    ChannelClosed,
    ChannelMessage,
    ChannelOpened,
    Mux,
    RemoteOpen,
    encode_batch,
)
from storage.replication.noise import Ed25519KeyPair, NoiseXX
from storage.replication.secretstream import (
    ID_HEADER_BYTES,
    SecretStream,
    stream_id,
)
from storage.replication.session import capability

VECTORS = json.loads((Path(__file__).parent / "interop" / "replication_vectors.json").read_text())


def _kp(hexseed: str) -> Ed25519KeyPair:
    return Ed25519KeyPair.from_seed(bytes.fromhex(hexseed))


# ----------------------------------------------------------------------- handshake


@pytest.mark.parametrize("v", VECTORS["handshakes"])
def test_noise_xx_matches_js(v: dict[str, str]) -> None:
    i = NoiseXX(True, _kp(v["initiator_seed"]), ephemeral=_kp(v["initiator_ephemeral_seed"]))
    r = NoiseXX(False, _kp(v["responder_seed"]), ephemeral=_kp(v["responder_ephemeral_seed"]))
    m1 = i.write_message()
    assert m1.hex() == v["messages"][0]
    r.read_message(m1)
    m2 = r.write_message()
    assert m2.hex() == v["messages"][1]
    i.read_message(m2)
    m3 = i.write_message()
    assert m3.hex() == v["messages"][2]
    r.read_message(m3)
    assert i.complete and r.complete
    assert i.handshake_hash.hex() == r.handshake_hash.hex() == v["handshake_hash"]
    assert (i.tx.hex(), i.rx.hex()) == (v["initiator_tx"], v["initiator_rx"])
    assert (r.tx.hex(), r.rx.hex()) == (v["responder_tx"], v["responder_rx"])
    assert i.rs is not None and i.rs.hex() == v["initiator_remote_static"]
    assert r.rs is not None and r.rs.hex() == v["responder_remote_static"]
    hh = i.handshake_hash
    assert stream_id(hh, True).hex() == v["stream_id_initiator"]
    assert stream_id(hh, False).hex() == v["stream_id_responder"]
    key = bytes.fromhex(v["core_key"])
    assert capability(True, key, hh).hex() == v["capability_initiator"]
    assert capability(False, key, hh).hex() == v["capability_responder"]


@pytest.mark.parametrize("v", VECTORS["handshakes"])
def test_noise_responder_replays_js_initiator(v: dict[str, str]) -> None:
    # Our responder, fed the JS initiator's messages, derives the same keys.
    r = NoiseXX(False, _kp(v["responder_seed"]), ephemeral=_kp(v["responder_ephemeral_seed"]))
    r.read_message(bytes.fromhex(v["messages"][0]))
    assert r.write_message().hex() == v["messages"][1]
    r.read_message(bytes.fromhex(v["messages"][2]))
    assert r.tx.hex() == v["responder_tx"]


def test_noise_tampered_message_is_handshake_error() -> None:
    v = VECTORS["handshakes"][0]
    i = NoiseXX(True, _kp(v["initiator_seed"]), ephemeral=_kp(v["initiator_ephemeral_seed"]))
    i.write_message()
    m2 = bytearray.fromhex(v["messages"][1])
    m2[40] ^= 1  # inside the encrypted static key
    with pytest.raises(HandshakeError):
        i.read_message(bytes(m2))


def test_noise_short_and_out_of_turn() -> None:
    v = VECTORS["handshakes"][0]
    r = NoiseXX(False, _kp(v["responder_seed"]))
    with pytest.raises(HandshakeError):
        r.read_message(b"\x01" * 10)
    i = NoiseXX(True, _kp(v["initiator_seed"]))
    with pytest.raises(HandshakeError):
        i.read_message(b"\x00" * 32)  # the initiator must write first


# --------------------------------------------------------------------- secretstream


def test_secretstream_pulls_js_ciphertexts() -> None:
    v = VECTORS["secretstream"]
    state = sodium.crypto_secretstream_xchacha20poly1305_state()
    sodium.crypto_secretstream_xchacha20poly1305_init_pull(
        state, bytes.fromhex(v["header"]), bytes.fromhex(v["key"])
    )
    for ct, pt in zip(v["ciphertexts"], v["plaintexts"], strict=True):
        m, tag = sodium.crypto_secretstream_xchacha20poly1305_pull(state, bytes.fromhex(ct))
        assert m.hex() == pt and tag == 0


def _connected_pair() -> tuple[SecretStream, SecretStream]:
    a, b = SecretStream(True), SecretStream(False)
    for _ in range(4):
        b.receive_data(a.data_to_send())
        a.receive_data(b.data_to_send())
    assert a.established and b.established
    return a, b


def test_secretstream_frames_byte_by_byte() -> None:
    a, b = SecretStream(True), SecretStream(False)
    first = a.data_to_send()
    assert first[:3] == (32).to_bytes(3, "little") and len(first) == 35  # e only
    for byte in first:
        b.receive_data(bytes([byte]))
    second = b.data_to_send()
    # message 2: e, encrypted s, encrypted empty payload = 32 + 48 + 16 bytes
    assert second[:3] == (96).to_bytes(3, "little") and len(second) == 99
    for byte in second:
        a.receive_data(bytes([byte]))
    third = a.data_to_send()
    # message 3 (encrypted s + payload = 64 bytes), then the 56-byte id header
    assert third[:3] == (64).to_bytes(3, "little")
    assert third[67:70] == ID_HEADER_BYTES.to_bytes(3, "little") and len(third) == 67 + 59
    assert third[70:102] == stream_id(a.handshake_hash, True)
    b.receive_data(third)
    fourth = b.data_to_send()
    assert len(fourth) == 59 and fourth[3:35] == stream_id(b.handshake_hash, False)
    for byte in fourth:
        a.receive_data(bytes([byte]))
    assert a.established and b.established
    assert a.remote_public_key == b.static.public_key
    assert b.remote_public_key == a.static.public_key
    a.send(b"hello")
    a.send(b"")  # keep-alive: dropped by the receiver
    a.send(b"world" * 1000)
    wire = a.data_to_send()
    assert wire[:3] == (5 + 17).to_bytes(3, "little")
    got: list[bytes] = []
    for byte in wire:
        got += b.receive_data(bytes([byte]))
    assert got == [b"hello", b"world" * 1000]


def test_secretstream_tampered_frame() -> None:
    a, b = _connected_pair()
    a.send(b"payload")
    wire = bytearray(a.data_to_send())
    wire[5] ^= 0x40
    with pytest.raises(FramingError):
        b.receive_data(bytes(wire))


def test_secretstream_short_frame_and_bad_header() -> None:
    _a, b = _connected_pair()
    with pytest.raises(FramingError):
        b.receive_data(b"\x03\x00\x00abc")
    x, y = SecretStream(True), SecretStream(False)
    y.receive_data(x.data_to_send())
    x.receive_data(y.data_to_send())
    out = bytearray(x.data_to_send())
    out[-30] ^= 1  # inside x's stream id
    with pytest.raises(HandshakeError):
        y.receive_data(bytes(out))


# ------------------------------------------------------------------------ messages


@pytest.mark.parametrize(("name", "hexbody"), VECTORS["wire"])
def test_wire_vectors_round_trip(name: str, hexbody: str) -> None:
    body = bytes.fromhex(hexbody)
    if name == "manifest":
        from storage.hypercore import Manifest

        assert Manifest.decode(body).encode() == body
        return
    if name == "handshake":
        assert M.decode_handshake(body).encode() == body
        return
    type_ = {
        "sync": 0, "request": 1, "cancel": 2, "data": 3, "noData": 4, "want": 5,
        "unwant": 6, "bitfield": 7, "range": 8, "extension": 9,
    }[name]
    msg = M.decode_message(type_, body)
    assert int(msg.TYPE) == type_
    assert msg.encode() == body
    # every strict prefix is rejected with a typed error, or (for the optional trailing
    # flags of noData/want/unwant, as in JS) decodes to a message that round-trips
    for cut in range(len(body)):
        try:
            m2 = M.decode_message(type_, body[:cut])
        except MessageError:
            continue
        assert name in ("noData", "want", "unwant", "extension")  # extension: raw tail
        assert M.decode_message(type_, m2.encode()) == m2
    if name != "extension":
        with pytest.raises(MessageError):
            M.decode_message(type_, body + b"\x00\x00")


def test_wire_vector_values() -> None:
    sync = M.decode_message(0, bytes.fromhex(VECTORS["wire"][3][1]))
    assert sync == M.Sync(3, 70000, 300, False, True, True, False, True)
    bf = M.decode_message(7, bytes.fromhex(VECTORS["wire"][15][1]))
    assert bf == M.Bitfield(32768, (1, 0xFFFFFFFF, 0x80000000))
    rng = M.decode_message(8, bytes.fromhex(VECTORS["wire"][17][1]))
    assert rng == M.Range(7, 1, drop=True)


def test_unknown_type_and_seek_data() -> None:
    with pytest.raises(MessageError):
        M.decode_message(10, b"")
    with pytest.raises(MessageError):
        M.decode_message(3, b"\x04\x01\x00\x05\x00")  # data with a seek proof


# ----------------------------------------------------------------------------- mux


def test_mux_open_pair_message_batch_close() -> None:
    a, b = Mux(), Mux()
    ch_a, ev = a.open("hypercore/alpha", b"\x01" * 32, b"HS-A")
    assert ev == []
    (open_a,) = a.outgoing()
    assert open_a == b"\x00\x01\x01" + b"\x0fhypercore/alpha" + b"\x20" + b"\x01" * 32 + b"HS-A"
    (ro,) = b.feed(open_a)
    assert isinstance(ro, RemoteOpen) and ro.handshake == b"HS-A"
    ch_b, ev = b.open("hypercore/alpha", b"\x01" * 32, b"HS-B")
    assert [type(e) for e in ev] == [ChannelOpened] and ch_b.remote_handshake == b"HS-A"
    (opened,) = a.feed(b.outgoing()[0])
    assert isinstance(opened, ChannelOpened) and ch_a.remote_handshake == b"HS-B"
    a.cork()
    a.send(ch_a, 0, b"x")
    a.send(ch_a, 8, b"yz")
    a.uncork()
    (batch,) = a.outgoing()
    assert batch == b"\x00\x00\x01" + b"\x02\x00x" + b"\x03\x08yz"
    evs = b.feed(batch)
    assert [(e.type, e.payload) for e in evs if isinstance(e, ChannelMessage)] == [(0, b"x"), (8, b"yz")]
    a.send(ch_a, 5, b"\x07")
    assert b.feed(a.outgoing()[0]) == [ChannelMessage(ch_b, 5, b"\x07")]
    a.close(ch_a)
    (close,) = a.outgoing()
    assert close == b"\x00\x03\x01"
    (ev_close,) = b.feed(close)
    assert isinstance(ev_close, ChannelClosed) and ev_close.remote
    assert b.feed(b"\x01\x00\x00") == []  # closed channel: ignored like protomux


def test_mux_batch_switches_channel() -> None:
    raw = encode_batch([(1, 0, b"a"), (2, 1, b"b"), (2, 2, b"")])
    assert raw == b"\x00\x00\x01\x02\x00a\x00\x02\x02\x01b\x01\x02"


def test_mux_rejects_garbage() -> None:
    m = Mux()
    for bad in (b"\x00", b"\x00\x01", b"\x00\x01\x01\x05ab", b"\x00\x00\x01\x05\x00", b"\xfd\x01"):
        with pytest.raises(MessageError):
            m.feed(bad)
    with pytest.raises(MessageError):
        m.feed(b"\x00\x02\x07")  # reject of a channel we never opened


# ---------------------------------------------------------------------------- fuzz


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 12), st.binary(max_size=200))
def test_fuzz_messages_only_typed_errors(type_: int, body: bytes) -> None:
    try:
        m = M.decode_message(type_, body)
    except MessageError:
        return
    M.decode_message(type_, m.encode())  # what decodes re-encodes to something valid


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=60), max_size=6))
def test_fuzz_mux_only_typed_errors(frames: list[bytes]) -> None:
    m = Mux()
    m.open("hypercore/alpha", b"\x01" * 32, b"")
    for f in frames:
        try:
            m.feed(f)
        except MessageError:
            return


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_fuzz_secretstream_only_typed_errors(data: bytes, initiator: bool) -> None:
    s = SecretStream(initiator)
    try:
        s.receive_data(data)
    except ReplicationError:
        return


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_established_stream_only_typed_errors(data: bytes) -> None:
    _a, b = _connected_pair()
    try:
        b.receive_data(data)
    except ReplicationError:
        return


def test_secretstream_large_frames_in_any_chunking() -> None:
    # receive_data decrypts whole frames in place and buffers only a torn tail: every
    # way of cutting the wire must give the same messages, and a tampered frame that
    # arrives in pieces is still a FramingError (not a BufferError from a live view).
    msgs = [b"", b"x", bytes(range(256)) * 256, b"y" * 100_003, b"z" * 17]
    for chunk in (1 << 18, 65_536, 4_099, 7):
        a, b = _connected_pair()
        for m in msgs:
            a.send(m)
        wire = a.data_to_send()
        got: list[bytes] = []
        for i in range(0, len(wire), chunk):
            got += b.receive_data(memoryview(wire)[i : i + chunk])
        assert got == [m for m in msgs if m]
        a.send(b"q" * 70_000)
        bad = bytearray(a.data_to_send())
        bad[50_000] ^= 1
        with pytest.raises(FramingError):
            for i in range(0, len(bad), chunk):
                b.receive_data(bytes(bad[i : i + chunk]))

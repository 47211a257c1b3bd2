"""FrameDecoder: whole, byte by byte, with trailing garbage, and hostile size prefixes."""

from __future__ import annotations

import struct

import pytest

from broker.protocol import FrameDecoder, FrameTooLarge, InvalidFrame, frame

PAYLOADS = [b"", b"a", b"hello" * 10, bytes(range(256)) * 300]  # last one is a "large" frame


def drain(dec: FrameDecoder) -> list[bytes]:
    out = []
    while (f := dec.next_frame()) is not None:
        out.append(bytes(f))
    return out


def stream() -> bytes:
    return b"".join(frame(p) for p in PAYLOADS)


def test_whole() -> None:
    dec = FrameDecoder()
    dec.receive_data(stream())
    assert drain(dec) == PAYLOADS
    assert dec.buffered == 0


@pytest.mark.parametrize("grow_chunk", [1, 1000, 1 << 20])
def test_byte_by_byte(grow_chunk: int) -> None:
    dec = FrameDecoder(
        large_frame_size=100, grow_chunk=grow_chunk
    )  # exercise the large-frame path too
    got = []
    for b in stream():
        dec.receive_data(bytes([b]))
        got += drain(dec)
    assert got == PAYLOADS
    assert dec.buffered == 0


@pytest.mark.parametrize("grow_chunk", [1, 1000, 1 << 20])
@pytest.mark.parametrize("chunk", [3, 7, 1000, 65536])
def test_chunks(chunk: int, grow_chunk: int) -> None:
    data = stream()
    dec = FrameDecoder(large_frame_size=64, grow_chunk=grow_chunk)
    got = []
    for i in range(0, len(data), chunk):
        dec.receive_data(memoryview(data)[i : i + chunk])
        got += drain(dec)
    assert got == PAYLOADS


def test_trailing_garbage_waits() -> None:
    dec = FrameDecoder()
    dec.receive_data(stream() + b"\x00\x00\x01")  # 3 bytes of a next size prefix
    assert drain(dec) == PAYLOADS
    assert dec.next_frame() is None
    assert dec.buffered == 3
    dec.receive_data(b"\x00xyz")  # completes a 256-byte size; the body is still missing
    assert dec.next_frame() is None


def test_negative_size_rejected_and_poisons() -> None:
    dec = FrameDecoder()
    dec.receive_data(frame(b"ok") + struct.pack(">i", -5))
    assert dec.next_frame() == b"ok"
    with pytest.raises(InvalidFrame):
        dec.next_frame()
    with pytest.raises(InvalidFrame):
        dec.next_frame()


def test_too_large_rejected_before_buffering_body() -> None:
    dec = FrameDecoder(max_frame_size=1000)
    dec.receive_data(struct.pack(">i", 1001))
    with pytest.raises(FrameTooLarge) as info:
        dec.next_frame()
    assert info.value.size == 1001 and info.value.limit == 1000


def test_max_size_frame_accepted() -> None:
    dec = FrameDecoder(max_frame_size=10)
    dec.receive_data(frame(b"x" * 10))
    assert dec.next_frame() == b"x" * 10


def test_huge_claim_allocates_nothing_up_front() -> None:
    dec = FrameDecoder()
    dec.receive_data(struct.pack(">i", 100 * 1024 * 1024) + b"abc")
    assert dec.next_frame() is None
    assert dec.buffered == 3  # memory grows only with received bytes


def test_large_frame_is_caller_owned_and_writable() -> None:
    dec = FrameDecoder(large_frame_size=16)
    dec.receive_data(frame(b"A" * 32) + frame(b"B" * 40))
    first = dec.next_frame()
    assert isinstance(first, memoryview) and not first.readonly
    # Keeping a view must not stop the decoder from buffering and compacting.
    keep = first[4:8]
    dec.receive_data(frame(b"C" * 20) * 50)
    rest = drain(dec)
    assert rest == [b"B" * 40] + [b"C" * 20] * 50
    assert bytes(keep) == b"AAAA"


@pytest.mark.parametrize("grow_chunk", [7, 1000, 1 << 20])
@pytest.mark.parametrize("chunk", [5, 4096, 1 << 20])
def test_recv_into_a_growing_large_frame(chunk: int, grow_chunk: int) -> None:
    """As the server reads: into receive_buffer() while it offers one, else receive_data,
    and mixing the two within one frame."""
    data = stream() + frame(b"tail")
    dec = FrameDecoder(large_frame_size=64, grow_chunk=grow_chunk)
    got, i, direct, turn = [], 0, 0, 0
    while i < len(data):
        room = dec.receive_buffer()
        turn += 1
        if room is not None and turn % 3:
            assert len(room) <= grow_chunk
            n = min(chunk, len(room), len(data) - i)
            room[:n] = data[i : i + n]
            del room
            dec.received_into(n)
            direct += n
        else:
            del room
            n = min(chunk, len(data) - i)
            dec.receive_data(data[i : i + n])
        i += n
        got += drain(dec)
    assert got == [*PAYLOADS, b"tail"]
    assert dec.buffered == 0
    assert direct > 0 if chunk < len(PAYLOADS[-1]) else True
    with pytest.raises(ValueError):
        dec.received_into(1)  # no frame is being assembled


def test_nothing_allocated_ahead_of_the_bytes_beyond_one_chunk() -> None:
    """A 2 MiB size prefix alone costs nothing; each receive_buffer() offers one chunk."""
    dec = FrameDecoder(grow_chunk=64 * 1024)
    dec.receive_data(struct.pack(">i", 2 * 1024 * 1024) + b"abc")
    assert dec.next_frame() is None
    assert dec.announced == 2 * 1024 * 1024
    assert dec.buffered == 3
    filled = 3
    while (room := dec.receive_buffer()) is not None:
        assert 0 < len(room) <= 64 * 1024  # never the whole frame ahead of its bytes
        n = len(room)
        room[:] = b"z" * n
        del room
        dec.received_into(n)
        filled += n
    frame_ = dec.next_frame()
    assert frame_ is not None and len(frame_) == filled == 2 * 1024 * 1024
    assert bytes(frame_[:3]) == b"abc"


def test_announced() -> None:
    dec = FrameDecoder(max_frame_size=1000)
    assert dec.announced is None
    dec.receive_data(b"\x00\x00")
    assert dec.announced is None
    dec.receive_data(b"\x00\x05ab")
    assert dec.announced == 5
    dec.receive_data(b"cde" + struct.pack(">i", 5000))
    assert dec.next_frame() == b"abcde"
    assert dec.announced is None  # too large: next_frame refuses it
    with pytest.raises(FrameTooLarge):
        dec.next_frame()


def test_linear_buffering_many_small_frames() -> None:
    # 20k frames fed in one go: quadratic front-deletion would take seconds here.
    dec = FrameDecoder()
    dec.receive_data(frame(b"x" * 10) * 20000)
    assert sum(1 for _ in iter(dec.next_frame, None)) == 20000


def test_frame_prefix() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x03abc"


def test_needed() -> None:
    dec = FrameDecoder(large_frame_size=16)
    assert dec.needed is None
    dec.receive_data(b"\x00\x00")
    assert dec.needed == 2
    dec.receive_data(b"\x00\x08abc")
    assert dec.needed == 5
    dec.receive_data(b"defgh" + struct.pack(">i", 100) + b"x")
    assert dec.next_frame() == b"abcdefgh"
    assert dec.next_frame() is None
    assert dec.needed == 99  # a large frame in progress


def test_grow_explicitly_then_read_into_the_room() -> None:
    dec = FrameDecoder(grow_chunk=64 * 1024)
    dec.receive_data(struct.pack(">i", 100_000) + b"ab")
    assert dec.next_frame() is None and dec.receiving_large
    assert (dec.room, dec.growth) == (0, 64 * 1024)
    assert dec.grow(1000) == 1000  # at most what was granted
    assert dec.room == 1000
    room = dec.receive_buffer()  # the room there: not grown again
    assert room is not None and len(room) == 1000
    room[:] = b"c" * 1000
    del room
    dec.received_into(1000)
    assert dec.grow(1 << 20) == 64 * 1024  # at most one chunk
    assert dec.grow(1 << 20) == 100_000 - 2 - 1000 - 64 * 1024  # never past the frame
    assert dec.grow(1) == 0
    dec.receive_data(b"d" * (100_000 - 1002))  # fills the grown room, then done
    frame_ = dec.next_frame()
    assert frame_ is not None and len(frame_) == 100_000 and bytes(frame_[:4]) == b"abcc"


def test_growing_writes_no_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The room a large frame grows by is left for recv_into to write (CPython: resized,
    not zero-filled first), and the frame still comes out as received."""
    from broker.protocol import framing

    def no_zero_fill(n: int) -> bytes:
        raise AssertionError(f"{n} bytes zero-filled")

    monkeypatch.setattr(framing, "_zeros", no_zero_fill)
    dec = FrameDecoder(large_frame_size=1024, grow_chunk=4096)
    payload = bytes(range(256)) * 40
    dec.receive_data(struct.pack(">i", len(payload)))
    assert dec.next_frame() is None
    while (room := dec.receive_buffer()) is not None:
        n = min(len(room), 1000)
        with room:
            room[:n] = payload[dec.buffered : dec.buffered + n]
        dec.received_into(n)
    got = dec.next_frame()
    assert got is not None and bytes(got) == payload

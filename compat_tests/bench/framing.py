"""Microbenchmark: 1 MiB request frames through `FrameDecoder` from a real socket.

The receiving loop is the server's (`broker.server._read_requests`): `recv_into` the
decoder's `receive_buffer()` while it offers one, else `recv` a chunk and
`receive_data` it. A thread writes the frames through a socketpair. Prints MiB/s and
microseconds per frame, best of `--runs`.

    python -m compat_tests.bench.framing [--frames N] [--frame-kib K] [--runs R]
"""

from __future__ import annotations

import argparse
import socket
import struct
import threading
import time

from broker.protocol.framing import FrameDecoder

RECEIVE_SIZE = 256 * 1024  # as broker.server


def _send(sock: socket.socket, frame: bytes, count: int) -> None:
    for _ in range(count):
        sock.sendall(frame)


def run_once(frames: int, size: int) -> float:
    a, b = socket.socketpair()
    payload = bytes(range(256)) * (size // 256)
    frame = struct.pack(">i", len(payload)) + payload
    sender = threading.Thread(target=_send, args=(a, frame, frames))
    decoder = FrameDecoder()
    got = 0
    start = time.perf_counter()
    sender.start()
    while got < frames:
        room = decoder.receive_buffer()
        if room is None:
            decoder.receive_data(b.recv(RECEIVE_SIZE))
        else:
            n = b.recv_into(room)
            del room
            decoder.received_into(n)
        while (f := decoder.next_frame()) is not None:
            assert len(f) == size
            got += 1
    elapsed = time.perf_counter() - start
    sender.join()
    a.close()
    b.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--frame-kib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    size = args.frame_kib * 1024
    best = min(run_once(args.frames, size) for _ in range(args.runs))
    mib = args.frames * size / (1 << 20)
    print(
        f"{args.frames} frames of {args.frame_kib} KiB: {mib / best:.0f} MiB/s, {best / args.frames * 1e6:.0f} us/frame (best of {args.runs})"
    )


if __name__ == "__main__":
    main()

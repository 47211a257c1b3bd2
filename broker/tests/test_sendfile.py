"""FileSlice: the file ranges Fetch answers with over plain TCP (broker/sendfile.py).
The end-to-end path (byte-exact answers, descriptors closed) is in test_server.py."""

from __future__ import annotations

import os
from pathlib import Path

from broker.sendfile import FileSlice


def test_file_slice_outlives_the_segment_it_was_cut_from(tmp_path: Path) -> None:
    # Retention may close and unlink a segment between Fetch reading it and the writer
    # sending it: the slice holds its own descriptor, so it still reads the stored bytes.
    path = tmp_path / "segment.log"
    path.write_bytes(b"x" * 10 + b"payload" + b"y" * 10)
    fd = os.open(path, os.O_RDONLY)
    piece = FileSlice(fd, 10, 7)
    os.close(fd)
    path.unlink()
    assert len(piece) == 7 and piece.read() == b"payload"
    piece.close()
    piece.close()  # idempotent
    assert piece.fd == -1

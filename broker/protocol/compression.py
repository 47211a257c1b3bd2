"""Compressing a batch's records as Kafka's broker does: a topic's compression.type.

Owns `compress` (one codec over a records section, in the framing Kafka's own broker
writes, so every client that reads Kafka reads ours) and `recompress_batch` (a v2 batch
rebuilt with another codec). Kafka's LogValidator rebuilds a produced batch when the
topic's compression.type is a codec other than the batch's ("producer" keeps the
producer's); the broker calls `recompress_batch` after the batch and every record passed
validation and before the batch is admitted, so only the rebuilt bytes are signed.

The rebuilt batch keeps every header field (producer id, epoch, sequence, timestamps,
attributes other than the codec bits) and the records byte for byte; only the records
section's compression, batchLength and the CRC change. Kafka rebuilds the records too
(renumbering inner offsets, which we already require to be 0..n-1) and ends with the same
records.

Framing, as Kafka's Java codecs write it:
  gzip    one gzip member (zlib, compression.gzip.level; -1 is zlib's default);
  snappy  xerial framing (magic, version 1, compatible 1, then int32-length blocks of at
          most 32 KiB input), which every client's snappy reader accepts;
  lz4     one LZ4 frame, 64 KiB independent blocks, no checksums, no content size (what
          KafkaLZ4BlockOutputStream writes), at compression.lz4.level;
  zstd    one zstd frame at compression.zstd.level.

Imports the codec libraries lazily, `records` and the standard library; no I/O.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Final

from ._wire import Buf
from .records import (
    ATTR_CODEC_MASK,
    BATCH_HEADER_SIZE,
    CRC_OFFSET,
    DEFAULT_MAX_DECOMPRESSED,
    LOG_OVERHEAD,
    Compression,
    compute_crc,
    decompress,
    parse_batch_header,
)

__all__ = ["CODEC_BY_NAME", "DEFAULT_LEVELS", "compress", "recompress_batch", "topic_compression"]

# compression.type values that name a codec ("producer" names none).
CODEC_BY_NAME: Final = {
    "uncompressed": Compression.NONE,
    "gzip": Compression.GZIP,
    "snappy": Compression.SNAPPY,
    "lz4": Compression.LZ4,
    "zstd": Compression.ZSTD,
}
# Kafka's defaults (KIP-390): compression.gzip.level -1, lz4 9, zstd 3.
DEFAULT_LEVELS: Final = {Compression.GZIP: -1, Compression.LZ4: 9, Compression.ZSTD: 3}

_XERIAL_HEADER: Final = b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
_XERIAL_BLOCK: Final = 32 * 1024  # xerial SnappyOutputStream's default block size
_I32: Final = struct.Struct(">i")


def compress(codec: int, data: Buf, level: int | None = None) -> bytes:
    """`data` compressed with `codec` (a `Compression`), framed as Kafka writes it."""
    raw = bytes(data)
    if codec == Compression.NONE:
        return raw
    if level is None:
        level = DEFAULT_LEVELS.get(Compression(codec), 0)
    if codec == Compression.GZIP:
        z = zlib.compressobj(level, zlib.DEFLATED, 31)  # 31: gzip header and trailer
        return z.compress(raw) + z.flush()
    if codec == Compression.SNAPPY:
        import snappy  # type: ignore[import-untyped]

        out = bytearray(_XERIAL_HEADER)
        for pos in range(0, len(raw), _XERIAL_BLOCK):
            block = snappy.compress(raw[pos : pos + _XERIAL_BLOCK])
            out += _I32.pack(len(block))
            out += block
        return bytes(out)
    if codec == Compression.LZ4:
        import lz4.frame  # type: ignore[import-untyped]

        return bytes(
            lz4.frame.compress(
                raw,
                compression_level=level,
                block_size=lz4.frame.BLOCKSIZE_MAX64KB,
                block_linked=False,
                content_checksum=False,
                block_checksum=False,
                store_size=False,
            )
        )
    if codec == Compression.ZSTD:
        import zstandard

        return zstandard.ZstdCompressor(level=level).compress(raw)
    raise ValueError(f"unknown compression codec {codec}")


def recompress_batch(
    batch: Buf,
    codec: int,
    level: int | None = None,
    max_size: int = DEFAULT_MAX_DECOMPRESSED,
) -> bytearray:
    """A copy of v2 `batch` whose records are compressed with `codec` instead of the
    batch's own; every other field kept, batchLength and CRC-32C recomputed. The batch
    must have passed validation (its records inflate within `max_size`)."""
    view = memoryview(batch)
    header = parse_batch_header(view)
    section = view[BATCH_HEADER_SIZE : header.size]
    records = decompress(header.compression, section, max_size)
    body = compress(codec, records, level)
    out = bytearray(view[:BATCH_HEADER_SIZE])
    out += body
    _I32.pack_into(out, 8, len(out) - LOG_OVERHEAD)
    attributes = (header.attributes & ~ATTR_CODEC_MASK) | int(codec)
    struct.pack_into(">h", out, 21, attributes)
    struct.pack_into(">I", out, CRC_OFFSET, compute_crc(out))
    return out


def topic_compression(config: Callable[[str], str]) -> tuple[int | None, int | None]:
    """A topic's (codec, level) from its effective configs (`config(name)` -> value):
    codec None for compression.type=producer, level None where the codec has none."""
    codec = CODEC_BY_NAME.get(config("compression.type"))
    if codec is None:
        return None, None
    level_name = {
        Compression.GZIP: "compression.gzip.level",
        Compression.LZ4: "compression.lz4.level",
        Compression.ZSTD: "compression.zstd.level",
    }.get(codec)
    return codec, (int(config(level_name)) if level_name else None)

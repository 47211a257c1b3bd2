"""Types of the native core (storage/native, Rust); see storage/native/src/lib.rs."""

from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview

INFLATE_WINDOW: int

def validate_records(
    batch: Buffer, max_inflated: int, check_ts: bool, low: int, high: int, /
) -> tuple[int, int, str | None, int]: ...
def check_batch(
    batch: Buffer, max_inflated: int, check_ts: bool, low: int, high: int, /
) -> tuple[int, int, int, str | None, int]: ...
def crc32c(data: Buffer, /) -> int: ...
def leaf_hashes(blocks: list[Buffer], /) -> list[bytes]: ...

"""The on-disk format of a partition archive (storage/FORMAT.md is the spec), in code.

Owns: the fsync policies and how a head records them, the byte layouts (index header and
entries, head slots, tree nodes), `Head` (a signed head as a head slot holds it) and how
head slots are read and checked, segment file names, this boot's id, and `Segment`, a
`.log` + `.bidx` pair whose index lives in memory as raw entries plus columns.

May import the standard library, crc32c and `storage.hypercore`, `storage.fs`,
`storage.errors`. Nothing here does I/O but `read_head_slots`.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass

import crc32c

from storage.errors import StorageError
from storage.fs import FileSystem
from storage.hypercore import Node, flat_tree, tree_hash
from storage.hypercore.multisig import HeadSigner, verify_signed_head


class FsyncPolicy(enum.StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


POLICY_CODE = {FsyncPolicy.ALWAYS: 0, FsyncPolicy.INTERVAL: 1, FsyncPolicy.NEVER: 2}
CODE_POLICY = {v: k for k, v in POLICY_CODE.items()}


IDX_MAGIC = b"HKBIDX01"
IDX_HEADER_SIZE = 64
ENTRY_SIZE = 64
IDX_HEADER = struct.Struct("<8sqQ36x")  # 60 bytes, then crc
ENTRY = struct.Struct("<qqIIi32s")  # 60 bytes, then crc
U32 = struct.Struct("<I")
# An entry as append keeps it in memory: leaf hash and CRC zero (only the file gets them).
ENTRY_NO_LEAF = struct.Struct("<qqIIi36x")
BE_I32 = struct.Struct(">i")
BE_I64 = struct.Struct(">q")

HEAD_MAGIC = b"HKHEAD01"
SLOT_SIZE = 4096
SLOT_FIXED = struct.Struct("<8sIIQQQQ32s68sqqQ16sqQI")  # 208 bytes
SLOT_ROOT = struct.Struct("<QQ32s")
FLAG_CLEAN = 1
# The head's signature is not the 68 bytes at offset 80 (left zero) but follows the roots
# as u16 length + bytes: a quorum signature of a multisig archive (FORMAT.md section 5).
# Set and cleared by Head.encode/decode from the signature's length, never by callers.
FLAG_LONG_SIGNATURE = 2
INLINE_SIGNATURE = 68
U16 = struct.Struct("<H")
MAX_ROOTS = 64
NODE_SIZE = 40
NODE = struct.Struct("<Q32s")


def segment_name(base_offset: int, ext: str) -> str:
    return f"{base_offset:020d}.{ext}"


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return bytes(16)


BOOT_ID = _boot_id()


@dataclass(frozen=True)
class Head:
    """A signed head as stored in a head slot."""

    fork: int
    length: int
    byte_length: int
    tree_hash: bytes
    signature: bytes
    next_offset: int
    log_start_offset: int
    min_index: int
    roots: tuple[Node, ...]
    seq: int = 0
    flags: int = 0
    boot_id: bytes = bytes(16)
    written_ms: int = 0
    derived_length: int = 0  # blocks whose .bidx entries and tree nodes were fsynced

    @property
    def clean(self) -> bool:
        return bool(self.flags & FLAG_CLEAN)

    @property
    def policy(self) -> FsyncPolicy:
        return CODE_POLICY.get((self.flags >> 8) & 0xFF, FsyncPolicy.NEVER)

    def encode(self) -> bytes:
        if len(self.roots) > MAX_ROOTS:
            raise StorageError("too many roots")
        long_sig = len(self.signature) != INLINE_SIGNATURE
        tail = SLOT_FIXED.size + len(self.roots) * SLOT_ROOT.size
        if long_sig and tail + U16.size + len(self.signature) > SLOT_SIZE:
            raise StorageError(f"a {len(self.signature)}-byte signature does not fit a head slot")
        flags = (self.flags & ~FLAG_LONG_SIGNATURE) | (FLAG_LONG_SIGNATURE if long_sig else 0)
        body = bytearray(SLOT_SIZE)
        SLOT_FIXED.pack_into(
            body,
            0,
            HEAD_MAGIC,
            0,
            flags,
            self.seq,
            self.fork,
            self.length,
            self.byte_length,
            self.tree_hash,
            bytes(INLINE_SIGNATURE) if long_sig else self.signature,
            self.next_offset,
            self.log_start_offset,
            self.min_index,
            self.boot_id,
            self.written_ms,
            self.derived_length,
            len(self.roots),
        )
        pos = SLOT_FIXED.size
        for r in self.roots:
            SLOT_ROOT.pack_into(body, pos, r.index, r.size, r.hash)
            pos += SLOT_ROOT.size
        if long_sig:
            U16.pack_into(body, pos, len(self.signature))
            body[pos + U16.size : pos + U16.size + len(self.signature)] = self.signature
        U32.pack_into(body, 8, crc32c.crc32c(memoryview(body)[12:]))
        return bytes(body)

    @classmethod
    def decode(cls, slot: bytes) -> Head | None:
        """None when the slot is empty or fails its CRC (torn)."""
        if len(slot) < SLOT_SIZE or slot[:8] != HEAD_MAGIC:
            return None
        (crc,) = U32.unpack_from(slot, 8)
        if crc32c.crc32c(memoryview(slot)[12:SLOT_SIZE]) != crc:
            return None
        (
            _,
            _,
            flags,
            seq,
            fork,
            length,
            byte_length,
            th,
            sig,
            nxt,
            lso,
            mi,
            boot,
            ms,
            dl,
            nroots,
        ) = SLOT_FIXED.unpack_from(slot, 0)
        if nroots > MAX_ROOTS:
            return None
        roots = tuple(
            Node(*SLOT_ROOT.unpack_from(slot, SLOT_FIXED.size + i * SLOT_ROOT.size))
            for i in range(nroots)
        )
        if flags & FLAG_LONG_SIGNATURE:
            pos = SLOT_FIXED.size + nroots * SLOT_ROOT.size
            (n,) = U16.unpack_from(slot, pos)
            if pos + U16.size + n > SLOT_SIZE:
                return None
            sig = bytes(slot[pos + U16.size : pos + U16.size + n])
            flags &= ~FLAG_LONG_SIGNATURE
        return cls(
            fork, length, byte_length, th, sig, nxt, lso, mi, roots, seq, flags, boot, ms, dl
        )


def read_head_slots(fs: FileSystem, fd: int) -> tuple[Head | None, bool]:
    """(best valid head, whether a non-empty slot failed its check)."""
    data = fs.pread_exact(fd, 2 * SLOT_SIZE, 0)
    best: Head | None = None
    corrupt = False
    for i in range(2):
        slot = data[i * SLOT_SIZE : (i + 1) * SLOT_SIZE]
        h = Head.decode(slot)
        if h is None:
            if slot.strip(b"\0"):
                corrupt = True
            continue
        if best is None or h.seq > best.seq:
            best = h
    return best, corrupt


def check_head(head: Head, public_key: HeadSigner, key: bytes) -> str | None:
    """Why a head does not verify, or None. `public_key` is the single signer's key or
    the manifest of a quorum-signed archive."""
    try:
        if tree_hash(head.roots) != head.tree_hash:
            return "head roots do not hash to the head's tree hash"
        if flat_tree.full_roots(2 * head.length) != [r.index for r in head.roots]:
            return "head roots are not the roots of its length"
        if sum(r.size for r in head.roots) != head.byte_length:
            return "head byte length does not match its roots"
    except Exception as exc:  # malformed roots from disk: report, do not crash
        return f"head roots malformed: {exc}"
    if head.length and not verify_signed_head(
        public_key, key, head.tree_hash, head.length, head.fork, head.signature
    ):
        if isinstance(public_key, bytes):
            return "head signature does not verify"
        return f"head is not signed by a quorum ({public_key.quorum} of {len(public_key.signers)}) of its manifest's signers"
    return None


def encode_index_header(base_offset: int, first_leaf: int) -> bytes:
    body = IDX_HEADER.pack(IDX_MAGIC, base_offset, first_leaf)
    return body + U32.pack(crc32c.crc32c(body))


def decode_index_header(data: bytes) -> tuple[int, int] | None:
    if len(data) < IDX_HEADER_SIZE or data[:8] != IDX_MAGIC:
        return None
    if crc32c.crc32c(data[:60]) != U32.unpack_from(data, 60)[0]:
        return None
    _, base, first = IDX_HEADER.unpack_from(data, 0)
    return base, first


def encode_entry(
    base: int, max_ts: int, position: int, size: int, last_delta: int, leaf: bytes
) -> bytes:
    body = ENTRY.pack(base, max_ts, position, size, last_delta, leaf)
    return body + U32.pack(crc32c.crc32c(body))


def entry_ok(entries: bytes | bytearray | memoryview, k: int) -> bool:
    o = k * ENTRY_SIZE
    mv = memoryview(entries)
    return bool(crc32c.crc32c(mv[o : o + 60]) == U32.unpack_from(entries, o + 60)[0])


def column(entries: bytes | bytearray, typecode: str, byte_offset: int) -> array:  # type: ignore[type-arg]
    """Pull one fixed-offset column out of the 64-byte entries with a strided copy."""
    out: array = array(typecode)  # type: ignore[type-arg]
    n = len(entries) // ENTRY_SIZE
    if not n:
        return out
    width = out.itemsize
    if sys.byteorder == "little" and byte_offset % width == 0:
        mv = memoryview(entries)[: n * ENTRY_SIZE].cast(typecode)  # type: ignore[call-overload]
        step = ENTRY_SIZE // width
        out.frombytes(mv[byte_offset // width :: step].tobytes())
    else:
        fmt = "<" + typecode
        out.extend(
            struct.unpack_from(fmt, entries, k * ENTRY_SIZE + byte_offset)[0] for k in range(n)
        )
    return out


class Segment:
    """A `.log` + `.bidx` pair; the index lives in memory as raw entries plus columns."""

    __slots__ = (
        "base_offset",
        "bases",
        "created_ms",
        "entries",
        "first_leaf",
        "idx_dirty",
        "idx_fd",
        "idx_path",
        "idx_written",
        "log_fd",
        "log_path",
        "log_size",
        "max_ts",
        "positions",
        "synced_log",
    )

    def __init__(
        self,
        base_offset: int,
        first_leaf: int,
        log_fd: int,
        idx_fd: int,
        log_path: str,
        idx_path: str,
    ) -> None:
        self.base_offset = base_offset
        self.first_leaf = first_leaf
        self.log_fd = log_fd
        self.idx_fd = idx_fd
        self.log_path = log_path
        self.idx_path = idx_path
        self.log_size = 0
        self.entries = bytearray()
        self.idx_written = 0  # entries already written to the .bidx file
        self.idx_dirty = False  # written but not fsynced
        self.bases: array = array("q")  # type: ignore[type-arg]
        self.positions: array = array("q")  # type: ignore[type-arg]
        self.max_ts: array = array("q")  # type: ignore[type-arg]
        self.created_ms = 0
        self.synced_log = True

    @property
    def count(self) -> int:
        return len(self.bases)

    def set_entries(self, entries: bytearray) -> None:
        self.entries = entries
        self.bases = column(entries, "q", 0)
        self.max_ts = column(entries, "q", 8)
        self.positions = array("q", column(entries, "I", 16))

    def end_of(self, k: int) -> int:
        """Byte position just past entry k."""
        if k + 1 < len(self.positions):
            return int(self.positions[k + 1])
        return int(self.positions[k]) + self.size_of(k)

    def size_of(self, k: int) -> int:
        return int(U32.unpack_from(self.entries, k * ENTRY_SIZE + 20)[0])

    def leaf_of(self, k: int) -> bytes:
        o = k * ENTRY_SIZE + 28
        return bytes(self.entries[o : o + 32])

    def next_offset(self) -> int:
        if not self.bases:
            return self.base_offset
        (delta,) = struct.unpack_from("<i", self.entries, (self.count - 1) * ENTRY_SIZE + 24)
        return int(self.bases[-1]) + int(delta) + 1

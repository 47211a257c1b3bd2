"""What a replication server reads from and what a follower writes into.

Owns: the `ArchiveSource` and `ArchiveSink` protocols, `MemoryArchive` (an in-memory
signed archive: a writer for tests and tools, and a sink that stores what a follower
verified), and `PartitionLogSource`, which serves a `storage.log.PartitionLog` by its
published head (a block is one stored RecordBatch, byte for byte).

May import the standard library, `storage.hypercore` and (for the adapter only)
`storage.log`; never trio or `broker`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from storage.hypercore import Frontier, KeyPair, Manifest, Node, sign_head
from storage.hypercore.multisig import HeadSigner, assemble_quorum, head_manifest, sign_partial

if TYPE_CHECKING:
    from storage.log import PartitionLog


@dataclass(frozen=True)
class SignedHead:
    """A head a server may serve: every node and block below `length` must be readable."""

    length: int
    fork: int
    signature: bytes | None  # None only for length 0


class ArchiveSource(Protocol):
    """Read side of an archive. `head()` is a snapshot; nodes and blocks under it are
    immutable within the fork, so a server may answer from it while the archive grows."""

    @property
    def key(self) -> bytes: ...

    @property
    def manifest(self) -> Manifest: ...

    def head(self) -> SignedHead: ...

    def node(self, index: int) -> Node | None: ...

    def block(self, index: int) -> bytes: ...


class ArchiveSink(Protocol):
    """Write side of a follower. Calls come in order: blocks 0, 1, 2, … and, once every
    block below a verified head's length was delivered, that head. A block's `value` may
    be a read-only view into the message it came in (immutable: keeping it is safe).

    A sink may also hold blocks no delivered head covers yet (a quorum-signed archive's
    replica stores what its leader proposes): `held_length()` and `holds_tree(start,
    length, roots)` (optional) tell the follower so, and a verified head whose tree those
    blocks make is then delivered without fetching them (storage/replication/follow.py)."""

    def put_block(self, index: int, value: bytes | memoryview, leaf: Node) -> None: ...

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> None: ...


class MemoryArchive:
    """An archive in memory. With a key pair it is writable (`append`); as a sink it
    keeps what a follower delivered, with the head it verified."""

    def __init__(
        self,
        public_key: HeadSigner,
        keypair: KeyPair | None = None,
        signers: Sequence[KeyPair] = (),
    ) -> None:
        """`public_key` is the single signer's key, or the manifest of a quorum-signed
        archive; such an archive is writable with `signers`, a quorum of its key pairs."""
        self.public_key = public_key
        self.keypair = keypair
        self._signers = tuple(signers)
        self._manifest = head_manifest(public_key)
        self._key = self._manifest.hash()
        self.blocks: list[bytes | memoryview] = []
        self.nodes: dict[int, Node] = {}
        self.frontier = Frontier()
        self._head = SignedHead(0, 0, None)
        self.heads: list[SignedHead] = []

    @classmethod
    def create(cls, keypair: KeyPair) -> MemoryArchive:
        return cls(keypair.public_key, keypair)

    @classmethod
    def create_multisig(cls, manifest: Manifest, signers: Sequence[KeyPair]) -> MemoryArchive:
        """A writable quorum-signed archive: every head is signed by all of `signers`
        (at least the manifest's quorum) and assembled as Hypercore does."""
        return cls(manifest, None, signers)

    @property
    def key(self) -> bytes:
        return self._key

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def append(self, *values: bytes) -> SignedHead:
        """Append blocks and sign the new head (one signature per call)."""
        if self.keypair is None and not self._signers:
            raise ValueError("read-only archive: no key pair")
        for v in values:
            for n in self.frontier.append_data(v):
                self.nodes[n.index] = n
            self.blocks.append(bytes(v))
        roots, length = self.frontier.roots(), self.frontier.length
        if self.keypair is not None:
            sig = sign_head(self.keypair, self._key, roots, length, 0)
        else:
            parts = [sign_partial(kp, self._manifest, roots, length, 0) for kp in self._signers]
            sig = assemble_quorum(self._manifest, parts)
        self._head = SignedHead(self.frontier.length, 0, sig)
        return self._head

    def head(self) -> SignedHead:
        return self._head

    def node(self, index: int) -> Node | None:
        return self.nodes.get(index)

    def block(self, index: int) -> bytes:
        return bytes(self.blocks[index])  # (a no-op for the bytes of a writer)

    # ------------------------------------------------------------------ sink side

    def put_block(self, index: int, value: bytes | memoryview, leaf: Node) -> None:
        if index != len(self.blocks):
            raise ValueError(f"block {index} out of order (have {len(self.blocks)})")
        self.blocks.append(value)
        for n in self.frontier.append(leaf.hash, leaf.size):
            self.nodes[n.index] = n

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> None:
        # The follower verified the head; we hold every block, so our own tree must match.
        if self.frontier.length != length or self.frontier.roots() != list(roots):
            raise ValueError("delivered blocks do not form the verified head")
        self._head = SignedHead(length, fork, signature)
        self.heads.append(self._head)


class PartitionLogSource:
    """Serve a `PartitionLog` as a Hypercore: blocks are its stored batches, the head is
    its last *published* head (nothing unpublished or unfsynced is ever served)."""

    def __init__(self, log: PartitionLog) -> None:
        self.log = log

    @property
    def key(self) -> bytes:
        return self.log.key

    @property
    def manifest(self) -> Manifest:
        return head_manifest(self.log.head_signer)

    def head(self) -> SignedHead:
        h = self.log.head
        if h is None or h.length == 0:
            return SignedHead(0, self.log.fork, None)
        return SignedHead(h.length, h.fork, h.signature)

    def node(self, index: int) -> Node | None:
        return self.log.node(index)

    def block(self, index: int) -> bytes:
        """The stored batch at leaf `index`; KeyError below retention's minimum index."""
        return self.log.block(index)

    def removed_runs(self, length: int) -> list[tuple[int, int]]:
        """Runs (first block, count) below `length` the log's cleaner removed."""
        return self.log.removed_runs(length)

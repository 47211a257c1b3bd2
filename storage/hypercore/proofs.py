"""Hypercore 11 Merkle proofs: generation from stored nodes, verification, wire codec.

Owns: the ``data`` message's proof parts (lib/messages.js ``wire.data``: block, hash,
upgrade; not seek), `generate_proof` (a port of lib/merkle-tree.js ``generateProof``
without seek, producing node-for-node what ``core.proof()`` returns), and
`verify_proof` (``verifyTree`` + ``verifyUpgrade`` + the signature check). A *block*
proof is an inclusion proof; an *upgrade* proof is a consistency proof from the
verifier's length ``start`` to ``start + length`` (plus ``additional_nodes`` up to
the prover's head), carrying the head signature.

Theory of operation: a proof is a list of nodes in a fixed order that both sides
derive from flat-tree arithmetic alone, so no indexes need trusting: the verifier
walks the same iteration and *expects* each index (`_NodeQueue.shift`). We are
stricter than Hypercore in three places, all on inputs Hypercore itself never sends:
leftover proof nodes, trailing bytes after a message, and an upgrade whose start is
not the verifier's length are errors.

May import only the standard library and `storage.hypercore.{flat_tree,tree,crypto,
encoding,errors,multisig}`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from storage.hypercore import flat_tree
from storage.hypercore.crypto import Manifest
from storage.hypercore.encoding import Reader, encode_buffer, encode_uint
from storage.hypercore.errors import DecodeError, HypercoreError, InvalidProof
from storage.hypercore.multisig import HeadSigner, verify_signed_head
from storage.hypercore.tree import Frontier, Node, leaf_node, parent_node

NodeSource = Callable[[int], Node]
"""Returns the stored node at a flat-tree index; raises (e.g. KeyError) when absent."""


class InvalidRequest(HypercoreError, ValueError):
    """A proof request the tree cannot answer (Hypercore's INVALID_OPERATION)."""


# ------------------------------------------------------------------------ messages


class BlockRequest(NamedTuple):
    """Block `index` with `nodes` levels of siblings the requester lacks."""

    index: int  # type: ignore[assignment]  # Hypercore's field name; shadows tuple.index
    nodes: int


class HashRequest(NamedTuple):
    """Tree node at flat index `index` with `nodes` levels of siblings."""

    index: int  # type: ignore[assignment]  # Hypercore's field name; shadows tuple.index
    nodes: int


class UpgradeRequest(NamedTuple):
    start: int
    length: int


@dataclass(frozen=True)
class BlockProof:
    index: int
    value: bytes | None
    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class HashProof:
    index: int
    nodes: tuple[Node, ...]


@dataclass(frozen=True)
class UpgradeProof:
    start: int
    length: int
    nodes: tuple[Node, ...]
    additional_nodes: tuple[Node, ...]
    signature: bytes | None


@dataclass(frozen=True)
class Proof:
    """The proof-carrying fields of a Hypercore ``data`` message (seek is unsupported)."""

    fork: int
    block: BlockProof | None = None
    hash: HashProof | None = None
    upgrade: UpgradeProof | None = None
    manifest: Manifest | None = None

    def encode(self, request: int = 0) -> bytes:
        """``wire.data`` bytes (the protomux message body) with request id `request`."""
        flags = (
            (1 if self.block else 0)
            | (2 if self.hash else 0)
            | (8 if self.upgrade else 0)
            | (16 if self.manifest else 0)
        )
        out = [encode_uint(flags), encode_uint(request), encode_uint(self.fork)]
        if self.block:
            value = self.block.value or b""
            # length and value as separate parts: join copies the value once, not twice
            out += [encode_uint(self.block.index), encode_uint(len(value)), value]
            out.append(_encode_nodes(self.block.nodes))
        if self.hash:
            out += [encode_uint(self.hash.index), _encode_nodes(self.hash.nodes)]
        if self.upgrade:
            u = self.upgrade
            out += [encode_uint(u.start), encode_uint(u.length)]
            out += [_encode_nodes(u.nodes), _encode_nodes(u.additional_nodes)]
            out.append(encode_buffer(u.signature) if u.signature else b"\x00")
        if self.manifest:
            out.append(self.manifest.encode())
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> tuple[int, Proof]:
        """Parse ``wire.data`` bytes into (request id, proof); DecodeError on anything bad."""
        r = Reader(data)
        flags = r.uint()
        if flags & 4:
            raise DecodeError("seek proofs are not supported")
        request = r.uint()
        fork = r.uint()
        block = BlockProof(r.uint(), r.buffer(), _read_nodes(r)) if flags & 1 else None
        hash_ = HashProof(r.uint(), _read_nodes(r)) if flags & 2 else None
        upgrade = None
        if flags & 8:
            start, length = r.uint(), r.uint()
            nodes, extra = _read_nodes(r), _read_nodes(r)
            sig = r.buffer()
            upgrade = UpgradeProof(start, length, nodes, extra, sig or None)
        manifest = Manifest.read(r) if flags & 16 else None
        r.finish()
        return request, cls(fork, block, hash_, upgrade, manifest)


def _encode_nodes(nodes: Sequence[Node]) -> bytes:
    out = [encode_uint(len(nodes))]
    for n in nodes:
        out += [encode_uint(n.index), encode_uint(n.size), n.hash]
    return b"".join(out)


def _read_nodes(r: Reader) -> tuple[Node, ...]:
    return tuple(Node(r.uint(), r.uint(), r.fixed(32)) for _ in range(r.array_length()))


# ---------------------------------------------------------------------- generation


def roots_at(get_node: NodeSource, length: int) -> list[Node]:
    """The stored roots of the tree at `length` blocks."""
    return [get_node(i) for i in flat_tree.full_roots(2 * length)]


class _Pending:
    __slots__ = ("additional", "node", "upgrade")

    def __init__(self) -> None:
        self.node: list[Node] | None = None
        self.upgrade: list[Node] | None = None
        self.additional: list[Node] | None = None


def _block_proof(get: NodeSource, index: int, has_value: bool, root: int, p: _Pending) -> None:
    # Sibling path from the requested node up to `root` (exclusive of root itself).
    p.node = []
    if not has_value:
        p.node.append(get(index))
    ite = index
    for _ in range(1024):
        if ite == root:
            return
        ite = flat_tree.sibling(ite)
        p.node.append(get(ite))
        ite = flat_tree.parent(ite)
    raise InvalidRequest(f"node {index} is not under {root}")


def _upgrade_nodes(
    get: NodeSource,
    from_: int,
    to: int,
    sub_tree: int | None,
    block: tuple[int, bool] | None,
    p: _Pending,
) -> list[Node]:
    """Nodes that grow the tree with head `from_` into the tree with head `to`.

    When the block/hash path (`sub_tree`) lies in the new part it is emitted into
    ``p.node`` in place of the node it proves, so the upgrade does not repeat it.
    """
    out: list[Node] | None = [] if from_ == 0 else None
    for root in flat_tree.full_roots(to):
        if flat_tree.right_span(root) < from_ - 1:
            continue  # the verifier already has this root
        if out is None and flat_tree.contains(root, from_ - 2):
            # Connect the verifier's last root to this one through the right siblings.
            out = []
            target = from_ - 2
            ite = target
            while ite != root:
                ite = flat_tree.sibling(ite)
                if ite > target:
                    if (
                        block is not None
                        and sub_tree is not None
                        and p.node is None
                        and flat_tree.contains(ite, sub_tree)
                    ):
                        _block_proof(get, block[0], block[1], ite, p)
                    else:
                        out.append(get(ite))
                ite = flat_tree.parent(ite)
            continue
        if out is None:
            out = []
        if (
            block is not None
            and sub_tree is not None
            and p.node is None
            and flat_tree.contains(root, sub_tree)
        ):
            _block_proof(get, block[0], block[1], root, p)
            continue
        out.append(get(root))
    return out if out is not None else []


def generate_proof(
    get_node: NodeSource,
    length: int,
    fork: int,
    signature: bytes | None,
    *,
    block: BlockRequest | None = None,
    block_value: bytes | None = None,
    hash: HashRequest | None = None,
    upgrade: UpgradeRequest | None = None,
    manifest: Manifest | None = None,
) -> Proof:
    """Answer a proof request for the tree of `length` blocks, like ``core.proof()``.

    `get_node` must serve every node of that tree (the log keeps them); `signature`
    is the stored head signature at (`length`, `fork`), sent with upgrades. The block
    value is the caller's to read; it is placed into the proof unchanged.
    """
    head = 2 * length
    from_ = upgrade.start * 2 if upgrade else 0
    to = from_ + upgrade.length * 2 if upgrade else head

    if head == 0:
        return Proof(fork)  # Hypercore answers an empty core with an empty proof
    if from_ >= to or to > head:
        raise InvalidRequest("invalid upgrade")

    node: tuple[int, bool, int, int] | None = None  # (flat index, has value, nodes, last block)
    if block is not None:
        if not 0 <= block.index < length:
            raise InvalidRequest("block out of range")
        node = (2 * block.index, True, block.nodes, block.index)
    elif hash is not None:
        if flat_tree.right_span(hash.index) >= head:
            raise InvalidRequest("hash index out of range")
        node = (hash.index, False, hash.nodes, flat_tree.right_span(hash.index) // 2)

    p = _Pending()
    sub_tree: int | None = None
    if node is not None and (upgrade is None or node[3] < upgrade.start):
        # The verifier already has the tree around this node: a standalone path.
        sub_tree = _nodes_to_root(node[0], node[2], to)
        _block_proof(get_node, node[0], node[1], sub_tree, p)
    elif node is not None:
        sub_tree = node[0]

    up: UpgradeProof | None = None
    if upgrade is not None:
        blk = (node[0], node[1]) if node is not None else None
        nodes = _upgrade_nodes(get_node, from_, to, sub_tree, blk, p)
        extra = _upgrade_nodes(get_node, to, head, None, None, p) if head > to else []
        up = UpgradeProof(upgrade.start, upgrade.length, tuple(nodes), tuple(extra), signature)

    bp = hp = None
    if block is not None:
        if p.node is None:
            raise InvalidRequest("invalid block request")
        bp = BlockProof(block.index, block_value, tuple(p.node))
    elif hash is not None:
        if p.node is None:
            raise InvalidRequest("invalid hash request")
        hp = HashProof(hash.index, tuple(p.node))
    return Proof(fork, bp, hp, up, manifest)


def _nodes_to_root(index: int, nodes: int, head: int) -> int:
    for _ in range(nodes):
        index = flat_tree.parent(index)
        if flat_tree.contains(index, head):
            raise InvalidRequest("nodes is out of bounds")
    return index


def max_missing_nodes(index: int, length: int) -> int:
    """Levels of siblings from flat `index` up to its root at `length` (MerkleTree.maxMissingNodes)."""
    head = 2 * length
    if flat_tree.right_span(index) >= head or index in flat_tree.full_roots(head):
        return 0
    ite, cnt = flat_tree.parent(index), 0
    while not flat_tree.contains(ite, head):
        cnt += 1
        ite = flat_tree.parent(ite)
    return cnt


def inclusion_proof(
    get_node: NodeSource, length: int, fork: int, signature: bytes, index: int, value: bytes
) -> Proof:
    """A self-contained receipt: block `index` plus everything up to the signed head."""
    return generate_proof(
        get_node,
        length,
        fork,
        signature,
        block=BlockRequest(index, 0),
        block_value=value,
        upgrade=UpgradeRequest(0, length),
    )


def consistency_proof(
    get_node: NodeSource, old_length: int, length: int, fork: int, signature: bytes
) -> Proof:
    """Upgrade proof from `old_length` to the signed head at `length`."""
    return generate_proof(
        get_node, length, fork, signature, upgrade=UpgradeRequest(old_length, length - old_length)
    )


# -------------------------------------------------------------------- verification


class _NodeQueue:
    """The proof's nodes in order; `shift(i)` demands that the next one is node i."""

    __slots__ = ("extra", "i", "nodes")

    def __init__(self, nodes: Sequence[Node], extra: Node | None = None) -> None:
        self.nodes = nodes
        self.i = 0
        self.extra = extra

    def __len__(self) -> int:
        return len(self.nodes) - self.i + (0 if self.extra is None else 1)

    def shift(self, index: int) -> Node:
        if self.extra is not None and self.extra.index == index:
            node, self.extra = self.extra, None
            return node
        if self.i >= len(self.nodes):
            raise InvalidProof(f"expected node {index}, proof ran out")
        node = self.nodes[self.i]
        if node.index != index:
            raise InvalidProof(f"expected node {index}, got node {node.index}")
        if len(node.hash) != 32:
            raise InvalidProof("node hash must be 32 bytes")
        self.i += 1
        return node


def _verify_path(proof: Proof) -> Node | None:
    """Fold a block/hash path into the node it claims to be under (verifyTree)."""
    if proof.block is not None:
        index, value, nodes = 2 * proof.block.index, proof.block.value, proof.block.nodes
        if value is None:
            raise InvalidProof("block proof without a value")
    elif proof.hash is not None:
        index, value, nodes = proof.hash.index, None, proof.hash.nodes
    else:
        return None
    q = _NodeQueue(nodes)
    root = leaf_node(index // 2, value) if value is not None else q.shift(index)
    ite = index
    while len(q):
        sib = q.shift(flat_tree.sibling(ite))
        root = parent_node(root, sib)
        ite = root.index
    return root


class _Batch:
    """Roots being grown by an upgrade proof (MerkleTreeBatch.appendRoot semantics)."""

    def __init__(self, roots: Sequence[Node]) -> None:
        self.roots = list(roots)

    def append_root(self, node: Node, ite: int) -> int:
        """Add `node` (at iterator position `ite`) as a root, merging siblings; new position."""
        self.roots.append(node)
        while len(self.roots) > 1:
            a, b = self.roots[-1], self.roots[-2]
            if flat_tree.sibling(ite) != b.index:
                break
            ite = flat_tree.parent(ite)
            self.roots[-2:] = [Node(ite, a.size + b.size, parent_node(b, a).hash)]
        return ite


def _left_child_or_none(ite: int) -> int | None:
    return None if not ite & 1 else flat_tree.left_child(ite)


def _verify_upgrade(
    upgrade: UpgradeProof, block_root: Node | None, trusted: Frontier
) -> tuple[Frontier, bool]:
    """Grow `trusted` by the upgrade's nodes; returns (new frontier, block root consumed)."""
    if upgrade.start != trusted.length:
        raise InvalidProof(f"upgrade starts at {upgrade.start}, verifier has {trusted.length}")
    if upgrade.length <= 0:
        raise InvalidProof("empty upgrade")
    q = _NodeQueue(upgrade.nodes, block_root)
    old = trusted.roots()
    batch = _Batch(old)
    grow = bool(old)
    i = 0
    to = 2 * (upgrade.start + upgrade.length)
    for root in flat_tree.full_roots(to):
        if i < len(old) and old[i].index == root:
            i += 1
            continue
        if grow:
            grow = False
            if i < len(old):
                ite = old[-1].index
                for _ in range(128):
                    if ite == root:
                        break
                    ite = batch.append_root(q.shift(flat_tree.sibling(ite)), flat_tree.sibling(ite))
                else:
                    raise InvalidProof("upgrade does not connect to the verifier's roots")
                if ite != root:
                    raise InvalidProof("upgrade does not connect to the verifier's roots")
                continue
        batch.append_root(q.shift(root), root)
    if q.i != len(q.nodes):
        raise InvalidProof(f"{len(q.nodes) - q.i} unused upgrade nodes")

    extra = upgrade.additional_nodes
    if extra:
        ite = flat_tree.sibling(batch.roots[-1].index)
        j = 0
        while j < len(extra) and extra[j].index == ite:
            ite = flat_tree.sibling(batch.append_root(_checked(extra[j]), ite))
            j += 1
        while j < len(extra):
            node = _checked(extra[j])
            j += 1
            while node.index != ite:
                child = _left_child_or_none(ite)
                if child is None:
                    raise InvalidProof(f"unexpected additional node {node.index}")
                ite = child
            ite = flat_tree.sibling(batch.append_root(node, ite))

    try:
        frontier = Frontier.from_roots(batch.roots)
    except HypercoreError as e:
        raise InvalidProof(f"upgrade does not form a tree: {e}") from e
    return frontier, q.extra is None


def _checked(node: Node) -> Node:
    if len(node.hash) != 32:
        raise InvalidProof("node hash must be 32 bytes")
    return node


@dataclass(frozen=True)
class VerifiedProof:
    """What a proof established: the proven node (if any) and the new signed head (if any)."""

    fork: int
    proven: Node | None  # the block's leaf node (or the hash request's node), verified
    head: Frontier | None  # tree at the upgrade's end (incl. additional nodes), signed
    signature: bytes | None


def verify_proof(
    proof: Proof,
    *,
    public_key: HeadSigner,
    key: bytes,
    fork: int,
    trusted: Frontier | None = None,
    trusted_node: Callable[[int], Node | None] | None = None,
) -> VerifiedProof:
    """Verify `proof` against what the verifier already trusts; raise InvalidProof if not.

    `trusted` is the verifier's current (signed) tree, `fork` its fork id, and
    `trusted_node` may return verified nodes it stores. With an upgrade the new head
    must be signed by `public_key` (a single signer's key, or a multisig manifest whose
    quorum must sign) for archive `key` at the proof's fork. Without one,
    the block/hash path must end in a node the verifier trusts (a root of `trusted`
    or a node from `trusted_node`).
    """
    if proof.fork != fork and proof.upgrade is None:
        raise InvalidProof(f"fork mismatch: proof {proof.fork}, verifier {fork}")
    base = trusted if trusted is not None else Frontier()
    path_root = _verify_path(proof)

    proven = None
    if proof.block is not None:
        proven = leaf_node(proof.block.index, proof.block.value or b"")
    elif proof.hash is not None and proof.hash.nodes:
        proven = proof.hash.nodes[0]

    head = None
    consumed = False
    if proof.upgrade is not None:
        if proof.fork != fork and base.length:
            # A new fork may rewrite the verifier's roots; that is a reorg, not an upgrade.
            raise InvalidProof(f"fork mismatch: proof {proof.fork}, verifier {fork}")
        head, consumed = _verify_upgrade(proof.upgrade, path_root, base)
        sig = proof.upgrade.signature
        if sig is None or not verify_signed_head(
            public_key, key, head.tree_hash(), head.length, proof.fork, sig
        ):
            raise InvalidProof("bad head signature")

    if path_root is not None and not consumed:
        known = {r.index: r for r in base.roots()}
        have = known.get(path_root.index)
        if have is None and trusted_node is not None:
            have = trusted_node(path_root.index)
        if have is None:
            raise InvalidProof(f"proof ends at node {path_root.index}, which is not trusted")
        if have.hash != path_root.hash or have.size != path_root.size:
            raise InvalidProof(f"checksum mismatch at node {path_root.index}")

    sig_out = proof.upgrade.signature if proof.upgrade is not None else None
    return VerifiedProof(proof.fork, proven, head, sig_out)

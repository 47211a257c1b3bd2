"""The following side of a replication channel: one archive fetched from one peer, verified.

Owns `Follower`, the role a `ReplicationChannel` plays when it follows an archive into an
`ArchiveSink` (`Connection.follow(key, sink, ...)`): learn the remote head from ``sync``,
fetch it with an ``upgrade`` request (plus the manifest, which must hash to the key; a
default single-signer manifest keeps its bare key, any other is verified as a whole, a
quorum of its signers), then fetch blocks with a window of in-flight ``request``s, verify
each against the signed tree and hand them to the sink in order, each verified head once
every block under it is delivered. `announce_stored` tells the peer with a ``range`` that
the sink now holds blocks [0, length), as a contiguous Hypercore peer does
(``broadcastRange``).

The catch-up hot path: a block is asked for with only the sibling levels the follower
does not already hold (`block_nodes`), its ``data`` answer is decoded without copying
the value (`read_block_data`, `Follower.take_block`), hashed once, and its path folded up
to a node verified before; an answer whose path ends at a node an earlier answer will
prove waits for it (`stalled`); verified nodes wholly left of the next block are pruned
every `PRUNE_EVERY` blocks.

Blocks the writer's cleaner removed (storage/FORMAT.md 4a): a sink that records holes
(``put_removed``) gets the block's leaf from a ``hash`` request proven against the
signed tree instead. A block damaged on disk is fetched again for ``repair_block``.

Not implemented (documented gaps): seek requests, reorgs (a newer fork that drops
verified blocks; one that keeps them is followed with ``fork=``), sparse peers that lack
blocks they announced, pushed blocks.

May import the standard library, `storage.hypercore` and
`storage.replication.{messages,errors,sources}`; `storage.replication.session` for
typing only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import blake2b
from typing import TYPE_CHECKING

from storage.hypercore import Frontier, HypercoreError, Manifest, Node, flat_tree
from storage.hypercore.encoding import Reader
from storage.hypercore.multisig import HeadSigner
from storage.hypercore.proofs import (
    BlockRequest,
    HashRequest,
    Proof,
    UpgradeRequest,
    max_missing_nodes,
    verify_proof,
)
from storage.replication import messages as M
from storage.replication.errors import RemoteProtocolError, VerificationError
from storage.replication.sources import ArchiveSink

if TYPE_CHECKING:
    from storage.replication.session import ReplicationChannel

DEFAULT_WINDOW = 128
PRUNE_EVERY = 4096  # delivered blocks between prunes of the follower's verified nodes


def block_nodes(index: int, length: int) -> int:
    """How many levels of siblings to ask for with block `index` when blocks are fetched
    in order: up to its lowest ancestor that is a right child, i.e. ``ctz(index)``
    levels (0 for every odd block), capped where the tree of `length` has a root.

    Why: the proof of block ``index - 2**h`` (h = ctz(index)) went at least one level
    higher and so carried that ancestor as a sibling; the follower keeps every node it
    verified, so the rest of the path would be sent and hashed for nothing. On average
    this is one node per block instead of log2(length), on the wire, in the server's
    node reads and in our hashing. Hypercore's own requester does the same thing
    (``nodes`` = levels up to the first node it has). Should the ancestor not be known
    when the answer arrives, the follower waits for earlier answers or asks again with
    the full path."""
    if index:
        low = index & -index  # the ancestor at height ctz spans blocks [index, index + low)
        if index + low <= length:
            return low.bit_length() - 1  # a whole node: the path to it stays in the tree
    return max_missing_nodes(2 * index, length)



def read_block_data(body: bytes | memoryview) -> tuple[int, int, int, memoryview, tuple[Node, ...]] | None:
    """A ``data`` message that carries a block and nothing else (flags = 1; the catch-up
    hot path) as (request, fork, index, value, nodes), the value a view into `body` (no
    copy); None for any other data message, or one that does not decode (the general
    decoder then reports it)."""
    try:
        r = Reader(body)
        if r.uint() != 1:
            return None
        request, fork, index = r.uint(), r.uint(), r.uint()
        value = r.view(r.uint())
        n = r.array_length()
        nodes = tuple(Node(r.uint(), r.uint(), r.fixed(32)) for _ in range(n))
        r.finish()
    except HypercoreError:
        return None
    return request, fork, index, value, nodes


@dataclass
class Pending:
    id: int
    block: int | None  # block index, or None for an upgrade request
    upgrade: bool
    manifest: bool
    repair: bool = False  # a block fetched again for sink.repair_block
    hole: bool = False  # the leaf node (a `hash` request) of a block the peer removed


@dataclass
class Follower:
    key: bytes
    sink: ArchiveSink
    live: bool
    have: Frontier | None
    public_key: HeadSigner | None
    window: int
    trusted: Frontier = field(default_factory=Frontier)
    fork: int = 0
    known: dict[int, Node] = field(default_factory=dict)
    heads: list[tuple[int, int, bytes, list[Node]]] = field(default_factory=list)
    # None: a block the writer's cleaner removed, its verified leaf (sink.put_removed)
    buffered: dict[int, tuple[bytes | memoryview | None, Node]] = field(default_factory=dict)
    inflight: dict[int, Pending] = field(default_factory=dict)
    next_id: int = 1
    next_request: int = 0
    next_deliver: int = 0
    remote_length: int | None = None
    remote_fork: int = 0
    upgrading: bool = False
    manifest_requested: bool = False
    latest_head: tuple[int, int, bytes, list[Node]] | None = None
    latest_proof: Proof | None = None
    probe_at: int | None = None  # ask for the peer's tree at this length (see follow)
    repairs: list[int] = field(default_factory=list)
    holes: list[int] = field(default_factory=list)  # removed blocks whose leaf to ask for
    # block answers whose path ends at a node an earlier answer will prove
    stalled: list[tuple[Pending, int, memoryview, tuple[Node, ...]]] = field(default_factory=list)
    stalls: int = 0  # answers that waited for an earlier one (statistics, tests)
    retries: int = 0  # short answers asked again with the full path
    skipped: int = 0  # blocks not fetched: the sink held them, making the verified tree
    pruned_at: int = 0
    stored: int = 0  # blocks [0, stored) the sink holds under a stored signed head
    announced: int = 0  # the prefix we told the peer about with a range

    def __post_init__(self) -> None:
        if self.have is not None:
            self.stored = self.have.length
            self.trusted = self.have.copy()
            self.next_request = self.next_deliver = self.have.length
            for r in self.have.roots():
                self.known[r.index] = r

    @property
    def finished(self) -> bool:
        return (
            not self.live
            and self.remote_length is not None
            and not self.inflight
            and not self.stalled
            and self.trusted.length >= self.remote_length
            and self.next_deliver == self.trusted.length
        )

    def _sync(self, s: ReplicationChannel) -> None:
        s.send(M.Sync(
            fork=self.fork,
            length=self.trusted.length,
            remote_length=self.remote_length or 0,
            can_upgrade=False,
            uploading=False,
            downloading=True,
            has_manifest=self.public_key is not None,
            allow_push=False,
        ))

    def on_open(self, s: ReplicationChannel) -> None:
        self._sync(s)
        self.announce_stored(s)  # replicator.js onopen: broadcastRange(0, contiguous)

    def announce_stored(self, s: ReplicationChannel) -> None:
        if self.stored > self.announced:
            s.send(M.Range(0, self.stored))  # a fully contiguous peer always sends from 0
            self.announced = self.stored

    def on_message(self, s: ReplicationChannel, m: M.Message) -> None:
        if isinstance(m, M.Sync):
            if m.fork != self.fork:
                if self.trusted.length:
                    raise VerificationError(
                        f"peer is on fork {m.fork}, we verified fork {self.fork}; reorgs unsupported")
                self.fork = m.fork
            self.remote_fork, self.remote_length = m.fork, m.length
        elif isinstance(m, M.Data):
            self._on_data(s, m)
        elif isinstance(m, M.NoData):
            p = self.inflight.get(m.request)
            if p is not None:
                if not self._removed(p, m.reason):
                    raise RemoteProtocolError(
                        f"peer refused request {m.request} (reason {m.reason}) for data it announced")
                del self.inflight[m.request]
        self._pump(s)
        if self.finished:
            s.close()

    def _removed(self, p: Pending, reason: int) -> bool:
        """A block request the writer answered `not available`: a block its cleaner removed
        (storage/FORMAT.md 4a). A sink that records such holes (`put_removed`) gets the
        block's leaf instead, from a `hash` request proven against the signed tree; the
        upgrade it rode along with is asked for again alone. Any other sink cannot go on."""
        if (reason != M.NoDataReason.NOT_AVAILABLE or p.block is None or p.manifest or p.repair
                or p.hole or getattr(self.sink, "put_removed", None) is None):
            return False
        if p.upgrade:
            self.upgrading = False
        self.holes.append(p.block)
        self.holes.sort()
        return True

    def _request(self, s: ReplicationChannel, p: Pending, req: M.Request) -> None:
        self.inflight[p.id] = p
        s.send(req)

    def _pump(self, s: ReplicationChannel) -> None:
        if self.remote_length is None:
            return
        if (self.public_key is None and self.remote_length == 0 and not self.manifest_requested
                and not self.upgrading):
            # an empty archive sends no upgrade: ask for the manifest alone, so the sink
            # learns the signer's key (verified: the manifest hashes to the archive key)
            self.manifest_requested = True
            rid = self._id()
            self._request(s, Pending(rid, None, False, True), M.Request(rid, self.fork, manifest=True))
        if (not self.upgrading and self.remote_length > self.trusted.length
                and self.remote_fork == self.fork):
            rid = self._id()
            need_manifest = self.public_key is None
            self.upgrading = True
            start = self.trusted.length
            # The first new block rides along (its path is part of the upgrade proof): a
            # live head of one block costs one round trip instead of two.
            first = None
            if (not need_manifest and self.next_request == start and len(self.inflight) < self.window
                    and self._held_length() <= start):
                first = BlockRequest(start, 0)
                self.next_request = start + 1
            upgrade_length = self.remote_length - start
            if self.probe_at and start == 0 and self.probe_at < upgrade_length:
                # the peer's roots at probe_at, then `additional_nodes` up to its head
                upgrade_length = self.probe_at
            self._request(s, Pending(rid, start if first else None, True, need_manifest), M.Request(
                rid, self.fork, block=first,
                upgrade=UpgradeRequest(start, upgrade_length),
                manifest=need_manifest,
            ))
        length = self.trusted.length
        while self.repairs and self.repairs[0] < min(length, self.next_deliver):
            i = self.repairs.pop(0)
            rid = self._id()
            self._request(s, Pending(rid, i, False, False, repair=True), M.Request(
                rid, self.fork, block=BlockRequest(i, max_missing_nodes(2 * i, length))))
        while self.holes and self.holes[0] < length:
            i = self.holes.pop(0)
            rid = self._id()
            self._request(s, Pending(rid, i, False, False, hole=True), M.Request(
                rid, self.fork, hash=HashRequest(2 * i, max_missing_nodes(2 * i, length))))
        while self.next_request < length and len(self.inflight) < self.window:
            i = self.next_request
            self.next_request += 1
            rid = self._id()
            self._request(s, Pending(rid, i, False, False), M.Request(
                rid, self.fork, block=BlockRequest(i, block_nodes(i, length))))

    def _held_length(self) -> int:
        """How many blocks the sink holds already, verified or not (a quorum-signed
        archive's replica stores the blocks its leader proposes before their head comes
        here); 0 for a sink that does not say."""
        held = getattr(self.sink, "held_length", None)
        return held() if held is not None else 0

    def _skip_held(self, length: int, roots: list[Node]) -> None:
        """A verified head of `length` whose blocks the sink holds already, making that
        very tree (`holds_tree`: a replica that signed it): none of them is fetched; the
        head is delivered as soon as every block before them is. Blocks only sent for
        nothing otherwise: on 3 brokers every byte crossed each link twice, in the
        proposal and again here, encrypted, decrypted and hashed each time."""
        start = self.next_deliver
        if self.next_request != start or self.buffered or not start < length:
            return  # blocks requested already: they come in as usual
        holds = getattr(self.sink, "holds_tree", None)
        if holds is None or not holds(start, length, roots):
            return
        self.next_request = self.next_deliver = length
        self.skipped += length - start

    def _id(self) -> int:
        rid = self.next_id
        self.next_id += 1
        return rid

    def take_block(self, s: ReplicationChannel, request: int, fork: int, index: int,
                   value: memoryview, nodes: tuple[Node, ...]) -> bool:
        """A block-only ``data`` message, decoded without copying the value: verified
        here when it answers a plain block request (True), else False and it goes
        through `_on_data` like any other message."""
        p = self.inflight.get(request)
        if (p is None or p.block is None or p.upgrade or p.manifest or p.repair or p.hole
                or self.public_key is None or fork != self.fork):
            return False
        del self.inflight[request]
        self._on_block(s, p, index, value, nodes)
        self._pump(s)
        if self.finished:
            s.close()
        return True

    def _on_data(self, s: ReplicationChannel, m: M.Data) -> None:
        p = self.inflight.pop(m.request, None)
        if p is None:
            return  # unrequested (push) or cancelled: Hypercore ignores it too
        proof = m.proof
        if proof.fork != self.fork:
            raise VerificationError(f"data for fork {proof.fork}, we are on {self.fork}")
        if p.hole:
            self._on_hole(s, p, proof)
            return
        if (p.block is not None and not p.upgrade and not p.manifest and not p.repair
                and proof.upgrade is None and proof.block is not None
                and proof.manifest is None and proof.hash is None and self.public_key is not None):
            if proof.block.value is None:
                raise VerificationError("block proof without a value")
            self._on_block(s, p, proof.block.index, memoryview(proof.block.value),
                           proof.block.nodes)
            return
        if p.manifest:
            if proof.manifest is None:
                raise VerificationError("peer did not send the manifest we asked for")
            if proof.manifest.hash() != self.key:
                raise VerificationError("manifest does not hash to the archive key")
            man = proof.manifest
            if (
                man.prologue is not None
                or man.allow_patch
                or not 1 <= man.quorum <= len(man.signers)
            ):
                raise VerificationError(
                    "manifests with a prologue, patches or no quorum are unsupported"
                )
            single = len(man.signers) == 1 and man == Manifest.default(man.signers[0].public_key)
            # a default single-signer core keeps its bare key (the path every archive of a
            # single node takes); any other manifest is checked as a whole (multisig)
            self.public_key = man.signers[0].public_key if single else man
        if self.public_key is None:
            raise VerificationError("no public key to verify against")
        if p.manifest and not p.upgrade and p.block is None:
            return  # the manifest alone (the key is all we wanted)
        if p.upgrade and proof.upgrade is None:
            raise VerificationError("peer answered an upgrade request without an upgrade")
        if p.block is not None and (proof.block is None or proof.block.index != p.block):
            raise VerificationError("peer answered with another block than requested")
        if not p.upgrade and proof.upgrade is not None:
            raise VerificationError("unrequested upgrade")
        try:
            vp = verify_proof(
                proof, public_key=self.public_key, key=self.key, fork=self.fork,
                trusted=self.trusted, trusted_node=self.known.get,
            )
        except HypercoreError as e:
            raise VerificationError(f"bad proof from peer: {e}") from e
        if p.upgrade:
            self.upgrading = False
            head = vp.head
            assert head is not None and vp.signature is not None
            self.trusted = head
            roots = head.roots()
            # every upgrade node took part in the signed tree hash: verified
            assert proof.upgrade is not None
            for n in proof.upgrade.nodes + proof.upgrade.additional_nodes:
                self.known[n.index] = n
            for r in roots:
                self.known[r.index] = r
            self.heads.append((head.length, self.fork, vp.signature, roots))
            self.latest_head = (head.length, self.fork, vp.signature, roots)
            self.latest_proof = proof
            self._skip_held(head.length, roots)
            self._sync(s)  # tell the peer our new length, as Hypercore does after upgrading
        if p.repair:
            assert proof.block is not None
            repair = getattr(self.sink, "repair_block", None)
            if repair is not None:
                repair(p.block, proof.block.value or b"")
            return
        if p.block is not None:
            assert proof.block is not None and vp.proven is not None
            if p.upgrade:
                self._keep_path(vp.proven, proof.block.nodes)
            self.buffered[p.block] = (proof.block.value or b"", vp.proven)
            s.stats.blocks += 1
            s.stats.bytes += len(proof.block.value or b"")
        self._deliver()
        self._unstall(s)

    def _on_hole(self, s: ReplicationChannel, p: Pending, proof: Proof) -> None:
        """The leaf node of a block the writer removed, with its path up to a node we
        trust: verified, it stands for the block (its hash and size fold into the tree)."""
        assert p.block is not None
        if (proof.hash is None or proof.hash.index != 2 * p.block or proof.block is not None
                or proof.upgrade is not None or self.public_key is None):
            raise VerificationError("peer answered a hash request with another proof")
        try:
            vp = verify_proof(
                proof, public_key=self.public_key, key=self.key, fork=self.fork,
                trusted=self.trusted, trusted_node=self.known.get,
            )
        except HypercoreError as e:
            raise VerificationError(f"bad proof from peer: {e}") from e
        leaf = vp.proven
        if leaf is None or leaf.index != 2 * p.block:
            raise VerificationError("peer answered with another node than requested")
        self._keep_path(leaf, proof.hash.nodes[1:])
        self.buffered[p.block] = (None, leaf)
        self._deliver()
        self._unstall(s)

    def _on_block(self, s: ReplicationChannel, p: Pending, index: int, value: memoryview,
                  nodes: tuple[Node, ...]) -> None:
        """A plain block answer (the catch-up hot path): hash the value once, fold the
        sibling path up to a node already verified, compare, keep the new nodes."""
        if index != p.block:
            raise VerificationError("peer answered with another block than requested")
        ite = 2 * index
        size = len(value)
        h = blake2b(b"\x00" + size.to_bytes(8, "little"), digest_size=32)
        h.update(value)
        leaf = cur = Node(ite, size, h.digest())
        path = [cur]
        for d, sib in enumerate(nodes):
            step = 2 << d
            right = (ite >> (d + 1)) & 1
            if sib.index != (ite - step if right else ite + step) or len(sib.hash) != 32:
                raise VerificationError(f"bad proof from peer: unexpected node {sib.index}")
            left_n, right_n = (sib, cur) if right else (cur, sib)
            total = left_n.size + right_n.size
            ite = ite - (step >> 1) if right else ite + (step >> 1)
            cur = Node(ite, total, blake2b(
                b"\x01" + total.to_bytes(8, "little") + left_n.hash + right_n.hash,
                digest_size=32).digest())
            path.append(sib)
            path.append(cur)
        known = self.known
        have = known.get(cur.index)
        if have is None:
            if any(q.block is not None and q.block < index for q in self.inflight.values()):
                self.stalls += 1
                self.stalled.append((p, index, value, nodes))  # an earlier answer proves its top
                return
            # nothing in flight can prove it (e.g. an upgrade moved the roots): full path
            self.retries += 1
            rid = self._id()
            self._request(s, Pending(rid, index, False, False), M.Request(
                rid, self.fork,
                block=BlockRequest(index, max_missing_nodes(2 * index, self.trusted.length))))
            return
        if have.hash != cur.hash or have.size != cur.size:
            raise VerificationError(f"bad proof from peer: checksum mismatch at node {cur.index}")
        for n in path:
            known[n.index] = n
        self.buffered[index] = (value, leaf)
        s.stats.blocks += 1
        s.stats.bytes += size
        self._deliver()
        self._unstall(s)

    def _unstall(self, s: ReplicationChannel) -> None:
        """Answers that waited for an earlier one: try them again (that one is in)."""
        if self.stalled:
            again, self.stalled = self.stalled, []
            for q, i, v, ns in again:
                self._on_block(s, q, i, v, ns)

    def _keep_path(self, leaf: Node, siblings: tuple[Node, ...]) -> None:
        """Remember a verified block's path (its siblings and the parents they make), as
        `_on_block` does, so the next blocks' short proofs can end on it."""
        known = self.known
        cur = leaf
        known[cur.index] = cur
        for sib in siblings:
            if sib.index != flat_tree.sibling(cur.index):
                return  # not a plain path: keep what we have
            left, right = (sib, cur) if sib.index < cur.index else (cur, sib)
            total = left.size + right.size
            cur = Node(flat_tree.parent(cur.index), total, blake2b(
                b"\x01" + total.to_bytes(8, "little") + left.hash + right.hash,
                digest_size=32).digest())
            known[sib.index] = sib
            known[cur.index] = cur

    def _prune(self) -> None:
        """Forget verified nodes wholly left of every block still to come (they can
        never be a sibling or an ancestor on a later path); keep the trusted roots."""
        edge = 2 * self.next_deliver
        self.known = {i: n for i, n in self.known.items() if flat_tree.right_span(i) >= edge}
        for r in self.trusted.roots():
            self.known[r.index] = r
        self.pruned_at = self.next_deliver

    def _deliver(self) -> None:
        if self.next_deliver - self.pruned_at >= PRUNE_EVERY:
            self._prune()
        while self.next_deliver in self.buffered:
            value, leaf = self.buffered.pop(self.next_deliver)
            if value is None:
                self.sink.put_removed(self.next_deliver, leaf)  # type: ignore[attr-defined]
            else:
                self.sink.put_block(self.next_deliver, value, leaf)
            self.next_deliver += 1
        while self.heads and self.heads[0][0] <= self.next_deliver:
            length, fork, sig, roots = self.heads.pop(0)
            self.sink.put_head(length, fork, sig, roots)

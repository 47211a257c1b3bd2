"""Cluster mode: the propose/sign channel of quorum-signed partitions (docs/clusters.md).

Owns the two messages (`Proposal`, `Answer`), the replica's signing service
(`ReplicaSigner`) and the leader's assembling of a quorum signature (`QuorumAssembler`).
The transport is not here: `Peers.propose(node_id, proposal)` carries a proposal to one
replica and brings its answer back, and the sender's broker id reaches the replica
authenticated by the transport (docs/clusters.md says which, and why).

Theory of operation, one head of one archive:

1. The leader appended batches (stamped with offsets and epoch) and holds them durably
   as an unsigned tail. It proposes (fork, length, tree hash) to every other replica,
   with the blocks that replica lacks: from what the replica last said it holds
   (`Answer.held`) up to `length`, in pieces of at most `max_bytes` (and MAX_BLOCKS
   blocks). A piece that stops short of `length` is stored and answered with what the
   replica holds now, without signing; the leader sends the next piece from there, so a
   replica far behind (a burst of unsigned blocks, a replica back from a pause) catches
   up within the signing window instead of being given up on. (Ordinary replication
   cannot carry those blocks: no head covers them yet.)
2. The replica (`ReplicaSigner.handle`) refuses a proposal for an archive it is not a
   signer of, from a broker that is not that archive's placed leader, or larger than its
   budget. It keeps the blocks it holds that the proposal repeats byte for byte; a block
   of its unsigned tail that differs is dropped with the rest of that tail (never one
   under its stored head: that is refused). Every new block goes through the produce
   path's checks (header, CRC-32C, every record; broker/validation.py) before it is
   stored: nothing malformed is signed. It then signs through `FollowerLog.sign_held`:
   the blocks are fsynced, the tree is computed from them, the signing rule (storage/
   quorum.py) is checked and recorded durably, and only then does the signature leave.
   Each refusal says how many blocks the replica holds, so the leader resends from there.
3. The leader (`QuorumAssembler.sign`) signs as itself, asks every replica at once, each
   within `timeout_s` (a trio cancel scope: a slow or dead replica never holds the
   leader; a refusal is asked again with backoff meanwhile, as a replica may not have
   opened its copy of a new topic yet), verifies each partial signature against the
   manifest, and returns the
   assembled quorum signature as soon as the manifest's quorum signed (the leader
   counting), cancelling the slower asks; `NotEnoughSigners` if the quorum is not
   reached. The head is then stored and published by the commit path.

May import trio, `broker.validation` (and its errors), `broker.cluster.*` and `storage`;
never the protocol codec or the handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from broker.protocol.errors import RecordBatchError
from broker.validation import check_batch, inflate_limit
from storage.errors import StorageError
from storage.follower import FollowerLog
from storage.hypercore import KeyPair, Manifest
from storage.hypercore.encoding import Reader, encode_uint
from storage.hypercore.errors import DecodeError
from storage.hypercore.multisig import (
    PartialSignature,
    assemble_quorum,
    sign_partial,
    signer_index,
    verify_partial,
)
from storage.hypercore.tree import leaf_hash
from storage.quorum import RefusedToSign

log = logging.getLogger("hyperkafka.quorum")

PROTOCOL = "hyperkafka/quorum"  # the protomux protocol name of the channel
PROPOSE = 0  # message types on it
ANSWER = 1
MAX_PROPOSAL_BYTES = 8 << 20  # a replica's budget for the blocks of one proposal
MAX_BLOCKS = 4096  # blocks in one proposal (each a whole batch)
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # Kafka's message.max.bytes, for the inflate cap
MAX_REASON = 512
RETRY_MIN_S = 0.05  # a refused or unanswered proposal is asked again after this, doubling
RETRY_MAX_S = 1.0


class MessageError(Exception):
    """A proposal or answer that does not decode (the channel is then closed)."""


def read_sized(r: Reader, size: int, what: str) -> bytes:
    """A length-prefixed field that is either empty or exactly `size` bytes (a signature,
    a tree hash): MessageError naming `what` otherwise."""
    n = r.uint()
    if n not in (0, size):
        raise MessageError(f"{what} is {size} bytes")
    return r.fixed(n)


def read_reason(r: Reader) -> str:
    """A refusal's reason: length-prefixed UTF-8 of at most MAX_REASON bytes."""
    m = r.uint()
    if m > MAX_REASON:
        raise MessageError("refusal reason too long")
    return r.fixed(m).decode(errors="replace")


@dataclass(frozen=True)
class Proposal:
    """Sign (`fork`, `length`, `tree_hash`) of archive `archive` (its key); `blocks` are
    the blocks `start`, `start + 1`, ... the replica may lack."""

    archive: bytes
    fork: int
    length: int
    tree_hash: bytes
    start: int
    blocks: tuple[bytes, ...] = ()

    def encode(self) -> bytes:
        out = [self.archive, encode_uint(self.fork), encode_uint(self.length), self.tree_hash]
        out += [encode_uint(self.start), encode_uint(len(self.blocks))]
        for b in self.blocks:
            out += [encode_uint(len(b)), b]
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, max_bytes: int) -> Proposal:
        """Bounds before allocation: at most MAX_BLOCKS blocks of `max_bytes` in all."""
        try:
            r = Reader(data)
            archive = r.fixed(32)
            fork, length, th = r.uint(), r.uint(), r.fixed(32)
            start, count = r.uint(), r.uint()
            if count > MAX_BLOCKS:
                raise MessageError(f"{count} blocks in one proposal (at most {MAX_BLOCKS})")
            blocks, total = [], 0
            for _ in range(count):
                n = r.uint()
                total += n
                if total > max_bytes:
                    raise MessageError(f"proposal blocks exceed the {max_bytes}-byte budget")
                blocks.append(r.fixed(n))
            if r.remaining():
                raise MessageError("trailing bytes after a proposal")
        except DecodeError as exc:
            raise MessageError(f"undecodable proposal: {exc}") from None
        return cls(archive, fork, length, th, start, tuple(blocks))


@dataclass(frozen=True)
class Answer:
    """A replica's answer: its partial signature (signer index in the manifest and
    ed25519 signature), or none and why; `held`, the blocks it holds now."""

    archive: bytes
    fork: int
    length: int
    held: int
    signer: int = -1
    signature: bytes = b""
    reason: str = ""

    @property
    def signed(self) -> bool:
        return self.signer >= 0 and len(self.signature) == 64

    def encode(self) -> bytes:
        reason = self.reason.encode()[:MAX_REASON]
        return b"".join([
            self.archive, encode_uint(self.fork), encode_uint(self.length),
            encode_uint(self.held), encode_uint(self.signer + 1),
            encode_uint(len(self.signature)), self.signature, encode_uint(len(reason)), reason,
        ])  # fmt: skip

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Answer:
        try:
            r = Reader(data)
            archive = r.fixed(32)
            fork, length, held, signer = r.uint(), r.uint(), r.uint(), r.uint() - 1
            sig = read_sized(r, 64, "a signature")
            reason = read_reason(r)
            if r.remaining():
                raise MessageError("trailing bytes after an answer")
        except DecodeError as exc:
            raise MessageError(f"undecodable answer: {exc}") from None
        return cls(archive, fork, length, held, signer, sig, reason)


# ----------------------------------------------------------------- the replica side


@dataclass
class ReplicaSigner:
    """A replica's signing service: `handle` one proposal (blocking: disk writes and
    fsyncs, run it in a worker thread, one proposal per archive at a time).

    `archive(key)`: this broker's copy of archive `key` (its mirror's FollowerLog), or
    None; `leader(key)`: the broker id placed as the leader of that archive, or None;
    `epoch(key)`: the leader epoch its placement records (None: a signer that does not
    know the placement, in tests of signing alone)."""

    keypair: KeyPair
    archive: Callable[[bytes], FollowerLog | None]
    leader: Callable[[bytes], int | None]
    epoch: Callable[[bytes], int] | None = None
    max_bytes: int = MAX_PROPOSAL_BYTES
    max_message_bytes: Callable[[bytes], int] = field(
        default=lambda _key: DEFAULT_MAX_MESSAGE_BYTES
    )

    def busy(self, key: bytes) -> bool:
        """Whether this broker's copy of archive `key` is storing a head right now (its
        mirror's accept job): a proposal is answered once it is done."""
        lg = self.archive(key)
        return lg is not None and lg.busy

    def handle(self, sender: int, p: Proposal) -> Answer:
        lg = self.archive(p.archive)
        if lg is None:
            return Answer(p.archive, p.fork, p.length, 0, reason="no copy of this archive here")

        def refuse(why: str) -> Answer:
            log.info("refused to sign %s at length %d: %s", lg.path, p.length, why)
            return Answer(p.archive, p.fork, p.length, lg.length, reason=why)

        manifest = lg.manifest
        if manifest is None or manifest == Manifest.default(lg.public_key):
            return refuse("not a quorum-signed archive")
        try:
            me = signer_index(manifest, self.keypair.public_key)
        except ValueError:
            return refuse("this broker is not one of the archive's signers")
        if self.leader(p.archive) != sender:
            return refuse(f"broker {sender} is not the placed leader of this archive")
        if self.epoch is not None:
            # A vote for epoch E is under way (this replica promised it, no leader of E is
            # recorded yet): no head is signed, on any fork, until one is. The promise
            # alone refuses forks older than E; but the placed leader may move to a fork
            # of E or newer by itself (its restart cut an unsigned tail), and heads it got
            # signed on fork E could disagree with those of the leader the vote elects
            # in E: two quorum-signed histories in one fork.
            promised, placed = lg.promised_epoch(), self.epoch(p.archive)
            if promised > placed:
                return refuse(f"a vote for leader epoch {promised} is under way "
                              f"(the placement records epoch {placed})")  # fmt: skip
        if not lg.log.replica:
            # This broker writes it (a failover elected it) while the placement names
            # another leader already: a later failover deposed it (paused past the
            # session timeout, say) and it has not stepped down yet. Its copy takes no
            # proposal until it has (broker/takeover.py `step_down`).
            return refuse("this broker still writes this archive; it has not stepped down yet")
        if sum(len(b) for b in p.blocks) > self.max_bytes:
            return refuse(f"proposal exceeds the {self.max_bytes}-byte budget")
        try:
            why = self._take_blocks(lg, p)
            if why is not None:
                return refuse(why)
            if p.blocks and p.start + len(p.blocks) < p.length and lg.length < p.length:
                # one piece of a proposal larger than a message: stored, the rest to come
                why = f"holds fewer than the {p.length} blocks proposed: {lg.length}; send the rest"
                return Answer(p.archive, p.fork, p.length, lg.length, reason=why)
            partial = lg.sign_held(self.keypair, p.fork, p.length, p.tree_hash)
        except RefusedToSign as exc:
            return refuse(str(exc))
        except StorageError as exc:
            return refuse(f"storage: {exc}")
        assert partial.signer == me
        return Answer(p.archive, p.fork, p.length, lg.length, partial.signer, partial.signature)

    def _take_blocks(self, lg: FollowerLog, p: Proposal) -> str | None:
        """Store the proposal's blocks this replica lacks; why not, or None."""
        stored = lg.head.length if lg.head is not None else 0
        if p.start > lg.length:
            return f"holds {lg.length} blocks; send from there"
        for k, block in enumerate(p.blocks):
            i = p.start + k
            if i < lg.length:
                if lg.log.block(i) == block:
                    continue  # held already, byte for byte
                if i < stored:
                    return f"block {i} differs from the one under its stored head"
                # an unsigned tail that another proposal left: dropped, resent below
                lg.discard_unsigned()
                if lg.length != stored:
                    return "cannot drop its unsigned tail now; try again"
                if p.start > stored:
                    return f"holds {stored} blocks; send from there"
                return self._take_blocks(lg, p)
            limit = inflate_limit(self.max_message_bytes(p.archive))
            try:
                check_batch(block, max_inflated=limit, timestamps=None).records()
            except RecordBatchError as exc:  # a malformed batch is never stored, nor signed
                return f"block {i} is not a valid record batch: {exc}"
            try:
                lg.append_block(i, block, leaf_hash(block))
            except StorageError as exc:
                return f"block {i}: {exc}"
        return None


# ----------------------------------------------------------------- the leader side


class Peers(Protocol):
    """The transport: carry `proposal` to broker `node_id`, return its answer."""

    async def propose(self, node_id: int, proposal: Proposal) -> Answer: ...


class NotEnoughSigners(StorageError):
    """Fewer than the quorum signed within the time given."""


@dataclass
class QuorumAssembler:
    """The leader's side of one quorum-signed archive: `sign` a head it holds.

    `replicas`: the broker ids in manifest order (this broker among them); `blocks(i)`:
    the leader's block i; `signed_length()`: its last published quorum head's length (a
    replica whose progress is unknown is sent the blocks from there)."""

    me: int
    keypair: KeyPair
    manifest: Manifest
    replicas: Sequence[int]
    peers: Peers
    blocks: Callable[[int], bytes]
    signed_length: Callable[[], int]
    timeout_s: float = 5.0
    max_bytes: int = MAX_PROPOSAL_BYTES
    held: dict[int, int] = field(default_factory=dict)  # what each replica said it holds
    # told (replica, fork, length) of every verified partial signature: that replica holds
    # the blocks durably (acks=all counts it, broker/cluster/replicas.py)
    on_signed: Callable[[int, int, int], None] | None = None

    @property
    def key(self) -> bytes:
        return self.manifest.hash()

    def _proposal(self, node_id: int, fork: int, length: int, th: bytes) -> Proposal | None:
        """The next piece for `node_id`: its missing blocks from what it holds, at most
        `max_bytes` and MAX_BLOCKS of them; None when one block alone exceeds the budget
        (that replica can never take it: given up on, logged)."""
        start = min(self.held.get(node_id, self.signed_length()), length)
        blocks: list[bytes] = []
        total = 0
        for i in range(start, length):
            b = self.blocks(i)
            if total + len(b) > self.max_bytes or len(blocks) >= MAX_BLOCKS:
                if not blocks:
                    log.warning(
                        "giving up on broker %d for length %d: block %d (%d bytes) exceeds "
                        "the %d-byte proposal budget", node_id, length, i, len(b), self.max_bytes,
                    )  # fmt: skip
                    return None
                break  # the rest in the next piece
            total += len(b)
            blocks.append(b)
        return Proposal(self.key, fork, length, th, start, tuple(blocks))

    async def _ask(
        self, node_id: int, fork: int, length: int, th: bytes
    ) -> PartialSignature | None:
        resent = False
        while True:
            p = self._proposal(node_id, fork, length, th)
            if p is None:
                return None
            a = await self.peers.propose(node_id, p)
            if a.archive != self.key or a.fork != fork or a.length != length:
                return None
            self.held[node_id] = a.held
            if a.signed:
                partial = PartialSignature(a.signer, a.signature)
                ok = self.manifest.signers[a.signer].public_key == self._key_of(
                    node_id
                ) and verify_partial(self.manifest, partial, th, length, fork)
                if ok and self.on_signed is not None:
                    self.on_signed(node_id, fork, length)
                return partial if ok else None
            end = p.start + len(p.blocks)
            if end < length and a.held >= end:
                continue  # a piece taken (or held already): the next one at once
            log.info("broker %d did not sign length %d: %s", node_id, length, a.reason)
            if a.held < p.start and not resent:
                resent = True  # it holds less than it said: once more from there
                continue
            return None

    def _key_of(self, node_id: int) -> bytes | None:
        try:
            return self.manifest.signers[list(self.replicas).index(node_id)].public_key
        except (ValueError, IndexError):
            return None

    async def sign(self, tree_hash: bytes, length: int, fork: int) -> bytes:
        """The assembled quorum signature over (`fork`, `length`, `tree_hash`), this
        broker's own included; NotEnoughSigners when fewer than the quorum sign within
        `timeout_s`."""
        partials = [sign_partial(self.keypair, self.manifest, tree_hash, length, fork)]
        need = self.manifest.quorum
        if len(partials) < need:
            async with trio.open_nursery() as nursery:

                async def ask(node_id: int) -> None:
                    # A refusal may pass (a replica that has not opened its copy of a new
                    # topic yet, a busy one, a link still connecting): asked again, with
                    # backoff, until the quorum is reached or the time is up.
                    delay = RETRY_MIN_S
                    with trio.move_on_after(self.timeout_s):
                        while True:
                            try:
                                partial = await self._ask(node_id, fork, length, tree_hash)
                            except (OSError, trio.BrokenResourceError, MessageError) as exc:
                                log.info("broker %d did not answer a proposal: %s", node_id, exc)
                                partial = None
                            if partial is not None:
                                partials.append(partial)
                                if len(partials) >= need:
                                    nursery.cancel_scope.cancel()
                                return
                            await trio.sleep(delay)
                            delay = min(delay * 2, RETRY_MAX_S)

                for r in self.replicas:
                    if r != self.me:
                        nursery.start_soon(ask, r)
        if len(partials) < need:
            late = [r for r in self.replicas if r != self.me]
            behind = {r: length - self.held.get(r, self.signed_length()) for r in late}
            log.warning(
                "gave up on signing length %d of %s after %.1f s: blocks each replica "
                "lacks %s", length, self.key.hex()[:16], self.timeout_s, behind,
            )  # fmt: skip
            raise NotEnoughSigners(
                f"{len(partials)} of the {need} signers needed signed length {length}"
            )
        return assemble_quorum(self.manifest, partials)

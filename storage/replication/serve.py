"""The serving side of a replication channel: one archive offered to one peer.

Owns `Server`, the role a `ReplicationChannel` plays when it serves an `ArchiveSource`
(`Connection.serve(source)`, or a channel the peer opens that the connection's `lookup`
finds), as Hypercore's replicator serves a core:

* announce the signed head (``sync``) and what we hold (``range``: every block up to the
  head, less the runs our cleaner removed, sent as ``range`` with drop, so a stock peer
  never asks for those; storage/FORMAT.md section 10), and again on every append;
* answer ``request`` with proofs from `storage.hypercore.proofs.generate_proof`. The
  connection queues requests per channel and has them `answer`ed round-robin
  across channels (storage/replication/session.py, `Connection.buffers_to_send`); a
  block-only answer is sent in parts, so the block is copied once, into the encryption;
  a removed block is ``noData`` (a ``hash`` request still gets its leaf); an invalid
  request is ``noData`` too, until `MAX_INVALID_REQUESTS` closes the channel;
* track how much the peer holds from its ``range``/``bitfield`` messages
  (`remote_contiguous`, Hypercore's ``_remoteContiguousLength``): cluster mode's in-sync
  replicas and acks=all are built on it.

Sans-I/O like the rest of storage/replication: nothing here blocks or sleeps.

May import the standard library, `storage.errors`, `storage.hypercore` and
`storage.replication.{messages,errors,sources}`; `storage.replication.session` for
typing only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from storage.errors import BlockRemoved
from storage.hypercore import Node
from storage.hypercore.encoding import encode_uint
from storage.hypercore.proofs import InvalidRequest, Proof, generate_proof
from storage.replication import messages as M
from storage.replication.errors import RemoteProtocolError
from storage.replication.sources import ArchiveSource, SignedHead

if TYPE_CHECKING:
    from storage.replication.session import ReplicationChannel

# Hypercore gives up on a peer after this many invalid requests (replicator.js).
MAX_INVALID_REQUESTS = 64


def encode_nodes(nodes: tuple[Node, ...]) -> bytes:
    """A proof's node list as on the wire (``uint count``, then index, size, hash each)."""
    return b"".join([encode_uint(len(nodes)),
                     *(encode_uint(n.index) + encode_uint(n.size) + n.hash for n in nodes)])



class Server:
    def __init__(self, source: ArchiveSource | None) -> None:
        self.source = source
        self.head = source.head() if source is not None else SignedHead(0, 0, None)
        self.remote_fork = 0
        self.remote_length = 0
        self.announced_remote: tuple[int, int] | None = None
        self.remote_contiguous = 0  # replicator.js Peer._remoteContiguousLength
        self._remote_ranges: dict[int, int] = {}  # start -> end of ranges past the prefix

    def _can_upgrade(self) -> bool:
        # replicator.js _canUpgrade: a peer at length 0 can always take an upgrade.
        if self.remote_fork != self.head.fork:
            return False
        return self.remote_length == 0 or self.remote_length < self.head.length

    def _sync(self, s: ReplicationChannel) -> None:
        self.announced_remote = (self.remote_fork, self.remote_length)
        same = self.remote_fork == self.head.fork
        s.send(M.Sync(
            fork=self.head.fork,
            length=self.head.length,
            remote_length=self.remote_length if same else 0,
            can_upgrade=self._can_upgrade(),
            uploading=True,
            downloading=False,
            has_manifest=True,
            allow_push=False,
        ))

    def on_open(self, s: ReplicationChannel) -> None:
        assert self.source is not None
        self.head = self.source.head()
        self._sync(s)
        self._held(s, 0)

    def _held(self, s: ReplicationChannel, start: int) -> None:
        """Tell the peer which blocks from `start` to our head we hold (Hypercore `range`
        messages): all of them, less the runs our cleaner removed (a `range` with drop),
        so a stock Hypercore peer never asks for those (storage/FORMAT.md section 10)."""
        length = self.head.length
        if length <= start:
            return
        s.send(M.Range(start, length - start))
        removed = getattr(self.source, "removed_runs", None)
        if removed is not None:
            for first, n in removed(length):
                if first + n > start:
                    s.send(M.Range(max(first, start), first + n - max(first, start), drop=True))

    def announce(self, s: ReplicationChannel) -> None:
        assert self.source is not None
        new = self.source.head()
        if new == self.head:
            return
        old, self.head = self.head, new
        s.mux.cork()
        self._sync(s)
        # grown on the same fork: only the new blocks (what the peer knew still holds)
        self._held(s, old.length if old.fork == new.fork and old.length <= new.length else 0)
        s.mux.uncork()

    def on_message(self, s: ReplicationChannel, m: M.Message) -> None:
        if isinstance(m, M.Sync):
            self.remote_fork, self.remote_length = m.fork, m.length
            if self.announced_remote != (m.fork, m.length):
                self._sync(s)  # acknowledge their length so they may ask for an upgrade
        elif isinstance(m, M.Request):
            s.stats.requests += 1
            self.answer(s, m)
        elif isinstance(m, M.Want) and not isinstance(m, M.Unwant) and self.head.length:
            self._held(s, 0)
        elif isinstance(m, M.Range):
            self._on_range(m.start, m.length, m.drop)
        elif isinstance(m, M.Bitfield):
            self._on_bitfield(m.start, m.bitfield)
        # cancel/unwant/data/noData/extension need no answer from a server that answers
        # every request synchronously and downloads nothing.

    def _on_range(self, start: int, length: int, drop: bool) -> None:
        """What the peer holds, as Hypercore's onrange keeps it: a drop below the
        contiguous prefix cuts it there; a held range at or touching the prefix extends
        it (ranges further out are kept until the gap before them is filled)."""
        end = start + length
        if drop:
            if start < self.remote_contiguous:
                self.remote_contiguous = start
            self._remote_ranges = {a: b for a, b in self._remote_ranges.items() if b <= start}
            return
        if length <= 0:
            return
        if start > self.remote_contiguous:
            if len(self._remote_ranges) < 1024:  # a peer cannot make us keep unbounded state
                self._remote_ranges[start] = max(end, self._remote_ranges.get(start, 0))
            return
        self.remote_contiguous = max(self.remote_contiguous, end)
        while self._remote_ranges:
            reach = [a for a in self._remote_ranges if a <= self.remote_contiguous]
            if not reach:
                break
            for a in reach:
                self.remote_contiguous = max(self.remote_contiguous, self._remote_ranges.pop(a))

    def _on_bitfield(self, start: int, words: tuple[int, ...]) -> None:
        """A bitfield is the truth for the blocks it covers (replicator.js onbitfield):
        the contiguous prefix ends at its first unset bit, if that is within it."""
        if start < self.remote_contiguous:
            self.remote_contiguous = start
        if start != self.remote_contiguous:
            return
        run = 0
        for w in words:
            if w == 0xFFFFFFFF:
                run += 32
                continue
            run += ((~w) & (w + 1)).bit_length() - 1  # trailing ones of w
            break
        if run:
            self._on_range(start, run, False)

    @staticmethod
    def _invalid(s: ReplicationChannel, m: M.Request) -> None:
        s.stats.invalid_requests += 1
        if s.stats.invalid_requests >= MAX_INVALID_REQUESTS:
            raise RemoteProtocolError("too many invalid requests") from None
        s.send(M.NoData(m.id, M.NoDataReason.INVALID_REQUEST))

    def answer(self, s: ReplicationChannel, m: M.Request) -> None:
        """One request, answered now (with a proof, or noData)."""
        assert self.source is not None
        head = self.head
        manifest = self.source.manifest if m.manifest else None
        if manifest is not None and m.block is None and m.hash is None and m.upgrade is None:
            s.send(M.Data(m.id, Proof(head.fork, manifest=manifest)))  # manifest alone
            return
        if m.fork != head.fork or m.seek is not None or (
            m.block is not None and m.block.index >= head.length
        ):
            if manifest is not None and m.block is None and m.hash is None and m.upgrade is None:
                s.send(M.Data(m.id, Proof(head.fork, manifest=manifest)))
            else:
                s.send(M.NoData(m.id, M.NoDataReason.NOT_AVAILABLE))
            return

        source = self.source

        def get(index: int) -> Node:
            n = source.node(index)
            if n is None:
                raise KeyError(index)
            return n

        try:
            value = self.source.block(m.block.index) if m.block is not None else None
        except BlockRemoved:
            # removed by the cleaner (storage/FORMAT.md 4a): not held, as Hypercore says of
            # a block it lacks; the leaf stays in the tree (a `hash` request gets it)
            s.send(M.NoData(m.id, M.NoDataReason.NOT_AVAILABLE))
            return
        except (KeyError, IndexError):
            self._invalid(s, m)
            return
        try:
            proof = generate_proof(
                get, head.length, head.fork, head.signature,
                block=m.block, block_value=value, hash=m.hash, upgrade=m.upgrade,
                manifest=manifest,
            )
        except (InvalidRequest, KeyError, IndexError):
            self._invalid(s, m)
            return
        if value is not None:
            s.stats.blocks += 1
            s.stats.bytes += len(value)
        b = proof.block
        if b is not None and b.value is not None and proof.hash is None and proof.upgrade is None \
                and proof.manifest is None:
            # Proof.encode's bytes, in parts: the block is copied once, into the encryption
            s.send_parts(M.MessageType.DATA, [
                b"".join((b"\x01", encode_uint(m.id), encode_uint(proof.fork),
                          encode_uint(b.index), encode_uint(len(b.value)))),
                b.value,
                encode_nodes(b.nodes),
            ])
            return
        s.send(M.Data(m.id, proof))

"""A follower archive: a partition log that another node signs (storage/FORMAT.md sec. 10).

Owns `FollowerLog`, the persistent sink of a mirror. It holds a `PartitionLog` (same
files and format: segments, dense index, tree file, two-slot head file) opened as a
replica with the writer's *public* key only, fsync `always`, and read-only for Kafka,
which reads it as any partition (`FollowerLog.log`): blocks come in
through `append_block` (written byte for byte, with the leaf hash a replication session
computed from those bytes when it verified them), and become visible only when
`accept_head` stores a head the writer signed, after checking that the delivered leaf
hashes fold into that signed tree (each block is hashed once, not again on the way in).
The writer's signature is stored verbatim in the head slot, so `verify` of the mirror's
data dir checks it with the writer's key (with its manifest, kept in the `manifest`
file, for a quorum-signed archive). We never sign alone: blocks past the last accepted
head are dropped at close and at recovery (they are fetched again); a replica of a
quorum-signed archive only adds its partial signature to a head its leader proposes over
blocks it holds (`sign_held`, through the signing rule of storage/quorum.py).

Two valid heads of one fork that disagree are equivocation, whatever their lengths: the
same length and another tree, a shorter head that is not a prefix of ours, or a longer
head whose tree at our length is not ours (shown by an upgrade proof from 0 to our length
plus the nodes that grow it to that head, bound to its signature: Hypercore's
``checkConflict``). Both heads (and that proof) go into the `evidence` file, the archive
is frozen (it keeps serving what it holds and takes nothing new), one ERROR line is
logged and `Equivocation` is raised. A head on a newer fork is no equivocation: the
writer truncated (Hypercore's ``truncate``, our writer's recovery after a power loss).
If the new fork keeps our whole tree it is followed (`follow_fork`); if it dropped
blocks we hold we would have to reorg, which we do not do yet: `ForkChanged` is raised
and nothing is stored. A head on an older fork is stale and ignored, as Hypercore does.

May import the standard library, `storage.log`, `storage.hypercore`, `storage.fs`,
`storage.errors`, `storage.batch`, `storage.manifest_file`, `storage.quorum`. Never
`broker` or trio.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

from storage import batch as B
from storage.errors import ArchiveDamaged, StorageError
from storage.fs import FileSystem, OsFileSystem
from storage.handles import HandleCache
from storage.hypercore import (
    Frontier,
    HypercoreError,
    InvalidProof,
    KeyPair,
    Manifest,
    Node,
    flat_tree,
    tree_hash,
)
from storage.hypercore.multisig import (
    HeadSigner,
    PartialSignature,
    head_manifest,
    verify_signed_head,
)
from storage.hypercore.proofs import Proof, UpgradeRequest, generate_proof, verify_proof
from storage.log import CommitJob, FileRange, FsyncPolicy, Head, LogConfig, PartitionLog
from storage.manifest_file import MANIFEST_FILE, write_manifest
from storage.quorum import Vote, promise, read_promise, sign_proposal

log = logging.getLogger(__name__)

PUBLIC_KEY_FILE = "public_key"
EVIDENCE_FILE = "evidence"
_BE_I64 = struct.Struct(">q")
_BE_I32 = struct.Struct(">i")


class VerificationFailed(StorageError):
    """A head or block handed to the follower does not verify: the peer lied; drop it."""


class Equivocation(StorageError):
    """The writer signed two heads that disagree; the archive is frozen."""


class ForkChanged(StorageError):
    """The writer signed a head on a newer fork (it truncated its archive): legitimate in
    Hypercore, but following it needs a reorg, which a mirror does not do yet."""


def _head_json(
    length: int, fork: int, th: bytes, signature: bytes, roots: Sequence[Node]
) -> dict[str, Any]:
    return {
        "length": length,
        "fork": fork,
        "tree_hash": th.hex(),
        "signature": signature.hex(),
        "roots": [[r.index, r.size, r.hash.hex()] for r in roots],
    }


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_evidence(
    path: str, public_key: HeadSigner, read: Callable[[str], bytes] = _read
) -> str | None:
    """A description of the equivocation recorded in archive dir `path` when its evidence
    file proves one under `public_key`: two heads of one fork, both signed, that disagree
    (same length and another tree hash; or the longer head's tree at the shorter length,
    shown by the recorded proof, is another tree). None when there is no such evidence
    (no file, or one that proves nothing: a forged or consistent pair)."""
    key = head_manifest(public_key).hash()
    try:
        doc = json.loads(read(os.path.join(path, EVIDENCE_FILE)))
        heads = []
        for h in doc["heads"][:2]:
            roots = [Node(int(i), int(s), bytes.fromhex(x)) for i, s, x in h["roots"]]
            th = tree_hash(roots)
            sig = bytes.fromhex(h["signature"])
            length, fork = int(h["length"]), int(h["fork"])
            if not (
                flat_tree.full_roots(2 * length) == [r.index for r in roots]
                and verify_signed_head(public_key, key, th, length, fork, sig)
            ):
                return None
            heads.append((length, fork, th))
        if len(heads) != 2:
            return None
        (la, fa, ta), (lb, fb, tb) = heads
        if fa != fb or (la, ta) == (lb, tb):
            return None
        where = f"(evidence in {os.path.join(path, EVIDENCE_FILE)})"
        if la == lb:
            return f"equivocation: writer signed two trees at length {la}, fork {fa} {where}"
        (ls, ts), (ll, tl) = sorted([(la, ta), (lb, tb)])
        _, proof = Proof.decode(bytes.fromhex(doc["proof"]))
        if _tree_at(proof, public_key, key, fa, ll, tl, ls) == ts:
            return None
    except (OSError, ValueError, KeyError, TypeError, HypercoreError):
        return None
    return (
        f"equivocation: writer signed length {ll} whose tree at length {ls} is not the "
        f"one it signed at length {ls} (fork {fa}) {where}"
    )


def _tree_at(
    proof: Proof, public_key: HeadSigner, key: bytes, fork: int, length: int, th: bytes, at: int
) -> bytes:
    """The tree hash at `at` blocks of the signed head (`length`, `th`, `fork`), shown by
    `proof`: an upgrade proof from 0 to `at` blocks plus the nodes that grow that tree to
    the head. Raises InvalidProof when it is not such a proof or does not verify."""
    up = proof.upgrade
    if up is None or up.start != 0 or up.length != at or proof.fork != fork:
        raise InvalidProof(f"not an upgrade proof from 0 to {at} blocks on fork {fork}")
    head = verify_proof(proof, public_key=public_key, key=key, fork=fork, trusted=Frontier()).head
    if head is None or head.length != length or head.tree_hash() != th:
        raise InvalidProof(f"the proof is not for the head at length {length}")
    # with start 0 the upgrade's nodes are the roots at `at` blocks, and they fold (with
    # the additional nodes) into the signed tree: the signer's own tree at `at` blocks
    return tree_hash(list(up.nodes))


@dataclass
class AcceptJob:
    """A signed head being stored (FollowerLog.prepare_accept / run_accept / finish_accept)."""

    job: CommitJob
    length: int
    tree_hash: bytes
    ran: bool = False  # run_accept started (a caller cancelled before it may never run it)


class FollowerLog:
    """A partition archive written by another node. Open with `FollowerLog.open_replica`.

    Holds the archive as `log`, a `PartitionLog` opened as a replica (it never signs and
    takes blocks only through this class): `log` is what Kafka reads are served from,
    this class is the replication sink that checks what goes into it."""

    def __init__(self, log_: PartitionLog) -> None:
        self.log = log_
        self.frozen: str | None = None  # set: equivocation evidence on disk, take nothing
        # a newer fork of the writer shown to extend what we hold (check_conflict): the
        # fork to follow, before a head on it is stored
        self._next_fork: int | None = None
        # set: the writer truncated below what we hold (ForkChanged raised); following
        # needs a reorg we do not do, so nothing is tried again until a restart
        self.reorg_needed: str | None = None
        # a run of blocks the writer's cleaner removed (put_removed), verified, not yet
        # written: their offsets are known once the next block kept says where it starts
        self._holes: list[tuple[int, Node]] = []
        # a head over blocks of `_holes` (put_head): stored once they are written
        self._deferred_head: tuple[int, int, bytes, list[Node]] | None = None

    @classmethod
    def open_replica(
        cls,
        path: str | os.PathLike[str],
        public_key: HeadSigner,
        *,
        config: LogConfig | None = None,
        fs: FileSystem | None = None,
    ) -> FollowerLog:
        """Open (create) the follower archive of the writer key `public_key` at `path`.
        The key is recorded in `public_key` on first open; another key is refused. A
        quorum-signed archive is opened by its manifest instead, recorded in `manifest`."""
        fs = fs or OsFileSystem()
        p = os.fspath(path)
        fs.makedirs(p)
        kpath = os.path.join(p, PUBLIC_KEY_FILE)
        if isinstance(public_key, Manifest):
            if fs.exists(kpath):
                raise VerificationFailed(f"{p} holds the archive of a single signer")
            try:
                write_manifest(fs, p, public_key)
            except ArchiveDamaged as exc:
                raise VerificationFailed(str(exc)) from exc
            pk = public_key.signers[0].public_key  # unused for signing or checking
        else:
            if fs.exists(os.path.join(p, MANIFEST_FILE)):
                raise VerificationFailed(f"{p} holds a quorum-signed archive")
            if fs.exists(kpath):
                if fs.read_file(kpath) != public_key:
                    raise VerificationFailed(f"{p} holds the archive of another key")
            else:
                fs.write_file_atomic(kpath, bytes(public_key))
            pk = bytes(public_key)
        # No secret key: signing would fail loudly, and nothing here ever signs.
        lg = cls(
            PartitionLog.open(
                p,
                KeyPair(pk, b""),
                fsync=FsyncPolicy.ALWAYS,
                config=config,
                fs=fs,
                replica=True,
            )
        )
        if fs.exists(os.path.join(p, EVIDENCE_FILE)):
            proven = check_evidence(p, lg.head_signer, fs.read_file)
            if proven:
                lg.frozen = proven
                log.error("%s: frozen: %s", p, proven)
            else:
                # what `verify` says too: a file that proves nothing (a fork change an
                # older version took for equivocation, a damaged file) freezes nothing
                log.warning("%s: %s proves no equivocation; not frozen", p, EVIDENCE_FILE)
        return lg

    # ------------------------------------------------------------------ the archive

    @property
    def path(self) -> str:
        return self.log.path

    @property
    def key(self) -> bytes:
        return self.log.key

    @property
    def public_key(self) -> bytes:
        return self.log.public_key

    @property
    def manifest(self) -> Manifest | None:
        """The manifest of a quorum-signed archive; None: a single signer's."""
        return self.log.manifest

    @property
    def head_signer(self) -> HeadSigner:
        """What heads are checked against (the manifest, else the writer's key)."""
        return self.log.head_signer

    @property
    def fork(self) -> int:
        return self.log.fork

    @property
    def head(self) -> Head | None:
        """The last stored head (signed by the writer)."""
        return self.log.head

    @property
    def length(self) -> int:
        """Blocks delivered (stored or not yet under a stored head)."""
        return self.log.length

    @property
    def high_watermark(self) -> int:
        return self.log.high_watermark

    @property
    def log_start_offset(self) -> int:
        return self.log.log_start_offset

    @property
    def log_end_offset(self) -> int:
        return self.log.log_end_offset

    def read(self, offset: int, max_bytes: int) -> FileRange:
        return self.log.read(offset, max_bytes)

    def node(self, index: int) -> Node | None:
        return self.log.node(index)

    def attach_handles(self, handles: HandleCache) -> None:
        self.log.attach_handles(handles)

    def close(self) -> None:
        """Close the archive; blocks past the last stored head are dropped."""
        self.log.close()

    # ------------------------------------------------------------------ sink side

    def discard_unsigned(self) -> None:
        """Drop blocks delivered past the last stored head (a session that ended before
        their head arrived); a new session fetches them again from `verified_tree()`."""
        self._holes = []
        self._deferred_head = None
        self.log.drop_unsigned_tail()

    @property
    def follow_fork(self) -> int:
        """The fork a replication session follows from `verified_tree()`: our head's, or a
        newer one that `check_conflict` found to extend it (the writer bumped its fork
        without dropping anything we hold, e.g. its recovery after a reboot)."""
        return self._next_fork if self._next_fork is not None else self.fork

    # ------------------------------------------------------- quorum-signed archives

    def sign_held(
        self, keypair: KeyPair, fork: int, length: int, tree_hash_: bytes
    ) -> PartialSignature:
        """As one of the signers of this quorum-signed archive, sign the head its leader
        proposes (`fork`, `length`, `tree_hash_`) over blocks this replica holds: those
        under its stored head and the ones delivered after it (`append_block`, not yet
        covered by a stored head). The blocks are made durable first, then the signing
        rule (storage/quorum.py) checks the tree against them and against what this
        replica signed before, and records the new head before the signature is
        returned. Raises RefusedToSign or StorageError.

        Not yet: a reopen still drops blocks past the stored head (as for any mirror),
        also the ones signed here, so until the leader's assembled head reaches this
        replica (`accept_head`) a crash loses them here; the signing record stays, and
        refuses any other history at those lengths in the fork. Keeping the signed
        tail across a reopen is the next step (docs/clusters.md, failover)."""
        lg = self.log
        manifest = lg.manifest
        if manifest is None or manifest == Manifest.default(lg.public_key):
            raise StorageError(f"{self.path}: not a quorum-signed archive")
        if self.frozen:
            raise Equivocation(f"{self.path}: archive frozen ({self.frozen})")
        lg.sync_unsigned_tail()  # the blocks it vouches for outlive a crash
        return sign_proposal(
            lg.fs, self.path, keypair, manifest, fork, length, tree_hash_, lg.held_tree_at
        )

    def promised_epoch(self) -> int:
        """The leader epoch this replica last promised a failover vote for (0: none)."""
        return read_promise(self.log.fs, self.path)

    @property
    def busy(self) -> bool:
        """Storing a head (an accept job in flight): `sign_held` cannot compute the tree
        of what it holds until that job is published."""
        return self.log.committing

    def vote(self, epoch: int) -> Vote:
        """A failover vote for leader epoch `epoch` (storage/quorum.py `promise`): this
        replica's longest head, after its promise never to sign an older fork is durable.
        Raises RefusedToPromise, or StorageError."""
        lg = self.log
        manifest = lg.manifest
        if manifest is None or manifest == Manifest.default(lg.public_key):
            raise StorageError(f"{self.path}: not a quorum-signed archive")
        lg.sync_unsigned_tail()  # what it answers as held outlives a crash
        h = lg.head
        stored = (h.fork, h.length, h.tree_hash) if h is not None else None
        return promise(lg.fs, self.path, epoch, stored, lg.held_tree_at)

    def verified_tree(self) -> Frontier:
        """The tree of the last accepted head (a replication follower's `have`)."""
        head = self.log.head
        return Frontier.from_roots(list(head.roots)) if head and head.length else Frontier()

    def append_block(
        self, index: int, value: bytes | bytearray | memoryview, leaf_hash: bytes
    ) -> None:
        """Store block `index` (the next one), which a replication session verified to hash
        to `leaf_hash` under a signed head. Invisible until `accept_head` covers it."""
        if self.frozen:
            raise Equivocation(f"{self.path}: archive frozen ({self.frozen})")
        lg = self.log
        lg.check_writable()
        if index != lg.length:
            raise StorageError(f"block {index} out of order (have {lg.length})")
        # The session hashed `value` to `leaf_hash` when it verified the proof, and these
        # very bytes are written (no offset or epoch is stamped into a replicated batch):
        # the index gets `leaf_hash`, and accept_head folds the delivered leaf hashes into
        # the tree and refuses to publish unless it is the signed one. Reads after a
        # reopen authenticate every batch against its leaf hash.
        size = len(value)
        if size < B.HEADER_SIZE or value[B.MAGIC_AT] != B.MAGIC:
            raise VerificationFailed(f"block {index} is not a record batch v2")
        if 12 + _BE_I32.unpack_from(value, B.BATCH_LENGTH)[0] != size:
            raise VerificationFailed(f"block {index}: batch length does not match its size")
        base = _BE_I64.unpack_from(value, B.BASE_OFFSET)[0]
        if base != lg.log_end_offset:
            raise VerificationFailed(
                f"block {index} starts at offset {base}, expected {lg.log_end_offset}"
            )
        delta = _BE_I32.unpack_from(value, B.LAST_OFFSET_DELTA)[0]
        if delta < 0:
            raise VerificationFailed(f"block {index}: negative lastOffsetDelta")
        max_ts = _BE_I64.unpack_from(value, B.MAX_TIMESTAMP)[0]
        lg.append_verified(value, base, delta, max_ts, leaf_hash)

    def reveal(self, length: int) -> bool:
        """Make blocks [0, `length`) readable (the high watermark moves) before the head
        over them is stored. Only for a caller that delivered them through `append_block`
        after a replication session verified each against a signed head of that length
        (`storage.replication` hands the head to its sink only then): every byte served is
        verified; what waits for `accept_head` is durability (the fsyncs and the head
        slot, several milliseconds on a busy disk, are then off the replication lag).
        After a crash before the head is stored the archive reopens at its last stored
        head and fetches the rest again. True when the high watermark moved."""
        lg = self.log
        if self.frozen or not lg.writable or not lg.published_length < length <= lg.length:
            return False
        offset = lg.offset_of_leaf(length)
        if offset <= lg.high_watermark:
            return False
        lg.high_watermark = offset
        return True

    def accept_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> bool:
        """Store and publish the writer's signed head over our first `length` blocks.
        True when the high watermark moved. Raises VerificationFailed (bad head),
        Equivocation (conflicting valid heads; frozen), StorageError (our own files do not
        reproduce the verified tree: the log is poisoned and must be reopened).
        `prepare_accept` + `run_accept` + `finish_accept` in a row."""
        job = self.prepare_accept(length, fork, signature, roots)
        if job is None:
            return False
        self.run_accept(job)
        return self.finish_accept(job)

    def prepare_accept(
        self, length: int, fork: int, signature: bytes, roots: Sequence[Node]
    ) -> AcceptJob | None:
        """Owner thread, cheap: check the head and snapshot the blocks it covers. None when
        it is not newer than ours. Blocks may keep arriving while the job runs."""
        if self.frozen:
            raise Equivocation(f"{self.path}: archive frozen ({self.frozen})")
        self.log.check_writable()
        roots = list(roots)
        if not self.check_conflict(length, fork, signature, roots):
            return None
        th = tree_hash(roots)
        if length <= self.log.length:
            self._next_fork = None
        job = self.log.prepare_signed(length, fork, signature, th)
        if job is None:  # pragma: no cover - new blocks always make a job
            return None
        return AcceptJob(job, length, th)

    def run_accept(self, aj: AcceptJob) -> None:
        """Any thread: fold the verified leaf hashes of the covered blocks into the tree,
        check it is the signed one, write index, tree nodes and the head slot, fsync.
        Raises StorageError (the log is poisoned) when they do not make the signed tree."""
        aj.ran = True
        aj.job.run()

    def finish_accept(self, aj: AcceptJob) -> bool:
        """Owner thread, after run_accept: publish (the high watermark moves; True). A job
        whose run failed is forgotten and StorageError raised (the log is poisoned then).
        A job never run (its caller was cancelled before the worker started; callers
        finish jobs in a `finally`) is forgotten without an error, so the caller's own
        exception goes on: nothing was written, the log is back at its last stored head
        and the blocks after it are fetched again (as after `discard_unsigned`); False."""
        lg = self.log
        if not aj.job.done:
            if aj.ran:
                lg.abandon(aj.job)
            else:
                # prepare_accept handed the covered blocks to the job (and may have folded
                # their leaves into our frontier already): back to the last stored head
                lg.withdraw(aj.job)
            head = lg.head
            lg.high_watermark = head.next_offset if head is not None else lg.log_start_offset
            if not aj.ran:
                return False
            raise StorageError(
                f"{self.path}: head at length {aj.length} was not stored"
            ) from aj.job.error
        revealed = lg.high_watermark
        lg.publish(aj.job)
        # a newer head may have been revealed meanwhile: never move readers back
        lg.high_watermark = max(lg.high_watermark, revealed)
        return True

    def check_conflict(
        self,
        length: int,
        fork: int,
        signature: bytes,
        roots: Sequence[Node],
        proof: Proof | None = None,
    ) -> bool:
        """Verify a head the writer signed against what we hold without storing it: raises
        VerificationFailed (bad signature, or a `proof` that does not verify),
        Equivocation (it disagrees with our head: evidence written, frozen) or
        ForkChanged (a newer fork). True when it is newer than our head (worth storing).

        A head longer than ours can only be held against ours with `proof`: an upgrade
        proof from 0 to our length plus the nodes up to that head (what
        `Connection.follow(..., probe_at=our length)` fetches). Without it a longer head
        is newer, and the replication session checks that it extends our tree."""
        if self.frozen:
            raise Equivocation(f"{self.path}: archive frozen ({self.frozen})")
        roots = list(roots)
        th = tree_hash(roots)
        if flat_tree.full_roots(2 * length) != [r.index for r in roots] or (
            length
            and not verify_signed_head(self.head_signer, self.key, th, length, fork, signature)
        ):
            raise VerificationFailed(f"{self.path}: head at length {length} does not verify")
        cur = self.log.head
        if cur is None or not cur.length:
            return length > 0
        if fork < cur.fork:
            return False  # a peer still on an older fork (Hypercore ignores it too)
        # Does the head keep our tree? None: not known here (longer, no proof).
        if length == cur.length:
            keeps: bool | None = th == cur.tree_hash
        elif length < cur.length:
            ours = [self.node(i) for i in flat_tree.full_roots(2 * length)]
            keeps = (
                None if any(n is None for n in ours) else tree_hash(cast(list[Node], ours)) == th
            )
        elif proof is not None:
            try:
                keeps = (
                    _tree_at(proof, self.head_signer, self.key, fork, length, th, cur.length)
                    == cur.tree_hash
                )
            except HypercoreError as e:
                raise VerificationFailed(
                    f"{self.path}: head at length {length}: bad proof of "
                    f"its tree at length {cur.length}: {e}"
                ) from e
        else:
            keeps = None  # the session that delivered it verified it extends our tree
        if fork > cur.fork:
            # A newer fork: the writer truncated (Hypercore's truncate, our writer's
            # recovery across a reboot), no equivocation. Followed when it keeps all we
            # hold (nothing to undo), else a reorg, which we do not do.
            if keeps is None and fork == self._next_fork and length > cur.length:
                return True  # the session verified it against our tree on that fork
            if keeps and length >= cur.length:
                if self._next_fork != fork:
                    log.warning(
                        "%s: the writer moved to fork %d keeping the %d blocks we hold",
                        self.path,
                        fork,
                        cur.length,
                    )
                self._next_fork = fork
                return length > cur.length
            self.reorg_needed = (
                f"the writer truncated its archive (fork {cur.fork} -> "
                f"{fork}, length {length}) below what we hold; a mirror does "
                f"not follow a reorg yet; serving the {cur.length} blocks "
                f"verified"
            )
            raise ForkChanged(f"{self.path}: {self.reorg_needed}")
        if keeps is False:
            if length == cur.length:
                why, evidence = f"two trees signed at length {length}", None
            elif length < cur.length:
                why = f"signed head at length {length} is not a prefix of ours"
                evidence = self._own_proof(cur, length)
            else:
                why = (
                    f"signed head at length {length} does not extend ours (its tree at "
                    f"length {cur.length} is another)"
                )
                evidence = proof
            self._equivocation(cur, length, fork, th, signature, roots, why, evidence)
        return length > cur.length

    def _own_proof(self, cur: Head, at: int) -> Proof | None:
        """Our signed head's upgrade proof from 0 to `at` blocks (evidence that its tree
        there is ours); None if a node it needs is not stored."""

        def get(index: int) -> Node:
            n = self.node(index)
            if n is None:
                raise KeyError(index)
            return n

        try:
            return generate_proof(
                get, cur.length, cur.fork, cur.signature, upgrade=UpgradeRequest(0, at)
            )
        except (KeyError, HypercoreError):
            return None

    def _equivocation(
        self,
        cur: Head,
        length: int,
        fork: int,
        th: bytes,
        signature: bytes,
        roots: Sequence[Node],
        why: str,
        proof: Proof | None = None,
    ) -> NoReturn:
        doc: dict[str, Any] = {
            "reason": why,
            "detected_ms": int(time.time() * 1000),
            "heads": [
                _head_json(cur.length, cur.fork, cur.tree_hash, cur.signature, cur.roots),
                _head_json(length, fork, th, signature, roots),
            ],
        }
        if proof is not None:
            # the longer head's tree at the shorter length, bound to its signature
            doc["proof"] = proof.encode().hex()
        self.log.fs.write_file_atomic(
            os.path.join(self.path, EVIDENCE_FILE), json.dumps(doc, indent=1).encode()
        )
        self.frozen = why
        log.error(
            "%s: EQUIVOCATION by the writer (%s); archive frozen, both heads kept in %s",
            self.path,
            why,
            EVIDENCE_FILE,
        )
        raise Equivocation(f"{self.path}: {why}")

    # ArchiveSink (storage.replication.sources): a replication follower delivers here.
    def put_block(self, index: int, value: bytes | memoryview, leaf: Node) -> None:
        lg = self.log
        stored = lg.head.length if lg.head is not None else 0
        if stored <= index < lg.length:
            # A quorum-signed archive's replica holds blocks its leader proposed (and it
            # signed) before their head reached it: the session now delivers them,
            # verified under that head. The same bytes are kept; other bytes replace the
            # unsigned tail (the verified block wins; the signing record still refuses
            # to sign another history within the fork).
            if lg.block(index) == bytes(value):
                return
            self.discard_unsigned()
        if self._holes:
            if len(value) < B.HEADER_SIZE:
                raise VerificationFailed(f"block {index} is not a record batch v2")
            self._write_holes(_BE_I64.unpack_from(value, B.BASE_OFFSET)[0])
        self.append_block(index, value, leaf.hash)
        deferred = self._deferred_head
        if deferred is not None and self.head_ready(deferred[0]):
            self._deferred_head = None
            self.accept_head(*deferred)

    def held_length(self) -> int:
        """Blocks held, under the stored head or delivered after it (a quorum-signed
        archive's replica: the ones its leader proposed)."""
        return self.log.length

    def holds_tree(self, start: int, length: int, roots: Sequence[Node]) -> bool:
        """Whether the blocks from `start` (the next one the follower would deliver) up to
        a verified head of `length` are held here already and, with the ones before,
        make that head's tree (`roots`): a replica that took them in proposals. The
        follower then fetches none of them and delivers the head alone; storing it
        checks the tree once more (`accept_head`). False when it cannot tell now (a head
        being stored): they are fetched as usual."""
        if self._holes or self.frozen or not start <= length <= self.log.length:
            return False
        return self.log.held_tree_at(length) == tree_hash(roots)

    def put_head(self, length: int, fork: int, signature: bytes, roots: Sequence[Node]) -> None:
        if not self.head_ready(length):
            self._deferred_head = (length, fork, signature, list(roots))
            return
        self.accept_head(length, fork, signature, roots)

    def put_removed(self, index: int, leaf: Node) -> None:
        """Block `index` is one the writer's cleaner removed (storage/FORMAT.md 4a): the
        session verified its leaf node (hash and byte size) against the signed tree and
        has no bytes for it. Recorded as the writer records it, a size-0 index entry with
        that leaf (section 10). A run of such blocks waits for the next block kept: its
        base offset says which offsets the run covered."""
        if self.frozen:
            raise Equivocation(f"{self.path}: archive frozen ({self.frozen})")
        self.log.check_writable()
        if index != self.log.length + len(self._holes):
            raise StorageError(f"block {index} out of order (have {self.log.length + len(self._holes)})")
        if leaf.index != 2 * index or leaf.size <= 0:
            raise VerificationFailed(f"block {index}: not its leaf node")
        self._holes.append((index, leaf))

    @property
    def holes_pending(self) -> bool:
        """Removed blocks were delivered that wait for the next block kept."""
        return bool(self._holes)

    def head_ready(self, length: int) -> bool:
        """Every block under a head of `length` is written (none waits in a run of removed
        blocks): the head can be revealed and stored."""
        return length <= self.log.length

    def _write_holes(self, next_base: int) -> None:
        """Write the waiting run of removed blocks, the block kept after it starting at
        offset `next_base`. The writer's split of the run's offsets among its blocks is
        gone with their bytes: each block but the last covers one offset, the last the
        rest (no record is served from any of them; section 10)."""
        lg = self.log
        holes, self._holes = self._holes, []
        start = lg.log_end_offset
        if next_base - start < len(holes):
            raise VerificationFailed(
                f"block {holes[-1][0] + 1} starts at offset {next_base}, but {len(holes)} "
                f"removed blocks lie between it and offset {start}")
        for n, (_, leaf) in enumerate(holes):
            delta = next_base - start - len(holes) if n == len(holes) - 1 else 0
            lg.append_removed(start + n, delta, leaf.hash, leaf.size)

    # ------------------------------------------------------------------ repair

    def bad_block(self) -> int | None:
        """The block of the first stored batch that failed authentication on read, if any."""
        return self.log.bad_block()

    def repair_block(self, index: int, value: bytes) -> None:
        """Overwrite stored block `index` with `value`, which a replication session verified
        against our signed head. The next read authenticates it again."""
        try:
            self.log.repair_block(index, value)
        except ValueError as e:
            raise VerificationFailed(str(e)) from e
        log.warning(
            "%s: block %d (offset %d) was damaged on disk; fetched again and verified",
            self.path,
            index,
            _BE_I64.unpack_from(value, B.BASE_OFFSET)[0],
        )

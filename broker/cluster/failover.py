"""Cluster mode: the failover vote of quorum-signed partitions (issue 17 item 3,
docs/clusters.md "Failover").

Owns the two messages of the vote (`VoteRequest`, `VoteAnswer`, on the
``hyperkafka/quorum`` channel next to proposals: types `VOTE_REQUEST`, `VOTE`), the
replica's side (`ReplicaVoter`: answers only the controller, through
`FollowerLog.vote`, which makes its promise durable first) and the controller's
(`elect`: asks the live replicas at once, each within its time; `choose_leader`: among
a majority of the manifest's signers, the replica with the longest head by (fork,
length), ties to the lowest broker id), and the leader epoch each partition's placement
records (`Placement.leaders`, `Placement.leader_epochs`, written by
`Membership.record_leader` in a transaction fenced by the controller's epoch and the
placement's revision).

A leader is lost when its lease is gone, and also when it registered again since the
vote that elected it (`leader_lost`: a restart, or a lease lost and taken again): it
may then no longer write in the epoch it was elected in (it may have appended past what
it stored, and replicas may have signed blocks it no longer holds), so it is voted
for again, as a candidate like the others (its copy is a replica's after its restart),
and leads, if elected, only in the new epoch.

Why a majority, as a Raft vote: an acknowledged write was signed by a quorum (a
majority) of the signers, each of which holds it durably and recorded it in `signed`;
any majority of voters holds one of them, whose vote is at least that head. And a
voter's promise (storage/quorum.py) makes it refuse to sign an older fork from then on,
so the deposed leader cannot complete a head once a majority voted.

Transport-agnostic (`Voters.vote` carries one request to one replica), as signing.py.
May import trio, `broker.cluster.*` and `storage`; never the protocol codec or the
handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import trio

from broker.cluster.membership import Membership, Placement
from broker.cluster.signing import MAX_REASON, MessageError, read_reason, read_sized
from storage.errors import StorageError
from storage.follower import FollowerLog
from storage.hypercore import Manifest
from storage.hypercore.encoding import Reader, encode_uint
from storage.hypercore.errors import DecodeError

log = logging.getLogger("hyperkafka.failover")

VOTE_REQUEST = 2  # message types on the hyperkafka/quorum channel (0, 1: signing.py)
VOTE = 3
VOTE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class VoteRequest:
    """Promise leader epoch `epoch` for archive `archive` and answer your head."""

    archive: bytes
    epoch: int

    def encode(self) -> bytes:
        return self.archive + encode_uint(self.epoch)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> VoteRequest:
        try:
            r = Reader(data)
            out = cls(r.fixed(32), r.uint())
            if r.remaining():
                raise MessageError("trailing bytes after a vote request")
        except DecodeError as exc:
            raise MessageError(f"undecodable vote request: {exc}") from None
        return out


@dataclass(frozen=True)
class VoteAnswer:
    """A replica's vote: its longest head (`fork`, `length`, `tree_hash`) under its
    promise of `epoch`, or none (`reason`)."""

    archive: bytes
    epoch: int
    fork: int = 0
    length: int = 0
    tree_hash: bytes = b""
    reason: str = ""

    @property
    def granted(self) -> bool:
        return not self.reason and len(self.tree_hash) == 32

    @property
    def rank(self) -> tuple[int, int]:
        return (self.fork, self.length)

    def encode(self) -> bytes:
        reason = self.reason.encode()[:MAX_REASON]
        th = self.tree_hash if len(self.tree_hash) == 32 else b""
        return b"".join([
            self.archive, encode_uint(self.epoch), encode_uint(self.fork),
            encode_uint(self.length), encode_uint(len(th)), th,
            encode_uint(len(reason)), reason,
        ])  # fmt: skip

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> VoteAnswer:
        try:
            r = Reader(data)
            archive, epoch, fork, length = r.fixed(32), r.uint(), r.uint(), r.uint()
            th = read_sized(r, 32, "a tree hash")
            reason = read_reason(r)
            if r.remaining():
                raise MessageError("trailing bytes after a vote")
        except DecodeError as exc:
            raise MessageError(f"undecodable vote: {exc}") from None
        return cls(archive, epoch, fork, length, th, reason)


# ----------------------------------------------------------------- the replica side


@dataclass
class ReplicaVoter:
    """A replica's side of the vote: `handle` one request (blocking: an fsync).

    `archive(key)`: this broker's copy of archive `key`, or None; `controller()`: the
    broker id of the current controller, or None (only it may ask: a vote is a promise
    that stops this replica signing for the partition's current leader)."""

    archive: Callable[[bytes], FollowerLog | None]
    controller: Callable[[], int | None]

    def handle(self, sender: int, req: VoteRequest) -> VoteAnswer:
        lg = self.archive(req.archive)
        if lg is None:
            return VoteAnswer(req.archive, req.epoch, reason="no copy of this archive here")
        if self.controller() != sender:
            return VoteAnswer(
                req.archive, req.epoch, reason=f"broker {sender} is not the controller"
            )
        try:
            v = lg.vote(req.epoch)
        except StorageError as exc:
            log.info("refused a vote for epoch %d of %s: %s", req.epoch, lg.path, exc)
            return VoteAnswer(req.archive, req.epoch, reason=str(exc))
        return VoteAnswer(req.archive, req.epoch, v.fork, v.length, v.tree_hash)


# ----------------------------------------------------------------- the controller side


class Voters(Protocol):
    """The transport: carry `request` to broker `node_id`, return its vote."""

    async def vote(self, node_id: int, request: VoteRequest) -> VoteAnswer: ...


@dataclass(frozen=True)
class Election:
    """The outcome of a vote: the new `leader`, its head, and every vote received."""

    leader: int
    epoch: int
    fork: int
    length: int
    votes: Mapping[int, VoteAnswer]


def majority(manifest: Manifest) -> int:
    """Votes an election needs: a majority of the signers. Any majority meets every
    quorum that signed an acknowledged head when the quorum itself is a majority (as
    partition_manifest makes it); a larger quorum is met all the more."""
    return len(manifest.signers) // 2 + 1


def choose_leader(votes: Mapping[int, VoteAnswer], need: int) -> int | None:
    """The broker whose granted vote has the longest head by (fork, length), ties to the
    lowest id; None when fewer than `need` votes were granted."""
    granted = {i: v for i, v in votes.items() if v.granted}
    if len(granted) < need:
        return None
    return min(granted, key=lambda i: (-granted[i].fork, -granted[i].length, i))


async def elect(
    archive: bytes,
    epoch: int,
    candidates: Sequence[int],
    need: int,
    voters: Voters,
    timeout_s: float = VOTE_TIMEOUT_S,
) -> Election | None:
    """Ask every broker of `candidates` (the partition's live replicas: a restarted
    leader among them, never one whose lease is gone) at once to vote for `epoch`, each
    within `timeout_s`; the Election once every one answered or the time is up, None
    when fewer than `need` granted."""
    votes: dict[int, VoteAnswer] = {}

    async def ask(node_id: int) -> None:
        with trio.move_on_after(timeout_s):
            try:
                a = await voters.vote(node_id, VoteRequest(archive, epoch))
            except (OSError, trio.BrokenResourceError, trio.BusyResourceError, MessageError) as exc:
                log.info("broker %d did not answer a vote: %s", node_id, exc)
                return
            if a.archive == archive and a.epoch == epoch:
                votes[node_id] = a
            if not a.granted:
                log.info("broker %d refused a vote for epoch %d: %s", node_id, epoch, a.reason)

    async with trio.open_nursery() as nursery:
        for c in dict.fromkeys(candidates):
            nursery.start_soon(ask, c)
    leader = choose_leader(votes, need)
    if leader is None:
        return None
    v = votes[leader]
    return Election(leader, epoch, v.fork, v.length, votes)


def restarted(membership: Membership, placement: Placement, index: int) -> bool:
    """Whether the leader a vote elected for partition `index` (epoch >= 1) registered
    in etcd again since that vote (its session is not the one the placement recorded).
    False when either session is not known."""
    recorded = placement.session_of(index)
    if placement.epoch_of(index) < 1 or not recorded:
        return False
    now = membership.sessions.get(placement.leader_of(index), 0)
    return now != 0 and now != recorded


def leader_lost(
    membership: Membership, alive: Callable[[int], bool], placement: Placement, index: int
) -> bool:
    """Whether partition `index`'s leader must be failed over: its lease is gone, or
    it restarted since the vote that elected it (`restarted`)."""
    return not alive(placement.leader_of(index)) or restarted(membership, placement, index)


async def fail_over(
    membership: Membership,
    alive: Callable[[int], bool],
    topic: str,
    index: int,
    manifest: Manifest,
    voters: Voters,
    timeout_s: float = VOTE_TIMEOUT_S,
) -> Election | None:
    """The controller's failover of partition `index` of quorum-signed topic `topic`
    (archive manifest `manifest`) once its leader's lease is gone (`alive` is the
    cluster's lease view): a vote among its live replicas for the next leader epoch,
    then the winner and the epoch recorded in the placement, fenced by this controller's
    epoch. None when there is nothing to do (not the controller, the leader is alive, no
    such partition) or it could not be done now (no majority answered, the placement
    changed meanwhile): the caller tries again later.

    The epoch is the placement's next one, or past the fork of the longest head voted
    (a deposed leader's recovery may have moved its fork on, FORMAT.md section 8 case
    9): it is asked again then, so the new fork is always newer than every head kept."""
    if not membership.is_controller:
        return None
    placement = membership.placements.get(topic)
    if placement is None or not 0 <= index < len(placement.replicas):
        return None
    leader = placement.leader_of(index)
    if not leader_lost(membership, alive, placement, index):
        return None
    # A restarted leader votes as any replica (its copy holds what it stored); one whose
    # lease is gone cannot.
    candidates = [r for r in placement.replicas[index] if alive(r)]
    epoch = placement.epoch_of(index) + 1
    for _ in range(2):
        e = await elect(manifest.hash(), epoch, candidates, majority(manifest), voters, timeout_s)
        if e is None:
            log.info("failover of %s-%d: no majority of %s voted", topic, index, candidates)
            return None
        if e.fork < epoch:
            break
        epoch = e.fork + 1
    else:
        return None
    session = membership.sessions.get(e.leader, 0)
    if not await membership.record_leader(topic, index, e.leader, epoch, session):
        return None
    log.warning(
        "failover of %s-%d: broker %d leads it in epoch %d from length %d (leader %d %s)",
        topic, index, e.leader, epoch, e.length, leader,
        "restarted" if alive(leader) else "lost",
    )  # fmt: skip
    return e

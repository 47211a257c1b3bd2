"""The follower's catch-up fast path: short block proofs (`block_nodes`), verification up
to a node an earlier answer proved, answers that arrive before the one proving them, and
resumes from every prefix length (where upgrades move the roots and short proofs may
need a full-path retry)."""

from __future__ import annotations

from typing import Any

import pytest

from storage.hypercore import KeyPair
from storage.hypercore.proofs import max_missing_nodes
from storage.replication import MemoryArchive, ReplicationSession, VerificationError
from storage.replication.follow import block_nodes

KP = KeyPair.from_seed(bytes([5]) * 32)


def _archive(n: int) -> MemoryArchive:
    a = MemoryArchive.create(KP)
    if n:
        a.append(*[bytes([i % 256]) * (30 + i % 17) for i in range(n)])
    return a


def _pump(a: ReplicationSession, b: ReplicationSession) -> None:
    for _ in range(100_000):
        da, db = a.data_to_send(), b.data_to_send()
        if not da and not db:
            return
        if da:
            b.receive_data(da)
        if db:
            a.receive_data(db)
    raise AssertionError("sessions did not go quiet")


def _follow(src: MemoryArchive, sink: MemoryArchive, **kw: object) -> ReplicationSession:
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, sink, **kw)  # type: ignore[arg-type]
    _pump(client, server)
    return client


def test_block_nodes_is_short_and_never_past_a_root() -> None:
    for length in range(1, 80):
        for i in range(length):
            n = block_nodes(i, length)
            assert 0 <= n <= max_missing_nodes(2 * i, length)
            if i % 2 and i + 1 < length:
                assert n == 0  # odd blocks: the earlier even block's proof carried the leaf
    assert block_nodes(0, 1 << 20) == 20 and block_nodes(1 << 19, 1 << 20) == 19


def test_catch_up_reads_about_one_node_per_block() -> None:
    src = _archive(300)
    reads = 0
    node = src.node

    def counting(index: int):  # type: ignore[no-untyped-def]
        nonlocal reads
        reads += 1
        return node(index)

    src.node = counting  # type: ignore[method-assign]
    sink = MemoryArchive(KP.public_key)
    client = _follow(src, sink, window=32)
    assert client.done and sink.blocks == src.blocks and sink.heads[-1] == src.head()
    # full sibling paths would be ~8 per block here; short ones are ~1, plus the upgrade
    assert reads < 2 * 300


@pytest.mark.parametrize("window", [1, 5, 128])
def test_resume_from_every_prefix(window: int) -> None:
    full = _archive(70)
    retries = 0
    for start in range(0, 70, 3):
        prefix = _archive(start)
        sink = MemoryArchive(KP.public_key)
        if start:
            _follow(prefix, sink, window=window)
        have = sink.frontier.copy() if start else None
        client = _follow(full, sink, window=window, have=have)
        assert client.done and sink.blocks == full.blocks, start
        assert sink.heads[-1] == full.head()
        retries += client.role.retries  # type: ignore[attr-defined]
    print(f"full-path retries after resumes (window {window}): {retries}")


def test_answers_out_of_order_wait_for_the_answer_that_proves_them() -> None:
    src = _archive(200)
    sink = MemoryArchive(KP.public_key)
    server = ReplicationSession.serve(src)
    client = ReplicationSession.follow(src.key, sink, window=16)
    role = client.role
    orig = role.take_block  # type: ignore[attr-defined]
    held: list[tuple[Any, ...]] = []

    def reorder(s: ReplicationSession, *block: Any) -> bool:
        # hold back block answers and hand them over newest first, four at a time
        held.append(block)
        if len(held) == 4:
            for x in reversed(held):
                assert orig(s, *x)
            held.clear()
        return True

    role.take_block = reorder  # type: ignore[attr-defined]
    for _ in range(1000):
        _pump(client, server)
        if not held:
            break
        for x in reversed(held):  # the tail of the window
            assert orig(client, *x)
        held.clear()
    assert sink.blocks == src.blocks and sink.heads[-1] == src.head()
    assert client.done and role.stalls > 0  # type: ignore[attr-defined]


class _Swapped(MemoryArchive):
    """Serves block 6 where block 7 belongs: a valid leaf, in the wrong place."""

    def block(self, index: int) -> bytes:
        return super().block(6 if index == 7 else index)


def test_a_block_proved_only_by_an_earlier_proof_is_still_checked() -> None:
    src = _Swapped.create(KP)
    src.append(*[bytes([i]) * 40 for i in range(12)])
    assert block_nodes(7, 12) == 0  # block 7's answer carries no nodes at all
    with pytest.raises(VerificationError):
        _follow(src, MemoryArchive(KP.public_key))


def test_a_short_answer_nothing_can_prove_is_asked_again_with_the_full_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from storage.replication.follow import Follower

    def forgetful_prune(self: Follower) -> None:  # keep only the trusted roots
        self.known = {r.index: r for r in self.trusted.roots()}

    orig_deliver = Follower._deliver

    def deliver(self: Follower) -> None:
        orig_deliver(self)
        forgetful_prune(self)

    monkeypatch.setattr(Follower, "_deliver", deliver)
    src = _archive(40)
    sink = MemoryArchive(KP.public_key)
    client = _follow(src, sink, window=1)
    assert client.done and sink.blocks == src.blocks
    assert client.role.retries > 0  # type: ignore[attr-defined]

"""broker.mirror's sink of an archive whose writer's cleaner removed blocks (storage/
FORMAT.md section 10): a head over a run of removed blocks is neither revealed nor
stored until the next block kept says which offsets the run covered."""

from __future__ import annotations

from pathlib import Path

from broker.cleaner import keys_of
from broker.mirror import _Sink
from storage import LogConfig
from storage.batch import build_batch
from storage.compaction import CompactionPolicy, clean
from storage.follower import FollowerLog
from storage.hypercore import KeyPair, Manifest, Node, flat_tree, sign_head
from storage.log import FsyncPolicy, PartitionLog
from storage.replication import PartitionLogSource, ReplicationSession
from storage.replication.sources import SignedHead

KP = KeyPair.from_seed(bytes([9]) * 32)
NOW = 1_700_000_000_000
DAY = 86_400_000


class _At:
    """The writer's archive, announcing `head` (an older one, or its newest)."""

    def __init__(self, log: PartitionLog, head: SignedHead) -> None:
        self.src = PartitionLogSource(log)
        self.at = head

    @property
    def key(self) -> bytes:
        return self.src.key

    @property
    def manifest(self) -> Manifest:
        return self.src.manifest

    def head(self) -> SignedHead:
        return self.at

    def node(self, index: int) -> Node | None:
        return self.src.node(index)

    def block(self, index: int) -> bytes:
        return self.src.block(index)


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


def _records(lg: PartitionLog) -> bytes:
    out, off = b"", lg.log_start_offset
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 20)
        out += r.read()
        off = r.end_offset
    return out


async def test_a_head_over_removed_blocks_waits_for_the_next_block_kept(tmp_path: Path) -> None:
    w = PartitionLog.open(tmp_path / "w", KP, fsync=FsyncPolicy.ALWAYS,
                          config=LogConfig(segment_bytes=400, retention_ms=-1))
    for i in range(60):
        w.append(build_batch([b"v%d" % i, b"w%d" % i], keys=[b"k%d" % (i % 4)] * 2, timestamp_ms=NOW))
    w.commit()
    assert clean(w, keys_of, CompactionPolicy(delete_retention_ms=DAY), NOW) is not None

    def gone(i: int) -> bool:
        try:
            w.block(i)
        except KeyError:
            return True
        return False

    # an older head whose last blocks were removed (the writer signed one there once)
    at = next(n for n in range(w.length - 1, 1, -1) if gone(n - 1) and gone(n - 2) and not gone(n))
    roots = [w.node(i) for i in flat_tree.full_roots(2 * at)]
    assert all(r is not None for r in roots)
    older = _At(w, SignedHead(at, 0, sign_head(KP, w.key, [r for r in roots if r is not None], at, 0)))

    f = FollowerLog.open_replica(tmp_path / "m", KP.public_key)
    moved: list[int] = []
    sink = _Sink(f, lambda: moved.append(f.high_watermark))
    server = ReplicationSession.serve(older)
    client = ReplicationSession.follow(w.key, sink, initiator=True, live=True, have=f.verified_tree())
    _pump(client, server)
    # every block under the head was verified, but its last ones are a run of removed
    # blocks whose offsets are not known yet: nothing revealed, nothing to store
    assert f.length < at and f.holes_pending and sink.heads == [] and f.high_watermark == 0
    older.at = PartitionLogSource(w).head()
    server.notify_append()
    _pump(client, server)
    await sink.store_heads()
    head, wh = f.head, w.head
    assert head is not None and wh is not None
    assert (head.length, head.tree_hash, head.signature) == (wh.length, wh.tree_hash, wh.signature)
    assert f.high_watermark == w.high_watermark and moved
    assert _records(f.log) == _records(w)
    f.close()
    w.close()

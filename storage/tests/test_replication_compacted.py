"""A mirror of a compacted archive (FORMAT.md sections 4a and 10): the writer answers a
request for a block its cleaner removed with `no-data`, the follower then asks for the
block's leaf node (a Hypercore `hash` request, proven against the signed tree) and
records the hole as the writer does; every later block and head still verifies."""

from __future__ import annotations

import contextlib
from pathlib import Path

from storage_testutil import KEYPAIR
from test_compaction import NOW, POLICY, append, keys_of, open_log, read_all, records_of
from test_replication_interop import PEER, _require_node

from storage import PartitionLog
from storage.compaction import clean
from storage.follower import FollowerLog
from storage.log import Head
from storage.replication import (
    MemoryArchive,
    PartitionLogSource,
    RemoteProtocolError,
    ReplicationSession,
)
from storage.replication.trio_driver import serve_archive
from storage.verify import verify_partition


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


def _compacted_writer(path: Path) -> tuple[PartitionLog, int]:
    lg = open_log(path)
    for i in range(90):
        # two records a batch, so a run of removed blocks spans several offsets each
        append(lg, [(b"k%d" % (i % 5), b"v%d" % i), (b"k%d" % ((i + 1) % 5), b"w%d" % i)])
        if i % 10 == 9:
            lg.commit()
    lg.commit()
    res = clean(lg, keys_of, POLICY, NOW)
    assert res is not None and res.removed_blocks > 20
    return lg, res.removed_blocks


def test_a_new_mirror_of_a_compacted_archive_holds_the_compacted_view(tmp_path: Path) -> None:
    w, removed = _compacted_writer(tmp_path / "w")
    f = FollowerLog.open_replica(tmp_path / "m", KEYPAIR.public_key)
    server = ReplicationSession.serve(PartitionLogSource(w))
    client = ReplicationSession.follow(w.key, f, initiator=True, live=True,
                                       have=f.verified_tree())
    _pump(client, server)
    assert _signed(f.head) == _signed(w.head)
    assert f.high_watermark == w.high_watermark
    # the same records at the same offsets as the writer serves
    assert records_of(read_all(f.log)) == records_of(read_all(w))
    # a fetch from an offset in a removed block starts at the next batch kept, as on the writer
    for off in range(0, 40):
        assert f.read(off, 1 << 20).base_offset == w.read(off, 1 << 20).base_offset
    # the writer goes on after the clean: the mirror follows, heads still verify
    append(w, [(b"k0", b"after")])
    w.commit()
    server.notify_append()
    _pump(client, server)
    assert _signed(f.head) == _signed(w.head)
    assert records_of(read_all(f.log)) == records_of(read_all(w))
    assert server.stats.invalid_requests == 0
    f.close()
    v = verify_partition(str(tmp_path / "m"), KEYPAIR.public_key)
    assert v.ok and v.compacted == removed, v
    # reopened, the mirror serves the same and resumes from its stored head
    f = FollowerLog.open_replica(tmp_path / "m", KEYPAIR.public_key)
    assert records_of(read_all(f.log)) == records_of(read_all(w))
    f.close()
    w.close()


def test_a_sink_that_takes_no_holes_is_refused_no_data_not_a_wrong_block(tmp_path: Path) -> None:
    """A peer that does not know removed blocks (as a stock Hypercore follower that insists
    on every block) gets `no-data` for them: no block is made up, the server stays up."""
    w, _ = _compacted_writer(tmp_path / "w")
    sink = MemoryArchive(KEYPAIR.public_key)
    server = ReplicationSession.serve(PartitionLogSource(w))
    client = ReplicationSession.follow(w.key, sink, initiator=True)
    with contextlib.suppress(RemoteProtocolError):
        _pump(client, server)
    # blocks before the first removed one were delivered, each verified; none after it
    first_gone = next(i for i in range(w.length) if _gone(w, i))
    assert len(sink.blocks) == first_gone
    assert server.stats.invalid_requests == 0
    w.close()


def _gone(lg: PartitionLog, i: int) -> bool:
    try:
        lg.block(i)
    except KeyError:
        return True
    return False


def _signed(head: Head | None) -> tuple[object, ...]:
    assert head is not None
    return (head.length, head.fork, head.tree_hash, head.signature, head.next_offset)


async def test_a_stock_hypercore_peer_gets_every_kept_block_and_no_removed_one(tmp_path: Path) -> None:
    """npm hypercore 11 replicating a compacted archive from us, downloading the whole
    range in parallel: every block we hold arrives and verifies (we announce the removed
    runs as dropped ranges, so it never asks for them and never backs off from us until it
    pauses); a removed one it insists on never arrives; no invalid request is counted."""
    import hashlib
    import json

    import trio

    node = _require_node()
    w, _ = _compacted_writer(tmp_path / "w")
    held = [i for i in range(w.length) if not _gone(w, i)]
    removed = next(i for i in range(w.length) if _gone(w, i))
    sha = hashlib.sha256(b"".join(w.block(i) for i in held)).hexdigest()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    served: list[int] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def serve_one() -> None:
                stream = await listeners[0].accept()
                stats = await serve_archive(stream, PartitionLogSource(w))
                served.append(stats.invalid_requests)

            nursery.start_soon(serve_one)
            proc = await trio.run_process(
                [node, str(PEER), "fetch-some", str(port), w.key.hex(), str(w.length),
                 ",".join(map(str, held)), sha, str(removed)],
                capture_stdout=True, capture_stderr=True, check=False,
            )
            assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()
            result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            assert result["ok"] and result["removed"] == "REQUEST_TIMEOUT", result
    assert served == [0]
    for listener in listeners:
        await listener.aclose()
    w.close()


def test_a_mirror_live_during_the_clean_keeps_its_copy_and_one_resuming_after_it_gets_holes(
        tmp_path: Path) -> None:
    """Mirror A followed the whole archive before the writer's clean: it keeps every block
    (mirrors do not compact) and follows what comes after. Mirror B had the first half:
    resuming after the clean it keeps that half whole and records the removed blocks of
    the rest as holes. Both verify, both read the writer's last value of every key."""
    lg = open_log(tmp_path / "w")
    for i in range(90):
        append(lg, [(b"k%d" % (i % 5), b"v%d" % i)])
        if i % 10 == 9:
            lg.commit()
        if i == 44:
            lg.commit()
            half = FollowerLog.open_replica(tmp_path / "b", KEYPAIR.public_key)
            _pump(ReplicationSession.follow(lg.key, half, initiator=True, have=half.verified_tree()),
                  ReplicationSession.serve(PartitionLogSource(lg)))
            assert half.length == 45
    lg.commit()
    full = FollowerLog.open_replica(tmp_path / "a", KEYPAIR.public_key)
    _pump(ReplicationSession.follow(lg.key, full, initiator=True, have=full.verified_tree()),
          ReplicationSession.serve(PartitionLogSource(lg)))
    everything = records_of(read_all(lg))
    res = clean(lg, keys_of, POLICY, NOW)
    assert res is not None and res.removed_blocks > 40
    append(lg, [(b"k0", b"after")])
    lg.commit()
    for f in (full, half):
        _pump(ReplicationSession.follow(lg.key, f, initiator=True, have=f.verified_tree()),
              ReplicationSession.serve(PartitionLogSource(lg)))
        assert _signed(f.head) == _signed(lg.head)
    after = records_of(read_all(lg))
    assert records_of(read_all(full.log)) == everything + after[-1:]
    got = records_of(read_all(half.log))
    assert got[:45] == everything[:45] and got[45:] == [r for r in after if r[0] >= 45]
    assert {k: v for _, k, v in got} == {k: v for _, k, v in after}
    for name, f, compacted in (("a", full, 0), ("b", half, None)):
        f.close()
        v = verify_partition(str(tmp_path / name), KEYPAIR.public_key)
        assert v.ok and (v.compacted == compacted if compacted is not None else v.compacted > 0), v
    lg.close()

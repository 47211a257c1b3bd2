"""Quorum-signed (multisig) archives over the Hypercore replication protocol.

Python to Python (sans-I/O): a follower that knows only the archive key learns the
manifest, verifies it hashes to the key, and checks every head against the quorum; a
head with fewer signers than the quorum, or signed by a non-signer, is refused.
Against the stock npm hypercore 11.39.5 (storage/tests/interop): Node fetches and
verifies a quorum-signed archive our server serves, and our follower replicates and
verifies one Node wrote (signed by its own verifier.sign + lib/multisig.js assemble).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from functools import partial
from pathlib import Path

import pytest
import trio

from storage.fs import OsFileSystem
from storage.hypercore import KeyPair, Manifest, signable
from storage.hypercore.multisig import (
    PartialSignature,
    assemble,
    assemble_quorum,
    multisig_manifest,
    sign_partial,
    verify_manifest_head,
)
from storage.log import FsyncPolicy, PartitionLog
from storage.manifest_file import write_manifest
from storage.replication import (
    MemoryArchive,
    PartitionLogSource,
    ReplicationSession,
    SignedHead,
    VerificationError,
)
from storage.replication.trio_driver import follow_archive, serve_archive
from storage.tests.storage_testutil import make_batch
from storage.tests.test_replication_interop import PEER, _blocks, _require_node
from storage.tests.test_replication_session import _pump

KPS = [KeyPair.from_seed(bytes([0x31 + i]) * 32) for i in range(3)]
MANIFEST = multisig_manifest([kp.public_key for kp in KPS])  # quorum 2


def _archive(n: int, signers: list[KeyPair] | None = None) -> MemoryArchive:
    a = MemoryArchive.create_multisig(MANIFEST, KPS[:2] if signers is None else signers)
    for i in range(0, n, 7):
        a.append(*[b"block %d" % j * 3 for j in range(i, min(n, i + 7))])
    return a


def _follow(src: MemoryArchive) -> tuple[ReplicationSession, MemoryArchive]:
    sink = MemoryArchive(MANIFEST)
    server = ReplicationSession.serve(src, initiator=False)
    client = ReplicationSession.follow(MANIFEST.hash(), sink, initiator=True)
    _pump(client, server)
    return client, sink


def test_follower_learns_the_manifest_and_checks_the_quorum() -> None:
    src = _archive(30)
    client, sink = _follow(src)
    assert client.done and client.public_key == MANIFEST
    assert sink.blocks == src.blocks and sink.heads[-1] == src.head()
    h = sink.heads[-1]
    assert verify_manifest_head(
        MANIFEST, src.key, sink.frontier.roots(), h.length, h.fork, h.signature
    )


def test_single_signer_archives_still_learn_a_bare_key() -> None:
    src = MemoryArchive.create(KPS[0])
    src.append(b"x")
    sink = MemoryArchive(KPS[0].public_key)
    server = ReplicationSession.serve(src, initiator=False)
    client = ReplicationSession.follow(src.key, sink, initiator=True)
    _pump(client, server)
    assert client.public_key == KPS[0].public_key  # bytes, as before multisig existed


class _Rewritten(MemoryArchive):
    """Serves each head with the signature `forge` makes for it."""

    forge: staticmethod  # type: ignore[type-arg]

    def head(self) -> SignedHead:
        h = super().head()
        msg = signable(self.key, self.frontier.tree_hash(), h.length, h.fork)
        return dataclasses.replace(h, signature=type(self).forge(msg, self.frontier))


def _hostile(forge: object) -> MemoryArchive:
    cls = type("_H", (_Rewritten,), {"forge": staticmethod(forge)})  # type: ignore[arg-type]
    a: MemoryArchive = cls.create_multisig(MANIFEST, KPS[:2])
    a.append(b"a", b"b", b"c")
    return a


def _one(msg: bytes, f: object) -> bytes:
    from storage.hypercore import sign_raw

    return assemble([PartialSignature(0, sign_raw(KPS[0], msg))])


def _dup(msg: bytes, f: object) -> bytes:
    from storage.hypercore import sign_raw

    p = PartialSignature(1, sign_raw(KPS[1], msg))
    return assemble([p, p])


def _outsider(msg: bytes, f: object) -> bytes:
    from storage.hypercore import sign_raw

    out = KeyPair.from_seed(b"\x77" * 32)
    return assemble(
        [PartialSignature(0, sign_raw(KPS[0], msg)), PartialSignature(2, sign_raw(out, msg))]
    )


@pytest.mark.parametrize(
    "forge", [_one, _dup, _outsider], ids=["below-quorum", "duplicate", "non-signer"]
)
def test_follower_refuses_heads_without_a_quorum(forge: object) -> None:
    with pytest.raises(VerificationError, match="signature"):
        _follow(_hostile(forge))


class _PatchManifest(MemoryArchive):
    @property
    def manifest(self) -> Manifest:
        return dataclasses.replace(MANIFEST, allow_patch=True)


def test_follower_refuses_a_manifest_for_another_key() -> None:
    src = _PatchManifest.create_multisig(MANIFEST, KPS[:2])
    src.append(b"a")
    with pytest.raises(VerificationError, match="manifest"):
        _follow(src)


def test_create_multisig_needs_a_quorum_of_signers() -> None:
    with pytest.raises(ValueError, match="quorum"):
        _archive(1, KPS[:1])


async def test_node_replicates_a_quorum_signed_archive_from_python() -> None:
    node = _require_node()
    n = 75
    src = MemoryArchive.create_multisig(MANIFEST, [KPS[2], KPS[0]])
    blocks = _blocks(n, 700)
    for i in range(0, n, 20):
        src.append(*blocks[i : i + 20])
    sha = hashlib.sha256(b"".join(blocks)).hexdigest()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def serve_one() -> None:
                stream = await listeners[0].accept()
                await serve_archive(stream, src)

            nursery.start_soon(serve_one)
            proc = await trio.run_process(
                [node, str(PEER), "fetch", str(port), src.key.hex(), str(n), sha],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()
            result = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            assert result["ok"] is True and result["length"] == n
    for listener in listeners:
        await listener.aclose()


async def test_python_follows_a_quorum_signed_node_core() -> None:
    node = _require_node()
    n = 40
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                partial(
                    trio.run_process,
                    [node, str(PEER), "serve-multisig", str(n), "300", str(0x31), "3", "2,0"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    check=False,
                )
            )
            assert proc.stdout is not None and proc.stdin is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "node peer exited before listening"
                line += chunk
            info = json.loads(line)
            # Node's manifest for these keys is byte-identical to the one we build
            assert bytes.fromhex(info["manifest"]) == MANIFEST.encode()
            assert info["key"] == MANIFEST.hash().hex() and info["quorum"] == 2
            sink = MemoryArchive(MANIFEST)
            stream = await trio.open_tcp_stream("127.0.0.1", info["port"])
            stats = await follow_archive(stream, MANIFEST.hash(), sink)
            await proc.stdin.aclose()
    assert proc.returncode == 0
    assert stats.blocks == n == len(sink.blocks) == info["length"]
    assert hashlib.sha256(b"".join(sink.blocks)).hexdigest() == info["sha256"]
    h = sink.heads[-1]
    assert verify_manifest_head(
        MANIFEST, MANIFEST.hash(), sink.frontier.roots(), h.length, 0, h.signature
    )
    # the head Node assembled names signers 2 then 0, exactly as asked
    parts = [sign_partial(KPS[i], MANIFEST, sink.frontier.roots(), n, 0) for i in (2, 0)]
    assert h.signature == assemble(parts)


async def test_node_replicates_a_quorum_signed_partition_log(tmp_path: Path) -> None:
    """A partition archive on disk, quorum-signed (manifest file, heads assembled from
    two of three signers), served from its files: stock hypercore verifies every block."""
    node = _require_node()
    path = tmp_path / "p"
    path.mkdir()
    write_manifest(OsFileSystem(), str(path), MANIFEST)
    lg = PartitionLog.open(path, KPS[0], fsync=FsyncPolicy.NEVER)
    lg.quorum_sign = lambda th, n, f: assemble_quorum(
        MANIFEST, [sign_partial(kp, MANIFEST, th, n, f) for kp in KPS[:2]]
    )
    for i in range(30):
        lg.append(make_batch(2, 30, ts=1000 + i, seed=i))
        if i % 9 == 8:
            lg.commit()
    lg.commit()
    n = lg.head.length if lg.head else 0
    blocks = [lg.block(i) for i in range(n)]
    sha = hashlib.sha256(b"".join(blocks)).hexdigest()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def serve_one() -> None:
                stream = await listeners[0].accept()
                await serve_archive(stream, PartitionLogSource(lg))

            nursery.start_soon(serve_one)
            proc = await trio.run_process(
                [node, str(PEER), "fetch", str(port), lg.key.hex(), str(n), sha],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert proc.returncode == 0, proc.stderr.decode() + proc.stdout.decode()
    for listener in listeners:
        await listener.aclose()
    lg.close()
    assert n == 30 and lg.key == MANIFEST.hash()

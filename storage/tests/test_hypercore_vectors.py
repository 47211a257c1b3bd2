"""Reproduce, byte for byte, the golden vectors made by the real npm `hypercore`.

`vectors/hypercore_vectors.json` is written by `vectors/gen.mjs` (hypercore 11.39.5,
pinned in `vectors/package-lock.json`). The first tests rebuild every key, manifest,
head, signature and proof from Python alone. The last one re-runs the generator when
`vectors/node_modules` exists and checks that it still writes the committed file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from storage.hypercore import (
    Frontier,
    KeyPair,
    Manifest,
    Node,
    archive_key,
    discovery_key,
    sign_head,
    verify_head,
)
from storage.hypercore.proofs import (
    BlockProof,
    BlockRequest,
    HashProof,
    HashRequest,
    Proof,
    UpgradeProof,
    UpgradeRequest,
    generate_proof,
    max_missing_nodes,
    roots_at,
    verify_proof,
)

VECTORS_DIR = Path(__file__).parent / "vectors"
VECTORS_FILE = VECTORS_DIR / "hypercore_vectors.json"
DOC: dict[str, Any] = json.loads(VECTORS_FILE.read_text())
CORES: list[dict[str, Any]] = DOC["cores"]


def _blocks(spec: dict[str, Any]) -> list[bytes]:
    if "hex" in spec:
        return [bytes.fromhex(h) for h in spec["hex"]]
    rule = spec["rule"]
    salt = rule["salt"]
    return [bytes((salt + 7 * j + k) % 256 for k in range(n)) for j, n in enumerate(rule["sizes"])]


def _node(d: dict[str, Any]) -> Node:
    return Node(d["index"], d["size"], bytes.fromhex(d["hash"]))


def _nodes(ds: list[dict[str, Any]]) -> tuple[Node, ...]:
    return tuple(_node(d) for d in ds)


def _proof(d: dict[str, Any]) -> Proof:
    b, h, u = d["block"], d["hash"], d["upgrade"]
    return Proof(
        fork=d["fork"],
        block=BlockProof(b["index"], bytes.fromhex(b["value"]), _nodes(b["nodes"])) if b else None,
        hash=HashProof(h["index"], _nodes(h["nodes"])) if h else None,
        upgrade=UpgradeProof(
            u["start"],
            u["length"],
            _nodes(u["nodes"]),
            _nodes(u["additionalNodes"]),
            bytes.fromhex(u["signature"]) if u["signature"] else None,
        )
        if u
        else None,
    )


class Replay:
    """Replays a core's appends/truncations into a node store, as storage-log would."""

    def __init__(self, core: dict[str, Any]) -> None:
        self.core = core
        self.kp = KeyPair.from_seed(bytes.fromhex(core["seed"]))
        self.key = archive_key(self.kp.public_key)
        self.blocks = _blocks(core["blocks"])
        self.store: dict[int, Node] = {}
        self.frontier = Frontier()
        self.fork = 0
        self.signature = b""
        self.heads: list[tuple[Frontier, int, bytes]] = []
        nxt = 0
        for op in core["ops"]:
            if "append" in op:
                for _ in range(op["append"]):
                    for n in self.frontier.append_data(self.blocks[nxt]):
                        self.store[n.index] = n
                    nxt += 1
                    self._sign()
            else:
                nxt = op["truncate"]
                # Hypercore bumps the fork on truncate and re-signs the shorter tree.
                self.fork += 1
                self.frontier = Frontier.from_roots(roots_at(self.store.__getitem__, nxt))
                self._sign()

    def _sign(self) -> None:
        f = self.frontier
        self.signature = sign_head(self.kp, self.key, f.roots(), f.length, self.fork)
        self.heads.append((f.copy(), self.fork, self.signature))


@pytest.fixture(scope="module", params=[c["name"] for c in CORES])
def replay(request: pytest.FixtureRequest) -> Replay:
    return Replay(next(c for c in CORES if c["name"] == request.param))


def test_vectors_cover_the_brief() -> None:
    assert DOC["generator"]["hypercore"] == "11.39.5"
    lengths = {c["heads"][-1]["length"] for c in CORES}
    assert {1, 2, 3, 5, 8, 13, 100}.issubset(lengths)
    assert any(h["fork"] > 0 for c in CORES for h in c["heads"])
    assert sum(len(c["proofs"]) for c in CORES) > 500


def test_keys_and_manifest(replay: Replay) -> None:
    c = replay.core
    assert replay.kp.public_key.hex() == c["publicKey"]
    assert replay.key.hex() == c["key"]
    assert discovery_key(replay.key).hex() == c["discoveryKey"]
    assert Manifest.default(replay.kp.public_key).encode().hex() == c["manifest"]
    assert Manifest.decode(bytes.fromhex(c["manifest"])) == Manifest.default(replay.kp.public_key)


def test_heads_byte_for_byte(replay: Replay) -> None:
    heads = replay.core["heads"]
    assert len(heads) == len(replay.heads)
    for want, (f, fork, sig) in zip(heads, replay.heads, strict=True):
        assert f.length == want["length"] and fork == want["fork"]
        assert f.byte_length == want["byteLength"]
        assert f.roots() == list(_nodes(want["roots"]))
        assert f.tree_hash().hex() == want["treeHash"]
        assert sig.hex() == want["signature"]
        assert verify_head(replay.kp.public_key, replay.key, f.tree_hash(), f.length, fork, sig)


def _request(d: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    if "block" in d:
        kw["block"] = BlockRequest(d["block"]["index"], d["block"]["nodes"])
    if "hash" in d:
        kw["hash"] = HashRequest(d["hash"]["index"], d["hash"]["nodes"])
    if "upgrade" in d:
        kw["upgrade"] = UpgradeRequest(d["upgrade"]["start"], d["upgrade"]["length"])
    return kw


def test_proofs_generated_byte_for_byte(replay: Replay) -> None:
    f = replay.frontier
    for v in replay.core["proofs"]:
        kw = _request(v["request"])
        if "block" in kw:
            kw["block_value"] = replay.blocks[kw["block"].index]
        got = generate_proof(
            replay.store.__getitem__, f.length, replay.fork, replay.signature, **kw
        )
        want = _proof(v["proof"])
        assert got == want, v["request"]
        wire = bytes.fromhex(v["wire"])
        assert got.encode(v["wireRequestId"]) == wire
        assert Proof.decode(wire) == (v["wireRequestId"], want)
        if "block" in v["request"] and "upgrade" not in v["request"]:
            b = v["request"]["block"]
            # The generator asks for max_missing_nodes; keep our port of it honest.
            assert b["nodes"] <= max_missing_nodes(2 * b["index"], f.length)


def test_proofs_verify(replay: Replay) -> None:
    f = replay.frontier
    get = replay.store.__getitem__
    pk, key = replay.kp.public_key, replay.key
    for v in replay.core["proofs"]:
        proof = _proof(v["proof"])
        req = v["request"]
        if "upgrade" in req:
            start = req["upgrade"]["start"]
            trusted = Frontier.from_roots(roots_at(get, start))
            res = verify_proof(
                proof,
                public_key=pk,
                key=key,
                fork=replay.fork,
                trusted=trusted,
                trusted_node=lambda i, t=trusted: get(i) if 2 * t.length > i else None,
            )
            assert res.head is not None
            # additionalNodes always take the verifier to the prover's head.
            assert res.head.length == f.length
            assert res.head.tree_hash() == f.tree_hash()
        else:
            res = verify_proof(
                proof, public_key=pk, key=key, fork=replay.fork, trusted=f, trusted_node=get
            )
            assert res.head is None
        if "block" in req:
            i = req["block"]["index"]
            assert res.proven == get(2 * i)


@pytest.mark.skipif(
    shutil.which("node") is None and os.environ.get("CI") != "true", reason="node not installed"
)
def test_generator_reproduces_committed_vectors() -> None:
    if not (VECTORS_DIR / "node_modules" / "hypercore").is_dir():
        reason = "storage/tests/vectors/node_modules missing (run `npm ci` there)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    node = shutil.which("node")
    assert node is not None, "node is required under CI=true"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "v.json"
        subprocess.run(
            [node, str(VECTORS_DIR / "gen.mjs"), str(out)],
            check=True,
            timeout=300,
            cwd=VECTORS_DIR,
        )
        assert out.read_bytes() == VECTORS_FILE.read_bytes()

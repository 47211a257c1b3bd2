"""Hypercore 11 multisig heads, byte for byte against the real npm `hypercore`.

`vectors/multisig_vectors.json` is written by `vectors/gen_multisig.mjs`: cores whose
manifest names several signers, each head signed by a quorum through Hypercore's own
``verifier.sign`` and ``lib/multisig.js assemble`` and accepted by ``core.append``.
We rebuild every manifest, key, signable, partial and assembled signature from Python,
verify them, and reject every hostile variation (too few signers, a non-signer, a
duplicated signer, a signature for another context, another head).
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
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hypercore import (
    DEFAULT_NAMESPACE,
    Frontier,
    KeyPair,
    Manifest,
    MultiSignature,
    MultisigProof,
    archive_key,
    discovery_key,
    sign_head,
    sign_raw,
    signable,
    verify_head,
)
from storage.hypercore.multisig import (
    PartialSignature,
    assemble,
    assemble_quorum,
    majority,
    multisig_manifest,
    sign_partial,
    signable_length,
    verify_manifest_head,
    verify_partial,
)

VECTORS_DIR = Path(__file__).parent / "vectors"
VECTORS_FILE = VECTORS_DIR / "multisig_vectors.json"
CORES: list[dict[str, Any]] = json.loads(VECTORS_FILE.read_text())["cores"]


def _keypairs(core: dict[str, Any]) -> list[KeyPair]:
    base = core["seedBase"]
    return [KeyPair.from_seed(bytes([base + i]) * 32) for i in range(len(core["publicKeys"]))]


def _blocks(core: dict[str, Any]) -> list[bytes]:
    salt = core["salt"]
    return [bytes((salt + 7 * j + k) % 256 for k in range(n)) for j, n in enumerate(core["sizes"])]


def _heads(core: dict[str, Any]) -> list[tuple[dict[str, Any], Frontier]]:
    """Each vector head with the tree we build from the same blocks."""
    blocks = iter(_blocks(core))
    f = Frontier()
    out = []
    for count, head in zip(core["groups"], core["heads"], strict=True):
        for _ in range(count):
            f.append_data(next(blocks))
        out.append((head, f.copy()))
    return out


@pytest.fixture(params=CORES, ids=[c["name"] for c in CORES])
def core(request: pytest.FixtureRequest) -> dict[str, Any]:
    c: dict[str, Any] = request.param
    return c


def test_vectors_cover_the_cases() -> None:
    names = {c["name"] for c in CORES}
    assert {
        "three-of-majority",
        "five-quorum-3",
        "single-multisig-form",
        "three-v2-user-data",
    } <= names
    # signer order in the assembled proofs is not always ascending
    assert any(h["signWith"] != sorted(h["signWith"]) for c in CORES for h in c["heads"])


def test_manifest_and_key(core: dict[str, Any]) -> None:
    kps = _keypairs(core)
    assert [kp.public_key.hex() for kp in kps] == core["publicKeys"]
    raw = bytes.fromhex(core["manifest"])
    m = Manifest.decode(raw)
    assert m.encode() == raw
    assert m.quorum == core["quorum"] and m.allow_patch == core["allowPatch"]
    assert m.hash().hex() == core["key"]
    assert discovery_key(m.hash()).hex() == core["discoveryKey"]
    if not core["allowPatch"]:
        q = None if core["quorum"] == majority(len(kps)) else core["quorum"]
        ud = bytes.fromhex(core["userData"]) if core["userData"] else None
        built = multisig_manifest([kp.public_key for kp in kps], q, ud)
        assert built.encode() == raw and built.version == core["version"]
    if len(kps) == 1:
        # Hypercore's one-signer manifest is exactly the default single-signer core
        assert m == Manifest.default(kps[0].public_key)
        assert archive_key(kps[0].public_key).hex() == core["key"]


def test_heads_byte_for_byte(core: dict[str, Any]) -> None:
    kps = _keypairs(core)
    m = Manifest.decode(bytes.fromhex(core["manifest"]))
    key = m.hash()
    for head, f in _heads(core):
        assert f.length == head["length"] and head["fork"] == 0
        assert f.tree_hash().hex() == head["treeHash"]
        assert signable(key, f.tree_hash(), f.length, 0).hex() == head["signable"]
        partials = [sign_partial(kp, m, f.roots(), f.length, 0) for kp in kps]
        assert [p.signature.hex() for p in partials] == head["partials"]
        assert [p.signer for p in partials] == list(range(len(kps)))
        for p in partials:
            assert verify_partial(m, p, f.tree_hash(), f.length, 0)
        sig = bytes.fromhex(head["signature"])
        assert assemble(partials[i] for i in head["signWith"]) == sig
        assert verify_manifest_head(m, key, f.roots(), f.length, 0, sig)
        # what we publish: the same quorum, signer-sorted; Hypercore accepts any order
        ours = assemble_quorum(m, [partials[i] for i in head["signWith"]])
        assert verify_manifest_head(m, key, f.tree_hash(), f.length, 0, ours)
        if len(kps) == 1:
            assert sign_head(kps[0], key, f.roots(), f.length, 0) == sig
            assert verify_head(kps[0].public_key, key, f.roots(), f.length, 0, sig)


def _three() -> tuple[list[KeyPair], Manifest, bytes, Frontier]:
    c = next(c for c in CORES if c["name"] == "three-of-majority")
    kps = _keypairs(c)
    m = multisig_manifest([kp.public_key for kp in kps])
    _head, f = _heads(c)[-1]
    return kps, m, m.hash(), f


def _ok(m: Manifest, key: bytes, f: Frontier, sig: bytes, fork: int = 0) -> bool:
    return verify_manifest_head(m, key, f.tree_hash(), f.length, fork, sig)


def test_fewer_than_a_quorum_is_rejected() -> None:
    kps, m, key, f = _three()
    one = sign_partial(kps[0], m, f.roots(), f.length, 0)
    assert not _ok(m, key, f, assemble([one]))
    assert not _ok(m, key, f, assemble([]))
    assert not _ok(m, key, f, b"")
    with pytest.raises(ValueError, match="quorum is 2"):
        assemble_quorum(m, [one, one])


def test_non_signer_is_rejected() -> None:
    kps, m, key, f = _three()
    outsider = KeyPair.from_seed(b"\x99" * 32)
    good = sign_partial(kps[0], m, f.roots(), f.length, 0)
    msg = signable(key, f.tree_hash(), f.length, 0)
    forged = PartialSignature(1, sign_raw(outsider, msg))  # outsider poses as signer 1
    assert not verify_partial(m, forged, f.tree_hash(), f.length, 0)
    assert not _ok(m, key, f, assemble([good, forged]))
    # an index past the signer list
    assert not _ok(m, key, f, assemble([good, PartialSignature(3, sign_raw(outsider, msg))]))
    with pytest.raises(ValueError, match="not a declared signer"):
        sign_partial(outsider, m, f.roots(), f.length, 0)


def test_duplicated_signer_is_rejected() -> None:
    kps, m, key, f = _three()
    p = sign_partial(kps[2], m, f.roots(), f.length, 0)
    assert not _ok(m, key, f, assemble([p, p]))
    with pytest.raises(ValueError):
        assemble_quorum(m, [p, p, p])


def test_wrong_context_is_rejected() -> None:
    """A v1 signer signs over the manifest hash; a signature over its namespace (the v0
    context), over another archive's key, or over another head does not verify."""
    kps, m, key, f = _three()
    th, n = f.tree_hash(), f.length
    over_ns = [
        PartialSignature(i, sign_raw(kps[i], signable(DEFAULT_NAMESPACE, th, n, 0))) for i in (0, 1)
    ]
    assert not _ok(m, key, f, assemble(over_ns))
    other = multisig_manifest([kps[1].public_key, kps[0].public_key, kps[2].public_key])
    replayed = assemble_quorum(other, [sign_partial(kp, other, th, n, 0) for kp in kps])
    assert _ok(other, other.hash(), f, replayed)
    assert not _ok(m, key, f, replayed)
    good = assemble_quorum(m, [sign_partial(kp, m, th, n, 0) for kp in kps[:2]])
    assert _ok(m, key, f, good)
    assert not _ok(m, key, f, good, fork=1)  # another fork
    assert not verify_manifest_head(m, key, th, n + 1, 0, good)  # another length
    assert not verify_manifest_head(m, key, bytes(32), n, 0, good)  # another tree
    assert not verify_manifest_head(m, other.hash(), th, n, 0, good)  # key != manifest


def test_malformed_signatures_are_false_not_errors() -> None:
    kps, m, key, f = _three()
    good = assemble_quorum(m, [sign_partial(kp, m, f.roots(), f.length, 0) for kp in kps])
    assert _ok(m, key, f, good)
    for bad in (good + b"\x00", good[:-1], good[:10], b"\xff" * 9, bytes(200)):
        assert not _ok(m, key, f, bad)
    flipped = bytearray(good)
    flipped[5] ^= 1
    assert not _ok(m, key, f, bytes(flipped))


def test_proofs_past_the_quorum_are_not_checked() -> None:
    """As in Hypercore: only the first `quorum` proofs count, the rest ride along."""
    kps, m, key, f = _three()
    a, b = (sign_partial(kp, m, f.roots(), f.length, 0) for kp in kps[:2])
    junk = PartialSignature(2, bytes(64))
    assert _ok(m, key, f, assemble([a, b, junk]))
    assert not _ok(m, key, f, assemble([a, junk, b]))


def test_patched_proofs_are_refused_when_patches_are_allowed() -> None:
    kps = [KeyPair.from_seed(bytes([i]) * 32) for i in (1, 2)]
    m = Manifest(
        signers=multisig_manifest([kp.public_key for kp in kps]).signers, quorum=1, allow_patch=True
    )
    f = Frontier()
    f.append_data(b"x")
    p = sign_partial(kps[0], m, f.roots(), 1, 0)
    assert _ok(m, m.hash(), f, assemble([p]))
    patched = MultiSignature((MultisigProof(0, p.signature, 1),)).encode()
    assert not _ok(m, m.hash(), f, patched)
    # without allowPatch Hypercore ignores the patch count, and so do we
    m2 = multisig_manifest([kp.public_key for kp in kps], 1)
    p2 = sign_partial(kps[0], m2, f.roots(), 1, 0)
    assert _ok(m2, m2.hash(), f, MultiSignature((MultisigProof(0, p2.signature, 7),)).encode())


def test_manifest_builder_refuses_what_cannot_verify() -> None:
    pk = [KeyPair.from_seed(bytes([i]) * 32).public_key for i in range(1, 4)]
    assert multisig_manifest(pk).quorum == 2
    assert multisig_manifest(pk[:2]).quorum == 2
    assert multisig_manifest(pk[:1]).quorum == 1
    for bad_q in (0, 4, -1):
        with pytest.raises(ValueError, match="quorum"):
            multisig_manifest(pk, bad_q)
    with pytest.raises(ValueError, match="only once"):
        multisig_manifest([pk[0], pk[1], pk[0]])
    with pytest.raises(ValueError):
        multisig_manifest([])
    zero_q = Manifest(signers=multisig_manifest(pk).signers, quorum=0)
    assert not verify_manifest_head(zero_q, zero_q.hash(), bytes(32), 1, 0, bytes(70))


def test_signable_length_matches_hypercore() -> None:
    assert signable_length([1, 1], 2) == 1
    assert signable_length([5, 3, 9], 2) == 5
    assert signable_length([5, 3, 9], 3) == 3
    assert signable_length([5], 2) == 0
    assert signable_length([4, 7], 0) == 7


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    data=st.data(),
)
def test_any_subset_verifies_iff_it_is_a_quorum(n: int, data: st.DataObject) -> None:
    kps = [KeyPair.from_seed(bytes([0x70 + i]) * 32) for i in range(n)]
    q = data.draw(st.integers(1, n), label="quorum")
    m = multisig_manifest([kp.public_key for kp in kps], q)
    f = Frontier()
    for b in data.draw(st.lists(st.binary(max_size=8), min_size=1, max_size=6), label="blocks"):
        f.append_data(b)
    fork = data.draw(st.integers(0, 3), label="fork")
    order = data.draw(st.lists(st.integers(0, n - 1), max_size=n + 2), label="signers")
    partials = [sign_partial(kps[i], m, f.roots(), f.length, fork) for i in order]
    sig = assemble(partials)
    expect = len(order) >= q and len(set(order[:q])) == q
    assert verify_manifest_head(m, m.hash(), f.tree_hash(), f.length, fork, sig) == expect
    if len(set(order)) >= q:
        assert _ok(m, m.hash(), f, assemble_quorum(m, partials), fork)


@pytest.mark.skipif(
    shutil.which("node") is None and os.environ.get("CI") != "true", reason="node not installed"
)
def test_generator_reproduces_committed_vectors() -> None:
    if not (VECTORS_DIR / "node_modules" / "hypercore").is_dir():
        reason = "storage/tests/vectors/node_modules missing (run `npm ci` there)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    node = shutil.which("node")
    assert node is not None, "node is required under CI=true"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "v.json"
        subprocess.run(
            [node, str(VECTORS_DIR / "gen_multisig.mjs"), str(out)],
            check=True,
            timeout=300,
            cwd=VECTORS_DIR,
        )
        assert out.read_bytes() == VECTORS_FILE.read_bytes()

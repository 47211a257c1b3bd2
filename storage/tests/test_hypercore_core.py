"""Phase-1 Hypercore primitives: golden vector, flat-tree math, frontier, keys, heads."""

from __future__ import annotations

from hashlib import blake2b

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hypercore import (
    DEFAULT_NAMESPACE,
    MANIFEST_NS,
    TREE_NS,
    Frontier,
    InvalidTree,
    KeyPair,
    Manifest,
    MultiSignature,
    MultisigProof,
    Node,
    Prologue,
    Signer,
    archive_key,
    derive_keypair,
    discovery_key,
    flat_tree,
    leaf_hash,
    manifest_hash,
    parent_hash,
    sign_head,
    signable,
    tree_hash,
    verify_head,
)
from storage.hypercore.errors import DecodeError

GOLDEN_SEED = bytes([7]) * 32
GOLDEN_BLOCKS = [b"a", b"bb", b"ccc", b"dddd", b"eeeee"]


def test_golden_vector_from_reference() -> None:
    kp = KeyPair.from_seed(GOLDEN_SEED)
    assert kp.public_key.hex() == "ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c"
    key = archive_key(kp.public_key)
    assert key.hex() == "04dc2c70d9b3954c86f4d0ffeae59b601b9739d285d5bb1849a9f93f45d95c18"
    assert discovery_key(key).hex() == (
        "1a5b6c22e4a4aa82b612ed68baea17a543db8ded6078040097e695b9fc40a129"
    )
    f = Frontier()
    for b in GOLDEN_BLOCKS:
        f.append_data(b)
    assert [r.index for r in f.roots()] == [3, 8]
    assert f.length == 5 and f.byte_length == 15
    assert f.tree_hash().hex() == (
        "8bd269686739ceaf0dd9b8cb911bcc004aaabc3f7986c5f18c0f2a9d1a293fc9"
    )
    sig = sign_head(kp, key, f.roots(), 5, 0)
    assert len(sig) == 68
    assert sig[:2].hex() == "0100" and sig[-2:] == b"\x00\x00"
    assert sig[2:8].hex() == "59833eda12a3"
    assert sig[-5:-2].hex() == "6caf09"
    assert verify_head(kp.public_key, key, f.tree_hash(), 5, 0, sig)


def test_namespaces_match_hypercore_caps() -> None:
    assert TREE_NS.hex().startswith("9fac70b5") and TREE_NS.hex().endswith("275b9c")
    assert DEFAULT_NAMESPACE.hex().startswith("4144eea5")
    assert DEFAULT_NAMESPACE.hex().endswith("d747cb")
    base = blake2b(b"hypercore", digest_size=32).digest()
    assert blake2b(base + b"\x03", digest_size=32).digest() == MANIFEST_NS


# --------------------------------------------------------------------------- flat tree


def _naive_index(depth: int, offset: int) -> int:
    return 2**depth * (2 * offset + 1) - 1


@given(st.integers(0, 40), st.integers(0, 10**6))
def test_flat_tree_index_roundtrip(depth: int, offset: int) -> None:
    i = _naive_index(depth, offset)
    assert flat_tree.index(depth, offset) == i
    assert flat_tree.depth(i) == depth
    assert flat_tree.offset(i) == offset
    assert flat_tree.parent(i) == _naive_index(depth + 1, offset // 2)
    assert flat_tree.sibling(i) == _naive_index(depth, offset ^ 1)
    assert flat_tree.left_span(i) == 2 * offset * 2**depth
    assert flat_tree.right_span(i) == 2 * ((offset + 1) * 2**depth - 1)
    assert flat_tree.count_leaves(i) == 2**depth
    if depth:
        assert flat_tree.left_child(i) == _naive_index(depth - 1, 2 * offset)
        assert flat_tree.right_child(i) == _naive_index(depth - 1, 2 * offset + 1)
    else:
        assert flat_tree.left_child(i) == -1
    lo, hi = flat_tree.spans(i)
    assert flat_tree.contains(i, lo) and flat_tree.contains(i, hi)
    assert not flat_tree.contains(i, hi + 1)
    assert not flat_tree.contains(i, lo - 1) or lo == 0


def test_full_roots_examples() -> None:
    assert flat_tree.full_roots(0) == []
    assert flat_tree.full_roots(2) == [0]
    assert flat_tree.full_roots(10) == [3, 8]
    assert flat_tree.full_roots(16) == [7]
    assert flat_tree.full_roots(22) == [7, 17, 20]
    with pytest.raises(ValueError):
        flat_tree.full_roots(3)


# ----------------------------------------------------------------------------- hashing


def _naive_root(blocks: list[bytes], first: int) -> Node:
    """Recursive reference: the perfect subtree over `blocks` starting at block `first`."""
    if len(blocks) == 1:
        return Node(2 * first, len(blocks[0]), leaf_hash(blocks[0]))
    half = len(blocks) // 2
    left = _naive_root(blocks[:half], first)
    right = _naive_root(blocks[half:], first + half)
    h = blake2b(
        b"\x01" + (left.size + right.size).to_bytes(8, "little") + left.hash + right.hash,
        digest_size=32,
    ).digest()
    return Node((left.index + right.index) // 2, left.size + right.size, h)


def _naive_roots(blocks: list[bytes]) -> list[Node]:
    roots, start = [], 0
    n = len(blocks)
    while n:
        size = 1 << (n.bit_length() - 1)
        roots.append(_naive_root(blocks[start : start + size], start))
        start += size
        n -= size
    return roots


def test_leaf_hash_definition_and_buffer_types() -> None:
    data = b"hello world"
    expected = blake2b(b"\x00" + len(data).to_bytes(8, "little") + data, digest_size=32).digest()
    assert leaf_hash(data) == expected
    assert leaf_hash(bytearray(data)) == expected
    assert leaf_hash(memoryview(b"xx" + data)[2:]) == expected


def test_parent_hash_orders_by_index() -> None:
    a = Node(0, 1, leaf_hash(b"a"))
    b = Node(2, 2, leaf_hash(b"bb"))
    assert parent_hash(a, b) == parent_hash(b, a)


@settings(max_examples=60)
@given(st.lists(st.binary(max_size=40), min_size=0, max_size=70))
def test_frontier_matches_naive_tree(blocks: list[bytes]) -> None:
    f = Frontier()
    stored: dict[int, Node] = {}
    for i, b in enumerate(blocks):
        created = f.append_data(b)
        assert created[0] == Node(2 * i, len(b), leaf_hash(b))
        for n in created:
            assert n.index not in stored  # every node is created exactly once
            stored[n.index] = n
    roots = _naive_roots(blocks)
    assert f.roots() == roots
    assert [r.index for r in roots] == flat_tree.full_roots(2 * len(blocks))
    assert f.length == len(blocks) and f.byte_length == sum(map(len, blocks))
    assert f.tree_hash() == tree_hash(roots)
    # Every node below the roots was handed out, so a log can serve proofs from them.
    for r in roots:
        lo, hi = flat_tree.spans(r.index)
        assert all(i in stored for i in range(lo, hi + 1))
    g = Frontier.from_roots(roots)
    assert g.length == f.length and g.byte_length == f.byte_length
    assert g.tree_hash() == f.tree_hash()


def test_frontier_copy_is_independent() -> None:
    f = Frontier()
    f.append_data(b"x")
    g = f.copy()
    g.append_data(b"y")
    assert f.length == 1 and g.length == 2
    assert f.tree_hash() != g.tree_hash()


def test_tree_hash_definition() -> None:
    roots = [Node(3, 10, bytes(range(32))), Node(8, 5, bytes(32))]
    buf = b"\x02"
    for r in roots:
        buf += r.hash + r.index.to_bytes(8, "little") + r.size.to_bytes(8, "little")
    assert tree_hash(roots) == blake2b(buf, digest_size=32).digest()
    assert tree_hash([]) == blake2b(b"\x02", digest_size=32).digest()


def test_from_roots_rejects_non_roots() -> None:
    h = bytes(32)
    with pytest.raises(InvalidTree):
        Frontier.from_roots([Node(1, 2, h), Node(3, 4, h)])
    with pytest.raises(InvalidTree):
        Frontier.from_roots([Node(8, 1, h)])  # missing the root [3] in front
    with pytest.raises(InvalidTree):
        Frontier.from_roots([Node(3, 1, h), Node(10, 1, h)])


# -------------------------------------------------------------------- keys and manifest


def test_derive_keypair_is_corestore_derivation() -> None:
    seed = bytes(range(32))
    kp = derive_keypair(seed, b"topic-a/0")
    assert kp == derive_keypair(seed, b"topic-a/0")
    assert kp != derive_keypair(seed, b"topic-a/1")
    assert kp != derive_keypair(bytes(32), b"topic-a/0")
    ns = blake2b(blake2b(b"corestore", digest_size=32).digest() + b"\x00", digest_size=32).digest()
    sub = blake2b(ns + bytes(32) + b"topic-a/0", digest_size=32, key=seed).digest()
    assert kp == KeyPair.from_seed(sub)
    assert len(kp.public_key) == 32 and len(kp.secret_key) == 64
    assert kp.secret_key[32:] == kp.public_key
    with pytest.raises(ValueError):
        derive_keypair(b"short", b"x")


def test_default_manifest_encoding() -> None:
    pk = bytes(range(32))
    enc = Manifest.default(pk).encode()
    # version 1, flags 0, hash blake2b(0), quorum 1, 1 signer: ed25519(0), ns, key
    assert enc == b"\x01\x00\x00\x01\x01\x00" + DEFAULT_NAMESPACE + pk
    assert manifest_hash(enc) == blake2b(MANIFEST_NS + enc, digest_size=32).digest()
    assert archive_key(pk) == manifest_hash(Manifest.default(pk))
    assert Manifest.decode(enc) == Manifest.default(pk)


def test_manifest_roundtrip_with_options() -> None:
    m = Manifest(
        signers=(Signer(bytes(32)), Signer(bytes([1]) * 32, bytes([2]) * 32)),
        quorum=2,
        version=2,
        allow_patch=True,
        prologue=Prologue(bytes([3]) * 32, 300),
        linked=(bytes([4]) * 32,),
        user_data=b"hello",
    )
    assert Manifest.decode(m.encode()) == m
    with pytest.raises(DecodeError):
        Manifest.decode(m.encode() + b"\x00")
    with pytest.raises(DecodeError):
        Manifest.decode(m.encode()[:-1])
    with pytest.raises(DecodeError):
        Manifest.decode(b"\x00\x00")  # v0 is not produced by Hypercore 11


# --------------------------------------------------------------------------- signatures


def _golden() -> tuple[KeyPair, bytes, Frontier, bytes]:
    kp = KeyPair.from_seed(GOLDEN_SEED)
    key = archive_key(kp.public_key)
    f = Frontier()
    for b in GOLDEN_BLOCKS:
        f.append_data(b)
    return kp, key, f, sign_head(kp, key, f.tree_hash(), 5, 0)


def test_signable_layout() -> None:
    _, key, f, _ = _golden()
    s = signable(key, f.tree_hash(), 5, 3)
    assert len(s) == 112
    tail = (5).to_bytes(8, "little") + (3).to_bytes(8, "little")
    assert s == TREE_NS + key + f.tree_hash() + tail


def test_multisig_wrapper_layout() -> None:
    _, _, _, sig = _golden()
    ms = MultiSignature.decode(sig)
    assert ms.proofs == (MultisigProof(0, sig[2:66], 0),) and ms.patch == ()
    assert ms.encode() == sig


@pytest.mark.parametrize(
    "case",
    [
        "wrong_length",
        "wrong_fork",
        "wrong_tree",
        "wrong_key",
        "other_signer_key",
        "flipped_bit",
        "truncated",
        "trailing_garbage",
        "signer_index_1",
        "empty",
    ],
)
def test_verify_head_negative(case: str) -> None:
    kp, key, f, sig = _golden()
    pk, th, length, fork = kp.public_key, f.tree_hash(), 5, 0
    other = KeyPair.from_seed(bytes([8]) * 32)
    if case == "wrong_length":
        length = 4
    elif case == "wrong_fork":
        fork = 1
    elif case == "wrong_tree":
        th = bytes(32)
    elif case == "wrong_key":
        key = archive_key(other.public_key)
    elif case == "other_signer_key":
        # A head signed by another key, presented for this core.
        sig = sign_head(other, key, th, length, fork)
    elif case == "flipped_bit":
        sig = sig[:10] + bytes([sig[10] ^ 1]) + sig[11:]
    elif case == "truncated":
        sig = sig[:-1]
    elif case == "trailing_garbage":
        sig = sig + b"\x00"
    elif case == "signer_index_1":
        sig = sig[:1] + b"\x01" + sig[2:]
    elif case == "empty":
        sig = b""
    assert verify_head(pk, key, th, length, fork, sig) is False

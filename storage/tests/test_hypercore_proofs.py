"""Inclusion/consistency proofs: named negative cases and Hypothesis round trips."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.hypercore import (
    DecodeError,
    Frontier,
    InvalidProof,
    KeyPair,
    Node,
    archive_key,
    sign_head,
)
from storage.hypercore.proofs import (
    BlockRequest,
    HashRequest,
    InvalidRequest,
    Proof,
    UpgradeRequest,
    consistency_proof,
    generate_proof,
    inclusion_proof,
    max_missing_nodes,
    roots_at,
    verify_proof,
)

KP = KeyPair.from_seed(bytes([0x31]) * 32)
OTHER = KeyPair.from_seed(bytes([0x32]) * 32)
KEY = archive_key(KP.public_key)


class Core:
    """A writer: blocks, stored nodes, and the signed head at its length."""

    def __init__(self, n: int, fork: int = 0, kp: KeyPair = KP) -> None:
        self.blocks = [bytes([i % 251]) * (i % 37 + 1) for i in range(n)]
        self.store: dict[int, Node] = {}
        self.frontier = Frontier()
        for b in self.blocks:
            for node in self.frontier.append_data(b):
                self.store[node.index] = node
        self.fork = fork
        self.signature = sign_head(kp, KEY, self.frontier.roots(), n, fork)

    def get(self, i: int) -> Node:
        return self.store[i]

    def at(self, length: int) -> Frontier:
        return Frontier.from_roots(roots_at(self.get, length))


def _verify(proof: Proof, trusted: Frontier | None, core: Core, fork: int = 0) -> None:
    verify_proof(
        proof,
        public_key=KP.public_key,
        key=KEY,
        fork=fork,
        trusted=trusted,
        trusted_node=lambda i: (
            core.store.get(i) if trusted is not None and i < 2 * trusted.length else None
        ),
    )


def _replace_upgrade(p: Proof, **kw: object) -> Proof:
    assert p.upgrade is not None
    return dataclasses.replace(p, upgrade=dataclasses.replace(p.upgrade, **kw))  # type: ignore[arg-type]


def _replace_block(p: Proof, **kw: object) -> Proof:
    assert p.block is not None
    return dataclasses.replace(p, block=dataclasses.replace(p.block, **kw))  # type: ignore[arg-type]


def _flip(n: Node) -> Node:
    return Node(n.index, n.size, bytes([n.hash[0] ^ 1]) + n.hash[1:])


CORE = Core(13)


def _receipt(index: int = 5) -> Proof:
    return inclusion_proof(CORE.get, 13, 0, CORE.signature, index, CORE.blocks[index])


def _consistency(old: int = 5) -> Proof:
    return consistency_proof(CORE.get, old, 13, 0, CORE.signature)


def _fork1_consistency() -> Proof:
    forked = Core(13, fork=1)
    return consistency_proof(forked.get, 5, 13, 1, forked.signature)


def _tampered_additional() -> Proof:
    # Upgrade 3 -> 7 whose additionalNodes carry the verifier on to 13.
    p = generate_proof(CORE.get, 13, 0, CORE.signature, upgrade=UpgradeRequest(3, 4))
    assert p.upgrade is not None and p.upgrade.additional_nodes
    extra = p.upgrade.additional_nodes
    return _replace_upgrade(p, additional_nodes=(_flip(extra[0]), *extra[1:]))


def test_valid_baselines() -> None:
    _verify(_receipt(), None, CORE)
    _verify(_consistency(), CORE.at(5), CORE)
    plain = generate_proof(
        CORE.get, 13, 0, None, block=BlockRequest(5, 3), block_value=CORE.blocks[5]
    )
    _verify(plain, CORE.frontier, CORE)


NEGATIVE: dict[str, Callable[[], tuple[Proof, Frontier | None, int]]] = {
    # The upgrade is one node short of reaching the signed head.
    "truncated_upgrade": lambda: (
        _replace_upgrade(_consistency(), nodes=_consistency().upgrade.nodes[:-1]),  # type: ignore[union-attr]
        CORE.at(5),
        0,
    ),
    # Block path cut short: it ends below the root the verifier trusts.
    "truncated_block_path": lambda: (
        _replace_block(_receipt(), nodes=_receipt().block.nodes[:-1]),  # type: ignore[union-attr]
        None,
        0,
    ),
    # Two upgrade roots in the wrong order.
    "swapped_roots": lambda: (
        _replace_upgrade(
            _consistency(0),
            nodes=tuple(reversed(_consistency(0).upgrade.nodes)),  # type: ignore[union-attr]
        ),
        None,
        0,
    ),
    "wrong_sibling_hash": lambda: (
        _replace_block(
            _receipt(),
            nodes=(_flip(_receipt().block.nodes[0]), *_receipt().block.nodes[1:]),  # type: ignore[union-attr]
        ),
        None,
        0,
    ),
    "wrong_sibling_index": lambda: (
        _replace_block(
            _receipt(),
            nodes=(CORE.get(10), *_receipt().block.nodes[1:]),  # type: ignore[union-attr]
        ),
        None,
        0,
    ),
    "wrong_block_value": lambda: (_replace_block(_receipt(), value=b"evil"), None, 0),
    "trailing_upgrade_node": lambda: (
        _replace_upgrade(
            _consistency(),
            nodes=(*_consistency().upgrade.nodes, CORE.get(24)),  # type: ignore[union-attr]
        ),
        CORE.at(5),
        0,
    ),
    "trailing_block_node": lambda: (
        _replace_block(
            _receipt(),
            nodes=(*_receipt().block.nodes, CORE.get(24)),  # type: ignore[union-attr]
        ),
        None,
        0,
    ),
    "wrong_length": lambda: (_replace_upgrade(_consistency(), length=7), CORE.at(5), 0),
    "wrong_start": lambda: (_replace_upgrade(_consistency(), start=4), CORE.at(5), 0),
    "verifier_at_other_length": lambda: (_consistency(5), CORE.at(6), 0),
    "bad_signature": lambda: (
        _replace_upgrade(
            _consistency(),
            signature=CORE.signature[:5] + bytes([CORE.signature[5] ^ 1]) + CORE.signature[6:],
        ),
        CORE.at(5),
        0,
    ),
    "missing_signature": lambda: (_replace_upgrade(_consistency(), signature=None), CORE.at(5), 0),
    "signature_from_another_key": lambda: (
        _replace_upgrade(
            _consistency(), signature=sign_head(OTHER, KEY, CORE.frontier.roots(), 13, 0)
        ),
        CORE.at(5),
        0,
    ),
    "signature_for_other_fork": lambda: (
        _replace_upgrade(
            _consistency(), signature=sign_head(KP, KEY, CORE.frontier.roots(), 13, 1)
        ),
        CORE.at(5),
        0,
    ),
    # The proof claims fork 1, the signature covers fork 0.
    "fork_mismatch_in_upgrade": lambda: (dataclasses.replace(_consistency(0), fork=1), None, 1),
    # The verifier is on fork 0, the proof's data comes from fork 1.
    "fork_mismatch_plain_block": lambda: (
        dataclasses.replace(
            generate_proof(
                CORE.get, 13, 0, None, block=BlockRequest(5, 3), block_value=CORE.blocks[5]
            ),
            fork=1,
        ),
        CORE.frontier,
        0,
    ),
    # A signed head on a new fork may rewrite the verifier's history: reorg, not upgrade.
    "fork_change_needs_reorg": lambda: (_fork1_consistency(), CORE.at(5), 0),
    "tampered_additional_node": lambda: (_tampered_additional(), CORE.at(3), 0),
    "untrusted_plain_path": lambda: (
        generate_proof(CORE.get, 13, 0, None, block=BlockRequest(5, 3), block_value=CORE.blocks[5]),
        None,
        0,
    ),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_negative(case: str) -> None:
    proof, trusted, fork = NEGATIVE[case]()
    with pytest.raises(InvalidProof):
        _verify(proof, trusted, CORE, fork)


def test_wire_trailing_garbage_and_truncation() -> None:
    wire = _receipt().encode(7)
    assert Proof.decode(wire) == (7, _receipt())
    with pytest.raises(DecodeError):
        Proof.decode(wire + b"\x00")
    # Every strict prefix is rejected with DecodeError, never IndexError/struct.error.
    for cut in range(len(wire)):
        with pytest.raises(DecodeError):
            Proof.decode(wire[:cut])


def test_invalid_requests() -> None:
    with pytest.raises(InvalidRequest):
        generate_proof(CORE.get, 13, 0, None, upgrade=UpgradeRequest(5, 9))
    with pytest.raises(InvalidRequest):
        generate_proof(CORE.get, 13, 0, None, upgrade=UpgradeRequest(13, 0))
    with pytest.raises(InvalidRequest):
        generate_proof(CORE.get, 13, 0, None, block=BlockRequest(13, 0), block_value=b"")
    with pytest.raises(InvalidRequest):
        generate_proof(CORE.get, 13, 0, None, block=BlockRequest(0, 9), block_value=b"")
    assert generate_proof(CORE.get, 0, 0, None, upgrade=UpgradeRequest(0, 1)) == Proof(0)


# ------------------------------------------------------------------- round trips


@st.composite
def _core_and_points(draw: st.DrawFn) -> tuple[int, int, int]:
    n = draw(st.integers(1, 300))
    return n, draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))


_CORES: dict[int, Core] = {}


def _core(n: int) -> Core:
    if n not in _CORES:
        _CORES[n] = Core(n)
    return _CORES[n]


@settings(max_examples=150, deadline=None)
@given(_core_and_points())
def test_roundtrip_inclusion_and_consistency(args: tuple[int, int, int]) -> None:
    n, i, m = args
    core = _core(n)
    receipt = inclusion_proof(core.get, n, 0, core.signature, i, core.blocks[i])
    res = verify_proof(receipt, public_key=KP.public_key, key=KEY, fork=0)
    assert res.proven == core.get(2 * i)
    assert res.head is not None and res.head.tree_hash() == core.frontier.tree_hash()
    assert Proof.decode(receipt.encode(3)) == (3, receipt)
    # A receipt is only good for its own bytes.
    with pytest.raises(InvalidProof):
        verify_proof(
            _replace_block(receipt, value=core.blocks[i] + b"x"),
            public_key=KP.public_key,
            key=KEY,
            fork=0,
        )

    cons = consistency_proof(core.get, m, n, 0, core.signature)
    res = verify_proof(cons, public_key=KP.public_key, key=KEY, fork=0, trusted=core.at(m))
    assert res.head is not None and res.head.roots() == core.frontier.roots()
    # ... and it does not verify from a forged older head.
    if m > 0:
        forged = core.at(m).roots()
        forged[-1] = _flip(forged[-1])
        with pytest.raises(InvalidProof):
            verify_proof(
                cons,
                public_key=KP.public_key,
                key=KEY,
                fork=0,
                trusted=Frontier.from_roots(forged),
            )

    # Block + upgrade from m (block inside or before the new part), and a plain hash proof.
    nodes = max_missing_nodes(2 * i, m) if i < m else 0
    p = generate_proof(
        core.get,
        n,
        0,
        core.signature,
        block=BlockRequest(i, nodes),
        block_value=core.blocks[i],
        upgrade=UpgradeRequest(m, n - m),
    )
    trusted = core.at(m)
    _verify(p, trusted, core)
    h = generate_proof(core.get, n, 0, None, hash=HashRequest(2 * i, 0))
    _verify(h, core.frontier, core)

"""Hypercore 11 primitives, byte-identical to the npm `hypercore` package (11.39.5).

Owns: flat-tree index math (`flat_tree`), the BLAKE2b Merkle tree and its `Frontier`
(`tree`), keys, manifests, archive/discovery keys and signed heads (`crypto`), and
inclusion/consistency proofs (`proofs`). Pure functions and small value objects: no
file I/O, no threads, no Trio. May import only the standard library and PyNaCl; never
`broker`, kio or the rest of `storage`.
"""

from storage.hypercore import flat_tree
from storage.hypercore.crypto import (
    CORESTORE_NS,
    DEFAULT_ENCRYPTION_NS,
    DEFAULT_NAMESPACE,
    MANIFEST_NS,
    REPLICATE_INITIATOR_NS,
    REPLICATE_RESPONDER_NS,
    TREE_NS,
    KeyPair,
    Manifest,
    MultiSignature,
    MultisigProof,
    Prologue,
    Signer,
    archive_key,
    derive_keypair,
    discovery_key,
    manifest_hash,
    namespace,
    sign_head,
    sign_raw,
    signable,
    verify_head,
    verify_raw,
)
from storage.hypercore.errors import DecodeError, HypercoreError, InvalidProof, InvalidTree
from storage.hypercore.tree import (
    Frontier,
    Node,
    check_roots,
    leaf_hash,
    leaf_node,
    parent_hash,
    parent_node,
    tree_hash,
)

__all__ = [
    "CORESTORE_NS",
    "DEFAULT_ENCRYPTION_NS",
    "DEFAULT_NAMESPACE",
    "MANIFEST_NS",
    "REPLICATE_INITIATOR_NS",
    "REPLICATE_RESPONDER_NS",
    "TREE_NS",
    "DecodeError",
    "Frontier",
    "HypercoreError",
    "InvalidProof",
    "InvalidTree",
    "KeyPair",
    "Manifest",
    "MultiSignature",
    "MultisigProof",
    "Node",
    "Prologue",
    "Signer",
    "archive_key",
    "check_roots",
    "derive_keypair",
    "discovery_key",
    "flat_tree",
    "leaf_hash",
    "leaf_node",
    "manifest_hash",
    "namespace",
    "parent_hash",
    "parent_node",
    "sign_head",
    "sign_raw",
    "signable",
    "tree_hash",
    "verify_head",
    "verify_raw",
]

"""JSON views of the signed archives for programs, served on the HTTP listener
(broker/http.py): a partition's last signed head, and an inclusion proof for the batch
holding a Kafka offset.

    GET /v1/partitions/<topic>/<partition>/head
    GET /v1/partitions/<topic>/<partition>/proof?offset=<offset>

The head is the one Fetch answers under (its length covers the high watermark). The proof
is Hypercore's own: the batch (leaf value), the nodes from its leaf up to the signed tree
and the writer's signature, both as the Hypercore wire `data` message (base64, which
`storage.hypercore.proofs.Proof.decode` and the `hypercore` npm package read) and as JSON
node lists. Anyone holding the writer's public key can check it; a mirror serves the same
proofs for the archives it holds, signed by their writer, so it cannot forge them.

May import `broker.node` and `storage`; never the protocol codec.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from broker.node import Node
from storage.errors import OffsetOutOfRange, StorageError
from storage.hypercore.proofs import inclusion_proof
from storage.hypercore.tree import Node as TreeNode
from storage.log import PartitionLog

_ROUTE = re.compile(r"^/v1/partitions/([a-zA-Z0-9._-]{1,249})/(\d{1,6})/(head|proof)$")


class NotFound(Exception):
    pass


def _nodes(nodes: tuple[TreeNode, ...]) -> list[dict[str, Any]]:
    return [{"index": n.index, "size": n.size, "hash": n.hash.hex()} for n in nodes]


def _head(node: Node, topic: str, index: int, plog: PartitionLog, mirrored: bool) -> dict[str, Any]:
    h = plog.head
    return {
        "topic": topic,
        "partition": index,
        "archive_key": plog.key.hex(),
        "writer_public_key": plog.public_key.hex(),
        "mirrored": mirrored,
        "fork": h.fork if h is not None else plog.fork,
        "length": h.length if h is not None else 0,
        "byte_length": h.byte_length if h is not None else 0,
        "tree_hash": h.tree_hash.hex() if h is not None else None,
        "signature": h.signature.hex() if h is not None and h.length else None,
        "high_watermark": plog.high_watermark,
        "log_start_offset": plog.log_start_offset,
        "node_key": node.store.node_public_key.hex(),
    }


def answer_json(
    node: Node, path: str, query: str, readable: Callable[[str], bool] = lambda _: True
) -> dict[str, Any]:
    """The JSON document for `path`; NotFound (404) or ValueError (400) otherwise.
    `readable(topic)`: may an anonymous client read it over Kafka? A proof carries the
    batch, so a topic the ACLs keep from anonymous readers is not found here either."""
    m = _ROUTE.match(path)
    if m is None:
        raise NotFound(f"no such resource: {path}")
    name, index, what = m.group(1), int(m.group(2)), m.group(3)
    topic = node.topics.get(name)
    if topic is None or not readable(name) or not 0 <= index < len(topic.partitions):
        raise NotFound(f"no partition {name}-{index}")
    plog = topic.partitions[index].log
    doc = _head(node, name, index, plog, topic.mirrored)
    if what == "head":
        return doc
    values = parse_qs(query).get("offset")
    if not values or not values[0].lstrip("-").isdigit():
        raise ValueError("proof needs ?offset=<offset>")
    offset = int(values[0])
    head = plog.head
    try:
        leaf = plog.leaf_of_offset(offset)
        if head is None or leaf >= head.length:
            raise OffsetOutOfRange(offset, plog.log_start_offset, plog.high_watermark)
        value = plog.block(leaf)

        def stored(i: int) -> TreeNode:
            n = plog.node(i)
            if n is None:
                raise StorageError(f"tree node {i} is missing")
            return n

        proof = inclusion_proof(stored, head.length, head.fork, head.signature, leaf, value)
    except (OffsetOutOfRange, KeyError):
        raise NotFound(
            f"offset {offset} is not readable in {name}-{index} "
            f"(log start {plog.log_start_offset}, high watermark {plog.high_watermark})"
        ) from None
    except StorageError as exc:  # a node the proof needs is missing or damaged
        raise NotFound(f"no proof for offset {offset} of {name}-{index}: {exc}") from None
    assert proof.block is not None and proof.upgrade is not None
    doc.update(
        offset=offset,
        block_index=leaf,
        batch=base64.b64encode(value).decode(),
        block_nodes=_nodes(proof.block.nodes),
        upgrade_start=proof.upgrade.start,
        upgrade_length=proof.upgrade.length,
        upgrade_nodes=_nodes(proof.upgrade.nodes),
        additional_nodes=_nodes(proof.upgrade.additional_nodes),
        proof=base64.b64encode(proof.encode()).decode(),
    )
    return doc

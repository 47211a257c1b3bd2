"""The explorer: a read-only web page on the HTTP listener (broker/http.py) and the JSON
it reads, beside /v1/partitions/... (broker/archive_json.py).

    GET /                  the page (broker/static/index.html)
    GET /explorer.js       its proof check: hypercore-crypto bundled by esbuild
                           (explorer/, see docs/explorer.md)
    GET /v1/topics         topics, partitions, high watermarks, signed heads
    GET /v1/groups         consumer groups, their committed offsets and lag
    GET /v1/mirrors        the mirrors replicating from this node, and their lag
    GET /v1/catalog?topic=T    the signed catalog listing T's archive keys (its writer's)

Every list is cut at MAX_ITEMS entries (and says so: `"truncated": true`), so an answer
stays small whatever the node holds. Topics an anonymous Kafka client may not read are
left out, as for proofs. Nothing here writes.

May import `broker.node`, `broker.archive_json` and `storage`; never the protocol codec.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from broker.archive_json import NotFound
from broker.node import Node
from storage.log import PartitionLog

MAX_ITEMS = 1000
MAX_CATALOG_BYTES = 4 << 20  # /v1/catalog: one catalog change is ~100 bytes a partition

# name -> content type of the static files the page needs (all in broker/static/)
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/explorer.js": ("explorer.js", "text/javascript; charset=utf-8"),
}
_cache: dict[str, bytes] = {}


def static_file(path: str) -> tuple[bytes, str] | None:
    """The bytes and content type of a static file of the page; None if `path` is none."""
    entry = STATIC.get(path)
    if entry is None:
        return None
    name, content_type = entry
    body = _cache.get(name)
    if body is None:
        body = _cache[name] = resources.files("broker").joinpath("static", name).read_bytes()
    return body, content_type


def _cut(items: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    out: list[dict[str, Any]] = []
    for item in items:
        if len(out) == MAX_ITEMS:
            return out, True
        out.append(item)
    return out, False


def _partition(index: int, plog: PartitionLog) -> dict[str, Any]:
    h = plog.head
    return {
        "partition": index,
        "log_start_offset": plog.log_start_offset,
        "high_watermark": plog.high_watermark,
        "archive_key": plog.key.hex(),
        "writer_public_key": plog.public_key.hex(),
        "length": h.length if h is not None else 0,
        "fork": h.fork if h is not None else plog.fork,
        "tree_hash": h.tree_hash.hex() if h is not None else None,
        "signature": h.signature.hex() if h is not None and h.length else None,
        "frozen": bool(getattr(plog, "frozen", False)),
    }


def _topics(node: Node, readable: Callable[[str], bool]) -> Iterator[dict[str, Any]]:
    for name, topic in sorted(node.topics.items()):
        if name.startswith("__") or not readable(name):
            continue
        yield {
            "topic": name,
            "topic_id": str(topic.topic_id),
            "mirrored": topic.mirrored,
            "configs": dict(topic.configs),  # in effect: a quorum topic's are its etcd record's
            "partitions": [_partition(p.index, p.log) for p in topic.partitions[:MAX_ITEMS]],
        }


def _groups(node: Node, readable: Callable[[str], bool]) -> Iterator[dict[str, Any]]:
    for group_id, protocol_type, state in sorted(node.groups.list_groups()):
        offsets = []
        for topic, parts in node.groups.fetch_offsets(group_id, None).items():
            t = node.topics.get(topic)
            if t is None or not readable(topic):
                continue
            for p, committed in sorted(parts.items()):
                if committed is None:
                    continue
                hw = t.partitions[p].log.high_watermark if p < len(t.partitions) else None
                offsets.append(
                    {
                        "topic": topic,
                        "partition": p,
                        "committed": committed.offset,
                        "high_watermark": hw,
                        "lag": max(0, hw - committed.offset) if hw is not None else None,
                    }
                )
        yield {
            "group": group_id,
            "protocol_type": protocol_type,
            "state": state,
            "lag": sum(o["lag"] or 0 for o in offsets),
            "offsets": offsets[:MAX_ITEMS],
        }


def _mirrors(node: Node, readable: Callable[[str], bool]) -> list[dict[str, Any]]:
    """Per mirror (its node key): each archive it replicates from us, how much of our
    signed head it holds verified, and the lag; the same figures as /metrics."""
    names: dict[int, str] = {}
    for t in node.topics.values():
        for p in t.partitions:
            names[id(p.log)] = f"{t.name}-{p.index}" if readable(t.name) else ""
    peers: dict[str, list[dict[str, Any]]] = {}
    for ch, peer in list(node.metrics.channels.items()):
        plog = getattr(ch.source, "log", None)
        if plog is None or ch.closed:
            continue
        name = names.get(id(plog), "__catalog")
        if not name:
            continue
        ours = plog.head.length if plog.head is not None else 0
        have = ch.remote_contiguous_length
        peers.setdefault(peer, []).append(
            {"archive": name, "verified": have, "signed": ours, "lag": max(0, ours - have)}
        )
    return [
        {
            "mirror": peer,
            "lag": sum(a["lag"] for a in archives),
            "archives": sorted(archives, key=lambda a: str(a["archive"]))[:MAX_ITEMS],
        }
        for peer, archives in sorted(peers.items())
    ]


def _catalog(node: Node, query: str, readable: Callable[[str], bool]) -> dict[str, Any]:
    """The signed catalog that lists `?topic=`'s archive keys: this node's own, or (a
    mirrored topic) our verified copy of its writer's. Whole, from block 0 to the signed
    head, so that a reader holding only the node key can replay it and learn the topic's
    archive keys without trusting us (explorer/verify.js)."""
    values = parse_qs(query).get("topic")
    name = values[0] if values else ""
    topic = node.topics.get(name)
    if topic is None or not readable(name):
        raise NotFound(f"no topic {name!r}")
    if topic.mirrored:
        if name not in node.writer_catalogs:
            raise NotFound(f"the catalog of {name}'s writer is not held here")
        node_key, cat = node.writer_catalogs[name]
    else:
        node_key, cat = node.store.node_public_key, node.store.catalog_log
    head = cat.head
    if head is None or head.length == 0:
        raise NotFound("the catalog has no signed head yet")
    if cat.log_start_offset > 0:
        raise NotFound("the catalog's first blocks are gone: the chain cannot be replayed")
    blocks: list[str] = []
    size = 0
    for i in range(head.length):
        block = cat.block(i)
        size += len(block)
        if size > MAX_CATALOG_BYTES:
            raise NotFound(f"the catalog is larger than {MAX_CATALOG_BYTES} bytes")
        blocks.append(base64.b64encode(block).decode())
    return {
        "topic": name,
        "node_key": node_key.hex(),
        "archive_key": cat.key.hex(),
        "length": head.length,
        "fork": head.fork,
        "tree_hash": head.tree_hash.hex(),
        "signature": head.signature.hex(),
        "blocks": blocks,
    }


def explorer_json(
    node: Node, path: str, query: str, readable: Callable[[str], bool]
) -> dict[str, Any] | None:
    """The JSON document for `path`, or None when the path is not the explorer's;
    NotFound (404) when it is but names nothing served."""
    if path == "/v1/catalog":
        return _catalog(node, query, readable)
    if path == "/v1/topics":
        items, truncated = _cut(_topics(node, readable))
        return {
            "node_key": node.store.node_public_key.hex(),
            "topics": items,
            "truncated": truncated,
        }
    if path == "/v1/groups":
        items, truncated = _cut(_groups(node, readable))
        return {"groups": items, "truncated": truncated}
    if path == "/v1/mirrors":
        items, truncated = _cut(_mirrors(node, readable))
        return {"mirrors": items, "truncated": truncated}
    return None

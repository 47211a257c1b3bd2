"""`hyperkafka keys` and `hyperkafka verify`: offline commands over a data directory.

The broker's console script dispatches to these functions. They print to stdout and
return an exit code. May import the standard library and `storage`; never `broker`.
"""

from __future__ import annotations

import os
import sys

from storage.catalog import TopicRecord, apply_change, decode_changes
from storage.fs import OsFileSystem
from storage.hypercore import archive_key, derive_keypair
from storage.store import CATALOG_DIR, CATALOG_NAME, load_seed, partition_dir, partition_key_name
from storage.verify import signed_batches, verify_partition


def _catalog(data_dir: str) -> tuple[bytes, bytes, dict[str, TopicRecord]]:
    """(node seed, node public key, topics) from the verified catalog archive, read-only:
    these commands may run next to a live broker and must not write its files."""
    seed = load_seed(OsFileSystem(), data_dir, create=False)
    kp = derive_keypair(seed, CATALOG_NAME)
    topics: dict[str, TopicRecord] = {}
    for batch in signed_batches(os.path.join(data_dir, CATALOG_DIR), kp.public_key):
        for change in decode_changes(batch):
            apply_change(topics, change)
    return seed, kp.public_key, topics


def keys_command(data_dir: str) -> int:
    """Print the node key, the catalog key and every partition's archive key."""
    try:
        seed, node_pk, topics = _catalog(data_dir)
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"node\t{node_pk.hex()}")
    print(f"catalog\t{archive_key(node_pk).hex()}")
    for name in sorted(topics):
        rec = topics[name]
        for p in range(rec.partitions):
            pk = derive_keypair(seed, partition_key_name(rec.topic_id, p)).public_key
            print(f"{name}\t{p}\t{archive_key(pk).hex()}")
    return 0


def verify_command(data_dir: str, topic: str | None) -> int:
    """Verify every archive (or one topic's) fully. 0 when all hold; 1 otherwise, with a
    line `BAD <topic> <partition> <first bad offset> <reason>` per failing archive."""
    try:
        seed, node_pk, topics = _catalog(data_dir)
    except Exception as exc:
        print(f"BAD catalog - - {exc}")
        return 1
    failures = 0
    cat = verify_partition(os.path.join(data_dir, CATALOG_DIR), node_pk)
    if not cat.ok:
        print(f"BAD __catalog 0 {cat.first_bad_offset} {cat.reason}")
        failures += 1
    if topic is not None and topic not in topics:
        print(f"BAD {topic} - - unknown topic")
        return 1
    for name in sorted(topics):
        if topic is not None and name != topic:
            continue
        rec = topics[name]
        for p in range(rec.partitions):
            path = partition_dir(data_dir, name, p)
            if not os.path.isdir(path):
                print(f"ok {name} {p} 0 blocks (never written)")
                continue
            pk = derive_keypair(seed, partition_key_name(rec.topic_id, p)).public_key
            res = verify_partition(path, pk)
            if res.ok:
                print(f"ok {name} {p} {res.length} blocks, {res.signed_length} signed")
            else:
                failures += 1
                print(f"BAD {name} {p} {res.first_bad_offset} {res.reason}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m storage.cli keys DIR` / `python -m storage.cli verify DIR [TOPIC]`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "keys":
        return keys_command(args[1])
    if len(args) >= 2 and args[0] == "verify":
        return verify_command(args[1], args[2] if len(args) > 2 else None)
    print("usage: python -m storage.cli keys DATA_DIR | verify DATA_DIR [TOPIC]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

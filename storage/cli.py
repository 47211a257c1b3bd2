"""`hyperkafka keys` and `hyperkafka verify`: offline commands over a data directory.

The broker's console script dispatches to these functions. They print to stdout and
return an exit code. May import the standard library and `storage`; never `broker`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from storage.catalog import TopicRecord, apply_change, decode_changes
from storage.dirlock import probe
from storage.errors import ArchiveDamaged
from storage.follower import PUBLIC_KEY_FILE, check_evidence
from storage.fs import OsFileSystem
from storage.hypercore import archive_key, derive_keypair
from storage.hypercore.multisig import HeadSigner, head_manifest
from storage.manifest_file import MANIFEST_FILE, read_manifest
from storage.progress import Progress
from storage.store import (
    CATALOG_DIR,
    CATALOG_NAME,
    MIRRORS_DIR,
    load_seed,
    partition_dir,
    partition_key_name,
)
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
        print(f"hyperkafka: {exc}", file=sys.stderr)
        return 2
    print(f"node\t{node_pk.hex()}")
    print(f"catalog\t{archive_key(node_pk).hex()}")
    for name in sorted(topics):
        rec = topics[name]
        for p in range(rec.partitions):
            pk = derive_keypair(seed, partition_key_name(rec.topic_id, p)).public_key
            print(f"{name}\t{p}\t{archive_key(pk).hex()}")
    return 0


def verify_command(data_dir: str, topic: str | None, *,
                   progress_interval: float | None = None) -> int:
    """Verify every archive (or one topic's) fully. 0 when all hold; 1 otherwise, with a
    line `BAD <topic> <partition> <first bad offset> <reason>` per failing archive.

    Read-only, so it takes no lock and may run beside a live broker; it says so (on
    stderr, stdout keeps its line format) when one holds the directory. Progress goes to
    stderr (storage/progress.py): a bar on a terminal, a line every `progress_interval`
    seconds (5 by default) otherwise."""
    holder = probe(data_dir)
    if holder is not None:
        print(f"note: a broker (pid {holder or 'unknown'}) holds {data_dir}; "
              "verifying while it writes", file=sys.stderr)
    try:
        seed, node_pk, topics = _catalog(data_dir)
    except Exception as exc:
        print(f"BAD catalog - - {exc}")
        return 1
    own = [(name, p, partition_dir(data_dir, name, p)) for name in sorted(topics)
           if topic is None or name == topic for p in range(topics[name].partitions)]
    planned = [os.path.join(data_dir, CATALOG_DIR)] + [path for _n, _p, path in own]
    planned += _mirror_dirs(data_dir, topic)
    prog = Progress("verify", sum(_log_bytes(d) for d in planned), items_total=len(planned),
                    interval=progress_interval)

    def say(line: str) -> None:
        prog.clear()  # the bar shares the terminal with these lines
        print(line, flush=True)

    failures = 0
    cat = verify_partition(os.path.join(data_dir, CATALOG_DIR), node_pk, progress=prog)
    prog.item_done()
    if not cat.ok:
        say(f"BAD __catalog 0 {cat.first_bad_offset} {cat.reason}")
        failures += 1
    if topic is not None and topic not in topics:
        say(f"BAD {topic} - - unknown topic")
        prog.finish()
        return 1
    for name, p, path in own:
        if not os.path.isdir(path):
            say(f"ok {name} {p} 0 blocks (never written)")
            prog.item_done()
            continue
        pk = derive_keypair(seed, partition_key_name(topics[name].topic_id, p)).public_key
        signer, why = _signer(path, pk, topics[name].archive_keys[p:p + 1])
        if why:
            failures += 1
            say(f"BAD {name} {p} - {why}")
            prog.item_done()
            continue
        res = verify_partition(path, signer, progress=prog)
        prog.item_done()
        if res.ok:
            say(f"ok {name} {p} {res.length} blocks, {res.signed_length} signed"
                + (f", {res.compacted} compacted away (leaf hashes checked)" if res.compacted else ""))
        else:
            failures += 1
            say(f"BAD {name} {p} {res.first_bad_offset} {res.reason}")
    failures += _verify_mirrors(data_dir, topic, prog, say)
    prog.finish()
    return 1 if failures else 0


def _signer(path: str, public_key: bytes | None,
            listed: Sequence[bytes]) -> tuple[HeadSigner, str | None]:
    """What the archive in `path` is checked against: its `manifest` file when it is
    quorum-signed, else `public_key`; and why not, when the catalog lists (in `listed`)
    another archive key for it or the manifest file is unreadable."""
    try:
        manifest = read_manifest(OsFileSystem(), path)
    except (ArchiveDamaged, OSError) as exc:
        return b"", str(exc)
    signer: HeadSigner
    if manifest is not None:
        signer, what = manifest, "manifest"
    elif public_key is not None:
        signer, what = public_key, "signer key"
    else:
        return b"", "no signer key and no manifest"
    if listed and head_manifest(signer).hash() != listed[0]:
        return signer, f"{what} does not match the catalog's archive key"
    return signer, None


def _log_bytes(path: str) -> int:
    """The bytes of an archive's segments: what verifying it reads (its progress total)."""
    try:
        return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".log"))
    except OSError:
        return 0


def _mirror_dirs(data_dir: str, topic: str | None) -> list[str]:
    """The archive directories `_verify_mirrors` will look at (for the progress total)."""
    root = os.path.join(data_dir, MIRRORS_DIR)
    if not os.path.isdir(root):
        return []
    out = []
    for node in sorted(os.listdir(root)):
        node_dir = os.path.join(root, node)
        if not os.path.isdir(node_dir):
            continue
        for d in sorted(os.listdir(node_dir)):
            if d == CATALOG_DIR or (
                    (os.path.exists(os.path.join(node_dir, d, PUBLIC_KEY_FILE))
                     or os.path.exists(os.path.join(node_dir, d, MANIFEST_FILE)))
                    and (topic is None or d.rsplit("-", 1)[0] == topic)):
                out.append(os.path.join(node_dir, d))
    return out


def _verify_mirrors(data_dir: str, topic: str | None, prog: Progress,
                    say: Callable[[str], None]) -> int:
    """Every archive this node mirrors (FORMAT.md section 10), each against its writer's
    key: the catalog against the node key in the directory name, each partition against
    the signer key recorded beside it, which must hash to the catalog's archive key.
    Lines are prefixed `mirror:<first 16 hex of the node key>`."""
    root = os.path.join(data_dir, MIRRORS_DIR)
    if not os.path.isdir(root):
        return 0
    failures = 0
    for name in sorted(os.listdir(root)):
        node_dir = os.path.join(root, name)
        try:
            node_pk = bytes.fromhex(name)
        except ValueError:
            continue
        if len(node_pk) != 32 or not os.path.isdir(node_dir):
            continue
        tag = f"mirror:{name[:16]}"
        cat_dir = os.path.join(node_dir, CATALOG_DIR)
        topics: dict[str, TopicRecord] = {}
        cat = verify_partition(cat_dir, node_pk, progress=prog)
        prog.item_done()
        evidence = check_evidence(cat_dir, node_pk)
        if evidence:
            say(f"BAD {tag}/__catalog 0 - {evidence}")
            failures += 1
        if not cat.ok:
            say(f"BAD {tag}/__catalog 0 {cat.first_bad_offset} {cat.reason}")
            failures += 1
            continue
        for batch in signed_batches(cat_dir, node_pk):
            for change in decode_changes(batch):
                apply_change(topics, change)
        for tname in sorted(topics):
            if topic is not None and tname != topic:
                continue
            rec = topics[tname]
            for p in range(rec.partitions):
                path = os.path.join(node_dir, f"{tname}-{p}")
                kfile = os.path.join(path, PUBLIC_KEY_FILE)
                if not os.path.exists(kfile) and not os.path.exists(os.path.join(path, MANIFEST_FILE)):
                    continue  # not mirrored (yet)
                key_bytes = None
                if os.path.exists(kfile):
                    with open(kfile, "rb") as f:
                        key_bytes = f.read()
                pk, why = _signer(path, key_bytes, rec.archive_keys[p:p + 1])
                if why:
                    say(f"BAD {tag}/{tname} {p} - {why}")
                    failures += 1
                    prog.item_done()
                    continue
                evidence = check_evidence(path, pk)
                if evidence:
                    say(f"BAD {tag}/{tname} {p} - {evidence}")
                    failures += 1
                res = verify_partition(path, pk, progress=prog)
                prog.item_done()
                if res.ok:
                    say(f"ok {tag}/{tname} {p} {res.length} blocks, {res.signed_length} signed"
                        + (f", {res.compacted} compacted away (leaf hashes checked)"
                           if res.compacted else ""))
                else:
                    failures += 1
                    say(f"BAD {tag}/{tname} {p} {res.first_bad_offset} {res.reason}")
    return failures


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

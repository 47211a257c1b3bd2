"""Hypothesis: random appends/commits/crashes against a model of what must survive.

Invariants after every crash + reopen:
  * what the log serves is a byte-exact prefix of what was appended (nothing invented);
  * everything acknowledged survives when the policy is `always` or only the process died;
  * the head signs exactly the tree of what is served, and offline verify agrees;
  * the fork increases by one exactly when a relaxed (`interval`/`never`) writer lost
    power (the machine rebooted), and never otherwise.
"""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from storage_testutil import KEYPAIR, split_batches, tree_hash_of

import storage.format as fmt_mod
from storage import FsyncPolicy, LogConfig, PartitionLog
from storage.batch import build_batch
from storage.fs import FaultyFileSystem
from storage.hypercore import verify_head
from storage.verify import verify_partition

op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4), st.integers(0, 600)),
    st.tuples(st.just("commit"), st.booleans()),
    st.tuples(st.just("crash"), st.sampled_from(["drop", "tear", "keep"]), st.booleans()),
    st.tuples(st.just("reopen")),
)


def served(lg):
    out, off = [], lg.log_start_offset
    while off < lg.high_watermark:
        r = lg.read(off, 1 << 30)
        out += split_batches(r.read())
        off = r.end_offset
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(list(FsyncPolicy)),
    segment_bytes=st.sampled_from([700, 1 << 20]),
    flush_ms=st.sampled_from([0, 10**9]),
    ops=st.lists(op, min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_crash_recovery_matches_model(policy, segment_bytes, flush_ms, ops, seed):
    boot = [bytes([1]) * 16]
    orig_boot = fmt_mod.BOOT_ID
    fmt_mod.BOOT_ID = boot[0]
    try:
        with tempfile.TemporaryDirectory() as d:
            fs = FaultyFileSystem(seed)
            cfg = LogConfig(segment_bytes=segment_bytes, flush_interval_ms=flush_ms)

            def reopen():
                return PartitionLog.open(d, KEYPAIR, fsync=policy, config=cfg, fs=fs)

            lg = reopen()
            written: list[bytes] = []
            acked = 0
            n = 0
            clean = True  # the head on disk carries the clean-shutdown flag
            for o in ops:
                if o[0] == "append":
                    for _ in range(o[1]):
                        b = build_batch([bytes([n % 251]) * o[2], b"k"], timestamp_ms=n)
                        lg.append(b)
                        written.append(bytes(b))
                        n += 1
                elif o[0] == "commit":
                    h = lg.commit(force_sync=o[1])
                    acked = len(written)
                    if h is not None:
                        clean = False
                    assert h is None or lg.high_watermark == h.next_offset
                    assert served(lg) == written
                elif o[0] == "reopen":
                    lg.close()
                    lg = reopen()
                    assert served(lg) == written and lg.damage is None
                    acked = len(written)
                    clean = True
                else:
                    _, mode, reboot = o
                    fork_before = lg.fork
                    power_loss = mode != "keep"
                    fs.crash(mode)
                    if power_loss or reboot:
                        boot[0] = bytes([boot[0][0] + 1]) * 16
                        fmt_mod.BOOT_ID = boot[0]
                    lg = reopen()
                    assert lg.damage is None
                    got = served(lg)
                    assert got == written[: len(got)]  # a prefix, byte for byte
                    if policy is FsyncPolicy.ALWAYS or not power_loss:
                        assert len(got) >= acked
                    if not power_loss:
                        assert got == written  # the page cache survived
                    # a clean close signed nothing afterwards: nothing can have been lost
                    relaxed_reboot = ((power_loss or reboot) and policy is not FsyncPolicy.ALWAYS
                                      and not clean)
                    assert lg.fork == fork_before + (1 if relaxed_reboot else 0)
                    head = lg.head
                    assert head is not None and head.fork == lg.fork
                    assert head.tree_hash == tree_hash_of(got)
                    assert head.length == len(got)
                    if head.length:
                        assert verify_head(KEYPAIR.public_key, lg.key, head.tree_hash,
                                           head.length, head.fork, head.signature)
                    if relaxed_reboot or len(got) > acked:
                        clean = False  # recovery signed and wrote a head
                    written = got
                    acked = len(got)
            lg.close()
            res = verify_partition(d, KEYPAIR.public_key)
            assert res.ok, res
            lg = reopen()
            assert served(lg) == written
            lg.close()
    finally:
        fmt_mod.BOOT_ID = orig_boot

"""Process-wide counters and latency histograms of the storage work that runs in worker
threads (leaf hashing, signing, fsync), read by the broker's /metrics (broker/metrics.py).

Owns `Histogram` and `Counter`, both safe to update from any thread: one uncontended lock
per observation (a commit, a sync, a signature), never per record, so the cost stays far
below the work measured. Imports nothing from the broker.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

# Seconds: from a page-cache fsync (tens of microseconds) to a stalled disk (seconds).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense (`snapshot` gives per-bucket
    counts; the renderer accumulates them)."""

    __slots__ = ("_lock", "bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value
            self.count += 1

    def snapshot(self) -> tuple[list[int], float, int]:
        with self._lock:
            return list(self.counts), self.sum, self.count


class Counter:
    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


SIGN_SECONDS = Histogram()  # one ed25519 signature over a new head (writer commits)
FSYNC_SECONDS = Histogram()  # the fsyncs of one commit or one background interval sync
LEAF_HASHED_BYTES = Counter()  # batch bytes read back and leaf-hashed by commit jobs

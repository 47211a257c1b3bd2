"""Idempotent producer state: what Kafka's ProducerStateManager keeps, per partition.

Theory of operation. A producer that called InitProducerId stamps every batch with
(producerId, epoch, baseSequence). Per partition the broker remembers, for each producer,
its epoch and the metadata of its last five batches (first/last sequence, first/last
offset). A new batch is, in this order:

- from an older epoch than we know: INVALID_PRODUCER_EPOCH (fenced);
- a retry of one of the last five batches (same epoch, same sequence range): a
  duplicate, acknowledged with the offsets it was first given, and not appended again;
- from a newer epoch: accepted only if it starts at sequence 0;
- otherwise accepted only if it continues the last sequence exactly (with wrap-around
  at 2**31-1), else OUT_OF_ORDER_SEQUENCE_NUMBER.

A producer this partition has never seen (or whose state expired) may start at any
sequence, as Kafka allows after retention removed its batches. `check` is pure and
`record` applies an accepted batch; the caller appends between the two without
yielding, so checks and appends are serialised per partition.

The state is rebuilt on open from the batch headers already in the log, so it survives
a restart without a snapshot file.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1
NO_PRODUCER_ID = -1
KEPT_BATCHES = 5  # Kafka's ProducerStateEntry.NUM_BATCHES_TO_RETAIN


class Verdict(enum.Enum):
    APPEND = "append"
    DUPLICATE = "duplicate"
    FENCED = "fenced"  # INVALID_PRODUCER_EPOCH
    OUT_OF_ORDER = "out_of_order"  # OUT_OF_ORDER_SEQUENCE_NUMBER


@dataclass(frozen=True, slots=True)
class BatchMeta:
    first_seq: int
    last_seq: int
    first_offset: int
    last_offset: int
    timestamp: int


@dataclass(slots=True)
class ProducerEntry:
    epoch: int
    batches: deque[BatchMeta] = field(default_factory=lambda: deque(maxlen=KEPT_BATCHES))
    last_timestamp: int = -1

    @property
    def last_seq(self) -> int:
        return self.batches[-1].last_seq if self.batches else -1


@dataclass(frozen=True, slots=True)
class Outcome:
    verdict: Verdict
    duplicate_of: BatchMeta | None = None
    message: str | None = None


def last_sequence(base_sequence: int, last_offset_delta: int) -> int:
    seq = base_sequence + last_offset_delta
    return seq - INT32_MAX - 1 if seq > INT32_MAX else seq


def _in_sequence(last_seq: int, next_seq: int) -> bool:
    return next_seq == last_seq + 1 or (next_seq == 0 and last_seq == INT32_MAX)


class ProducerStates:
    """The idempotence state of one partition."""

    def __init__(self) -> None:
        self._producers: dict[int, ProducerEntry] = {}

    def __len__(self) -> int:
        return len(self._producers)

    def items(self) -> list[tuple[int, ProducerEntry]]:
        """(producer id, state) of every producer remembered (DescribeProducers)."""
        return list(self._producers.items())

    def entry(self, producer_id: int) -> ProducerEntry | None:
        return self._producers.get(producer_id)

    def check(self, producer_id: int, epoch: int, first_seq: int, last_seq: int) -> Outcome:
        entry = self._producers.get(producer_id)
        if entry is None:
            return Outcome(Verdict.APPEND)
        if epoch < entry.epoch:
            return Outcome(
                Verdict.FENCED,
                message=f"Producer {producer_id} epoch {epoch} is older than the current epoch {entry.epoch}",
            )
        if epoch == entry.epoch:
            for meta in entry.batches:
                if meta.first_seq == first_seq and meta.last_seq == last_seq:
                    return Outcome(Verdict.DUPLICATE, duplicate_of=meta)
            if entry.batches and not _in_sequence(entry.last_seq, first_seq):
                return Outcome(
                    Verdict.OUT_OF_ORDER,
                    message=f"Out of order sequence number for producer {producer_id}: "
                    f"{first_seq} (incoming seq. number), {entry.last_seq} (current end sequence number)",
                )
            return Outcome(Verdict.APPEND)
        if first_seq != 0:
            return Outcome(
                Verdict.OUT_OF_ORDER,
                message=f"Invalid sequence number for new epoch of producer {producer_id}: "
                f"{epoch} (request epoch), {first_seq} (seq. number), {entry.epoch} (current producer epoch)",
            )
        return Outcome(Verdict.APPEND)

    def record(
        self,
        producer_id: int,
        epoch: int,
        first_seq: int,
        last_seq: int,
        first_offset: int,
        last_offset: int,
        timestamp: int,
    ) -> None:
        entry = self._producers.get(producer_id)
        if entry is None or entry.epoch != epoch:
            entry = ProducerEntry(epoch)
            self._producers[producer_id] = entry
        entry.batches.append(BatchMeta(first_seq, last_seq, first_offset, last_offset, timestamp))
        entry.last_timestamp = max(entry.last_timestamp, timestamp)

    def fence(self, producer_id: int, epoch: int, timestamp: int = -1) -> None:
        """A transaction marker with `epoch` was written for this producer: an older epoch
        is fenced from now on (a newer epoch starts at sequence 0, as after InitProducerId)."""
        entry = self._producers.get(producer_id)
        if entry is None or entry.epoch < epoch:
            last = -1 if entry is None else entry.last_timestamp
            entry = self._producers[producer_id] = ProducerEntry(epoch)
            entry.last_timestamp = max(last, timestamp)

    def rebuild(self, headers: Iterable[tuple[int, int, int, int, int, int]]) -> None:
        """Replay (producer_id, epoch, base_sequence, last_offset_delta, base_offset,
        max_timestamp) for every stored batch, oldest first."""
        for producer_id, epoch, base_seq, last_delta, base_offset, max_ts in headers:
            if producer_id < 0:
                continue
            if base_seq < 0:  # a transaction marker: its epoch fences older ones
                self.fence(producer_id, epoch, max_ts)
                continue
            self.record(
                producer_id,
                epoch,
                base_seq,
                last_sequence(base_seq, last_delta),
                base_offset,
                base_offset + last_delta,
                max_ts,
            )

    def expire(self, now_ms: int, max_idle_ms: int) -> int:
        """Forget producers idle for longer than producer.id.expiration.ms."""
        stale = [pid for pid, e in self._producers.items() if now_ms - e.last_timestamp > max_idle_ms]
        for pid in stale:
            del self._producers[pid]
        return len(stale)

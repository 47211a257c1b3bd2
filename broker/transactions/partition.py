"""One partition's transactions: open transactions, aborted ones, the last stable offset.

What Kafka's ProducerStateManager (ongoing transactions) and TransactionIndex (aborted
transactions) keep, per partition. A transactional data batch opens its producer's
transaction here at its base offset unless one is open; a marker (control batch) closes
it, and an ABORT marker records (producer id, first offset, marker offset) as an aborted
transaction.

The last stable offset (LSO) is the smallest first offset of a transaction not yet
closed by a durable marker, or the high watermark if none is open: read_committed
consumers read below it. A marker is admitted before a head covers it, so a closed
transaction keeps the LSO down (`_closing`) until the high watermark passes its marker;
an abort is listed at once (a fetch only ever sees it with the range it covers).

Coordinator epochs (Kafka's ProducerStateEntry.coordinatorEpoch): each marker carries the
epoch of the transaction coordinator that sent it (in its control record's value), and
the partition keeps, per producer id, the newest one it wrote. A marker with an older
coordinator epoch comes from a coordinator that lost the transactional id since (a
paused one): `coordinator_fenced` says so, and the marker is refused
(TRANSACTION_COORDINATOR_FENCED) before anything is written, as Kafka's leaders do.

Rebuilt on open from the batch headers in the log (markers are read for their type and
coordinator epoch),
as the idempotence state is, so it survives a restart without a snapshot. A mirror's copy
has no admissions: `last_stable_offset` takes in the batches it verified since (`follow`). Pure: no trio,
no I/O except the `rebuild` reader given.
"""

from __future__ import annotations

import bisect
import logging
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.protocol.errors import RecordBatchError
from broker.protocol.records import iter_records
from broker.transactions.records import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    MarkerType,
    marker_coordinator_epoch,
    marker_type,
)
from storage.errors import StorageError

if TYPE_CHECKING:
    from broker.node import Partition
    from storage import PartitionLog

log = logging.getLogger("hyperkafka.transactions")


@dataclass(frozen=True, slots=True)
class Aborted:
    producer_id: int
    first_offset: int
    last_offset: int  # the ABORT marker's offset


class PartitionTxns:
    def __init__(self) -> None:
        self.ongoing: dict[int, int] = {}  # producer id -> first offset of its open transaction
        self._closing: list[tuple[int, int]] = []  # (marker offset, first offset) not yet durable
        self._aborted: list[Aborted] = []  # by marker offset
        self._aborted_last: list[int] = []
        self._followed = 0  # a mirror's copy: batches below this were taken in (`follow`)
        # producer id -> the newest coordinator epoch of its markers here (none: -1)
        self.coordinator_epochs: dict[int, int] = {}

    def on_data(self, producer_id: int, base_offset: int) -> None:
        """A transactional data batch was admitted at `base_offset`."""
        self.ongoing.setdefault(producer_id, base_offset)

    def coordinator_fenced(self, producer_id: int, coordinator_epoch: int) -> bool:
        """Whether a marker of `producer_id` from a coordinator at `coordinator_epoch` is
        a stale coordinator's: a newer coordinator's marker for it was written here
        (Kafka's checkCoordinatorEpoch; an equal epoch is the same coordinator's retry)."""
        return self.coordinator_epochs.get(producer_id, -1) > coordinator_epoch

    def on_marker(
        self, producer_id: int, marker: MarkerType, marker_offset: int, coordinator_epoch: int = -1
    ) -> None:
        if coordinator_epoch > self.coordinator_epochs.get(producer_id, -1):
            self.coordinator_epochs[producer_id] = coordinator_epoch
        first = self.ongoing.pop(producer_id, None)
        if first is None:
            return  # nothing of this transaction here (or retried marker): nothing to close
        self._closing.append((marker_offset, first))
        if marker is MarkerType.ABORT:
            self._aborted.append(Aborted(producer_id, first, marker_offset))
            self._aborted_last.append(marker_offset)

    def follow(self, plog: PartitionLog) -> None:
        """A mirror's copy (no admissions here): take in the batches verified since the
        last call, up to the high watermark."""
        hwm = plog.high_watermark
        start = max(self._followed, plog.log_start_offset)
        if start >= hwm:
            return
        self.rebuild(_headers_below(plog, start, hwm), _marker_reader(plog))
        self._followed = hwm

    def lso(self, high_watermark: int) -> int:
        if self._closing:
            self._closing = [(m, f) for m, f in self._closing if m >= high_watermark]
        lso = high_watermark
        for first in self.ongoing.values():
            lso = min(lso, first)
        for _, first in self._closing:
            lso = min(lso, first)
        return lso

    def aborted_in(self, fetch_offset: int, upper: int) -> list[Aborted]:
        """Aborted transactions that a read of [fetch_offset, upper) may hold records of
        (Kafka's collectAbortedTxns: last offset >= fetch offset, first offset < upper)."""
        i = bisect.bisect_left(self._aborted_last, fetch_offset)
        return [a for a in self._aborted[i:] if a.first_offset < upper]

    def forget_below(self, log_start: int) -> None:
        """Retention dropped everything below `log_start`: so are its aborted transactions."""
        i = bisect.bisect_left(self._aborted_last, log_start)
        if i:
            del self._aborted[:i]
            del self._aborted_last[:i]

    def rebuild(
        self, headers: Iterable[bytes], marker_at: Callable[[int], tuple[MarkerType, int] | None]
    ) -> None:
        """Replay the raw 61-byte headers of the stored batches, oldest first;
        `marker_at(offset)` reads the type and coordinator epoch of the control batch at
        that offset."""
        for header in headers:
            attributes = struct.unpack_from(">h", header, 21)[0]
            if not attributes & ATTR_TRANSACTIONAL:
                continue
            base_offset = struct.unpack_from(">q", header, 0)[0]
            producer_id = struct.unpack_from(">q", header, 43)[0]
            if attributes & ATTR_CONTROL:
                read = marker_at(base_offset)
                if read is not None:
                    self.on_marker(producer_id, read[0], base_offset, read[1])
            else:
                self.on_data(producer_id, base_offset)
        self._closing.clear()  # every marker replayed is stored and under a signed head


def _marker_reader(plog: PartitionLog) -> Callable[[int], tuple[MarkerType, int] | None]:
    def marker_at(offset: int) -> tuple[MarkerType, int] | None:
        try:
            batch = plog.read_bytes(offset, 1)
            for rec in iter_records(batch):
                kind = marker_type(rec.key)
                return None if kind is None else (kind, marker_coordinator_epoch(rec.value))
        except (StorageError, RecordBatchError, OSError) as exc:
            log.warning("no marker readable at offset %d: %s", offset, exc)
        return None

    return marker_at


def _headers_below(plog: PartitionLog, start: int, end: int) -> Iterator[bytes]:
    for header in plog.batch_headers(start):
        base = struct.unpack_from(">q", header, 0)[0]
        last = base + struct.unpack_from(">i", header, 23)[0]
        if base >= end:
            return
        if last >= start:
            yield header


def rebuild_txns(plog: PartitionLog) -> PartitionTxns:
    """The transactions of a partition archive, from what it stores; a copy that then
    follows its writer (`follow`) takes in only the batches after those."""
    txns = PartitionTxns()
    end = plog.log_start_offset

    def headers() -> Iterator[bytes]:
        nonlocal end
        for header in plog.batch_headers(plog.log_start_offset):
            end = struct.unpack_from(">q", header, 0)[0] + struct.unpack_from(">i", header, 23)[0] + 1
            yield header

    txns.rebuild(headers(), _marker_reader(plog))
    txns._followed = end
    return txns


def last_stable_offset(partition: Partition) -> int:
    """The partition's LSO; a copy this broker does not write (a mirrored partition no
    failover made it lead, or a quorum-signed one whose leader it was until a failover
    deposed it: its log is a replica's) first takes in what it verified since. A
    partition written here knows its transactions as it admits them."""
    if (partition.topic.mirrored and not partition.led) or partition.log.replica:
        partition.txns.follow(partition.log)
    return partition.txns.lso(partition.log.high_watermark)

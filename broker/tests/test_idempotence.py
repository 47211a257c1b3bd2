"""The idempotent-producer rules, checked against Kafka's ProducerStateManager semantics."""

from hypothesis import given
from hypothesis import strategies as st

from broker.idempotence import INT32_MAX, ProducerStates, Verdict, last_sequence


def appended(states: ProducerStates, pid: int, epoch: int, first: int, count: int, offset: int) -> None:
    last = last_sequence(first, count - 1)
    assert states.check(pid, epoch, first, last).verdict is Verdict.APPEND
    states.record(pid, epoch, first, last, offset, offset + count - 1, 0)


def test_in_sequence_batches_append() -> None:
    s = ProducerStates()
    appended(s, 7, 0, 0, 3, 0)
    appended(s, 7, 0, 3, 2, 3)
    assert s.entry(7) is not None and s.entry(7).last_seq == 4  # type: ignore[union-attr]


def test_retry_of_a_recent_batch_is_a_duplicate_with_its_original_offsets() -> None:
    s = ProducerStates()
    for i in range(5):
        appended(s, 1, 0, i * 10, 10, 100 + i * 10)
    outcome = s.check(1, 0, 20, 29)
    assert outcome.verdict is Verdict.DUPLICATE
    assert outcome.duplicate_of is not None
    assert (outcome.duplicate_of.first_offset, outcome.duplicate_of.last_offset) == (120, 129)


def test_only_the_last_five_batches_are_remembered() -> None:
    s = ProducerStates()
    for i in range(6):
        appended(s, 1, 0, i, 1, i)
    assert s.check(1, 0, 0, 0).verdict is Verdict.OUT_OF_ORDER  # batch 0 fell out
    assert s.check(1, 0, 1, 1).verdict is Verdict.DUPLICATE


def test_gap_is_out_of_order() -> None:
    s = ProducerStates()
    appended(s, 1, 0, 0, 5, 0)
    outcome = s.check(1, 0, 6, 6)
    assert outcome.verdict is Verdict.OUT_OF_ORDER
    assert outcome.message and "6" in outcome.message


def test_older_epoch_is_fenced_and_new_epoch_must_start_at_zero() -> None:
    s = ProducerStates()
    appended(s, 1, 3, 0, 1, 0)
    assert s.check(1, 2, 1, 1).verdict is Verdict.FENCED
    assert s.check(1, 4, 5, 5).verdict is Verdict.OUT_OF_ORDER
    assert s.check(1, 4, 0, 0).verdict is Verdict.APPEND


def test_unknown_producer_may_start_anywhere() -> None:
    # As Kafka after retention removed the producer's batches.
    assert ProducerStates().check(9, 0, 1234, 1240).verdict is Verdict.APPEND


def test_sequence_wraps_at_int32_max() -> None:
    s = ProducerStates()
    appended(s, 1, 0, INT32_MAX - 1, 2, 0)
    assert s.entry(1).last_seq == INT32_MAX  # type: ignore[union-attr]
    assert s.check(1, 0, 0, 0).verdict is Verdict.APPEND
    assert last_sequence(INT32_MAX, 1) == 0


def test_rebuild_from_headers_matches_live_state() -> None:
    live = ProducerStates()
    headers = []
    offset = 0
    for pid, epoch, count in [(1, 0, 3), (2, 0, 1), (1, 0, 2), (1, 1, 4)]:
        entry = live.entry(pid)
        first = 0 if entry is None or entry.epoch != epoch else entry.last_seq + 1
        appended(live, pid, epoch, first, count, offset)
        headers.append((pid, epoch, first, count - 1, offset, 0))
        offset += count
    headers.append((-1, -1, -1, 0, offset, 0))  # non-idempotent batches are skipped
    rebuilt = ProducerStates()
    rebuilt.rebuild(headers)
    for pid in (1, 2):
        assert rebuilt.entry(pid) == live.entry(pid)


@given(st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=30))
def test_every_retry_of_the_last_five_is_recognised(counts: list[int]) -> None:
    s = ProducerStates()
    seq = offset = 0
    ranges = []
    for count in counts:
        appended(s, 5, 0, seq, count, offset)
        ranges.append((seq, seq + count - 1, offset))
        seq += count
        offset += count
    for first, last, off in ranges[-5:]:
        outcome = s.check(5, 0, first, last)
        assert outcome.verdict is Verdict.DUPLICATE
        assert outcome.duplicate_of is not None and outcome.duplicate_of.first_offset == off
    assert s.check(5, 0, seq, seq).verdict is Verdict.APPEND

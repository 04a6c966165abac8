"""Batch sizing by free device memory and the NVML affinity mask (pure logic, no GPU)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.gpu.buckets import BUCKETS, bucket_for
from scratchd.workers.gpu_memory import CHUNK_COST_MS, BatchSizer, cpus_from_mask, split_batch

SIZE = (1024, 1024)
GIB = 1024**3


class Card:
    """A card whose free memory the test sets (another process taking memory)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self) -> int:
        return self.free


def sizer(card: Card, max_batch: int = 16, reserve: int = GIB) -> BatchSizer:
    s = BatchSizer((1, 2, 4, 8, 16), max_batch, reserve, card)
    s.measured(SIZE, {1: 2 * GIB + 100, 2: 4 * GIB + 100})  # 2 GiB a frame, 100 B fixed
    return s


def test_measured_splits_per_frame_and_fixed_bytes() -> None:
    s = sizer(Card(0))
    assert s.per_frame[SIZE] == 2 * GIB
    assert s.fixed[SIZE] == 100
    assert s.need_bytes(SIZE, 8) == 16 * GIB + 100


def test_limit_is_the_largest_bucket_that_fits_beside_the_reserve() -> None:
    card = Card(17 * GIB + 100)  # 8 frames (16 GiB) + reserve (1 GiB) fit; 16 do not
    assert sizer(card).limit(SIZE) == 8
    card.free = 1000 * GIB
    assert sizer(card).limit(SIZE) == 16
    assert sizer(card, max_batch=5).limit(SIZE) == 4


def test_another_process_taking_memory_shrinks_the_limit_but_held_graphs_still_serve() -> None:
    card = Card(1000 * GIB)
    s = sizer(card)
    s.hold(SIZE, 4)
    assert s.limit(SIZE) == 16
    card.free = 0  # someone took everything
    assert s.limit(SIZE) == 4  # buckets 1, 2, 4 are held (their memory is ours)
    assert not s.usable(SIZE, 8)


def test_nothing_fits_and_nothing_held_still_allows_one() -> None:
    s = BatchSizer((1, 2, 4), 4, GIB, Card(0))
    assert s.limit() == 1  # nothing measured yet
    s.measured((32, 32), {1: GIB})  # another size is held; for SIZE no bucket fits or is held
    assert not s.usable(SIZE, 1)
    assert s.limit(SIZE) == 1


def test_an_out_of_memory_capture_is_refused_for_a_while() -> None:
    card = Card(1000 * GIB)
    s = sizer(card)
    s.refuse(SIZE, 16)
    assert s.oom_refusals == 1
    assert s.limit(SIZE) == 8
    assert s.usable(SIZE, 16, now=1e12)  # long after RETRY_AFTER_S


def test_claim_time_limit_uses_the_most_demanding_measured_size() -> None:
    card = Card(9 * GIB + 100)
    s = sizer(card)
    s.measured((64, 64), {1: 1000, 2: 2000})
    assert s.limit() == s.limit(SIZE) == 4  # 4 x 2 GiB + 100 B + 1 GiB reserve fit exactly


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        BatchSizer((1, 2), 0, 0, Card(0))
    with pytest.raises(ValueError, match="increasing"):
        BatchSizer((2, 1), 4, 0, Card(0))


@given(st.lists(st.integers(0, 2**64 - 1), max_size=4))
def test_cpus_from_mask_reads_every_set_bit(words: list[int]) -> None:
    cpus = cpus_from_mask(words)
    for cpu in range(64 * len(words)):
        assert (cpu in cpus) == bool((words[cpu // 64] >> (cpu % 64)) & 1)


@given(st.integers(0, 200), st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_split_batch_covers_every_frame_within_the_limit(n: int, limit: int) -> None:
    chunks = split_batch(n, limit, BUCKETS)
    assert sum(chunks) == n
    assert all(0 < c <= limit for c in chunks)
    assert chunks == sorted(chunks, reverse=True)
    # by size alone, no frame is padded: every chunk fills its bucket
    assert all(bucket_for(c) == c for c in chunks)


def compositions(n: int, cap: int) -> list[list[int]]:
    if n == 0:
        return [[]]
    return [[m, *rest] for m in range(1, min(n, cap) + 1) for rest in compositions(n - m, cap)]


@given(
    st.integers(0, 10),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.lists(st.floats(0.1, 10.0), min_size=5, max_size=5),
)
def test_split_batch_is_the_cheapest_split_by_measured_cost(
    n: int, limit: int, per: list[float]
) -> None:
    # a measured device time per bucket that grows with the bucket, as a real graph's does
    ms = dict(zip(BUCKETS, itertools.accumulate(per), strict=True))
    chunks = split_batch(n, limit, BUCKETS, ms.__getitem__)

    def total(split: list[int]) -> float:
        return sum(ms[bucket_for(m)] + CHUNK_COST_MS for m in split)

    assert sum(chunks) == n and all(c <= limit for c in chunks)
    cheapest = min(total(c) for c in compositions(n, limit))
    assert total(chunks) <= cheapest + 1e-9


def test_split_batch_pads_when_the_measured_bucket_is_cheaper() -> None:
    # costs like a GPU's with one view: 16 frames cost less in one graph than 8 + 4 + 2 + 1
    ms = {1: 0.62, 2: 1.0, 4: 1.85, 8: 3.6, 16: 6.9}
    assert split_batch(15, 16, BUCKETS, ms.__getitem__) == [15]
    assert split_batch(5, 16, BUCKETS, ms.__getitem__) == [4, 1]

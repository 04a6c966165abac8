"""The timing wheel alone: nothing expires early, nothing due is missed, rounds wrap."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.ipc.wheel import NIL, TimingWheel

TICK = 1_000_000  # 1 ms
BASE = 5_000_000_000


def make_wheel(n: int, buckets: int) -> TimingWheel:
    return TimingWheel(
        np.full(buckets, NIL, np.int32),
        np.full(n, NIL, np.int32),
        np.full(n, NIL, np.int32),
        np.full(n, NIL, np.int32),
        np.zeros(n, np.int64),
        np.zeros(1, np.int64),
        base_ns=BASE,
        tick_ns=TICK,
    )


def test_far_deadline_waits_for_its_round() -> None:
    w = make_wheel(2, 8)
    w.deadline[0] = BASE + 3 * TICK + 10  # bucket 3, this revolution
    w.deadline[1] = BASE + 19 * TICK + 10  # bucket 3 too, two revolutions later
    w.insert(0)
    w.insert(1)
    assert w.expire_due(BASE + 3 * TICK + 9) == []  # same tick, but before the deadline
    assert w.expire_due(BASE + 3 * TICK + 10) == [0]
    assert w.expire_due(BASE + 11 * TICK + 50) == []  # bucket 3 visited again: not yet
    assert w.expire_due(BASE + 19 * TICK + 10) == [1]


def test_deadline_behind_the_cursor_expires_on_the_next_call() -> None:
    w = make_wheel(1, 8)
    assert w.expire_due(BASE + 100 * TICK) == []
    w.deadline[0] = BASE + 40 * TICK  # already past when inserted
    w.insert(0)
    assert w.expire_due(BASE + 100 * TICK) == [0]


def test_remove_unlinks_from_the_middle_and_head() -> None:
    w = make_wheel(3, 4)
    for i in range(3):
        w.deadline[i] = BASE + 2 * TICK
        w.insert(i)
    w.remove(1)
    w.remove(2)  # the bucket's head (inserted last)
    assert w.expire_due(BASE + 10 * TICK) == [0]
    assert (w._head_np == NIL).all()


@settings(max_examples=150, deadline=None)
@given(
    buckets=st.sampled_from([1, 2, 7, 16]),
    deadlines=st.lists(st.integers(0, 80 * TICK), min_size=1, max_size=30),
    steps=st.lists(st.integers(0, 9 * TICK), min_size=1, max_size=40),
    removals=st.sets(st.integers(0, 29)),
)
def test_expiry_matches_a_sorted_reference(
    buckets: int, deadlines: list[int], steps: list[int], removals: set[int]
) -> None:
    """Each call returns exactly the live entries whose deadline is ≤ now: so nothing is
    expired early, and an entry is expired by the first call at or after its deadline
    (with a call every tick, that is within one tick)."""
    n = len(deadlines)
    w = make_wheel(n, buckets)
    for i, d in enumerate(deadlines):
        w.deadline[i] = BASE + d
        w.insert(i)
    live = set(range(n))
    for i in removals & live:
        w.remove(i)
        live.discard(i)
    now = BASE
    for step in steps:
        now += step
        got = w.expire_due(now)
        want = {i for i in live if BASE + deadlines[i] <= now}
        assert sorted(got) == sorted(want)
        live -= want
        for i in live:
            assert BASE + deadlines[i] > now
    w.rebuild(live)  # a rebuilt wheel holds exactly the live entries
    assert sorted(w.expire_due(BASE + 10**12)) == sorted(live)

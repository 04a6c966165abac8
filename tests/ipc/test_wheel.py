"""The timing wheel (C, ``_native.Core``), driven through the queue that uses it: nothing
expires early, nothing due is missed, rounds wrap, unlinks and rebuilds keep it exact."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Geometry, RequestQueue

TICK = NS_PER_MS  # the queue's tick_ms = 1


@contextlib.contextmanager
def wheel(n: int, buckets: int) -> Iterator[tuple[RequestQueue, int]]:
    """A queue of ``n`` slots whose wheel has ``buckets`` buckets, and its clock base (tick 0;
    the wheel's cursor starts there)."""
    geometry = Geometry(slots=n, slot_bytes=1, tick_ms=1, max_workers=1, wheel_ticks=buckets)
    q = RequestQueue.create(f"/scratchd-test-wheel-{os.getpid()}", geometry)
    try:
        yield q, int(q._core.seg.header["clock_base_ns"])
    finally:
        q.close()


def insert(q: RequestQueue, rid: int, deadline_ns: int) -> None:
    """Queue request ``rid`` (its own connection ``rid``, so abandoning it removes just it)."""
    h = q.reserve()
    assert h is not None
    q.submit(
        h, request_id=rid, conn_id=rid, priority=rid % 8, part_class=0,
        deadline_ns=deadline_ns, height=1, width=1, want_mask=False,
    )  # fmt: skip


def expire(q: RequestQueue, now_ns: int) -> list[int]:
    return [c.request_id for c in q.expire_due(now_ns)]


def test_far_deadline_waits_for_its_round() -> None:
    with wheel(2, 8) as (q, base):
        insert(q, 0, base + 3 * TICK + 10)  # bucket 3, this revolution
        insert(q, 1, base + 19 * TICK + 10)  # bucket 3 too, two revolutions later
        assert expire(q, base + 3 * TICK + 9) == []  # same tick, but before the deadline
        assert expire(q, base + 3 * TICK + 10) == [0]
        assert expire(q, base + 11 * TICK + 50) == []  # bucket 3 visited again: not yet
        assert expire(q, base + 19 * TICK + 10) == [1]


def test_deadline_behind_the_cursor_expires_on_the_next_call() -> None:
    with wheel(1, 8) as (q, base):
        assert expire(q, base + 100 * TICK) == []
        insert(q, 0, base + 40 * TICK)  # already past when inserted
        assert expire(q, base + 100 * TICK) == [0]


def test_remove_unlinks_from_the_middle_and_head() -> None:
    with wheel(3, 4) as (q, base):
        for rid in range(3):
            insert(q, rid, base + 2 * TICK)
        q.abandon_connection(1)
        q.abandon_connection(2)  # the bucket's head (inserted last)
        assert expire(q, base + 10 * TICK) == [0]
        assert (q._core.seg.wheel_head == -1).all()


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
    with wheel(n, buckets) as (q, base):
        for rid, d in enumerate(deadlines):
            insert(q, rid, base + d)
        live = set(range(n))
        for rid in removals & live:
            q.abandon_connection(rid)
            live.discard(rid)
        now = base
        for step in steps:
            now += step
            got = expire(q, now)
            want = {rid for rid in live if base + deadlines[rid] <= now}
            assert sorted(got) == sorted(want)
            live -= want
            for rid in live:
                assert base + deadlines[rid] > now
        with q._core.mutex:
            q._core.repair()  # a rebuilt wheel holds exactly the live entries
        assert sorted(expire(q, base + 10**12)) == sorted(live)

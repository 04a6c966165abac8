"""Submitting requests: reserve, write, submit, and what is refused."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.ipc.queue import (
    DescState,
    Handle,
    RequestQueue,
    Result,
    StaleHandle,
    Status,
)
from tests.ipc.queue_helpers import GEOMETRY, SLOTS, shm_name, submit


def test_full_queue_reserves_nothing_and_recovers(queue: RequestQueue) -> None:
    handles = [queue.reserve() for _ in range(SLOTS)]
    assert None not in handles
    assert queue.reserve() is None  # the acceptor answers 'overloaded'
    first = handles[0]
    assert first is not None
    queue.release(first)
    again = queue.reserve()
    assert again is not None and again.index == first.index
    assert again.generation == first.generation + 1  # the old handle is stale now
    with pytest.raises(StaleHandle):
        queue.payload(first)


def test_out_of_range_request_fields_are_refused_and_nothing_is_written(
    queue: RequestQueue,
) -> None:
    h = queue.reserve()
    assert h is not None
    now = time.monotonic_ns()
    bad: list[dict[str, int]] = [{"request_id": -1}, {"conn_id": 2**64}, {"priority": 8}]
    for fields in bad:
        args: dict[str, Any] = {"request_id": 1, "conn_id": 1, "priority": 0, **fields}
        with pytest.raises(ValueError):
            queue.submit(
                h, part_class=0, deadline_ns=now, height=1, width=1, want_mask=False, **args
            )
    with pytest.raises(ValueError, match="does not fit"):
        queue.submit(
            h, request_id=1, conn_id=1, priority=0, part_class=0, deadline_ns=now,
            height=5, width=5, want_mask=False,
        )  # fmt: skip
    assert queue.counts_by_state()[DescState.WRITTEN] == 1  # still the acceptor's to release
    queue.release(h)
    assert queue.counts_by_state()[DescState.FREE] == SLOTS


def test_submit_wakes_a_waiting_worker(queue: RequestQueue) -> None:
    queue.register_worker(0, os.getpid())
    start = time.monotonic()
    assert not queue.wait_for_work(0, timeout_s=0.05)  # nothing queued: sleeps, times out
    assert time.monotonic() - start >= 0.04
    woke: list[float] = []

    def worker() -> None:
        assert queue.wait_for_work(0, timeout_s=10.0)
        woke.append(time.monotonic())

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.2)  # let it fall asleep on its doorbell
    assert not woke
    submitted = time.monotonic()
    submit(queue, 1, deadline_ns=time.monotonic_ns() + 10**9)
    thread.join(5.0)
    assert woke and woke[0] - submitted < 1.0  # woken by the ring, not by the timeout


def test_input_and_result_round_trip(queue: RequestQueue) -> None:
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    h = queue.reserve()
    assert h is not None
    queue.payload(h)[: image.size] = image.tobytes()
    queue.submit(
        h, request_id=41, conn_id=9, priority=7, part_class=2,
        deadline_ns=time.monotonic_ns() + 10**9, height=3, width=4, want_mask=True,
    )  # fmt: skip
    queue.register_worker(0, os.getpid())
    (claim,) = queue.claim_batch(0, 8, time.monotonic_ns())
    view = queue.input_view(claim)
    assert (view == image).all() and not view.flags.writeable
    mask = np.zeros((3, 4), np.uint8)
    mask[1, 1:3] = 255
    boxes = [(float(i), 1.0, 2.0, 3.0, 0.5) for i in range(70)]
    result = Result(
        Status.OK, verdict_defect=True, score=0.75, boxes=boxes, entropy=0.25,
        histogram=np.arange(64, dtype=np.uint32), compute_ns=1234, batch_size=3,
        error="ß" * 150, mask=mask,
    )  # fmt: skip
    assert queue.complete(0, claim, result)
    (done,) = queue.collect_completed()
    got = done.result
    assert got is not None and done.status == Status.OK
    assert (done.request_id, done.conn_id, done.part_class, done.priority) == (41, 9, 2, 7)
    assert done.enqueue_ns <= done.claim_ns <= done.done_ns and done.worker == 0
    assert got.verdict_defect and got.score == 0.75 and got.entropy == 0.25
    assert got.boxes == boxes[:64]  # at most 64 kept
    assert (got.histogram == np.arange(64)).all()
    assert (got.compute_ns, got.batch_size) == (1234, 3)
    assert got.error == "ß" * 100  # 200 bytes of UTF-8, cut at a character boundary
    assert got.mask is not None and (got.mask == mask).all()


_U64 = st.integers(-(2**65), 2**65)
_FIELDS = st.fixed_dictionaries(
    {
        "request_id": _U64,
        "conn_id": _U64,
        "deadline_ns": st.integers(-(2**64), 2**64),
        "part_class": st.integers(-(2**33), 2**33),
        "offset": _U64,
        "region_gen": st.integers(-(2**33), 2**33),
    }
)


@settings(max_examples=200, deadline=None)
@given(fields=_FIELDS, want_mask=st.booleans(), priority=st.integers(0, 7))
def test_a_submitted_request_reads_back_as_written_or_is_refused_untouched(
    fields: dict[str, int], want_mask: bool, priority: int
) -> None:
    """Every request field is checked against its width before any is written: a request
    either reads back exactly (its claim, the descriptor's region fields) or is refused with
    ValueError, the descriptor still WRITTEN and the caller's to release."""
    q = RequestQueue.create(shm_name("fields"), GEOMETRY)
    try:
        q.register_worker(0, os.getpid())
        h = q.reserve()
        assert h is not None
        in_range = (
            0 <= fields["request_id"] < 2**64 and 0 <= fields["conn_id"] < 2**64
            and -(2**63) <= fields["deadline_ns"] < 2**63
            and -(2**31) <= fields["part_class"] < 2**31
            and 0 <= fields["offset"] < 2**64 and 0 <= fields["region_gen"] < 2**32
        )  # fmt: skip
        try:
            q.submit(
                h, request_id=fields["request_id"], conn_id=fields["conn_id"],
                priority=priority, part_class=fields["part_class"],
                deadline_ns=fields["deadline_ns"], height=2, width=3, want_mask=want_mask,
                region=(4, fields["region_gen"], fields["offset"]),
            )  # fmt: skip
        except ValueError:
            assert not in_range
            assert q.counts_by_state()[DescState.WRITTEN] == 1
            q.release(h)
            return
        assert in_range
        d = q._core.seg.descs[h.index]
        assert d["state"] == DescState.QUEUED
        read = {name: int(d[name]) for name in ("request_id", "conn_id", "deadline_ns",
                                                "part_class", "region_gen")}  # fmt: skip
        read["offset"] = int(d["region_offset"])
        assert read == fields
        assert int(d["region"]) == 5  # the row + 1 (0: the input slot)
        assert (int(d["priority"]), int(d["height"]), int(d["width"])) == (priority, 2, 3)
        assert bool(d["want_mask"]) == want_mask
    finally:
        q.close()


def _submit_one_pixel(queue: RequestQueue, handle: Handle, request_id: int) -> None:
    queue.submit(
        handle, request_id=request_id, conn_id=1, priority=0, part_class=0,
        deadline_ns=time.monotonic_ns(), height=1, width=1, want_mask=False,
    )  # fmt: skip


def test_submit_with_a_stale_handle_raises_and_writes_nothing(queue: RequestQueue) -> None:
    h = queue.reserve()
    assert h is not None
    queue.release(h)  # h is stale now: its descriptor is FREE under the next generation
    with pytest.raises(StaleHandle):
        _submit_one_pixel(queue, h, 7)
    assert queue.counts_by_state()[DescState.FREE] == SLOTS
    assert int(queue._core.seg.descs[h.index]["request_id"]) != 7


def test_submit_with_a_handle_naming_no_descriptor_raises_stale(queue: RequestQueue) -> None:
    for bogus in (Handle(-1, 0), Handle(SLOTS, 0), Handle(0, 2**40)):
        with pytest.raises(StaleHandle):
            _submit_one_pixel(queue, bogus, 1)
    assert queue.counts_by_state()[DescState.FREE] == SLOTS

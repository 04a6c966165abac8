"""The worker side: claiming, completing, the worker row, a standby's take-over."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from scratchd.ipc.queue import (
    DescState,
    QueueError,
    RequestQueue,
    Result,
    Status,
)
from tests.ipc.queue_helpers import submit


def test_malformed_result_writes_nothing(queue: RequestQueue) -> None:
    submit(queue, 1, deadline_ns=time.monotonic_ns() + 10**9)
    queue.register_worker(0, os.getpid())
    (claim,) = queue.claim_batch(0, 1, time.monotonic_ns())
    with pytest.raises(ValueError, match="mask shape"):
        queue.complete(0, claim, Result(Status.OK, mask=np.zeros((5, 5), np.uint8)))
    with pytest.raises(ValueError, match="histogram"):
        queue.complete(0, claim, Result(Status.OK, histogram=np.zeros(3, np.uint32)))
    assert queue.counts_by_state()[DescState.CLAIMED] == 1
    assert queue.complete(0, claim, Result(Status.ERROR, error="model failed"))
    (done,) = queue.collect_completed()
    assert done.status == Status.ERROR and done.result is not None
    assert done.result.error == "model failed"


def test_reclaimed_worker_cannot_claim(queue: RequestQueue) -> None:
    queue.register_worker(2, os.getpid())
    queue.reclaim_worker(2, time.monotonic_ns())
    with pytest.raises(QueueError, match="not the worker registered"):
        queue.claim_batch(2, 1, time.monotonic_ns())
    assert queue.worker_rows() == []


def test_a_gpu_worker_reports_its_arena_fragmentation_in_its_row(queue: RequestQueue) -> None:
    queue.register_worker(1, os.getpid())
    assert math.isnan(queue.worker_rows()[0].vram_frag)  # no arena reported: no number
    queue.report_device_memory(1, 0.25)
    assert queue.worker_rows()[0].vram_frag == 0.25
    queue.reclaim_worker(1, time.monotonic_ns())
    queue.register_worker(1, os.getpid() + 1)  # a replacement starts with no number
    assert math.isnan(queue.worker_rows()[0].vram_frag)


def test_a_standby_mapping_takes_a_slots_doorbell_when_handed_one(queue: RequestQueue) -> None:
    """workers.main: a standby attaches without a slot at boot; on take-over it adopts the
    slot's work doorbell, registers, and is woken by a submit like any worker."""
    standby = RequestQueue.attach(queue.name, completion_fd=queue.completion_fd)
    try:
        with pytest.raises(QueueError, match="work doorbell"):
            standby.wait_for_work(1, 0.0)  # no slot yet: nothing to wait on
        standby.adopt_work_fd(os.dup(queue.work_fd(1)))
        with pytest.raises(QueueError, match="already"):
            standby.adopt_work_fd(os.dup(queue.work_fd(1)))
        standby.register_worker(1, os.getpid())
        assert not standby.wait_for_work(1, timeout_s=0.0)
        submit(queue, 1, deadline_ns=time.monotonic_ns() + 10**9)
        assert standby.wait_for_work(1, timeout_s=5.0)
        (claim,) = standby.claim_batch(1, 4, time.monotonic_ns())
        assert claim.request_id == 1
    finally:
        standby.close()


def test_a_claim_does_not_start_a_request_that_its_batch_would_finish_late(
    queue: RequestQueue,
) -> None:
    """``lead_ns`` (the batch's expected compute): a request with less time left than that
    is answered TIMEOUT at once and leaves its place in the batch to one that can make it."""
    now = time.monotonic_ns()
    submit(queue, 1, deadline_ns=now + 5_000_000)  # 5 ms left: less than the lead
    submit(queue, 2, deadline_ns=now + 50_000_000)  # 50 ms left: enough
    submit(queue, 3, deadline_ns=now + 60_000_000)
    queue.register_worker(0, os.getpid())
    claims = queue.claim_batch(0, 2, now, lead_ns=20_000_000)
    assert [c.request_id for c in claims] == [2, 3]
    (late,) = queue.collect_completed()
    assert (late.request_id, late.status, late.result) == (1, Status.TIMEOUT, None)
    with pytest.raises(ValueError, match="negative"):
        queue.claim_batch(0, 1, now, lead_ns=-1)

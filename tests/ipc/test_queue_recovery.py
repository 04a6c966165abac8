"""Recovery: a request that kills its workers, a lock whose holder died or is busy, and
the segment's unmapping on close."""

from __future__ import annotations

import os
import signal
import time

from scratchd.ipc.queue import (
    RequestQueue,
    Status,
)
from tests.ipc.queue_helpers import GEOMETRY, shm_name, submit


def test_request_that_kills_its_workers_is_quarantined(queue: RequestQueue) -> None:
    submit(queue, 5, deadline_ns=time.monotonic_ns() + 60 * 10**9)
    for attempt in (1, 2, 3):
        queue.register_worker(1, os.getpid())
        (claim,) = queue.claim_batch(1, 1, time.monotonic_ns())
        assert claim.attempt == attempt
        report = queue.reclaim_worker(1, time.monotonic_ns(), max_kills=3)
    assert report.quarantined == [claim.handle] and not report.requeued
    (done,) = queue.collect_completed()
    assert done.status == Status.ERROR and "quarantined" in done.error


def hold_lock_in_child(queue: RequestQueue, then: str) -> int:
    """Fork a child that takes the queue's mutex, then dies holding it ('die') or lets it go
    after 0.2 s ('release'); returns when the child holds it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            queue._core.mutex.acquire()
            os.write(ready_w, b"x")
            if then == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.2)
            queue._core.mutex.release()
        finally:
            os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid


def test_a_native_operation_after_a_dead_holder_repairs_first(queue: RequestQueue) -> None:
    """The C fast path's trylock gets EOWNERDEAD: Python repairs, then the operation runs."""
    queue.register_worker(0, os.getpid())
    submit(queue, 1, deadline_ns=time.monotonic_ns() + 10**9)
    os.waitpid(hold_lock_in_child(queue, "die"), 0)
    submit(queue, 2, deadline_ns=time.monotonic_ns() + 10**9)  # meets OWNER_DIED
    assert queue.counters()["repairs"] == 1
    claims = queue.claim_batch(0, 4, time.monotonic_ns())
    assert [c.request_id for c in claims] == [1, 2]
    assert queue._core.mutex.try_acquire()  # consistent and free again
    queue._core.mutex.release()


def test_a_native_operation_waits_for_a_busy_lock(queue: RequestQueue) -> None:
    """The C fast path's trylock gets EBUSY: the operation waits in Python, then runs."""
    queue.register_worker(0, os.getpid())
    pid = hold_lock_in_child(queue, "release")
    start = time.monotonic()
    submit(queue, 1, deadline_ns=time.monotonic_ns() + 10**9)
    assert time.monotonic() - start > 0.05  # it waited for the holder
    os.waitpid(pid, 0)
    assert [c.request_id for c in queue.claim_batch(0, 1, time.monotonic_ns())] == [1]
    assert queue.counters()["repairs"] == 0


def test_close_unmaps_the_segment() -> None:
    """Nothing (the C objects hold buffer exports) keeps the mapping alive after close."""
    q = RequestQueue.create(shm_name("close"), GEOMETRY)
    q.register_worker(0, os.getpid())
    submit(q, 1, deadline_ns=time.monotonic_ns() + 10**9)
    (claim,) = q.claim_batch(0, 1, time.monotonic_ns())
    del claim
    mm = q._core.seg.mm
    q.close()
    assert mm.closed

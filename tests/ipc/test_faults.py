"""Fault injection with real processes: workers SIGKILLed at named points of the queue code.

Each case: three requests are queued; an exec'd worker (doorbells passed by ``pass_fds``,
``SCRATCHD_IPC_FAULT`` in its environment) dies at the point; the supervisor's part
(``reclaim_worker``) runs; a second worker serves what is left. Then every request has been
answered exactly once, with the result computed from its own input, and no descriptor leaks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.queue import Completion, DescState, Geometry, RequestQueue, Status

WORKER = """
import os, sys, time
import numpy as np
from scratchd.ipc.queue import RequestQueue, Result, Status
name, (slot, cfd, wfd, want) = sys.argv[1], map(int, sys.argv[2:6])
q = RequestQueue.attach(name, completion_fd=cfd, work_fd=wfd)
q.register_worker(slot, os.getpid())
served = 0
while served < want and q.wait_for_work(slot, 10.0):
    for c in q.claim_batch(slot, 4, time.monotonic_ns()):
        img = q.input_view(c)
        mask = np.where(img > 0, 255, 0).astype(np.uint8) if c.want_mask else None
        q.complete(slot, c, Result(Status.OK, score=float(img[0, 0]), mask=mask))
        served += 1
"""

GEOMETRY = Geometry(slots=8, slot_bytes=64, tick_ms=1, max_workers=4, wheel_ticks=16)


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(f"/scratchd-test-faults-{os.getpid()}", GEOMETRY)
    yield q
    q.close()


def spawn(q: RequestQueue, slot: int, want: int, fault: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "SCRATCHD_IPC_FAULT"}
    if fault:
        env["SCRATCHD_IPC_FAULT"] = fault
    fds = (q.completion_fd, q.work_fd(slot))
    args = [q.name, str(slot), *map(str, fds), str(want)]
    return subprocess.Popen([sys.executable, "-c", WORKER, *args], env=env, pass_fds=fds)


def submit_images(q: RequestQueue, n: int) -> None:
    for rid in range(1, n + 1):
        h = q.reserve()
        assert h is not None
        image = np.full((4, 5), rid * 10, np.uint8)
        image[0, 1] = 0  # so the mask is not trivially all-ones
        q.payload(h)[: image.size] = image.tobytes()
        q.submit(
            h, request_id=rid, conn_id=1, priority=rid % 2, part_class=0,
            deadline_ns=time.monotonic_ns() + 30 * 10**9, height=4, width=5, want_mask=True,
        )  # fmt: skip


def collect(q: RequestQueue, n: int, timeout_s: float = 20.0) -> list[Completion]:
    """Wait on the completion doorbell (as the acceptor's loop does) until n arrive."""
    bell = Doorbell.from_fd(q.completion_fd)
    got: list[Completion] = []
    end = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        got += q.collect_completed()
        if len(got) < n:
            bell.wait(0.5)
    return got


def check_served_exactly_once(q: RequestQueue, got: list[Completion], n: int) -> None:
    assert sorted(c.request_id for c in got) == list(range(1, n + 1))
    for c in got:
        assert c.status == Status.OK and c.result is not None
        assert c.result.score == c.request_id * 10  # computed from its own input
        assert c.result.mask is not None and c.result.mask[0, 1] == 0 and c.result.mask[1, 1] == 255
    assert q.collect_completed() == []
    assert q.counts_by_state()[DescState.FREE] == GEOMETRY.slots


LOCK_HELD = ["claim.unlinked", "claim.marked", "complete.flipped"]
LOCK_FREE = ["claim.returned", "complete.mid_result", "complete.mid_result@2"]


@pytest.mark.parametrize("fault", LOCK_HELD + LOCK_FREE)
def test_worker_killed_at_a_fault_point_loses_nothing(queue: RequestQueue, fault: str) -> None:
    submit_images(queue, 3)
    victim = spawn(queue, 0, 3, fault)
    assert victim.wait(30) == -9
    # The supervisor learns of the death and returns the dead worker's claims.
    report = queue.reclaim_worker(0, time.monotonic_ns())
    assert report.pid == victim.pid
    if fault in LOCK_HELD:
        assert queue.counters()["repairs"] == 1  # the next locker repaired the index
    assert not report.expired and not report.quarantined
    rescuer = spawn(queue, 1, 3, None)
    got = collect(queue, 3)
    rescuer.kill()
    rescuer.wait(10)
    check_served_exactly_once(queue, got, 3)

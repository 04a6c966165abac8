"""Fault injection with real processes: workers SIGKILLed at named points of the queue code.

Each case: three requests are queued; an exec'd worker (doorbells passed by ``pass_fds``,
``SCRATCHD_IPC_FAULT`` in its environment) dies at the point; the supervisor's part
(``reclaim_worker``) runs; a second worker serves what is left. Then every request has been
answered exactly once, with the result computed from its own input, and no descriptor leaks.
"""

from __future__ import annotations

import os
import signal
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


def test_main_process_killed_mid_expiry_is_repaired(queue: RequestQueue) -> None:
    """The main process's own critical sections are repairable too: a process that dies in
    ``expire_due`` after unlinking the due requests leaves them QUEUED; the next locker
    re-links them and they are expired (once) by the next ``expire_due``."""
    now = time.monotonic_ns()
    for rid in (1, 2):
        h = queue.reserve()
        assert h is not None
        queue.submit(
            h, request_id=rid, conn_id=1, priority=0, part_class=0,
            deadline_ns=now + 1_000_000, height=1, width=1, want_mask=False,
        )  # fmt: skip
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["SCRATCHD_IPC_FAULT"] = "expire.unlinked"
            RequestQueue.attach(queue.name).expire_due(now + 10**9)
        finally:
            os._exit(0)  # not reached: the fault point kills it
    assert os.WTERMSIG(os.waitpid(pid, 0)[1]) == signal.SIGKILL
    assert queue.depth_by_priority()[0] == 2  # repaired by this lock
    assert queue.counters()["repairs"] == 1
    expired = queue.expire_due(now + 10**9)
    assert sorted(c.request_id for c in expired) == [1, 2]
    assert all(c.status == Status.TIMEOUT for c in expired)
    assert queue.counts_by_state()[DescState.FREE] == GEOMETRY.slots


STRESS_WORKER = """
import os, sys, time
from scratchd.ipc.queue import RequestQueue, Result, Status
name, slot = sys.argv[1], int(sys.argv[2])
q = RequestQueue.attach(name, work_fd=int(sys.argv[3]), completion_fd=int(sys.argv[4]))
q.register_worker(slot, os.getpid())
os.write(1, b"R")
while True:
    q.wait_for_work(slot, 1.0)
    for c in q.claim_batch(slot, 2, time.monotonic_ns()):
        q.complete(slot, c, Result(Status.OK, score=float(q.input_view(c)[0, 0])))
"""


def test_random_kill_9_of_busy_workers_loses_nothing(queue: RequestQueue) -> None:
    """Workers busy claiming and completing are SIGKILLed at random moments (often inside
    the lock); after each death the slot is reclaimed and a replacement starts. In the end
    every request is answered exactly once with its own result."""
    rng = np.random.default_rng(7)
    total, sent, answers = 120, 0, []
    for round_ in range(8):
        slot = round_ % 2
        fds = (queue.work_fd(slot), queue.completion_fd)
        proc = subprocess.Popen(
            [sys.executable, "-c", STRESS_WORKER, queue.name, str(slot), *map(str, fds)],
            pass_fds=fds, stdout=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.read(1) == b"R"  # registered
        end = time.monotonic() + rng.uniform(0.005, 0.05)
        while time.monotonic() < end:
            while sent < total and (h := queue.reserve()) is not None:
                sent += 1
                queue.payload(h)[:1] = bytes([sent % 251])
                queue.submit(
                    h, request_id=sent, conn_id=1, priority=sent % 8, part_class=0,
                    deadline_ns=time.monotonic_ns() + 60 * 10**9, height=1, width=1,
                    want_mask=False,
                )  # fmt: skip
            answers += queue.collect_completed()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        queue.reclaim_worker(slot, time.monotonic_ns(), max_kills=100)
    rescuer = spawn(queue, 3, total, None)
    answers += collect(queue, total - len(answers))
    rescuer.kill()
    rescuer.wait()
    assert sent == total
    assert sorted(c.request_id for c in answers) == list(range(1, total + 1))
    for c in answers:
        assert c.status == Status.OK and c.result is not None
        assert c.result.score == c.request_id % 251
    assert queue.counts_by_state()[DescState.FREE] == GEOMETRY.slots


def wait_until_stopped(pid: int, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never stopped")


def test_a_stopped_lock_holder_is_killed_so_the_main_process_never_blocks_for_good(
    queue: RequestQueue,
) -> None:
    submit_images(queue, 3)
    victim = spawn(queue, 0, 3, "claim.marked:stop")  # SIGSTOPs itself holding the lock
    wait_until_stopped(victim.pid)
    start = time.monotonic()
    assert sum(queue.depth_by_priority()) == 2  # waited ~0.5 s, killed it, repaired
    assert time.monotonic() - start < 60.0  # "for good": the victim never resumes by itself
    assert victim.wait(10) == -9 and queue.stuck_kills == 1
    report = queue.reclaim_worker(0, time.monotonic_ns())
    assert len(report.requeued) == 1
    rescuer = spawn(queue, 1, 3, None)
    got = collect(queue, 3)
    rescuer.kill()
    rescuer.wait(10)
    check_served_exactly_once(queue, got, 3)

"""Spin, then sleep: the handshakes that let both sides skip the eventfd without losing a wake-up.

Worker side: a worker out of work spins ``worker_spin_us`` on the ready counts, then sets its
bit in the waiting mask under the lock (after re-checking) and sleeps; ``submit`` rings only
a worker whose bit is set. Main side: ``wait_for_completions`` spins with
``completion_armed = 0`` (workers skip the ring), re-arms, looks again, then sleeps in
``poll``. A lost wake-up shows up as a wait that runs into its timeout.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.queue import Geometry, RequestQueue, Result, Status

GEOMETRY = Geometry(slots=8, slot_bytes=16, tick_ms=1, max_workers=2, wheel_ticks=64)


def make_queue(tag: str, worker_spin_us: int) -> RequestQueue:
    return RequestQueue.create(f"/scratchd-test-spin-{tag}-{os.getpid()}", GEOMETRY,
                               worker_spin_us=worker_spin_us)  # fmt: skip


@pytest.fixture
def spinning() -> Iterator[RequestQueue]:
    q = make_queue("long", worker_spin_us=20_000_000)  # 20 s: the spin, not a ring, must wake it
    q.register_worker(0, os.getpid())
    yield q
    q.close()


@pytest.fixture
def brief() -> Iterator[RequestQueue]:
    q = make_queue("brief", worker_spin_us=100)
    q.register_worker(0, os.getpid())
    yield q
    q.close()


def submit(q: RequestQueue, rid: int) -> None:
    h = q.reserve()
    assert h is not None
    q.payload(h)[:1] = bytes([rid % 256])
    q.submit(
        h, request_id=rid, conn_id=1, priority=0, part_class=0,
        deadline_ns=time.monotonic_ns() + 60 * 10**9, height=1, width=1, want_mask=False,
    )  # fmt: skip


def waiting_mask(q: RequestQueue) -> int:
    return int(q._core.seg.header["waiting"])


def wait_in_thread(q: RequestQueue, timeout_s: float) -> tuple[threading.Thread, list[bool]]:
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(q.wait_for_work(0, timeout_s)))
    thread.start()
    return thread, got


def test_a_spinning_worker_takes_work_without_being_rung(spinning: RequestQueue) -> None:
    thread, got = wait_in_thread(spinning, timeout_s=60.0)
    time.sleep(0.05)  # well inside its 20 s spin
    assert waiting_mask(spinning) == 0  # spinning is not announced: submit must not ring
    submit(spinning, 1)
    thread.join(5.0)
    assert got == [True]
    work = Doorbell.from_fd(spinning.work_fd(0))
    assert work.drain() == 0  # nobody rang: the spin saw the ready count


def test_a_worker_past_its_spin_announces_itself_and_is_woken(brief: RequestQueue) -> None:
    thread, got = wait_in_thread(brief, timeout_s=60.0)
    deadline = time.monotonic() + 30.0
    while waiting_mask(brief) != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert waiting_mask(brief) == 1  # asleep on its eventfd, bit set under the lock
    time.sleep(0.05)
    assert not got
    woken_at = time.monotonic()
    submit(brief, 1)  # takes the bit and rings
    thread.join(60.0)
    # woken by the ring, not by its 60 s timeout (the margin is for a loaded machine)
    assert got == [True] and time.monotonic() - woken_at < 30.0
    assert waiting_mask(brief) == 0


def test_spin_is_bounded_by_the_wait_timeout(spinning: RequestQueue) -> None:
    start = time.monotonic()
    assert not spinning.wait_for_work(0, timeout_s=0.05)
    assert time.monotonic() - start < 10.0  # not the 20 s spin


def wait_until_main_spins(q: RequestQueue, timeout_s: float = 10.0) -> bool:
    """Whether the main side's spin (the completion ring disarmed) began in time: a thread
    started under load may take a while to get there."""
    deadline = time.monotonic() + timeout_s
    while q._core.native.completion_armed() and time.monotonic() < deadline:
        time.sleep(0.001)
    return not q._core.native.completion_armed()


def test_main_spin_disarms_the_completion_ring_only_while_it_spins(brief: RequestQueue) -> None:
    submit(brief, 7)
    (claim,) = brief.claim_batch(0, 1, time.monotonic_ns())
    thread = threading.Thread(target=lambda: brief.wait_for_completions(60.0, 20_000_000))
    thread.start()
    armed = [not wait_until_main_spins(brief)]
    assert brief.complete(0, claim, Result(Status.OK, score=7.0))  # ends the spin
    thread.join(30.0)
    armed.append(brief._core.native.completion_armed())
    assert armed == [False, True]


def test_a_completion_during_the_main_spin_is_seen_without_a_ring(brief: RequestQueue) -> None:
    submit(brief, 7)
    (claim,) = brief.claim_batch(0, 1, time.monotonic_ns())
    seen: list[bool] = []
    thread = threading.Thread(
        target=lambda: seen.append(brief.wait_for_completions(60.0, 20_000_000))
    )
    thread.start()
    assert wait_until_main_spins(brief)
    assert brief.complete(0, claim, Result(Status.OK, score=7.0))
    thread.join(30.0)
    assert seen == [True]
    assert Doorbell.from_fd(brief.completion_fd).drain() == 0  # skipped: it was spinning
    (done,) = brief.collect_completed()
    assert done.request_id == 7


def test_a_completion_without_a_spinner_rings(brief: RequestQueue) -> None:
    submit(brief, 3)
    (claim,) = brief.claim_batch(0, 1, time.monotonic_ns())
    assert brief.complete(0, claim, Result(Status.OK, score=3.0))
    assert Doorbell.from_fd(brief.completion_fd).drain() == 1


WORKER = """
import os, sys, time
from scratchd.ipc.queue import RequestQueue, Result, Status
name, done_fd, work_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
q = RequestQueue.attach(name, completion_fd=done_fd, work_fd=work_fd)
q.register_worker(0, os.getpid())
while True:
    if not q.wait_for_work(0, 30.0):
        continue
    for c in q.claim_batch(0, 4, time.monotonic_ns()):
        if c.request_id == 0:
            sys.exit(0)
        q.complete(0, c, Result(Status.OK, score=float(c.request_id)))
"""


def test_no_wake_up_is_lost_across_processes() -> None:
    """Round trips with gaps around both spin lengths, so submits and completions land while
    the other side spins, while it announces itself and while it sleeps. A lost ring on
    either side leaves a wait to run into its timeout (worker 30 s, main 20 s)."""
    q = make_queue("procs", worker_spin_us=30)
    fds = (q.completion_fd, q.work_fd(0))
    worker = subprocess.Popen([sys.executable, "-c", WORKER, q.name, *map(str, fds)], pass_fds=fds)
    rng = random.Random(3)
    try:
        for rid in range(1, 1501):
            submit(q, rid)
            got: list[int] = []
            start = time.monotonic()
            while not got:  # a stale ring may end a wait early: look again
                q.wait_for_completions(20.0, spin_us=rng.choice([0, 0, 5, 40]))
                # A lost ring shows as a wait that ends only at its 20 s timeout (half of
                # that is far more than any round trip takes on a loaded machine).
                assert time.monotonic() - start < 10.0, f"request {rid}: lost wake-up"
                got = [c.request_id for c in q.collect_completed()]
            assert got == [rid]
            gap = rng.choice([0.0, 0.0, 10e-6, 30e-6, 60e-6, 300e-6])
            end = time.perf_counter() + gap
            while time.perf_counter() < end:  # a busy gap: sleep() would round up to ~60 µs
                pass
        submit(q, 0)  # tells the worker to exit
        assert worker.wait(10.0) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        q.close()


def test_close_refuses_while_a_thread_spins_on_the_mapping(spinning: RequestQueue) -> None:
    thread, got = wait_in_thread(spinning, timeout_s=60.0)
    time.sleep(0.05)  # inside its 20 s spin, reading shared memory without the GIL
    with pytest.raises(RuntimeError, match="waiting"):
        spinning.close()
    submit(spinning, 1)  # the queue still works: nothing was closed
    thread.join(5.0)
    assert got == [True]


def test_a_worker_sharing_the_main_process_cpu_sleeps_instead_of_spinning(
    spinning: RequestQueue,
) -> None:
    """Spinning there only trades the CPU back and forth (and keeps both processes on it for
    good); the worker sleeps instead, so its wake-up can land on an idle CPU."""
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(everywhere)})  # the waiting thread inherits this CPU
    try:
        spinning._core.seg.header["main_cpu"] = min(everywhere)  # "the main process spins here"
        thread, got = wait_in_thread(spinning, timeout_s=60.0)
        deadline = time.monotonic() + 10.0  # far less than its 20 s spin
        while waiting_mask(spinning) != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waiting_mask(spinning) == 1  # asleep on its eventfd, not spinning
        submit(spinning, 1)
        thread.join(5.0)
        assert got == [True]
    finally:
        os.sched_setaffinity(0, everywhere)

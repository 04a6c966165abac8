"""The pipelined worker loop (workers/main.py, PipelinedLoop) on the real queue with a fake
asynchronous backend: every request completed once with its own result, and the order of
steps overlaps batch k's host finish with batch k+1's launch."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from scratchd.ipc.queue import Completion, Geometry, RequestQueue, Result, Status
from scratchd.workers.main import PipelinedLoop, StopFlag


@dataclass
class FakeBatch:
    number: int
    means: list[float]
    started: bool = False
    collected: bool = False


@dataclass
class FakeAsyncBackend:
    """Scores each frame by its mean pixel; logs every step."""

    device: str = "fake"
    max_batch: int = 3
    version: str = "fake-1"
    log: list[tuple[str, int]] = field(default_factory=list)
    count: int = 0
    boot_ms: dict[str, float] = field(default_factory=dict)

    def warm_up(self) -> None:
        pass

    def infer(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> list[Result]:
        raise AssertionError("a pipelined loop never calls infer")

    def submit(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> FakeBatch:
        self.count += 1
        batch = FakeBatch(self.count, [float(img.mean()) for img in images])
        self.log.append(("submit", batch.number))
        return batch

    def start(self, batch: FakeBatch) -> None:
        assert not batch.started
        batch.started = True
        self.log.append(("start", batch.number))

    def collect(self, batch: FakeBatch) -> None:
        assert batch.started and not batch.collected
        batch.collected = True
        self.log.append(("collect", batch.number))

    def finish_each(self, batch: FakeBatch) -> Iterator[tuple[int, Result]]:
        assert batch.collected
        self.log.append(("finish", batch.number))
        for pos, m in enumerate(batch.means):
            yield pos, Result(status=Status.OK, score=m / 255.0, batch_size=len(batch.means))

    def expected_ms(self, batch: FakeBatch) -> float:
        return 0.0  # not measured: the next batch is claimed as soon as anything is ready


@dataclass
class TimedBackend(FakeAsyncBackend):
    """A device that takes ``device_s`` a batch, and says so (``expected_ms``): collect
    waits until the batch's time on the device is over."""

    device_s: float = 1.0
    started_at: dict[int, float] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)

    def submit(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> FakeBatch:
        batch = super().submit(images, want_mask)
        self.sizes[batch.number] = len(images)
        return batch

    def start(self, batch: FakeBatch) -> None:
        super().start(batch)
        self.started_at[batch.number] = time.monotonic()

    def collect(self, batch: FakeBatch) -> None:
        time.sleep(max(0.0, self.started_at[batch.number] + self.device_s - time.monotonic()))
        super().collect(batch)

    def expected_ms(self, batch: FakeBatch) -> float:
        return self.device_s * 1000.0


class DeviceMemoryParts:
    """The rest of ``workers/backend.py: DeviceMemory`` for a fake async backend: nothing to
    register, the whole batch always allowed."""

    max_batch: int

    def register_host(self, region: np.ndarray) -> None:
        pass

    def register_region(self, pixels: np.ndarray) -> None:
        pass

    def unregister_region(self, pixels: np.ndarray) -> None:
        pass

    def batch_limit(self) -> int:
        return self.max_batch

    def fragmentation_ratio(self) -> float:
        return 0.0


@dataclass
class PinningBackend(DeviceMemoryParts, FakeAsyncBackend):
    """A backend with device memory (``workers/backend.py: DeviceMemory``) that has
    ``pieces`` of page-locking to do, one a ``pin_pending`` call, logged."""

    pieces: int = 5

    def pin_pending(self) -> bool:
        if self.pieces:
            self.pieces -= 1
            self.log.append(("pin", self.pieces))
        return self.pieces > 0

    def pin_within(self, budget_ns: int) -> bool:
        return False  # nothing staged: PagesInComputeTime has that


@dataclass
class PagesInComputeTime(DeviceMemoryParts, TimedBackend):
    """A device with ``device_s`` a batch and ``wanted`` staged frames' ranges to lock, each
    taken when ``pin_within`` is offered a budget of at least ``cost_ns``; logs each with
    the batch then on the device and the budget."""

    wanted: int = 3
    cost_ns: int = 1_000_000
    budgets: list[tuple[int, int]] = field(default_factory=list)  # (batch on device, budget)

    def pin_pending(self) -> bool:
        self.log.append(("pin", 0))
        return False

    def pin_within(self, budget_ns: int) -> bool:
        if not self.wanted or budget_ns < self.cost_ns:
            return False
        self.wanted -= 1
        on_device = max(n for n, _ in self.started_at.items())
        self.budgets.append((on_device, budget_ns))
        self.log.append(("pin_within", on_device))
        return True


@dataclass
class SlowFinishBackend(FakeAsyncBackend):
    """Finishes a frame every ``frame_s`` on the host, in reverse batch order (any order is
    allowed), and notes when it handed each request's result over."""

    frame_s: float = 0.3
    handed: dict[float, float] = field(default_factory=dict)  # score -> when

    def finish_each(self, batch: FakeBatch) -> Iterator[tuple[int, Result]]:
        for pos, result in reversed(list(super().finish_each(batch))):
            time.sleep(self.frame_s)
            self.handed[result.score] = time.monotonic()
            yield pos, result


@dataclass
class WrongFinishBackend(FakeAsyncBackend):
    """A broken backend: ``positions`` is what its finish_each gives for a batch (each with
    the first frame's result)."""

    positions: tuple[int, ...] = (0, 0)

    def finish_each(self, batch: FakeBatch) -> Iterator[tuple[int, Result]]:
        first = next(iter(super().finish_each(batch)))[1]
        for pos in self.positions:
            yield pos, first


@contextlib.contextmanager
def pipelined_loop(
    backend: FakeAsyncBackend, max_delay_ms: int
) -> Iterator[tuple[RequestQueue, PipelinedLoop, StopFlag]]:
    """A queue (the daemon's side) and a PipelinedLoop for worker slot 0 with ``backend``,
    not running; everything closed on exit."""
    name = f"/scratchd-test-pipeline-{os.getpid()}"
    main = RequestQueue.create(name, Geometry(slots=64, slot_bytes=64, max_workers=2))
    death_r, death_w = os.pipe()
    worker = RequestQueue.attach(name, completion_fd=main.completion_fd, work_fd=main.work_fd(0))
    worker.register_worker(0, os.getpid())
    stop = StopFlag(main.work_fd(0))
    loop = PipelinedLoop(
        worker, 0, backend, stop, death_r, max_delay_ms=max_delay_ms, heartbeat_ms=50
    )
    try:
        yield main, loop, stop
    finally:
        os.close(death_w)
        os.close(death_r)
        worker.close()
        main.close()


@contextlib.contextmanager
def running_loop(
    max_delay_ms: int, backend: FakeAsyncBackend | None = None, before: int = 0
) -> Iterator[tuple[RequestQueue, FakeAsyncBackend]]:
    """A queue and a PipelinedLoop on a thread serving it with a fake backend (``before``
    requests, ids 0.., queued before it starts); the loop is stopped, and everything
    closed, on exit."""
    backend = backend if backend is not None else FakeAsyncBackend()
    with pipelined_loop(backend, max_delay_ms) as (main, loop, stop):
        for rid in range(before):
            submit(main, rid, 10 * (rid + 1))
        thread = threading.Thread(target=loop.run)
        thread.start()
        try:
            yield main, backend
        finally:
            stop.requested = True
            os.eventfd_write(main.work_fd(0), 1)
            thread.join(10)
        assert not thread.is_alive()


def submit(main: RequestQueue, rid: int, value: int) -> None:
    """A 4x4 frame of ``value`` as request ``rid``, due in an hour."""
    h = main.reserve()
    assert h is not None
    np.frombuffer(main.payload(h), np.uint8, count=16)[:] = value
    main.submit(
        h, request_id=rid, conn_id=1, priority=0, part_class=0,
        deadline_ns=time.monotonic_ns() + 3600 * 10**9, height=4, width=4, want_mask=False,
    )  # fmt: skip


def test_every_request_completes_once_with_its_own_result_and_steps_overlap() -> None:
    with running_loop(max_delay_ms=0) as (main, backend):
        want: dict[int, float] = {}
        for rid in range(40):
            value = (rid * 37) % 251
            submit(main, rid, value)
            want[rid] = float(np.float32(value / 255.0))
        done: dict[int, float] = {}
        deadline = time.monotonic() + 30
        while len(done) < 40 and time.monotonic() < deadline:
            for c in main.collect_completed():
                assert c.request_id not in done, "a request completed twice"
                assert c.status is Status.OK and c.result is not None
                done[c.request_id] = c.result.score
            time.sleep(0.001)
        assert done == want
    log = backend.log
    for number in range(1, backend.count + 1):
        steps = [step for step, n in log if n == number]
        assert steps == ["submit", "start", "collect", "finish"], (number, steps)
    for number in range(2, backend.count + 1):
        # batch k is finished on the host only after batch k+1 was launched, when k+1 existed
        # by then (the loop had claims) — and never before k was collected
        assert log.index(("collect", number - 1)) < log.index(("start", number))
    overlapped = [
        n for n in range(1, backend.count)
        if log.index(("start", n + 1)) < log.index(("finish", n))
    ]  # fmt: skip
    assert overlapped, f"no batch finished while the next one ran: {log}"


def test_page_locking_waits_until_nothing_is_ready_then_runs_to_the_end() -> None:
    backend = PinningBackend(pieces=5)
    with running_loop(max_delay_ms=0, backend=backend, before=9) as (main, _):
        deadline = time.monotonic() + 30
        done = 0
        while (done < 9 or backend.pieces) and time.monotonic() < deadline:
            done += len(main.collect_completed())
            time.sleep(0.001)
        assert done == 9 and backend.pieces == 0  # it went on without new work to wake it
    first_pin = backend.log.index(("pin", 4))
    submits = [i for i, (step, _) in enumerate(backend.log) if step == "submit"]
    assert len(submits) == 3 and submits[-1] < first_pin  # the queued frames went first


def test_staged_frames_pages_are_locked_while_a_batch_computes_not_after_it() -> None:
    """The time the loop would sleep while batch k is on the device goes to locking staged
    frames' pages, each only with a budget left that covers its cost, and all before batch
    k is collected: none of it waits for a turn with nothing to claim."""
    device_s = 2.0  # a window no scheduling delay on a busy machine closes
    backend = PagesInComputeTime(max_batch=3, device_s=device_s, wanted=3)
    with running_loop(max_delay_ms=0, backend=backend, before=3) as (main, _):
        deadline = time.monotonic() + 30
        done = 0
        while done < 3 and time.monotonic() < deadline:
            done += len(main.collect_completed())
            time.sleep(0.001)
        assert done == 3
    assert backend.wanted == 0
    steps = backend.log
    locked_at = [i for i, (step, _) in enumerate(steps) if step == "pin_within"]
    assert len(locked_at) == 3
    assert steps.index(("start", 1)) < locked_at[0] and locked_at[-1] < steps.index(("collect", 1))
    assert all(n == 1 and backend.cost_ns <= b <= device_s * 1e9 for n, b in backend.budgets)


def test_each_frame_is_completed_as_soon_as_the_host_has_finished_it() -> None:
    """Three requests in one batch, finished 0.3 s apart: each is answered right after its
    own finish, not when the batch's last frame is done."""
    backend = SlowFinishBackend(max_batch=3)
    with running_loop(max_delay_ms=600_000, backend=backend, before=3) as (main, _):
        answered: dict[float, float] = {}
        deadline = time.monotonic() + 30
        while len(answered) < 3 and time.monotonic() < deadline:
            for c in main.collect_completed():
                assert c.result is not None
                answered[c.result.score] = time.monotonic()
            time.sleep(0.001)
    assert backend.count == 1, "the three requests were meant to be one batch"
    assert len(answered) == 3
    last_handed = max(backend.handed.values())
    early = [score for score, t in answered.items() if t < last_handed]
    assert len(early) == 2, f"answered {answered}, handed {backend.handed}"


@pytest.mark.parametrize(
    ("positions", "error", "answered"),
    [((0, 0), "position 0 twice", [0]),  # a repeat: never answered twice
     ((0, 3), "position 3 twice or out of range", [0]),  # past the batch
     ((0, 1), r"no result for batch positions \[2\]", [0, 1])],  # one left out
)  # fmt: skip
def test_a_backend_that_skips_or_repeats_a_frame_stops_the_worker(
    positions: tuple[int, ...], error: str, answered: list[int]
) -> None:
    """A batch of 3 whose finish_each breaks its contract: the loop raises (the worker
    process dies and the supervisor re-queues what was not completed) after answering only
    the frames it was given once each."""
    backend = WrongFinishBackend(max_batch=3, positions=positions)
    with pipelined_loop(backend, max_delay_ms=600_000) as (main, loop, _):
        for rid, value in enumerate((10, 20, 30)):
            submit(main, rid, value)
        with pytest.raises(RuntimeError, match=error):
            loop.run()
        assert sorted(c.request_id for c in main.collect_completed()) == answered


@dataclass
class CapturingBackend(FakeAsyncBackend):
    """Its submit takes ``submit_s`` (a graph captured on first use), and it expects
    ``expected`` ms of device time for the batch (0: the new graph has no time yet)."""

    submit_s: float = 0.05
    expected: float = 0.0

    def submit(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> FakeBatch:
        time.sleep(self.submit_s)
        return super().submit(images, want_mask)

    def expected_ms(self, batch: FakeBatch) -> float:
        return self.expected


@pytest.mark.parametrize(("expected_ms", "learned_ns"), [(0.0, 0.0), (1.0, 1e6)])
def test_a_slow_submit_does_not_stretch_the_lead_past_the_batchs_device_time(
    expected_ms: float, learned_ns: float
) -> None:
    """A submit that captured a graph takes far longer than a batch computes: the lead
    (claim + submit time) learns at most the batch's expected device time from it, and
    nothing when there is no expectation yet (a new graph, not timed)."""
    backend = CapturingBackend(submit_s=0.05, expected=expected_ms)
    with pipelined_loop(backend, max_delay_ms=0) as (main, loop, _):
        submit(main, 1, 10)
        loop.claimed_ns = time.monotonic_ns()
        claims = loop.queue.claim_batch(0, 1, time.monotonic_ns())
        loop.take(claims)
        assert loop.submit_ns == learned_ns
        loop.drain()
        assert [c.request_id for c in main.collect_completed()] == [1]


def test_an_idle_device_takes_a_lone_request_without_waiting_for_the_fill_window() -> None:
    """A 10-minute fill window and a batch limit of 3: a single request is still claimed,
    computed and completed at once, because nothing is computing (continuous batching)."""
    with running_loop(max_delay_ms=600_000) as (main, _):
        submit(main, 7, 51)
        done: list[Completion] = []
        deadline = time.monotonic() + 30  # far below the window: only an early claim passes
        while not done and time.monotonic() < deadline:
            done = main.collect_completed()
            time.sleep(0.001)
        assert [(c.request_id, c.status) for c in done] == [(7, Status.OK)]
        assert done[0].result is not None and done[0].result.batch_size == 1


def wait_done(main: RequestQueue, n: int) -> list[Completion]:
    done: list[Completion] = []
    deadline = time.monotonic() + 30
    while len(done) < n and time.monotonic() < deadline:
        done += main.collect_completed()
        time.sleep(0.001)
    return done


def test_the_next_batch_fills_while_one_computes_and_is_uploaded_before_it_ends() -> None:
    """A batch computing for 1 s: two requests that arrive during it (fewer than a full
    batch of 3) are neither claimed at once nor left until the device is idle — they go
    together as batch 2, submitted (claimed and uploaded) before batch 1 is collected, so
    batch 2 launches right behind batch 1."""
    backend = TimedBackend(device_s=1.0)
    with running_loop(max_delay_ms=600_000, backend=backend) as (main, _):
        submit(main, 1, 10)
        while not backend.started_at:
            time.sleep(0.001)
        submit(main, 2, 20)  # right after batch 1 started
        time.sleep(0.3)
        submit(main, 3, 30)  # well before batch 1's expected end
        done = wait_done(main, 3)
        assert sorted(c.request_id for c in done) == [1, 2, 3]
    log = backend.log
    assert backend.sizes == {1: 1, 2: 2}, log
    assert log.index(("submit", 2)) < log.index(("collect", 1)) < log.index(("start", 2)), log

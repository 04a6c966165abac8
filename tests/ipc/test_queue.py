"""The request queue against a reference model (stateful hypothesis), plus focused cases.

The model is a few dicts. Every rule applies an operation to both and compares what a user
depends on: claim order (priority, then deadline, then FIFO), which requests time out, that
every submitted request is answered exactly once (or dropped because its client left), that
no descriptor leaks and that stale claims cannot complete.

submit, claim, complete and collect are whole C sections (``ipc/_native.c``) while expiry,
reclaim, abandonment and repair are Python sections calling the same C index steps, so the
state machine interleaves both; ``index_is_well_formed`` walks every list after every step.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from scratchd.ipc.queue import (
    Claim,
    DescState,
    Geometry,
    Handle,
    QueueError,
    RequestQueue,
    Result,
    StaleHandle,
    Status,
)

TICK = 1_000_000
SLOTS = 6
MAX_KILLS = 2
GEOMETRY = Geometry(slots=SLOTS, slot_bytes=16, tick_ms=1, max_workers=3, wheel_ticks=8)


def shm_name(tag: str) -> str:
    return f"/scratchd-test-{tag}-{os.getpid()}"


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(shm_name("q"), GEOMETRY)
    yield q
    q.close()


def submit(
    q: RequestQueue, rid: int, *, priority: int = 0, deadline_ns: int, conn: int = 1
) -> Handle:
    h = q.reserve()
    assert h is not None
    q.payload(h)[:4] = bytes([rid % 256] * 4)
    q.submit(
        h, request_id=rid, conn_id=conn, priority=priority, part_class=0,
        deadline_ns=deadline_ns, height=2, width=2, want_mask=False,
    )  # fmt: skip
    return h


@dataclass
class Req:
    rid: int
    priority: int
    deadline: int
    seq: int
    conn: int


class QueueModel(RuleBasedStateMachine):
    """Queue vs model; two worker slots live in this process (claims check the pid)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = RequestQueue.create(shm_name("model"), GEOMETRY)
        self.now = time.monotonic_ns() + 10**9
        for slot in (0, 1):
            self.q.register_worker(slot, os.getpid())
        self.written: list[Handle] = []
        self.queued: dict[int, Req] = {}
        self.claimed: dict[int, tuple[int, Claim, Req]] = {}
        self.finished: dict[int, Status] = {}  # answerable, waiting for collect
        self.finished_dropped: set[int] = set()  # DONE but abandoned: freed without an answer
        self.abandoned: set[int] = set()  # claimed requests whose client left
        self.answered: set[int] = set()
        self.dropped: set[int] = set()
        self.kills: dict[int, int] = {}
        self.stale: list[tuple[int, Claim]] = []
        self.conn_of: dict[int, int] = {}
        self.rid = self.seq = 0

    def used(self) -> int:
        n = len(self.written) + len(self.queued) + len(self.claimed)
        return n + len(self.finished) + len(self.finished_dropped)

    @rule()
    def reserve(self) -> None:
        h = self.q.reserve()
        if self.used() == SLOTS:
            assert h is None
        else:
            assert h is not None
            self.written.append(h)

    @precondition(lambda self: self.written)
    @rule()
    def release(self) -> None:
        self.q.release(self.written.pop())

    @precondition(lambda self: self.written)
    @rule(
        # Few distinct values, so equal priorities and equal deadlines (FIFO ties) are common;
        # offsets past the 8-tick wheel exercise its rounds.
        priority=st.sampled_from([0, 3, 7]),
        offset=st.sampled_from([0, 1, 2, 5, 11, 19]).map(lambda t: t * TICK),
        conn=st.integers(0, 2),
    )
    def submit(self, priority: int, offset: int, conn: int) -> None:
        h = self.written.pop()
        self.rid += 1
        self.seq += 1
        deadline = self.now + offset
        self.q.submit(
            h, request_id=self.rid, conn_id=conn, priority=priority, part_class=3,
            deadline_ns=deadline, height=1, width=1, want_mask=False,
        )  # fmt: skip
        self.queued[self.rid] = Req(self.rid, priority, deadline, self.seq, conn)
        self.conn_of[self.rid] = conn

    @rule(dt=st.integers(0, 6 * TICK))
    def advance(self, dt: int) -> None:
        self.now += dt

    @rule(slot=st.integers(0, 1), max_n=st.integers(1, 4))
    def claim(self, slot: int, max_n: int) -> None:
        claims = self.q.claim_batch(slot, max_n, self.now)
        order = sorted(self.queued.values(), key=lambda r: (-r.priority, r.deadline, r.seq))
        want: list[Req] = []
        for r in order:
            if len(want) == max_n:
                break
            del self.queued[r.rid]
            if r.deadline <= self.now:
                self.finished[r.rid] = Status.TIMEOUT  # late: never reaches a worker
            else:
                want.append(r)
        assert [c.request_id for c in claims] == [r.rid for r in want]
        for c, r in zip(claims, want, strict=True):
            self.claimed[r.rid] = (slot, c, r)

    @precondition(lambda self: self.claimed)
    @rule(pick=st.integers(0, 100))
    def complete(self, pick: int) -> None:
        rid = sorted(self.claimed)[pick % len(self.claimed)]
        slot, c, _ = self.claimed.pop(rid)
        assert self.q.complete(slot, c, Result(Status.OK, score=float(rid)))
        self.stale.append((slot, c))
        if rid in self.abandoned:
            self.finished_dropped.add(rid)
            self.dropped.add(rid)
        else:
            self.finished[rid] = Status.OK

    @precondition(lambda self: self.stale)
    @rule(pick=st.integers(0, 100))
    def complete_stale(self, pick: int) -> None:
        slot, c = self.stale[pick % len(self.stale)]
        assert not self.q.complete(slot, c, Result(Status.OK, score=-1.0))

    @rule()
    def expire(self) -> None:
        got = {c.request_id: c.status for c in self.q.expire_due(self.now)}
        due = [rid for rid, r in self.queued.items() if r.deadline <= self.now]
        assert got == dict.fromkeys(due, Status.TIMEOUT)
        for rid in due:
            del self.queued[rid]
        self._answer(got)

    @rule(slot=st.integers(0, 1))
    def worker_dies(self, slot: int) -> None:
        report = self.q.reclaim_worker(slot, self.now, max_kills=MAX_KILLS)
        assert report.pid == os.getpid()
        mine = [rid for rid, (s, _, _) in self.claimed.items() if s == slot]
        assert len(report.requeued + report.expired + report.quarantined + report.dropped) == len(
            mine
        )
        for rid in mine:
            _, c, r = self.claimed.pop(rid)
            self.stale.append((slot, c))
            self.kills[rid] = self.kills.get(rid, 0) + 1
            if rid in self.abandoned:
                self.dropped.add(rid)
            elif self.kills[rid] >= MAX_KILLS:
                self.finished[rid] = Status.ERROR
            elif r.deadline <= self.now:
                self.finished[rid] = Status.TIMEOUT
            else:
                self.queued[rid] = r
        self.q.register_worker(slot, os.getpid())  # the replacement

    @rule(conn=st.integers(0, 2))
    def client_leaves(self, conn: int) -> None:
        self.q.abandon_connection(conn)
        for rid in [rid for rid, r in self.queued.items() if r.conn == conn]:
            del self.queued[rid]
            self.dropped.add(rid)
        for rid in [rid for rid in self.finished if self.conn_of[rid] == conn]:
            del self.finished[rid]  # freed by the next collect, without an answer
            self.finished_dropped.add(rid)
            self.dropped.add(rid)
        self.abandoned |= {rid for rid, (_, _, r) in self.claimed.items() if r.conn == conn}

    @rule(slot=st.integers(0, 1), min_ready=st.integers(1, 3))
    def look_for_work(self, slot: int, min_ready: int) -> None:
        """The worker's wait (lock-free look, spin, announce, sleep) agrees with the model."""
        assert self.q.wait_for_work(slot, 0.0, min_ready) == (len(self.queued) >= min_ready)

    @rule(spin_us=st.sampled_from([0, 5]))
    def look_for_completions(self, spin_us: int) -> None:
        waiting = bool(self.finished or self.finished_dropped)
        assert self.q.wait_for_completions(0.0, spin_us) == waiting

    @rule()
    def lock_holder_died(self) -> None:
        """A process died mid-critical-section with the index in any state: wipe the whole
        derived index and let the repair rebuild it from the descriptor table alone. Every
        later observation (claim order, expiry, collection) must be unaffected."""
        seg = self.q._seg
        with self.q._mutex:
            for index in (seg.ready_head, seg.ready_tail, seg.wheel_head):
                index[:] = -1
            seg.ready_count[:] = 0
            self.q._done_head[0] = -1
            self.q._repair()

    @rule()
    def collect(self) -> None:
        completions = self.q.collect_completed()
        got = {c.request_id: c.status for c in completions}
        assert len(got) == len(completions)
        assert got == self.finished
        for c in completions:
            if c.status == Status.OK:
                assert c.result is not None and c.result.score == c.request_id
        self._answer(got)
        self.finished = {}
        self.finished_dropped = set()

    def _answer(self, got: dict[int, Status]) -> None:
        assert not (self.answered & got.keys()), "a request was answered twice"
        self.answered |= got.keys()

    @invariant()
    def tables_agree(self) -> None:
        counts = self.q.counts_by_state()
        assert counts[DescState.FREE] == SLOTS - self.used() == self.q.free_count()
        assert counts[DescState.WRITTEN] == len(self.written)
        assert counts[DescState.QUEUED] == len(self.queued)
        assert counts[DescState.CLAIMED] == len(self.claimed)
        depth = [0] * 8
        for r in self.queued.values():
            depth[r.priority] += 1
        assert self.q.depth_by_priority() == depth
        earliest = min((r.deadline for r in self.queued.values()), default=None)
        assert self.q.next_deadline_ns() == earliest

    @invariant()
    def index_is_well_formed(self) -> None:
        """Ready lists, wheel buckets and the done stack hold exactly the descriptors their
        states say, doubly linked both ways, ready lists in (deadline, seq) order."""
        seg, d = self.q._seg, self.q._seg.descs
        state = d["state"]
        queued = {int(i) for i in np.flatnonzero(state == DescState.QUEUED)}
        in_lists: set[int] = set()
        for p in range(8):
            walk, i, prev = [], int(seg.ready_head[p]), -1
            while i != -1:
                assert int(d["rprev"][i]) == prev and int(d["priority"][i]) == p
                walk.append(i)
                prev, i = i, int(d["rnext"][i])
            assert int(seg.ready_tail[p]) == prev and int(seg.ready_count[p]) == len(walk)
            keys = [(int(d["deadline_ns"][i]), int(d["seq"][i])) for i in walk]
            assert keys == sorted(keys)
            in_lists |= set(walk)
        assert in_lists == queued
        in_wheel: set[int] = set()
        for b in np.flatnonzero(seg.wheel_head != -1).tolist():
            i, prev = int(seg.wheel_head[b]), -1
            while i != -1:
                assert int(d["wprev"][i]) == prev and int(d["wbucket"][i]) == b
                in_wheel.add(i)
                prev, i = i, int(d["wnext"][i])
        assert in_wheel == queued
        stacked, i = set(), int(self.q._done_head[0])
        while i != -1:
            stacked.add(i)
            i = int(d["rnext"][i])
        assert stacked == {int(i) for i in np.flatnonzero(state >= DescState.DONE)}
        assert self.q.ready_count() == len(queued)

    def teardown(self) -> None:
        # Drain: finish every claim, expire the rest, collect. Then every request ever
        # submitted was answered exactly once or dropped because its client left.
        try:
            while self.claimed:
                self.complete(0)
            self.now += 10**12
            self.expire()
            self.collect()
            assert self.answered | self.dropped == set(range(1, self.rid + 1))
            assert not (self.answered & self.dropped)
            assert self.q.counts_by_state()[DescState.FREE] == SLOTS - len(self.written)
        finally:
            self.q.close()


TestQueueModel = QueueModel.TestCase
TestQueueModel.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


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


def test_reclaimed_worker_cannot_claim(queue: RequestQueue) -> None:
    queue.register_worker(2, os.getpid())
    queue.reclaim_worker(2, time.monotonic_ns())
    with pytest.raises(QueueError, match="not the worker registered"):
        queue.claim_batch(2, 1, time.monotonic_ns())
    assert queue.worker_rows() == []


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


def test_out_of_range_request_fields_are_refused_and_nothing_is_written(
    queue: RequestQueue,
) -> None:
    h = queue.reserve()
    assert h is not None
    now = time.monotonic_ns()
    bad: list[dict[str, int]] = [{"request_id": -1}, {"conn_id": 2**64}, {"priority": 8}]
    for fields in bad:
        args = {"request_id": 1, "conn_id": 1, "priority": 0, **fields}
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


def hold_lock_in_child(queue: RequestQueue, then: str) -> int:
    """Fork a child that takes the queue's mutex, then dies holding it ('die') or lets it go
    after 0.2 s ('release'); returns when the child holds it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            queue._mutex.acquire()
            os.write(ready_w, b"x")
            if then == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.2)
            queue._mutex.release()
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
    assert queue._mutex.try_acquire()  # consistent and free again
    queue._mutex.release()


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
    mm = q._seg.mm
    q.close()
    assert mm.closed


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

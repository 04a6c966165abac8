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

import os
import time
from dataclasses import dataclass

import numpy as np
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
    Handle,
    RequestQueue,
    Result,
    Status,
)
from tests.ipc.queue_helpers import GEOMETRY, MAX_KILLS, SLOTS, TICK, shm_name


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
        seg = self.q._core.seg
        with self.q._core.mutex:
            for index in (seg.ready_head, seg.ready_tail, seg.wheel_head):
                index[:] = -1
            seg.ready_count[:] = 0
            self.q._core.done_head[0] = -1
            self.q._core.repair()

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
        for p in range(8):  # admission's look: ahead of p, queued in all, the two workers
            assert self.q.load_ahead(p) == (sum(depth[p:]), len(self.queued), 2)
        earliest = min((r.deadline for r in self.queued.values()), default=None)
        assert self.q.next_deadline_ns() == earliest

    @invariant()
    def index_is_well_formed(self) -> None:
        """Ready lists, wheel buckets and the done stack hold exactly the descriptors their
        states say, doubly linked both ways, ready lists in (deadline, seq) order."""
        seg, d = self.q._core.seg, self.q._core.seg.descs
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
        stacked, i = set(), int(self.q._core.done_head[0])
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

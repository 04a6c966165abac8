"""Overload rules (daemon/frontend/overload.py): the deadline estimate, and the slot rule
with shedding, run against the real shared-memory queue and checked against a model."""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.daemon.config import ConfigError, QueueConfig, load_config
from scratchd.daemon.frontend import overload
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Completion, Geometry, Handle, RequestQueue, Result, Status

MS = NS_PER_MS


def _done(compute_ms: float, batch: int, status: Status = Status.OK) -> Completion:
    result = Result(status, compute_ns=int(compute_ms * MS), batch_size=batch)
    return Completion(
        handle=Handle(0, 0), request_id=1, conn_id=1, part_class=0, priority=0, status=status,
        result=result, enqueue_ns=0, claim_ns=0, done_ns=0, worker=0,
    )  # fmt: skip


def test_nothing_is_refused_on_the_estimate_before_anything_is_measured() -> None:
    rate = overload.ServiceRate()
    assert rate.refusal(0, 1 * MS, ahead=10_000, in_service=2, workers=1) is None
    rate.observe_all([_done(40.0, 2, Status.ERROR)])  # a failure measures nothing
    assert rate.per_request_ns == 0.0


def test_the_estimate_is_the_work_ahead_spread_over_the_workers_plus_its_own() -> None:
    rate = overload.ServiceRate()
    rate.observe_all([_done(40.0, 2)])  # 20 ms per request of one worker
    assert rate.per_request_ns == 20 * MS
    # 6 queued + 2 half-done in service on 2 workers: 3.5 rounds, then its own: 90 ms
    assert rate.expected_ns(6, 2, 2) == 90 * MS
    assert rate.refusal(0, 90 * MS, 6, 2, 2) is None
    reason = rate.refusal(0, 89 * MS, 6, 2, 2)
    assert reason is not None and "cannot be served within its deadline" in reason
    assert "6 requests queued ahead" in reason and "2 workers" in reason
    assert rate.expected_ns(6, 2, 0) == rate.expected_ns(6, 2, 1)  # no worker: as if one


def test_the_estimate_follows_the_service_time() -> None:
    rate = overload.ServiceRate()
    rate.observe_all([_done(10.0, 1)])
    for _ in range(200):
        rate.observe_all([_done(30.0, 1)])
    assert rate.per_request_ns == pytest.approx(30 * MS, rel=1e-3)


@given(
    per_ms=st.floats(0.01, 100.0),
    most=st.integers(0, 1000),
    left_ms=st.floats(0.0, 100_000.0),
    ahead=st.integers(0, 1000),
    in_service=st.integers(0, 2000),
    workers=st.integers(0, 64),
)
def test_a_request_surely_in_time_is_never_refused_on_the_estimate(
    per_ms: float, most: int, left_ms: float, ahead: int, in_service: int, workers: int
) -> None:
    """The shortcut that skips looking at the queue never lets in what ``refusal`` would
    refuse, for any load within the bound it was given."""
    rate = overload.ServiceRate()
    rate.observe_all([_done(per_ms, 1)])
    now, deadline = 10**12, 10**12 + int(left_ms * MS)
    if ahead + in_service / 2 > most or not rate.surely_in_time(now, deadline, most):
        return
    assert rate.refusal(now, deadline, ahead, in_service, workers) is None


def test_reserved_share_is_checked_and_rounds_up() -> None:
    assert overload.reserved_slots(QueueConfig(slots=8, reserved_share=0.125)) == 1
    assert overload.reserved_slots(QueueConfig(slots=10, reserved_share=0.125)) == 2
    assert overload.reserved_slots(QueueConfig(slots=4, reserved_share=0.99)) == 3
    assert overload.reserved_slots(QueueConfig(slots=8, reserved_share=0.0)) == 0
    with pytest.raises(ConfigError, match=r"queue\.reserved_share"):
        load_config(overrides={"queue.reserved_share": 1.0})
    with pytest.raises(ConfigError, match=r"queue\.reserved_priority"):
        load_config(overrides={"queue.reserved_priority": 8})


# ---- the slot rule against a model --------------------------------------------------------

SLOTS = 8


@dataclass
class Model:
    """The rule in its simplest form: a list of queued (priority, id) in arrival order."""

    limits: QueueConfig
    queued: list[tuple[int, int]] = field(default_factory=list)
    claimed: set[int] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.limits.slots - len(self.queued) - len(self.claimed)

    def arrive(self, priority: int, rid: int) -> tuple[bool, int | None]:
        """(admitted, id of the request shed for it)."""
        reserved = overload.reserved_slots(self.limits)
        need = 1 if priority >= self.limits.reserved_priority else reserved + 1
        shed = None
        if self.free < need:
            lower = [q for q in self.queued if q[0] < priority]
            if not lower:
                return False, None
            lowest = min(p for p, _ in lower)
            victim = [q for q in lower if q[0] == lowest][-1]  # the newest of the lowest
            self.queued.remove(victim)
            shed = victim[1]
        self.queued.append((priority, rid))
        return True, shed

    def claim(self, n: int) -> list[int]:
        order = sorted(self.queued, key=lambda q: -q[0])  # stable: FIFO within a priority
        taken = order[:n]
        for q in taken:
            self.queued.remove(q)
            self.claimed.add(q[1])
        return [rid for _, rid in taken]


ARRIVE = st.tuples(st.just("arrive"), st.integers(0, 7))
ops = st.lists(  # mostly arrivals, so that the queue fills and sheds
    st.one_of(
        *[ARRIVE] * 4,
        st.tuples(st.just("claim"), st.integers(1, 3)),
        st.tuples(st.just("finish"), st.just(0)),
    ),
    min_size=3 * SLOTS,
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, share=st.sampled_from([0.0, 0.125, 0.3, 0.5]), threshold=st.integers(1, 7))
def test_admission_and_shedding_follow_the_model(
    ops: list[tuple[str, int]], share: float, threshold: int
) -> None:
    limits = QueueConfig(slots=SLOTS, slot_bytes=64, reserved_share=share,
                         reserved_priority=threshold)  # fmt: skip
    queue = RequestQueue.create(
        f"/scratchd-test-overload-{os.getpid()}", Geometry(slots=SLOTS, slot_bytes=64)
    )
    try:
        queue.register_worker(0, os.getpid())
        model, ids, claims = Model(limits), itertools.count(1), []
        deadline = time.monotonic_ns() + 3600 * 10**9  # one deadline: order is priority, FIFO
        for op, arg in ops:
            if op == "arrive":
                rid = next(ids)
                handle, shed = overload.take_slot(queue, arg, overload.keep_free(arg, limits))
                admitted, victim = model.arrive(arg, rid)
                assert (handle is not None, shed.request_id if shed else None) == (admitted, victim)
                if shed is not None:  # answered overloaded, and only ever a lower priority
                    assert shed.status == Status.OVERLOADED and shed.priority < arg
                if handle is not None:
                    queue.submit(
                        handle, request_id=rid, conn_id=1, priority=arg, part_class=0,
                        deadline_ns=deadline, height=1, width=1, want_mask=False,
                    )  # fmt: skip
            elif op == "claim":
                got = queue.claim_batch(0, arg, time.monotonic_ns())
                assert [c.request_id for c in got] == model.claim(arg)
                claims += got
            else:
                for c in claims:
                    assert queue.complete(0, c, Result(Status.OK))
                done = queue.collect_completed()
                assert sorted(c.request_id for c in done) == sorted(model.claimed)
                claims, model.claimed = [], set()
            assert queue.free_count() == model.free
            assert queue.depth_by_priority() == (
                [sum(1 for p, _ in model.queued if p == k) for k in range(8)]
            )
    finally:
        queue.close()

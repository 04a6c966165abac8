"""The batching policy: full batches go at once, partial ones wait within delay and slack."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.ipc.layout import NS_PER_MS
from scratchd.workers.batching import BatchPolicy, Plan


def test_nothing_ready_sleeps_on_the_doorbell() -> None:
    assert BatchPolicy(8, 10 * NS_PER_MS).plan(0, 0, None) == Plan(0, None)


def test_a_full_batch_is_claimed_at_once() -> None:
    policy = BatchPolicy(4, 10 * NS_PER_MS)
    assert policy.plan(5, 9, (5, 10**12)) == Plan(4, None)


def test_a_partial_batch_waits_until_the_queue_delay_then_goes() -> None:
    policy = BatchPolicy(8, 10 * NS_PER_MS)
    assert policy.plan(1 * NS_PER_MS, 3, (0, 10**12)) == Plan(0, 10 * NS_PER_MS)
    assert policy.plan(10 * NS_PER_MS, 3, (0, 10**12)) == Plan(3, None)


def test_a_partial_batch_never_waits_past_its_deadline_slack() -> None:
    policy = BatchPolicy(8, 10 * NS_PER_MS)
    policy.observe(2, 4 * NS_PER_MS)  # 2 ms per image → a full batch would take 16 ms
    assert policy.plan(0, 1, (0, 20 * NS_PER_MS)) == Plan(0, 4 * NS_PER_MS)
    assert policy.plan(4 * NS_PER_MS, 1, (0, 20 * NS_PER_MS)) == Plan(1, None)


def test_an_idle_device_takes_a_partial_batch_at_once() -> None:
    policy = BatchPolicy(4, 10 * NS_PER_MS)
    # busy: it may fill
    assert policy.plan(1 * NS_PER_MS, 3, (0, 10**12)) == Plan(0, 10 * NS_PER_MS)
    assert policy.plan(1 * NS_PER_MS, 3, (0, 10**12), idle=True) == Plan(3, None)
    assert policy.plan(1 * NS_PER_MS, 9, (0, 10**12), idle=True) == Plan(4, None)
    assert policy.plan(1 * NS_PER_MS, 0, None, idle=True) == Plan(0, None)


def test_zero_delay_never_waits() -> None:
    assert BatchPolicy(8, 0).plan(7, 1, (7, 10**12)) == Plan(1, None)


def test_the_estimate_follows_observed_batches() -> None:
    policy = BatchPolicy(8, 0)
    policy.observe(4, 40)
    assert policy.per_image_ns == pytest.approx(10)
    for _ in range(100):
        policy.observe(1, 20)
    assert policy.per_image_ns == pytest.approx(20, rel=1e-3)
    policy.observe(0, 5)  # ignored
    assert policy.per_image_ns == pytest.approx(20, rel=1e-3)


@given(
    max_batch=st.integers(1, 32),
    delay=st.integers(0, 50 * NS_PER_MS),
    now=st.integers(0, 10**10),
    ready=st.integers(0, 100),
    enqueue_age=st.integers(0, 10**9),
    deadline_in=st.integers(-(10**9), 10**10),
    per_image=st.integers(0, 10**8),
    idle=st.booleans(),
)
def test_plan_invariants(
    max_batch: int,
    delay: int,
    now: int,
    ready: int,
    enqueue_age: int,
    deadline_in: int,
    per_image: int,
    idle: bool,
) -> None:
    policy = BatchPolicy(max_batch, delay, float(per_image))
    enqueue = now - enqueue_age
    plan = policy.plan(now, ready, (enqueue, now + deadline_in), idle)
    assert 0 <= plan.claim <= min(ready, max_batch)
    if ready == 0:
        assert plan == Plan(0, None)
    elif plan.claim == 0:
        # waiting: only for a partial batch on a busy device, never past the delay bound or
        # the slack
        assert ready < max_batch and not idle and plan.wake_ns is not None
        assert now < plan.wake_ns <= enqueue + delay
        assert plan.wake_ns <= now + deadline_in - per_image * max_batch
    else:
        assert plan.claim == min(ready, max_batch) and plan.wake_ns is None


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        BatchPolicy(0, 1)
    with pytest.raises(ValueError, match="max_delay_ns"):
        BatchPolicy(1, -1)


@given(
    batch=st.integers(1, 16),
    per_image_ms=st.floats(0.5, 500.0),
    left_ms=st.floats(-100.0, 5000.0),
)
def test_a_batch_fits_its_best_requests_remaining_time(
    batch: int, per_image_ms: float, left_ms: float
) -> None:
    """``fit``: at least one request, at most ``batch``, and more than one only while the
    batch's expected compute still ends by the best request's deadline; ``expected_ns`` is
    that compute (the claim's lead)."""
    policy = BatchPolicy(max_batch=16, max_delay_ns=0)
    assert policy.fit(batch, 0, int(left_ms * NS_PER_MS)) == batch  # nothing measured yet
    assert policy.expected_ns(batch) == 0
    policy.observe(1, int(per_image_ms * NS_PER_MS))
    n = policy.fit(batch, 0, int(left_ms * NS_PER_MS))
    assert 1 <= n <= batch
    assert n == 1 or policy.expected_ns(n) <= left_ms * NS_PER_MS
    if n < batch:
        assert (n + 1) * policy.per_image_ns > int(left_ms * NS_PER_MS)  # one more would not fit

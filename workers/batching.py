"""When a worker claims, and how many: the batching policy.

A worker that finds requests ready decides between claiming now and waiting a little for the
batch to fill (a batch of 8 costs far less than 8 batches of 1 on any backend). The rule:

- batch size = min(ready, ``max_batch`` from config, the backend's own limit);
- claim at once when that many are ready already, or when the worker's device is idle: a
  pipelined (GPU) worker's next batch fills while the current one computes, so holding a
  partial batch for an idle device only adds latency (a frame costs the GPU nearly as much
  alone as in a batch: docs/benchmarks.md, serving graph);
- otherwise wait for more, but at most ``max_queue_delay`` after the best ready request was
  enqueued, and never past the moment when that request's deadline, less the estimated
  compute time of the batch, would be missed (its *slack*).

A batch is no larger than its best request's remaining time allows (``fit``: that request
waits for its whole batch), and a claim does not start a request whose deadline is nearer
than the batch's expected compute (``expected_ns``): it could only be answered late, so it
is answered ``timeout`` at once and costs the device nothing.

The policy is pure arithmetic on numbers the queue reports (`oldest_ready`, the ready count):
the worker loop asks :meth:`BatchPolicy.plan` and then either claims or sleeps on its
doorbell until the returned time, waking early when a new request arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

EWMA_WEIGHT: Final = 0.2
"""Weight of the newest sample in the per-image compute-time estimate."""


def ewma(estimate: float, sample: float, weight: float) -> float:
    """A running estimate after ``sample`` (``weight``: the newest sample's share); an
    estimate of 0 has seen nothing yet and becomes the sample."""
    return sample if estimate == 0.0 else estimate + weight * (sample - estimate)


@dataclass(frozen=True)
class Plan:
    """What a worker should do now: claim ``claim`` requests (0: none), else sleep until
    ``wake_ns`` (None: until the doorbell rings)."""

    claim: int
    wake_ns: int | None


@dataclass
class BatchPolicy:
    """The batching rule for one worker.

    ``per_image_ns`` is a running estimate of compute time per image (EWMA of observed
    batches), used to keep a waiting batch inside its oldest member's deadline.
    """

    max_batch: int
    max_delay_ns: int
    per_image_ns: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if self.max_delay_ns < 0:
            raise ValueError(f"max_delay_ns must be >= 0, got {self.max_delay_ns}")

    def plan(
        self, now_ns: int, ready: int, oldest: tuple[int, int] | None, idle: bool = False
    ) -> Plan:
        """Decide for ``ready`` queued requests whose best one has
        ``oldest = (enqueue_ns, deadline_ns)``; ``idle``: the worker's device computes nothing
        now (a pipelined backend), so a partial batch goes at once."""
        if ready <= 0 or oldest is None:
            return Plan(claim=0, wake_ns=None)
        target = min(ready, self.max_batch)
        if target >= self.max_batch or idle:
            return Plan(claim=target, wake_ns=None)
        enqueue_ns, deadline_ns = oldest
        fill_by = enqueue_ns + self.max_delay_ns
        slack_by = deadline_ns - int(self.per_image_ns * self.max_batch)
        wake_ns = min(fill_by, slack_by)
        if wake_ns <= now_ns:
            return Plan(claim=target, wake_ns=None)
        return Plan(claim=0, wake_ns=wake_ns)

    def expected_ns(self, batch_size: int) -> int:
        """The expected compute time of a batch of ``batch_size`` (0 before any was timed):
        a claim does not start a request with less time than this left before its deadline
        (it could only be answered late; ``claim_batch``'s ``lead_ns``)."""
        return int(self.per_image_ns * batch_size)

    def fit(self, batch_size: int, now_ns: int, deadline_ns: int) -> int:
        """The largest batch, at most ``batch_size``, whose expected compute still ends by
        ``deadline_ns`` (the best ready request's: it is claimed first and waits for its whole
        batch), at least 1: an urgent request does not wait for neighbours it cannot afford."""
        if self.per_image_ns <= 0.0:
            return batch_size
        return max(1, min(batch_size, int((deadline_ns - now_ns) // self.per_image_ns)))

    def observe(self, batch_size: int, compute_ns: int) -> None:
        """Fold a finished batch's compute time into the per-image estimate."""
        if batch_size <= 0 or compute_ns <= 0:
            return
        self.per_image_ns = ewma(self.per_image_ns, compute_ns / batch_size, EWMA_WEIGHT)

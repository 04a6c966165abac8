"""Overload: which requests the queue still takes, and which it makes room for.

Two rules, applied by the acceptor (``daemon/frontend/acceptor.py``) after a request's class
is known and before a slot is reserved, both pure arithmetic on numbers the queue reports:

**Deadlines that can be met** (:meth:`ServiceRate.refusal`). A request is refused
``overloaded`` at the door when the work queued ahead of it cannot be done before its
deadline: with ``s`` the measured service time per request of one worker (an EWMA of each
result's batch compute time over its batch size, :meth:`ServiceRate.observe`), ``W`` the
serving workers, ``A`` the requests queued (or being decoded, to be queued before it) at
its priority or higher (a claim takes those first) and ``C`` those being computed now
(half done, on average, when a request arrives), it would finish about
``now + ((A + C / 2) / W + 1) * s``. Before anything is measured nothing is refused this
way (a daemon that has served nothing yet must not refuse everything); the two checks behind
admission keep the deadline anyway: a worker does not start a request that its batch would
finish late (``claim_batch``'s ``lead_ns``), and a result that arrives late is answered
``timeout``, never ``ok`` (``daemon/frontend/dispatch.py``).

**Priority protection** (:func:`place`). The last ``reserved`` free slots
(``ceil(queue.slots * queue.reserved_share)``, at most all but one) are only for requests of
``queue.reserved_priority`` or higher. A request that finds no slot it may take makes room by
shedding the newest queued (not yet claimed) request of the lowest priority below its own,
which is answered ``overloaded`` (``RequestQueue.shed``); with none below it, it is refused
itself. So a flood of one priority never squeezes out a higher one, and a request is never
shed for one of its own priority or lower.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from scratchd.daemon.config import QueueConfig
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Completion, Handle, RequestQueue, Status

_OK: Final = Status.OK  # a constant: Status.OK is a descriptor call per read (Python 3.11)
SERVICE_WEIGHT: Final = 0.05
"""The newest result's share in the service-time estimate: a batch's results all carry its
time, so a few dozen results make the estimate (a few batches per worker)."""


@dataclass
class ServiceRate:
    """The measured service time per request of one worker (ns; 0.0: nothing measured)."""

    per_request_ns: float = 0.0

    def observe_all(self, completions: Iterable[Completion]) -> None:
        """Fold in each computed result, in order (a collected batch: one call)."""
        for completion in completions:
            result = completion.result
            if completion.status != _OK or result is None or result.batch_size <= 0:
                continue
            if result.compute_ns <= 0:
                continue
            sample = result.compute_ns / result.batch_size
            if self.per_request_ns == 0.0:
                self.per_request_ns = sample
            else:
                self.per_request_ns += SERVICE_WEIGHT * (sample - self.per_request_ns)

    def expected_ns(self, ahead: int, in_service: int, workers: int) -> int:
        """When a request with ``ahead`` queued before it, ``in_service`` being computed and
        ``workers`` serving would finish, from now (0 while nothing is measured)."""
        return int(((ahead + in_service / 2) / max(1, workers) + 1) * self.per_request_ns)

    def refusal(
        self, now_ns: int, deadline_ns: int, ahead: int, in_service: int, workers: int
    ) -> str | None:
        """Why a request due at ``deadline_ns`` cannot be served in time, or None."""
        if self.per_request_ns == 0.0:
            return None
        expected = self.expected_ns(ahead, in_service, workers)
        if now_ns + expected <= deadline_ns:
            return None
        left_ms = max(0, deadline_ns - now_ns) / NS_PER_MS
        return (
            f"cannot be served within its deadline: {ahead} requests queued ahead and "
            f"{in_service} in service on {max(1, workers)} workers need about "
            f"{expected / NS_PER_MS:.0f} ms, {left_ms:.0f} ms are left"
        )

    def surely_in_time(self, now_ns: int, deadline_ns: int, most: int) -> bool:
        """True when a request due at ``deadline_ns`` is in time whatever the load, as long
        as ``ahead + in_service / 2 <= most`` (then ``refusal`` would be None: the estimate
        grows with the load and falls with the workers, of which there is at least one).
        The usual request's answer without looking at the queue; False says nothing."""
        return now_ns + (most + 1) * self.per_request_ns <= deadline_ns


def late(
    service: ServiceRate, queue: RequestQueue, deadline_ns: int, priority: int, pending: int,
    converting: list[int],
) -> str | None:  # fmt: skip
    """Why a request of ``priority`` due at ``deadline_ns`` cannot be served in time behind
    the work queued ahead of it (``ServiceRate.refusal``), or None. ``pending``: requests
    submitted and not answered; ``converting``: images being decoded, by priority. The queue
    is only looked at when the deadline is near enough for its load to matter."""
    if service.per_request_ns == 0.0:
        return None  # nothing measured yet: nothing refused this way
    now = time.monotonic_ns()
    most = queue.geometry.slots + sum(converting) + pending  # >= ahead + in_service / 2
    if service.surely_in_time(now, deadline_ns, most):
        return None
    ahead, queued, workers = queue.load_ahead(priority)
    ahead += sum(converting[priority:])  # decoding now, queued before it once submitted
    return service.refusal(now, deadline_ns, ahead, max(0, pending - queued), workers)


def reserved_slots(queue: QueueConfig) -> int:
    """Slots only requests of ``reserved_priority`` or higher may take."""
    return min(queue.slots - 1, math.ceil(queue.slots * queue.reserved_share))


def place(priority: int, free: int, queue: QueueConfig) -> bool:
    """Whether a request of ``priority`` may take one of ``free`` slots (else it must shed a
    lower-priority request or be refused)."""
    if priority >= queue.reserved_priority:
        return free >= 1
    return free > reserved_slots(queue)


def keep_free(priority: int, queue: QueueConfig) -> int:
    """How many free slots a request of ``priority`` must leave to others: it may take one
    only while more than that many are free (``place``; ``RequestQueue.reserve(keep)``)."""
    return 0 if priority >= queue.reserved_priority else reserved_slots(queue)


def take_slot(
    queue: RequestQueue, priority: int, keep: int
) -> tuple[Handle | None, Completion | None]:
    """A WRITTEN slot for a request of ``priority`` that must leave ``keep`` free slots to
    others (``keep_free``; None: refuse it, ``full_reason``), and the request shed to make
    room for it, whose Completion the caller must answer."""
    handle = queue.reserve(keep)
    if handle is not None:
        return handle, None
    # None it may take is free: shed a queued request of lower priority and take its slot.
    shed = queue.shed(priority, shed_reason(priority))
    if shed is None:
        return None, None
    return queue.reserve(), shed  # the shed request's slot is free: only this process reserves


def shed_reason(priority: int) -> str:
    return f"queue full: shed to make room for a priority {priority} request"


def full_reason(priority: int, queue: QueueConfig) -> str:
    if priority >= queue.reserved_priority:
        return f"queue full: all {queue.slots} slots in use, none queued below priority {priority}"
    reserved = reserved_slots(queue)
    return (
        f"queue full for priority {priority}: no slot free beyond the {reserved} reserved "
        f"for priority {queue.reserved_priority} or higher, none of lower priority to shed"
    )

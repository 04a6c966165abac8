"""The in-flight table: from a queued descriptor back to the one reply its client gets.

Every request the acceptor enqueues is recorded here under its queue handle
``(index, generation)``. Completions reach the event loop without polling:

- the queue's completion doorbell (an eventfd rung by a worker after it flips a descriptor
  to DONE, and by reclaims) is registered with ``loop.add_reader``; its callback calls
  ``collect_completed``, which drains it first (a completion landing meanwhile rings again);
- while the loop is awake anyway (a completion or a request being handled), workers need not
  ring: the first ``enqueued`` or ``collect`` of a turn tells them so
  (``RequestQueue.quiet_completions``) and schedules one look (``_look``, ``call_soon``)
  that re-arms the doorbell and collects what finished meanwhile.
  A scheduled callback runs before the loop next sleeps (its poll does not block while one
  is pending), and the re-arm is the queue's handshake (a worker that finishes after the look
  sees it armed and rings), so a completion is never left unseen; it is answered in the same
  turn or earlier than its ring would have been, and the loop is woken less;
- deadlines: a single loop timer armed at the earliest queued deadline (no earlier than one
  tick from now, so a deadline inside the current wheel tick cannot spin the loop) calls
  ``expire_due``; the wheel answers expired requests ``timeout`` within a tick. A descriptor
  becomes QUEUED only by ``submit`` (then ``enqueued`` arms at its own deadline, without asking
  the queue) or by a reclaim (then ``requeued`` re-arms from ``next_deadline_ns()``), so the
  timer is always due by the earliest deadline; a worker's completion can only make the
  earliest deadline later, so the doorbell's ``collect`` never takes the queue lock to ask.

Deadlines hold: a result that reaches the dispatcher after its request's deadline is
answered ``timeout`` ("finished … ms after its deadline"), never ``ok``; the check and the
reply's ``total_ms`` read the same clock reading, and the reply is written in the same turn.
The accountant tells such a reply by its completion's status (``OK``) and counts it apart.

Exactly once: a reply is sent only by :meth:`Dispatcher.answer` (or, for a collected batch,
by ``_collect``, which does what ``answer`` does for each), and a queued request only
after its entry is *popped* from the table, so a completion that shows up twice (say, from
both a reclaim and a collect) or for a connection already gone is dropped, never re-sent.

The same two are the only places where each finished request is accounted
(``account(flight, reply, completion)``): metrics hook in there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final, Protocol

import msgspec

from scratchd.daemon.frontend.overload import ServiceRate
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Completion, Handle, RequestQueue, Status
from scratchd.protocol import wire

STATUS_NAMES: Final[dict[Status, wire.ReplyStatus]] = {
    Status.OK: "ok",
    Status.TIMEOUT: "timeout",
    Status.OVERLOADED: "overloaded",
    Status.INVALID: "invalid",
    Status.ERROR: "error",
}


class Peer(Protocol):
    """Where a request's reply goes: a Unix-socket ``Connection``, or any other front
    end's stand-in for one (``daemon/kserve/``). ``id`` keys the peer's requests in the queue
    (``abandon_connection``); ``in_queue`` and ``converting`` are its requests accepted and
    not yet answered, which the per-connection limit counts (``in_flight``)."""

    id: int
    closed: bool
    in_queue: set[Handle]
    converting: int

    def send(self, message: wire.Reply) -> None: ...

    def in_flight(self) -> int: ...

    def converted(self, _task: asyncio.Task[None]) -> None: ...


class InFlight(msgspec.Struct):
    """A request between its frame arriving and its reply being written (a msgspec Struct:
    built in C, one per request; never encoded)."""

    conn: Peer
    request_id: int
    part_class: str
    priority: int
    received_ns: int
    want_mask: bool = False
    handle: Handle | None = None
    deadline_ns: int = 0


Accountant = Callable[[InFlight, wire.Reply, Completion | None], None]


class Dispatcher:
    """Owns the in-flight table, the completion doorbell reader and the expiry timer."""

    def __init__(
        self,
        queue: RequestQueue,
        tick_ns: int,
        account: Accountant,
        worker_name: Callable[[int], str | None],
    ) -> None:
        self.queue = queue
        self.tick_ns = tick_ns
        self.account = account
        self.worker_name = worker_name
        self.pending: dict[Handle, InFlight] = {}
        self.service = ServiceRate()  # what admission weighs deadlines against (overload.py)
        self.idle = asyncio.Event()
        self.idle.set()
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ns = 0
        self._looking: asyncio.Handle | None = None  # the doorbell is quiet, this _look due

    def start(self) -> None:
        self._loop.add_reader(self.queue.completion_fd, self.collect)

    def stop(self) -> None:
        self._loop.remove_reader(self.queue.completion_fd)
        if self._looking is not None:  # nobody looks any more: workers ring again
            self._looking.cancel()
            self._looking = None
            self.queue.rearm_completions()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---- the one way out ----------------------------------------------------------------

    def answer(self, flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
        """Send ``reply`` to the flight's client (if still connected) and account it."""
        flight.conn.send(reply)
        self.account(flight, reply, completion)

    def reject(self, flight: InFlight, status: wire.ReplyStatus, reason: str) -> None:
        """Answer a request that never reached the queue."""
        timings = wire.Timings(total_ms=(time.monotonic_ns() - flight.received_ns) / NS_PER_MS)
        reply = wire.Reply(id=flight.request_id, status=status, timings=timings, error=reason)
        self.answer(flight, reply, None)

    # ---- requests in the queue ----------------------------------------------------------

    def enqueued(self, flight: InFlight) -> None:
        """Record a request just submitted to the queue."""
        assert flight.handle is not None
        self.pending[flight.handle] = flight
        flight.conn.in_queue.add(flight.handle)
        if len(self.pending) == 1:  # idle is only ever set with nothing pending
            self.idle.clear()
        if self._looking is None:  # the loop is awake: workers need not ring until _look
            self.queue.quiet_completions()
            self._looking = self._loop.call_soon(self._look)
        if self._timer is None or self._timer_ns > flight.deadline_ns:
            self._arm_at(flight.deadline_ns)  # else the armed timer fires first: no clock read

    def shed(self, completion: Completion) -> None:
        """Answer a request the queue shed (``RequestQueue.shed``: already out of the queue)."""
        self._finish([completion])
        self._note_idle()

    def forget_connection(self, conn: Peer) -> int:
        """A client left: drop its entries (the queue frees their slots). Returns how many."""
        for handle in conn.in_queue:
            self.pending.pop(handle, None)
        dropped = len(conn.in_queue)
        conn.in_queue.clear()
        self._note_idle()
        return dropped

    def collect(self, drain: bool = True) -> None:
        """Answer everything the queue has finished (``drain``: the doorbell first; ``_look``
        collects without, having re-armed it)."""
        if drain and self._looking is None:  # as in enqueued
            self.queue.quiet_completions()
            self._looking = self._loop.call_soon(self._look)
        self._finish(self.queue.collect_completed(drain))
        if not self.pending:
            self.idle.set()

    def _look(self) -> None:
        """Re-arm the doorbell, then answer what finished while it was quiet (scheduled by
        the turn's first ``enqueued`` or ``collect``; runs before the loop next sleeps)."""
        self._looking = None
        if self.queue.rearm_completions():
            self.collect(False)

    def requeued(self) -> None:
        """A dead worker's claims went back to the queue: answer what the reclaim finished
        (timeouts, quarantined failures) and re-arm the timer for the requeued deadlines."""
        self.collect()
        self.arm_expiry()

    def _on_timer(self) -> None:
        self._timer = None
        self._finish(self.queue.expire_due(time.monotonic_ns()))
        self.collect()
        self.arm_expiry()

    def arm_expiry(self) -> None:
        """Make sure a timer fires by the earliest queued deadline (at least a tick out)."""
        deadline = self.queue.next_deadline_ns()
        if deadline is not None:
            self._arm_at(deadline)

    def _arm_at(self, deadline: int) -> None:
        now = time.monotonic_ns()
        at = max(deadline, now + self.tick_ns)
        if self._timer is not None:
            if self._timer_ns <= at:
                return
            self._timer.cancel()
        self._timer_ns = at
        self._timer = self._loop.call_at(self._loop.time() + (at - now) / 1e9, self._on_timer)

    def _finish(self, completions: list[Completion]) -> None:
        """Answer finished requests, in one frame for a whole batch (the hot path): the
        service estimate takes them in one call, then each still-pending one is replied to
        and accounted (``answer``'s send and account, written out)."""
        self.service.observe_all(completions)
        pending, reply, account = self.pending, self._reply, self.account
        for completion in completions:
            handle = completion.handle
            flight = pending.pop(handle, None)
            if flight is None:
                continue  # its client left (abandoned) or it was answered already
            flight.conn.in_queue.discard(handle)
            message = reply(flight, completion)
            flight.conn.send(message)
            account(flight, message, completion)

    def _reply(self, flight: InFlight, c: Completion) -> wire.Reply:
        now = time.monotonic_ns()
        queue_end = c.claim_ns if c.claim_ns > 0 else (c.done_ns or now)
        result = c.result
        # Only a worker that produced the result is named (a reclaimed claim that then timed
        # out still records its dead owner's slot).
        if result is None:
            compute_ms, worker = 0.0, None
        else:
            compute_ms = result.compute_ns / NS_PER_MS
            worker = self.worker_name(c.worker) if c.worker >= 0 else None
        timings = wire.Timings(max(0, queue_end - c.enqueue_ns) / NS_PER_MS, compute_ms,
                               (now - flight.received_ns) / NS_PER_MS)  # fmt: skip
        status = STATUS_NAMES.get(c.status, "error")
        if status == "ok" and now > flight.deadline_ns:
            late_ms = (now - flight.deadline_ns) / NS_PER_MS
            reason = f"finished {late_ms:.1f} ms after its deadline"
            return wire.Reply(
                id=flight.request_id, status="timeout", timings=timings, worker=worker, error=reason
            )
        if status != "ok" or result is None:
            reason = (result.error if result is not None else "") or c.error or _REASONS[status]
            return wire.Reply(
                id=flight.request_id, status=status, timings=timings, worker=worker, error=reason
            )
        mask, shape = (None, None)
        if flight.want_mask and result.mask is not None:
            mask, shape = wire.pack_mask(result.mask)
        return wire.Reply(
            id=flight.request_id,
            status="ok",
            verdict="defect" if result.verdict_defect else "clean",
            score=float(result.score),
            boxes=result.boxes,  # tuples of Python floats (records.read_result)
            mask=mask,
            mask_shape=shape,
            timings=timings,
            worker=worker,
        )

    def fail_pending(self, reason: str) -> None:
        """Answer everything still in flight with ``error`` (shutdown past its bound)."""
        for handle, flight in list(self.pending.items()):
            del self.pending[handle]
            flight.conn.in_queue.discard(handle)
            self.reject(flight, "error", reason)
        self._note_idle()

    def _note_idle(self) -> None:
        if not self.pending:
            self.idle.set()


_REASONS: Final[dict[wire.ReplyStatus, str]] = {
    "ok": "the worker returned no result",
    "timeout": "deadline passed before a worker could serve it",
    "overloaded": "queue full",
    "invalid": "invalid request",
    "error": "request failed",
}

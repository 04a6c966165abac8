"""The request queue in shared memory: descriptors, scheduling, expiry, crash recovery.

Processes and roles (layout in ``ipc/shm.py``, value types in ``ipc/records.py``):

- **main process** (acceptor + supervisor): ``create``, ``reserve``/``payload``/``submit``/
  ``release``, ``collect_completed``, ``expire_due``, ``abandon_connection``,
  ``reclaim_worker``. It is the only process that moves descriptors to or from FREE, so its
  free list lives in its own memory.
- **workers** (``attach``): ``register_worker``, ``wait_for_work``, ``claim_batch``,
  ``input_view``, ``complete``, ``heartbeat``.

The main process against the queue (the worker side is sketched in ``ipc/claims.py``)::

    q = RequestQueue.create(f"/scratchd-{instance}", Geometry(slots=256, ...))
    loop.add_reader(q.completion_fd, on_completions)        # eventfd: no polling
    # spawn worker w with pass_fds=(q.completion_fd, q.work_fd(w))
    h = q.reserve()                                         # None → answer 'overloaded'
    q.payload(h)[: h_px * w_px] = pixels                    # raw uint8 greyscale, row-major
    q.submit(h, request_id=..., conn_id=..., priority=..., part_class=...,
             deadline_ns=time.monotonic_ns() + budget, height=h_px, width=w_px, want_mask=...)
    def on_completions():                                   # also on a timer at next_deadline_ns()
        for c in q.collect_completed() + q.expire_due(time.monotonic_ns()):
            reply(c)                                        # exactly one Completion per request
    # on a worker's death (pidfd): q.reclaim_worker(w, time.monotonic_ns(), max_kills)
    # on a client's disconnect: q.abandon_connection(conn_id); release() its WRITTEN handles
    q.close()                                               # the creator also unlinks

Scheduling: strictly higher priority first, earliest deadline first within a priority, FIFO
(enqueue sequence) among equals (``ipc/core.py``). A queued request whose deadline passes
is expired by ``expire_due`` (main, on a timer at ``next_deadline_ns``) or, if a worker gets
there first, by ``claim_batch`` — either way it is answered TIMEOUT and never computed.

Locking and the order of writes. Every change to a descriptor's ``state`` (except FREE ↔
WRITTEN, main only), the ready lists, the wheel, the done stack or the header counters
happens under the robust mutex, in an order chosen so that a SIGKILL at any instruction
leaves a state that ``_repair`` (run by the next locker on ``EOWNERDEAD``) turns back into a
consistent one. The descriptor table is the truth; the index is derived: repair re-links
exactly the QUEUED descriptors into fresh ready lists and wheel buckets and the finished
ones (DONE / EXPIRED / FAILED) into a fresh done stack (``ipc/core.py``).

- submit:   request fields (unlocked, the acceptor owns WRITTEN) → [lock] attempt = 0,
            claim_ns = 0, seq → ready list → wheel → state = QUEUED → take one waiting
            worker's bit [unlock] → ring that worker (none waiting: no ring).
- claim:    [lock] unlink from ready list and wheel → worker, pid, claim_ns, attempt →
            state = CLAIMED [unlock]. Killed before the state write: still QUEUED, repair
            re-links it. Killed after: CLAIMED by a dead pid, ``reclaim_worker`` requeues it.
            A claim that meets a passed deadline pushes the descriptor on the done stack
            and marks it EXPIRED instead (never computed).
- complete: result row and mask (unlocked, the worker owns its CLAIMED descriptor) →
            [lock] re-check ownership → done_ns → push on the done stack → state = DONE
            [unlock] → ring if ``completion_armed``. Killed before the flip: still CLAIMED,
            requeued; nothing half-written is ever read.
- reclaim:  (only after the worker is known dead) [lock] each claim: kills += 1, then
            FAILED (kills ≥ max_kills), EXPIRED (deadline passed) — both via the done
            stack — or back to the ready list and wheel then state = QUEUED; clear the
            worker row [unlock] → ring.
- collect:  [lock] pop the whole done stack → for each: copy out its request fields,
            generation += 1, worker = NIL, state = FREE (same hold, so a repair cannot push
            them again) [unlock] → read the result rows (nobody writes a FREE descriptor
            and only this process reuses one).

The C fast path (``ipc/_native.c``). submit, claim, complete and collect — the four
sections of every request's round trip — run as one C call each: trylock, the body above
in exactly that order, unlock. The named fault points (``ipc/faults.py``) inside them are
reached from C, with the lock held. If the trylock fails the call returns a sentinel and
Python takes the slow path (``QueueCore._contended``): BUSY → wait as every other section
does (the main process watching for a stuck holder), OWNER_DIED → ``_repair`` and mark
consistent; then the same C body runs with the lock held. Every other section (expiry,
reclaim, abandon, register, repair) is Python under the lock, calling the same C for the
ready lists and the wheel (``ipc/core.py``); the state machine test interleaves both.

Spinning before sleeping. A worker out of work spins ``worker_spin_us`` (header, set by
``create``; 0: off) on the ready counts before it sets its waiting bit and sleeps, so a
request that arrives meanwhile costs no wake-up and ``submit`` rings nobody. A main process
with a thread to spare may likewise spin in :meth:`RequestQueue.wait_for_completions`; the
handshake that keeps a completion from being missed::

    main (wait_for_completions)              worker (complete)
    armed = 0                                [lock] push on done stack [unlock]
    spin until done_head != NIL or timeout   fence (seq_cst)
    armed = 1, fence (seq_cst)               if armed: ring the completion eventfd
    done_head != NIL? → return True
    poll(completion eventfd)

Either the worker's load sees ``armed = 1`` (it rings) or the main's look sees the push:
both fences are sequentially consistent, so they cannot both miss. The daemon's event loop
never spins: ``armed`` stays 1 and every completion rings.

Between looks a spinner pauses and, if the other side was last seen spinning on the same
CPU (header ``main_cpu`` / ``worker_cpu``) or never spun, yields the CPU: the process it
waits for may be queued behind it. On a CPU of its own it does not yield, which would only
hand the CPU to unrelated work for a scheduler slice. A worker that finds the main process
spinning on its own CPU sleeps instead (at most once per 10 ms): two processes that keep
handing over by yields are never moved apart by the load balancer, a wake-up can land on an
idle CPU. A spin is bounded either way.

Stale writers: handles carry ``(index, generation)`` and every call checks both; a claim is
also bound to the worker slot, its pid and the claim's attempt number, so a late
``complete`` from a worker whose claim was reclaimed returns False and writes nothing.
``reclaim_worker`` must only be called once the worker process is gone (pidfd/waitpid).

Doorbells (``ipc/doorbell.py``): the creator makes one completion eventfd and one work
eventfd per worker slot; hand ``completion_fd`` and ``work_fd(slot)`` to the worker via
``pass_fds`` and its ``attach``.
"""

from __future__ import annotations

import struct
from time import monotonic_ns as time_ns
from typing import TYPE_CHECKING

import numpy as np

from scratchd.ipc._native import Contended
from scratchd.ipc.claims import WorkerOps
from scratchd.ipc.core import DEFAULT_WORKER_SPIN_US, DONE, EXPIRED, FREE, QUEUED, WRITTEN
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.layout import PRIORITIES, Geometry
from scratchd.ipc.records import (
    Claim,
    Completion,
    DescState,
    Handle,
    QueueError,
    ReclaimReport,
    Result,
    StaleHandle,
    Status,
    WorkerRow,
    WorkerSlotState,
    read_result,
)
from scratchd.ipc.shm import Segment

if TYPE_CHECKING:  # a type the stub names (ipc/_native.pyi), not a runtime attribute
    from scratchd.ipc._native import FinishedRow

__all__ = [
    "Claim",
    "Completion",
    "DescState",
    "Geometry",
    "Handle",
    "QueueError",
    "ReclaimReport",
    "RequestQueue",
    "Result",
    "StaleHandle",
    "Status",
    "WorkerRow",
    "WorkerSlotState",
]

_TIMEOUT_REASON = "deadline passed while queued"


class RequestQueue(WorkerOps):
    """The shared-memory request queue; see the module docstring for roles and ordering."""

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls, name: str, geometry: Geometry, *, worker_spin_us: int = DEFAULT_WORKER_SPIN_US
    ) -> RequestQueue:
        """Create the segment (main process); replaces a stale one, refuses a live owner's.

        ``worker_spin_us``: how long a worker that finds no work spins before it sleeps on
        its eventfd (stored in the header, so every worker uses the same; 0: never spin)."""
        seg = Segment.create(name, geometry)
        work = [Doorbell.create() for _ in range(geometry.max_workers)]
        q = cls(seg, Doorbell.create(), work)
        q._initialize(worker_spin_us)
        return q

    @classmethod
    def attach(
        cls, name: str, *, completion_fd: int | None = None, work_fd: int | None = None
    ) -> RequestQueue:
        """Map an existing queue (workers). The fds are the doorbells passed via ``pass_fds``."""
        seg = Segment.attach(name)
        completion = None if completion_fd is None else Doorbell.from_fd(completion_fd)
        work = [] if work_fd is None else [Doorbell.from_fd(work_fd)]
        return cls(seg, completion, work)

    def adopt_work_fd(self, work_fd: int) -> None:
        """Take a worker slot's work doorbell on a mapping attached without one: a warm
        standby maps the queue (and page-locks its inputs) at boot, before it is handed a
        slot; ``register_worker`` and ``wait_for_work`` follow."""
        if self._work:
            raise QueueError("this mapping has a work doorbell already")
        self._work = [Doorbell.from_fd(work_fd)]

    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def completion_fd(self) -> int:
        """The eventfd the main loop watches (``loop.add_reader``) for finished requests."""
        if self._completion is None:
            raise QueueError("this queue was attached without a completion doorbell")
        return self._completion.fileno()

    def work_fd(self, slot: int) -> int:
        """Worker slot ``slot``'s work eventfd (creator only), to pass to that worker."""
        if len(self._work) != self.geometry.max_workers:
            raise QueueError("work doorbells are held by the creating process only")
        return self._work[slot].fileno()

    def close(self) -> None:
        """Unmap. The creator also unlinks the segment and closes the doorbells it made.

        Raises RuntimeError, closing nothing, while another thread of this process is inside
        a wait's spin (it reads the mapping without the GIL)."""
        self._native.close()
        if self._seg.owner:
            self._seg.unlink()
        for bell in [*self._work, *([self._completion] if self._completion else [])]:
            bell.close()
        self._mutex.close()
        for attr in ("_d", "_r", "_waiting", "_done_head", "_inputs_ro"):
            setattr(self, attr, None)
        self._w_pid = self._w_state = None  # type: ignore[assignment]
        self._seg.close()

    def unlink(self) -> None:
        """Remove the segment's name now (mappings stay valid until closed)."""
        self._seg.unlink()

    # ---------------------------------------------------------------- acceptor side
    def reserve(self) -> Handle | None:
        """A FREE descriptor, now WRITTEN and owned by the caller; None when full (overloaded)."""
        state = self._d.state
        while True:
            if not self._free_list:
                scan = np.flatnonzero(self._seg.descs["state"] == FREE)
                self._free_list.extend(scan.tolist())
                if not self._free_list:
                    return None
            i = self._free_list.popleft()
            if state[i] == FREE:
                state[i] = WRITTEN
                return Handle(i, int(self._d.generation[i]))

    def payload(self, h: Handle) -> memoryview:
        """The writable input slot (``slot_bytes``) of a WRITTEN descriptor."""
        self._expect(h, WRITTEN)
        return self._seg.inputs[h.index].data

    def submit(
        self, h: Handle, *, request_id: int, conn_id: int, priority: int, part_class: int,
        deadline_ns: int, height: int, width: int, want_mask: bool,
    ) -> None:  # fmt: skip
        """Publish a WRITTEN descriptor whose input slot holds ``height × width`` pixels."""
        self._expect(h, WRITTEN)
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"priority {priority} outside 0..{PRIORITIES - 1}")
        if height <= 0 or width <= 0 or height * width > self.geometry.slot_bytes:
            raise ValueError(
                f"image {height}x{width} does not fit a {self.geometry.slot_bytes} B slot"
            )
        i = h.index
        try:
            self._seg.request_block.pack(
                i, request_id, conn_id, time_ns(), deadline_ns, part_class, height, width,
                priority, 1 if want_mask else 0, 0, 0,  # abandoned, kills
            )  # fmt: skip
        except struct.error as exc:  # nothing was written; the descriptor stays WRITTEN
            raise ValueError(
                f"request field out of range (request_id and conn_id are u64, part_class "
                f"i32, deadline_ns i64): {exc}"
            ) from exc
        # [lock] attempt, seq, ready list, wheel, state = QUEUED, take a waiting worker [unlock]
        wake = self._native.submit(False, i)
        if isinstance(wake, Contended):
            wake = self._contended(wake, self._native.submit, i)
        if wake >= 0:
            self._ring_workers([wake])

    def release(self, h: Handle) -> None:
        """Give back a WRITTEN descriptor that will not be submitted."""
        self._expect(h, WRITTEN)
        self._make_free(h.index)

    def abandon_connection(self, conn_id: int) -> int:
        """The client left: its queued requests are freed now, its claimed and finished ones
        when ``collect_completed`` meets them (without a Completion).

        WRITTEN descriptors are the acceptor's own: it must ``release`` them. Returns the
        number of requests dropped.
        """
        d = self._d
        with self._mutex:
            dn = self._seg.descs
            mine = np.flatnonzero((dn["conn_id"] == conn_id) & (dn["state"] >= QUEUED)).tolist()
            for i in mine:
                if d.state[i] == QUEUED:
                    self._native.unlink(i)
                    self._make_free(i)
                else:
                    d.abandoned[i] = 1
            self._seg.header["abandoned"] += len(mine)
        return len(mine)

    def collect_completed(self) -> list[Completion]:
        """Every finished (DONE / EXPIRED / FAILED) request as a Completion, oldest first;
        their descriptors are FREE afterwards.

        Drains the completion doorbell first, so a completion that lands later rings again.
        Requests whose client left are freed without a Completion.
        """
        if self._completion is not None:
            self._completion.drain()
        # [lock] pop the done stack, free each in the same hold [unlock]
        finished = self._native.collect(False)
        if isinstance(finished, Contended):
            finished = self._contended(finished, self._native.collect)
        # FREE but not reused before we return (only this process reserves): read unlocked.
        out = [self._completion_of(row) for row in finished if not row[3]]  # 3: abandoned
        if self._seg.owner:
            self._free_list.extend([row[0] for row in finished])
        return out

    def wait_for_completions(self, timeout_s: float | None, spin_us: int = 0) -> bool:
        """Wait until a finished request waits for ``collect_completed``, spinning first for
        up to ``spin_us``, then sleeping on the completion eventfd for up to ``timeout_s``
        (None: forever). True if one waits now; False after the timeout or a stale ring.

        For a main process that has a thread to spare (the benchmark, a synchronous
        embedding); the daemon's event loop instead watches ``completion_fd`` and never
        spins. While this spins, ``completion_armed`` is 0 and workers skip the eventfd
        write; it is re-armed (seq_cst) and the done stack looked at once more before the
        ``poll``, so a completion is never missed."""
        if self._completion is None:
            raise QueueError("wait_for_completions needs the completion doorbell")
        if self._native.await_done(spin_us * 1000):
            return True
        self._completion.wait(timeout_s)  # a stale ring (collected already) wakes it early
        return self._native.await_done(0)

    def expire_due(self, now_ns: int) -> list[Completion]:
        """Answer TIMEOUT for every queued request whose deadline is ``≤ now_ns``."""
        d = self._d
        with self._mutex:
            due = self._native.expire(now_ns)  # unlinked from the wheel and ready lists
            if self._faulty:
                self._fault.reach("expire.unlinked")
            for i in due:
                d.done_ns[i] = now_ns
                d.state[i] = EXPIRED
            if due:
                self._seg.header["expired"] += len(due)
            out = [self._completion_of(self._native.finished(i)) for i in due]
            for i in due:
                self._make_free(i)
        return out

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline among queued requests (when to call ``expire_due``)."""
        with self._mutex:
            return self._native.earliest_deadline()

    def depth_by_priority(self) -> list[int]:
        """Queued requests per priority, index 0..7."""
        with self._mutex:
            return [int(n) for n in self._seg.ready_count]

    def counters(self) -> dict[str, int]:
        """Totals since creation: repairs (after a dead lock holder), expired, requeued,
        quarantined and abandoned requests."""
        h = self._seg.header
        names = ("repairs", "expired", "requeued", "quarantined", "abandoned")
        return {n: int(h[n]) for n in names}

    def free_count(self) -> int:
        """FREE descriptors now (a lock-free snapshot; counts_by_state's FREE entry without
        the other states: the acceptor asks it per large frame)."""
        return int(np.count_nonzero(self._seg.descs["state"] == FREE))

    def counts_by_state(self) -> dict[DescState, int]:
        """Descriptors per state (a lock-free snapshot)."""
        counts = np.bincount(self._seg.descs["state"], minlength=len(DescState))
        return {s: int(counts[s.value]) for s in DescState}

    # ---------------------------------------------------------------- internals
    def _completion_of(self, row: FinishedRow) -> Completion:
        i, gen, state, _, rid, conn, enqueued, part, h, w, prio, kills, claimed, done, worker = row
        result, error = None, ""
        if state == DONE:
            result = read_result(self._seg.result_block, self._r, self._seg.masks, i, h, w)
            status = result.status
        elif state == EXPIRED:
            status, error = Status.TIMEOUT, _TIMEOUT_REASON
        else:
            status = Status.ERROR
            error = f"quarantined: {kills} workers died while processing this request"
        return Completion(
            handle=Handle(i, gen), request_id=rid, conn_id=conn, part_class=part, priority=prio,
            status=status, result=result, enqueue_ns=enqueued, claim_ns=claimed, done_ns=done,
            worker=worker, error=error,
        )  # fmt: skip

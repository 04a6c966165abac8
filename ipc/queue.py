"""The request queue in shared memory: descriptors, scheduling, expiry, crash recovery.

Processes and roles (layout in ``ipc/shm.py``, value types in ``ipc/records.py``):

- **main process** (acceptor + supervisor): ``create``, ``reserve``/``payload``/``submit``/
  ``release``, ``collect_completed``, ``expire_due``, ``abandon_connection``,
  ``reclaim_worker``. It is the only process that moves descriptors to or from FREE, so its
  free list lives in its own memory.
- **workers** (``attach``): ``register_worker``, ``wait_for_work``, ``claim_batch``,
  ``input_view``, ``complete``, ``heartbeat``.

Scheduling: strictly higher priority first, earliest deadline first within a priority, FIFO
(enqueue sequence) among equals (``ipc/ready.py``). A queued request whose deadline passes
is expired by ``expire_due`` (main, on a timer at ``next_deadline_ns``) or, if a worker gets
there first, by ``claim_batch`` — either way it is answered TIMEOUT and never computed.

Locking and the order of writes. Every change to a descriptor's ``state``, the ready lists,
the wheel or the header counters happens under the robust mutex, in an order chosen so that
a SIGKILL at any instruction leaves a state that ``_repair`` (run by the next locker on
``EOWNERDEAD``) turns back into a consistent one. The descriptor table is the truth; the
index is derived: repair re-links exactly the QUEUED descriptors into fresh ready lists and
wheel buckets.

- submit:   request fields (unlocked, the acceptor owns WRITTEN) → [lock] seq → ready
            list → wheel → state = QUEUED → pick a waiting worker [unlock] → ring it.
- claim:    [lock] unlink from ready list and wheel → worker, pid, claim_ns → state =
            CLAIMED [unlock]. Killed before the state write: still QUEUED, repair re-links
            it. Killed after: CLAIMED by a dead pid, ``reclaim_worker`` requeues it.
- complete: result row and mask (unlocked, the worker owns its CLAIMED descriptor) →
            [lock] re-check ownership → done_ns → state = DONE [unlock] → ring. Killed
            before the flip: still CLAIMED, requeued; nothing half-written is ever read.
- reclaim:  (only after the worker is known dead) [lock] each claim: kills += 1, then
            FAILED (kills ≥ max_kills), EXPIRED (deadline passed) or back to the ready list
            and wheel then state = QUEUED; clear the worker row [unlock] → ring.

Stale writers: handles carry ``(index, generation)`` and every call checks both; a claim is
also bound to the worker slot, its pid and the claim time, so a late ``complete`` from a
worker whose claim was reclaimed returns False and writes nothing. ``reclaim_worker`` must
only be called once the worker process is gone (pidfd/waitpid said so).

Doorbells (``ipc/doorbell.py``): the creator makes one completion eventfd and one work
eventfd per worker slot; hand ``completion_fd`` and ``work_fd(slot)`` to the worker via
``pass_fds`` and its ``attach``.
"""

from __future__ import annotations

from collections import deque
from time import monotonic_ns as time_ns

import numpy as np

from scratchd.ipc.claims import WorkerOps
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.faults import FaultPoint
from scratchd.ipc.lock import RobustMutex
from scratchd.ipc.ready import ReadyLists
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
from scratchd.ipc.shm import MUTEX_OFFSET, NIL, PRIORITIES, Geometry, Segment
from scratchd.ipc.wheel import TimingWheel

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

_FREE, _WRITTEN, _QUEUED = DescState.FREE, DescState.WRITTEN, DescState.QUEUED
_CLAIMED, _DONE, _EXPIRED, _FAILED = (
    DescState.CLAIMED,
    DescState.DONE,
    DescState.EXPIRED,
    DescState.FAILED,
)


class RequestQueue(WorkerOps):
    """The shared-memory request queue; see the module docstring for roles and ordering."""

    def __init__(self, seg: Segment, completion: Doorbell | None, work: list[Doorbell]) -> None:
        self._seg = seg
        self.geometry = seg.geometry
        self._fault = FaultPoint.from_env()
        self._completion = completion
        self._work = work  # creator: one per slot; a worker: [its own] or []
        self._mutex = RobustMutex(seg.mm, MUTEX_OFFSET, repair=self._repair)
        d = seg.descs
        self._state, self._gen, self._prio = d["state"], d["generation"], d["priority"]
        self._deadline, self._seq, self._owner = d["deadline_ns"], d["seq"], d["worker"]
        self._ready = ReadyLists(
            seg.ready_head, seg.ready_tail, seg.ready_count, d["rnext"], d["rprev"],
            self._prio, self._deadline, self._seq,
        )  # fmt: skip
        self._cursor = seg.header_cell("wheel_cursor")
        self._wheel = TimingWheel(
            seg.wheel_head, d["wnext"], d["wprev"], d["wbucket"], self._deadline, self._cursor,
            base_ns=int(seg.header["clock_base_ns"]), tick_ns=self.geometry.tick_ms * 1_000_000,
        )  # fmt: skip
        self._hseq, self._waiting = seg.header_cell("seq"), seg.header_cell("waiting")
        self._free_list: deque[int] = deque()

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def create(cls, name: str, geometry: Geometry) -> RequestQueue:
        """Create the segment (main process); replaces a stale one, refuses a live owner's."""
        seg = Segment.create(name, geometry)
        work = [Doorbell.create() for _ in range(geometry.max_workers)]
        q = cls(seg, Doorbell.create(), work)
        q._mutex.initialize()
        d = seg.descs
        for link in ("rnext", "rprev", "wnext", "wprev", "wbucket", "worker"):
            d[link] = NIL
        seg.ready_head[:] = NIL
        seg.ready_tail[:] = NIL
        seg.wheel_head[:] = NIL
        q._free_list.extend(range(geometry.slots))
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
        """Unmap. The creator also unlinks the segment and closes the doorbells it made."""
        if self._seg.owner:
            self._seg.unlink()
        for bell in [*self._work, *([self._completion] if self._completion else [])]:
            bell.close()
        self._mutex.close()
        for attr in ("_state", "_gen", "_prio", "_deadline", "_seq", "_owner"):
            setattr(self, attr, None)
        self._ready = self._wheel = None  # type: ignore[assignment]
        self._cursor = self._hseq = self._waiting = None  # type: ignore[assignment]
        self._seg.close()

    def unlink(self) -> None:
        """Remove the segment's name now (mappings stay valid until closed)."""
        self._seg.unlink()

    # ---------------------------------------------------------------- acceptor side
    def reserve(self) -> Handle | None:
        """A FREE descriptor, now WRITTEN and owned by the caller; None when full (overloaded)."""
        while True:
            if not self._free_list:
                self._free_list.extend(np.flatnonzero(self._state == _FREE).tolist())
                if not self._free_list:
                    return None
            i = self._free_list.popleft()
            if self._state[i] == _FREE:
                self._state[i] = _WRITTEN
                return Handle(i, int(self._gen[i]))

    def payload(self, h: Handle) -> memoryview:
        """The writable input slot (``slot_bytes``) of a WRITTEN descriptor."""
        self._expect(h, _WRITTEN)
        return memoryview(self._seg.inputs[h.index])

    def submit(
        self, h: Handle, *, request_id: int, conn_id: int, priority: int, part_class: int,
        deadline_ns: int, height: int, width: int, want_mask: bool,
    ) -> None:  # fmt: skip
        """Publish a WRITTEN descriptor whose input slot holds ``height × width`` pixels."""
        self._expect(h, _WRITTEN)
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"priority {priority} outside 0..{PRIORITIES - 1}")
        if height <= 0 or width <= 0 or height * width > self.geometry.slot_bytes:
            raise ValueError(
                f"image {height}x{width} does not fit a {self.geometry.slot_bytes} B slot"
            )
        i = h.index
        row = self._seg.descs[i]
        row["request_id"], row["conn_id"], row["part_class"] = request_id, conn_id, part_class
        row["priority"], row["height"], row["width"] = priority, height, width
        row["want_mask"], row["abandoned"], row["kills"] = bool(want_mask), 0, 0
        row["attempt"] = 0
        row["enqueue_ns"], row["deadline_ns"] = time_ns(), deadline_ns
        row["claim_ns"] = row["done_ns"] = 0
        self._mutex.acquire()
        try:
            self._hseq[0] += 1
            self._seq[i] = self._hseq[0]
            self._ready.push(i)
            self._wheel.insert(i)
            self._fault.reach("submit.linked")
            self._state[i] = _QUEUED
            wake = self._pick_waiting(1)
        finally:
            self._mutex.release()
        self._ring_workers(wake)

    def release(self, h: Handle) -> None:
        """Give back a WRITTEN descriptor that will not be submitted."""
        self._expect(h, _WRITTEN)
        self._make_free(h.index)

    def abandon_connection(self, conn_id: int) -> int:
        """The client left: free its queued and finished requests now, claimed ones when done.

        WRITTEN descriptors are the acceptor's own and must be ``release``d by it. Returns the
        number of requests dropped or marked.
        """
        with self._mutex.held():
            mine = np.flatnonzero(
                (self._seg.descs["conn_id"] == conn_id) & (self._state >= _QUEUED)
            ).tolist()
            for i in mine:
                if self._state[i] == _QUEUED:
                    self._ready.remove(i)
                    self._wheel.remove(i)
                if self._state[i] == _CLAIMED:
                    self._seg.descs["abandoned"][i] = 1
                else:
                    self._make_free(i)
            self._seg.header["abandoned"] += len(mine)
        return len(mine)

    def collect_completed(self) -> list[Completion]:
        """Every DONE / EXPIRED / FAILED request as a Completion, its descriptor freed.

        Drains the completion doorbell first, so a completion that lands during the scan
        rings again. Requests whose client left are freed without a Completion.
        """
        if self._completion is not None:
            self._completion.drain()
        with self._mutex.held():  # the lock orders our reads after the workers' flips
            finished = np.flatnonzero(self._state >= _DONE).tolist()
        # Only this process moves a finished descriptor on, so it is read without the lock.
        out = [c for i in finished if (c := self._completion_of(i)) is not None]
        with self._mutex.held():
            for i in finished:
                self._make_free(i)
        return out

    def expire_due(self, now_ns: int) -> list[Completion]:
        """Answer TIMEOUT for every queued request whose deadline is ``≤ now_ns``."""
        with self._mutex.held():
            due = self._wheel.expire_due(now_ns)
            for i in due:
                self._ready.remove(i)
            self._fault.reach("expire.unlinked")
            for i in due:
                self._state[i] = _EXPIRED
                self._seg.descs["done_ns"][i] = now_ns
            self._seg.header["expired"] += len(due)
            out = [c for i in due if (c := self._completion_of(i)) is not None]
            for i in due:
                self._make_free(i)
        return out

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline among queued requests (when to call ``expire_due``)."""
        with self._mutex.held():
            return self._ready.earliest_deadline()

    def depth_by_priority(self) -> list[int]:
        """Queued requests per priority, index 0..7."""
        with self._mutex.held():
            return [int(n) for n in self._seg.ready_count]

    def counters(self) -> dict[str, int]:
        """Totals since creation: repairs (after a dead lock holder), expired, requeued,
        quarantined and abandoned requests."""
        h = self._seg.header
        names = ("repairs", "expired", "requeued", "quarantined", "abandoned")
        return {n: int(h[n]) for n in names}

    def counts_by_state(self) -> dict[DescState, int]:
        counts = np.bincount(self._state, minlength=len(DescState))
        return {s: int(counts[s]) for s in DescState}

    # ---------------------------------------------------------------- internals
    def _expect(self, h: Handle, state: DescState) -> None:
        i = h.index
        if not 0 <= i < self.geometry.slots:
            raise StaleHandle(f"descriptor {i} out of range")
        if self._gen[i] != h.generation or self._state[i] != state:
            raise StaleHandle(
                f"descriptor {i} gen {h.generation} is not {state.name} "
                f"(now gen {int(self._gen[i])}, {DescState(int(self._state[i])).name})"
            )

    def _make_free(self, i: int) -> None:
        # Generation first: from here on every old handle of this descriptor is stale.
        self._gen[i] = (int(self._gen[i]) + 1) & 0xFFFFFFFF
        self._owner[i] = NIL
        self._state[i] = _FREE
        if self._seg.owner:
            self._free_list.append(i)

    def _completion_of(self, i: int) -> Completion | None:
        row = self._seg.descs[i]
        if row["abandoned"]:
            return None
        state, result, error = int(row["state"]), None, ""
        h, w = int(row["height"]), int(row["width"])
        if state == _DONE:
            result = read_result(self._seg.results[i], self._seg.masks[i], h, w)
            status = result.status
        elif state == _EXPIRED:
            status, error = Status.TIMEOUT, "deadline passed while queued"
        else:
            status = Status.ERROR
            kills = int(row["kills"])
            error = f"quarantined: {kills} workers died while processing this request"
        return Completion(
            handle=Handle(i, int(row["generation"])), request_id=int(row["request_id"]),
            conn_id=int(row["conn_id"]), part_class=int(row["part_class"]),
            priority=int(row["priority"]), status=status, result=result,
            enqueue_ns=int(row["enqueue_ns"]), claim_ns=int(row["claim_ns"]),
            done_ns=int(row["done_ns"]), worker=int(row["worker"]), error=error,
        )  # fmt: skip

    def _pick_waiting(self, n: int) -> list[int]:
        """Take up to ``n`` waiting worker slots off the waiting mask (lock held)."""
        mask, picked = int(self._waiting[0]), list[int]()
        while mask and len(picked) < n:
            low = mask & -mask
            picked.append(low.bit_length() - 1)
            mask ^= low
        self._waiting[0] = mask
        return picked

    def _ring_workers(self, slots: list[int]) -> None:
        if len(self._work) == self.geometry.max_workers:
            for w in slots:
                self._work[w].ring()

    def _repair(self) -> None:
        """Rebuild the index from the descriptor table (a lock holder died; lock held)."""
        queued = np.flatnonzero(self._state == _QUEUED).tolist()
        self._ready.rebuild(queued)
        self._wheel.rebuild(queued)
        self._seg.header["repairs"] += 1

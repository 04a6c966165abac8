"""The worker and supervisor half of :class:`~scratchd.ipc.queue.RequestQueue`.

Kept apart from ``ipc/queue.py`` (the acceptor half and the lifecycle) only to keep modules
small; the order of writes for claim, complete and reclaim is in that module's docstring.

A worker's life against the queue::

    q = RequestQueue.attach(name, completion_fd=c_fd, work_fd=w_fd)
    q.register_worker(slot, os.getpid())
    while running:
        q.heartbeat(slot, time.monotonic_ns())
        if not q.wait_for_work(slot, timeout_s=0.1):   # sleeps on the work eventfd
            continue
        claims = q.claim_batch(slot, max_batch, time.monotonic_ns())
        images = [q.input_view(c) for c in claims]      # zero-copy (H, W) uint8
        for c, r in zip(claims, compute(images)):
            q.complete(slot, c, r)                      # rings the completion doorbell

The waiting mask (header ``waiting``, bit per worker slot) is how ``submit`` knows whom to
wake: ``wait_for_work`` sets the worker's bit under the lock only after seeing too little
work under that same lock, and ``submit`` clears one bit under the lock and rings that
worker's eventfd; an eventfd stays readable until read, so no wake-up is lost between the
check and the ``poll``.
"""

from __future__ import annotations

import os
from collections import deque
from time import monotonic_ns as time_ns

import numpy as np

from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.faults import FaultPoint
from scratchd.ipc.lock import RobustMutex
from scratchd.ipc.ready import ReadyLists
from scratchd.ipc.records import (
    Claim,
    DescState,
    Handle,
    QueueError,
    ReclaimReport,
    Result,
    WorkerRow,
    WorkerSlotState,
    write_result,
)
from scratchd.ipc.shm import NIL, Geometry, Segment
from scratchd.ipc.wheel import TimingWheel

_QUEUED, _CLAIMED, _DONE = DescState.QUEUED, DescState.CLAIMED, DescState.DONE
_EXPIRED, _FAILED = DescState.EXPIRED, DescState.FAILED


class WorkerOps:
    """Worker and supervisor operations; the state they use is set up by RequestQueue."""

    geometry: Geometry
    _seg: Segment
    _mutex: RobustMutex
    _fault: FaultPoint
    _completion: Doorbell | None
    _work: list[Doorbell]
    _state: np.ndarray
    _gen: np.ndarray
    _deadline: np.ndarray
    _owner: np.ndarray
    _ready: ReadyLists
    _wheel: TimingWheel
    _waiting: np.ndarray
    _free_list: deque[int]

    def _pick_waiting(self, n: int) -> list[int]:
        raise NotImplementedError

    def _ring_workers(self, slots: list[int]) -> None:
        raise NotImplementedError

    def _make_free(self, i: int) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- workers
    def register_worker(self, slot: int, pid: int) -> None:
        """Make ``slot`` ACTIVE for ``pid`` (idempotent for the same pid).

        Raises QueueError if another live registration holds the slot: the supervisor must
        ``reclaim_worker`` a dead worker's slot before a replacement registers in it.
        """
        self._check_slot(slot)
        with self._mutex.held():
            row = self._seg.workers[slot]
            if row["state"] == WorkerSlotState.ACTIVE:
                if int(row["pid"]) == pid:
                    return
                raise QueueError(f"worker slot {slot} is held by pid {int(row['pid'])}")
            now = time_ns()
            row["pid"], row["state"] = pid, WorkerSlotState.ACTIVE
            row["registered_ns"] = row["heartbeat_ns"] = now
            row["batches"] = row["requests"] = 0
            self._waiting[0] = int(self._waiting[0]) & ~(1 << slot)

    def heartbeat(self, slot: int, now_ns: int) -> None:
        """Record that the worker in ``slot`` is alive (its own field: no lock)."""
        self._seg.workers["heartbeat_ns"][slot] = now_ns

    def ready_count(self) -> int:
        """Queued requests right now (a lock-free snapshot; exact only under the lock)."""
        return self._ready.total()

    def wait_for_work(self, slot: int, timeout_s: float | None, min_ready: int = 1) -> bool:
        """Return True at once if ``min_ready`` requests are queued, else sleep on this
        worker's work doorbell until a submit rings it or ``timeout_s`` passes.

        True means "look again": it does not reserve anything for this worker.
        """
        if not self._work:
            raise QueueError("wait_for_work needs the work doorbell (attach with work_fd=)")
        bit = 1 << slot
        with self._mutex.held():
            if self._ready.total() >= min_ready:
                return True
            self._waiting[0] = int(self._waiting[0]) | bit
        bell = self._work[0] if len(self._work) == 1 else self._work[slot]
        if bell.wait(timeout_s):
            return True
        with self._mutex.held():
            self._waiting[0] = int(self._waiting[0]) & ~bit
        return self._ready.total() >= min_ready

    def claim_batch(self, slot: int, max_n: int, now_ns: int) -> list[Claim]:
        """Take up to ``max_n`` requests in scheduling order; late ones become EXPIRED.

        Raises QueueError if this process is not the worker registered in ``slot`` (e.g. it
        was reclaimed): such a worker must exit, not claim.
        """
        d, expired, pid = self._seg.descs, 0, os.getpid()
        claims: list[Claim] = []
        with self._mutex.held():
            row = self._seg.workers[slot]
            if row["state"] != WorkerSlotState.ACTIVE or int(row["pid"]) != pid:
                raise QueueError(f"pid {pid} is not the worker registered in slot {slot}")
            while len(claims) < max_n:
                i = self._ready.best()
                if i == NIL:
                    break
                self._ready.remove(i)
                self._wheel.remove(i)
                self._fault.reach("claim.unlinked")
                if self._deadline[i] <= now_ns:
                    d["done_ns"][i] = now_ns
                    self._state[i] = _EXPIRED
                    expired += 1
                    continue
                d["worker"][i], d["worker_pid"][i], d["claim_ns"][i] = slot, pid, now_ns
                d["attempt"][i] += 1
                self._state[i] = _CLAIMED
                self._fault.reach("claim.marked")
                claims.append(self._claim_of(i))
            self._seg.header["expired"] += expired
        if expired and self._completion is not None:
            self._completion.ring()
        if claims:
            w = self._seg.workers
            w["batches"][slot] += 1
            w["requests"][slot] += len(claims)
        self._fault.reach("claim.returned")
        return claims

    def input_view(self, c: Claim) -> np.ndarray:
        """Read-only ``(height, width)`` uint8 view of the claim's input slot (zero-copy)."""
        view = self._seg.inputs[c.handle.index, : c.height * c.width].reshape(c.height, c.width)
        view.flags.writeable = False
        return view

    def oldest_ready(self) -> tuple[int, int] | None:
        """``(enqueue_ns, deadline_ns)`` of the request a claim would get next, or None."""
        with self._mutex.held():
            i = self._ready.best()
            if i == NIL:
                return None
            return int(self._seg.descs["enqueue_ns"][i]), int(self._deadline[i])

    def complete(self, slot: int, c: Claim, result: Result) -> bool:
        """Write ``result`` and flip the claim to DONE; False (nothing written) if stale.

        Raises ValueError (nothing written, still CLAIMED) for a malformed result.
        """
        i = c.handle.index
        if not self._owns(slot, c):
            return False
        write_result(
            self._seg.results[i], self._seg.masks[i], result, c.height, c.width,
            between=lambda: self._fault.reach("complete.mid_result"),
        )  # fmt: skip
        with self._mutex.held():
            if not self._owns(slot, c):
                return False
            self._seg.descs["done_ns"][i] = time_ns()
            self._state[i] = _DONE
            self._fault.reach("complete.flipped")
        if self._completion is not None:
            self._completion.ring()
        return True

    # ---------------------------------------------------------------- supervisor
    def reclaim_worker(self, slot: int, now_ns: int, max_kills: int = 3) -> ReclaimReport:
        """Return a DEAD worker's claims: requeue, expire (deadline passed) or quarantine
        (it has now died holding a request ``max_kills`` times); clear its worker row.

        Call only after the process is known to be gone (pidfd readable / waitpid).
        """
        self._check_slot(slot)
        with self._mutex.held():
            report = ReclaimReport(slot=slot, pid=int(self._seg.workers["pid"][slot]))
            held = np.flatnonzero((self._state == _CLAIMED) & (self._owner == slot)).tolist()
            for i in held:
                self._return_claim(i, now_ns, max_kills, report)
            row = self._seg.workers[slot]
            row["pid"], row["state"] = 0, WorkerSlotState.EMPTY
            self._waiting[0] = int(self._waiting[0]) & ~(1 << slot)
            h = self._seg.header
            h["requeued"] += len(report.requeued)
            h["expired"] += len(report.expired)
            h["quarantined"] += len(report.quarantined)
            wake = self._pick_waiting(len(report.requeued))
        self._ring_workers(wake)
        if (report.expired or report.quarantined) and self._completion is not None:
            self._completion.ring()
        return report

    def worker_rows(self) -> list[WorkerRow]:
        """Registered workers (not EMPTY rows), with what each holds right now."""
        w = self._seg.workers
        active = np.flatnonzero(w["state"] != WorkerSlotState.EMPTY).tolist()
        claimed = np.bincount(
            self._owner[self._state == _CLAIMED].astype(np.int64) + 1,
            minlength=self.geometry.max_workers + 1,
        )
        return [
            WorkerRow(
                slot=s,
                pid=int(w["pid"][s]),
                state=WorkerSlotState(int(w["state"][s])),
                registered_ns=int(w["registered_ns"][s]),
                heartbeat_ns=int(w["heartbeat_ns"][s]),
                batches=int(w["batches"][s]),
                requests=int(w["requests"][s]),
                claimed=int(claimed[s + 1]),
            )
            for s in active
        ]

    # ---------------------------------------------------------------- internals
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.geometry.max_workers:
            raise QueueError(f"worker slot {slot} outside 0..{self.geometry.max_workers - 1}")

    def _owns(self, slot: int, c: Claim) -> bool:
        i, d = c.handle.index, self._seg.descs
        return bool(
            self._gen[i] == c.handle.generation
            and self._state[i] == _CLAIMED
            and self._owner[i] == slot
            and d["worker_pid"][i] == os.getpid()
            and d["attempt"][i] == c.attempt
        )

    def _claim_of(self, i: int) -> Claim:
        row = self._seg.descs[i]
        return Claim(
            handle=Handle(i, int(row["generation"])), request_id=int(row["request_id"]),
            priority=int(row["priority"]), deadline_ns=int(row["deadline_ns"]),
            height=int(row["height"]), width=int(row["width"]),
            want_mask=bool(row["want_mask"]), enqueue_ns=int(row["enqueue_ns"]),
            part_class=int(row["part_class"]), claim_ns=int(row["claim_ns"]),
            attempt=int(row["attempt"]),
        )  # fmt: skip

    def _return_claim(self, i: int, now_ns: int, max_kills: int, report: ReclaimReport) -> None:
        """One claim of a dead worker (lock held); the state is written last."""
        d, h = self._seg.descs, Handle(i, int(self._gen[i]))
        d["kills"][i] = min(int(d["kills"][i]) + 1, 255)
        d["worker"][i] = NIL
        if d["abandoned"][i]:
            report.dropped.append(h)
            self._make_free(i)
        elif d["kills"][i] >= max_kills:
            d["done_ns"][i] = now_ns
            self._state[i] = _FAILED
            report.quarantined.append(h)
        elif self._deadline[i] <= now_ns:
            d["done_ns"][i] = now_ns
            self._state[i] = _EXPIRED
            report.expired.append(h)
        else:
            d["claim_ns"][i] = 0
            self._ready.push(i)
            self._wheel.insert(i)
            self._state[i] = _QUEUED
            report.requeued.append(h)

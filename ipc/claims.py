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

``wait_for_work`` first spins up to ``worker_spin_us`` (the header's; C, GIL released,
a pause and a ``sched_yield`` between looks so a process queued behind us on this CPU runs)
watching the ready counts. Only then does it announce itself: the waiting mask (header
``waiting``, bit per worker slot) is how ``submit`` knows whom to wake. The bit is set under
the lock only after seeing too little work under that same lock, and ``submit`` clears one
bit under the lock and rings that worker's eventfd; an eventfd stays readable until read,
so no wake-up is lost between the check and the ``poll``. A spinning worker has no bit set,
so ``submit`` rings nobody and it sees the work within a look.
"""

from __future__ import annotations

import os
from time import monotonic_ns as time_ns

import numpy as np

from scratchd.ipc._native import Contended
from scratchd.ipc.core import ACTIVE, CLAIMED, EXPIRED, FAILED, QUEUED, QueueCore
from scratchd.ipc.layout import NIL
from scratchd.ipc.records import (
    Claim,
    Handle,
    QueueError,
    ReclaimReport,
    Result,
    WorkerRow,
    WorkerSlotState,
    write_result,
)


class WorkerOps(QueueCore):
    """Worker and supervisor operations (see the module docstring)."""

    # ---------------------------------------------------------------- workers
    def register_worker(self, slot: int, pid: int) -> None:
        """Make ``slot`` ACTIVE for ``pid`` (idempotent for the same pid).

        Raises QueueError if another registration holds the slot: the supervisor must
        ``reclaim_worker`` a dead worker's slot before a replacement registers in it.
        """
        self._check_slot(slot)
        with self._mutex:
            row = self._seg.workers[slot]
            if row["state"] == ACTIVE:
                if int(row["pid"]) == pid:
                    return
                raise QueueError(f"worker slot {slot} is held by pid {int(row['pid'])}")
            now = time_ns()
            row["pid"], row["state"] = pid, ACTIVE
            row["registered_ns"] = row["heartbeat_ns"] = now
            row["batches"] = row["requests"] = 0
            row["vram_frag"] = np.nan
            self._waiting[0] = int(self._waiting[0]) & ~(1 << slot)

    def heartbeat(self, slot: int, now_ns: int) -> None:
        """Record that the worker in ``slot`` is alive (its own field: no lock)."""
        self._seg.workers["heartbeat_ns"][slot] = now_ns

    def report_device_memory(self, slot: int, fragmentation: float) -> None:
        """A GPU worker's arena fragmentation ratio (its own field: no lock; a float32
        write is atomic), read by the main process for the metrics."""
        self._seg.workers["vram_frag"][slot] = fragmentation

    def ready_count(self) -> int:
        """Queued requests right now (a lock-free snapshot; exact only under the lock)."""
        return int(self._native.ready_total())

    def wait_for_work(self, slot: int, timeout_s: float | None, min_ready: int = 1) -> bool:
        """Return True at once if ``min_ready`` requests are queued, else sleep on this
        worker's work doorbell until a submit rings it or ``timeout_s`` passes.

        True means "look again" (it reserves nothing). Safe against lost wake-ups: the
        waiting bit is set under the same lock hold that saw too little work.
        """
        if not self._work:
            raise QueueError("wait_for_work needs the work doorbell (attach with work_fd=)")
        spin_ns = self._spin_ns if timeout_s is None else min(self._spin_ns, int(timeout_s * 1e9))
        if self._native.spin_ready(min_ready, spin_ns):  # lock-free look, then bounded spin
            return True
        bit = 1 << slot
        with self._mutex:
            if self._native.ready_total() >= min_ready:
                return True
            self._waiting[0] = int(self._waiting[0]) | bit
        bell = self._work[0] if len(self._work) == 1 else self._work[slot]
        if bell.wait(timeout_s):
            return True
        with self._mutex:
            self._waiting[0] = int(self._waiting[0]) & ~bit
        return self._native.ready_total() >= min_ready

    def claim_batch(self, slot: int, max_n: int, now_ns: int) -> list[Claim]:
        """Take up to ``max_n`` requests in scheduling order; late ones become EXPIRED.

        Raises QueueError if this process is not the worker registered in ``slot`` (e.g. it
        was reclaimed): such a worker must exit, not claim.
        """
        pid = os.getpid()
        # [lock] per request: unlink, ownership, state = CLAIMED (or EXPIRED) [unlock]
        taken = self._native.claim(False, slot, pid, max_n, now_ns)
        if isinstance(taken, Contended):
            taken = self._contended(taken, self._native.claim, slot, pid, max_n, now_ns)
        if taken is None:
            raise QueueError(f"pid {pid} is not the worker registered in slot {slot}")
        rows, expired = taken
        if expired:
            self._ring_completion()
        claims = [Claim(Handle(row[0], row[1]), *row[2:]) for row in rows]
        if self._faulty:
            self._fault.reach("claim.returned")
        return claims

    def input_view(self, c: Claim) -> np.ndarray:
        """Read-only ``(height, width)`` uint8 view of the claim's input slot (zero-copy)."""
        n = c.height * c.width
        return self._inputs_ro[c.handle.index, :n].reshape(c.height, c.width)

    def input_region(self) -> np.ndarray:
        """All input payload slots, ``[slots, slot_bytes]`` uint8 over the mapping: what a
        GPU worker page-locks (``cudaHostRegister``) so uploads read the slots directly."""
        return self._seg.inputs

    def oldest_ready(self) -> tuple[int, int] | None:
        """``(enqueue_ns, deadline_ns)`` of the request a claim would get next, or None."""
        with self._mutex:
            i = self._native.best()
            if i == NIL:
                return None
            return int(self._d.enqueue_ns[i]), int(self._d.deadline_ns[i])

    def complete(self, slot: int, c: Claim, result: Result) -> bool:
        """Write ``result`` and flip the claim to DONE; False (nothing written) if stale.

        Raises ValueError (nothing written, still CLAIMED) for a malformed result.
        """
        h, pid = c.handle, os.getpid()  # a syscall: once per call, not per claim
        if not self._native.owns(h.index, h.generation, c.attempt, slot, pid):
            return False
        i = h.index
        write_result(
            self._seg.result_block, self._r, self._seg.masks, i, result, c.height, c.width,
            between=self._die_mid_result if self._faulty else None,
        )  # fmt: skip
        args = (i, h.generation, c.attempt, slot, pid, time_ns())
        # [lock] re-check ownership, push on the done stack, state = DONE [unlock]
        done = self._native.complete(False, *args)
        if isinstance(done, Contended):
            done = self._contended(done, self._native.complete, *args)
        if done:
            self._ring_completion()
        return done

    # ---------------------------------------------------------------- supervisor
    def reclaim_worker(self, slot: int, now_ns: int, max_kills: int = 3) -> ReclaimReport:
        """Return a DEAD worker's claims: requeue, expire (deadline passed) or quarantine
        (it has now died holding a request ``max_kills`` times); clear its worker row.

        Call only after the process is known to be gone (pidfd readable / waitpid).
        """
        self._check_slot(slot)
        with self._mutex:
            report = ReclaimReport(slot=slot, pid=int(self._w_pid[slot]))
            dn = self._seg.descs
            held = np.flatnonzero((dn["state"] == CLAIMED) & (dn["worker"] == slot))
            for i in held.tolist():
                self._return_claim(i, now_ns, max_kills, report)
            self._w_pid[slot], self._w_state[slot] = 0, WorkerSlotState.EMPTY.value
            self._waiting[0] = int(self._waiting[0]) & ~(1 << slot)
            h = self._seg.header
            h["requeued"] += len(report.requeued)
            h["expired"] += len(report.expired)
            h["quarantined"] += len(report.quarantined)
            wake = self._pick_waiting(len(report.requeued))
        self._ring_workers(wake)
        if report.expired or report.quarantined:
            self._ring_completion()
        return report

    def worker_rows(self) -> list[WorkerRow]:
        """Registered workers (not EMPTY rows), with what each holds right now."""
        w = self._seg.workers
        active = np.flatnonzero(w["state"] != WorkerSlotState.EMPTY.value).tolist()
        dn = self._seg.descs
        claimed = np.bincount(
            dn["worker"][dn["state"] == CLAIMED].astype(np.int64) + 1,
            minlength=self.geometry.max_workers + 1,
        )
        return [self._row_of(s, int(claimed[s + 1])) for s in active]

    # ---------------------------------------------------------------- internals
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.geometry.max_workers:
            raise QueueError(f"worker slot {slot} outside 0..{self.geometry.max_workers - 1}")

    def _row_of(self, s: int, claimed: int) -> WorkerRow:
        w = self._seg.workers[s]
        return WorkerRow(
            slot=s, pid=int(w["pid"]), state=WorkerSlotState(int(w["state"])),
            registered_ns=int(w["registered_ns"]), heartbeat_ns=int(w["heartbeat_ns"]),
            batches=int(w["batches"]), requests=int(w["requests"]), claimed=claimed,
            vram_frag=float(w["vram_frag"]),
        )  # fmt: skip

    def _die_mid_result(self) -> None:
        if self._faulty:
            self._fault.reach("complete.mid_result")

    def _return_claim(self, i: int, now_ns: int, max_kills: int, report: ReclaimReport) -> None:
        """One claim of a dead worker (lock held); the state is written last."""
        d, h = self._d, Handle(i, int(self._d.generation[i]))
        d.kills[i] = min(int(d.kills[i]) + 1, 255)
        d.worker[i] = NIL
        if d.abandoned[i]:
            report.dropped.append(h)
            self._make_free(i)
        elif d.kills[i] >= max_kills:
            self._native.finish(i, FAILED, now_ns)
            report.quarantined.append(h)
        elif d.deadline_ns[i] <= now_ns:
            self._native.finish(i, EXPIRED, now_ns)
            report.expired.append(h)
        else:
            self._native.link(i)
            d.state[i] = QUEUED
            report.requeued.append(h)

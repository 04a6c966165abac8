"""What the supervisor does to the queue: reclaim a dead worker's claims, read the worker rows,
and recover the lock from a holder that died or sits on it.

The supervisor runs in the main process. :func:`repair` is the one step here that any
process may run: the robust mutex calls it in whichever process locks next after a holder
died (``ipc/lock.py``). :func:`kill_stuck_holder` runs only in the main process (the creator),
the one process that must never block for good. The order of writes of a reclaim is in
``ipc/queue.py``'s docstring.
"""

from __future__ import annotations

import contextlib
import os
import signal

import numpy as np

from scratchd.ipc.core import CLAIMED, DONE, EXPIRED, FAILED, QUEUED, QueueCore
from scratchd.ipc.layout import NIL
from scratchd.ipc.records import Handle, ReclaimReport, WorkerRow, WorkerSlotState


class SupervisorSide:
    """Reclaim and worker rows, over one process's :class:`QueueCore`."""

    def __init__(self, core: QueueCore) -> None:
        self._core = core

    def reclaim_worker(self, slot: int, now_ns: int, max_kills: int = 3) -> ReclaimReport:
        """Return a DEAD worker's claims: requeue, expire (deadline passed) or quarantine
        (it has now died holding a request ``max_kills`` times); clear its worker row.

        Call only after the process is known to be gone (pidfd readable / waitpid).
        """
        core = self._core
        core.check_slot(slot)
        with core.mutex:
            report = ReclaimReport(slot=slot, pid=int(core.w_pid[slot]))
            dn = core.seg.descs
            held = np.flatnonzero((dn["state"] == CLAIMED) & (dn["worker"] == slot))
            for i in held.tolist():
                self._return_claim(i, now_ns, max_kills, report)
            core.w_pid[slot], core.w_state[slot] = 0, WorkerSlotState.EMPTY.value
            core.waiting[0] = int(core.waiting[0]) & ~(1 << slot)
            h = core.seg.header
            h["requeued"] += len(report.requeued)
            h["expired"] += len(report.expired)
            h["quarantined"] += len(report.quarantined)
            wake = core.pick_waiting(len(report.requeued))
        core.ring_workers(wake)
        if report.expired or report.quarantined:
            core.ring_completion()
        return report

    def worker_rows(self) -> list[WorkerRow]:
        """Registered workers (not EMPTY rows), with what each holds right now."""
        core = self._core
        w = core.seg.workers
        active = np.flatnonzero(w["state"] != WorkerSlotState.EMPTY.value).tolist()
        dn = core.seg.descs
        claimed = np.bincount(
            dn["worker"][dn["state"] == CLAIMED].astype(np.int64) + 1,
            minlength=core.geometry.max_workers + 1,
        )
        return [self._row_of(s, int(claimed[s + 1])) for s in active]

    def _row_of(self, s: int, claimed: int) -> WorkerRow:
        w = self._core.seg.workers[s]
        return WorkerRow(
            slot=s, pid=int(w["pid"]), state=WorkerSlotState(int(w["state"])),
            registered_ns=int(w["registered_ns"]), heartbeat_ns=int(w["heartbeat_ns"]),
            batches=int(w["batches"]), requests=int(w["requests"]), claimed=claimed,
            vram_frag=float(w["vram_frag"]),
        )  # fmt: skip

    def _return_claim(self, i: int, now_ns: int, max_kills: int, report: ReclaimReport) -> None:
        """One claim of a dead worker (lock held); the state is written last."""
        core = self._core
        d, h = core.d, Handle(i, int(core.d.generation[i]))
        d.kills[i] = min(int(d.kills[i]) + 1, 255)
        d.worker[i] = NIL
        if d.abandoned[i]:
            report.dropped.append(h)
            core.make_free(i)
        elif d.kills[i] >= max_kills:
            core.native.finish(i, FAILED, now_ns)
            report.quarantined.append(h)
        elif d.deadline_ns[i] <= now_ns:
            core.native.finish(i, EXPIRED, now_ns)
            report.expired.append(h)
        else:
            core.native.link(i)
            d.state[i] = QUEUED
            report.requeued.append(h)


# ---------------------------------------------------------------- the lock's recovery
def repair(core: QueueCore) -> None:
    """Rebuild the derived index from the descriptor table (a lock holder died; we hold
    the lock): ready lists and wheel from the QUEUED descriptors, the done stack from the
    finished ones. Runs in whichever process locks next."""
    dn = core.seg.descs
    state = dn["state"]
    queued = np.flatnonzero(state == QUEUED)
    # In (deadline, seq) order every ready-list push lands at the tail: O(1) each.
    order = queued[np.lexsort((dn["seq"][queued], dn["deadline_ns"][queued]))]
    core.native.rebuild(order.tolist())
    finished = np.flatnonzero(state >= DONE)
    core.done_head[0] = NIL
    # Oldest first, as they were pushed; finish() rewrites done_ns and state unchanged.
    for i in finished[np.argsort(dn["done_ns"][finished], kind="stable")].tolist():
        core.native.finish(i, int(state[i]), int(dn["done_ns"][i]))
    core.seg.header["repairs"] += 1


def kill_stuck_holder(core: QueueCore, tid: int) -> None:
    """The lock has been held for ``stuck_after_s``: SIGKILL the holder if it is one of our
    workers (stopped or wedged inside a microsecond critical section). The kill makes the
    pending lock return EOWNERDEAD; the supervisor then reaps and reclaims it."""
    pid = _process_of(tid)
    if pid and pid in core.w_pid.tolist():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            core.stuck_kills += 1


def _process_of(tid: int) -> int:
    """The process (thread group) a thread id belongs to; 0 if it is gone or unknown."""
    if tid <= 0:
        return 0
    try:
        with open(f"/proc/{tid}/status") as status:
            for line in status:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return 0
    return 0

"""What a worker process does to the queue: register, wait for work, claim, finish, heartbeat.

Used by the worker processes (``workers/``), each on its own mapping (``RequestQueue.attach``);
the order of writes of a claim and a complete is in ``ipc/queue.py``'s docstring. A worker's
life against the queue::

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

A warm standby attaches without a work doorbell and ``adopt_work_fd``-s its slot's when it
takes a dead worker's place, then registers.

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
from scratchd.ipc.core import ACTIVE, QueueCore
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.layout import NIL
from scratchd.ipc.records import Claim, Handle, QueueError, Result, write_result
from scratchd.ipc.region_maps import RegionMaps


class WorkerSide:
    """A worker's operations, over its own mapping's :class:`QueueCore`; ``regions`` are its
    mappings of the client regions claims name (``ipc/region_maps.py``)."""

    def __init__(self, core: QueueCore, regions: RegionMaps) -> None:
        self._core = core
        self.regions = regions

    def adopt_work_fd(self, work_fd: int) -> None:
        """Take a worker slot's work doorbell on a mapping attached without one: a warm
        standby maps the queue (and page-locks its inputs) at boot, before it is handed a
        slot; ``register_worker`` and ``wait_for_work`` follow."""
        if self._core.work:
            raise QueueError("this mapping has a work doorbell already")
        self._core.work = [Doorbell.from_fd(work_fd)]

    def register_worker(self, slot: int, pid: int) -> None:
        """Make ``slot`` ACTIVE for ``pid`` (idempotent for the same pid).

        Raises QueueError if another registration holds the slot: the supervisor must
        ``reclaim_worker`` a dead worker's slot before a replacement registers in it.
        """
        core = self._core
        core.check_slot(slot)
        with core.mutex:
            row = core.seg.workers[slot]
            if row["state"] == ACTIVE:
                if int(row["pid"]) == pid:
                    return
                raise QueueError(f"worker slot {slot} is held by pid {int(row['pid'])}")
            now = time_ns()
            row["pid"], row["state"] = pid, ACTIVE
            row["registered_ns"] = row["heartbeat_ns"] = now
            row["batches"] = row["requests"] = 0
            row["vram_frag"] = np.nan
            core.waiting[0] = int(core.waiting[0]) & ~(1 << slot)

    def heartbeat(self, slot: int, now_ns: int) -> None:
        """Record that the worker in ``slot`` is alive (its own field: no lock)."""
        self._core.seg.workers["heartbeat_ns"][slot] = now_ns

    def report_device_memory(self, slot: int, fragmentation: float) -> None:
        """A GPU worker's arena fragmentation ratio (its own field: no lock; a float32
        write is atomic), read by the main process for the metrics."""
        self._core.seg.workers["vram_frag"][slot] = fragmentation

    def ready_count(self) -> int:
        """Queued requests right now (a lock-free snapshot; exact only under the lock)."""
        return int(self._core.native.ready_total())

    def wait_for_work(self, slot: int, timeout_s: float | None, min_ready: int = 1) -> bool:
        """Return True at once if ``min_ready`` requests are queued, else sleep on this
        worker's work doorbell until a submit rings it or ``timeout_s`` passes.

        True means "look again" (it reserves nothing). Safe against lost wake-ups: the
        waiting bit is set under the same lock hold that saw too little work.
        """
        core = self._core
        if not core.work:
            raise QueueError("wait_for_work needs the work doorbell (attach with work_fd=)")
        spin_ns = core.spin_ns if timeout_s is None else min(core.spin_ns, int(timeout_s * 1e9))
        if core.native.spin_ready(min_ready, spin_ns):  # lock-free look, then bounded spin
            return True
        bit = 1 << slot
        with core.mutex:
            if core.native.ready_total() >= min_ready:
                return True
            core.waiting[0] = int(core.waiting[0]) | bit
        bell = core.work[0] if len(core.work) == 1 else core.work[slot]
        if bell.wait(timeout_s):
            return True
        with core.mutex:
            core.waiting[0] = int(core.waiting[0]) & ~bit
        return core.native.ready_total() >= min_ready

    def claim_batch(self, slot: int, max_n: int, now_ns: int, lead_ns: int = 0) -> list[Claim]:
        """Take up to ``max_n`` requests in scheduling order. One whose deadline is no later
        than ``now_ns + lead_ns`` is not started but becomes EXPIRED (answered TIMEOUT):
        ``lead_ns`` is the batch's expected compute, so a request that could only finish
        after its deadline costs no compute and takes no place in the batch.

        Raises QueueError if this process is not the worker registered in ``slot`` (e.g. it
        was reclaimed): such a worker must exit, not claim.
        """
        core = self._core
        pid = os.getpid()
        args = (slot, pid, max_n, now_ns, lead_ns)
        # [lock] per request: unlink, ownership, state = CLAIMED (or EXPIRED) [unlock]
        taken = core.native.claim(False, *args)
        if isinstance(taken, Contended):
            taken = core.contended(taken, core.native.claim, *args)
        if taken is None:
            raise QueueError(f"pid {pid} is not the worker registered in slot {slot}")
        rows, expired = taken
        if expired:
            core.ring_completion()
        claims = [Claim(Handle(row[0], row[1]), *row[2:]) for row in rows]
        if core.faulty:
            core.fault.reach("claim.returned")
        return claims

    def input_view(self, c: Claim) -> np.ndarray:
        """Read-only ``(height, width)`` uint8 view of the claim's pixels (zero-copy): its input
        slot, or the client region its descriptor names (``ipc/region_maps.py``; raises
        :class:`~scratchd.ipc.regions.RegionError` when that region cannot be read)."""
        i, d = c.handle.index, self._core.d
        region = d.region[i]
        if region:
            offset = d.region_offset[i]
            return self.regions.image(region - 1, d.region_gen[i], offset, c.height, c.width)
        n = c.height * c.width
        return self._core.inputs_ro[i, :n].reshape(c.height, c.width)

    def input_region(self) -> np.ndarray:
        """All input payload slots, ``[slots, slot_bytes]`` uint8 over the mapping: what a
        GPU worker page-locks (``cudaHostRegister``) so uploads read the slots directly."""
        return self._core.seg.inputs

    def oldest_ready(self) -> tuple[int, int] | None:
        """``(enqueue_ns, deadline_ns)`` of the request a claim would get next, or None."""
        core = self._core
        with core.mutex:
            i = core.native.best()
            if i == NIL:
                return None
            return int(core.d.enqueue_ns[i]), int(core.d.deadline_ns[i])

    def complete(self, slot: int, c: Claim, result: Result) -> bool:
        """Write ``result`` and flip the claim to DONE; False (nothing written) if stale.

        Raises ValueError (nothing written, still CLAIMED) for a malformed result.
        """
        core = self._core
        h, pid = c.handle, os.getpid()  # a syscall: once per call, not per claim
        if not core.native.owns(h.index, h.generation, c.attempt, slot, pid):
            return False
        i = h.index
        seg = core.seg
        write_result(
            seg.result_block, core.r, seg.masks, i, result, c.height, c.width,
            between=self._die_mid_result if core.faulty else None,
        )  # fmt: skip
        args = (i, h.generation, c.attempt, slot, pid, time_ns())
        # [lock] re-check ownership, push on the done stack, state = DONE [unlock]
        done = core.native.complete(False, *args)
        if isinstance(done, Contended):
            done = core.contended(done, core.native.complete, *args)
        if done:
            core.ring_completion()
        return done

    def _die_mid_result(self) -> None:
        if self._core.faulty:
            self._core.fault.reach("complete.mid_result")

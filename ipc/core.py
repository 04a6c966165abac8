"""The queue's shared state and the small steps every operation is built from.

:class:`QueueCore` holds the views onto the segment (``ipc/shm.py``), the robust mutex, the
ready lists, the timing wheel and the doorbells; ``ipc/claims.py`` (workers, supervisor) and
``ipc/queue.py`` (lifecycle, acceptor) add the operations. The write orders that make each
step safe against a SIGKILL are in ``ipc/queue.py``'s docstring.

The four round-trip sections (submit, claim, complete, collect) are C
(``_native.Core``, built from ``layout.native_offsets``), taking the lock themselves;
:meth:`QueueCore._contended` is their slow path when the lock is busy or its holder died.
Everything else is Python over the same bytes, using the C index steps below.

The Python sections (reserve, the handle checks, expiry, reclaim, abandon) read and write
single descriptor fields through per-field column views (``self._d.state`` etc.) and
compare with plain ``int`` state codes: numpy compares a scalar with an ``IntEnum`` member
~50× slower than with an int.

The index over the descriptor table, derived from it (repair rebuilds it from the states)
and implemented once, in C (``_native.Core``: the hot sections use it directly, the Python
sections here and in ``claims.py``/``queue.py`` call ``link``, ``unlink``, ``expire``,
``best``, ``earliest_deadline``, ``finish`` (done stack) and ``rebuild`` with the mutex
held)::

    ready head[8], tail[8], count[8]  int32  per priority; NIL (-1) when empty
    desc rnext, rprev                 int32  ready-list links through the descriptors
    wheel head[wheel_ticks]           int32  first descriptor of each bucket, NIL if empty
    desc wnext, wprev, wbucket        int32  bucket links, and the bucket (O(1) unlink)
    header wheel_cursor               int64  every tick < cursor has been fully expired

Ready lists: one doubly linked list per priority (0..7, 7 most urgent), kept sorted by
``(deadline_ns, seq)``: earliest deadline first, then FIFO by the enqueue sequence. A claim
takes the head of the highest non-empty priority. Insertion walks back from the tail while
the tail's deadline is later; requests of one part class carry the same deadline offset, so
they arrive in deadline order and insertion is O(1) in the common case. A requeued claim
keeps its ``seq`` and so goes back to exactly where it was.

Timing wheel: a deadline falls in tick ``t = (deadline - clock_base_ns) // tick_ns`` and is
linked into bucket ``max(t, cursor) % wheel_ticks`` (a deadline already behind the cursor
goes to the cursor's bucket, which the next expiry visits first). Deadlines more than one
revolution ahead share a bucket with nearer ones ("rounds"): expiry compares each visited
entry's exact deadline with ``now``, so nothing expires early whatever its round, and an
entry whose deadline is ``≤ now`` is always found, because its bucket lies between the
cursor and ``now``'s tick, all of which are visited (every bucket, after a gap longer than
a revolution). Expiry costs O(1) per due entry plus the buckets passed.

The done stack: finished descriptors (DONE, EXPIRED, FAILED) are pushed, under the lock,
onto a singly linked stack (header ``done_head``, linked through ``rnext``, which a finished
descriptor no longer needs for the ready lists), so ``collect_completed`` pops exactly the
finished ones without scanning the table. It is part of the derived index: ``_repair``
rebuilds it from the descriptor states.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from scratchd.ipc._native import OWNER_DIED, Contended, Core
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.faults import FaultPoint
from scratchd.ipc.layout import MUTEX_OFFSET, NIL, native_offsets
from scratchd.ipc.lock import RobustMutex
from scratchd.ipc.records import DescState, Handle, StaleHandle
from scratchd.ipc.shm import Segment

FREE, WRITTEN, QUEUED, CLAIMED = 0, 1, 2, 3
DONE, EXPIRED, FAILED = 4, 5, 6
assert [s.value for s in DescState] == [FREE, WRITTEN, QUEUED, CLAIMED, DONE, EXPIRED, FAILED]
ACTIVE = 1  # WorkerSlotState.ACTIVE
R = TypeVar("R")
DEFAULT_WORKER_SPIN_US = 50  # [queue] worker_spin_us


class QueueCore:
    """Views and shared steps; not used directly (see RequestQueue)."""

    def __init__(self, seg: Segment, completion: Doorbell | None, work: list[Doorbell]) -> None:
        self._seg = seg
        self.geometry = seg.geometry
        self._fault = FaultPoint.from_env()
        self._faulty = self._fault.name is not None  # one bool test per hook when unarmed
        self._completion = completion
        self._work = work  # creator: one per slot; a worker: [its own] or []
        # Only the main process watches for a wedged holder: it is the one that must never
        # block for good (its event loop serves every client), and it may kill workers.
        self._mutex = RobustMutex(
            seg.mm, MUTEX_OFFSET, repair=self._repair,
            on_stuck=self._kill_stuck_holder if seg.owner else None,
        )  # fmt: skip
        self.stuck_kills = 0  # workers this process killed for sitting on the lock
        # The hot critical sections (submit, claim, complete, collect), the index (ready
        # lists, wheel) that every section uses, and the spins.
        fault = self._fault.reach if self._faulty else None
        self._native = Core(seg.mm, native_offsets(seg.header), fault)
        self._spin_ns = int(seg.header["worker_spin_ns"])
        self._inputs_ro = seg.inputs.view()  # what workers get: views of it are read-only
        self._inputs_ro.flags.writeable = False
        self._d = seg.d  # fast scalar views; seg.descs for vector work
        self._r = seg.r
        self._waiting = seg.header_cell("waiting")
        self._done_head = seg.header_cell("done_head")
        self._w_pid = seg.workers["pid"].data
        self._w_state = seg.workers["state"].data
        self._free_list: deque[int] = deque()  # creator only: FREE descriptors

    def _initialize(self, worker_spin_us: int) -> None:
        """Creator only, before anyone attaches: links empty, mutex initialised."""
        if worker_spin_us < 0:
            raise ValueError(f"worker_spin_us={worker_spin_us} is negative")
        self._mutex.initialize()
        self._spin_ns = self._seg.header["worker_spin_ns"] = worker_spin_us * 1000
        self._seg.header["completion_armed"] = 1
        self._seg.header["main_cpu"] = self._seg.header["worker_cpu"] = -1
        for link in ("rnext", "rprev", "wnext", "wprev"):
            self._seg.descs[link] = NIL
        self._seg.descs["wbucket"] = NIL
        self._seg.descs["worker"] = NIL
        for index in (self._seg.ready_head, self._seg.ready_tail, self._seg.wheel_head):
            index[:] = NIL
        self._done_head[0] = NIL
        self._free_list.extend(range(self.geometry.slots))

    # ---------------------------------------------------------------- shared steps
    def _expect(self, h: Handle, state: int) -> None:
        i = h.index
        if not 0 <= i < self.geometry.slots:
            raise StaleHandle(f"descriptor {i} out of range")
        if self._d.generation[i] != h.generation or self._d.state[i] != state:
            raise StaleHandle(
                f"descriptor {i} generation {h.generation} is not {DescState(state).name} "
                f"(now generation {int(self._d.generation[i])}, "
                f"{DescState(int(self._d.state[i])).name})"
            )

    def _make_free(self, i: int) -> None:
        """Any state → FREE (main process only). Generation first: from here on every old
        handle of this descriptor is stale."""
        d = self._d
        d.generation[i] = (int(d.generation[i]) + 1) & 0xFFFFFFFF
        d.worker[i] = NIL
        d.state[i] = FREE
        if self._seg.owner:
            self._free_list.append(i)

    def _contended(self, how: Contended, op: Callable[..., R | Contended], *args: Any) -> R:
        """The slow path of a native operation whose own trylock did not simply succeed:
        after a dead holder (OWNER_DIED, the lock is ours) repair first; otherwise wait for
        the lock like any other section (watching for a stuck holder, repairing if its
        holder dies). Then run the operation with the lock held."""
        if how is OWNER_DIED:
            self._mutex.recover()  # raises with the lock released if the repair fails
            try:
                done = op(True, *args)
            finally:
                self._mutex.release()
        else:
            with self._mutex:
                done = op(True, *args)
        assert not isinstance(done, Contended)  # held=True never tries the lock
        return done

    def _pick_waiting(self, n: int) -> list[int]:
        """Take up to ``n`` waiting worker slots off the waiting mask (lock held)."""
        mask, picked = self._waiting[0], list[int]()
        if not mask:
            return picked
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

    def _ring_completion(self) -> None:
        """Ring the main process, unless it is spinning on the done stack (it sees it)."""
        if self._completion is not None and self._native.completion_armed():
            self._completion.ring()

    def _repair(self) -> None:
        """Rebuild the derived index from the descriptor table (a lock holder died; we hold
        the lock): ready lists and wheel from the QUEUED descriptors, the done stack from the
        finished ones. Runs in whichever process locks next."""
        dn = self._seg.descs
        state = dn["state"]
        queued = np.flatnonzero(state == QUEUED)
        # In (deadline, seq) order every ready-list push lands at the tail: O(1) each.
        order = queued[np.lexsort((dn["seq"][queued], dn["deadline_ns"][queued]))]
        self._native.rebuild(order.tolist())
        finished = np.flatnonzero(state >= DONE)
        self._done_head[0] = NIL
        # Oldest first, as they were pushed; finish() rewrites done_ns and state unchanged.
        for i in finished[np.argsort(dn["done_ns"][finished], kind="stable")].tolist():
            self._native.finish(i, int(state[i]), int(dn["done_ns"][i]))
        self._seg.header["repairs"] += 1

    def _kill_stuck_holder(self, tid: int) -> None:
        """The lock has been held for ``stuck_after_s``: SIGKILL the holder if it is one of
        our workers (stopped or wedged inside a microsecond critical section). The kill makes
        the pending lock return EOWNERDEAD; the supervisor then reaps and reclaims it."""
        pid = _process_of(tid)
        if pid and pid in self._w_pid.tolist():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                self.stuck_kills += 1


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

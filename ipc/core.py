"""The queue's shared state and the small steps every operation is built from.

Used by every process that maps the queue. :class:`QueueCore` holds the views onto the
segment (``ipc/shm.py``), the robust mutex, the ready lists, the timing wheel and the
doorbells; the operations are grouped by the process that calls them, each group holding
this core: ``ipc/main_side.py`` (main process), ``ipc/worker_side.py`` (workers),
``ipc/supervisor_side.py`` (the supervisor, and the lock's repair, which any locker runs),
composed by ``ipc/queue.py`` into :class:`~scratchd.ipc.queue.RequestQueue`. The write orders
that make each step safe against a SIGKILL are in ``ipc/queue.py``'s docstring.

The four round-trip sections (submit, claim, complete, collect) are C
(``_native.Core``, built from ``layout.native_offsets``), taking the lock themselves;
:meth:`QueueCore.contended` is their slow path when the lock is busy or its holder died.
Everything else is Python over the same bytes, using the C index steps below.

The Python sections (reserve, the handle checks, expiry, reclaim, abandon) read and write
single descriptor fields through per-field column views (``core.d.state`` etc.) and
compare with plain ``int`` state codes: numpy compares a scalar with an ``IntEnum`` member
~50× slower than with an int.

The index over the descriptor table, derived from it (repair rebuilds it from the states)
and implemented once, in C (``_native.Core``: the hot sections use it directly, the Python
sections of the role modules call ``link``, ``unlink``, ``expire``,
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
finished ones without scanning the table. It is part of the derived index: the repair
(``ipc/supervisor_side.py``) rebuilds it from the descriptor states.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from scratchd.ipc._native import OWNER_DIED, Contended, Core
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.faults import FaultPoint
from scratchd.ipc.layout import MUTEX_OFFSET, NIL, native_offsets
from scratchd.ipc.lock import RobustMutex
from scratchd.ipc.records import DescState, Handle, QueueError, StaleHandle
from scratchd.ipc.shm import Segment

FREE, WRITTEN, QUEUED, CLAIMED = 0, 1, 2, 3
DONE, EXPIRED, FAILED = 4, 5, 6
assert [s.value for s in DescState] == [FREE, WRITTEN, QUEUED, CLAIMED, DONE, EXPIRED, FAILED]
ACTIVE = 1  # WorkerSlotState.ACTIVE
R = TypeVar("R")
DEFAULT_WORKER_SPIN_US = 50  # [queue] worker_spin_us


class QueueCore:
    """One process's mapping of the queue: views, mutex, doorbells and the shared steps.

    Its fields are read and written by the role objects (``MainSide``, ``WorkerSide``,
    ``SupervisorSide``) that hold it; nothing outside ``ipc/`` sees it. ``repair`` and
    ``on_stuck`` are the lock's recovery (``ipc/supervisor_side.py``), called with this core.
    """

    def __init__(
        self,
        seg: Segment,
        completion: Doorbell | None,
        work: list[Doorbell],
        *,
        repair: Callable[[QueueCore], None],
        on_stuck: Callable[[QueueCore, int], None],
    ) -> None:
        self.seg = seg
        self.geometry = seg.geometry
        self.fault = FaultPoint.from_env()
        self.faulty = self.fault.name is not None  # one bool test per hook when unarmed
        self.completion = completion
        self.work = work  # creator: one per slot; a worker: [its own] or []
        self.repair = functools.partial(repair, self)
        """Rebuild the derived index (a lock holder died; the lock is held)."""
        # Only the main process watches for a wedged holder: it is the one that must never
        # block for good (its event loop serves every client), and it may kill workers.
        self.mutex = RobustMutex(
            seg.mm, MUTEX_OFFSET, repair=self.repair,
            on_stuck=functools.partial(on_stuck, self) if seg.owner else None,
        )  # fmt: skip
        self.stuck_kills = 0  # workers this process killed for sitting on the lock
        self.on_close: list[Callable[[], None]] = []  # parts that drop their views of seg
        # The hot critical sections (submit, claim, complete, collect), the index (ready
        # lists, wheel) that every section uses, and the spins.
        fault = self.fault.reach if self.faulty else None
        self.native = Core(seg.mm, native_offsets(seg.header), fault, Handle)
        self.spin_ns = int(seg.header["worker_spin_ns"])
        self.inputs_ro = seg.inputs.view()  # what workers get: views of it are read-only
        self.inputs_ro.flags.writeable = False
        self.d = seg.d  # fast scalar views; seg.descs for vector work
        self.r = seg.r
        self.waiting = seg.header_cell("waiting")
        self.done_head = seg.header_cell("done_head")
        self.w_pid = seg.workers["pid"].data
        self.w_state = seg.workers["state"].data

    def initialize(self, worker_spin_us: int) -> None:
        """Creator only, before anyone attaches: links empty, mutex initialised."""
        if worker_spin_us < 0:
            raise ValueError(f"worker_spin_us={worker_spin_us} is negative")
        self.mutex.initialize()
        self.spin_ns = self.seg.header["worker_spin_ns"] = worker_spin_us * 1000
        self.seg.header["completion_armed"] = 1
        self.seg.header["main_cpu"] = self.seg.header["worker_cpu"] = -1
        for link in ("rnext", "rprev", "wnext", "wprev"):
            self.seg.descs[link] = NIL
        self.seg.descs["wbucket"] = NIL
        self.seg.descs["worker"] = NIL
        for index in (self.seg.ready_head, self.seg.ready_tail, self.seg.wheel_head):
            index[:] = NIL
        self.done_head[0] = NIL

    def close(self) -> None:
        """Unmap and close the doorbells; the creator also unlinks the name. Raises
        RuntimeError, closing nothing, while another thread is inside a wait's spin."""
        self.native.close()
        if self.seg.owner:
            self.seg.unlink()
        for bell in [*self.work, *([self.completion] if self.completion else [])]:
            bell.close()
        self.mutex.close()
        for drop_views in self.on_close:
            drop_views()
        for attr in ("d", "r", "waiting", "done_head", "inputs_ro", "w_pid", "w_state"):
            setattr(self, attr, None)
        self.seg.close()

    # ---------------------------------------------------------------- shared steps
    def expect(self, h: Handle, state: int) -> None:
        """Raise StaleHandle unless ``h`` names its descriptor's generation in ``state``."""
        i = h.index
        if not 0 <= i < self.geometry.slots:
            raise StaleHandle(f"descriptor {i} out of range")
        if self.d.generation[i] != h.generation or self.d.state[i] != state:
            raise StaleHandle(
                f"descriptor {i} generation {h.generation} is not {DescState(state).name} "
                f"(now generation {int(self.d.generation[i])}, "
                f"{DescState(int(self.d.state[i])).name})"
            )

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.geometry.max_workers:
            raise QueueError(f"worker slot {slot} outside 0..{self.geometry.max_workers - 1}")

    def make_free(self, i: int) -> None:
        """Any state → FREE (main process only). Generation first: from here on every old
        handle of this descriptor is stale."""
        d = self.d
        d.generation[i] = (int(d.generation[i]) + 1) & 0xFFFFFFFF
        d.worker[i] = NIL
        d.state[i] = FREE
        if self.seg.owner:
            self.native.push_free(i)

    def contended(self, how: Contended, op: Callable[..., R | Contended], *args: Any) -> R:
        """The slow path of a native operation whose own trylock did not simply succeed:
        after a dead holder (OWNER_DIED, the lock is ours) repair first; otherwise wait for
        the lock like any other section (watching for a stuck holder, repairing if its
        holder dies). Then run the operation with the lock held."""
        if how is OWNER_DIED:
            self.mutex.recover()  # raises with the lock released if the repair fails
            try:
                done = op(True, *args)
            finally:
                self.mutex.release()
        else:
            with self.mutex:
                done = op(True, *args)
        assert not isinstance(done, Contended)  # held=True never tries the lock
        return done

    def pick_waiting(self, n: int) -> list[int]:
        """Take up to ``n`` waiting worker slots off the waiting mask (lock held)."""
        mask, picked = self.waiting[0], list[int]()
        if not mask:
            return picked
        while mask and len(picked) < n:
            low = mask & -mask
            picked.append(low.bit_length() - 1)
            mask ^= low
        self.waiting[0] = mask
        return picked

    def ring_workers(self, slots: list[int]) -> None:
        if len(self.work) == self.geometry.max_workers:
            for w in slots:
                self.work[w].ring()

    def ring_completion(self) -> None:
        """Ring the main process, unless it will look at the done stack anyway (armed = 0)."""
        if self.completion is not None and self.native.completion_armed():
            self.completion.ring()

"""The request queue in shared memory: descriptors, scheduling, expiry, crash recovery.

:class:`RequestQueue` is one process's handle on the queue: it creates or maps the segment
(here) and offers the operations of every role, each group in the module of the process
that calls it, all over one shared :class:`~scratchd.ipc.core.QueueCore` (layout in
``ipc/shm.py``, value types in ``ipc/records.py``):

- ``ipc/core.py``, every process: the views onto the segment, the mutex, the index (ready
  lists, timing wheel, done stack), the doorbells and the small steps all operations use;
- ``ipc/main_side.py``, the **main process** (``create``; acceptor and dispatcher):
  ``reserve``/``payload``/``submit``/``release``, ``shed``, ``collect_completed``,
  ``wait_for_completions``, ``expire_due``, ``abandon_connection``, and the queue's views.
  It is the only process that moves descriptors to or from FREE, so its free list lives in
  its own memory;
- ``ipc/worker_side.py``, the **workers** (``attach``): ``register_worker``,
  ``wait_for_work``, ``claim_batch``, ``input_view``, ``complete``, ``heartbeat``,
  ``adopt_work_fd`` (a standby taking a slot);
- ``ipc/supervisor_side.py``, the **supervisor** (in the main process):
  ``reclaim_worker``, ``worker_rows``, and the lock's recovery (``repair``, run by whichever
  process locks next after a holder died; killing a holder stuck on the lock).

The operations are the role objects' own bound methods, set on the instance when it is
built: calling ``q.submit`` or ``q.claim_batch`` costs no wrapper call.

The main process against the queue (the worker side is sketched in ``ipc/worker_side.py``)::

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
leaves a state that ``repair`` (run by the next locker on ``EOWNERDEAD``) turns back into a
consistent one. The descriptor table is the truth; the index is derived: repair re-links
exactly the QUEUED descriptors into fresh ready lists and wheel buckets and the finished
ones (DONE / EXPIRED / FAILED) into a fresh done stack (``ipc/core.py``).

- submit:   request fields (unlocked, the acceptor owns WRITTEN) → [lock] attempt = 0,
            claim_ns = 0, seq → ready list → wheel → state = QUEUED → take one waiting
            worker's bit [unlock] → ring that worker (none waiting: no ring).
- claim:    [lock] unlink from ready list and wheel → worker, pid, claim_ns, attempt →
            state = CLAIMED [unlock]. Killed before the state write: still QUEUED, repair
            re-links it. Killed after: CLAIMED by a dead pid, ``reclaim_worker`` requeues it.
            A claim that meets a deadline passed, or nearer than the batch's expected
            compute (``lead_ns``), pushes the descriptor on the done stack and marks it
            EXPIRED instead (never computed).
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
Python takes the slow path (``QueueCore.contended``): BUSY → wait as every other section
does (the main process watching for a stuck holder), OWNER_DIED → ``repair`` and mark
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
never spins; it uses the same handshake without the spin: ``quiet_completions`` (armed = 0)
while it is awake and has scheduled one look before it can next sleep, and that look is
``rearm_completions`` (armed = 1, fence, done_head != NIL?), so completions made while it is
busy anyway cost no ring and no wake-up (``daemon/frontend/dispatch.py``).

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

from scratchd.ipc.core import DEFAULT_WORKER_SPIN_US, QueueCore
from scratchd.ipc.doorbell import Doorbell
from scratchd.ipc.layout import Geometry
from scratchd.ipc.main_side import MainSide
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
)
from scratchd.ipc.region_maps import RegionMaps
from scratchd.ipc.region_table import RegionTable, workers_can_open
from scratchd.ipc.shm import Segment
from scratchd.ipc.supervisor_side import SupervisorSide, kill_stuck_holder, repair
from scratchd.ipc.worker_side import WorkerSide

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


class RequestQueue:
    """The shared-memory request queue; see the module docstring for roles and ordering."""

    def __init__(self, seg: Segment, completion: Doorbell | None, work: list[Doorbell]) -> None:
        core = QueueCore(seg, completion, work, repair=repair, on_stuck=kill_stuck_holder)
        self._core = core
        self.geometry = core.geometry
        owner_pid = int(seg.header["owner_pid"])
        self.regions = RegionTable(seg.regions, seg.owner and workers_can_open())
        self.region_maps = RegionMaps(seg.regions, owner_pid)
        main, supervisor = MainSide(core, self.regions), SupervisorSide(core)
        worker = WorkerSide(core, self.region_maps)
        core.on_close += [self.region_maps.close, self.regions.close]
        # main process (ipc/main_side.py)
        self.reserve = main.reserve
        self.payload = main.payload
        self.submit = main.submit
        self.release = main.release
        self.shed = main.shed
        self.abandon_connection = main.abandon_connection
        self.collect_completed = main.collect_completed
        self.wait_for_completions = main.wait_for_completions
        self.quiet_completions = main.quiet_completions
        self.rearm_completions = main.rearm_completions
        self.expire_due = main.expire_due
        self.next_deadline_ns = main.next_deadline_ns
        self.depth_by_priority = main.depth_by_priority
        self.counters = main.counters
        self.free_count = main.free_count
        self.load_ahead = main.load_ahead
        self.counts_by_state = main.counts_by_state
        # workers (ipc/worker_side.py)
        self.adopt_work_fd = worker.adopt_work_fd
        self.register_worker = worker.register_worker
        self.heartbeat = worker.heartbeat
        self.report_device_memory = worker.report_device_memory
        self.ready_count = worker.ready_count
        self.wait_for_work = worker.wait_for_work
        self.claim_batch = worker.claim_batch
        self.input_view = worker.input_view
        self.input_region = worker.input_region
        self.oldest_ready = worker.oldest_ready
        self.complete = worker.complete
        # supervisor (ipc/supervisor_side.py)
        self.reclaim_worker = supervisor.reclaim_worker
        self.worker_rows = supervisor.worker_rows

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls, name: str, geometry: Geometry, *, worker_spin_us: int = DEFAULT_WORKER_SPIN_US
    ) -> RequestQueue:
        """Create the segment (main process); replaces a stale one, refuses a live owner's.

        ``worker_spin_us``: how long a worker that finds no work spins before it sleeps on
        its eventfd (stored in the header, so every worker uses the same; 0: never spin)."""
        return cls._around(Segment.create(name, geometry), geometry, worker_spin_us)

    @classmethod
    def create_unique(
        cls, prefix: str, geometry: Geometry, *, worker_spin_us: int = DEFAULT_WORKER_SPIN_US
    ) -> RequestQueue:
        """``create`` under a name nobody can predict: ``prefix`` and random digits, created
        with ``O_EXCL`` after this user's dead segments under ``prefix`` are removed
        (``ipc/shm.py``); ``name`` is the one drawn."""
        return cls._around(Segment.create_unique(prefix, geometry), geometry, worker_spin_us)

    @classmethod
    def _around(cls, seg: Segment, geometry: Geometry, worker_spin_us: int) -> RequestQueue:
        work = [Doorbell.create() for _ in range(geometry.max_workers)]
        q = cls(seg, Doorbell.create(), work)
        q._core.initialize(worker_spin_us)
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
        return self._core.seg.name

    @property
    def completion_fd(self) -> int:
        """The eventfd the main loop watches (``loop.add_reader``) for finished requests."""
        if self._core.completion is None:
            raise QueueError("this queue was attached without a completion doorbell")
        return self._core.completion.fileno()

    def work_fd(self, slot: int) -> int:
        """Worker slot ``slot``'s work eventfd (creator only), to pass to that worker."""
        work = self._core.work
        if len(work) != self.geometry.max_workers:
            raise QueueError("work doorbells are held by the creating process only")
        return work[slot].fileno()

    @property
    def stuck_kills(self) -> int:
        """Workers this process killed for sitting on the lock (``ipc/lock.py``)."""
        return self._core.stuck_kills

    def close(self) -> None:
        """Unmap. The creator also unlinks the segment and closes the doorbells it made.

        Raises RuntimeError, closing nothing, while another thread of this process is inside
        a wait's spin (it reads the mapping without the GIL)."""
        self._core.close()

    def unlink(self) -> None:
        """Remove the segment's name now (mappings stay valid until closed)."""
        self._core.seg.unlink()

"""What the main process does to the queue: take in requests and hand back their answers.

Used by the daemon's main process only (the creator, ``RequestQueue.create``): the acceptor
reserves a descriptor, writes the image into its input slot and submits it; the dispatcher
collects finished requests, expires due ones and frees both; a client's disconnect abandons
its requests; a full queue sheds its newest lowest-priority request for a more urgent one.
The main process is the only one that moves descriptors to or from FREE, so its free list
lives in its own memory (``_native.Core``'s, which ``reserve`` takes from and ``collect`` and
``QueueCore.make_free`` add to). The order of writes of submit, collect
and expiry is in ``ipc/queue.py``'s docstring, and so is the handshake that lets
``wait_for_completions`` spin without missing a completion.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from scratchd.ipc._native import Contended
from scratchd.ipc._results import Reader
from scratchd.ipc.core import DONE, EXPIRED, QUEUED, WRITTEN, QueueCore
from scratchd.ipc.layout import PRIORITIES, result_offsets
from scratchd.ipc.records import (
    Completion,
    DescState,
    Handle,
    QueueError,
    Result,
    Status,
    read_result,
)
from scratchd.ipc.region_table import RegionTable

if TYPE_CHECKING:  # a type the stub names (ipc/_native.pyi), not a runtime attribute
    from scratchd.ipc._native import FinishedRow

_TIMEOUT_REASON = "deadline passed while queued"
_INDEX = operator.itemgetter(0)  # a FinishedRow's descriptor index


class MainSide:
    """The main process's operations, over its :class:`QueueCore`; ``regions`` is the region
    table's main-process side (whose pins follow the descriptors freed here)."""

    def __init__(self, core: QueueCore, regions: RegionTable) -> None:
        self._core = core
        self._regions = regions
        # Admission asks these per request, so they are the C calls themselves:
        # free_count(): FREE descriptors now (a lock-free snapshot, counts_by_state's FREE
        # entry alone); load_ahead(priority): (queued at priority >= priority, queued in all,
        # ACTIVE workers), what a new request's deadline is weighed against (lock-free
        # snapshots, one look each).
        self.free_count: Callable[[], int] = core.native.free_count
        self.load_ahead: Callable[[int], tuple[int, int, int]] = core.native.load_ahead
        # reserve(keep=0): a FREE descriptor, now WRITTEN and the caller's (a Handle); None
        # when no more than ``keep`` are FREE, or none is (overloaded). C: the free list
        # (FREE descriptors, oldest freed first) lives in this process's memory, checked
        # on use and refilled by a scan when empty (ipc/_native.c).
        self.reserve = cast(Callable[..., Handle | None], core.native.reserve)
        # An event loop that never spins, awake: quiet_completions() (workers skip the
        # completion doorbell) until rearm_completions() right before it may sleep, which
        # looks once more: True if finished requests wait (collect them, without a drain).
        self.quiet_completions: Callable[[], None] = core.native.quiet
        self.rearm_completions: Callable[[], bool] = core.native.rearm
        # A collected batch's Completions, built in C from its FinishedRows and the result
        # rows (ipc/_results.c; _completion_of is the definition it follows).
        self._reader_kit = (Completion, Result, Handle, tuple(Status), Status.TIMEOUT,
                            Status.ERROR, _TIMEOUT_REASON)  # fmt: skip
        self._reader = Reader(result_offsets(core.seg.header), self._reader_kit)

    # ---------------------------------------------------------------- requests in
    def payload(self, h: Handle) -> memoryview:
        """The writable input slot (``slot_bytes``) of a WRITTEN descriptor."""
        core = self._core
        core.expect(h, WRITTEN)
        return core.seg.inputs[h.index].data

    def submit(
        self, h: Handle, *, request_id: int, conn_id: int, priority: int, part_class: int,
        deadline_ns: int, height: int, width: int, want_mask: bool,
        region: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
        """Publish a WRITTEN descriptor whose input slot holds ``height × width`` pixels, or,
        with ``region`` = ``(row, generation, offset)``, whose pixels lie at ``offset`` of that
        published region (``ipc/region_table.py``; pinned until the descriptor is freed)."""
        core = self._core
        if not 0 <= priority < PRIORITIES:
            raise ValueError(f"priority {priority} outside 0..{PRIORITIES - 1}")
        if height <= 0 or width <= 0 or height * width > core.geometry.slot_bytes:
            raise ValueError(
                f"image {height}x{width} does not fit a {core.geometry.slot_bytes} B slot"
            )
        row, generation, offset = (-1, 0, 0) if region is None else region
        # In C, one call: the handle and every field checked before a byte is written (a
        # stale handle: None; a field out of range: ValueError, the descriptor stays
        # WRITTEN), the request block written (enqueue_ns = now), then [lock] attempt, seq,
        # ready list, wheel, state = QUEUED, take a waiting worker [unlock].
        wake = core.native.submit_request(
            h.index, h.generation, request_id, conn_id, deadline_ns, part_class, height, width,
            priority, want_mask, row + 1, generation, offset,
        )  # fmt: skip
        if wake is None:
            core.expect(h, WRITTEN)  # raises StaleHandle, saying what the descriptor is now
            raise AssertionError("submit_request refused a WRITTEN descriptor")
        if isinstance(wake, Contended):  # the block is written; submit on the slow path
            wake = core.contended(wake, core.native.submit, h.index)
        if region is not None:
            self._regions.pin(h.index, row)
        if wake >= 0:
            core.ring_workers([wake])

    def release(self, h: Handle) -> None:
        """Give back a WRITTEN descriptor that will not be submitted."""
        self._core.expect(h, WRITTEN)
        self._core.make_free(h.index)

    def shed(self, below_priority: int, reason: str) -> Completion | None:
        """Make room for a request of ``below_priority``: the newest queued (not claimed)
        request of the lowest priority under it is taken out of the queue and freed; its
        Completion (OVERLOADED, ``reason``) is the caller's to answer. None when every queued
        request has at least that priority: a request is never shed for one of its own
        priority or lower.

        Under the lock, and only a QUEUED descriptor: a claimed one is a worker's, and a
        worker killed at any point of a claim leaves its descriptor either QUEUED (the
        repair that this lock hold runs first re-links it) or CLAIMED (reclaimed later),
        never both, so the shed request is answered exactly once, by this Completion.
        """
        core = self._core
        with core.mutex:
            dn = core.seg.descs
            queued = np.flatnonzero((dn["state"] == QUEUED) & (dn["priority"] < below_priority))
            if not queued.size:
                return None
            priorities = dn["priority"][queued]
            lowest = queued[priorities == priorities.min()]
            i = int(lowest[np.argmax(dn["seq"][lowest])])  # the newest: the last to be served
            core.native.unlink(i)
            if core.faulty:
                core.fault.reach("shed.unlinked")
            row = core.native.finished(i)
            core.make_free(i)
        _, gen, _, _, rid, conn, enqueued, part, _, _, prio, _, _, _, _ = row
        return Completion(
            handle=Handle(i, gen), request_id=rid, conn_id=conn, part_class=part, priority=prio,
            status=Status.OVERLOADED, result=None, enqueue_ns=enqueued, claim_ns=0, done_ns=0,
            worker=-1, error=reason,
        )  # fmt: skip

    def abandon_connection(self, conn_id: int) -> int:
        """The client left: its queued requests are freed now, its claimed and finished ones
        when ``collect_completed`` meets them (without a Completion).

        WRITTEN descriptors are the acceptor's own: it must ``release`` them. Returns the
        number of requests dropped.
        """
        core = self._core
        d = core.d
        with core.mutex:
            dn = core.seg.descs
            mine = np.flatnonzero((dn["conn_id"] == conn_id) & (dn["state"] >= QUEUED)).tolist()
            freed = []
            for i in mine:
                if d.state[i] == QUEUED:
                    core.native.unlink(i)
                    core.make_free(i)
                    freed.append(i)
                else:
                    d.abandoned[i] = 1
            core.seg.header["abandoned"] += len(mine)
        self._regions.unpin(freed)
        return len(mine)

    # ---------------------------------------------------------------- answers out
    def collect_completed(self, drain: bool = True) -> list[Completion]:
        """Every finished (DONE / EXPIRED / FAILED) request as a Completion, oldest first;
        their descriptors are FREE afterwards.

        Drains the completion doorbell first (``drain``), so a completion that lands later
        rings again. Requests whose client left are freed without a Completion.
        """
        core = self._core
        if drain and core.completion is not None:
            core.completion.drain()
        # [lock] pop the done stack, free each in the same hold [unlock]
        finished = core.native.collect(False)
        if isinstance(finished, Contended):
            finished = core.contended(finished, core.native.collect)
        # FREE but not reused before we return (only this process reserves): read unlocked.
        seg = core.seg
        out = self._reader.completions(seg.mm, finished, seg.r.histogram, self._masked)
        if core.seg.owner:  # collect put them on the free list
            self._regions.unpin(map(_INDEX, finished))
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
        core = self._core
        if core.completion is None:
            raise QueueError("wait_for_completions needs the completion doorbell")
        if core.native.await_done(spin_us * 1000):
            return True
        core.completion.wait(timeout_s)  # a stale ring (collected already) wakes it early
        return core.native.await_done(0)

    def expire_due(self, now_ns: int) -> list[Completion]:
        """Answer TIMEOUT for every queued request whose deadline is ``≤ now_ns``."""
        core = self._core
        d = core.d
        with core.mutex:
            due = core.native.expire(now_ns)  # unlinked from the wheel and ready lists
            if core.faulty:
                core.fault.reach("expire.unlinked")
            for i in due:
                d.done_ns[i] = now_ns
                d.state[i] = EXPIRED
            if due:
                core.seg.header["expired"] += len(due)
            out = [self._completion_of(core.native.finished(i)) for i in due]
            for i in due:
                core.make_free(i)
        self._regions.unpin(due)
        return out

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline among queued requests (when to call ``expire_due``)."""
        with self._core.mutex:
            return self._core.native.earliest_deadline()

    # ---------------------------------------------------------------- views
    def depth_by_priority(self) -> list[int]:
        """Queued requests per priority, index 0..7."""
        with self._core.mutex:
            return [int(n) for n in self._core.seg.ready_count]

    def counters(self) -> dict[str, int]:
        """Totals since creation: repairs (after a dead lock holder), expired, requeued,
        quarantined and abandoned requests."""
        h = self._core.seg.header
        names = ("repairs", "expired", "requeued", "quarantined", "abandoned")
        return {n: int(h[n]) for n in names}

    def counts_by_state(self) -> dict[DescState, int]:
        """Descriptors per state (a lock-free snapshot)."""
        counts = np.bincount(self._core.seg.descs["state"], minlength=len(DescState))
        return {s: int(counts[s.value]) for s in DescState}

    def _masked(self, i: int, height: int, width: int) -> Result:
        """Descriptor ``i``'s result with its mask (the reader's one call back to Python)."""
        seg = self._core.seg
        return read_result(seg.result_block, self._core.r, seg.masks, i, height, width)

    def _completion_of(self, row: FinishedRow) -> Completion:
        i, gen, state, _, rid, conn, enqueued, part, h, w, prio, kills, claimed, done, worker = row
        result, error = None, ""
        if state == DONE:
            seg = self._core.seg
            result = read_result(seg.result_block, self._core.r, seg.masks, i, h, w)
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

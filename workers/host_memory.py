"""Host memory a CUDA worker uploads from: ranges page-locked with CUDA, and a pinned staging
buffer for frames that lie outside them.

Two kinds of range are page-locked (``cudaHostRegister``):

- the queue's input slots (read-write shared memory), at boot, whole (:meth:`register`);
- each client region a claim names (``ipc/region_maps.py``), once the worker maps it
  (:meth:`adopt`). Page-locking faults in and pins every page of the range, which takes long
  for a gateway's region (``scripts/bench_host_register.py``; docs/benchmarks.md): done on the
  claim path of the batch that first names a region, it held the queue for that long. So a
  region is locked in ``CHUNK``-byte pieces, off the batch loop's thread: a pinning thread
  (:meth:`start_pinning`) locks them one after another from the moment the region is
  adopted, with no lock of ours held during the CUDA call (which releases the GIL). Until a
  frame's piece is locked, the frame goes through a staging area. Without the thread
  (``PIN_THREAD_ENV=0``, for benchmarks, and in tests) :meth:`pin_pending` does the same work
  a piece a call, which the worker loop makes only when it has nothing to claim. The mapping
  is ``PROT_READ``, so it is registered with ``cudaHostRegisterReadOnly`` (the device only
  reads it, which is all an upload does). A device that cannot register read-only memory (the
  flag needs ``cudaDevAttrHostRegisterReadOnlySupported``) leaves every region unregistered:
  its frames go through a staging area, correct but with one more host copy. A region the
  worker unmaps (:meth:`retire`) leaves the lookup at once; its pieces are unlocked the same
  way, a piece at a time, and its array (which keeps the mapping alive) is let go after the
  last. The lookup and the regions' bookkeeping are changed only under ``PinnedHost._lock``:
  an upload never sees a piece before its lock has returned, nor after its region was
  retired.

``sources`` is what an upload reads: the frame itself when it lies, contiguous, in registered
memory (the DMA reads the slot or the client's region directly, one copy per registered range
it spans: a frame larger than ``CHUNK``, or across two pieces, is two or more copies), else a
copy in a staging area. A chunk's uploads run inside :meth:`PinnedHost.chunk`; chunks take the
``STAGING_AREAS`` areas in turn, and a chunk's first staged frame waits for the event recorded
after the copies of the chunk that used its area last, not for the whole copy stream: that
stream's next copies also wait for the graph still reading the input buffer, so a wait on the
stream would hold the worker's thread until the previous batch's compute ended, frame after
frame.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import numpy as np

from scratchd.kernels._checks import env_choice
from scratchd.protocol.log import log_event

HOST_REGISTER_READ_ONLY: Final = 8  # cudaHostRegisterReadOnly
"""CUDA's flag for page-locking memory the device will only read (a read-only mapping)."""

CHUNK: Final = 4 << 20
"""Bytes of a client region page-locked (or unlocked) in one CUDA call: without the pinning
thread, a request arriving during an idle turn's call waits for one piece at most.
``PIECE_ENV`` (MiB) overrides it, for benchmarks comparing piece sizes."""

PIECE_ENV: Final = "SCRATCHD_PIN_PIECE_MIB"

PIN_THREAD_ENV: Final = "SCRATCHD_PIN_THREAD"
"""``1`` (default): client regions are page-locked by a thread of their own; ``0``: by the
worker loop's idle turns (:meth:`PinnedHost.pin_pending`), for benchmarks comparing them."""

STAGING_AREAS: Final = 2
"""Staging areas taken in turn, one a chunk: a chunk reuses the area of two chunks back, whose
copies have almost always finished by then."""


@dataclass(eq=False)
class _Region:
    """A client region's mapping: ``locked`` pieces so far (their addresses), the next at
    ``base + done``. ``array`` keeps the mapping alive until its pieces are unlocked."""

    array: np.ndarray
    base: int
    nbytes: int
    done: int = 0  # bytes handed to a lock job (locked, or being locked now)
    locked: list[int] = field(default_factory=list)
    retired: bool = False


class _Job(NamedTuple):
    """One piece to lock (``lock``) or unlock, taken under the lock, run outside it."""

    region: _Region
    ptr: int
    nbytes: int
    lock: bool


class PinnedHost:
    """The page-locked ranges of one worker and its staging areas. ``cp`` is CuPy (or a
    stand-in with its ``cuda.runtime`` and ``cuda.Event``, for tests); ``copy_stream`` the
    uploads'."""

    def __init__(
        self, cp: Any, copy_stream: Any,
        alloc_pinned: Callable[[int], np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        """``alloc_pinned(n)``: ``n`` bytes of page-locked host memory, a uint8 array
        (default: ``cupyx.empty_pinned``)."""
        self.cp = cp
        self.copy_stream = copy_stream
        self.ranges: dict[int, int] = {}  # ptr -> nbytes, registered with CUDA, looked up
        self._starts: list[int] = []  # the ranges' addresses, sorted (disjoint ranges)
        self._regions: dict[int, _Region] = {}  # adopted client regions by address
        self._retiring: list[_Region] = []  # retired regions with pieces still locked
        self._alloc = alloc_pinned or _empty_pinned
        self._areas: list[np.ndarray | None] = [None] * STAGING_AREAS
        # Per area, the event recorded after the last copies that read it (None: never used).
        self._drained: list[Any] = [None] * STAGING_AREAS
        self._area = 0
        self._in_chunk = False
        self._area_ready = False  # the current chunk's area has been waited for
        self._read_only_refused = False
        self.piece = int(env_choice(PIECE_ENV, str(CHUNK >> 20), ("1", "2", "4", "8", "16"))) << 20
        # Guards the lookup and the regions' bookkeeping; never held during a CUDA call.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # notified when pieces are to be done
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: BaseException | None = None  # what ended the pinning thread
        self._busy = False  # the thread is running a job (outside the lock)

    def register(self, array: np.ndarray) -> None:
        """Page-lock ``array``'s memory (read-write, whole, now): the queue's input slots."""
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        if ptr in self.ranges or nbytes == 0:
            return
        self.cp.cuda.runtime.hostRegister(ptr, nbytes, 0)
        with self._lock:
            self._add(ptr, nbytes)

    def adopt(self, array: np.ndarray) -> None:
        """A client region's read-only mapping, to be page-locked piece by piece."""
        base = int(array.ctypes.data)
        with self._work:
            if array.nbytes and base not in self._regions and not self._read_only_refused:
                self._regions[base] = _Region(array, base, int(array.nbytes))
                self._work.notify_all()

    def retire(self, array: np.ndarray) -> None:
        """The worker unmaps ``array`` (an adopted region): no upload reads it from now on;
        its pieces are unlocked later, and then the array, and so the mapping, is let go."""
        with self._work:
            region = self._regions.get(int(array.ctypes.data))
            if region is not None:
                self._retire(region)
                self._work.notify_all()

    def _retire(self, region: _Region) -> None:
        # Under the lock. Its pieces are one run of the sorted addresses (nothing else lies
        # inside a region): cut as a slice, not piece by piece (a 4 GiB region has a thousand).
        del self._regions[region.base]
        region.retired = True
        lo = bisect.bisect_left(self._starts, region.base)
        hi = bisect.bisect_left(self._starts, region.base + region.nbytes)
        for ptr in self._starts[lo:hi]:
            del self.ranges[ptr]
        del self._starts[lo:hi]
        if region.locked:
            self._retiring.append(region)

    @property
    def region_bytes_locked(self) -> int:
        """Bytes of client regions CUDA holds page-locked now (retired ones not yet unlocked
        included)."""
        with self._lock:
            regions = [*self._regions.values(), *self._retiring]
            return sum(min(self.piece, r.base + r.nbytes - p) for r in regions for p in r.locked)

    def start_pinning(self, setup: Callable[[], None] = lambda: None) -> None:
        """Page-lock and unlock client regions on a thread of its own from now on (unless
        ``PIN_THREAD_ENV`` is ``0``). ``setup`` runs on that thread first (CuPy: make the
        worker's device current there)."""
        if self._thread is not None or env_choice(PIN_THREAD_ENV, "1", ("0", "1")) == "0":
            return
        self._thread = threading.Thread(
            target=self._pin_loop, args=(setup,), name="scratchd-pin", daemon=True
        )
        self._thread.start()

    def stop_pinning(self) -> None:
        """End the pinning thread after the piece in progress (it takes no new one)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        with self._work:
            self._stopping = True
            self._work.notify_all()
        thread.join()
        self._stopping = False

    def pin_pending(self) -> bool:
        """Without the pinning thread: unlock one piece of a retired region, or else lock the
        next piece of an adopted one; True while work of either kind is left. With it: False,
        or the thread's failure raised here (the worker loop's thread), never swallowed."""
        if self._thread is not None or self._failure is not None:
            if self._failure is not None:
                raise RuntimeError("page-locking client regions failed") from self._failure
            return False
        with self._lock:
            job = self._take_job()
        if job is not None:
            self._run_job(job)
        with self._lock:
            return self._work_left()

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until the pinning thread has no piece left to do or in progress (True), or
        ``timeout_s`` has passed (False); its failure is raised here. Immediate without it."""
        with self._work:
            settled = self._work.wait_for(
                lambda: (
                    self._failure is not None
                    or self._thread is None
                    or (not self._busy and not self._work_left())
                ),
                timeout_s,
            )
        if self._failure is not None:
            raise RuntimeError("page-locking client regions failed") from self._failure
        return settled

    def _pin_loop(self, setup: Callable[[], None]) -> None:
        try:
            setup()
            while True:
                with self._work:
                    self._busy = False
                    self._work.notify_all()  # wait_settled's waiters look again
                    while not self._stopping and not self._work_left():
                        self._work.wait()
                    if self._stopping:
                        return
                    job = self._take_job()
                    self._busy = job is not None
                if job is not None:
                    self._run_job(job)
        except BaseException as exc:  # reported by pin_pending on the worker loop's thread
            log_event("region_pinning_failed", logging.ERROR, reason=repr(exc))
            with self._work:
                self._failure, self._busy = exc, False
                self._work.notify_all()

    def _work_left(self) -> bool:
        # Under the lock.
        return bool(self._retiring) or any(r.done < r.nbytes for r in self._regions.values())

    def _take_job(self) -> _Job | None:
        # Under the lock; one job runs at a time (the thread's, or pin_pending's caller's).
        if self._retiring:
            old = self._retiring[0]
            ptr = old.locked.pop()
            if not old.locked:
                self._retiring.pop(0)
            return _Job(old, ptr, 0, lock=False)
        region = next((r for r in self._regions.values() if r.done < r.nbytes), None)
        if region is None:
            return None
        ptr = region.base + region.done
        nbytes = min(self.piece, region.nbytes - region.done)
        region.done += nbytes
        return _Job(region, ptr, nbytes, lock=True)

    def _run_job(self, job: _Job) -> None:
        rt = self.cp.cuda.runtime
        if not job.lock:
            rt.hostUnregister(job.ptr)
            return
        try:
            rt.hostRegister(job.ptr, job.nbytes, HOST_REGISTER_READ_ONLY)
        except rt.CUDARuntimeError as exc:
            # The device cannot lock read-only memory: no region will be, all go staged.
            with self._lock:
                self._read_only_refused = True
                for r in list(self._regions.values()):
                    self._retire(r)
            log_event("region_not_page_locked", logging.WARNING, reason=str(exc))
            return
        with self._lock:
            region = job.region
            region.locked.append(job.ptr)
            if not region.retired:
                self._add(job.ptr, job.nbytes)
            elif not any(r is region for r in self._retiring):
                self._retiring.append(region)  # retired while this piece was being locked

    def unregister_all(self) -> None:
        """Undo every page-locking now (before the memory is unmapped); the pinning thread,
        if any, is stopped first."""
        self.stop_pinning()
        with self._lock:
            for region in list(self._regions.values()):
                self._retire(region)
            ranges, retiring = list(self.ranges), list(self._retiring)
            for ptr in ranges:
                self._remove(ptr)
            self._retiring.clear()
        for ptr in ranges:
            self.cp.cuda.runtime.hostUnregister(ptr)
        for region in retiring:
            for ptr in region.locked:
                self.cp.cuda.runtime.hostUnregister(ptr)

    def pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """``(address, length)`` pieces, in order, of ``nbytes`` at ``ptr`` each inside one
        registered range (a frame across a region's adjacent pieces is several), or None if
        some byte is not registered."""
        with self._lock:
            return self._pieces(ptr, nbytes)

    def _pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        at, end, out = ptr, ptr + nbytes, []
        while i >= 0 and i < len(self._starts):
            lo = self._starts[i]
            hi = lo + self.ranges[lo]
            if not lo <= at < hi:
                return None  # a gap
            take = min(hi, end) - at
            out.append((at, take))
            at += take
            if at >= end:
                return out
            i += 1
        return None

    def registered(self, ptr: int, nbytes: int) -> bool:
        """Whether every one of ``nbytes`` at ``ptr`` is registered."""
        return self.pieces(ptr, nbytes) is not None

    def _add(self, ptr: int, nbytes: int) -> None:
        self.ranges[ptr] = nbytes
        bisect.insort(self._starts, ptr)

    def _remove(self, ptr: int) -> None:
        del self.ranges[ptr]
        self._starts.remove(ptr)

    def sources(self, img: np.ndarray, j: int, nbytes: int) -> list[tuple[int, int]]:
        """Page-locked ``(address, length)`` pieces that hold ``img`` (frame ``j`` of a chunk)
        in order: the frame itself if it lies in registered memory (and is contiguous), one
        piece per registered range it spans (each copy reads inside one registration), else
        one copy in the current chunk's staging area (only inside :meth:`chunk`)."""
        ptr = int(img.ctypes.data)
        if img.flags.c_contiguous:
            found = self.pieces(ptr, nbytes)
            if found is not None:
                return found
        if not self._in_chunk:
            raise RuntimeError("a frame staged outside PinnedHost.chunk()")
        a = self._area
        if not self._area_ready:
            if self._drained[a] is not None:
                self._drained[a].synchronize()  # the copies that read this area last
            self._area_ready = True
        need = (j + 1) * nbytes
        area = self._areas[a]
        if area is None or area.nbytes < need:
            area = self._areas[a] = self._alloc(max(need, 16 * nbytes))
        area[j * nbytes : need] = np.ascontiguousarray(img).reshape(-1)
        return [(int(area.ctypes.data) + j * nbytes, nbytes)]

    @contextmanager
    def chunk(self) -> Iterator[None]:
        """One chunk's uploads: :meth:`sources` and the copies that read what it returns are
        all enqueued on ``copy_stream`` inside. Its staged frames take the next area; on the
        way out (an error included: copies may be in flight) an event after them marks when
        the area may be written again."""
        if self._in_chunk:
            raise RuntimeError("PinnedHost.chunk() is not reentrant")
        self._area = (self._area + 1) % STAGING_AREAS
        self._in_chunk, self._area_ready = True, False
        try:
            yield
        finally:
            self._in_chunk = False
            if self._area_ready:  # something was staged: its copies read the area
                event = self._drained[self._area]
                if event is None:
                    event = self._drained[self._area] = self.cp.cuda.Event(disable_timing=True)
                event.record(self.copy_stream)


def _empty_pinned(nbytes: int) -> np.ndarray:
    import cupyx

    return cupyx.empty_pinned((nbytes,), np.uint8)

"""Host memory a CUDA worker uploads from: ranges page-locked with CUDA, and a pinned staging
buffer for frames that lie outside them.

Two kinds of range are page-locked (``cudaHostRegister``):

- the queue's input slots (read-write shared memory), at boot, whole (:meth:`register`);
- each client region a claim names (``ipc/region_maps.py``), once the worker maps it
  (:meth:`adopt`). Page-locking faults in and pins every page of the range, which takes long
  for a gateway's region (``scripts/bench_host_register.py``; docs/benchmarks.md): done on the
  claim path of the batch that first names a region, it held the queue for that long. So a
  region is locked a piece at a time, off the claim path, and until a frame's bytes are
  locked the frame goes through a staging area. The pages a staged frame lies in are locked
  first: pages a gateway wrote cost 5-14x less to lock than pages it never wrote, and a grey
  1024² frame fills only the first MiB of a 4 MiB ring slot. The worker loop locks them in
  the time it would sleep while a batch computes (:meth:`pin_within`, when the measured
  cost per byte says the range fits before the loop must claim again), and in turns with
  nothing to claim (:meth:`pin_pending`), which then also lock the rest of the region in
  ``CHUNK``-byte pieces. The mapping is ``PROT_READ``, so it is registered with
  ``cudaHostRegisterReadOnly`` (the device only reads it, which is all an upload does). A
  device that cannot register read-only memory (the flag needs
  ``cudaDevAttrHostRegisterReadOnlySupported``) leaves every region unregistered: its frames go
  through a staging area, correct but with one more host copy. A region the worker unmaps
  (:meth:`retire`) leaves the lookup at once; its pieces are unlocked by :meth:`pin_pending`
  the same way, a piece a call, and its array (which keeps the mapping alive) is let go after
  the last. A region's last piece locked logs ``region_page_locked`` (its bytes and pieces,
  the ms spent locking and since the worker mapped it, and the frames staged meanwhile).

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
import mmap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from scratchd.kernels._checks import env_choice
from scratchd.protocol.log import log_event

HOST_REGISTER_READ_ONLY: Final = 8  # cudaHostRegisterReadOnly
"""CUDA's flag for page-locking memory the device will only read (a read-only mapping)."""

CHUNK: Final = 4 << 20
"""Bytes of a client region page-locked (or unlocked) per :meth:`PinnedHost.pin_pending`: a
request arriving meanwhile waits for one piece at most. ``PIECE_ENV`` (MiB) overrides it, for
benchmarks comparing piece sizes."""

PIECE_ENV: Final = "SCRATCHD_PIN_PIECE_MIB"

PAGE: Final = mmap.PAGESIZE

MAX_WANTED: Final = 256
"""Ranges of staged frames a region remembers to lock first (a ring has tens of slots); more
are left to the piece-by-piece locking."""

FIRST_NS_PER_MIB: Final = 250_000
"""What locking 1 MiB of a staged frame's pages is taken to cost until one has been timed (the
H200: 0.1-0.2 ms for pages written, ``docs/bench/host-register.json``)."""

STAGING_AREAS: Final = 2
"""Staging areas taken in turn, one a chunk: a chunk reuses the area of two chunks back, whose
copies have almost always finished by then."""


@dataclass(eq=False)
class _Region:
    """A client region's mapping and what of it is locked. ``array`` keeps the mapping alive
    until its ranges are unlocked."""

    array: np.ndarray
    base: int
    nbytes: int
    adopted_ns: int  # when the worker mapped it (monotonic)
    staged_before: int  # the worker's staged frames when it was adopted
    done: int = 0  # bytes locked
    locked: dict[int, int] = field(default_factory=dict)  # its locked ranges: ptr -> nbytes
    starts: list[int] = field(default_factory=list)  # their addresses, sorted
    wanted: dict[int, int] = field(default_factory=dict)  # staged frames' pages: ptr -> end
    lock_ns: int = 0  # spent in cudaHostRegister for its ranges

    def unlocked_run(self, lo: int, hi: int, limit: int) -> tuple[int, int] | None:
        """The first run of unlocked bytes in ``[lo, hi)``, at most ``limit`` long, as
        ``(address, length)``; None when all of it is locked."""
        at = lo
        for ptr in self.starts[max(0, bisect.bisect_right(self.starts, lo) - 1) :]:
            end = ptr + self.locked[ptr]
            if end <= at:
                continue
            if ptr > at:
                break  # [at, ptr) is a gap
            at = end
            if at >= hi:
                return None
        else:
            ptr = hi
        if at >= hi:
            return None
        return at, min(ptr, hi, at + limit) - at

    def want(self, ptr: int, nbytes: int) -> None:
        """A frame at ``ptr`` was staged: lock its pages first."""
        if len(self.wanted) >= MAX_WANTED:
            return
        lo = self.base + (ptr - self.base) // PAGE * PAGE
        hi = min(self.base + self.nbytes, self.base - (-(ptr + nbytes - self.base) // PAGE) * PAGE)
        self.wanted[lo] = max(self.wanted.get(lo, hi), hi)

    def next_wanted(self, limit: int) -> tuple[int, int] | None:
        """The first unlocked run of a staged frame's pages (forgetting those locked)."""
        for lo, hi in list(self.wanted.items()):
            run = self.unlocked_run(lo, hi, limit)
            if run is not None:
                return run
            del self.wanted[lo]
        return None

    def next_piece(self, limit: int) -> tuple[int, int] | None:
        """What to lock next: a staged frame's pages, else the first unlocked run."""
        run = self.next_wanted(limit)
        return (
            run if run is not None else self.unlocked_run(self.base, self.base + self.nbytes, limit)
        )


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
        self.staged = 0  # frames copied through a staging area so far
        self.ns_per_byte = FIRST_NS_PER_MIB / (1 << 20)  # locking staged frames' pages, EWMA
        self.piece = int(env_choice(PIECE_ENV, str(CHUNK >> 20), ("1", "2", "4", "8", "16"))) << 20

    def register(self, array: np.ndarray) -> None:
        """Page-lock ``array``'s memory (read-write, whole, now): the queue's input slots."""
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        if ptr in self.ranges or nbytes == 0:
            return
        self.cp.cuda.runtime.hostRegister(ptr, nbytes, 0)
        self._add(ptr, nbytes)

    def adopt(self, array: np.ndarray) -> None:
        """A client region's read-only mapping, to be page-locked by :meth:`pin_pending`."""
        base = int(array.ctypes.data)
        if array.nbytes and base not in self._regions and not self._read_only_refused:
            region = _Region(array, base, int(array.nbytes), time.monotonic_ns(), self.staged)
            self._regions[base] = region

    def retire(self, array: np.ndarray) -> None:
        """The worker unmaps ``array`` (an adopted region): no upload reads it from now on;
        :meth:`pin_pending` unlocks its pieces and then lets the array, and so the mapping,
        go."""
        region = self._regions.pop(int(array.ctypes.data), None)
        if region is None:
            return
        # Its pieces are one run of the sorted addresses (nothing else lies inside a region):
        # cut as a slice, not piece by piece (a 4 GiB region has a thousand).
        lo = bisect.bisect_left(self._starts, region.base)
        hi = bisect.bisect_left(self._starts, region.base + region.nbytes)
        for ptr in self._starts[lo:hi]:
            del self.ranges[ptr]
        del self._starts[lo:hi]
        if region.locked:
            self._retiring.append(region)

    def pin_pending(self) -> bool:
        """Unlock one range of a retired region, or else lock the next range of an adopted
        one (a staged frame's pages first, then ``piece`` bytes at most); True while work of
        either kind is left."""
        rt = self.cp.cuda.runtime
        if self._retiring:
            region = self._retiring[0]
            rt.hostUnregister(region.locked.popitem()[0])
            if not region.locked:
                self._retiring.pop(0)
        else:
            for region in self._regions.values():
                run = region.next_piece(self.piece)
                if run is not None:
                    self._lock(region, *run)
                    break
        return bool(self._retiring) or any(r.done < r.nbytes for r in self._regions.values())

    def pin_within(self, budget_ns: int) -> bool:
        """Lock the next staged frame's pages if their measured cost fits in ``budget_ns``
        (the time the worker would otherwise sleep while a batch computes); True if it locked
        anything. The rest of a region waits for :meth:`pin_pending`: pages never written
        cost far more, and cannot be timed ahead."""
        for region in self._regions.values():
            run = region.next_wanted(self.piece)
            if run is not None:
                if run[1] * self.ns_per_byte > budget_ns:
                    return False
                t0 = time.monotonic_ns()
                if self._lock(region, *run):
                    sample = (time.monotonic_ns() - t0) / run[1]
                    self.ns_per_byte = 0.8 * self.ns_per_byte + 0.2 * sample
                    return True
                return False
        return False

    def _lock(self, region: _Region, ptr: int, nbytes: int) -> bool:
        t0 = time.monotonic_ns()
        try:
            self.cp.cuda.runtime.hostRegister(ptr, nbytes, HOST_REGISTER_READ_ONLY)
        except self.cp.cuda.runtime.CUDARuntimeError as exc:
            # The device cannot lock read-only memory: no region will be, all go staged.
            self._read_only_refused = True
            log_event("region_not_page_locked", logging.WARNING, reason=str(exc))
            for r in list(self._regions.values()):
                self.retire(r.array)
            return False
        now = time.monotonic_ns()
        region.lock_ns += now - t0
        region.done += nbytes
        region.locked[ptr] = nbytes
        bisect.insort(region.starts, ptr)
        self._add(ptr, nbytes)
        if region.done == region.nbytes:
            # When a gateway's frames start going straight from its region to the card, and
            # what locking it cost: frames staged meanwhile took one more host copy each.
            log_event(
                "region_page_locked", bytes=region.nbytes, pieces=len(region.locked),
                lock_ms=round(region.lock_ns / 1e6, 2),
                after_ms=round((now - region.adopted_ns) / 1e6, 2),
                frames_staged=self.staged - region.staged_before,
            )  # fmt: skip
        return True

    def unregister_all(self) -> None:
        """Undo every page-locking now (before the memory is unmapped)."""
        for region in list(self._regions.values()):
            self.retire(region.array)
        for ptr in list(self.ranges):
            self._remove(ptr)
            self.cp.cuda.runtime.hostUnregister(ptr)
        for region in self._retiring:
            for ptr in region.locked:
                self.cp.cuda.runtime.hostUnregister(ptr)
        self._retiring.clear()

    def pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """``(address, length)`` pieces, in order, of ``nbytes`` at ``ptr`` each inside one
        registered range (a frame across a region's adjacent pieces is several), or None if
        some byte is not registered."""
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

    def _want(self, ptr: int, nbytes: int) -> None:
        for region in self._regions.values():
            if region.base <= ptr < region.base + region.nbytes:
                region.want(ptr, nbytes)
                return

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
        self.staged += 1
        if img.flags.c_contiguous:
            self._want(ptr, nbytes)
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

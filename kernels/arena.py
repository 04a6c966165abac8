"""Device memory from one arena: a binary buddy allocator for large blocks, slabs for small ones,
stream-ordered reuse, plugged into CuPy as its allocator.

Three layers, each usable alone:

- :class:`OffsetArena` — pure Python over byte offsets into one region (no CUDA): the buddy
  allocator and the slabs. Fully tested on the CPU.
- :class:`StreamOrderedArena` — adds stream-ordered reuse on top: freed blocks wait behind a
  CUDA event before anyone else may have them. Events come from a factory, so the rules are
  tested on the CPU with hand-driven events.
- :class:`DeviceArena` — takes the region with ``cudaMalloc`` once and serves
  ``cupy.cuda.set_allocator(arena.malloc)`` / ``cupy.cuda.using_allocator(arena.malloc)``.

The buddy tree (orders; a block of order k is ``ALIGN << k`` bytes, aligned to its size
relative to the region start; its buddy is ``offset ^ size``)::

    order 3  [0 ─────────────────────────────── 2048)          one root (power-of-two region)
    order 2  [0 ────────── 1024)[1024 ────── 2048)             split on demand ...
    order 1  [0 ── 512)[512 ── 1024)  (free)                   ... down to the order asked for
    order 0  [0)[256)  (free)                                  free: both buddies merge upwards

    allocate(order k): lowest-offset free block of the smallest order ≥ k, split down to k, each
    split's upper half goes on its order's free list. free: while the buddy is free at the same
    order, take it off its list and merge. Both O(log n) (a set and a lazy heap per order).

Trimmed blocks: a large request is rounded up to ``TRIM_BITS`` (4) significant bits of
256-byte units (≤ 12.5 % over, against up to 100 % for a whole power of two), takes the
power-of-two block that holds it, and gives the tail back at once as buddy blocks::

    request 5 units, block of 8:  [0 ──── 4)[4)[5)[6 ── 8)
                                  └─ kept ───┘ └─ tail ─┘   tail (1 + 2 units) freed at once;
                                                            free gives back 1 then 4 (merging)

A region that is not a power of two is cut into its binary digits from offset 0 (3 MiB → a
2 MiB root then a 1 MiB root); roots never merge, so an empty 3 MiB arena already reports
(3 − 2) / 3 = 0.33: no request above 2 MiB can be served.

Slabs (requests of at most ``small_max`` bytes, rounded to a power-of-two class ≥ 256 B)::

    one buddy block of slab_bytes (aligned to slab_bytes), cut into equal objects of one class
    ┌─────┬─────┬─────┬─────┬─── ... ───┬─────┐   live: bytearray (1 = handed out)
    │ obj0│ obj1│ obj2│ obj3│           │objN-1│  fresh: objects [0, fresh) used at least once
    └─────┴─────┴─────┴─────┴─── ... ───┴─────┘   free: stack of those given back since
    a class keeps its slabs that have a free object; a slab whose last object comes back is
    returned to the buddy allocator at once (so "everything freed" is one free block again).
    When no slab-sized block is left, a small request falls back to a buddy block of its class.

Fragmentation: ``(free − largest free block) / total`` where free = total − bytes handed out
(rounded sizes; blocks waiting on an event count as handed out) and the largest free block is
the largest free buddy block. Free objects inside slabs are free but never part of the largest
block, so a half-empty slab shows up as fragmentation, as it should. A power-of-two region
that holds any block can serve at most half of itself in one piece, so an arena less than half
full reads at least (free − total/2) / total: the ratio says how much free memory one large
request cannot use, not how scattered the blocks are.

Stream-ordered reuse (``StreamOrderedArena`` / ``DeviceArena``), in the order things happen:

1. Free (the last reference to a CuPy array's memory dies): the block's owner appends
   ``(offset, size, current stream)`` to a lock-free deque — nothing else, no CUDA call, because
   this runs inside ``__del__``, at any point, possibly while this thread holds the arena lock.
2. The next allocation (or ``collect``/``stats``) drains that deque under the lock into the
   freeing stream's open batch. Those blocks are in no free list: no other stream can get them.
3. A stream's open batch is sealed — one event recorded on that stream for all its blocks —
   once it holds ``SEAL_BLOCKS`` blocks or ``SEAL_BYTES`` bytes, and always in ``collect``,
   ``stats``, ``synchronize`` and before the slow path (6). Recording later than the free is
   later in the same stream's order, so the event still completes only after every kernel
   enqueued before the free; batching saves an event record per free.
4. An allocation on stream S of the same rounded size takes a block waiting in one of S's own
   batches (open or sealed): stream order makes that safe (its kernels run after S's earlier
   ones). A block freed on S never goes to another stream before S's event has completed.
5. Sealed batches wait per stream in record order. A drain, or an allocation that step 4 could
   not serve, retires (at most every ``RETIRE_INTERVAL_NS``), per stream, the batches whose
   event has completed (``cudaEventQuery``, never a synchronisation): their blocks go back to
   the buddy/slab allocator and may go to any stream. Completed events are recorded again.
6. Otherwise the buddy/slab allocator serves it. Only when that is exhausted does the arena
   block the host: it seals every batch, waits on the oldest events one at a time and retries,
   and raises :class:`ArenaExhausted` (a ``MemoryError``, like CuPy's) when nothing is left.

The free-time stream is the one that must order every use of the block before the free (the
convention of CuPy's stream-ordered memory). Threads: ``allocate`` holds ``_lock``; ``release``
takes no lock. A double free inside the offset arena raises :class:`InvalidFree`; a block freed
twice after being reused by someone else cannot be told apart (as with any malloc).
"""

from __future__ import annotations

import enum
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

ALIGN_SHIFT = 8
ALIGN = 1 << ALIGN_SHIFT  # 256 bytes; CuPy's allocation granularity is a multiple of it
SMALL_MAX = 64 << 10  # largest request served from a slab
SLAB_BYTES = 1 << 20  # one slab, carved from one buddy block
SEAL_BLOCKS, SEAL_BYTES = 32, 1 << 20  # a stream's frees get an event at either count
RETIRE_INTERVAL_NS = 20_000  # the allocation path asks the events at most this often
TRIM_BITS = 4  # significant bits kept of a large request's size (see "Trimmed blocks")


class ArenaError(Exception):
    """Misuse of the arena (bad free, wrong device, closing with live blocks)."""


class ArenaExhausted(ArenaError, MemoryError):
    """No free block can hold the request."""

    def __init__(self, size: int, free: int, largest: int) -> None:
        super().__init__(
            f"device arena exhausted: cannot allocate {size} bytes "
            f"(free {free} bytes, largest free block {largest} bytes)"
        )
        self.size, self.free, self.largest = size, free, largest


class InvalidFree(ArenaError):
    """A free of an offset that is not the start of a live block (double free, foreign pointer)."""


def order_of(size: int) -> int:
    """The buddy order whose block (``ALIGN << order`` bytes) is the smallest to hold ``size``."""
    units = max(1, -(-size // ALIGN))
    return (units - 1).bit_length()


def large_units(size: int) -> int:
    """``ALIGN`` units a buddy request takes: rounded up to 4 significant bits (≤ 12.5 % over)."""
    units = max(1, -(-size // ALIGN))
    step = 1 << max(0, units.bit_length() - TRIM_BITS)
    return -(-units // step) * step


def pieces(offset: int, units: int) -> list[tuple[int, int]]:
    """``(offset, order)`` of the buddy blocks spelling ``units`` from ``offset``, largest first.

    Each piece is aligned to its size when ``offset`` is aligned to the largest one.
    """
    out = []
    for order in range(units.bit_length() - 1, -1, -1):
        if units >> order & 1:
            out.append((offset, order))
            offset += ALIGN << order
    return out


@dataclass(frozen=True)
class ArenaStats:
    total: int  # bytes in the region
    used: int  # bytes handed out (rounded sizes), waiting blocks included
    free: int  # total - used
    largest_free: int  # largest free buddy block
    fragmentation_ratio: float  # (free - largest_free) / total
    high_water: int  # highest end offset any block has reached
    slabs: dict[int, tuple[int, int]] = field(default_factory=dict)  # class → (slabs, live objs)
    waiting: int = 0  # bytes freed but waiting behind an event (StreamOrderedArena)


class BuddyAllocator:
    """Binary buddy allocator over ``[0, total)``; ``total`` a positive multiple of ``ALIGN``."""

    def __init__(self, total: int) -> None:
        if total <= 0 or total % ALIGN:
            raise ValueError(f"arena size must be a positive multiple of {ALIGN}, got {total}")
        self.total, self.free_bytes, self.high_water = total, total, 0
        self.max_order = order_of(total) + 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._heap: list[list[int]] = [[] for _ in range(self.max_order + 1)]
        self.roots: list[tuple[int, int]] = []  # (offset, order), the region's binary digits
        offset = 0
        for order in range(self.max_order, -1, -1):
            if offset + (ALIGN << order) <= total:
                self.roots.append((offset, order))
                self._push(offset, order)
                offset += ALIGN << order

    def _push(self, offset: int, order: int) -> None:
        self._free[order].add(offset)
        heap = self._heap[order]
        heapq.heappush(heap, offset)
        if len(heap) > 2 * len(self._free[order]) + 64:  # drop stale entries now and then
            self._heap[order] = sorted(self._free[order])

    def _pop_lowest(self, order: int) -> int:
        free, heap = self._free[order], self._heap[order]
        while True:
            offset = heapq.heappop(heap)
            if offset in free:  # entries of blocks merged or taken meanwhile are stale
                free.remove(offset)
                return offset

    def allocate(self, order: int) -> int | None:
        """Offset of a free block of ``order`` (split from a larger one), or None."""
        free, k = self._free, order
        if k > self.max_order:
            return None
        while not free[k]:  # the smallest order that has a free block
            k += 1
            if k > self.max_order:
                return None
        offset = self._pop_lowest(k)
        while k > order:
            k -= 1
            self._push(offset + (ALIGN << k), k)
        self.free_bytes -= ALIGN << order
        return offset

    def release(self, offset: int, order: int) -> None:
        """Give a block back, merging it with its free buddies."""
        self.free_bytes += ALIGN << order
        while order < self.max_order:
            buddy = offset ^ (ALIGN << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset, order = min(offset, buddy), order + 1
        self._push(offset, order)

    def allocate_units(self, units: int) -> int | None:
        """Offset of ``units`` contiguous free units: a block of the next power of two whose
        tail beyond ``units`` goes straight back (at most ``TRIM_BITS`` pieces for large ones)."""
        order = (units - 1).bit_length()
        offset = self.allocate(order)
        if offset is None:
            return None
        tail, end = (1 << order) - units, offset + units * ALIGN
        while tail:  # smallest piece first: each is then aligned to its size
            k = (tail & -tail).bit_length() - 1
            self.release(end, k)
            end += ALIGN << k
            tail &= tail - 1
        self.high_water = max(self.high_water, offset + units * ALIGN)
        return offset

    def release_units(self, offset: int, units: int) -> None:
        for start, order in reversed(pieces(offset, units)):
            self.release(start, order)

    def largest_free(self) -> int:
        return next((ALIGN << k for k in range(self.max_order, -1, -1) if self._free[k]), 0)

    def free_block_holding(self, offset: int) -> tuple[int, int] | None:
        """The free block ``(start, order)`` that contains ``offset``, if any."""
        for k in range(self.max_order + 1):
            start = offset & ~((ALIGN << k) - 1)
            if start in self._free[k]:
                return start, k
        return None

    def free_blocks(self) -> Iterator[tuple[int, int]]:
        """Every free block as ``(offset, size)``, by offset."""
        blocks = ((o, ALIGN << k) for k, s in enumerate(self._free) for o in s)
        return iter(sorted(blocks))


class _Slab:
    """Objects ``[0, fresh)`` have been handed out at least once; those given back since are on
    ``free``. Creating a slab is O(1) (no list of its 4096 objects), which matters because an
    emptied slab goes straight back to the buddy allocator and may be made again at once."""

    __slots__ = ("base", "free", "fresh", "live", "live_count", "size")

    def __init__(self, base: int, size: int, count: int) -> None:
        self.base, self.size = base, size
        self.free: list[int] = []
        self.fresh = self.live_count = 0
        self.live = bytearray(count)

    def take(self) -> int:
        index = self.free.pop() if self.free else self.fresh
        if index == self.fresh:
            self.fresh += 1
        self.live[index] = 1
        self.live_count += 1
        return index

    @property
    def full(self) -> bool:
        return not self.free and self.fresh == len(self.live)


class OffsetArena:
    """Buddy blocks for large requests, slabs for those of at most ``small_max`` bytes."""

    def __init__(
        self, total: int, *, small_max: int = SMALL_MAX, slab_bytes: int = SLAB_BYTES
    ) -> None:
        self.small_max = ALIGN << order_of(small_max) if small_max > 0 else -1  # -1: no slabs
        if self.small_max > 0 and (
            slab_bytes & (slab_bytes - 1) or slab_bytes < 2 * self.small_max
        ):
            raise ValueError(f"slab_bytes {slab_bytes}: need a power of two ≥ 2 × {small_max}")
        self.buddy = BuddyAllocator(total)
        self.total, self.used = total, 0
        self.slab_bytes, self._slab_order = slab_bytes, order_of(slab_bytes)
        self._blocks: dict[int, int] = {}  # buddy blocks handed out: offset → units
        self._slabs: dict[int, _Slab] = {}  # slab base → slab
        self._partial: dict[int, dict[int, _Slab]] = {}  # class → slabs with a free object

    def reserved(self, size: int) -> int:
        """Bytes a request of ``size`` takes (its slab class, or its trimmed buddy blocks)."""
        if size <= self.small_max:
            return ALIGN << ((size - 1) >> ALIGN_SHIFT).bit_length() if size > ALIGN else ALIGN
        return ALIGN * large_units(size)

    def allocate(self, size: int, reserved: int = 0) -> int:
        """Offset of a new block of at least ``size`` bytes, aligned to ``ALIGN``.

        ``reserved``: ``self.reserved(size)`` when the caller has it already.
        """
        if size < 0:
            raise ValueError(f"negative allocation size {size}")
        reserved = reserved or self.reserved(size)
        offset = self._allocate_small(reserved) if size <= self.small_max else None
        if offset is None:  # a large request, or a small one with no room for a new slab
            found = self.buddy.allocate_units(reserved // ALIGN)
            if found is None:
                raise ArenaExhausted(size, self.total - self.used, self.buddy.largest_free())
            offset = found
            self._blocks[offset] = reserved // ALIGN
        self.used += reserved
        return offset

    def _allocate_small(self, cls: int) -> int | None:
        partial = self._partial.get(cls)
        if partial is None:
            partial = self._partial[cls] = {}
        slab = next(iter(partial.values())) if partial else None
        if slab is None:
            base = self.buddy.allocate(self._slab_order)
            if base is None:
                return None  # the caller falls back to a buddy block of the class size
            self.buddy.high_water = max(self.buddy.high_water, base + self.slab_bytes)
            slab = self._slabs[base] = partial[base] = _Slab(base, cls, self.slab_bytes // cls)
        index = slab.take()
        if slab.full:
            del partial[slab.base]
        return slab.base + index * cls

    def free(self, offset: int) -> None:
        """Give back the block that starts at ``offset``."""
        units = self._blocks.pop(offset, None)
        if units is not None:
            self.buddy.release_units(offset, units)
            self.used -= units * ALIGN
            return
        slab = self._slabs.get(offset & ~(self.slab_bytes - 1))
        index, rest = divmod(offset - slab.base, slab.size) if slab else (0, 1)
        if slab is None or rest or not slab.live[index]:
            raise self._bad_free(offset)
        slab.live[index] = 0
        slab.free.append(index)
        slab.live_count -= 1
        self.used -= slab.size
        partial = self._partial[slab.size]
        partial[slab.base] = slab
        if not slab.live_count:  # empty: back to the buddy allocator
            del partial[slab.base], self._slabs[slab.base]
            self.buddy.release(slab.base, self._slab_order)

    def _bad_free(self, offset: int) -> InvalidFree:
        if not 0 <= offset < self.total or offset % ALIGN:
            return InvalidFree(f"foreign pointer: offset {offset} is not a block of this arena")
        hole = self.buddy.free_block_holding(offset)
        if hole is not None:
            start, end = hole[0], hole[0] + (ALIGN << hole[1])
            return InvalidFree(f"double free: offset {offset} lies in free block [{start}, {end})")
        slab = self._slabs.get(offset & ~(self.slab_bytes - 1))
        if slab and (offset - slab.base) % slab.size == 0:
            return InvalidFree(f"double free: slab object at offset {offset} is already free")
        return InvalidFree(f"foreign pointer: offset {offset} is not the start of a live block")

    def fragmentation_ratio(self) -> float:
        free = self.total - self.used
        return (free - self.buddy.largest_free()) / self.total

    def stats(self, waiting: int = 0) -> ArenaStats:
        slabs: dict[int, tuple[int, int]] = {}
        for slab in self._slabs.values():
            count, live = slabs.get(slab.size, (0, 0))
            slabs[slab.size] = (count + 1, live + slab.live_count)
        return ArenaStats(
            total=self.total, used=self.used, free=self.total - self.used,
            largest_free=self.buddy.largest_free(),
            fragmentation_ratio=self.fragmentation_ratio(), high_water=self.buddy.high_water,
            slabs=dict(sorted(slabs.items())), waiting=waiting,
        )  # fmt: skip


# ---------------------------------------------------------------- stream-ordered reuse


class Event(Protocol):
    """What the arena needs of a CUDA event (``cupy.cuda.Event`` has it)."""

    def record(self, stream: Any = ...) -> None: ...
    @property
    def done(self) -> bool: ...
    def synchronize(self) -> None: ...


class _Batch:
    """Blocks one stream freed, then (once sealed) behind one event recorded on that stream."""

    __slots__ = ("blocks", "event", "nbytes", "stream")

    def __init__(self, stream: Any) -> None:
        # Holding the stream keeps it alive while blocks wait on it: a destroyed stream's
        # handle could be reused by a new stream that is not ordered after the old one.
        self.stream = stream
        self.event: Event | None = None  # recorded on ``stream`` when the batch is sealed
        self.blocks: list[tuple[int, int]] = []  # (offset, reserved size)
        self.nbytes = 0


class StreamOrderedArena:
    """An :class:`OffsetArena` whose freed blocks wait behind events (module docstring, 1–6)."""

    def __init__(self, total: int, new_event: Callable[[], Event], **slabs: int) -> None:
        self.offsets = OffsetArena(total, **slabs)
        self._new_event = new_event
        self._spare_events: list[Event] = []
        self._released: deque[tuple[int, int, Any]] = deque()  # (offset, reserved, stream)
        self._open: dict[int, _Batch] = {}  # stream ptr → its batch not sealed yet
        self._sealed: dict[int, deque[_Batch]] = {}  # stream ptr → sealed batches, record order
        self._waiting: dict[int, _Batch] = {}  # offset → the batch it waits in
        self._reusable: dict[tuple[int, int], dict[int, None]] = {}  # (stream, size) → offsets
        self._waiting_bytes = self._sealed_count = self._next_retire_ns = 0
        self._lock = threading.Lock()

    def release(self, offset: int, reserved: int, stream: Any) -> None:
        """Called when the last user of a block is gone (any thread, inside ``__del__``)."""
        self._released.append((offset, reserved, stream))

    def allocate(self, size: int, stream: Any, reserved: int = 0) -> int:
        """Offset of a block that work enqueued on ``stream`` from now on may use.

        ``reserved``: ``offsets.reserved(size)`` when the caller has it already.
        """
        reserved = reserved or self.offsets.reserved(size)
        with self._lock:
            if self._released:
                self._drain()
            bucket = self._reusable.get((stream.ptr, reserved))
            if bucket:  # freed on this stream: its later work runs after the earlier frees
                offset, _ = bucket.popitem()
                del self._waiting[offset]
                self._waiting_bytes -= reserved
                return offset
            if self._sealed_count and time.perf_counter_ns() >= self._next_retire_ns:
                self._retire()
            try:
                return self.offsets.allocate(size, reserved)
            except ArenaExhausted:
                return self._allocate_after_waiting(size)

    def collect(self) -> ArenaStats:
        """Drain released blocks, seal every batch, retire completed events; the stats then."""
        with self._lock:
            self._drain()
            self._seal_all()
            self._retire()
            return self.offsets.stats(self._waiting_bytes)

    def synchronize(self) -> None:
        """Wait for every pending event (not in the hot path: tests, shutdown)."""
        with self._lock:
            self._drain()
            self._seal_all()
            for batches in self._sealed.values():
                for batch in batches:
                    assert batch.event is not None
                    batch.event.synchronize()
            self._retire()

    def fragmentation_ratio(self) -> float:
        return self.collect().fragmentation_ratio

    def _drain(self) -> None:
        # Retire first: a batch sealed below is not asked about until later, so its blocks get
        # one round of same-stream reuse (a serving loop's next batch) before they go back to
        # the buddy allocator — on an idle GPU the event would already be done, and every
        # block would be merged and split again.
        if self._sealed_count and time.perf_counter_ns() >= self._next_retire_ns:
            self._retire()
        touched: set[int] = set()
        while self._released:
            offset, reserved, stream = self._released.popleft()
            ptr = stream.ptr
            batch = self._open.get(ptr)
            if batch is None:
                batch = self._open[ptr] = _Batch(stream)
            batch.blocks.append((offset, reserved))
            batch.nbytes += reserved
            self._waiting[offset] = batch
            self._reusable.setdefault((ptr, reserved), {})[offset] = None
            self._waiting_bytes += reserved
            touched.add(ptr)
        for ptr in touched:  # one event per stream and drain at most
            batch = self._open[ptr]
            if len(batch.blocks) >= SEAL_BLOCKS or batch.nbytes >= SEAL_BYTES:
                self._seal(ptr)

    def _seal(self, ptr: int) -> None:
        batch = self._open.pop(ptr)
        event = self._spare_events.pop() if self._spare_events else self._new_event()
        event.record(batch.stream)
        batch.event = event
        self._sealed.setdefault(ptr, deque()).append(batch)
        self._sealed_count += 1

    def _seal_all(self) -> None:
        for ptr in list(self._open):
            self._seal(ptr)

    def _retire(self) -> None:
        self._next_retire_ns = time.perf_counter_ns() + RETIRE_INTERVAL_NS
        for ptr, batches in self._sealed.items():
            while batches and batches[0].event.done:  # type: ignore[union-attr]
                batch = batches.popleft()  # one stream's events complete in record order
                self._sealed_count -= 1
                for offset, reserved in batch.blocks:
                    if self._waiting.get(offset) is batch:  # not reused on its stream meanwhile
                        del self._waiting[offset]
                        del self._reusable[(ptr, reserved)][offset]
                        self._waiting_bytes -= reserved
                        self.offsets.free(offset)
                self._spare_events.append(batch.event)  # type: ignore[arg-type]

    def _allocate_after_waiting(self, size: int) -> int:
        """The slow path: seal everything, block on the oldest events one at a time, retry."""
        self._seal_all()
        while True:
            heads = [batches[0] for batches in self._sealed.values() if batches]
            if not heads:
                return self.offsets.allocate(size)  # raises ArenaExhausted
            heads[0].event.synchronize()  # type: ignore[union-attr]
            self._retire()
            try:
                return self.offsets.allocate(size)
            except ArenaExhausted:
                continue


# ---------------------------------------------------------------- CuPy plug-in


class ArenaState(enum.Enum):
    OPEN = "open"  # serving allocations
    CLOSED = "closed"  # region given back with cudaFree; every call raises


class _Block:
    """Owner of one block behind a ``cupy.cuda.UnownedMemory``: dies with the last view."""

    __slots__ = ("arena", "current_stream", "offset", "reserved")

    def __init__(
        self, arena: StreamOrderedArena, offset: int, reserved: int, current_stream: Any
    ) -> None:
        self.arena, self.offset, self.reserved = arena, offset, reserved
        self.current_stream = current_stream

    def __del__(self) -> None:
        try:
            stream = self.current_stream()
        except Exception:  # interpreter teardown: CuPy is gone, and so is the context
            return
        self.arena.release(self.offset, self.reserved, stream)


class DeviceArena:
    """One ``cudaMalloc`` region of the current device, served to CuPy as its allocator."""

    def __init__(self, nbytes: int, **slabs: int) -> None:
        from scratchd.kernels._cuda import cupy

        cp = cupy()
        total = nbytes // ALIGN * ALIGN
        self.arena = StreamOrderedArena(
            total, lambda: cp.cuda.Event(block=False, disable_timing=True), **slabs
        )  # first: bad arguments raise before any device memory is taken
        self.device_id = int(cp.cuda.runtime.getDevice())
        self._runtime, self._cp = cp.cuda.runtime, cp
        self.base = int(cp.cuda.runtime.malloc(total))  # cudaMalloc: 256-byte aligned or more
        self._current_stream = cp.cuda.get_current_stream
        self._reserved, self._allocate = self.arena.offsets.reserved, self.arena.allocate
        self._unowned, self._pointer = cp.cuda.memory.UnownedMemory, cp.cuda.MemoryPointer
        self.state = ArenaState.OPEN

    @classmethod
    def from_free_memory(cls, fraction: float, **slabs: int) -> DeviceArena:
        """An arena of ``fraction`` of the device's free memory now (``cudaMemGetInfo``)."""
        from scratchd.kernels._cuda import cupy

        free, _ = cupy().cuda.runtime.memGetInfo()
        return cls(int(free * fraction), **slabs)

    def malloc(self, size: int) -> Any:
        """A ``cupy.cuda.MemoryPointer`` to ``size`` bytes; the CuPy allocator interface."""
        if self.state is not ArenaState.OPEN:
            raise ArenaError("device arena is closed")
        if self._runtime.getDevice() != self.device_id:
            raise ArenaError(f"arena of device {self.device_id} asked from another device")
        stream = self._current_stream()
        reserved = self._reserved(size)
        offset = self._allocate(size, stream, reserved)
        block = _Block(self.arena, offset, reserved, self._current_stream)
        return self._pointer(self._unowned(self.base + offset, size, block, self.device_id), 0)

    __call__ = malloc

    def using(self) -> Any:
        """Context manager: CuPy allocates from this arena inside it (this thread)."""
        return self._cp.cuda.using_allocator(self.malloc)

    def install(self) -> None:
        """Make this arena CuPy's allocator for this thread and the ones it starts."""
        self._cp.cuda.set_allocator(self.malloc)

    def fragmentation_ratio(self) -> float:
        """``(free − largest free block) / total`` now; what the CUDA worker reports."""
        return self.arena.fragmentation_ratio()

    def stats(self) -> ArenaStats:
        return self.arena.collect()

    def close(self) -> None:
        """Give the region back; refuses while any block is still in use."""
        if self.state is ArenaState.CLOSED:
            return
        self.arena.synchronize()
        used = self.arena.offsets.used
        if used:
            raise ArenaError(f"cannot close the device arena: {used} bytes still in use")
        self._runtime.free(self.base)
        self.state = ArenaState.CLOSED

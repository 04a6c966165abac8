"""The offset allocator under the device arena (``arena.py``): a binary buddy allocator for
large blocks and slabs for small ones, over byte offsets into one region. Pure Python, no
CUDA: fully tested on the CPU.

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

A double free raises :class:`InvalidFree`; a block freed twice after being reused by someone
else cannot be told apart (as with any malloc).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

ALIGN_SHIFT = 8
ALIGN = 1 << ALIGN_SHIFT  # 256 bytes; CuPy's allocation granularity is a multiple of it
SMALL_MAX = 64 << 10  # largest request served from a slab
SLAB_BYTES = 1 << 20  # one slab, carved from one buddy block
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
        self.total, self.high_water = total, 0
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
        return offset

    def release(self, offset: int, order: int) -> None:
        """Give a block back, merging it with its free buddies."""
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
            return ALIGN << order_of(size)
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

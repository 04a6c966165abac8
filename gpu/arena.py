"""Device memory from one arena: a binary buddy allocator for large blocks, slabs for small ones,
stream-ordered reuse, plugged into CuPy as its allocator.

Three layers, each usable alone:

- :class:`~scratchd.gpu.offset_arena.OffsetArena` (``offset_arena.py``, where the buddy
  tree, the trimmed blocks, the slabs and the fragmentation ratio are drawn) — pure Python
  over byte offsets into one region (no CUDA): the buddy allocator and the slabs. Fully
  tested on the CPU.
- :class:`StreamOrderedArena` — adds stream-ordered reuse on top: freed blocks wait behind a
  CUDA event before anyone else may have them. Events come from a factory, so the rules are
  tested on the CPU with hand-driven events.
- :class:`DeviceArena` — takes the region with ``cudaMalloc`` once and serves
  ``cupy.cuda.set_allocator(arena.malloc)`` / ``cupy.cuda.using_allocator(arena.malloc)``.

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
takes no lock.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from scratchd.gpu.offset_arena import (
    ALIGN,
    ArenaError,
    ArenaExhausted,
    ArenaStats,
    OffsetArena,
)
from scratchd.kernels._cuda import cupy

SEAL_BLOCKS, SEAL_BYTES = 32, 1 << 20  # a stream's frees get an event at either count
RETIRE_INTERVAL_NS = 20_000  # the allocation path asks the events at most this often


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

"""The device memory arena: stream-ordered reuse, and (gpu-marked) CuPy arrays served from it.
The offset allocator under it is tested in ``test_offset_arena.py``.

The stream-ordering tests on the CPU drive events by hand (``HandEvent``: ``done`` only when the
test says so), which is exactly the information a CUDA event gives the arena.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from scratchd.gpu.arena import SEAL_BLOCKS, DeviceArena, StreamOrderedArena
from scratchd.gpu.offset_arena import ALIGN, ArenaExhausted

from ..kernels.cuda_helpers import cupy

# ---------------------------------------------------------------- stream-ordered reuse


@dataclass(frozen=True)
class Stream:
    ptr: int


class HandEvent:
    """An event the test completes by hand; ``synchronize`` completes it (as CUDA's would)."""

    def __init__(self) -> None:
        self.done = False
        self.stream: Stream | None = None
        self.waited = 0

    def record(self, stream: Any = None) -> None:
        self.done, self.stream = False, stream

    def synchronize(self) -> None:
        self.done, self.waited = True, self.waited + 1


def make_arena(total: int = 1 << 20) -> tuple[StreamOrderedArena, list[HandEvent]]:
    events: list[HandEvent] = []

    def new_event() -> HandEvent:
        events.append(HandEvent())
        return events[-1]

    return StreamOrderedArena(total, new_event, small_max=0), events


A, B = Stream(0xA), Stream(0xB)


def test_a_block_freed_on_one_stream_waits_for_its_event_before_another_stream_gets_it() -> None:
    arena, events = make_arena()
    x = arena.allocate(4096, A)
    arena.release(x, 4096, A)
    y = arena.allocate(4096, B)  # A's work may still read x: B must not get it
    assert y != x
    z = arena.allocate(4096, A)  # A's own later work runs after the free in stream order
    assert z == x
    arena.release(z, 4096, A)
    arena.collect()  # seals A's batch: one event recorded on A
    assert [e.stream for e in events] == [A]
    assert arena.allocate(4096, B) not in (x, y)
    events[0].done = True
    arena.collect()
    assert arena.allocate(4096, B) == x  # the event completed: any stream may have it now


def test_a_stream_seals_its_frees_behind_one_event_per_batch() -> None:
    arena, events = make_arena(64 << 20)
    blocks = [arena.allocate(4096, A) for _ in range(SEAL_BLOCKS)]
    for offset in blocks[:-1]:
        arena.release(offset, 4096, A)
    arena.allocate(ALIGN, B)  # drains: too few frees of A for an event yet
    assert events == []
    arena.release(blocks[-1], 4096, A)
    arena.allocate(ALIGN, B)  # the batch is full: one event on A for all of it
    assert [e.stream for e in events] == [A]
    assert arena.allocate(4096, B) not in blocks
    events[0].done = True
    assert arena.collect().used == 2 * ALIGN + 4096


def test_completed_events_return_blocks_and_are_recycled() -> None:
    arena, events = make_arena()
    for _ in range(100):
        offsets = [arena.allocate(size, A) for size in (1000, 70_000, 3 << 16)]
        for offset, size in zip(offsets, (1000, 70_000, 3 << 16), strict=True):
            arena.release(offset, arena.offsets.reserved(size), A)
        stats = arena.collect()
        assert stats.waiting == stats.used > 0
        for event in events:
            event.done = True
        assert arena.collect().used == 0
    assert len(events) == 1  # one event per drain, reused once completed
    assert list(arena.offsets.buddy.free_blocks()) == [(0, 1 << 20)]


def test_exhaustion_waits_on_pending_events_before_failing() -> None:
    arena, events = make_arena(8192)
    whole = arena.allocate(8192, A)
    arena.release(whole, 8192, A)
    assert arena.allocate(8192, B) == whole  # only by waiting for A's event
    assert events[0].waited == 1
    with pytest.raises(ArenaExhausted):
        arena.allocate(256, B)  # nothing is waiting: a real exhaustion


def test_fragmentation_counts_waiting_blocks_as_used() -> None:
    arena, _ = make_arena(4 * ALIGN)
    blocks = [arena.allocate(ALIGN, A) for _ in range(4)]
    arena.release(blocks[1], ALIGN, A)
    arena.release(blocks[3], ALIGN, B)
    assert arena.fragmentation_ratio() == 0.0  # both still behind their events
    arena.synchronize()
    assert arena.fragmentation_ratio() == (2 * ALIGN - ALIGN) / (4 * ALIGN)


class ReuseMachine(RuleBasedStateMachine):
    """Random allocate / free / event completion on three streams. The safety rule checked on
    every allocation: a block last freed on another stream comes back only after an event
    recorded on that stream after the free has completed."""

    streams = (Stream(1), Stream(2), Stream(3))

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.records: list[tuple[Stream, int, HandEvent]] = []  # (stream, time, event)
        self.completed: set[int] = set()  # indices into records
        self.arena = StreamOrderedArena(1 << 16, self.new_event, small_max=1024, slab_bytes=4096)
        self.live: dict[int, tuple[Stream, int]] = {}  # offset → (stream, reserved)
        self.last_free: dict[int, tuple[Stream, int]] = {}  # offset → (stream, time)

    def new_event(self) -> HandEvent:
        machine = self

        class Logged(HandEvent):
            def record(self, stream: Any = None) -> None:
                super().record(stream)
                machine.clock += 1
                machine.records.append((stream, machine.clock, self))

            def synchronize(self) -> None:  # the arena's slow path waits on events
                super().synchronize()
                machine.complete(self)

        return Logged()

    def complete(self, event: HandEvent) -> None:
        event.done = True
        latest = max(i for i, r in enumerate(self.records) if r[2] is event)
        self.completed.add(latest)

    @rule(stream=st.sampled_from(streams), size=st.integers(0, 9000))
    def allocate(self, stream: Stream, size: int) -> None:
        try:
            offset = self.arena.allocate(size, stream)
        except ArenaExhausted:
            return
        freed = self.last_free.get(offset)
        if freed is not None and freed[0] != stream:
            assert any(
                s == freed[0] and t > freed[1] and i in self.completed
                for i, (s, t, _) in enumerate(self.records)
            ), f"block {offset} freed on {freed[0]} went to {stream} before an event completed"
        self.live[offset] = (stream, self.arena.offsets.reserved(size))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.sampled_from(streams))
    def free(self, data: st.DataObject, stream: Stream) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        _, reserved = self.live.pop(offset)
        self.clock += 1
        self.last_free[offset] = (stream, self.clock)
        self.arena.release(offset, reserved, stream)

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def an_event_completes(self, data: st.DataObject) -> None:
        self.complete(data.draw(st.sampled_from([r[2] for r in self.records])))

    @rule()
    def collect(self) -> None:
        stats = self.arena.collect()
        live = sum(reserved for _, reserved in self.live.values())
        assert stats.used == live + stats.waiting

    def teardown(self) -> None:
        for offset, (stream, reserved) in self.live.items():
            self.arena.release(offset, reserved, stream)
        self.arena.synchronize()
        stats = self.arena.collect()
        assert (stats.used, stats.waiting, stats.largest_free) == (0, 0, 1 << 16)


TestReuseMachine = ReuseMachine.TestCase
TestReuseMachine.settings = settings(max_examples=80, stateful_step_count=60)


# ---------------------------------------------------------------- CuPy (gpu)

SPIN_FILL = r"""
__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));  // volatile: the loop stays
    return t;
}

// Waits `ns` nanoseconds, then writes `value` to p[0, n).
extern "C" __global__ void spin_fill(unsigned char* p, long long n, long long ns,
                                     unsigned char value) {
    unsigned long long start = now_ns();
    while (now_ns() - start < (unsigned long long)ns) { }
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        p[i] = value;
}
"""


@pytest.mark.gpu
def test_cupy_arrays_from_the_arena_compute_correctly_and_come_back() -> None:
    cp = cupy()
    arena = DeviceArena(64 << 20)
    total = arena.arena.offsets.total
    with arena.using():
        a = cp.arange(100_000, dtype=cp.float64)
        m = cp.ones((300, 300), cp.float32) * 2 + cp.arange(300, dtype=cp.float32)
        small = [cp.full(i + 1, i, cp.int32) for i in range(300)]
        assert arena.base <= a.data.ptr < arena.base + total
        assert all(arena.base <= s.data.ptr < arena.base + total for s in small)
        assert float(a.sum()) == 100_000 * 99_999 / 2
        assert np.array_equal(cp.asnumpy(m), np.ones((300, 300)) * 2 + np.arange(300))
        assert [int(s.sum()) for s in small] == [i * (i + 1) for i in range(300)]
        assert arena.stats().used > 0
    del a, m, small
    cp.cuda.get_current_stream().synchronize()
    arena.arena.synchronize()
    stats = arena.stats()
    assert (stats.used, stats.largest_free, stats.fragmentation_ratio) == (0, total, 0.0)
    arena.close()


@pytest.mark.gpu
def test_cross_stream_reuse_waits_for_the_event() -> None:
    cp = cupy()
    arena = DeviceArena(64 << 20)
    spin = cp.RawKernel(SPIN_FILL, "spin_fill")
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    n = 1 << 20
    with arena.using():
        # Load every kernel used below first: a module loaded while the spin kernel runs
        # would wait for it (lazy loading) and end the window the test needs.
        warm = cp.empty(n, cp.uint8)
        spin((1,), (256,), (warm, np.int64(n), np.int64(0), np.uint8(7)))
        warm.fill(1)
        warm.fill(3)
        assert int((warm == 3).sum()) == n
        del warm
        cp.cuda.Device().synchronize()
        arena.arena.synchronize()
        with a:
            x = cp.empty(n, cp.uint8)
            ptr = x.data.ptr
            spin((1,), (256,), (x, np.int64(n), np.int64(500_000_000), np.uint8(7)))
            del x  # freed on A while A's kernel (≈ 0.5 s) still writes it
        with b:
            y = cp.empty(n, cp.uint8)
            y.fill(1)
        assert not a.done, "the spin kernel ended too soon for the test to mean anything"
        assert y.data.ptr != ptr
        with a:
            z = cp.empty(n, cp.uint8)  # same stream: runs after the spin kernel, safe
            z.fill(3)
        assert z.data.ptr == ptr
        a.synchronize()
        b.synchronize()
        assert int((y == 1).sum()) == n and int((z == 3).sum()) == n
        with a:
            del z
        arena.stats()  # drains z's free: its event is recorded on A
        a.synchronize()
        arena.stats()  # retires the completed event
        with b:
            w = cp.empty(n, cp.uint8)  # A's event has completed: B may have the block now
        assert w.data.ptr == ptr
    del y, w
    arena.arena.synchronize()
    arena.close()


@pytest.mark.gpu
def test_exhausted_arena_raises_a_memory_error_naming_the_request() -> None:
    cp = cupy()
    arena = DeviceArena(16 << 20)
    with arena.using(), pytest.raises(MemoryError, match=str(32 << 20)):
        cp.empty(32 << 20, cp.uint8)
    arena.close()

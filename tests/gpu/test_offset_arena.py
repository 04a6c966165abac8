"""The offset allocator under the device arena (buddy blocks and slabs) against a model of
its live blocks, and its accounting, trimming and fallbacks on hand-picked cases.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from scratchd.gpu.offset_arena import ALIGN, ArenaExhausted, InvalidFree, OffsetArena


class ArenaMachine(RuleBasedStateMachine):
    """Random allocate/free sequences checked against a dict of live blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = OffsetArena(ALIGN)
        self.live: dict[int, tuple[int, int]] = {}  # offset → (size asked, bytes reserved)
        self.freed: set[int] = set()

    @initialize(units=st.integers(1, 1024), slabs=st.booleans())
    def create(self, units: int, slabs: bool) -> None:
        small_max = 1024 if slabs else 0
        self.arena = OffsetArena(units * ALIGN, small_max=small_max, slab_bytes=4096)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        total = self.arena.total
        size = data.draw(st.one_of(st.integers(0, 1100), st.integers(0, total + ALIGN)))
        reserved = self.arena.reserved(size)
        try:
            offset = self.arena.allocate(size)
        except ArenaExhausted as exc:
            assert (exc.size, exc.free) == (size, total - self.arena.used)
            assert exc.largest == self.arena.buddy.largest_free() < reserved
            assert str(size) in str(exc) and str(exc.largest) in str(exc)
            return
        assert reserved >= max(size, 1) and reserved % ALIGN == 0
        assert offset % ALIGN == 0 and offset >= 0 and offset + reserved <= total
        for other, (_, other_reserved) in self.live.items():
            assert offset + reserved <= other or other + other_reserved <= offset, "overlap"
        self.live[offset] = (size, reserved)
        self.freed.discard(offset)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.arena.free(offset)
        del self.live[offset]
        self.freed.add(offset)

    @precondition(lambda self: self.freed - self.live.keys())
    @rule(data=st.data())
    def double_free_is_rejected(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.freed - self.live.keys())))
        with pytest.raises(InvalidFree):
            self.arena.free(offset)

    @rule(data=st.data())
    def foreign_pointer_is_rejected(self, data: st.DataObject) -> None:
        offset = data.draw(st.integers(-ALIGN, self.arena.total + ALIGN))
        if offset in self.live:
            offset += 1  # inside a live block, not its start
        with pytest.raises(InvalidFree):
            self.arena.free(offset)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        stats = self.arena.stats()
        used = sum(reserved for _, reserved in self.live.values())
        free_blocks = list(self.arena.buddy.free_blocks())
        assert stats.used == used and stats.free == stats.total - used
        assert stats.largest_free == max((size for _, size in free_blocks), default=0)
        assert stats.fragmentation_ratio == (stats.free - stats.largest_free) / stats.total
        assert 0.0 <= stats.fragmentation_ratio < 1.0
        assert sum(size for _, size in free_blocks) <= stats.free
        for start, size in free_blocks:  # a free block never covers a live one
            for offset, (_, reserved) in self.live.items():
                assert start + size <= offset or offset + reserved <= start

    def teardown(self) -> None:
        for offset in list(self.live):
            self.arena.free(offset)
        stats = self.arena.stats()
        assert stats.used == 0 and stats.slabs == {}
        roots = [(offset, ALIGN << order) for offset, order in self.arena.buddy.roots]
        assert list(self.arena.buddy.free_blocks()) == roots  # everything merged back


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=120, stateful_step_count=50)


def test_everything_freed_is_one_block_of_the_whole_region() -> None:
    arena = OffsetArena(1 << 20, small_max=4096, slab_bytes=16384)
    offsets = [arena.allocate(size) for size in (1, 255, 256, 3000, 5000, 70_000, 300_000)]
    for offset in reversed(offsets):
        arena.free(offset)
    assert list(arena.buddy.free_blocks()) == [(0, 1 << 20)]
    assert arena.fragmentation_ratio() == 0.0


def test_fragmentation_ratio_is_free_minus_largest_over_total() -> None:
    arena = OffsetArena(4 * ALIGN, small_max=0)
    blocks = [arena.allocate(ALIGN) for _ in range(4)]
    arena.free(blocks[0])
    arena.free(blocks[2])  # two free 256 B holes that are not buddies
    assert arena.fragmentation_ratio() == (2 * ALIGN - ALIGN) / (4 * ALIGN)
    arena.free(blocks[1])  # 0 and 1 merge; 2 stays apart
    stats = arena.stats()
    assert (stats.free, stats.largest_free) == (3 * ALIGN, 2 * ALIGN)
    assert stats.fragmentation_ratio == ALIGN / (4 * ALIGN)


def test_exhaustion_names_the_request_and_what_is_free() -> None:
    arena = OffsetArena(1 << 20, small_max=0)
    arena.allocate(400_000)  # from a 512 KiB block
    with pytest.raises(ArenaExhausted) as err:
        arena.allocate(600_000)
    assert isinstance(err.value, MemoryError)
    assert "600000 bytes" in str(err.value)  # 425984 used (1664 units), tail 98304 back
    assert "free 622592 bytes" in str(err.value) and "largest free block 524288" in str(err.value)


def test_small_requests_share_a_slab_that_goes_back_when_empty() -> None:
    arena = OffsetArena(1 << 20, small_max=4096, slab_bytes=16384)
    objects = [arena.allocate(200) for _ in range(64)]  # 64 × 256 B = exactly one slab
    assert arena.stats().slabs == {256: (1, 64)}
    assert sorted(objects) == list(range(objects[0], objects[0] + 64 * 256, 256))
    extra = arena.allocate(256)
    assert arena.stats().slabs == {256: (2, 65)}
    for offset in objects:
        arena.free(offset)
    assert arena.stats().slabs == {256: (1, 1)}
    arena.free(extra)
    assert arena.stats().slabs == {} and arena.stats().largest_free == 1 << 20


def test_small_requests_fall_back_to_buddy_blocks_when_no_slab_fits() -> None:
    arena = OffsetArena(16384, small_max=1024, slab_bytes=8192)
    arena.allocate(8192)  # half the region: one slab would still fit
    first = arena.allocate(100)  # takes the other half as a 256 B slab
    arena.free(first)
    big = arena.allocate(4096)
    small = arena.allocate(512)  # no 8 KiB block left for a slab: a 512 B buddy block
    assert arena.stats().slabs == {}
    arena.free(small)
    arena.free(big)


def test_non_power_of_two_region_is_cut_into_roots() -> None:
    arena = OffsetArena(3 << 20, small_max=0)
    assert arena.buddy.roots == [(0, 13), (2 << 20, 12)]
    assert arena.fragmentation_ratio() == pytest.approx(1 / 3)
    with pytest.raises(ArenaExhausted):
        arena.allocate((2 << 20) + 1)


@given(st.lists(st.integers(0, 1 << 26), min_size=1, max_size=200))
def test_reserved_sizes_waste_little(sizes: list[int]) -> None:
    arena = OffsetArena(1 << 27)
    for size in sizes:
        reserved = arena.reserved(size)
        assert reserved >= max(size, 1) and reserved % ALIGN == 0
        if size <= arena.small_max:  # a slab class: the power of two that holds it
            assert reserved & (reserved - 1) == 0 and (reserved == ALIGN or reserved // 2 < size)
        else:  # four significant bits of 256-byte units
            assert reserved <= max(size * 1.125, size + ALIGN)


def test_every_small_size_takes_the_smallest_power_of_two_slab_class() -> None:
    arena = OffsetArena(1 << 27)
    for size in range(arena.small_max + 1):  # exhaustive: the random sizes above rarely land here
        reserved = arena.reserved(size)
        assert reserved & (reserved - 1) == 0 and reserved >= max(size, 1)
        assert reserved == ALIGN or reserved // 2 < size


def test_a_large_block_gives_its_tail_back() -> None:
    arena = OffsetArena(1 << 20, small_max=0)
    offset = arena.allocate(5 * ALIGN)  # a block of 8 units; 3 go back at once
    assert arena.stats().used == 5 * ALIGN
    assert [b for b in arena.buddy.free_blocks() if b[0] < 8 * ALIGN] == [
        (5 * ALIGN, ALIGN),
        (6 * ALIGN, 2 * ALIGN),
    ]
    assert arena.allocate(ALIGN) == 5 * ALIGN  # the tail serves the next request
    arena.free(offset)
    arena.free(5 * ALIGN)
    assert list(arena.buddy.free_blocks()) == [(0, 1 << 20)]

"""The receive budget and the body-buffer pool: grants stay within the budget (beyond it only
to break a wait in which every holder waits, by at most one frame), waiters are served first
come first served, every frame finishes whatever the order of arrivals, and a buffer the pool
gives back returns its pages."""

from __future__ import annotations

import asyncio
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.daemon.frontend.buffers import BODY_ROUND, KEEP_RESIDENT, BufferPool, ReceiveBudget
from scratchd.daemon.frontend.connection import HEAD_BYTES, Connection, ReadState

from .test_connection import FakeTransport, Recorder, open_connection


class Frame:
    """A frame being received in chunks as ``Connection`` asks for them."""

    def __init__(self, budget: ReceiveBudget, length: int, grants: list[int]) -> None:
        self.budget, self.length, self.grants = budget, length, grants
        self.got = self.granted = 0
        self.waiting = False

    def start(self, already: int) -> None:
        self.got = self.granted = min(already, self.length)
        self.budget.force(self, self.got)
        self.ask()

    def ask(self) -> None:
        if self.got == self.length:
            self.budget.release(self)
            return
        want = min(self.length, max(2 * self.granted, self.got + BODY_ROUND)) - self.granted
        if self.budget.ask(self, want):
            self.granted += want
        else:
            self.waiting = True

    def budget_granted(self, nbytes: int) -> None:
        self.grants.append(id(self))
        self.waiting = False
        self.granted += nbytes

    def receive(self) -> None:
        self.got = self.granted
        self.ask()


@given(
    limit=st.integers(1, 1 << 20),
    lengths=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=12),
    order=st.lists(st.integers(0, 1 << 16), max_size=400),
)
@settings(max_examples=200, deadline=None)
def test_every_frame_finishes_and_the_budget_is_exceeded_only_by_one_frame(
    limit: int, lengths: list[int], order: list[int]
) -> None:
    budget = ReceiveBudget(limit)
    grants: list[int] = []
    frames = [Frame(budget, n, grants) for n in lengths]
    for frame in frames:
        frame.start(HEAD_BYTES)
    peak = budget.used
    picks = iter(order)
    while active := [f for f in frames if f.got < f.length and not f.waiting]:
        active[next(picks, 0) % len(active)].receive()  # some sender's bytes arrive
        peak = max(peak, budget.used)
        held = sum(budget.held(f) for f in frames)
        assert budget.used == held
    assert all(f.got == f.length for f in frames), "a frame was left waiting for ever"
    assert budget.used == 0 and budget.waiting() == 0
    first = sum(min(HEAD_BYTES, n) for n in lengths)  # granted unasked
    assert peak <= limit + first + max(lengths)


def test_waiters_are_granted_in_arrival_order() -> None:
    budget = ReceiveBudget(4 * BODY_ROUND)
    grants: list[int] = []
    big, *queued = frames = [Frame(budget, 1 << 20, grants) for _ in range(4)]
    big.start(0)
    big.receive()
    big.receive()  # holds 4 chunks: the budget is full
    for frame in queued:
        frame.start(0)
    assert [f.waiting for f in queued] == [True] * 3
    while big.got < big.length:
        big.receive()
    assert grants[:3] == [id(f) for f in queued]
    assert budget.used == sum(budget.held(f) for f in frames)


def test_a_budget_needs_a_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        ReceiveBudget(0)


def test_a_pooled_buffer_keeps_only_its_first_pages() -> None:
    pool = BufferPool(keep=1)
    buf = pool.take(3 * KEEP_RESIDENT)
    assert len(buf) >= 3 * KEEP_RESIDENT
    buf[:] = b"\xff" * len(buf)
    pool.give(buf)
    again = pool.take(3 * KEEP_RESIDENT)
    assert again is buf
    # Pages beyond KEEP_RESIDENT were dropped: they read as zeros again; the kept ones not.
    assert again[KEEP_RESIDENT - 1] == 0xFF
    assert again[KEEP_RESIDENT:] == bytes(len(again) - KEEP_RESIDENT)
    pool.give(again)
    pool.give(pool.take(1))  # a fresh one: the pool is full, it is dropped (unmapped)
    assert len(pool._free) == 1


def deliver_paused(conns: list[tuple[Connection, FakeTransport, bytes]]) -> int:
    """Send every connection's bytes, a read at a time, round robin, skipping a connection
    whose transport is paused (as uvloop would), until all is sent or all are paused;
    returns the most connections seen paused at once."""
    sent = [0] * len(conns)
    most = 0
    while True:
        progress = False
        most = max(most, sum(t.paused for _, t, _ in conns))
        for k, (conn, transport, data) in enumerate(conns):
            if sent[k] == len(data) or transport.paused or conn.state is ReadState.CLOSED:
                continue
            buf = conn.get_buffer(-1)
            n = min(len(buf), len(data) - sent[k], 48 * 1024)
            buf[:n] = data[sent[k] : sent[k] + n]
            conn.buffer_updated(n)
            sent[k] += n
            progress = True
        if not progress:
            return most


def test_connections_over_the_budget_pause_and_resume_and_every_frame_arrives() -> None:
    async def run() -> None:
        handler = Recorder()
        handler.budget = ReceiveBudget(6 * BODY_ROUND)
        bodies = [bytes([k]) * (700_000 + k) for k in range(3)]
        opened = []
        for k, body in enumerate(bodies):
            conn, transport = open_connection(handler)
            conn.id = k
            opened.append((conn, transport, struct.pack(">I", len(body)) + body))
        assert deliver_paused(opened) == 2  # one receives at a time, the others wait
        assert sorted(handler.frames) == sorted(bodies)
        assert handler.budget.used == 0 and handler.budget.waiting() == 0
        assert not any(t.paused for _, t, _ in opened)

    asyncio.run(run())

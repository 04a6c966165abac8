"""The main process's free list (``_native.Core``: ``reserve``, ``push_free``, ``collect``):
whatever happens to the descriptors, and whatever is pushed onto the list, ``reserve`` hands
out exactly the FREE descriptors, each once between two frees, with its current generation,
and refuses only when no more than ``keep`` are FREE."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scratchd.ipc._native import Core
from scratchd.ipc.queue import DescState, Handle, RequestQueue, Result, Status
from tests.ipc.queue_helpers import GEOMETRY, SLOTS, shm_name

FAR = 10**15  # a deadline nobody reaches in a test


class FreeListMachine(RuleBasedStateMachine):
    """The model: each descriptor's generation and who holds it (free, reserved, queued)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = RequestQueue.create(shm_name(f"fl{id(self)}"), GEOMETRY)
        self.q.register_worker(0, os.getpid())
        self.generation = [0] * SLOTS
        self.reserved: dict[int, Handle] = {}
        self.queued: set[int] = set()
        self.rid = 0

    def teardown(self) -> None:
        self.q.close()

    def free(self) -> set[int]:
        return set(range(SLOTS)) - set(self.reserved) - self.queued

    @rule(keep=st.integers(0, SLOTS + 1))
    def reserve(self, keep: int) -> None:
        free = self.free()
        h = self.q.reserve(keep)
        if len(free) <= keep:
            assert h is None
            return
        assert isinstance(h, Handle)
        assert h.index in free, f"{h} was not FREE"
        assert h.generation == self.generation[h.index]
        self.reserved[h.index] = h

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.reserved:
            return
        i = data.draw(st.sampled_from(sorted(self.reserved)))
        self.q.release(self.reserved.pop(i))
        self.generation[i] += 1

    @rule(data=st.data(), past=st.booleans())
    def submit(self, data: st.DataObject, past: bool) -> None:
        if not self.reserved:
            return
        i = data.draw(st.sampled_from(sorted(self.reserved)))
        self.rid += 1
        deadline = time.monotonic_ns() - 1 if past else FAR
        self.q.submit(
            self.reserved.pop(i), request_id=self.rid, conn_id=1, priority=0, part_class=0,
            deadline_ns=deadline, height=2, width=2, want_mask=False,
        )  # fmt: skip
        self.queued.add(i)

    @rule()
    def expire(self) -> None:
        for c in self.q.expire_due(time.monotonic_ns()):
            self.queued.remove(c.handle.index)
            self.generation[c.handle.index] += 1

    @rule(n=st.integers(1, SLOTS))
    def serve(self, n: int) -> None:
        claims = self.q.claim_batch(0, n, time.monotonic_ns())
        for claim in claims:
            assert self.q.complete(0, claim, Result(Status.OK, batch_size=len(claims)))
        for c in self.q.collect_completed():
            self.queued.remove(c.handle.index)
            self.generation[c.handle.index] += 1

    @rule(index=st.integers(0, SLOTS - 1), times=st.integers(1, 2 * SLOTS))
    def push_anything(self, index: int, times: int) -> None:
        """A free list told wrong things (a descriptor in any state, many times over)."""
        for _ in range(times):
            self.q._core.native.push_free(index)

    @invariant()
    def states_match(self) -> None:
        states = self.q.counts_by_state()
        assert states[DescState.FREE] == len(self.free())
        assert states[DescState.WRITTEN] == len(self.reserved)


TestFreeList = FreeListMachine.TestCase
TestFreeList.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_reserve_hands_out_every_free_descriptor_once(queue: RequestQueue) -> None:
    handles = [queue.reserve() for _ in range(SLOTS)]
    assert sorted(h.index for h in handles if h is not None) == list(range(SLOTS))
    assert queue.reserve() is None
    for h in handles:
        assert h is not None
        queue.release(h)
    again = [queue.reserve() for _ in range(SLOTS)]
    assert [h.index for h in again if h is not None] == [h.index for h in handles if h]
    assert all(h is not None and h.generation == 1 for h in again)


def test_reserve_leaves_keep_free(queue: RequestQueue) -> None:
    held = [queue.reserve(2) for _ in range(SLOTS)]
    assert sum(h is not None for h in held) == SLOTS - 2
    assert queue.reserve(1) is not None and queue.reserve(1) is None
    assert queue.reserve() is not None and queue.reserve() is None


def test_a_handle_is_a_handle(queue: RequestQueue) -> None:
    h = queue.reserve()
    assert type(h) is Handle and h == Handle(h.index, h.generation)
    assert hash(h) == hash((h.index, h.generation))


def test_bad_arguments_are_refused(queue: RequestQueue) -> None:
    native = queue._core.native
    with pytest.raises(ValueError, match="negative"):
        native.reserve(-1)
    for index in (-1, SLOTS, 2**40):
        with pytest.raises((IndexError, OverflowError)):
            native.push_free(index)
    with pytest.raises(TypeError):
        native.push_free("0")  # type: ignore[arg-type]
    assert queue.counts_by_state()[DescState.FREE] == SLOTS  # nothing was taken


@pytest.mark.parametrize("handle", [int, dict, object(), type("Fat", (tuple,), {})])
def test_core_takes_only_a_plain_tuple_subclass_as_handle(handle: Any) -> None:
    buf = bytearray(1 << 16)
    with pytest.raises(TypeError, match="tuple subclass"):
        Core(buf, {}, None, handle)
    assert np.frombuffer(buf, np.uint8).sum() == 0  # refused before touching the buffer

"""The dispatcher's expiry timer, without workers: a queued request is answered ``timeout``
once, by its own deadline, even when an earlier deadline arrives after a later one armed
the timer."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from scratchd.daemon.frontend.dispatch import Dispatcher, InFlight
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Completion, Geometry, RequestQueue, Result, Status
from scratchd.protocol import wire


class FakeConn:
    """What the dispatcher uses of a connection: its id, its queued handles, ``send``."""

    def __init__(self) -> None:
        self.id = 1
        self.closed = False
        self.in_queue: set[object] = set()
        self.sent: list[tuple[int, wire.Reply]] = []  # (monotonic ns, reply)

    def send(self, reply: wire.Reply) -> None:
        self.sent.append((time.monotonic_ns(), reply))


@pytest.fixture
def queue() -> Iterator[RequestQueue]:
    q = RequestQueue.create(
        f"/scratchd-test-dispatch-{os.getpid()}", Geometry(slots=8, slot_bytes=64, tick_ms=1)
    )
    try:
        yield q
    finally:
        q.close()


def _enqueue(dispatcher: Dispatcher, conn: FakeConn, request_id: int, deadline_ms: int) -> int:
    queue = dispatcher.queue
    handle = queue.reserve()
    assert handle is not None
    received = time.monotonic_ns()
    flight = InFlight(conn, request_id, "normal", 0, received)  # type: ignore[arg-type]
    flight.handle, flight.deadline_ns = handle, received + deadline_ms * NS_PER_MS
    queue.submit(
        handle, request_id=request_id, conn_id=conn.id, priority=0, part_class=0,
        deadline_ns=flight.deadline_ns, height=8, width=8, want_mask=False,
    )  # fmt: skip
    dispatcher.enqueued(flight)
    return flight.deadline_ns


def test_an_earlier_deadline_queued_later_is_answered_by_its_own_deadline(
    queue: RequestQueue,
) -> None:
    accounted: list[tuple[int, str, Completion | None]] = []

    async def scenario() -> tuple[FakeConn, dict[int, int]]:
        dispatcher = Dispatcher(
            queue,
            NS_PER_MS,
            lambda f, r, c: accounted.append((f.request_id, r.status, c)),
            lambda _: None,
        )
        dispatcher.start()
        conn = FakeConn()
        try:
            deadlines = {1: _enqueue(dispatcher, conn, 1, 400)}  # arms the timer at 400 ms
            deadlines[2] = _enqueue(dispatcher, conn, 2, 10)  # must bring it forward
            await asyncio.wait_for(dispatcher.idle.wait(), 5.0)
        finally:
            dispatcher.stop()
        return conn, deadlines

    conn, deadlines = asyncio.run(scenario())
    assert [reply.id for _, reply in conn.sent] == [2, 1]
    assert all(reply.status == "timeout" for _, reply in conn.sent)
    (first_at, _), (second_at, _) = conn.sent
    # a tick early at most; not held back
    assert deadlines[2] - NS_PER_MS <= first_at < deadlines[1]
    assert second_at >= deadlines[1]
    assert sorted(rid for rid, _, _ in accounted) == [1, 2]  # each accounted exactly once


def test_a_result_that_arrives_after_its_deadline_is_answered_timeout_not_ok(
    queue: RequestQueue,
) -> None:
    """Deadlines hold: a worker's ``ok`` that reaches the dispatcher past the request's
    deadline goes out as ``timeout`` (saying by how much it was late); one in time as ``ok``.
    Each is accounted once, with the worker's completion, so metrics can count it as late."""
    accounted: list[tuple[int, str, Completion | None]] = []

    async def scenario() -> FakeConn:
        dispatcher = Dispatcher(
            queue, NS_PER_MS, lambda f, r, c: accounted.append((f.request_id, r.status, c)),
            lambda _: "w0",
        )  # fmt: skip
        dispatcher.start()
        conn = FakeConn()
        queue.register_worker(0, os.getpid())
        try:
            late_deadline = _enqueue(dispatcher, conn, 1, 50)
            _enqueue(dispatcher, conn, 2, 60_000)
            claims = queue.claim_batch(0, 2, time.monotonic_ns())
            assert [c.request_id for c in claims] == [1, 2]
            while time.monotonic_ns() <= late_deadline:  # the "compute" outlasts the deadline
                await asyncio.sleep(0.01)
            for c in claims:
                assert queue.complete(0, c, Result(Status.OK, score=0.5))
            await asyncio.wait_for(dispatcher.idle.wait(), 5.0)
        finally:
            dispatcher.stop()
        return conn

    conn = asyncio.run(scenario())
    replies = {reply.id: reply for _, reply in conn.sent}
    assert len(conn.sent) == 2
    assert replies[1].status == "timeout" and "after its deadline" in replies[1].error
    assert replies[1].timings.total_ms > 50  # the reply says when, the deadline was 50 ms
    assert replies[2].status == "ok" and replies[2].timings.total_ms <= 60_000
    statuses = {rid: (status, c.status if c else None) for rid, status, c in accounted}
    assert statuses == {1: ("timeout", Status.OK), 2: ("ok", Status.OK)}


def test_a_completion_while_the_loop_is_awake_is_answered_without_a_ring(
    queue: RequestQueue,
) -> None:
    """While the loop is awake (a request just queued) workers skip the doorbell; the look
    before the loop sleeps answers what finished meanwhile, then re-arms it, so the next
    completion rings as usual. Each request is answered once."""

    async def scenario() -> tuple[FakeConn, list[bool], int]:
        dispatcher = Dispatcher(queue, NS_PER_MS, lambda *_: None, lambda _: "w0")
        dispatcher.start()
        conn = FakeConn()
        queue.register_worker(0, os.getpid())
        armed: list[bool] = []
        bell = queue._core.completion
        assert bell is not None
        try:
            _enqueue(dispatcher, conn, 1, 60_000)  # the loop is awake: quiet
            armed.append(queue._core.native.completion_armed())
            (claim,) = queue.claim_batch(0, 1, time.monotonic_ns())
            assert queue.complete(0, claim, Result(Status.OK, score=0.5))  # rings nobody
            rung_while_quiet = bell.drain()
            await asyncio.sleep(0)  # the turn ends: the look answers it
            armed.append(queue._core.native.completion_armed())
            answered_by_look = len(conn.sent)
            _enqueue(dispatcher, conn, 2, 60_000)
            await asyncio.sleep(0)  # looked: nothing finished, armed again
            (claim,) = queue.claim_batch(0, 1, time.monotonic_ns())
            assert queue.complete(0, claim, Result(Status.OK, score=0.5))  # rings: wakes it
            await asyncio.wait_for(dispatcher.idle.wait(), 5.0)
            _enqueue(dispatcher, conn, 3, 60_000)  # quiet again: stopping re-arms it
        finally:
            dispatcher.stop()
        armed.append(queue._core.native.completion_armed())
        await asyncio.sleep(0)  # the look was cancelled: nothing collected after the stop
        assert answered_by_look == 1 and len(conn.sent) == 2
        return conn, armed, rung_while_quiet

    conn, armed, rung_while_quiet = asyncio.run(scenario())
    assert armed == [False, True, True]
    assert rung_while_quiet == 0
    assert [(reply.id, reply.status) for _, reply in conn.sent] == [(1, "ok"), (2, "ok")]

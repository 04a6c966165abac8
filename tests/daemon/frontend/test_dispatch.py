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
from scratchd.ipc.queue import Completion, Geometry, RequestQueue
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

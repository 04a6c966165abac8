"""A stream that can no longer be trusted (an oversized length prefix, a body that stalls) ends
its connection only after every request already accepted on it is answered: nothing more is
read, the queued and decoding requests get their replies, then one ``invalid`` reply with id 0
says why and the connection closes. Meanwhile it holds no receive memory (no head, no body
buffer, no budget, no lent slot) and keeps its connection place.
"""

from __future__ import annotations

import asyncio
import io
import socket
import time
from typing import Final

import numpy as np
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from scratchd.daemon.frontend.connection import HEAD_BYTES, Connection, ReadState
from scratchd.ipc.queue import DescState, Result, Status
from scratchd.protocol import wire

from .test_acceptor import PREFIX, SLOTS, FrontEnd
from .test_connection import deliver

STALL_MS: Final = 50


def _grey(request_id: int, side: int = 8) -> bytes:
    pixels = np.full((side, side), request_id % 251, np.uint8).tobytes()
    return bytes(
        wire.encode_frame(wire.InferRequest(id=request_id, pixels=pixels, height=side, width=side))
    )


def _png(request_id: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), 7, np.uint8)).save(buf, format="PNG")
    return bytes(wire.encode_frame(wire.InferRequest(id=request_id, encoded=buf.getvalue())))


def _replies(written: list[bytes] | bytes) -> list[wire.Reply]:
    data = b"".join(written) if isinstance(written, list) else written
    replies = []
    while data:
        n = wire.frame_length(data[:4])
        reply = wire.decode_daemon_message(data[4 : 4 + n])
        assert isinstance(reply, wire.Reply)
        replies.append(reply)
        data = data[4 + n :]
    return replies


def _serve_queued(front: FrontEnd) -> int:
    claims = front.queue.claim_batch(0, SLOTS, time.monotonic_ns())
    for claim in claims:
        front.queue.complete(0, claim, Result(Status.OK, score=0.5))
    front.dispatcher.collect()
    return len(claims)


async def _until(condition: object, what: str) -> None:
    """Let the loop run until ``condition()`` holds (timers and threads need turns)."""
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def _holds_no_receive_memory(front: FrontEnd, conn: Connection) -> None:
    assert conn.state is ReadState.ENDING
    assert front.acceptor.budget.held(conn) == 0 and front.acceptor.budget.used == 0
    assert front.acceptor.lent == 0
    assert conn._body is None and len(conn._head_view) == 0
    assert len(front.acceptor.places) == 1  # it keeps its place until it closes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    queued=st.integers(1, 5),
    decoding=st.integers(0, 2),
    how=st.sampled_from(["oversized", "stalled in head", "in a body", "in a slot"]),
    cut=st.integers(0, 3),
)
def test_requests_in_flight_are_answered_before_the_reason_and_the_close(
    queued: int, decoding: int, how: str, cut: int
) -> None:
    async def run() -> None:
        front = FrontEnd(frame_timeout_ms=STALL_MS)
        try:
            conn, transport = front.connect()
            accepted = [_grey(i) for i in range(1, queued + 1)]
            accepted += [_png(100 + i) for i in range(decoding)]
            if how == "oversized":
                bad = PREFIX.pack(front.acceptor.max_frame + 1)
            elif how == "stalled in head":
                bad = PREFIX.pack(1000) + b"\x81"
            elif how == "in a body":  # encoded: received into a pool buffer
                png = b"\x89PNG\r\n\x1a\n" + bytes(3 * HEAD_BYTES)
                bad = bytes(wire.encode_frame(wire.InferRequest(id=999, encoded=png)))
                bad = bad[: 2 * HEAD_BYTES]
            else:  # raw grey: received into a lent slot
                bad = _grey(999, side=300)[: HEAD_BYTES + 1000]
            data = b"".join(accepted) + bad
            deliver(conn, data, [len(data) - cut] if cut else [])
            await _until(lambda: conn.state is ReadState.ENDING, "the stream ends")
            _holds_no_receive_memory(front, conn)
            assert transport.paused and not transport.closed
            await front.acceptor.wait_for_decodes()
            assert _serve_queued(front) == queued + decoding
            await _until(lambda: transport.closed, "the connection closes")
            replies = _replies(transport.written)
            assert sorted(r.id for r in replies[:-1]) == sorted(
                [*range(1, queued + 1), *range(100, 100 + decoding)]
            )
            assert all(r.status == "ok" for r in replies[:-1])
            last = replies[-1]
            assert (last.id, last.status) == (0, "invalid")
            why = "exceeds the limit" if how == "oversized" else f"within {STALL_MS} ms"
            assert why in last.error and "closing the connection" in last.error
            assert conn.closed and len(front.acceptor.places) == 0
            assert front.queue.counts_by_state()[DescState.FREE] == SLOTS
        finally:
            await front.close()

    asyncio.run(run())


def test_a_peer_that_leaves_while_its_connection_ends_frees_its_requests() -> None:
    async def run() -> None:
        front = FrontEnd()
        try:
            conn, transport = front.connect()
            deliver(conn, _grey(1) + _grey(2) + PREFIX.pack(2**32 - 1), [])
            assert conn.state is ReadState.ENDING and len(front.dispatcher.pending) == 2
            conn.connection_lost(ConnectionResetError())
            assert conn.closed and not front.dispatcher.pending
            assert front.queue.counts_by_state()[DescState.FREE] == SLOTS
            assert _serve_queued(front) == 0
            await asyncio.sleep(0)
            assert transport.written == []  # nobody to answer
        finally:
            await front.close()

    asyncio.run(run())


def test_a_connection_ending_with_nothing_in_flight_closes_at_once() -> None:
    async def run() -> None:
        front = FrontEnd()
        try:
            conn, transport = front.connect()
            deliver(conn, PREFIX.pack(2**31), [])
            assert transport.closed and conn.state is ReadState.CLOSED
            (reply,) = _replies(transport.written)
            assert (reply.id, reply.status) == (0, "invalid")
        finally:
            await front.close()

    asyncio.run(run())


@pytest.mark.parametrize("receive_threads", [0, 2])
def test_a_frame_stalled_in_its_lent_slot_over_a_socket(receive_threads: int) -> None:
    """On uvloop, over a real socket: a large raw frame being received into a lent slot (by a
    receive thread or on the loop) stalls; its slot goes back at once, the request queued
    before it is answered, then the reason, then EOF."""

    async def run() -> None:
        front = FrontEnd(frame_timeout_ms=STALL_MS, receive_threads=receive_threads)
        loop = asyncio.get_running_loop()
        try:
            conn, client = await front.connect_socket()
            big = _grey(2, side=300)
            await loop.sock_sendall(client, _grey(1) + big[: len(big) // 2])
            await _until(lambda: conn.state is ReadState.ENDING, "the frame stalls")
            await _until(lambda: front.acceptor.lent == 0, "the slot goes back")
            assert _serve_queued(front) == 1
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 30.0):
                received += chunk
            client.close()
            first, last = _replies(received)
            assert (first.id, first.status) == (1, "ok")
            assert (last.id, last.status) == (0, "invalid") and "not received" in last.error
            assert front.queue.counts_by_state()[DescState.FREE] == SLOTS
        finally:
            await front.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


def test_a_connection_ending_reads_nothing_more_over_a_socket() -> None:
    """Bytes sent after the bad prefix stay in the socket: never read, never answered."""

    async def run() -> None:
        front = FrontEnd()
        loop = asyncio.get_running_loop()
        try:
            conn, client = await front.connect_socket()
            after = b"".join(_grey(i) for i in range(10, 14))
            await loop.sock_sendall(client, _grey(1) + PREFIX.pack(2**32 - 1) + after)
            await _until(lambda: conn.state is ReadState.ENDING, "the stream ends")
            for _ in range(20):
                await asyncio.sleep(0)
            assert len(front.dispatcher.pending) == 1  # the bytes after it were not read
            assert _serve_queued(front) == 1
            received = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 30.0):
                received += chunk
            client.shutdown(socket.SHUT_RDWR)
            client.close()
            assert [(r.id, r.status) for r in _replies(received)] == [(1, "ok"), (0, "invalid")]
        finally:
            await front.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())

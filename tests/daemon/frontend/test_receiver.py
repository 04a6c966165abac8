"""Large raw frames received by a receive thread (``daemon/frontend/receiver.py``), over real
sockets on
uvloop as the daemon runs: every frame reaches the handler as the same message the on-loop
path gives, the slot goes back exactly once whatever ends a receive (the peer leaving, the loop
closing the connection, the transport aborting, the stall timer), the thread lets go of the
socket (the peer sees the close) and frame_timeout_ms still cuts off a stalled frame."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.daemon.frontend import receiver as receiver_module
from scratchd.daemon.frontend.connection import (
    HEAD_BYTES,
    SCAN_BYTES,
    Connection,
    ReadState,
    SlotLoan,
)
from scratchd.daemon.frontend.receiver import (
    MAX_WAIT_S,
    MIN_BYTES,
    PoolState,
    ReceiveJob,
    ReceivePool,
)
from scratchd.ipc._native import recv_into_exact

from .test_connection import Lender, decoded, frame_bodies, frame_mixes, framed, raw_body


def run_uvloop(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


class Counting(Lender):
    """A Lender with a receive pool (or none) that notes each job's size and slot returns."""

    def __init__(self, threads: int, max_wait_s: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.returned: list[int] = []
        self.job_bytes: list[int] = []  # pixels each job was given to receive
        if threads:
            pool = ReceivePool(threads)
            pool.min_bytes = 1  # every lent frame with pixels still to come goes to a thread
            pool.max_wait_s = max_wait_s  # 10 s: a job keeps its thread until its frame stalls
            receive = pool.receive

            def counting(
                fd: int,
                into: memoryview,
                done: Callable[[int], None],
                after: memoryview | None = None,
            ) -> ReceiveJob | None:
                job = receive(fd, into, done, after)
                self.job_bytes.append(len(into))
                return job

            pool.receive = counting  # type: ignore[method-assign]
            self.receiver = pool

    @property
    def jobs(self) -> int:
        """Jobs its pool started (ReceivePool.jobs); 0 without a pool."""
        return self.receiver.jobs if self.receiver is not None else 0

    def return_slot(self, loan: SlotLoan) -> None:
        self.returned.append(loan.handle.index)
        super().return_slot(loan)


async def connect(handler: Lender) -> tuple[Connection, socket.socket]:
    """A Connection on one end of a socketpair (as the acceptor's server makes them); the
    test is the client on the other end."""
    daemon_end, client = socket.socketpair()
    loop = asyncio.get_running_loop()
    _, conn = await loop.connect_accepted_socket(lambda: Connection(1, handler), daemon_end)
    client.setblocking(False)
    return conn, client


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    stop = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < stop, "timed out"
        await asyncio.sleep(0.001)


async def send(client: socket.socket, data: bytes, cuts: list[int]) -> None:
    """Send ``data`` in pieces split at ``cuts``, each given a moment to arrive on its own."""
    loop = asyncio.get_running_loop()
    edges = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for lo, hi in itertools.pairwise(edges):
        await loop.sock_sendall(client, data[lo:hi])
        await asyncio.sleep(0.0005)


async def receive_all(
    bodies: list[bytes], cuts: list[int], threads: int, lend: bool, take: bool
) -> Counting:
    handler = Counting(threads, lend=lend, take=take)
    conn, client = await connect(handler)
    try:
        await send(client, framed(bodies), cuts)
        await until(lambda: len(handler.messages) == len(bodies))
        assert handler.events == [] and conn.state is ReadState.HEAD
    finally:
        client.close()
        await conn.wait_closed(5.0)
        if handler.receiver is not None:
            await handler.receiver.wait_idle()
            handler.receiver.shutdown()
    return handler


@settings(max_examples=25, deadline=None)
@given(
    frames=frame_mixes(5),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=8),
    lend=st.booleans(),
    take=st.booleans(),
    seed=st.integers(0, 255),
)
def test_frames_received_by_threads_arrive_as_on_the_loop(
    frames: list[tuple[str, int]], cuts: list[int], lend: bool, take: bool, seed: int
) -> None:
    bodies = frame_bodies(frames, seed)
    expected = [decoded(b) for b in bodies]

    async def main() -> None:
        on_loop = await receive_all(bodies, cuts, 0, lend, take)
        threaded = await receive_all(bodies, cuts, 2, lend, take)
        assert on_loop.messages == threaded.messages == expected
        if not take:  # not taken: the body reaches frame() exactly as it was sent
            assert on_loop.frames == threaded.frames == bodies
        for handler in (on_loop, threaded):
            assert handler.out == {}  # every slot taken or returned ...
            assert len(handler.returned) == len(set(handler.returned))  # ... once
            assert handler.events == [("closed", 1)]
        # Whether a lent frame's rest goes to a thread depends on how much of it the sender
        # has pushed into the socket when the loop looks (a thread never waits for a sender),
        # so only what holds whatever the timing is asserted here; the thread path itself is
        # the next test's, with frames too big for one read.
        assert on_loop.jobs == 0
        if not lend:
            assert threaded.jobs == 0

    run_uvloop(main)


def test_after_a_frame_received_off_the_loop_the_next_ones_pixels_are_left_to_a_thread() -> None:
    """The first large frame's first read fills head (64 KiB, its pixels copied on the loop);
    after a frame received off the loop, the next read asks for PEEK_BYTES only, so all but
    the first SCAN_BYTES of the next frame's body go to a thread; after a small frame, reads
    take all of head again."""

    async def main() -> None:
        handler = Counting(2)
        n = 8 * HEAD_BYTES
        bodies = [raw_body(n, 1), raw_body(n, 2), b"small", raw_body(n, 3)]
        conn, client = await connect(handler)
        loop = asyncio.get_running_loop()
        # Each sendall's first send() queues 200 KiB or so before the loop reads: full reads.
        await loop.sock_sendall(client, framed(bodies[:2]))
        await until(lambda: len(handler.messages) == 2)
        await loop.sock_sendall(client, framed(bodies[2:]))
        await until(lambda: len(handler.messages) == len(bodies))
        assert handler.messages == [decoded(b) for b in bodies]
        first, second, after_small = handler.job_bytes
        assert first < n - HEAD_BYTES + 100  # head's worth went through the loop
        assert second > n - SCAN_BYTES  # only what the peek read
        assert after_small < n - HEAD_BYTES + 100  # a small frame between: head is read whole
        client.close()
        await conn.wait_closed(5.0)
        assert handler.receiver is not None
        handler.receiver.shutdown()

    run_uvloop(main)


def test_a_sender_that_pauses_mid_frame_has_its_thread_back_at_once() -> None:
    """With the pool's own max_wait_s (0) a job copies what is there and hands the frame back;
    the rest, sent later, arrives through the loop or another job; the frame is whole."""

    async def main() -> None:
        handler = Counting(2, max_wait_s=MAX_WAIT_S)
        assert handler.receiver is not None
        conn, client = await connect(handler)
        body = raw_body(4 * HEAD_BYTES, 4)
        frame = framed([body])
        await send(client, frame[: 2 * HEAD_BYTES], [])
        await until(lambda: handler.jobs == 1)
        await until(lambda: handler.receiver is not None and handler.receiver.in_flight == 0)
        assert conn.state is ReadState.SLOT and len(handler.out) == 1  # still lent, not cut off
        await send(client, frame[2 * HEAD_BYTES :], [HEAD_BYTES])
        await until(lambda: len(handler.messages) == 1)
        assert handler.messages == [decoded(body)] and handler.jobs >= 1
        assert handler.out == {} and handler.returned == [] and handler.events == []
        client.close()
        await conn.wait_closed(5.0)
        handler.receiver.shutdown()

    run_uvloop(main)


def test_a_job_never_waits_for_bytes_not_yet_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job is started with no time to wait (a mutant that waits for the sender fails
    here), and a slow sender's rest is received as it comes: frames whole, slots back."""
    timeouts: list[int] = []

    def spy(fd: int, into: Any, timeout_ms: int, cancel: Any, after: Any = None) -> Any:
        timeouts.append(timeout_ms)
        return recv_into_exact(fd, into, timeout_ms, cancel, after)

    monkeypatch.setattr(receiver_module, "recv_into_exact", spy)

    async def main() -> None:
        pool = ReceivePool(2)
        assert pool.max_wait_s == 0 and pool.min_bytes == MIN_BYTES
        handler = Counting(0)
        handler.receiver = pool
        conn, client = await connect(handler)
        bodies = [raw_body(6 * HEAD_BYTES, 6), raw_body(6 * HEAD_BYTES, 7)]
        frame = framed(bodies)
        half = len(frame) // 2
        await asyncio.get_running_loop().sock_sendall(client, frame[:half])  # a burst ...
        for lo in range(half, len(frame), 16 * 1024):  # ... then 16 KiB pieces, 2 ms apart
            await asyncio.sleep(0.002)
            await asyncio.get_running_loop().sock_sendall(client, frame[lo : lo + 16 * 1024])
        await until(lambda: len(handler.messages) == 2)
        assert handler.messages == [decoded(b) for b in bodies]
        assert timeouts and set(timeouts) == {0} and pool.jobs == len(timeouts)
        assert handler.out == {} and handler.returned == []
        client.close()
        await conn.wait_closed(5.0)
        await pool.wait_idle()
        pool.shutdown()

    run_uvloop(main)


def test_slow_senders_hold_no_thread_while_a_fast_frame_waits() -> None:
    """One thread; four connections stop mid-frame, each with a burst of its frame already
    sent (so each is handed to the thread); a fifth then sends a whole frame. Every slow job
    gives the thread back while its frame is still incomplete (no job in flight, the four
    still lent, not cut off), so the fast frame is served beside them. That no job waits at
    all is test_a_job_never_waits_for_bytes_not_yet_sent's (no wall-clock bound here)."""

    async def main() -> None:
        handler = Counting(1, max_wait_s=MAX_WAIT_S)
        pool = handler.receiver
        assert pool is not None
        pool.min_bytes = MIN_BYTES
        slow_body, fast_body = raw_body(8 * HEAD_BYTES, 8), raw_body(4 * HEAD_BYTES, 9)
        slow = [await connect(handler) for _ in range(4)]
        fast_conn, fast = await connect(handler)
        loop = asyncio.get_running_loop()
        for _, client in slow:  # prefix, scan bytes and 3 x 64 KiB more: worth a thread
            client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # all sent at once
            await loop.sock_sendall(client, framed([slow_body])[: 4 * HEAD_BYTES])
        await until(lambda: handler.jobs == 4)
        await until(lambda: pool.in_flight == 0)  # the thread is free, the frames unfinished
        assert all(conn.state is ReadState.SLOT for conn, _ in slow)  # still lent, not cut off
        await loop.sock_sendall(fast, framed([fast_body]))
        await until(lambda: len(handler.messages) == 1)
        assert handler.messages == [decoded(fast_body)]
        assert all(conn.state is ReadState.SLOT for conn, _ in slow)
        for conn, client in [*slow, (fast_conn, fast)]:
            client.close()
            await conn.wait_closed(5.0)
        await pool.wait_idle()
        assert handler.out == {} and sorted(handler.returned) == [1, 2, 3, 4]
        pool.shutdown()

    run_uvloop(main)


def test_a_frame_that_fails_after_its_receive_closes_the_connection_and_returns_the_slot() -> None:
    """As uvloop closes a connection whose buffer_updated raises (the on-loop path)."""

    async def main() -> None:
        handler = Counting(2, take=False)

        def no_memory(n: int) -> NoReturn:
            raise MemoryError

        handler.pool.take = no_memory  # type: ignore[method-assign]
        conn, client = await connect(handler)
        await send(client, framed([raw_body(4 * HEAD_BYTES, 5)]), [])
        await until(lambda: conn.gone.done())
        assert handler.jobs == 1 and handler.returned == [1] and handler.out == {}
        assert handler.events == [("closed", 1)]
        await await_peer_close(client)
        assert handler.receiver is not None
        handler.receiver.shutdown()

    run_uvloop(main)


def test_a_frame_stalled_in_a_receive_thread_is_cut_off_and_its_slot_returned_once() -> None:
    async def main() -> None:
        handler = Counting(2, timeout_s=0.1)
        _conn, client = await connect(handler)
        frame = framed([raw_body(4 * HEAD_BYTES, 2)])
        await send(client, frame[: 2 * HEAD_BYTES], [SCAN_BYTES])
        await until(lambda: handler.jobs == 1)
        assert handler.receiver is not None and handler.receiver.in_flight == 1
        await until(lambda: handler.events != [], 2.0)  # the loop's stall timer, not the thread's
        assert handler.events == [("stalled", len(frame) - 4), ("closed", 1)]
        await until(lambda: handler.receiver is not None and handler.receiver.in_flight == 0, 0.5)
        assert handler.returned == [1] and handler.out == {}
        await await_peer_close(client)
        handler.receiver.shutdown()

    run_uvloop(main)


def test_a_frame_stalled_after_its_thread_let_go_is_cut_off_and_its_slot_returned_once() -> None:
    """With the pool's own max_wait_s the thread lets go at once; the loop's stall timer
    still cuts the frame off, and the slot goes back exactly once."""

    async def main() -> None:
        handler = Counting(2, max_wait_s=MAX_WAIT_S, timeout_s=0.1)
        conn, client = await connect(handler)
        frame = framed([raw_body(4 * HEAD_BYTES, 3)])
        await send(client, frame[: 2 * HEAD_BYTES], [])
        await until(lambda: handler.jobs == 1)
        await until(lambda: handler.events != [], 2.0)
        assert handler.events == [("stalled", len(frame) - 4), ("closed", 1)]
        assert handler.returned == [1] and handler.out == {}
        await await_peer_close(client)
        await until(lambda: conn.gone.done())
        assert handler.receiver is not None and handler.receiver.in_flight == 0
        handler.receiver.shutdown()

    run_uvloop(main)


async def await_peer_close(client: socket.socket) -> None:
    """Until the daemon's end is closed (no descriptor of it left open, the thread's dup
    included): the client reads the reply sent before the close, then EOF; a read that
    waits 2 s for either fails the test (TimeoutError)."""
    loop = asyncio.get_running_loop()
    try:
        while await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 2.0):
            pass
    except ConnectionResetError:
        pass
    client.close()


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_a_connection_gone_mid_receive_returns_its_slot_once_after_the_thread() -> None:
    for how in ["peer closed", "loop closed", "transport aborted"]:

        async def main(how: str = how) -> None:
            handler = Counting(2)
            sockets_before = open_sockets()
            conn, client = await connect(handler)
            frame = framed([raw_body(4 * HEAD_BYTES, 3)])
            await send(client, frame[: HEAD_BYTES + 5000], [])
            await until(lambda: handler.jobs == 1)
            assert handler.receiver is not None and handler.receiver.in_flight == 1
            assert handler.returned == []  # the thread may be writing into it
            if how == "peer closed":
                client.close()
            elif how == "loop closed":
                conn.close()
            else:
                assert conn.transport is not None
                conn.transport.abort()
            await until(lambda: conn.gone.done() and handler.returned != [])
            await handler.receiver.wait_idle()
            assert handler.returned == [1] and handler.out == {} and handler.messages == []
            assert ("closed", 1) in handler.events
            if how != "peer closed":
                await await_peer_close(client)
            handler.receiver.shutdown()
            await until(lambda: open_sockets() == sockets_before, 1.0)  # the dup is closed

        run_uvloop(main)


def test_the_pool_refuses_jobs_it_cannot_run_and_ends_its_threads() -> None:
    async def main() -> None:
        pool = ReceivePool(2)
        done: list[int] = []
        assert pool.state is PoolState.NEW and pool.native_ids() == []
        assert pool.receive(-1, memoryview(bytearray(4)), done.append) is None  # no dup
        assert pool.state is PoolState.NEW and pool.in_flight == 0
        a, b = socket.socketpair()
        b.sendall(b"abcd")
        buf = bytearray(4)
        assert pool.receive(a.fileno(), memoryview(buf), done.append) is not None
        assert pool.state is PoolState.RUNNING and len(pool.native_ids()) == 2
        await pool.wait_idle()
        assert done == [4] and buf == b"abcd"
        pool.shutdown()
        assert pool.state is PoolState.STOPPED and pool.native_ids() == []
        assert pool.receive(a.fileno(), memoryview(buf), done.append) is None
        a.close()
        b.close()

    run_uvloop(main)

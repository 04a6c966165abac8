"""The connection's frame reader: whatever way the bytes arrive (split anywhere, many frames in
one read, frames larger and smaller than the head buffer), every frame reaches the acceptor
whole, once, in order; the cap, the stall timer and refusals behave as the acceptor relies on.

The transport is played by the test: it asks for a buffer (``get_buffer``), writes at most
that many bytes into it and reports them (``buffer_updated``), as uvloop's ``recv_into`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from scratchd.daemon.connection import HEAD_BYTES, BufferPool, Connection, ReadState
from scratchd.ipc import wire


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.eof_written = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.written.append(b"".join(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Recorder:
    """A FrameHandler that records what the connection hands it."""

    def __init__(self, max_frame: int = 1 << 22, timeout_s: float = 30.0) -> None:
        self.pool = BufferPool()
        self.max_frame = max_frame
        self.frame_timeout_s = timeout_s
        self.frames: list[bytes] = []
        self.events: list[tuple[str, int]] = []
        self.refusal: str | None = None
        self.reader: asyncio.StreamReader | None = None

    def opened(self, conn: Connection) -> str | None:
        return self.refusal

    def frame(self, conn: Connection, body: memoryview, received_ns: int) -> None:
        self.frames.append(bytes(body))

    def oversized(self, conn: Connection, length: int) -> None:
        self.events.append(("oversized", length))
        conn.close()

    def stalled(self, conn: Connection, length: int) -> None:
        self.events.append(("stalled", length))
        conn.close()

    def refused(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def closed(self, conn: Connection) -> None:
        self.events.append(("closed", conn.id))


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(b)) + b for b in bodies)


def deliver(conn: Connection, data: bytes, cuts: list[int], after_close: bool = False) -> None:
    """Send ``data`` in chunks split at ``cuts``, each chunk read as the transport would
    (which stops reading once the connection is closed, unless ``after_close``)."""
    edges = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    for lo, hi in itertools.pairwise(edges):
        while lo < hi and (after_close or conn.state is not ReadState.CLOSED):
            buf = conn.get_buffer(-1)
            n = min(len(buf), hi - lo)
            buf[:n] = data[lo : lo + n]
            conn.buffer_updated(n)
            lo += n


def open_connection(handler: Recorder) -> tuple[Connection, FakeTransport]:
    conn = Connection(1, handler)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


sizes = st.one_of(
    st.integers(0, 64),
    st.integers(HEAD_BYTES - 16, HEAD_BYTES + 16),  # around the head's capacity
    st.integers(HEAD_BYTES, 3 * HEAD_BYTES),
)


@given(
    lengths=st.lists(sizes, min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=12),
    seed=st.integers(0, 255),
)
def test_every_frame_arrives_whole_once_and_in_order(
    lengths: list[int], cuts: list[int], seed: int
) -> None:
    async def run() -> None:
        bodies = [bytes((seed + i + k) % 251 for k in range(n)) for i, n in enumerate(lengths)]
        handler = Recorder()
        conn, _ = open_connection(handler)
        deliver(conn, framed(bodies), cuts)
        assert handler.frames == bodies
        assert handler.events == []
        assert conn.state is ReadState.HEAD
        assert len(handler.pool._free) <= handler.pool.keep

    asyncio.run(run())


def test_body_buffers_are_reused_not_reallocated() -> None:
    async def run() -> None:
        handler = Recorder()
        conn, _ = open_connection(handler)
        bodies = [bytes([i]) * (300_000 + i) for i in range(5)]
        deliver(conn, framed(bodies), [])
        assert handler.frames == bodies
        assert len(handler.pool._free) == 1  # one buffer served all five frames

    asyncio.run(run())


def test_an_oversized_prefix_is_refused_before_its_body_and_ends_the_connection() -> None:
    async def run() -> None:
        handler = Recorder(max_frame=1000)
        conn, transport = open_connection(handler)
        deliver(conn, framed([b"ok", b"x" * 1001, b"never"]), [])
        assert handler.frames == [b"ok"]
        assert handler.events == [("oversized", 1001), ("closed", 1)]
        assert transport.closed and conn.state is ReadState.CLOSED

    asyncio.run(run())


def test_a_body_that_stalls_is_cut_off_and_a_whole_one_is_not() -> None:
    async def run() -> None:
        handler = Recorder(timeout_s=0.05)
        conn, transport = open_connection(handler)
        deliver(conn, framed([b"a" * 10]), [])
        await asyncio.sleep(0.1)
        assert handler.events == []  # whole in time: no timer left behind
        big = framed([b"b" * (2 * HEAD_BYTES)])
        deliver(conn, big[: HEAD_BYTES + 100], [])
        await asyncio.sleep(0.1)
        assert handler.events == [("stalled", 2 * HEAD_BYTES), ("closed", 1)]
        assert transport.closed
        assert len(handler.pool._free) == 1  # the half-filled body buffer went back

    asyncio.run(run())


def test_a_refused_peer_gets_one_error_reply_and_its_bytes_go_to_the_linger_reader() -> None:
    async def run() -> None:
        handler = Recorder()
        handler.refusal = "access denied"
        conn, transport = open_connection(handler)
        reply = wire.decode_daemon_message(transport.written[0][wire.PREFIX_BYTES :])
        assert isinstance(reply, wire.Reply)
        assert (reply.status, reply.error) == ("error", "access denied")
        deliver(conn, framed([b"first request"]), [5], after_close=True)
        conn.eof_received()
        assert handler.frames == []
        assert handler.reader is not None
        assert await handler.reader.read() == framed([b"first request"])

    asyncio.run(run())


def test_a_lost_connection_is_reported_once() -> None:
    async def run() -> None:
        handler = Recorder()
        conn, _ = open_connection(handler)
        deliver(conn, framed([b"x" * (2 * HEAD_BYTES)])[:1000], [])  # mid-frame
        conn.connection_lost(None)
        conn.connection_lost(None)
        assert handler.events == [("closed", 1)]
        assert conn.closed and conn.gone.done()
        assert len(handler.pool._free) == 1

    asyncio.run(run())


def test_replies_of_one_turn_leave_together_and_in_order_and_close_flushes_them() -> None:
    async def run() -> None:
        conn, transport = open_connection(Recorder())
        for i in range(3):
            conn.send(wire.Reply(id=i, status="ok"))
        assert transport.written == []  # not yet: at the end of this turn of the loop
        await asyncio.sleep(0)
        assert len(transport.written) == 1
        ids = []
        data = transport.written[0]
        while data:
            n = wire.frame_length(data[: wire.PREFIX_BYTES])
            ids.append(
                wire.decode_daemon_message(data[wire.PREFIX_BYTES : wire.PREFIX_BYTES + n]).id
            )
            data = data[wire.PREFIX_BYTES + n :]
        assert ids == [0, 1, 2]
        conn.send(wire.Reply(id=9, status="invalid"))
        conn.close()  # an oversized frame's reply, then the close: the reply is not lost
        assert len(transport.written) == 2 and transport.closed
        conn.send(wire.Reply(id=10, status="ok"))  # a late completion: dropped, not written
        await asyncio.sleep(0)
        assert len(transport.written) == 2

    asyncio.run(run())

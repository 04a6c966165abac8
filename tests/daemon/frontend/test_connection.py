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
from typing import Any, NoReturn

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.daemon.frontend.buffers import BufferPool, ReceiveBudget
from scratchd.daemon.frontend.connection import (
    HEAD_BYTES,
    SCAN_BYTES,
    Connection,
    ReadState,
    SlotLoan,
)
from scratchd.daemon.frontend.receiver import ReceivePool
from scratchd.ipc.queue import Handle
from scratchd.protocol import wire


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False
        self.eof_written = False
        self.paused = False

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

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Recorder:
    """A FrameHandler that records what the connection hands it."""

    def __init__(self, max_frame: int = 1 << 22, timeout_s: float = 30.0) -> None:
        self.pool = BufferPool()
        self.budget = ReceiveBudget(1 << 40)
        self.receiver: ReceivePool | None = None  # these tests' fake transport has no socket
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

    def lend_slot(self, conn: Connection, nbytes: int) -> SlotLoan | None:
        return None

    def slot_frame(
        self, conn: Connection, body: memoryview, loan: SlotLoan, received_ns: int
    ) -> bool:
        raise AssertionError("no slot was lent")

    def return_slot(self, loan: SlotLoan) -> None:
        raise AssertionError("no slot was lent")


class Lender(Recorder):
    """A FrameHandler that also lends slots (``lend``) and takes slot frames (``take``); it
    records every frame as the message it decodes to, so a frame that came through a slot
    can be compared with the same body decoded whole (``decoded``)."""

    def __init__(self, *, lend: bool = True, take: bool = True, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.lend, self.take = lend, take
        self.loans = 0
        self.out: dict[int, SlotLoan] = {}  # lent and neither taken nor returned
        self.messages: list[object] = []

    def frame(self, conn: Connection, body: memoryview, received_ns: int) -> None:
        super().frame(conn, body, received_ns)
        self.messages.append(decoded(body))

    def lend_slot(self, conn: Connection, nbytes: int) -> SlotLoan | None:
        if not self.lend:
            return None
        self.loans += 1
        loan = SlotLoan(Handle(self.loans, 0), memoryview(bytearray(nbytes)))
        self.out[self.loans] = loan
        return loan

    def slot_frame(
        self, conn: Connection, body: memoryview, loan: SlotLoan, received_ns: int
    ) -> bool:
        assert self.out[loan.handle.index] is loan
        if not self.take:
            return False
        del self.out[loan.handle.index]
        message = wire.decode_client_frame(body)
        assert isinstance(message, wire.InferFrame) and message.pixels is None
        self.messages.append(decoded(msgspec.structs.replace(message, pixels=loan.view)))
        return True

    def return_slot(self, loan: SlotLoan) -> None:
        assert self.out.pop(loan.handle.index) is loan


def decoded(body: memoryview | bytes | wire.ClientFrame) -> object:
    """What the acceptor would see of a body: its message (pixels as bytes) or its error."""
    if not isinstance(body, memoryview | bytes):
        message = body
    else:
        try:
            message = wire.decode_client_frame(body)
        except wire.DecodeError as exc:
            return str(exc)
    fields = msgspec.structs.asdict(message)
    if fields.get("pixels") is not None:
        fields["pixels"] = bytes(fields["pixels"])
    return type(message).__name__, fields


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
        deliver(conn, framed([b"x" * (2 * HEAD_BYTES)])[:4000], [])  # mid-frame
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


# ---- large raw frames received straight into a lent slot -------------------------------------

raw_sizes = st.one_of(
    st.integers(0, 64),
    st.integers(HEAD_BYTES - 200, HEAD_BYTES + 200),  # pixels end inside or past the head
    st.integers(HEAD_BYTES, 3 * HEAD_BYTES),
)


def frame_mixes(max_size: int) -> st.SearchStrategy[list[tuple[str, int]]]:
    """1..max_size frames, each a raw image request of a raw_sizes body or opaque bytes."""
    kinds = st.one_of(st.tuples(st.just("raw"), raw_sizes), st.tuples(st.just("opaque"), sizes))
    return st.lists(kinds, min_size=1, max_size=max_size)


def raw_body(n: int, seed: int, **extra: object) -> bytes:
    """A request as a client sends it (msgspec field order: ``pixels`` fourth)."""
    pixels = bytes((seed + k) % 253 for k in range(n))
    request = wire.InferRequest(id=seed, pixels=pixels, height=1, width=n, **extra)  # type: ignore[arg-type]
    return bytes(wire.encode_frame(request)[wire.PREFIX_BYTES :])


def frame_bodies(frames: list[tuple[str, int]], seed: int) -> list[bytes]:
    """The bodies of a ``frame_mixes`` draw: raw requests, or ``n`` opaque bytes."""
    return [
        raw_body(n, seed + i) if kind == "raw" else bytes([seed]) * n
        for i, (kind, n) in enumerate(frames)
    ]


@settings(max_examples=60, deadline=None)
@given(
    frames=frame_mixes(6),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=12),
    lend=st.booleans(),
    take=st.booleans(),
    seed=st.integers(0, 255),
)
def test_raw_frames_through_a_slot_arrive_as_the_same_messages_and_no_slot_is_kept(
    frames: list[tuple[str, int]], cuts: list[int], lend: bool, take: bool, seed: int
) -> None:
    async def run() -> None:
        bodies = frame_bodies(frames, seed)
        handler = Lender(lend=lend, take=take)
        conn, _ = open_connection(handler)
        deliver(conn, framed(bodies), cuts)
        assert handler.messages == [decoded(b) for b in bodies]
        if not take:  # not taken: the body reaches frame() exactly as it was sent
            assert handler.frames == bodies
        assert handler.out == {} and handler.events == []
        assert conn.state is ReadState.HEAD
        # Every frame whose pixels outlast the head went through a slot when one was lent.
        big = sum(kind == "raw" and n >= HEAD_BYTES for kind, n in frames)
        assert handler.loans >= big if lend else handler.loans == 0

    asyncio.run(run())


def test_pixels_land_in_the_slot_and_only_the_rest_is_decoded_from_head() -> None:
    async def run() -> None:
        handler = Lender()
        conn, _ = open_connection(handler)
        body = raw_body(3 * HEAD_BYTES, 5, part_class="safety", want_mask=True)
        deliver(conn, framed([body]), [wire.PREFIX_BYTES + SCAN_BYTES + 7, 2 * HEAD_BYTES])
        assert handler.loans == 1 and handler.out == {}
        assert handler.frames == []  # never went through frame(): no body buffer either
        assert handler.pool._free == []
        assert handler.messages == [decoded(body)]

    asyncio.run(run())


@settings(max_examples=30, deadline=None)
@given(
    sent=st.integers(wire.PREFIX_BYTES + SCAN_BYTES, 3 * HEAD_BYTES),
    how=st.sampled_from(["lost", "closed", "stalled"]),
)
def test_a_connection_gone_mid_frame_returns_its_slot_once(sent: int, how: str) -> None:
    async def run() -> None:
        handler = Lender(timeout_s=0.02)
        conn, _ = open_connection(handler)
        deliver(conn, framed([raw_body(3 * HEAD_BYTES, 1)])[:sent], [])
        assert handler.loans == 1 and len(handler.out) == 1 and conn.state is ReadState.SLOT
        if how == "lost":
            conn.connection_lost(None)
        elif how == "closed":
            conn.close()
        else:
            await asyncio.sleep(0.05)
        assert handler.out == {} and handler.messages == []
        conn.connection_lost(None)  # the transport reports it after a close: nothing twice
        assert handler.out == {}
        assert ("closed", 1) in handler.events

    asyncio.run(run())


def test_a_failure_to_lend_costs_the_in_place_copy_not_the_frame() -> None:
    async def run() -> None:
        handler = Lender()

        def broken(conn: Connection, nbytes: int) -> SlotLoan | None:
            raise RuntimeError("reserve failed")

        handler.lend_slot = broken  # type: ignore[method-assign]
        conn, transport = open_connection(handler)
        body = raw_body(2 * HEAD_BYTES, 4)
        deliver(conn, framed([body]), [])
        assert handler.frames == [body]  # the body path, whole
        assert conn.state is ReadState.HEAD and not transport.closed

    asyncio.run(run())


def test_a_slot_frame_not_taken_returns_its_slot_even_if_no_body_buffer_can_be_had() -> None:
    async def run() -> None:
        handler = Lender(take=False)

        def no_memory(n: int) -> NoReturn:
            raise MemoryError

        handler.pool.take = no_memory  # type: ignore[method-assign]
        conn, _ = open_connection(handler)
        with pytest.raises(MemoryError):
            deliver(conn, framed([raw_body(2 * HEAD_BYTES, 6)]), [])
        assert handler.loans == 1 and handler.out == {}

    asyncio.run(run())


@pytest.mark.parametrize("rest", ["sent", "never sent"])
def test_a_frame_that_waits_for_its_first_bytes_is_still_served_and_timed(rest: str) -> None:
    async def run() -> None:
        handler = Lender(timeout_s=0.05)
        conn, _ = open_connection(handler)
        body = raw_body(2 * HEAD_BYTES, 3)
        frame = framed([body])
        deliver(conn, frame[:20], [])  # the prefix and a few bytes: not enough to look
        assert conn.state is ReadState.HEAD and handler.loans == 0
        if rest == "sent":  # the rest in time: through a slot, whole, and the timer is off
            deliver(conn, frame[20:], [SCAN_BYTES])
            assert handler.loans == 1 and handler.out == {}
            assert handler.messages == [decoded(body)]
            await asyncio.sleep(0.1)
            assert handler.events == [] and conn.state is ReadState.HEAD
            return
        await asyncio.sleep(0.1)  # the stall timer runs from the prefix, as for any frame
        assert handler.events == [("stalled", len(frame) - 4), ("closed", 1)]

    asyncio.run(run())


@pytest.mark.parametrize(
    "body",
    [
        # The bin claims more bytes than the frame holds: no slot, msgspec's own error.
        b"\x82\xa4type\xa5infer\xa6pixels\xc6\x00\x10\x00\x00" + bytes(HEAD_BYTES),
        # A second 'pixels' after the first: the frame is rebuilt and decoded whole.
        b"\x84\xa4type\xa5infer\xa2id\x01\xa6pixels\xc6\x00\x02\x00\x00"
        + bytes(2 * HEAD_BYTES)
        + b"\xa6pixels\xc4\x01x",
        # pixels before every other key, and an array value after them.
        b"\x84\xa6pixels\xc5\xff\xff"
        + bytes(0xFFFF)
        + b"\xa4type\xa5infer\xa2id\x02"
        + b"\xa1x\x92\x01\x02",
        # Not a map at all.
        b"\x92\xa6pixels\xc6\x00\x02\x00\x00" + bytes(2 * HEAD_BYTES),
    ],
    ids=["bin overruns frame", "second pixels", "pixels first", "array"],
)
def test_odd_large_bodies_reach_the_handler_as_the_whole_frame_would(body: bytes) -> None:
    async def run() -> None:
        handler = Lender(take=False)  # as the acceptor does with what it cannot take as is
        conn, _ = open_connection(handler)
        deliver(conn, framed([body, raw_body(10, 9)]), [])
        assert handler.frames == [body, raw_body(10, 9)]
        assert handler.out == {} and conn.state is ReadState.HEAD

    asyncio.run(run())

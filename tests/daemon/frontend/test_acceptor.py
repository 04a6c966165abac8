"""Acceptor validation without a daemon: what is refused before a slot is reserved, class
resolution, conversion of raw/encoded images into a payload slot, and large raw frames
received straight into a slot (answered and served exactly as if they had been copied)."""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import re
import socket
import struct
import time
from typing import Any, Final

import msgspec
import numpy as np
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from PIL import Image

from scratchd.daemon.config import Config, QueueConfig, ServerConfig
from scratchd.daemon.frontend import raw_frames
from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.daemon.frontend.connection import HEAD_BYTES, SCAN_BYTES, Connection, SlotLoan
from scratchd.daemon.frontend.dispatch import Dispatcher
from scratchd.daemon.frontend.images import Invalid, check_image, convert_into
from scratchd.ipc.queue import DescState, Geometry, RequestQueue, Result, Status
from scratchd.protocol import wire
from scratchd.protocol.image import ImageError
from scratchd.protocol.wire import InferRequest

from .test_connection import FakeTransport, deliver


def _raw(arr: np.ndarray) -> InferRequest:
    channels = 1 if arr.ndim == 2 else arr.shape[2]
    return InferRequest(
        id=1, pixels=arr.tobytes(), height=arr.shape[0], width=arr.shape[1], channels=channels
    )


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (InferRequest(id=1), "exactly one of"),
        (InferRequest(id=1, pixels=b"\0", encoded=b"\0", height=1, width=1), "exactly one of"),
        (InferRequest(id=1, encoded=b"GIF89a"), "not a PNG, BMP or JPEG"),
        (InferRequest(id=1, pixels=b"\0" * 4, height=2, width=2, channels=2), "channels"),
        (InferRequest(id=1, pixels=b"", height=0, width=5), "positive height"),
        (InferRequest(id=1, pixels=b"\0" * 3, height=2, width=2), "needs 4"),
        (InferRequest(id=1, pixels=b"", height=100, width=100), "exceeds the limit of 4096"),
    ],
)
def test_requests_that_cannot_be_served_are_refused_with_a_reason(
    request_: InferRequest, reason: str
) -> None:
    with pytest.raises(Invalid, match=reason):
        check_image(request_, 4096)


def test_well_formed_requests_pass() -> None:
    check_image(InferRequest(id=1, pixels=b"\0" * 12, height=2, width=2, channels=3), 4096)
    check_image(InferRequest(id=1, pixels=b"\0" * 4096, height=64, width=64), 4096)
    check_image(InferRequest(id=1, encoded=b"\xff\xd8\xff\xe0"), 4096)  # decoded later


@settings(max_examples=50, deadline=None)
@given(arrays(np.uint8, st.tuples(st.integers(1, 17), st.integers(1, 17), st.just(3))))
def test_raw_rgb_fills_the_slot_exactly_as_the_same_image_sent_as_png(rgb: np.ndarray) -> None:
    raw, png = bytearray(1024), bytearray(1024)
    shape = convert_into(memoryview(raw), _raw(rgb))
    assert shape == rgb.shape[:2]
    assert convert_into(memoryview(png), InferRequest(id=1, encoded=_png(rgb))) == shape
    assert raw == png  # the same grey pixels, and nothing written past them


@pytest.mark.parametrize("kind", ["png", "rgb"])
def test_conversion_writes_grey_pixels_into_the_slot(kind: str) -> None:
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (13, 21), dtype=np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    request = InferRequest(id=1, encoded=_png(grey)) if kind == "png" else _raw(rgb)
    slot = bytearray(1024)
    shape = convert_into(memoryview(slot), request)
    assert shape == (13, 21)
    np.testing.assert_array_equal(np.frombuffer(slot, np.uint8, count=13 * 21), grey.ravel())


def test_an_encoded_image_larger_than_a_slot_is_refused_before_decoding() -> None:
    big = np.zeros((64, 64), np.uint8)
    with pytest.raises(ImageError, match="limit of 1024"):
        convert_into(memoryview(bytearray(1024)), InferRequest(id=1, encoded=_png(big)))


# ---- large raw frames received straight into a lent slot: the same replies, no slot kept ------

SLOT_BYTES = 96 * 1024  # > the connection's head, so a raw grey frame that fits can be lent
SLOTS = 8


class FrontEnd:
    """An acceptor with its queue and dispatcher, in this process; the test is the worker
    (it claims, reads the pixels and completes) and the client (a fake transport, or the other
    end of a socketpair: then large frames' pixels are received by the receive threads)."""

    def __init__(self, **server: Any) -> None:
        self.queue = RequestQueue.create(
            f"/scratchd-test-acceptor-{os.getpid()}", Geometry(SLOTS, SLOT_BYTES)
        )
        self.queue.register_worker(0, os.getpid())
        config = Config(
            server=ServerConfig(socket="/nonexistent", **server),
            queue=QueueConfig(slots=SLOTS, slot_bytes=SLOT_BYTES),
        )
        self.dispatcher = Dispatcher(self.queue, 1_000_000, lambda *_: None, lambda _: "w0")
        self.acceptor = Acceptor(config, self.queue, self.dispatcher, self._status)
        self.loans = 0
        lend = self.acceptor.lend_slot

        def counting(conn: Connection, nbytes: int) -> SlotLoan | None:
            loan = lend(conn, nbytes)
            self.loans += loan is not None
            return loan

        self.acceptor.lend_slot = counting  # type: ignore[method-assign]
        if self.acceptor.receiver is not None:
            self.acceptor.receiver.min_bytes = 1  # every lent frame with pixels to come: a thread
        self._ids = itertools.count(1)

    @staticmethod
    def _status(request_id: int) -> wire.StatusReply:
        depth = wire.QueueStatus(depth=[0] * 8, slots=SLOTS, in_use=0, in_flight=0)
        return wire.StatusReply(request_id, "serving", 0, 0.0, "test", [], depth)

    def connect(self) -> tuple[Connection, FakeTransport]:
        conn = Connection(next(self._ids), self.acceptor)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        return conn, transport

    async def connect_socket(self) -> tuple[Connection, socket.socket]:
        daemon_end, client = socket.socketpair()
        loop = asyncio.get_running_loop()
        _, conn = await loop.connect_accepted_socket(
            lambda: Connection(next(self._ids), self.acceptor), daemon_end
        )
        client.setblocking(False)
        return conn, client

    async def serve(
        self, frames: list[bytes], *, lend: bool, via_socket: bool = False
    ) -> tuple[list[object], list[object]]:
        """Send ``frames`` on one connection, serve what was queued; (replies, what the
        worker saw). Replies: id, status, error, verdict; the worker: the claim's fields
        and its pixels."""
        self.acceptor.lend_limit = SLOTS // 4 if lend else 0
        data = b"".join(PREFIX.pack(len(f)) + f for f in frames)
        if via_socket:
            conn, client = await self.connect_socket()
            received = await self._send_until_handled(client, data)
        else:
            conn, transport = self.connect()
            deliver(conn, data, [])
        await self.acceptor.wait_for_decodes()
        seen: list[object] = []
        for c in self.queue.claim_batch(0, SLOTS, time.monotonic_ns()):
            pixels = self.queue.input_view(c).tobytes()
            seen.append((c.request_id, c.priority, c.part_class, c.height, c.width, pixels))
            self.queue.complete(0, c, Result(Status.OK, score=0.5))
        self.dispatcher.collect()
        await asyncio.sleep(0)  # replies leave at the end of the loop's turn
        conn.close()
        if via_socket:  # what is left: the replies sent since the marker's, then EOF
            loop = asyncio.get_running_loop()
            while more := await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 5.0):
                received += more
            client.close()
        written = [received] if via_socket else transport.written
        replies: list[object] = []
        for data in written:
            while data:
                n = wire.frame_length(data[:4])
                reply = wire.decode_daemon_message(data[4 : 4 + n])
                if isinstance(reply, wire.Reply):
                    error = re.sub(r" at 0x[0-9a-f]+", "", reply.error)  # Pillow names objects
                    replies.append((reply.id, reply.status, error, reply.verdict))
                else:
                    replies.append((reply.id, "status_reply"))
                data = data[4 + n :]
        if via_socket:
            replies.remove((MARKER, "status_reply"))  # ValueError (a failure) if it is not there
        assert self.acceptor.lent == 0
        free = self.queue.counts_by_state()[DescState.FREE]
        assert free == SLOTS, f"{SLOTS - free} slots kept"
        return replies, seen

    async def _send_until_handled(self, client: socket.socket, data: bytes) -> bytes:
        """Send ``data`` and a status request (the marker) after it; return what the daemon
        wrote up to the marker's reply, which comes once every frame before it was handled."""
        loop = asyncio.get_running_loop()
        marker = wire.encode_frame(wire.StatusRequest(id=MARKER))
        await loop.sock_sendall(client, data + bytes(marker))
        received, tag = b"", bytes(wire.encode_frame(self._status(MARKER))[4:])
        while tag not in received:
            received += await asyncio.wait_for(loop.sock_recv(client, 1 << 16), 5.0)
        return received

    async def close(self) -> None:
        await self.acceptor.close_connections()
        self.queue.close()


MARKER: Final = 987_654  # the status request that ends a socket run


PREFIX = struct.Struct(">I")


def encode_map(pairs: list[tuple[str, object]]) -> bytes:
    """A msgpack map in exactly this order, duplicate keys included."""
    assert len(pairs) < 16
    body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in pairs)
    return bytes([0x80 | len(pairs)]) + body


@st.composite
def large_frames(draw: st.DrawFn) -> bytes:
    """Raw requests big enough to be lent a slot, valid and not, in any order of fields."""
    channels = draw(st.sampled_from([1, 1, 1, 3]))
    if channels == 1:
        height, width = draw(st.sampled_from([256, 300, 400])), draw(st.integers(260, 330))
    else:  # RGB that fits a slot (3 bytes a pixel), then converted in the decode pool
        height, width = draw(st.integers(150, 180)), draw(st.integers(150, 180))
    n = height * width * channels + draw(st.sampled_from([0, 0, 0, -1, 1]))
    pixels = np.random.default_rng(draw(st.integers(0, 99))).bytes(n)
    head = [("type", draw(st.sampled_from(["infer", "infer", "status"]))), ("id", 7)]
    head.append(("part_class", draw(st.sampled_from(["normal", "safety", "bogus"]))))
    tail = [("height", height), ("width", width), ("channels", channels)]
    tail += draw(st.lists(st.sampled_from([
        ("priority", 3), ("priority", 99), ("deadline_ms", -1), ("want_mask", True),
        ("pixels", b"x"), ("pixels", None), ("pixels", b""), ("zz", [1, {"a": 2}]),
        ("encoded", b"\x89PNG\r\n\x1a\n"), ("id", 8),
    ]), max_size=3))  # fmt: skip
    pairs = [*head, ("pixels", pixels), *tail]
    if draw(st.booleans()):
        pairs = draw(st.permutations(pairs))
    body = encode_map(pairs)
    return body + draw(st.sampled_from([b"", b"", b"\xc0"]))  # trailing bytes: malformed


def _lendable(body: bytes) -> bool:
    """Whether a frame is received into a slot when it starts a read of head (as each frame
    does here: all are larger than head): its first SCAN_BYTES show where its pixels lie,
    they fit a slot, what head holds of the body ends within them, and the rest of the body
    without them fits in head."""
    got = HEAD_BYTES - PREFIX.size
    assert len(body) > got
    at = raw_frames.locate_pixels(memoryview(body)[:SCAN_BYTES])
    if at is None or not 0 < at.length <= SLOT_BYTES:
        return False
    return got <= at.start + at.length and at.hidden_length(len(body)) <= HEAD_BYTES


def unordered(served: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
    """Replies and claims as multisets: an encoded image is decoded off the loop, so its
    reply (or its place in the queue) may come before or after a later frame's on any
    path; what must match is every reply and every frame served, once."""
    replies, seen = served
    return sorted(replies, key=repr), sorted(seen, key=repr)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.large_base_example])
@given(st.lists(large_frames(), min_size=1, max_size=3))
def test_a_frame_received_into_a_slot_is_answered_and_served_as_if_copied(
    frames: list[bytes],
) -> None:
    """Copied, received into a slot by the loop, received into a slot by a receive thread
    (over a socket, on uvloop as the daemon runs): the same replies, the same pixels served."""

    async def run() -> None:
        front = FrontEnd(receive_threads=2)
        try:
            copied = unordered(await front.serve(frames, lend=False))
            assert front.loans == 0
            in_place = unordered(await front.serve(frames, lend=True))
            assert in_place == copied
            assert front.loans == sum(map(_lendable, frames))  # and they did go through slots
            loans = front.loans
            threaded = unordered(await front.serve(frames, lend=True, via_socket=True))
            assert threaded == copied
            # Through slots again; each rest went to a thread when a burst of it was in the
            # socket, else the loop received it (test_receiver checks which, and when).
            assert front.loans - loans == sum(map(_lendable, frames))
        finally:
            await front.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


@pytest.mark.parametrize("threads", [0, 2])
def test_receive_threads_0_receives_on_the_loop_and_more_in_threads(threads: int) -> None:
    async def run() -> None:
        front = FrontEnd(receive_threads=threads)
        try:
            assert (front.acceptor.receiver is None) == (threads == 0)
            request = InferRequest(id=4, pixels=bytes(300 * 310), height=300, width=310)
            body = bytes(wire.encode_frame(request)[4:])
            replies, seen = await front.serve([body], lend=True, via_socket=True)
            assert replies == [(4, "ok", "", "clean")] and len(seen) == 1
            jobs = front.acceptor.receiver.jobs if front.acceptor.receiver is not None else 0
            assert front.loans == 1 and (jobs >= 1 if threads else jobs == 0)
        finally:
            await front.close()
        assert front.acceptor.receiver is None or not front.acceptor.receiver.native_ids()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


@pytest.mark.parametrize("shape", [(300, 310), (160, 170, 3)], ids=["grey", "rgb"])
def test_a_valid_raw_frame_is_served_from_the_slot_it_was_received_into(
    shape: tuple[int, ...],
) -> None:
    async def run() -> None:
        front = FrontEnd()
        try:
            image = np.random.default_rng(1).integers(0, 256, shape, np.uint8)
            channels = 1 if image.ndim == 2 else 3
            request = InferRequest(
                id=3, pixels=image.tobytes(), height=shape[0], width=shape[1], channels=channels
            )
            body = bytes(wire.encode_frame(request)[4:])
            replies, seen = await front.serve([body], lend=True)
            assert front.loans == 1
            assert replies == [(3, "ok", "", "clean")]
            grey = bytearray(image.tobytes())
            if channels == 3:  # the luma the same image sent as PNG gets
                convert_into(memoryview(grey), request)
            assert seen == [(3, 0, 0, shape[0], shape[1], bytes(grey[: shape[0] * shape[1]]))]
        finally:
            await front.close()

    asyncio.run(run())


@pytest.mark.parametrize("why", ["queue full", "draining", "in-flight limit", "lend limit"])
def test_no_slot_is_lent_when_that_would_change_the_frames_reply(why: str) -> None:
    async def run() -> None:
        front = FrontEnd(max_in_flight_per_connection=1)
        body = bytes(wire.encode_frame(InferRequest(id=1, pixels=bytes(300 * 300), height=300,
                                                    width=300))[4:])  # fmt: skip
        held = []
        try:
            if why == "queue full":
                held = [front.queue.reserve() for _ in range(SLOTS)]
            elif why == "draining":
                front.acceptor.draining = True
            elif why == "lend limit":
                front.acceptor.lent = front.acceptor.lend_limit = 1
            frames = [body, body] if why == "in-flight limit" else [body]
            expected = {
                "queue full": "queue full",
                "draining": "daemon is shutting down",
                "in-flight limit": "1 requests already in flight on this connection",
            }
            conn, transport = front.connect()
            deliver(conn, b"".join(PREFIX.pack(len(f)) + f for f in frames), [])
            await asyncio.sleep(0)
            assert front.loans == (1 if why == "in-flight limit" else 0)
            if why in expected:
                last = wire.decode_daemon_message(transport.written[-1][4:])
                assert last.status == "overloaded"  # type: ignore[union-attr]
                assert expected[why] in last.error  # type: ignore[union-attr]
            conn.close()
        finally:
            for h in held:
                assert h is not None
                front.queue.release(h)
            front.acceptor.lent = 0
            await front.close()

    asyncio.run(run())


@pytest.mark.parametrize("free", [1, 2, 3])  # lend_limit is 2 (SLOTS // 4)
def test_a_slot_is_lent_only_while_more_than_the_lend_limit_are_free(free: int) -> None:
    """A lent slot is not available to other frames until its frame is whole: with only
    ``lend_limit`` slots free, a slow client's large frame is not lent one, so another
    client's complete frame is still queued (not answered ``queue full``)."""

    async def run() -> None:
        front = FrontEnd()
        assert front.acceptor.lend_limit == 2
        held = [front.queue.reserve() for _ in range(SLOTS - free)]
        big = InferRequest(id=1, pixels=bytes(300 * 300), height=300, width=300)
        # Priority 7: the last free slot is also the reserved one (queue.reserved_share)
        small = InferRequest(id=2, pixels=bytes(16 * 16), height=16, width=16, priority=7)
        try:
            a, _ = front.connect()
            b, b_transport = front.connect()
            deliver(a, bytes(wire.encode_frame(big))[:20_000], [])  # A stalls mid-frame
            deliver(b, bytes(wire.encode_frame(small)), [])  # B's frame is whole
            await asyncio.sleep(0)
            assert front.loans == (free > 2)  # lent only if that leaves lend_limit slots free
            assert b_transport.written == []  # B is not answered: it is queued
            assert front.queue.counts_by_state()[DescState.QUEUED] == 1
            a.close()
            b.close()
        finally:
            for h in held:
                assert h is not None
                front.queue.release(h)
            await front.close()

    asyncio.run(run())


@pytest.mark.parametrize("sent", [4 + 2000, 50_000, 4 + 300 * 300])
def test_a_client_gone_mid_frame_gives_the_slot_back(sent: int) -> None:
    async def run() -> None:
        front = FrontEnd()
        try:
            request = InferRequest(id=1, pixels=bytes(300 * 300), height=300, width=300)
            frame = bytes(wire.encode_frame(request))
            conn, _ = front.connect()
            deliver(conn, frame[:sent], [])
            assert front.acceptor.lent == 1
            conn.connection_lost(None)
            assert front.acceptor.lent == 0
            assert front.queue.counts_by_state()[DescState.FREE] == SLOTS
        finally:
            await front.close()

    asyncio.run(run())

"""The acceptor: the daemon's Unix socket, one asyncio task per client connection.

Per frame (see ``scratchd.ipc.wire`` for the format), in this order:

1. read the 4-byte length and check it against the frame cap *before* reading the body
   (cap = 3 x ``slot_bytes`` for raw RGB + 64 KiB); an oversized frame gets one ``invalid``
   reply (id 0: its body is never read) and the connection is closed, since the stream can
   no longer be trusted; so is a body that does not arrive within ``frame_timeout_ms``;
2. typed msgpack decode; a body that fails it is answered ``invalid`` with msgspec's reason
   (addressed to the body's ``id`` when one can be read) and the connection carries on;
3. resolve the part class and check the image's declared size (``invalid`` with a reason);
4. ``reserve()`` a descriptor; none free → ``overloaded`` at once (backpressure);
5. write the image into the reserved payload slot as raw greyscale: raw grey pixels are copied
   on the loop (a memcpy); encoded images (PNG/BMP/JPEG, ``decode_image``) and raw RGB are
   converted in a thread pool straight into the slot, never on the loop;
6. ``submit()`` and record the request in the dispatcher's in-flight table.

No slot leaks: a reserved descriptor is either submitted or released on every path
(a decode failure, any exception, the client having left meanwhile). Decode tasks are never
cancelled: a thread may still be writing into the slot, so the slot is released only after
the thread is done. When a client disconnects, ``abandon_connection`` hands the queue the
rest: queued requests are freed, claimed ones when their worker finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from scratchd.daemon.access import AccessGate
from scratchd.daemon.config import Config
from scratchd.daemon.dispatch import Dispatcher, InFlight
from scratchd.daemon.log import log_event
from scratchd.ipc import wire
from scratchd.ipc.image import ImageError, decode_image, sniff_format
from scratchd.ipc.queue import Handle, RequestQueue

MS: Final = 1_000_000
MAX_DEADLINE_MS: Final = 86_400_000
"""No part waits a day; and a deadline must fit the queue's int64 nanoseconds."""
DECODE_THREADS: Final = 2


class Invalid(ValueError):
    """A request that cannot be served as sent; the message goes back to the client."""


@dataclass(frozen=True)
class Admission:
    """A validated request: where it goes in the queue."""

    class_name: str
    class_index: int
    priority: int
    deadline_ms: int


class Connection:
    """One client: its writer, whether it is gone, and its requests still in the queue."""

    def __init__(self, conn_id: int, writer: asyncio.StreamWriter) -> None:
        self.id = conn_id
        self.writer = writer
        self.closed = False
        self.in_queue: set[Handle] = set()
        self.converting = 0  # images of this connection in the decode pool, not yet queued

    def converted(self, _task: asyncio.Task[None]) -> None:
        self.converting -= 1

    def in_flight(self) -> int:
        """Accepted and not yet answered (the per-connection limit counts these)."""
        return len(self.in_queue) + self.converting

    def send(self, message: wire.DaemonMessage) -> None:
        if not self.closed:
            self.writer.write(wire.encode_frame(message))


class Acceptor:
    """Accepts connections and turns frames into queued requests or immediate replies.

    ``status`` builds the reply to a status request; ``draining`` (set by the daemon on
    SIGTERM) makes new inference requests get ``overloaded`` while accepted ones finish.
    """

    def __init__(
        self,
        config: Config,
        queue: RequestQueue,
        dispatcher: Dispatcher,
        status: Callable[[int], wire.StatusReply],
    ) -> None:
        self.config = config
        self.queue = queue
        self.dispatcher = dispatcher
        self.status = status
        self.draining = False
        self.max_frame = 3 * config.queue.slot_bytes + wire.MAX_FRAME_OVERHEAD
        self.connections: dict[int, Connection] = {}
        self._class_index = {name: i for i, name in enumerate(config.class_names())}
        self.gate = AccessGate.from_config(config.server.allowed_uids, config.server.allowed_gids)
        self._ids = itertools.count(1)
        self._decoding: set[asyncio.Task[None]] = set()
        self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="scratchd-decode")
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None

    # ---- the listening socket ---------------------------------------------------------

    async def listen(self, path: str, sock: socket.socket | None = None) -> None:
        """Listen on ``path`` (or on an inherited, already-bound ``sock``)."""
        if sock is None:
            _clear_stale_socket(path)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._server = await asyncio.start_unix_server(self._serve, path=path)
            os.chmod(path, self.config.server.socket_mode)
            self._path = path
        else:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    def stop_listening(self) -> None:
        """Stop accepting connections; the socket file goes (established ones stay)."""
        if self._server is not None:
            self._server.close()
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None

    async def wait_for_decodes(self) -> None:
        """Until every image conversion in progress has submitted or released its slot."""
        while self._decoding:
            await asyncio.wait(list(self._decoding))

    async def close_connections(self) -> None:
        """Wait for running decodes, then flush and close every connection."""
        await self.wait_for_decodes()
        for conn in list(self.connections.values()):
            conn.writer.close()
        for conn in list(self.connections.values()):
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await asyncio.wait_for(conn.writer.wait_closed(), 1.0)
        self._pool.shutdown(wait=True)

    # ---- one connection ---------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(next(self._ids), writer)
        self.connections[conn.id] = conn
        try:
            refusal = self.gate.admit(writer.get_extra_info("socket"))
            if refusal is None:
                limit = self.config.server.max_connections
                refusal = self.gate.over_capacity(len(self.connections), limit)
            if refusal is not None:  # not on the allow-list, or too many: one reply, closed
                conn.send(wire.Reply(id=0, status="error", error=refusal))
                await self.gate.linger(reader, writer)
                return
            while True:
                prefix = await reader.readexactly(wire.PREFIX_BYTES)
                length = wire.frame_length(prefix)
                if length > self.max_frame:
                    reason = f"frame of {length} bytes exceeds the limit of {self.max_frame}"
                    flight = InFlight(conn, 0, "unknown", 0, time.monotonic_ns())
                    self.dispatcher.reject(flight, "invalid", reason + "; closing the connection")
                    break
                body = await self._read_body(conn, reader, length)
                if body is None:
                    break
                received_ns = time.monotonic_ns()
                try:
                    self.handle_frame(conn, body, received_ns)
                except Exception as exc:  # a bug must cost one reply, not the connection
                    log_event("request_failed", logging.ERROR, error=repr(exc))
                    rid = wire.salvage_request_id(body)
                    flight = InFlight(conn, rid, "unknown", 0, received_ns)
                    self.dispatcher.reject(flight, "error", f"internal error: {exc}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client left, possibly mid-frame
        finally:
            self._disconnect(conn)

    async def _read_body(
        self, conn: Connection, reader: asyncio.StreamReader, length: int
    ) -> bytes | None:
        """The frame's body, or None (after an ``invalid`` reply) if it stalls."""
        timeout_ms = self.config.server.frame_timeout_ms
        try:
            async with asyncio.timeout(timeout_ms / 1000.0):
                return await reader.readexactly(length)
        except TimeoutError:
            reason = f"frame body of {length} bytes not received within {timeout_ms} ms"
            flight = InFlight(conn, 0, "unknown", 0, time.monotonic_ns())
            self.dispatcher.reject(flight, "invalid", reason + "; closing the connection")
            return None

    def _disconnect(self, conn: Connection) -> None:
        conn.closed = True
        self.connections.pop(conn.id, None)
        self.dispatcher.forget_connection(conn)
        self.queue.abandon_connection(conn.id)
        conn.writer.close()

    def handle_frame(self, conn: Connection, body: bytes, received_ns: int) -> None:
        try:
            message = wire.decode_client_message(body)
        except wire.DecodeError as exc:
            flight = InFlight(conn, wire.salvage_request_id(body), "unknown", 0, received_ns)
            self.dispatcher.reject(flight, "invalid", f"malformed request: {exc}")
            return
        if isinstance(message, wire.StatusRequest):
            conn.send(self.status(message.id))
            return
        self._admit(conn, message, received_ns)

    def _admit(self, conn: Connection, request: wire.InferRequest, received_ns: int) -> None:
        flight = InFlight(conn, request.id, "unknown", 0, received_ns, request.want_mask)
        try:
            admission = self.classify(request)
            flight.part_class, flight.priority = admission.class_name, admission.priority
            check_image(request, self.config.queue.slot_bytes)
        except Invalid as exc:
            self.dispatcher.reject(flight, "invalid", str(exc))
            return
        if self.draining:
            self.dispatcher.reject(flight, "overloaded", "daemon is shutting down")
            return
        limit = self.config.server.max_in_flight_per_connection
        if conn.in_flight() >= limit:
            reason = f"{limit} requests already in flight on this connection (limit per connection)"
            self.dispatcher.reject(flight, "overloaded", reason)
            return
        handle = self.queue.reserve()
        if handle is None:
            slots = self.config.queue.slots
            self.dispatcher.reject(flight, "overloaded", f"queue full: all {slots} slots in use")
            return
        flight.handle = handle
        flight.deadline_ns = received_ns + admission.deadline_ms * MS
        if request.encoded is None and request.channels == 1:
            try:
                shape = write_raw_grey(self.queue.payload(handle), request)
                self._submit(flight, admission, shape)
            except Exception as exc:  # not published: the slot is still ours to give back
                self.queue.release(handle)
                self.dispatcher.reject(flight, "error", f"could not queue the request: {exc}")
        else:
            task = asyncio.get_running_loop().create_task(
                self._convert_and_submit(flight, admission, request)
            )
            self._decoding.add(task)
            task.add_done_callback(self._decoding.discard)
            conn.converting += 1
            task.add_done_callback(conn.converted)

    async def _convert_and_submit(
        self, flight: InFlight, admission: Admission, request: wire.InferRequest
    ) -> None:
        assert flight.handle is not None
        handle, submitted = flight.handle, False
        try:
            payload = self.queue.payload(handle)
            loop = asyncio.get_running_loop()
            shape = await loop.run_in_executor(self._pool, convert_into, payload, request)
            if not flight.conn.closed:
                self._submit(flight, admission, shape)
                submitted = True
        except ImageError as exc:
            self.dispatcher.reject(flight, "invalid", str(exc))
        except Exception as exc:
            self.dispatcher.reject(flight, "error", f"image conversion failed: {exc}")
        finally:
            if not submitted:
                self.queue.release(handle)

    def _submit(self, flight: InFlight, admission: Admission, shape: tuple[int, int]) -> None:
        assert flight.handle is not None
        self.queue.submit(
            flight.handle,
            request_id=flight.request_id,
            conn_id=flight.conn.id,
            priority=admission.priority,
            part_class=admission.class_index,
            deadline_ns=flight.deadline_ns,
            height=shape[0],
            width=shape[1],
            want_mask=flight.want_mask,
        )
        self.dispatcher.enqueued(flight)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded configuration (classes, allow-list, in-flight limit); the socket
        and the queue geometry do not change while running."""
        self.config = config
        self._class_index = {name: i for i, name in enumerate(config.class_names())}
        self.gate.policy = AccessGate.from_config(
            config.server.allowed_uids, config.server.allowed_gids
        ).policy

    def classify(self, request: wire.InferRequest) -> Admission:
        """The request's class, priority and deadline (its own values override the class's)."""
        cls = self.config.classes.get(request.part_class)
        if cls is None:
            known = ", ".join(self.config.class_names())
            raise Invalid(f"unknown part class {request.part_class!r}; configured: {known}")
        priority = cls.priority if request.priority is None else request.priority
        if not 0 <= priority <= 7:
            raise Invalid(f"priority {priority} outside 0..7")
        deadline_ms = cls.deadline_ms if request.deadline_ms is None else request.deadline_ms
        if deadline_ms <= 0:
            raise Invalid(f"deadline_ms must be positive, got {deadline_ms}")
        if deadline_ms > MAX_DEADLINE_MS:
            raise Invalid(
                f"deadline_ms {deadline_ms} exceeds the maximum {MAX_DEADLINE_MS} (1 day)"
            )
        index = self._class_index[request.part_class]
        return Admission(request.part_class, index, priority, deadline_ms)


def check_image(request: wire.InferRequest, slot_bytes: int) -> None:
    """Reject what can be seen to be wrong before any pixel is touched."""
    if (request.pixels is None) == (request.encoded is None):
        raise Invalid("exactly one of 'pixels' (raw) or 'encoded' (PNG/BMP/JPEG) must be set")
    if request.encoded is not None:
        if sniff_format(request.encoded) is None:
            raise Invalid("'encoded' is not a PNG, BMP or JPEG image")
        return
    assert request.pixels is not None
    h, w, c = request.height, request.width, request.channels
    if c not in (1, 3):
        raise Invalid(f"channels must be 1 (grey) or 3 (RGB), got {c}")
    if h <= 0 or w <= 0:
        raise Invalid(f"raw image needs positive height and width, got {h}x{w}")
    if h * w > slot_bytes:
        raise Invalid(f"image of {h}x{w} = {h * w} pixels exceeds the limit of {slot_bytes}")
    reason = shape_cost_error(h, w, slot_bytes)
    if reason:
        raise Invalid(reason)
    if len(request.pixels) != h * w * c:
        raise Invalid(f"'pixels' has {len(request.pixels)} bytes, {h}x{w}x{c} needs {h * w * c}")


def write_raw_grey(payload: memoryview, request: wire.InferRequest) -> tuple[int, int]:
    assert request.pixels is not None
    n = request.height * request.width
    np.frombuffer(payload, dtype=np.uint8, count=n)[:] = np.frombuffer(request.pixels, np.uint8)
    return request.height, request.width


def convert_into(payload: memoryview, request: wire.InferRequest) -> tuple[int, int]:
    """Decode/convert the request's image into ``payload`` as grey uint8; returns (H, W).

    Runs in the decode thread pool. Encoded images go through ``decode_image`` with the slot
    size as the pixel limit (checked from the header, before decoding).
    """
    slot_bytes = len(payload)
    if request.encoded is not None:
        grey = decode_image(request.encoded, max_pixels=slot_bytes)
    else:
        assert request.pixels is not None
        rgb = np.frombuffer(request.pixels, np.uint8).reshape(request.height, request.width, 3)
        grey = rgb_to_luma(rgb)
    height, width = grey.shape
    reason = shape_cost_error(height, width, slot_bytes)
    if reason:
        raise ImageError(reason)
    np.frombuffer(payload, dtype=np.uint8, count=grey.size)[:] = grey.ravel()
    return int(height), int(width)


PAD_MULTIPLE: Final = 16
"""The network pads each side to a multiple of 16 (``kernels.net.forward``): its cost and
memory follow the padded area, not the pixel count."""


def shape_cost_error(height: int, width: int, slot_bytes: int) -> str:
    """Why a frame's shape would cost far more than its pixel count, or "" if it will not.

    A 1 x 4M frame fits a 4 MiB slot but pads to 16 x 4M: sixteen times the largest frame's
    compute and activation memory, enough to OOM a worker or stall it past its heartbeat.
    The padded area may be at most twice the slot: room for the padding of any frame that
    is not extremely elongated (a full-slot frame needs a shorter side of about 8 or more).
    """
    padded = -(-height // PAD_MULTIPLE) * PAD_MULTIPLE * (-(-width // PAD_MULTIPLE) * PAD_MULTIPLE)
    if padded <= 2 * slot_bytes:
        return ""
    return (
        f"image of {height}x{width} pads to {padded} pixels for the network, more than twice "
        f"the limit of {slot_bytes}; send frames that are less elongated"
    )


def rgb_to_luma(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma exactly as Pillow's ``convert("L")`` computes it (fixed point)."""
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)


def _clear_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse to steal a live one's."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise OSError(f"socket {path} exists and cannot be probed: {exc}") from None
    finally:
        probe.close()
    raise OSError(f"socket {path} is in use by a running daemon")

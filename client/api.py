"""The Python client of the scratchd daemon (``scratchd.client``), sync and asyncio.

This is what ``scratchd infer`` / ``scratchd status`` use and what a PLC gateway imports::

    from scratchd.client import Client
    with Client("/run/scratchd/scratchd.sock") as client:
        reply = client.infer("part-0042.png", part_class="safety", want_mask=True)
        if reply.status == "ok":
            print(reply.verdict, reply.score, reply.boxes)

    async with await AsyncClient.connect() as client:          # pipelined: many in flight
        replies = await asyncio.gather(*(client.infer(p) for p in paths))

An image is a path (its bytes are sent encoded: PNG, BMP or JPEG), encoded ``bytes``, or a
uint8 numpy array ``(H, W)`` (grey) or ``(H, W, 3)`` (RGB) sent raw; with ``zero_copy=True``
(the default) an array goes through a memfd ring shared with the daemon instead, or in the
frame when that cannot be used (``client/regions.py``: how, and the ownership rules; how a
frame is built without extra copies: ``client/frames.py``). Replies are
``scratchd.protocol.wire.Reply``; ``unpack_mask(reply)`` gives the mask as a 0/255 array.
Failures of the daemon are replies with a status, not exceptions; a lost connection raises
``ConnectionError`` for every request still in flight. Both clients send a ``ping`` as they
connect, so the daemon counts them as having spoken and never closes them to make room for
others however long they stay idle. A reply with id 0 is addressed to the connection, not to
a request: ``error`` refuses it (not on the allow-list, too many connections), which raises
``ConnectionError`` with the daemon's reason at once; any other is the reason the daemon is
about to close it, named by the ``ConnectionError`` that follows. A connection reuses its last
frame's buffer once the socket has taken all of it (``AsyncClient``: when the transport kept
none of it): a fresh megabyte buffer costs its page faults again (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Final

import numpy as np

from scratchd.client import frames
from scratchd.client.frames import ImageInput, build_request, request_frame, widen_send_buffer
from scratchd.client.regions import SlotRing, accept_registration, place, send_descriptor
from scratchd.protocol import wire
from scratchd.protocol.defaults import socket_path
from scratchd.protocol.wire import Reply, StatusReply, unpack_mask

__all__ = [
    "AsyncClient",
    "Client",
    "ImageInput",
    "Reply",
    "StatusReply",
    "build_request",
    "request_frame",
    "unpack_mask",
]

MAX_REPLY_BYTES: Final = 256 * 1024 * 1024


class AsyncClient:
    """A pipelined asyncio connection: any number of ``infer`` calls may be awaited at once.

    ``timeout`` is each call's deadline, as in :class:`Client` (a late reply finds no one
    waiting and is dropped); errors name the socket."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        path: str = "",
        timeout: float | None = None,
        zero_copy: bool = True,
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.zero_copy = zero_copy  # register a ring at the first array (one attempt)
        self.zero_copy_error = ""  # why registration was refused, if it was
        self.ring: SlotRing | None = None  # registered: arrays go through it
        self._gate: asyncio.Future[None] | None = None  # set while registering: writes wait
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._spare: bytearray | None = None  # the last frame, all of it sent: reused
        self._waiting: dict[int, asyncio.Future[wire.DaemonMessage]] = {}
        self._closed_by = f"scratchd at {path}: the connection is closed"
        self._receiver = asyncio.get_running_loop().create_task(self._receive())
        writer.write(wire.encode_frame(wire.Ping(id=next(self._ids))))  # its pong is dropped

    @classmethod
    async def connect(
        cls, path: str | None = None, timeout: float | None = None, *, zero_copy: bool = True
    ) -> AsyncClient:
        """Connect to ``path`` (default: ``SCRATCHD_SOCKET``, else the standard socket)."""
        where = socket_path(path)
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(where, limit=MAX_REPLY_BYTES)
        except TimeoutError:
            raise TimeoutError(f"scratchd at {where}: no connection within the timeout") from None
        except OSError as exc:
            named = type(exc)(f"scratchd at {where}: {exc}")
            named.errno = exc.errno
            raise named from None
        widen_send_buffer(writer.get_extra_info("socket"))
        return cls(reader, writer, where, timeout, zero_copy)

    async def infer(
        self,
        image: ImageInput,
        *,
        part_class: str | None = None,
        priority: int | None = None,
        deadline_ms: int | None = None,
        want_mask: bool = False,
        timeout: float | None = None,
    ) -> Reply:
        """One image's reply; ``timeout`` overrides the client's for this call."""
        request_id = next(self._ids)
        if isinstance(image, np.ndarray) and self.zero_copy:
            await self._register_ring(timeout)
        image = place(self.ring, request_id, image)
        frame = request_frame(
            request_id,
            image,
            part_class=part_class,
            priority=priority,
            deadline_ms=deadline_ms,
            want_mask=want_mask,
            into=self._spare,
        )
        self._spare = None
        reply = await self._call(request_id, frame, timeout, reuse=True)
        if not isinstance(reply, Reply):
            raise ConnectionError(f"daemon answered request {request_id} with {type(reply)}")
        return reply

    async def status(self, timeout: float | None = None) -> StatusReply:
        request_id = next(self._ids)
        frame = wire.encode_frame(wire.StatusRequest(id=request_id))
        reply = await self._call(request_id, frame, timeout)
        if not isinstance(reply, StatusReply):
            raise ConnectionError(f"daemon answered a status request with {type(reply)}")
        return reply

    async def _register_ring(self, timeout: float | None) -> None:
        """Register a ring (the handshake of ``wire.RegisterRegion``), once per connection.
        Other calls' writes wait meanwhile: nothing may follow the request but its byte."""
        self.zero_copy = False
        ring = SlotRing()
        request_id = next(self._ids)
        self._gate = asyncio.get_running_loop().create_future()
        try:
            frame = wire.encode_frame(wire.RegisterRegion(id=request_id, size=ring.size))
            answer = await self._call(request_id, frame, timeout, gated=True)
            if isinstance(answer, wire.SendDescriptor):
                answer = await self._call(request_id, None, timeout, gated=True, fd=ring.fd)
        except BaseException:
            ring.close()
            self._writer.close()  # cut mid-handshake: where the stream stands is unknown
            raise
        finally:
            self._gate.set_result(None)
            self._gate = None
        self.ring, self.zero_copy_error = accept_registration(ring, answer)

    async def _call(
        self,
        request_id: int,
        frame: bytearray | None,
        timeout: float | None,
        reuse: bool = False,
        gated: bool = False,
        fd: int = -1,
    ) -> wire.DaemonMessage:
        """Send ``frame`` (or the handshake's byte carrying ``fd``) and await the answer."""
        while self._gate is not None and not gated:
            await asyncio.shield(self._gate)
        if self._receiver.done():
            raise ConnectionError(self._closed_by)
        future: asyncio.Future[wire.DaemonMessage] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                if frame is None:  # the daemon read the request, so the transport holds none
                    fileno = self._writer.get_extra_info("socket").fileno()
                    with socket.socket(fileno=os.dup(fileno)) as sock:
                        send_descriptor(sock, fd)
                    return await future
                # write() puts all of the frame in the transport: a timeout never cuts one
                self._writer.write(frame)
                if reuse and self._writer.transport.get_write_buffer_size() == 0:
                    self._spare = frame  # the socket took it all: the transport keeps none
                with contextlib.suppress(ConnectionError):  # lost: the receiver tells why
                    await self._writer.drain()
                return await future
        except TimeoutError:
            raise TimeoutError(f"scratchd at {self.path}: no reply within the timeout") from None
        finally:
            self._waiting.pop(request_id, None)  # a late reply finds no one and is dropped

    async def _receive(self) -> None:
        error: BaseException = ConnectionError(f"scratchd at {self.path} closed the connection")
        said = ""  # the daemon's reason for closing, from a reply with id 0
        try:
            while True:
                prefix = await self._reader.readexactly(wire.PREFIX_BYTES)
                body = await self._reader.readexactly(wire.frame_length(prefix))
                message = wire.decode_daemon_message(body)
                if message.id == 0 and isinstance(message, Reply):  # to the connection
                    said = f": {message.error}"
                    error = ConnectionError(f"scratchd at {self.path} closed the connection{said}")
                    if message.status == "error":  # refused: every call fails with the reason
                        error = ConnectionError(f"scratchd at {self.path}{said}")
                        return
                    continue
                if self.ring is not None:  # answered: the daemon reads its slot no more
                    self.ring.release(message.id)
                future = self._waiting.get(message.id)
                if future is not None and not future.done():
                    future.set_result(message)
        except (asyncio.IncompleteReadError, OSError) as exc:
            error = ConnectionError(f"scratchd at {self.path}: connection lost: {exc}{said}")
        except wire.DecodeError as exc:
            error = ConnectionError(f"scratchd at {self.path} sent an undecodable reply: {exc}")
        finally:
            self._closed_by = str(error)
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(error)

    async def close(self) -> None:
        self._writer.close()
        if self.ring is not None:
            self.ring.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
        self._receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._receiver

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Client:
    """A blocking connection. ``infer`` is one round trip; ``map`` pipelines many.

    ``timeout`` (seconds, None: wait for ever) is a deadline for each whole call: ``infer``
    and ``status`` raise ``TimeoutError`` once it has passed, however the time went
    (sending, waiting, a reply arriving in pieces); in ``map`` it bounds the wait for each
    next reply. A reply that arrives after its call timed out is dropped when it is read, as
    is anything else no call is waiting for, so a long-lived client holds nothing for them;
    a reply cut short by a timeout is finished by the next call, so the connection stays
    usable. A send that times out may have sent part of a frame: the connection is closed.
    Errors (``OSError`` and its subclasses ``ConnectionError``, ``TimeoutError``, ...)
    name the socket: ``scratchd at /run/scratchd/scratchd.sock: [Errno 2] ...``.
    """

    def __init__(
        self, path: str | None = None, timeout: float | None = None, *, zero_copy: bool = True
    ) -> None:
        self.path = socket_path(path)
        self.timeout = timeout
        self.zero_copy = zero_copy  # register a ring at the first array (one attempt)
        self.zero_copy_error = ""  # why registration was refused, if it was
        self.ring: SlotRing | None = None  # registered: arrays go through it
        self._said = ""  # the daemon's reason for closing, from a reply with id 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as exc:
            self._sock.close()
            raise self._named(exc) from None
        widen_send_buffer(self._sock)
        self._ids = itertools.count(1)
        self._spare: bytearray | None = None  # the last frame (sendall sent it): reused
        self._pending: set[int] = set()  # sent, reply not yet handed to a caller
        self._early: dict[int, wire.DaemonMessage] = {}  # pending replies read by another call
        self._prefix = bytearray(wire.PREFIX_BYTES)  # the frame being read, kept across calls
        self._body: bytearray | None = None
        self._got = 0
        with contextlib.suppress(OSError):  # a refusal is read by the first call
            self._sock.sendall(wire.encode_frame(wire.Ping(id=next(self._ids))))

    def infer(
        self,
        image: ImageInput,
        *,
        part_class: str | None = None,
        priority: int | None = None,
        deadline_ms: int | None = None,
        want_mask: bool = False,
        timeout: float | None = None,
    ) -> Reply:
        """One image's reply; ``timeout`` overrides the client's for this call."""
        deadline = self._deadline(timeout)
        request_id = self._send(
            image,
            deadline,
            part_class=part_class,
            priority=priority,
            deadline_ms=deadline_ms,
            want_mask=want_mask,
        )
        reply = self._receive_for(request_id, deadline)
        assert isinstance(reply, Reply)
        return reply

    def map(
        self, images: Iterable[ImageInput], *, concurrency: int = 8, **options: object
    ) -> Iterator[tuple[int, Reply]]:
        """Send ``images`` with up to ``concurrency`` in flight; yields ``(index, reply)``
        in completion order. ``options`` are ``infer``'s keyword arguments."""
        in_flight: dict[int, int] = {}
        try:
            for index, image in enumerate(images):
                in_flight[self._send(image, self._deadline(None), **options)] = index
                while len(in_flight) >= concurrency:
                    yield self._collect_one(in_flight)
            while in_flight:
                yield self._collect_one(in_flight)
        finally:  # closed early, or failed: nobody waits for the rest any more
            self._pending.difference_update(in_flight)

    def status(self, timeout: float | None = None) -> StatusReply:
        deadline = self._deadline(timeout)
        request_id = next(self._ids)
        self._send_frame(wire.encode_frame(wire.StatusRequest(id=request_id)), deadline)
        self._pending.add(request_id)
        reply = self._receive_for(request_id, deadline)
        assert isinstance(reply, StatusReply)
        return reply

    def _deadline(self, timeout: float | None) -> float | None:
        timeout = self.timeout if timeout is None else timeout
        return None if timeout is None else time.monotonic() + timeout

    def _send(self, image: ImageInput, deadline: float | None, **options: object) -> int:
        """Send ``image``'s request (``options``: ``infer``'s keyword arguments) in the last
        frame's buffer, which ``sendall`` has sent all of; returns the request's id."""
        request_id = next(self._ids)
        if isinstance(image, np.ndarray) and self.zero_copy:
            self._register_ring(deadline)
        image = place(self.ring, request_id, image)
        frame = request_frame(request_id, image, into=self._spare, **options)  # type: ignore[arg-type]
        self._send_frame(frame, deadline)
        self._spare = frame
        self._pending.add(request_id)
        return request_id

    def _register_ring(self, deadline: float | None) -> None:
        """Register a ring (the handshake of ``wire.RegisterRegion``), once per connection;
        replies to other requests that arrive meanwhile are kept for their calls."""
        self.zero_copy = False
        ring = SlotRing()
        request_id = next(self._ids)
        try:
            frame = wire.encode_frame(wire.RegisterRegion(id=request_id, size=ring.size))
            self._send_frame(frame, deadline)
            self._pending.add(request_id)
            answer = self._receive_for(request_id, deadline)
            if isinstance(answer, wire.SendDescriptor):
                self._settimeout(deadline)
                try:
                    send_descriptor(self._sock, ring.fd)
                except OSError as exc:
                    raise self._named(exc) from None
                self._pending.add(request_id)
                answer = self._receive_for(request_id, deadline)
        except BaseException as exc:
            ring.close()
            if isinstance(exc, TimeoutError):  # cut mid-handshake: the stream cannot resume
                self.close()
            raise
        self.ring, self.zero_copy_error = accept_registration(ring, answer)

    def _send_frame(self, frame: bytearray, deadline: float | None) -> None:
        self._settimeout(deadline)
        try:
            self._sock.sendall(frame)
        except TimeoutError:  # part of a frame may be out: the stream cannot be resumed
            self.close()
            raise TimeoutError(f"scratchd at {self.path}: send timed out; closed") from None
        except OSError as exc:  # the daemon closed: its reason may wait unread, at a frame's start
            if not self._said and self._body is None and not self._got:
                self._said = frames.closing_reason(self._sock)
            raise self._named(exc) from None

    def _collect_one(self, in_flight: dict[int, int]) -> tuple[int, Reply]:
        deadline = self._deadline(None)
        for request_id in in_flight.keys() & self._early.keys():
            reply = self._take(request_id)
            assert isinstance(reply, Reply)
            return in_flight.pop(request_id), reply
        while True:
            message = self._read_message(deadline)
            if message.id in in_flight and isinstance(message, Reply):
                self._pending.discard(message.id)
                return in_flight.pop(message.id), message
            self._keep(message)

    def _receive_for(self, request_id: int, deadline: float | None) -> wire.DaemonMessage:
        try:
            if request_id in self._early:
                return self._take(request_id)
            while True:
                message = self._read_message(deadline)
                if message.id == request_id:
                    self._pending.discard(request_id)
                    return message
                self._keep(message)
        except TimeoutError:
            self._pending.discard(request_id)  # its reply, should it come, is dropped
            raise

    def _keep(self, message: wire.DaemonMessage) -> None:
        """Hold a reply another pending call will ask for; drop one nobody waits for."""
        if message.id in self._pending:
            self._early[message.id] = message

    def _take(self, request_id: int) -> wire.DaemonMessage:
        self._pending.discard(request_id)
        return self._early.pop(request_id)

    def _read_message(self, deadline: float | None) -> wire.DaemonMessage:
        """The next reply, read into buffers that outlive the call: a timeout part way
        through a frame leaves what came for the next call to complete."""
        if self._body is None:
            self._fill(self._prefix, deadline)
            length = wire.frame_length(self._prefix)
            if length > MAX_REPLY_BYTES:
                raise ConnectionError(
                    f"scratchd at {self.path}: reply frame of {length} bytes is larger than any"
                )
            self._body, self._got = bytearray(length), 0
        self._fill(self._body, deadline)
        body, self._body, self._got = self._body, None, 0
        message = wire.decode_daemon_message(body)  # from the buffer as it is: no copy
        if message.id == 0 and isinstance(message, Reply):  # to the connection
            self._said = f": {message.error}"
            if message.status == "error":  # refused
                raise ConnectionError(f"scratchd at {self.path}{self._said}")
        if self.ring is not None:  # answered: the daemon reads its slot no more
            self.ring.release(message.id)
        return message

    def _fill(self, buf: bytearray, deadline: float | None) -> None:
        view = memoryview(buf)
        while self._got < len(buf):
            self._settimeout(deadline)
            try:
                k = self._sock.recv_into(view[self._got :])
            except OSError as exc:
                raise self._named(exc) from None
            if k == 0:
                raise ConnectionError(f"scratchd at {self.path} closed the connection{self._said}")
            self._got += k
        self._got = 0

    def _settimeout(self, deadline: float | None) -> None:
        if deadline is None:
            self._sock.settimeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"scratchd at {self.path}: no reply within the timeout")
        self._sock.settimeout(left)

    def _named(self, exc: OSError) -> OSError:
        """``exc`` as the same type, naming the socket and the daemon's reason (errno kept)."""
        if isinstance(exc, TimeoutError):
            return TimeoutError(f"scratchd at {self.path}: no reply within the timeout")
        named = type(exc)(f"scratchd at {self.path}: {exc}{self._said}")
        named.errno = exc.errno
        return named

    def close(self) -> None:
        self._sock.close()
        if self.ring is not None:
            self.ring.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

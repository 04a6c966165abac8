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
uint8 numpy array ``(H, W)`` (grey) or ``(H, W, 3)`` (RGB) sent raw. Replies are
``scratchd.protocol.wire.Reply``; ``unpack_mask(reply)`` gives the mask as a 0/255 array.
Failures of the daemon are replies with a status, not exceptions; a lost connection raises
``ConnectionError`` for every request still in flight. Both clients send a ``ping`` as they
connect, so the daemon counts them as having spoken and never closes them to make room for
others however long they stay idle. A reply with id 0 is addressed to the connection, not to
a request: ``error`` refuses it (not on the allow-list, too many connections), which raises
``ConnectionError`` with the daemon's reason at once; any other is the reason the daemon is
about to close it, named by the ``ConnectionError`` that follows.

An array's pixels are copied once on their way to the socket: ``request_frame`` encodes them
straight from the array into the frame (a view of the array stands for ``pixels``, which
msgpack encodes as the same bin as the ``bytes`` would be), instead of ``tobytes`` and then a
zero-filled frame buffer and a second copy into it; the bytes sent are the same as
``wire.encode_frame(build_request(...))``'s. A connection also reuses its last frame's buffer
for the next one once the socket has taken all of it (``Client``: always; ``AsyncClient``:
when the transport kept none of it, so it holds no reference): a fresh megabyte buffer a
request costs its page faults again whenever malloc has handed the last one back to the
kernel (docs/benchmarks.md, front end).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Final, cast

import msgspec
import numpy as np

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

ImageInput = str | os.PathLike[str] | bytes | np.ndarray
MAX_REPLY_BYTES: Final = 256 * 1024 * 1024
SEND_BUFFER_BYTES: Final = 4 * 1024 * 1024


def build_request(
    request_id: int,
    image: ImageInput,
    *,
    part_class: str | None = None,
    priority: int | None = None,
    deadline_ms: int | None = None,
    want_mask: bool = False,
) -> wire.InferRequest:
    """The wire request for ``image`` (see the module docstring for accepted inputs)."""
    request = _request(request_id, image, part_class, priority, deadline_ms, want_mask)
    if isinstance(request.pixels, memoryview):
        return msgspec.structs.replace(request, pixels=request.pixels.tobytes())
    return request


def request_frame(
    request_id: int,
    image: ImageInput,
    *,
    part_class: str | None = None,
    priority: int | None = None,
    deadline_ms: int | None = None,
    want_mask: bool = False,
    into: bytearray | None = None,
) -> bytearray:
    """``wire.encode_frame(build_request(...))``'s bytes, an array's pixels copied only once:
    from the array into the frame, which grows as msgpack is written (not zero-filled).
    ``into``: a buffer to write the frame into (its contents replaced), else a new one."""
    request = _request(request_id, image, part_class, priority, deadline_ms, want_mask)
    return wire.encode_frame_into(request, bytearray(wire.PREFIX_BYTES) if into is None else into)


def _request(
    request_id: int,
    image: ImageInput,
    part_class: str | None,
    priority: int | None,
    deadline_ms: int | None,
    want_mask: bool,
) -> wire.InferRequest:
    """The request, an array's ``pixels`` a flat view of it (msgpack: the same bin)."""
    common = {
        "id": request_id,
        "part_class": part_class or "normal",
        "priority": priority,
        "deadline_ms": deadline_ms,
        "want_mask": want_mask,
    }
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"expected uint8 (H, W) or (H, W, 3), got {image.dtype} {image.shape}")
        channels = 1 if image.ndim == 2 else image.shape[2]
        view = np.ascontiguousarray(image).data.cast("B")
        return wire.InferRequest(
            pixels=cast(bytes, view),  # encoded from the buffer as is; never decoded
            height=image.shape[0],
            width=image.shape[1],
            channels=channels,
            **common,  # type: ignore[arg-type]
        )
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    return wire.InferRequest(encoded=data, **common)  # type: ignore[arg-type]


def _widen_send_buffer(sock: socket.socket | None) -> None:
    """Let a whole 1 MiB frame sit in the daemon's receive queue (the kernel caps this at
    ``net.core.wmem_max``): the daemon then reads a frame in one or two ``recv`` calls
    instead of one per ~200 KiB (the default send buffer), and wakes up that much less."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


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
    ) -> None:
        self.path = path
        self.timeout = timeout
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._spare: bytearray | None = None  # the last frame, all of it sent: reused
        self._waiting: dict[int, asyncio.Future[wire.DaemonMessage]] = {}
        self._closed_by = f"scratchd at {path}: the connection is closed"
        self._receiver = asyncio.get_running_loop().create_task(self._receive())
        writer.write(wire.encode_frame(wire.Ping(id=next(self._ids))))  # its pong is dropped

    @classmethod
    async def connect(cls, path: str | None = None, timeout: float | None = None) -> AsyncClient:
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
        _widen_send_buffer(writer.get_extra_info("socket"))
        return cls(reader, writer, where, timeout)

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

    async def _call(
        self, request_id: int, frame: bytearray, timeout: float | None, reuse: bool = False
    ) -> wire.DaemonMessage:
        if self._receiver.done():
            raise ConnectionError(self._closed_by)
        future: asyncio.Future[wire.DaemonMessage] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                # write() puts all of the frame in the transport: a timeout never cuts one
                self._writer.write(frame)
                if reuse and self._writer.transport.get_write_buffer_size() == 0:
                    self._spare = frame  # the socket took it all: the transport keeps none
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

    def __init__(self, path: str | None = None, timeout: float | None = None) -> None:
        self.path = socket_path(path)
        self.timeout = timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except OSError as exc:
            self._sock.close()
            raise self._named(exc) from None
        _widen_send_buffer(self._sock)
        self._ids = itertools.count(1)
        self._spare: bytearray | None = None  # the last frame (sendall sent it): reused
        self._pending: set[int] = set()  # sent, reply not yet handed to a caller
        self._early: dict[int, wire.DaemonMessage] = {}  # pending replies read by another call
        self._prefix = bytearray(wire.PREFIX_BYTES)  # the frame being read, kept across calls
        self._body: bytearray | None = None
        self._got = 0
        self._said = ""  # the daemon's reason for closing, from a reply with id 0
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
        frame = request_frame(request_id, image, into=self._spare, **options)  # type: ignore[arg-type]
        self._send_frame(frame, deadline)
        self._spare = frame
        self._pending.add(request_id)
        return request_id

    def _send_frame(self, frame: bytearray, deadline: float | None) -> None:
        self._settimeout(deadline)
        try:
            self._sock.sendall(frame)
        except TimeoutError:  # part of a frame may be out: the stream cannot be resumed
            self.close()
            raise TimeoutError(f"scratchd at {self.path}: send timed out; closed") from None
        except OSError as exc:
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
        """``exc`` as the same type, its message naming the socket (and its errno kept)."""
        if isinstance(exc, TimeoutError):
            return TimeoutError(f"scratchd at {self.path}: no reply within the timeout")
        named = type(exc)(f"scratchd at {self.path}: {exc}")
        named.errno = exc.errno
        return named

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

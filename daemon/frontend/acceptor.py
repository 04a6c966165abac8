"""The acceptor: the daemon's Unix socket; each client connection is a ``Connection``
protocol (``daemon/frontend/connection.py``) that reads frames straight into reused buffers.

Per frame (see ``scratchd.protocol.wire`` for the format), in this order:

1. the 4-byte length is checked against the frame cap *before* the body is read
   (cap = 3 x ``slot_bytes`` for raw RGB + 64 KiB); after an oversized frame (body never read)
   or a body not whole within ``frame_timeout_ms`` nothing more is read: the requests accepted
   on it are answered, then one ``invalid`` (id 0), and it closes (``Connection.end``);
2. typed msgpack decode (``wire.decode_client_frame``: raw pixels stay a view of the
   received frame); a body that fails it, however malformed (nested thousands deep, sizes
   that lie), is answered ``invalid`` with the reason (addressed to the body's ``id`` when
   one can be read) and the connection carries on, its requests in flight answered as
   usual; the log gets a throttled ``malformed_frame`` warning, never a traceback;
3. resolve the part class (``daemon/frontend/admission.py``) and check the image's declared size
   (``invalid`` with a reason; ``daemon/frontend/images.py``);
4. weigh the request against the load (``daemon/frontend/overload.py``): ``overloaded``
   at once (backpressure, with the reason) when its deadline cannot be met behind the work
   queued ahead of it, or when no slot is left that its priority may take and no queued
   request of lower priority can be shed for it; else ``reserve()`` a descriptor (after
   shedding one, answered ``overloaded``, when that was needed);
5. write the image into the reserved payload slot as raw greyscale: raw grey pixels are copied
   on the loop, from the frame's buffer (one memcpy: the only copy the daemon makes of
   them); encoded images (PNG/BMP/JPEG, ``decode_image``) and raw RGB (copied out of the
   frame first: the buffer is reused by the next frame) are converted in a thread pool
   straight into the slot, never on the loop; raw grey pixels in a client's published region
   (``daemon/frontend/regions.py``) are not copied at all: the request names them and its
   worker reads them in place;
6. ``submit()`` and record the request in the dispatcher's in-flight table.

Large raw frames skip the copy of step 5: once the connection has read where a frame's pixels
lie it asks for a slot (``lend_slot``) and the kernel writes them straight into it (in the
receive threads with ``[server] receive_threads`` > 0, ``daemon/frontend/receiver.py``); the
frame then arrives through ``slot_frame``. Lending cannot change a frame's reply: no slot is
lent when draining, at the in-flight limit, or for more pixels than a slot holds, and at most
``lend_limit`` = ``max(1, slots // 4)`` at once, only while more than that are free, so
clients that stall mid-frame cannot take the last free slots from complete frames.

No slot leaks: a reserved descriptor is either submitted or released on every path
(a decode failure, any exception, the client having left meanwhile); a lent one is the
connection's until its frame is whole (``daemon/frontend/connection.py``), then this module's.
Decode tasks are never cancelled: a thread may still be writing into the slot, so the slot
is released only after the thread is done. When a client disconnects,
``abandon_connection`` hands the queue the rest: queued requests are freed, claimed ones
when their worker finishes.
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
from pathlib import Path
from typing import Final

import msgspec

from scratchd.daemon.config import Config
from scratchd.daemon.frontend import images, overload, raw_frames
from scratchd.daemon.frontend.access import AccessGate, AccessPolicy, peer_ids
from scratchd.daemon.frontend.admission import Admission, PartClasses, Refused
from scratchd.daemon.frontend.buffers import BufferPool, ReceiveBudget
from scratchd.daemon.frontend.connection import Connection, SlotLoan
from scratchd.daemon.frontend.dispatch import Dispatcher, InFlight, Peer
from scratchd.daemon.frontend.places import UNKNOWN, Caps, Places
from scratchd.daemon.frontend.receiver import ReceivePool
from scratchd.daemon.frontend.regions import RegionDesk
from scratchd.daemon.frontend.socket_file import clear_stale_socket
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Handle, RequestQueue
from scratchd.ipc.regions import Region
from scratchd.protocol import wire
from scratchd.protocol.image import ImageError
from scratchd.protocol.log import Throttle, log_event

__all__ = ["Acceptor"]

DECODE_THREADS: Final = 2


class Acceptor:
    """Accepts connections and turns frames into queued requests or immediate replies.

    ``status`` builds the reply to a status request; ``draining`` (set by the daemon on
    SIGTERM) makes new inference requests get ``overloaded`` while accepted ones finish.
    It is every connection's ``FrameHandler`` (``daemon/frontend/connection.py``).
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
        self.frame_timeout_s = config.server.frame_timeout_ms / 1000.0
        self.pool = BufferPool()
        self.budget = ReceiveBudget(config.server.receive_budget_mb * 1024 * 1024)
        threads = config.server.receive_threads
        self.receiver = ReceivePool(threads) if threads else None
        self.lent = 0  # payload slots lent to connections receiving pixels into them
        self.lend_limit = max(1, config.queue.slots // 4)
        self.connections: dict[int, Connection] = {}
        self.classes = PartClasses(config)
        self._keep = [overload.keep_free(p, config.queue) for p in range(wire.PRIORITIES)]
        self.gate = AccessGate.from_config(config.server.allowed_uids, config.server.allowed_gids)
        self.regions = RegionDesk(lambda: self.config.server, queue.regions)
        self.places: Places[Connection] = Places(Caps.of(config.server))
        self._full = Throttle("connections_full", burst=5, window=60.0)
        self._evicted = Throttle("silent_connection_closed", burst=5, window=60.0)
        self._ids = itertools.count(1)
        self._malformed = Throttle("malformed_frame", burst=5, window=60.0)
        self._decoding: set[asyncio.Task[None]] = set()
        self.converting = [0] * wire.PRIORITIES  # images in the decode pool, by priority
        self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="scratchd-decode")
        self._server: asyncio.AbstractServer | None = None
        self._path: str | None = None

    # ---- the listening socket ---------------------------------------------------------

    async def listen(self, path: str, sock: socket.socket | None = None) -> None:
        """Listen on ``path`` (or on an inherited, already-bound ``sock``)."""
        loop = asyncio.get_running_loop()

        def connection() -> Connection:
            return Connection(next(self._ids), self)

        if sock is None:
            clear_stale_socket(path)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._server = await loop.create_unix_server(connection, path=path)
            os.chmod(path, self.config.server.socket_mode)
            self._path = path
        else:
            self._server = await loop.create_unix_server(connection, sock=sock)

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
        """Wait for running decodes, then flush and close every connection (which cancels its
        receive thread's job), and wait for the receive threads to give their slots back."""
        await self.wait_for_decodes()
        conns = list(self.connections.values())
        for conn in conns:
            conn.close()
        for conn in conns:
            await conn.wait_closed(1.0)
        if self.receiver is not None:
            await self.receiver.wait_idle()
            self.receiver.shutdown()
        self._pool.shutdown(wait=True)

    # ---- one connection (FrameHandler) ------------------------------------------------

    def opened(self, conn: Connection) -> str | None:
        """Register ``conn``; None to serve it, else why it is refused (not on the
        allow-list, or a connection cap is full and no silent connection makes room:
        ``daemon/frontend/places.py``)."""
        self.connections[conn.id] = conn
        refusal = self.gate.admit(conn.socket())
        if refusal is not None:
            return refusal
        uid, pid = peer_ids(conn.socket()) or (UNKNOWN, UNKNOWN)
        decision = self.places.open(conn, uid, pid, time.monotonic())
        for victim in decision.evict:
            self._evict(victim)
        if decision.refusal is not None:
            self.gate.over_limit += 1
            self._full.log(logging.WARNING, uid=uid, pid=pid, limit=decision.limit)
        return decision.refusal

    def _evict(self, conn: Connection) -> None:
        """Close a silent connection to make room (one ``error`` reply, id 0, says why)."""
        silent_ms = self.config.server.first_frame_timeout_ms
        reason = (
            f"no frame within {silent_ms} ms of connecting while connections are at their "
            "limit: closed to make room; closing the connection"
        )
        self._evicted.log(logging.WARNING, conn=conn.id)
        conn.send(wire.Reply(id=0, status="error", error=reason))
        conn.close()

    def refused(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        """After the refusal reply: let the peer's first request arrive, then close."""
        assert conn.transport is not None
        writer = asyncio.StreamWriter(conn.transport, conn, reader, asyncio.get_running_loop())
        self.gate.close_after_linger(reader, writer, conn.close)

    def oversized(self, conn: Connection, length: int) -> None:
        self._close_stream(conn, f"frame of {length} bytes exceeds the limit of {self.max_frame}")

    def stalled(self, conn: Connection, length: int) -> None:
        timeout_ms = self.config.server.frame_timeout_ms
        self._close_stream(
            conn, f"frame body of {length} bytes not received within {timeout_ms} ms"
        )

    def _close_stream(self, conn: Connection, reason: str) -> None:
        """A stream that can no longer be trusted: its requests answered, one ``invalid``
        reply (id 0) says why, then it closes (``Connection.end``)."""
        reply = wire.Reply(id=0, status="invalid", error=reason + "; closing the connection")
        self.dispatcher.account(InFlight(conn, 0, "unknown", 0, time.monotonic_ns()), reply, None)
        conn.end(reply)

    def closed(self, conn: Peer) -> None:
        """The client left (or was closed): drop its requests from the books."""
        self.connections.pop(conn.id, None)
        self.dispatcher.forget_connection(conn)
        self.queue.abandon_connection(conn.id)
        if isinstance(conn, Connection):  # a Unix-socket client: its place and its regions
            self.places.close(conn)
            self.regions.release(conn)

    def frame(self, conn: Connection, body: memoryview, received_ns: int) -> None:
        self.places.spoke(conn)
        try:  # decode, then answer it or admit it: one frame (frames cost, per request)
            try:
                message = wire.decode_client_frame_raw(body)
            except Exception as exc:  # whatever the body: a malformed one, never a bug here
                rid, reason = wire.salvage_request_id(body), wire.decode_failure(exc)
                self._malformed.log(logging.WARNING, conn=conn.id, id=rid, reason=reason)
                flight = InFlight(conn, rid, "unknown", 0, received_ns)
                self.dispatcher.reject(flight, "invalid", f"malformed request: {reason}")
                return
            if not isinstance(message, wire.InferFrame):  # the rare kinds: one test for the usual
                if isinstance(message, wire.StatusRequest):
                    conn.send(self.status(message.id))
                elif isinstance(message, wire.Ping):
                    conn.send(wire.Pong(id=message.id))
                else:
                    self.regions.register(conn, message)
                return
            region = None
            if message.region:  # zero-copy: the pixels are read from the client's region
                try:
                    message, region = self.regions.resolve(conn, message)
                except images.Invalid as exc:
                    flight = InFlight(conn, message.id, "unknown", 0, received_ns)
                    flight.want_mask = message.want_mask
                    self.dispatcher.reject(flight, "invalid", str(exc))
                    return
            self._admit(conn, message, received_ns, None, region)
        except Exception as exc:
            self._answer_bug(conn, wire.salvage_request_id(body), received_ns, exc)

    def _answer_bug(self, conn: Peer, request_id: int, received_ns: int, exc: Exception) -> None:
        """A bug must cost one reply, not the connection: logged, answered ``error``."""
        log_event("request_failed", logging.ERROR, error=repr(exc))
        flight = InFlight(conn, request_id, "unknown", 0, received_ns)
        self.dispatcher.reject(flight, "error", f"internal error: {exc}")

    def lend_slot(self, conn: Connection, nbytes: int) -> SlotLoan | None:
        """A slot for ``nbytes`` of raw pixels about to arrive on ``conn``, while lending one
        cannot change the frame's reply and leaves ``lend_limit`` slots free (module
        docstring); else None."""
        if self.lent >= self.lend_limit or self._refusal_at_door(conn) is not None:
            return None
        if not 0 < nbytes <= self.config.queue.slot_bytes:
            return None
        if self.queue.free_count() <= self.lend_limit:
            return None  # scarce: the last free slots go to frames already whole
        handle = self.queue.reserve()
        if handle is None:
            return None
        self.lent += 1
        return SlotLoan(handle, self.queue.payload(handle)[:nbytes])

    def return_slot(self, loan: SlotLoan) -> None:
        self.lent -= 1
        self.queue.release(loan.handle)

    def slot_frame(
        self, conn: Connection, body: memoryview, loan: SlotLoan, received_ns: int
    ) -> bool:
        """A frame whose pixels arrived in ``loan``'s slot and ``body`` is the rest (see
        ``raw_frames.hide_pixels``). False, touching nothing, unless it is an inference request
        whose only ``pixels`` are those; else handled as ``frame`` would, the slot with it."""
        self.places.spoke(conn)
        try:
            message = raw_frames.decode_without_pixels(body)
            if message is None:
                return False
            request = msgspec.structs.replace(message, pixels=loan.view)
        except Exception:  # the frame path decodes the body as sent, for the same reason
            return False
        self.lent -= 1  # the slot is _admit's now: submitted or released there
        try:
            self._admit(conn, request, received_ns, loan.handle)
        except Exception as exc:
            self._answer_bug(conn, request.id, received_ns, exc)
        return True

    def new_peer_id(self) -> int:
        """A connection id no Unix-socket connection has: for another front end's peers."""
        return next(self._ids)

    def admit(self, peer: Peer, request: wire.InferFrame, received_ns: int) -> None:
        """Queue a request another front end decoded (``daemon/kserve/``), or answer it on
        ``peer``: the same classes, checks, door and queue as a Unix-socket frame's."""
        try:
            self._admit(peer, request, received_ns, None)
        except Exception as exc:
            self._answer_bug(peer, request.id, received_ns, exc)

    def _admit(
        self, conn: Peer, request: wire.InferFrame, received_ns: int, lent: Handle | None,
        region: Region | None = None,
    ) -> None:  # fmt: skip
        """Queue ``request`` or answer it. ``lent``: the slot its pixels were received into
        (``request.pixels`` is a view of it); submitted or released here, whatever happens.
        ``region``: the client region ``request.pixels`` lie in; grey ones are queued naming
        it when it is published (``ipc/region_table.py``), never copied."""
        flight = InFlight(conn, request.id, "unknown", 0, received_ns, request.want_mask)
        try:
            admission = self._admission(request, flight, region is not None)
        except BaseException as exc:
            if lent is not None:  # refused or whatever went wrong, a lent slot goes back
                self.queue.release(lent)
            if not isinstance(exc, Refused):
                raise
            self.dispatcher.reject(flight, exc.status, str(exc))
            return
        flight.deadline_ns = received_ns + admission.deadline_ms * NS_PER_MS
        handle = self._take_slot(flight, lent)
        if handle is None:
            return
        flight.handle = handle
        try:
            if request.encoded is None and request.channels == 1:
                shape, named = (request.height, request.width), None
                if region is not None and region.row is not None:  # read in place by workers
                    named = (region.row, region.generation, request.offset)
                elif lent is None:
                    shape = images.write_raw_grey(self.queue.payload(handle), request)
                self._submit(flight, admission, shape, named)
                return
            if request.pixels is not None and not request.region:  # raw RGB: off the frame
                # buffer (or slot) it is in; a region's pixels stay put (regions.py)
                request = msgspec.structs.replace(request, pixels=memoryview(bytes(request.pixels)))
        except Exception as exc:  # not published: the slot is still ours to give back
            self.queue.release(handle)
            self.dispatcher.reject(flight, "error", f"could not queue the request: {exc}")
            return
        self._start_conversion(flight, admission, request)  # its task releases the slot now

    def _take_slot(self, flight: InFlight, lent: Handle | None) -> Handle | None:
        """A slot for an admitted request, or None when it was refused ``overloaded`` here
        (daemon/frontend/overload.py): its deadline cannot be met behind the work queued
        ahead of it, or no slot is left that its priority may take and no request of lower
        priority is queued to shed. ``lent``: the slot it was received into (kept, unless it
        is refused; lent only while free slots abound, so that is a reserved-share case)."""
        queue, limits, priority = self.queue, self.config.queue, flight.priority
        refusal = overload.late(self.dispatcher.service, queue, flight.deadline_ns, priority,
                                len(self.dispatcher.pending), self.converting)  # fmt: skip
        if refusal is None and lent is not None:
            if overload.place(priority, queue.free_count() + 1, limits):
                return lent
            refusal = overload.full_reason(priority, limits)
        if refusal is None:  # the usual: a slot its priority may take, or make room
            handle, shed = overload.take_slot(queue, priority, self._keep[priority])
            if shed is not None:
                self.dispatcher.shed(shed)
            if handle is not None:
                return handle
            refusal = overload.full_reason(priority, limits)
        if lent is not None:
            queue.release(lent)
        self.dispatcher.reject(flight, "overloaded", refusal)
        return None

    def _start_conversion(
        self, flight: InFlight, admission: Admission, request: wire.InferFrame
    ) -> None:
        """Convert an encoded or raw RGB image (its pixels already copied off the frame) into
        its slot in the decode pool, then submit."""
        task = asyncio.get_running_loop().create_task(
            self._convert_and_submit(flight, admission, request)
        )
        self._decoding.add(task)
        task.add_done_callback(self._decoding.discard)
        self.converting[flight.priority] += 1  # ahead of later requests once submitted

        def converted(_: object, priority: int = flight.priority) -> None:
            self.converting[priority] -= 1

        task.add_done_callback(converted)
        flight.conn.converting += 1
        task.add_done_callback(flight.conn.converted)

    def _admission(self, request: wire.InferFrame, flight: InFlight, region: bool) -> Admission:
        """Where ``request`` goes, or ``Refused``: in this order, an invalid class or image,
        a draining daemon, the connection's in-flight limit. ``region``: its pixels lie in
        a client region (``RegionDesk.resolve`` checked them there): only the shape is left."""
        try:
            admission = self.classes.classify(request)
            flight.part_class, flight.priority = admission.class_name, admission.priority
            slot_bytes = self.config.queue.slot_bytes
            if region:  # the bytes it names were checked there: only its shape is left
                images.check_shape(request.height, request.width, request.channels, slot_bytes)
            else:
                images.check_image(request, slot_bytes)
        except images.Invalid as exc:
            raise Refused("invalid", str(exc)) from None
        refusal = self._refusal_at_door(flight.conn)
        if refusal is not None:
            raise refusal
        return admission

    def _refusal_at_door(self, conn: Peer) -> Refused | None:
        """Why any inference request arriving on ``conn`` now is refused, whatever it holds:
        in this order, a draining daemon, the connection's in-flight limit; else None."""
        if self.draining:
            return Refused("overloaded", "daemon is shutting down")
        limit = self.config.server.max_in_flight_per_connection
        if conn.in_flight() >= limit:
            reason = f"{limit} requests already in flight on this connection (limit per connection)"
            return Refused("overloaded", reason)
        return None

    async def _convert_and_submit(
        self, flight: InFlight, admission: Admission, request: wire.InferFrame
    ) -> None:
        assert flight.handle is not None
        handle, submitted = flight.handle, False
        try:
            payload = self.queue.payload(handle)
            loop = asyncio.get_running_loop()
            shape = await loop.run_in_executor(self._pool, images.convert_into, payload, request)
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

    def _submit(
        self, flight: InFlight, admission: Admission, shape: tuple[int, int],
        region: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
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
            region=region,
        )
        self.dispatcher.enqueued(flight)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded configuration (classes, allow-list, in-flight limit); the socket
        and the queue geometry do not change while running."""
        self.config = config
        self.classes = PartClasses(config)
        self._keep = [overload.keep_free(p, config.queue) for p in range(wire.PRIORITIES)]
        self.places.caps = Caps.of(config.server)
        self.gate.policy = AccessPolicy.from_lists(
            config.server.allowed_uids, config.server.allowed_gids
        )

"""Client regions on the daemon's side: the registration handshake and the per-connection table
that zero-copy requests name (``protocol/wire.py`` ``RegisterRegion``; the checks a descriptor
and every read pass are ``ipc/regions.py``'s).

Registration, on the event loop (a descriptor travels only with bytes read by ``recvmsg``, and
the connection's transport reads with plain ``recv``, which would drop it)::

    client                          daemon (RegionDesk)
    RegisterRegion{id, size}  ──▶   limits checked (count per connection, bytes per daemon);
                                    refused: RegionReply{status}, nothing else changes
                                    else: the transport's reading paused, a duplicate of the
                                    socket watched, the bytes reserved
                              ◀──   SendDescriptor{id}
    1 byte + SCM_RIGHTS(fd)   ──▶   recvmsg(1 byte, ancillary, MSG_CMSG_CLOEXEC); reading
                                    resumed; the descriptor checked and mapped read-only
                                    (ipc/regions.py), then closed
                              ◀──   RegionReply{id, status, region}

A refused descriptor (not a sealed memfd, too small) is answered ``invalid`` and the connection
carries on: the stream is still in step. A byte that is not :data:`wire.DESCRIPTOR_BYTE` with
exactly one descriptor, or nothing within ``frame_timeout_ms``, means the client did not follow
the handshake: ``invalid``, and the connection is closed. Any descriptor received is closed
whatever happens (extra ones included), and all of them are received close-on-exec, so none
leaks into a worker started later.

Ownership: a region belongs to the connection that registered it and is found only through it
(ids count from 1 per connection, so naming another connection's region finds nothing). A
registered region is published in the queue's region table (``ipc/region_table.py``): a raw
grey request naming it is queued naming it too, and the worker that claims the request reads
the pixels in place; the main process copies nothing. Raw RGB ones are converted from the
region into the request's slot in the decode pool. (When the table is full, or workers could
not open the daemon's descriptors, a region is not published and its grey pixels are copied
into the slot on the loop.) The client must not write a slot before its request's reply:
workers read it until then. When the connection closes its regions are retired: each stays
mapped, in the daemon and in the table, until the last request naming it is answered or
dropped, then is unmapped; a conversion still reading one keeps the daemon's mapping until it
is done (``Region.close``).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import msgspec

from scratchd.daemon.config import ServerConfig
from scratchd.daemon.frontend.connection import Connection
from scratchd.daemon.frontend.dispatch import Peer
from scratchd.daemon.frontend.images import Invalid
from scratchd.ipc.region_table import RegionTable
from scratchd.ipc.regions import Region, RegionError
from scratchd.protocol import wire
from scratchd.protocol.log import log_event

MAX_DESCRIPTORS: Final = 4
"""Room for this many descriptors in the handshake's ``recvmsg``: one is expected; the others
are received only to be closed (the kernel closes any beyond the room)."""
_FD_BYTES: Final = array.array("i").itemsize


@dataclass(eq=False)
class _Handshake:
    """A registration waiting for its descriptor byte."""

    message: wire.RegisterRegion
    conn: Connection
    sock: socket.socket  # a duplicate of the connection's socket, watched for the byte
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Regions:
    """One connection's regions and its handshake in progress."""

    by_id: dict[int, Region] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    handshake: _Handshake | None = None


class RegionDesk:
    """Every connection's registered regions, the bytes mapped, and the handshakes in flight.

    ``server`` gives the current ``[server]`` section (a reload changes the limits for the
    registrations that follow); ``table`` is the queue's region table, where registered
    regions are published for the workers."""

    def __init__(self, server: Callable[[], ServerConfig], table: RegionTable) -> None:
        self._server = server
        self._table = table
        self._conns: dict[int, _Regions] = {}
        self._reserved = 0  # bytes of handshakes in flight

    @property
    def mapped_bytes(self) -> int:
        """Bytes of client regions mapped (registered, or retired but still named by a
        request) and reserved by handshakes in flight, all connections: what
        ``max_region_bytes`` limits."""
        registered = sum(r.size for c in self._conns.values() for r in c.by_id.values())
        return registered + self._reserved + self._table.retiring_bytes()

    def registered(self, conn: Connection) -> int:
        """How many regions ``conn`` has registered."""
        regions = self._conns.get(conn.id)
        return 0 if regions is None else len(regions.by_id)

    # ---- registration -----------------------------------------------------------------

    def register(self, conn: Connection, message: wire.RegisterRegion) -> None:
        """Start ``message``'s handshake on ``conn``, or answer its refusal."""
        regions = self._conns.setdefault(conn.id, _Regions())
        if regions.handshake is not None:
            self._abort(conn, message.id, "a region registration is already waiting for its byte")
            return
        refusal = self._refusal(regions, message.size)
        sock = None if refusal else self._duplicate(conn)
        if refusal or sock is None:
            reason = refusal or "the connection has no socket"
            conn.send(wire.RegionReply(id=message.id, status="overloaded", error=reason))
            return
        assert conn.transport is not None
        loop = asyncio.get_running_loop()
        handshake = _Handshake(message, conn, sock)
        regions.handshake = handshake
        self._reserved += message.size  # until registered or given up
        conn.transport.pause_reading()  # the byte is this handshake's to read, not the loop's
        loop.add_reader(sock.fileno(), self._readable, conn, regions)
        timeout = self._server().frame_timeout_ms / 1000.0
        handshake.timer = loop.call_later(timeout, self._timed_out, conn, regions)
        conn.send(wire.SendDescriptor(id=message.id))

    def _refusal(self, regions: _Regions, size: int) -> str:
        server = self._server()
        limit = server.max_regions_per_connection
        if len(regions.by_id) >= limit:
            return f"{limit} regions already registered on this connection (limit per connection)"
        if self.mapped_bytes + size > server.max_region_bytes:
            return (
                f"registering {size} bytes would map more than the daemon's "
                f"{server.max_region_bytes} bytes of client regions"
            )
        return ""

    @staticmethod
    def _duplicate(conn: Connection) -> socket.socket | None:
        """A duplicate of ``conn``'s socket (close-on-exec), so the handshake watches its own
        descriptor while the transport's stays registered, paused, with the loop."""
        if conn.transport is None or conn.closed:
            return None
        sock = conn.transport.get_extra_info("socket")
        if sock is None:
            return None
        return socket.fromfd(sock.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)

    def _readable(self, conn: Connection, regions: _Regions) -> None:
        handshake = regions.handshake
        if handshake is None:
            return
        try:
            data, ancillary, flags, _ = handshake.sock.recvmsg(
                1, socket.CMSG_SPACE(MAX_DESCRIPTORS * _FD_BYTES), socket.MSG_CMSG_CLOEXEC
            )
        except (BlockingIOError, InterruptedError):
            return  # woken for nothing: keep watching
        except OSError:
            data, ancillary, flags = b"", [], 0  # the loop meets the error itself on resume
        fds = _descriptors(ancillary)
        try:
            self._finish(regions)
            message = handshake.message
            if not data:  # EOF or error: the transport, reading again, sees it and closes
                return
            if data != wire.DESCRIPTOR_BYTE or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                self._abort(conn, message.id, "expected one byte carrying one descriptor")
                return
            self._map(conn, regions, message, fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _map(
        self, conn: Connection, regions: _Regions, message: wire.RegisterRegion, fd: int
    ) -> None:
        try:
            region = Region.from_descriptor(next(regions.ids), fd, message.size)
        except RegionError as exc:
            conn.send(wire.RegionReply(id=message.id, status="invalid", error=str(exc)))
            return
        regions.by_id[region.id] = region
        published = self._table.publish(region)
        log_event("region_registered", logging.DEBUG, conn=conn.id, region=region.id,
                  size=region.size, published=published)  # fmt: skip
        conn.send(wire.RegionReply(id=message.id, status="ok", region=region.id))

    def _timed_out(self, conn: Connection, regions: _Regions) -> None:
        handshake = regions.handshake
        if handshake is not None:
            self._finish(regions)
            timeout_ms = self._server().frame_timeout_ms
            reason = f"no descriptor byte within {timeout_ms} ms of SendDescriptor"
            self._abort(conn, handshake.message.id, reason)

    def _finish(self, regions: _Regions) -> None:
        """End the handshake in progress: stop watching, give back the reserved bytes,
        let the transport read again."""
        handshake, regions.handshake = regions.handshake, None
        if handshake is None:
            return
        self._reserved -= handshake.message.size
        if handshake.timer is not None:
            handshake.timer.cancel()
        with contextlib.suppress(Exception):  # the loop may be closing
            asyncio.get_running_loop().remove_reader(handshake.sock.fileno())
        handshake.sock.close()
        conn = handshake.conn
        if conn.transport is not None and not conn.closed:
            conn.transport.resume_reading()

    @staticmethod
    def _abort(conn: Connection, request_id: int, reason: str) -> None:
        """The client broke the handshake: where the stream stands is unknown, so close."""
        reply = wire.RegionReply(id=request_id, status="invalid", error=reason + "; closing")
        conn.send(reply)
        conn.close()

    # ---- use and release --------------------------------------------------------------

    def resolve(self, conn: Connection, request: wire.InferFrame) -> tuple[wire.InferFrame, Region]:
        """``request`` and the one of ``conn``'s regions it names, the bytes it names checked
        to lie inside; :class:`Invalid` if it names none or bytes outside it. Its ``pixels``
        become a read-only view of those bytes where the main process reads them (RGB to
        convert, a region not published to copy); grey ones in a published region stay
        unset: workers read them in place."""
        regions = self._conns.get(conn.id)
        region = None if regions is None else regions.by_id.get(request.region)
        if region is None:
            raise Invalid(f"region {request.region} is not registered on this connection")
        if request.pixels is not None or request.encoded is not None:
            raise Invalid("a request that names a region carries no 'pixels' or 'encoded'")
        h, w, c = request.height, request.width, request.channels
        if c not in (1, 3) or h <= 0 or w <= 0:
            raise Invalid(f"region image needs height, width > 0 and channels 1 or 3: {h}x{w}x{c}")
        try:
            region.check(request.offset, h * w * c)
        except RegionError as exc:
            raise Invalid(str(exc)) from None
        if c == 1 and region.row is not None:
            return request, region
        return msgspec.structs.replace(
            request, pixels=region.view(request.offset, h * w * c)
        ), region

    def release(self, conn: Peer) -> None:
        """``conn`` is gone: end its handshake and retire its regions (each unmapped once no
        request names it, ``ipc/region_table.py``; a conversion still reading one keeps the
        daemon's mapping until done)."""
        regions = self._conns.pop(conn.id, None)
        if regions is None:
            return
        self._finish(regions)
        for region in regions.by_id.values():
            self._table.retire(region)


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """Every descriptor in ``recvmsg``'s ancillary data (to be used or closed)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _FD_BYTES])
    return list(fds)

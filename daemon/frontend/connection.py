"""One client connection: frames read straight into reused buffers, replies written back.

A :class:`Connection` is the connection's ``asyncio.BufferedProtocol``: the event loop
``recv``\\ s into memory this class lends it (``get_buffer``). A large raw image is received
straight into the payload slot it will be served from (the pixels that came in ``head`` with
the frame's start are copied from there once, by ``_start_slot``); any other frame into a
reused buffer, then, if it is an image, once more by the acceptor into its slot. Nothing in
between (no stream buffer, no ``bytes`` per read, no copy of the body or of ``pixels`` when
decoding: ``wire.decode_client_frame``).

Reading is a small state machine (:class:`ReadState`); what is lent in each state::

    HEAD   head (64 KiB, the connection's own)    ┌─────┬──────────┬─────┬──────────┬──...
           complete frames are handled in place:  │ len │ body     │ len │ body ... │
           views of ``head``; leftover bytes      └─────┴──────────┴─────┴──────────┴──...
           move to its front
    SLOT   a frame too big for ``head`` whose      head: │ body before pixels │ c4 00 │ after │
           first SCAN_BYTES show raw ``pixels``          (``hide_pixels``)        ▲ then these
           (``raw_frames.locate_pixels``) that a  slot:  │ pixels ...................│ first
           slot lent by the handler holds: those bytes go straight into the slot, then the
           few after them into ``head`` behind the body's start with the pixels taken out
    BODY   body[got:granted] (from the           any other frame too big for ``head``: the
           acceptor's BufferPool, returned when   part already in ``head`` is moved over first;
           it is done)                            ``granted`` grows as bytes arrive, within the
                                                  daemon's ReceiveBudget (``buffers.py``)
    ENDING reading paused (``end``): the requests accepted are answered, then its last reply
    CLOSED nothing more is handled. Neither holds receive memory (head, body, slot given up;
           a read that comes anyway lands in one shared scratch buffer and is dropped)

The length prefix is checked against the frame cap before a byte of the body is read
(``FrameHandler.oversized``); a body must arrive within ``frame_timeout_ms`` of its prefix
(a timer armed at the prefix, cancelled when the frame is whole; ``FrameHandler.stalled``).
Each complete frame goes to ``FrameHandler.frame(conn, body, received_ns)`` synchronously,
on the loop: ``body`` is a view reused after the call returns (the handler copies what it keeps).

A SLOT frame goes to ``FrameHandler.slot_frame(conn, body, loan, received_ns)`` instead
(``body`` without its pixels, which are in ``loan.view``). A lent slot is never leaked: it
is the connection's from ``lend_slot`` until the frame is whole, then the handler's if
``slot_frame`` takes it (True: it submits or releases it); otherwise (False: a body that does
not decode, a status request, a second ``pixels`` key) the body is rebuilt as sent
(``raw_frames.rebuild_body``) into a pool buffer, the slot goes back (``return_slot``) and the
frame takes the ``frame`` path, so every reply is what it would have been. A connection closed
or lost mid-frame returns its slot at once (or once a receive thread filling it let go).

Off the loop (``[server] receive_threads`` > 0): in SLOT, when at least ``receiver.min_bytes``
of pixels are still to come and already in the socket (``ReceivePool.worth``), reading is
paused and a receive thread (``receiver.py``) fills the rest of the slot, then the frame's tail
in head, as far as the socket holds them (a thread never waits for a sender). ``_received``
goes on as ``buffer_updated`` would have with those bytes. A short count (socket dry, EOF,
error) is fewer bytes: another job if a burst is there again, else reading resumes and the
loop receives the rest, ``SLOT_READ_BYTES`` a read, checking after each whether a burst waits
for a thread. The stall timer runs throughout. Closed or lost meanwhile, the job is cancelled
and ``_received`` returns the slot, once. After a frame finished off the loop the next read of
head asks only ``PEEK_BYTES`` (``_peek``): a next large frame's pixels are not copied on the loop.

Replies (``send``) are queued and written together at the end of the loop's turn, encoded into
one buffer: one ``write``; ``close`` writes what is queued first. ``end`` stops reading but
writes on until every request accepted on the connection is answered.

A refused connection (allow-list, connection limit) is decided in ``connection_made``; it is
then handed to ``AccessGate.linger`` through a ``StreamReader`` this protocol feeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import mmap
import time
from typing import Final, Protocol, cast

from scratchd.daemon.frontend import raw_frames
from scratchd.daemon.frontend.access import LINGER_BYTES, SupportsGetsockopt
from scratchd.daemon.frontend.buffers import BODY_ROUND, BufferPool, ReceiveBudget
from scratchd.daemon.frontend.raw_frames import SlotLoan
from scratchd.daemon.frontend.receiver import ReceiveJob, ReceivePool
from scratchd.ipc.queue import Handle
from scratchd.protocol import wire
from scratchd.protocol.log import log_event

HEAD_BYTES: Final = 64 * 1024
SCAN_BYTES: Final = 1024
"""How much of a large frame's body is awaited (and searched) for where its pixels lie."""
SLOT_READ_BYTES: Final = 64 * 1024
"""SLOT with a receive pool: the most pixels one read on the loop takes, so that a burst that
piled up while the loop was busy goes to a thread after the first 64 KiB of it."""
PEEK_BYTES: Final = wire.PREFIX_BYTES + SCAN_BYTES
"""How much the read after a frame received off the loop asks for: enough to lend a slot."""
REFUSED_FEED_BYTES: Final = LINGER_BYTES + HEAD_BYTES
"""What a refused peer may still send into ``linger``'s reader (it reads LINGER_BYTES)."""
_DISCARD: Final = memoryview(bytearray(HEAD_BYTES))  # ENDING and CLOSED read here (dropped)


class ReadState(enum.Enum):
    HEAD = "head"
    SLOT = "slot"
    BODY = "body"
    ENDING = "ending"
    CLOSED = "closed"


HEAD, SLOT, BODY, ENDING, CLOSED = ReadState  # constants: ReadState.X is a descriptor call


class FrameHandler(Protocol):
    """What the acceptor does for a connection (see ``daemon/frontend/acceptor.py``)."""

    pool: BufferPool
    budget: ReceiveBudget
    receiver: ReceivePool | None  # None: SLOT frames are received on the loop
    max_frame: int
    frame_timeout_s: float

    def opened(self, conn: Connection) -> str | None:
        """None to serve the connection, else the reason it is refused."""

    def frame(self, conn: Connection, body: memoryview, received_ns: int) -> None: ...

    def lend_slot(self, conn: Connection, nbytes: int) -> SlotLoan | None:
        """A payload slot for ``nbytes`` of raw pixels about to arrive, or None (then the
        frame is read into a pool buffer)."""

    def slot_frame(
        self, conn: Connection, body: memoryview, loan: SlotLoan, received_ns: int
    ) -> bool:
        """True: the frame is handled and the slot is the handler's; False: neither."""

    def return_slot(self, loan: SlotLoan) -> None: ...

    def oversized(self, conn: Connection, length: int) -> None: ...

    def stalled(self, conn: Connection, length: int) -> None: ...

    def refused(self, conn: Connection, reader: asyncio.StreamReader) -> None: ...

    def closed(self, conn: Connection) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One client: its transport, its read state, whether it is gone, and its requests
    still in the queue (``in_queue``) or in the decode pool (``converting``)."""

    def __init__(self, conn_id: int, handler: FrameHandler) -> None:
        self.id = conn_id
        self.handler = handler
        self.closed = False
        self.in_queue: set[Handle] = set()
        self.converting = 0  # images of this connection in the decode pool, not yet queued
        self.transport: asyncio.Transport | None = None
        self._fd = -1  # the transport's socket's descriptor (connection_made), -1: none
        self.state = HEAD
        self._loop = asyncio.get_running_loop()  # looked up once: each look is a getpid()
        self.gone: asyncio.Future[None] = self._loop.create_future()
        self._head_view = memoryview(bytearray(HEAD_BYTES))
        self._have = 0  # bytes of head in use, from its start
        self._body: mmap.mmap | None = None
        self._length = 0  # the current body's length (BODY, SLOT), or 0
        self._got = 0  # bytes of it received
        self._granted = 0  # BODY: bytes of it the budget lets it receive so far
        self._loan: SlotLoan | None = None  # SLOT: where the pixels go
        self._at: raw_frames.PixelsAt | None = None  # SLOT: where they lie in the body
        self._job: ReceiveJob | None = None  # SLOT: a receive thread is filling the slot
        self._peek = False  # HEAD: read only PEEK_BYTES (the last frame came off the loop)
        self._timer: asyncio.TimerHandle | None = None
        self._refused: asyncio.StreamReader | None = None
        self._fed = 0
        self._out: list[wire.DaemonMessage] = []  # replies not yet written (see send)
        self._last: wire.DaemonMessage | None = None  # ENDING: sent once all are answered

    # ---- bookkeeping the acceptor uses ------------------------------------------------

    def converted(self, _task: asyncio.Task[None]) -> None:
        self.converting -= 1
        self._end_if_answered()

    def in_flight(self) -> int:
        """Accepted and not yet answered (the per-connection limit counts these)."""
        return len(self.in_queue) + self.converting

    def send(self, message: wire.DaemonMessage) -> None:
        """Queue a reply; those of one turn of the loop are encoded and written together."""
        if self.closed or self.transport is None or self.state is CLOSED:
            return
        if not self._out:
            self._loop.call_soon(self.flush)
        self._out.append(message)

    def flush(self) -> None:
        """Write the queued replies now."""
        if self._out and not self.closed and self.transport is not None:
            self.transport.write(wire.encode_frames(self._out))
        self._out.clear()
        if self.state is ENDING:
            self._end_if_answered()

    def end(self, last: wire.DaemonMessage) -> None:
        """Read no more (the stream cannot be trusted); once every request accepted on it is
        answered (or timed out, as usual), send ``last`` and close. Once only."""
        if self.state not in (ENDING, CLOSED):
            self._last = last
            self._enter(ENDING)
            if self.transport is not None:
                self.transport.pause_reading()
            self._end_if_answered()

    def _end_if_answered(self) -> None:
        if self.state is ENDING and self.in_flight() == 0 and self._last is not None:
            self._out.append(self._last)
            self.close()

    def close(self) -> None:
        """Stop handling frames; what was sent is written, the acceptor forgets the
        connection's requests (``FrameHandler.closed``), then the transport closes."""
        self._enter(CLOSED)
        self.flush()
        self._mark_closed()
        if self.transport is not None:
            self.transport.close()

    def _mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.handler.closed(self)

    def socket(self) -> SupportsGetsockopt | None:
        """The peer's socket, for its credentials (``SO_PEERCRED``)."""
        return None if self.transport is None else self.transport.get_extra_info("socket")

    # ---- asyncio.BufferedProtocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        # Looked up once: the loop closes this descriptor only after connection_lost, which
        # leaves SLOT, so in SLOT (where the receive pool uses it) it is this socket's.
        sock = self.transport.get_extra_info("socket")
        self._fd = -1 if sock is None else sock.fileno()
        refusal = self.handler.opened(self)
        if refusal is not None:
            self.send(wire.Reply(id=0, status="error", error=refusal))
            self.flush()  # before linger half-closes the write side
            self._refused = asyncio.StreamReader()
            self._enter(CLOSED)
            self.handler.refused(self, self._refused)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state is SLOT:
            at, loan = self._at, self._loan
            assert at is not None and loan is not None
            end = at.start + at.length
            if self._got < end:
                stop = end if self.handler.receiver is None else self._got + SLOT_READ_BYTES
                return loan.view[self._got - at.start : stop - at.start]
            return self._head_view[at.hidden_end + self._got - end : at.hidden_length(self._length)]
        if self.state is BODY:
            assert self._body is not None
            # Paused while nothing is granted; a read that comes anyway is taken, never lost.
            stop = self._granted if self._granted > self._got else self._got + mmap.PAGESIZE
            return memoryview(self._body)[self._got : min(stop, self._length)]
        if self.state in (ENDING, CLOSED):
            return _DISCARD
        if self._peek and self._have < PEEK_BYTES:
            return self._head_view[self._have : PEEK_BYTES]
        return self._head_view[self._have :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.state in (ENDING, CLOSED):
            if self._refused is not None and self._fed < REFUSED_FEED_BYTES:
                self._refused.feed_data(bytes(_DISCARD[:nbytes]))
                self._fed += nbytes
            return
        if self.state is SLOT:
            self._got += nbytes
            if self._got == self._length:
                self._finish_slot()
            elif self.handler.receiver is not None:
                self._receive_off_loop()
            return
        if self.state is BODY:
            self._got += nbytes
            if self._got > self._granted:
                self.handler.budget.force(self, self._got - self._granted)
                self._granted = self._got
            if self._got == self._length:
                self._finish_body()
            elif self._got == self._granted:
                self._ask_budget()
            return
        # HEAD: handle every complete frame in head; keep a partial one for the next read
        self._have += nbytes
        pos, have, view, prefix = 0, self._have, self._head_view, wire.LENGTH_PREFIX.unpack_from
        while self.state is HEAD and have - pos >= wire.PREFIX_BYTES:
            (length,) = prefix(view, pos)
            if length > self.handler.max_frame:
                self.handler.oversized(self, length)
                return
            start = pos + wire.PREFIX_BYTES
            if have - start >= length:
                self._disarm()
                self._peek = False  # not a large frame after all: read all of head again
                self.handler.frame(self, view[start : start + length], time.monotonic_ns())
                pos = start + length
                continue
            self._arm(length)
            if wire.PREFIX_BYTES + length > HEAD_BYTES:  # too big for head
                if have - start < SCAN_BYTES:  # here length > HEAD_BYTES - 4 > SCAN_BYTES
                    break  # wait for enough of the body to find its pixels
                self._peek = False
                if not self._start_slot(length, start):
                    self._start_body(length, view[start:have])
                return
            break
        if self.state is HEAD:  # the partial frame moves to the front
            view[: have - pos] = view[pos:have]
            self._have = have - pos

    def eof_received(self) -> bool | None:
        if self._refused is not None:
            self._refused.feed_eof()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._out.clear()
        if self._refused is not None:
            self._refused.feed_eof()
        self._enter(CLOSED)
        self._mark_closed()
        if not self.gone.done():
            self.gone.set_result(None)

    # ---- frames -----------------------------------------------------------------------

    def _start_slot(self, length: int, start: int) -> bool:
        """Receive the rest of a large frame's pixels straight into a lent payload slot, if
        its first bytes show where they lie, all the bytes in head so far are up to their
        end, and the bytes after them fit in head; False (nothing changed) otherwise."""
        view, got = self._head_view, self._have - start
        at = raw_frames.locate_pixels(view[start : start + min(got, SCAN_BYTES)])
        if at is None:
            return False
        end = at.start + at.length
        if not got <= end <= length or at.hidden_length(length) > HEAD_BYTES:
            return False
        try:
            loan = self.handler.lend_slot(self, at.length)
        except Exception as exc:  # a bug in lending costs the in-place copy, not the frame
            log_event("lend_slot_failed", logging.ERROR, error=repr(exc))
            return False
        if loan is None:
            return False
        loan.view[: got - at.start] = view[start + at.start : start + got]
        view[: at.header] = view[start : start + at.header]  # the body's start to the front
        raw_frames.hide_pixels(view, at)
        self._loan, self._at, self._length, self._got = loan, at, length, got
        self._enter(SLOT)  # got < length: head holds less than a large frame
        self._receive_off_loop()
        return True

    def _receive_off_loop(self, paused: bool = False) -> bool:
        """SLOT: hand the pixels still to come, and the frame's tail after them, to a receive
        thread, reading paused until ``_received``; False, nothing changed (the loop receives
        them; reading is left ``paused`` or not as it was), if there is no pool, it does not
        find them worth a thread (``ReceivePool.worth``) or it takes no job."""
        receiver, at, loan = self.handler.receiver, self._at, self._loan
        assert at is not None and loan is not None
        rest = at.start + at.length - self._got
        if receiver is None or self.transport is None or self._fd < 0:
            return False
        if not receiver.worth(self._fd, rest):
            return False
        if not paused:
            self.transport.pause_reading()  # before the thread starts: one reader at a time
        done = functools.partial(self._received, loan)
        pixels = loan.view[self._got - at.start :]
        tail = self._head_view[at.hidden_end : at.hidden_length(self._length)]
        self._job = receiver.receive(self._fd, pixels, done, tail)
        if self._job is None and not paused:
            self.transport.resume_reading()
        return self._job is not None

    def _received(self, loan: SlotLoan, received: int) -> None:
        """On the loop, once the receive thread has let go of the socket and of ``loan``:
        ``received`` more pixels are in the slot, as if ``buffer_updated`` had seen them."""
        self._job = None
        if self.state is not SLOT:  # closed or lost meanwhile (_enter kept the slot)
            self.handler.return_slot(loan)
            return
        self._got += received
        # A burst of the rest already there: another job, reading still paused. Only after
        # progress: a job that got nothing met an EOF or error, which the loop must see.
        if received and self._got < self._length and self._receive_off_loop(paused=True):
            return
        if self.transport is not None:
            self.transport.resume_reading()
        if self._got == self._length:
            self._peek = True
            try:
                self._finish_slot()
            except Exception as exc:  # what uvloop does when buffer_updated raises: close
                log_event("frame_failed", logging.ERROR, error=repr(exc))
                self.close()

    def _finish_slot(self) -> None:
        loan, at, length = self._loan, self._at, self._length
        assert loan is not None and at is not None
        body = self._head_view[: at.hidden_length(length)]
        self._loan = None  # the handler's now, or given back below
        self._disarm()
        self._enter(HEAD)
        received_ns = time.monotonic_ns()
        if self.handler.slot_frame(self, body, loan, received_ns):
            return
        try:  # handled as if it had come the usual way; the slot goes back whatever happens
            whole = self.handler.pool.take(length)
            raw_frames.rebuild_body(memoryview(whole), body, loan.view, at)
        finally:
            self.handler.return_slot(loan)
        self._handle_pooled(whole, length, received_ns)

    def _start_body(self, length: int, already: memoryview) -> None:
        self._body = self.handler.pool.take(length)
        self._length, self._got = length, len(already)
        self._body[: self._got] = already
        self._have = 0
        self._enter(BODY)
        self._granted = self._got  # already received: granted unasked (at most a head's)
        self.handler.budget.force(self, self._got)
        if self._got == length:
            self._finish_body()
        else:
            self._ask_budget()

    def _ask_budget(self) -> None:
        """BODY, all granted received: ask for the next chunk (twice the last grant, up to
        the frame's end); reading pauses until it is granted (``budget_granted``)."""
        want = min(self._length, max(2 * self._granted, self._got + BODY_ROUND)) - self._granted
        if self.handler.budget.ask(self, want):
            self._granted += want
        elif self.transport is not None:
            self.transport.pause_reading()

    def budget_granted(self, nbytes: int) -> None:
        """The chunk this BODY frame waited for (the budget calls back)."""
        self._granted += nbytes
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _finish_body(self) -> None:
        body, length = self._body, self._length
        assert body is not None
        self._disarm()
        self._enter(HEAD)
        self._handle_pooled(body, length, time.monotonic_ns())

    def _handle_pooled(self, buf: mmap.mmap, length: int, received_ns: int) -> None:
        """Hand the frame in ``buf[:length]`` (a pool buffer) to the handler; the buffer goes
        back to the pool whatever happens."""
        try:
            self.handler.frame(self, memoryview(buf)[:length], received_ns)
        finally:
            self.handler.pool.give(buf)

    def _arm(self, length: int) -> None:
        if self._timer is None:
            timeout = self.handler.frame_timeout_s
            self._timer = self._loop.call_later(timeout, self.handler.stalled, self, length)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _enter(self, state: ReadState) -> None:
        if state is not HEAD:
            self._have = 0
        if self.state is BODY and state is not BODY:
            self.handler.budget.release(self)  # the frame is done or gone: its grant goes
            self._granted = 0
        if state in (ENDING, CLOSED):
            self._head_view = _DISCARD[:0]  # the connection's head goes (a frame's view keeps it)
            self._disarm()
            if self._body is not None and self.state is BODY:
                self.handler.pool.give(self._body)
            if self._job is not None:  # a thread is filling the slot: _received returns it
                self._job.cancel()
            elif self._loan is not None:  # closed mid-frame: the slot goes back at once
                self.handler.return_slot(self._loan)
        if state is not BODY:
            self._body = None
        if state is not SLOT:
            self._loan, self._at = None, None
        if state not in (BODY, SLOT):
            self._length, self._got = 0, 0
        self.state = state

    async def wait_closed(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.gone), timeout)

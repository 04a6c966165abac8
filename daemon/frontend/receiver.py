"""Receive threads: a large raw frame's pixels copied out of the socket off the loop's thread.

Per 1 MiB frame, most of the main process's CPU is the kernel's AF_UNIX receive copy, done by
``recv`` on whichever thread calls it (``docs/bench/frontend.json``). With receive threads
(``[server] receive_threads`` > 0) a connection in state SLOT
(``daemon/frontend/connection.py``) does
not lend its slot to the event loop: it pauses the transport's reading and hands the pixels
still to come to this pool, and the loop serves other connections meanwhile::

    loop thread                               receive thread (one of ``threads``)
    ───────────                               ───────────────────────────────────
    worth(fd, rest): FIONREAD >= min_bytes
    _start_slot: pause_reading()
    receive(fd, slot[got:], ...,  ──job──▶    recv_into_exact(dup, slot[got:], 0, cancel,
            after=head[tail])                                 after=head[tail])
      dup(fd), the job queued                   (C, GIL released: recvmsg into both until
    ... other connections ...                    full, empty (timeout 0), EOF, error, cancel)
    close(dup), _received(n):       ◀──────   loop.call_soon_threadsafe(done, n)
      another job if worth() again,
      else resume_reading(); the state
      machine goes on as if buffer_updated
      had seen those n bytes

The bytes after the pixels (the frame's tail, a few dozen) go into the connection's head in the
same recvmsg, so the loop has nothing left to read of the frame when ``done`` runs.

Who owns what: from ``receive`` until ``done`` runs, ``into``, ``after`` and the duplicate
descriptor are the thread's; the loop touches neither (the connection keeps the slot lent and
returns it only in ``done``: ``return_slot`` then, never before). The thread reads its own
``dup`` of the socket, never the transport's descriptor: uvloop closes that one itself after a
write error (``connection_lost`` while a job runs), and a descriptor number closed under a
thread could be reused at once by the next ``accept``, whose bytes the thread would then read
into this slot. A duplicate keeps the socket open until the job ends, which it does within
``RECV_SLICE_MS`` of ``ReceiveJob.cancel`` (the connection cancels when it is closed or
lost, including by the stall timer: ``frame_timeout_ms`` still cuts a stalled frame off).

A job never waits for a sender (``max_wait_s`` = 0): the thread copies what the socket holds
when it runs, and what arrives while it copies, and hands the frame back at the first empty
read. A frame goes to a thread only when the socket already holds ``min_bytes`` of it
(``ready``: ioctl FIONREAD), so a sender slow to push the rest of its frame has that rest
received by the loop as it trickles in (where waiting costs nothing) and takes a thread only
for a burst that is already there. Waiting for more would let a few slow senders hold every
thread while other connections' frames queue behind them, a convoy that multiplies the fast
senders' latency (docs/benchmarks.md, front end).

``done`` always runs once per job, on the loop, whatever the thread met (a short count: the
loop resumes reading and meets the EOF or the error itself, or receives the rest of a frame,
or hands it to a thread again if a burst of it is already there; its stall timer is still
armed).
``wait_idle`` awaits every job's ``done``; ``shutdown`` then ends the threads. A thread holds
the GIL only to take a job and to hand it back (microseconds), never while it waits or copies.
"""

from __future__ import annotations

import array
import asyncio
import enum
import fcntl
import logging
import math
import os
import queue
import termios
import threading
from collections.abc import Callable
from typing import Final

from scratchd.ipc._native import recv_into_exact
from scratchd.protocol.log import log_event

MIN_BYTES: Final = 64 * 1024
"""Pixels still to come, and bytes already in the socket, for which a thread is worth its
hand-offs: fewer still to come, and one read of the loop's (``SLOT_READ_BYTES``, also 64 KiB)
takes them. The value is not tuned against a measurement: the front-end benchmark only bounds
a hand-off's cost from above, well under the loop CPU a 1 MiB frame saves."""
MAX_WAIT_S: Final = 0.0
"""The longest one job waits for bytes that are not there yet: none. Tests raise it to hold a
thread mid-frame (cancel and close while a thread owns the slot)."""


class PoolState(enum.Enum):
    NEW = "new"  # no thread started yet (started by the first job)
    RUNNING = "running"
    STOPPED = "stopped"  # shut down: receive() takes no more jobs


class ReceiveJob:
    """One receive in a thread: ``into`` filled from ``fd`` (a duplicate the thread closes)."""

    __slots__ = ("_cancel", "after", "done", "fd", "into", "loop", "timeout_ms")

    def __init__(
        self,
        fd: int,
        into: memoryview,
        after: memoryview | None,
        timeout_ms: int,
        loop: asyncio.AbstractEventLoop,
        done: Callable[[int], None],
    ) -> None:
        self.fd, self.into, self.after, self.timeout_ms = fd, into, after, timeout_ms
        self.loop, self.done = loop, done
        self._cancel = bytearray(1)  # byte 0 read by the thread before each recv and poll

    def cancel(self) -> None:
        """Stop the receive (the thread lets go within ``RECV_SLICE_MS``); ``done`` still runs."""
        self._cancel[0] = 1

    def run(self) -> int:
        """In a receive thread: the bytes received (the descriptor stays open: see _work)."""
        try:
            received, _why = recv_into_exact(
                self.fd, self.into, self.timeout_ms, self._cancel, self.after
            )
            return received
        except Exception as exc:  # a bug here must still end in done(): the slot goes back
            log_event("receive_failed", logging.ERROR, error=repr(exc))
            return 0


class ReceivePool:
    """``threads`` receive threads, one per daemon (the acceptor's), started on first use."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a receive pool needs at least one thread, not {threads}")
        self.threads = threads
        self.min_bytes = MIN_BYTES  # fewer pixels than this to come, or in the socket: loop
        self.max_wait_s = MAX_WAIT_S  # a job waits this long at most for bytes not there yet
        self.state = PoolState.NEW
        self.in_flight = 0  # jobs whose done() has not run yet (loop thread only)
        self.jobs = 0  # jobs started, ever (loop thread only; benchmarks count hand-offs)
        self._ready = array.array("i", [0])  # ready()'s ioctl result (loop thread only)
        self._jobs: queue.SimpleQueue[ReceiveJob | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle: list[asyncio.Future[None]] = []

    def ready(self, fd: int) -> int:
        """On the loop: the bytes the socket ``fd`` holds unread (ioctl FIONREAD), 0 if it
        cannot say (an error is the loop's own read to meet)."""
        try:
            fcntl.ioctl(fd, termios.FIONREAD, self._ready, True)
        except OSError:
            return 0
        return self._ready[0]

    def worth(self, fd: int, rest: int) -> bool:
        """On the loop: whether ``rest`` bytes still to come of a frame on ``fd`` go to a
        thread: at least ``min_bytes`` of them, and at least that many already in the socket
        (a thread copies what is there and waits for nothing)."""
        return rest >= self.min_bytes and self.ready(fd) >= self.min_bytes

    def receive(
        self,
        fd: int,
        into: memoryview,
        done: Callable[[int], None],
        after: memoryview | None = None,
    ) -> ReceiveJob | None:
        """On the loop: fill ``into``, then ``after``, from the socket ``fd`` in a thread with
        what it holds, waiting at most ``max_wait_s`` for the rest (the frame's stall timer
        stays the loop's: a close cancels the job); ``done(received)`` runs on the loop after
        the thread has let go of the socket and of both buffers. None (nothing started) if the
        pool is stopped or the descriptor cannot be duplicated: the caller then receives on the
        loop."""
        if self.state is PoolState.STOPPED:
            return None
        try:
            dup = os.dup(fd)
        except OSError as exc:  # out of descriptors, say: this frame is received on the loop
            log_event("receive_dup_failed", logging.WARNING, error=repr(exc))
            return None
        if self.state is PoolState.NEW:
            self._start()
        timeout_ms = max(0, math.ceil(self.max_wait_s * 1000))
        job = ReceiveJob(dup, into, after, timeout_ms, asyncio.get_running_loop(), done)
        self.in_flight += 1
        self.jobs += 1
        self._jobs.put(job)
        return job

    def _start(self) -> None:
        for k in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"scratchd-recv-{k}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self.state = PoolState.RUNNING

    def _work(self) -> None:
        # The duplicate is closed on the loop (_finished): a close here would give up the GIL
        # and wait for it again, and every such wait can delay the hand-back behind the loop.
        while (job := self._jobs.get()) is not None:
            received = job.run()
            try:
                job.loop.call_soon_threadsafe(self._finished, job, received)
            except RuntimeError:  # the loop is closed: nobody is left to take the slot back
                os.close(job.fd)

    def _finished(self, job: ReceiveJob, received: int) -> None:
        self.in_flight -= 1
        try:
            os.close(job.fd)  # the thread has let go of it: the socket's last reference, maybe
            job.done(received)
        finally:
            if self.in_flight == 0:
                for waiter in self._idle:
                    if not waiter.done():
                        waiter.set_result(None)
                self._idle.clear()

    async def wait_idle(self) -> None:
        """Until every job so far has run its ``done`` (cancel them first to be quick)."""
        if self.in_flight:
            waiter = asyncio.get_running_loop().create_future()
            self._idle.append(waiter)
            await waiter

    def native_ids(self) -> list[int]:
        """The threads' kernel ids (``/proc/<pid>/task/<id>``), for CPU accounting."""
        return [w.native_id for w in self._workers if w.native_id is not None]

    def shutdown(self) -> None:
        """End the threads once their jobs are done (``wait_idle`` first); no more jobs."""
        self.state = PoolState.STOPPED
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join()
        self._workers.clear()

"""Doorbells: eventfd wake-ups between the main process and the workers.

A doorbell carries no data, only "look at the shared memory again". The data always goes
through the queue under its lock; the doorbell only ends a wait. So a spurious ring is
harmless and a ring is never needed twice: an eventfd's counter stays non-zero until read,
so a ring that lands *before* the waiter starts to wait still wakes it (no lost wake-up).

Two kinds, both ``os.eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)`` (Linux):

- **completion** (one, main process reads): rung by a worker after it flips a descriptor to
  DONE, and by anyone who moves a descriptor to EXPIRED/FAILED — unless the main process
  will look at the done stack anyway (header ``completion_armed`` = 0: it is spinning on it,
  or its event loop is awake and looks before it sleeps; ``ipc/queue.py``).
  The asyncio loop watches it with ``loop.add_reader(fd, ...)``; the callback drains it,
  then collects.
- **work** (one per worker slot, the worker reads): rung by ``RequestQueue.submit`` for a
  worker that announced it is waiting (the queue's waiting bitmask, set after its bounded
  spin), so a waiting worker sleeps in ``poll`` instead of polling the queue.

``ring`` and ``drain`` are C (``_native.eventfd_ring``/``eventfd_drain``): an empty or full
counter is a return value there, not a Python exception raised on the hot path.

Inheritance: the fds are created close-on-exec; the supervisor hands them to an exec'd
worker with ``subprocess.Popen(..., pass_fds=(completion_fd, work_fd))``, which keeps their
numbers, and the worker wraps them again with :meth:`Doorbell.from_fd`.
"""

from __future__ import annotations

import os
import select

from scratchd.ipc._native import eventfd_drain, eventfd_ring


class Doorbell:
    """One eventfd. ``ring`` from anywhere, ``wait``/``drain`` in the one process that reads."""

    __slots__ = ("_fd", "_owned", "_poll")

    def __init__(self, fd: int, *, owned: bool) -> None:
        self._fd = fd
        self._owned = owned
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls) -> Doorbell:
        """A new non-blocking, close-on-exec eventfd owned (closed) by this object."""
        return cls(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC), owned=True)

    @classmethod
    def from_fd(cls, fd: int, *, owned: bool = False) -> Doorbell:
        """Wrap an inherited eventfd number; it is made non-blocking (reads must never block)."""
        os.set_blocking(fd, False)
        return cls(fd, owned=owned)

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        """Wake the reader. Never blocks; a full counter (2**64 - 2 rings unread) is ignored."""
        eventfd_ring(self._fd)  # C: no exception object for a full counter (EAGAIN)

    def drain(self) -> int:
        """Reset the counter; returns how many rings were pending (0 if none)."""
        return eventfd_drain(self._fd)  # C: an unset counter is 0, not an EAGAIN exception

    def wait(self, timeout_s: float | None) -> bool:
        """Block until rung or ``timeout_s`` passes (None: forever); drains; True if rung."""
        timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000.0 + 0.999))
        try:
            ready = self._poll.poll(timeout_ms)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            ready = []
        return bool(ready) and self.drain() > 0

    def close(self) -> None:
        """Close the fd if this object created it (inherited fds are the caller's)."""
        if self._owned and self._fd >= 0:
            self._poll.unregister(self._fd)
            os.close(self._fd)
        self._fd = -1

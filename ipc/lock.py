"""A robust, process-shared pthread mutex living inside a shared mapping.

Why this lock: the queue's critical sections are entered by the main process and by worker
processes that may be SIGKILLed at any instruction. A POSIX semaphore or a
``multiprocessing.Lock`` held by a dead process stays locked forever. A *robust* mutex does
not: the kernel walks the dead thread's robust list and marks the futex ``OWNER_DIED``, and
the next ``pthread_mutex_lock`` returns ``EOWNERDEAD`` *with the lock acquired*. The new
holder must then repair whatever the dead one left half-done and call
``pthread_mutex_consistent`` before unlocking; if it unlocks without doing so the mutex
becomes ``ENOTRECOVERABLE`` for everyone.

Memory: :data:`MUTEX_BYTES` bytes at a caller-chosen, 64-byte aligned offset of a writable
mmap (glibc's ``pthread_mutex_t`` is 40 bytes on x86-64 and 48 on aarch64). Only the process
that creates the segment calls :meth:`RobustMutex.initialize`, once, before any other process
attaches; everyone else just wraps the same bytes.

Repair protocol (see :meth:`RobustMutex.acquire`): on ``EOWNERDEAD`` the ``repair`` callback
given to the constructor runs while the lock is held, then the mutex is marked consistent.
If ``repair`` raises, the mutex is still marked consistent and released (a later locker gets
an ordinary lock, not ``EOWNERDEAD`` again), and the exception propagates.

A stopped holder (SIGSTOP, a debugger) would block everyone forever, and the main process's
event loop with them. So a process may pass ``on_stuck``: its ``acquire`` then waits at most
``stuck_after_s`` (``pthread_mutex_clocklock`` on CLOCK_MONOTONIC), hands the holder's
thread id (read from the futex word) to ``on_stuck`` — the queue's main process SIGKILLs a
registered worker found there — and then waits on; the kill turns the wait into an
``EOWNERDEAD`` acquisition, repaired as above. Uncontended, this costs one ``trylock``.

Calls go to the C extension ``scratchd.ipc._native`` (``Mutex``: one C call per pthread
function, returning its error code; this module decides what a code means). The GIL is
released only around the calls that can block (a contended ``lock``, ``clocklock``), so a
blocked lock never stalls other Python threads while an uncontended one costs two plain C
calls, far cheaper than the same pair through ctypes. A build without the extension
fails at import with ImportError: there is no slower fallback to drift into silently.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from collections.abc import Callable

from scratchd.ipc._native import Mutex

MUTEX_BYTES = 64  # room for pthread_mutex_t on every glibc ABI we run on (40 or 48 bytes)
_FUTEX_TID_MASK = 0x3FFFFFFF  # the robust futex word is the holder's TID plus two flag bits


class LockError(RuntimeError):
    """The mutex could not be initialised, acquired or released (the message says which)."""


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise LockError(f"{what} failed: {errno.errorcode.get(rc, rc)} ({os.strerror(rc)})")


class RobustMutex:
    """A robust, process-shared mutex over ``MUTEX_BYTES`` bytes of ``buf`` at ``offset``.

    ``repair`` runs (lock held) whenever this process acquires the mutex from a holder that
    died; it must restore every invariant the critical sections protect.
    """

    def __init__(
        self,
        buf: mmap.mmap,
        offset: int,
        repair: Callable[[], None] | None = None,
        on_stuck: Callable[[int], None] | None = None,
        stuck_after_s: float = 0.5,
    ) -> None:
        if offset % 64:
            raise LockError(f"mutex offset {offset} is not 64-byte aligned")
        self._native = Mutex(buf, offset)
        self._repair = repair
        self._on_stuck = on_stuck
        self._stuck_after_ns = int(stuck_after_s * 1e9)
        self._lock = self._native.lock
        self._unlock = self._native.unlock
        # A watching process tries first and only then waits with a time limit.
        self._first_try = self._native.trylock if on_stuck else self._native.lock
        self.repairs = 0  # times this process repaired after a dead holder

    def initialize(self) -> None:
        """Initialise the mutex: robust, process-shared, error-checking (a holder that locks
        again gets LockError EDEADLK instead of hanging). Creator only, before sharing."""
        _check(self._native.initialize(), "pthread_mutex_init (robust, process-shared)")

    def acquire(self) -> None:
        """Lock; on ``EOWNERDEAD`` run ``repair`` and mark the mutex consistent."""
        rc = self._first_try()
        if rc:
            self._acquire_slowly(rc)

    def _acquire_slowly(self, rc: int) -> None:
        if rc == errno.EBUSY and self._on_stuck is not None:  # trylock lost: wait, watching
            self._acquire_watching()
        elif rc == errno.EOWNERDEAD:
            self.recover()
        else:
            _check(rc, "pthread_mutex_lock")

    def try_acquire(self) -> bool:
        """Lock if free (repairing after a dead holder); False if another process holds it."""
        rc = self._native.trylock()
        if rc == 0:
            return True
        if rc == errno.EBUSY:
            return False
        if rc == errno.EOWNERDEAD:
            self.recover()
            return True
        _check(rc, "pthread_mutex_trylock")
        return False

    def holder_tid(self) -> int:
        """Thread id of the current holder (0 when free); racy, for diagnosis only."""
        return int(self._native.word()) & _FUTEX_TID_MASK

    def _acquire_watching(self) -> None:
        """Wait ``stuck_after_s`` for the lock, report a stuck holder, then wait on."""
        assert self._on_stuck is not None
        rc = self._native.clocklock(time.monotonic_ns() + self._stuck_after_ns)
        if rc == errno.ETIMEDOUT:
            self._on_stuck(self.holder_tid())
            rc = self._lock()
        if rc == errno.EOWNERDEAD:
            self.recover()
        elif rc:
            _check(rc, "pthread_mutex_clocklock")

    def release(self) -> None:
        """Unlock. Raises :class:`LockError` if this thread does not hold the lock."""
        rc = self._unlock()
        if rc:
            _check(rc, "pthread_mutex_unlock")

    # ``with mutex: ...``: acquire, run the block, release (also on exceptions). The hot
    # path of every Python section: one C call when uncontended.
    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        rc = self._unlock()
        if rc:
            _check(rc, "pthread_mutex_unlock")

    def held(self) -> RobustMutex:
        """``with mutex.held(): ...`` reads better at some call sites; same as ``with mutex``."""
        return self

    def close(self) -> None:
        """Drop the buffer export so the mmap can be closed. The mutex bytes stay as they are."""
        self._native.close()

    def recover(self) -> None:
        """Repair and mark consistent after taking the lock with EOWNERDEAD: from
        :meth:`acquire` and :meth:`try_acquire`, or from a caller that got the lock some other
        way (the C fast path of a queue operation). If the repair raises, the mutex is
        released and the exception propagates."""
        # Order: repair while we hold the lock, then consistent, so no other process can
        # observe the half-repaired state; consistent even if repair raised, so the mutex
        # never becomes ENOTRECOVERABLE because of a bug in repair.
        self.repairs += 1
        try:
            if self._repair is not None:
                self._repair()
        except BaseException:
            self._native.consistent()
            self.release()
            raise
        _check(self._native.consistent(), "pthread_mutex_consistent")

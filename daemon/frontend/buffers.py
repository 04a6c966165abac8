"""Memory for frames being received: body buffers whose pages follow the bytes that arrived,
and the daemon-wide budget for what incomplete frames may hold.

A frame larger than a connection's head (``daemon/frontend/connection.py``, state BODY) is
received into a body buffer from :class:`BufferPool`. Two things bound what that costs,
whatever a peer announces in its length prefix:

* **Pages follow arrivals.** A body buffer is an anonymous ``mmap``: the kernel backs a page
  only once a byte is received into it, so a frame that announced 12 MiB and sent 1 KiB holds
  one page, not 12 MiB; and a buffer the pool does not keep is unmapped, its memory back to
  the system at once (a ``bytearray`` of that size is zero-filled, every page touched, and
  once freed stays in the allocator's heap). A kept buffer keeps at most ``KEEP_RESIDENT`` of
  its pages (the rest are dropped with ``MADV_DONTNEED``), so the pool's resident memory is
  at most ``keep`` x ``KEEP_RESIDENT`` after any flood.
* **One budget for all incomplete frames** (:class:`ReceiveBudget`, ``[server]
  receive_budget_mb``). A connection may receive into its body only the bytes granted to it:
  what was already in its head when the frame moved to a body (at most one head's worth, so
  granted unasked), then chunks it asks for as the bytes arrive, doubling up to the frame's
  length. A chunk that does not fit the budget is not granted: the connection stops reading
  (``pause_reading``) and waits its turn, first come first served; a frame that finishes or a
  connection that closes gives its grant back and wakes the waiters that now fit. Its frame
  timer keeps running meanwhile, so a frame that waits longer than ``frame_timeout_ms`` is
  cut off as a stalled one. To hold the budget a peer must really send the bytes (a grant is
  at most twice what arrived, plus one chunk), and only for ``frame_timeout_ms``.

  No deadlock: when every connection holding a grant is itself waiting for more (none can
  finish without more budget), the first waiter is let past the budget, and only it, until
  its frame is done; so the budget is exceeded by at most one frame (and what heads held).

Both run on the event loop's thread only.
"""

from __future__ import annotations

import collections
import mmap
from typing import Final, Protocol

BODY_ROUND: Final = 64 * 1024
"""Body buffers are sized in multiples of this, so frames of nearly one size share them;
also the first chunk a frame is granted beyond what its head held."""
POOL_KEEP: Final = 8
KEEP_RESIDENT: Final = 2 * 1024 * 1024
"""Of a buffer the pool keeps, the pages that stay backed (frames up to this size reuse
them without page faults); the rest go back to the system."""


class BufferPool:
    """Body buffers for frames larger than a connection's head, reused across connections.

    Only frames being received hold one, so idle connections hold none; at most ``keep``
    spare buffers are kept, each with at most ``KEEP_RESIDENT`` bytes of it backed.
    """

    def __init__(self, keep: int = POOL_KEEP) -> None:
        self.keep = keep
        self._free: list[mmap.mmap] = []

    def take(self, n: int) -> mmap.mmap:
        """A buffer of at least ``n`` bytes (none of its pages backed until written)."""
        fits = [b for b in self._free if len(b) >= n]
        if fits:
            buf = min(fits, key=len)
            self._free.remove(buf)
            return buf
        size = max(BODY_ROUND, -(-n // BODY_ROUND) * BODY_ROUND)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem

    def give(self, buf: mmap.mmap) -> None:
        """Take ``buf`` back: kept (its pages beyond ``KEEP_RESIDENT`` dropped) or, the pool
        being full, unmapped once the last view of it is gone."""
        if len(self._free) >= self.keep:
            return
        if len(buf) > KEEP_RESIDENT:
            buf.madvise(mmap.MADV_DONTNEED, KEEP_RESIDENT, len(buf) - KEEP_RESIDENT)
        self._free.append(buf)


class Holder(Protocol):
    """A connection receiving a frame under the budget."""

    def budget_granted(self, nbytes: int) -> None:
        """A chunk it waited for is granted (called on the loop, from ``release``)."""


class ReceiveBudget:
    """Bytes granted to incomplete frames, all connections together, at most ``limit``
    (the module docstring has the rules)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a receive budget needs at least one byte, not {limit}")
        self.limit = limit
        self.used = 0
        self._held: dict[Holder, int] = {}
        self._waiting: collections.OrderedDict[Holder, int] = collections.OrderedDict()
        self._overdrawn: Holder | None = None  # the one frame let past the limit (no deadlock)

    def held(self, holder: Holder) -> int:
        return self._held.get(holder, 0)

    def waiting(self) -> int:
        return len(self._waiting)

    def force(self, holder: Holder, nbytes: int) -> None:
        """Grant ``nbytes`` whatever the budget (bytes already received: a head's worth)."""
        self._held[holder] = self._held.get(holder, 0) + nbytes
        self.used += nbytes

    def ask(self, holder: Holder, nbytes: int) -> bool:
        """True: ``nbytes`` more are granted to ``holder``. False: it waits (behind any
        earlier waiter), and ``holder.budget_granted(nbytes)`` runs once they are."""
        fits = not self._waiting and self.used + nbytes <= self.limit
        if fits or holder is self._overdrawn or self._unblocks(holder):
            self.force(holder, nbytes)
            return True
        self._waiting[holder] = nbytes
        return False

    def release(self, holder: Holder) -> None:
        """``holder``'s frame is done (or gone): all it held goes back; it waits no more."""
        self.used -= self._held.pop(holder, 0)
        self._waiting.pop(holder, None)
        if holder is self._overdrawn:
            self._overdrawn = None
        self._wake()

    def _fits(self, holder: Holder, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit or holder is self._overdrawn

    def _unblocks(self, holder: Holder) -> bool:
        """Whether every other holder waits for more (none could finish and give back): then
        ``holder`` becomes the one frame let past the budget, until it is done."""
        if self._overdrawn is not None:
            return False
        if all(other in self._waiting for other in self._held if other is not holder):
            self._overdrawn = holder
            return True
        return False

    def _wake(self) -> None:
        """Grant waiters in arrival order while the first one fits."""
        while self._waiting:
            holder, nbytes = next(iter(self._waiting.items()))
            if not (self._fits(holder, nbytes) or self._unblocks(holder)):
                return
            del self._waiting[holder]
            self.force(holder, nbytes)
            holder.budget_granted(nbytes)

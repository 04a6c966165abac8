"""A hashed timing wheel over deadline ticks, stored in caller-provided arrays.

The wheel indexes queued descriptors by deadline so that expiry costs O(1) per descriptor
and touches only the buckets that came due, never the whole queue. It owns no memory: the
queue passes numpy views into shared memory (tests pass plain arrays)::

    head[wheel_ticks]   int32  first descriptor of each bucket, NIL (-1) if empty
    nxt[n], prv[n]      int32  doubly linked bucket list through the descriptors
    bucket[n]           int32  the bucket a descriptor is linked into (O(1) unlink)
    deadline[n]         int64  absolute deadline, monotonic ns
    cursor[1]           int64  every tick < cursor has been fully expired

A deadline falls in tick ``t = (deadline - base_ns) // tick_ns`` and is linked into bucket
``max(t, cursor) % wheel_ticks`` (a deadline already behind the cursor goes to the cursor's
bucket, which the next ``expire_due`` visits first). Deadlines further than one revolution
ahead share a bucket with nearer ones ("rounds"): ``expire_due`` compares each visited
entry's exact deadline with ``now``, so an entry is never expired early, whatever its round,
and an entry whose deadline is ``≤ now`` is always found, because its bucket lies between
the cursor and ``now``'s tick, all of which are visited (or all buckets, after a gap longer
than a revolution).

Not thread-safe by itself: the queue calls it only while holding the segment's mutex. A
process killed between two writes of an insert or remove leaves the links inconsistent; the
queue then calls :meth:`TimingWheel.rebuild` with the descriptors that are truly QUEUED.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

NIL = -1


class TimingWheel:
    """Insert, remove and expire descriptor indices by deadline (see the module docstring)."""

    def __init__(
        self,
        head: np.ndarray,
        nxt: np.ndarray,
        prv: np.ndarray,
        bucket: np.ndarray,
        deadline: np.ndarray,
        cursor: np.ndarray | memoryview,
        *,
        base_ns: int,
        tick_ns: int,
    ) -> None:
        # memoryviews for scalar access (~5x faster than numpy scalars); numpy for vectors
        self._head_np = head
        self.head, self.nxt, self.prv = head.data, nxt.data, prv.data
        self.bucket, self.deadline = bucket.data, deadline.data
        self.cursor = cursor
        self.base_ns, self.tick_ns = base_ns, tick_ns
        self.size = len(head)

    def tick_of(self, ns: int) -> int:
        return (ns - self.base_ns) // self.tick_ns

    def insert(self, i: int) -> None:
        """Link descriptor ``i`` (its ``deadline`` already written) into its bucket."""
        b = max(self.tick_of(self.deadline[i]), int(self.cursor[0])) % self.size
        first = self.head[b]
        self.bucket[i] = b
        self.prv[i] = NIL
        self.nxt[i] = first
        if first != NIL:
            self.prv[first] = i
        self.head[b] = i

    def remove(self, i: int) -> None:
        """Unlink descriptor ``i`` from its bucket."""
        n, p = self.nxt[i], self.prv[i]
        if p == NIL:
            self.head[self.bucket[i]] = n
        else:
            self.nxt[p] = n
        if n != NIL:
            self.prv[n] = p
        self.nxt[i] = self.prv[i] = NIL

    def expire_due(self, now_ns: int) -> list[int]:
        """Unlink and return every descriptor whose deadline is ``≤ now_ns``."""
        now_tick = self.tick_of(now_ns)
        start = int(self.cursor[0])
        if now_tick < start:
            return []
        span = min(now_tick - start + 1, self.size)
        buckets = (start + np.arange(span)) % self.size
        due: list[int] = []
        for b in buckets[self._head_np[buckets] != NIL].tolist():
            i = self.head[b]
            while i != NIL:
                after = self.nxt[i]
                if self.deadline[i] <= now_ns:
                    self.remove(i)
                    due.append(i)
                i = after
        # Ticks before now_tick are done; now_tick itself may still hold later deadlines.
        self.cursor[0] = now_tick
        return due

    def rebuild(self, members: Iterable[int]) -> None:
        """Forget all links and insert ``members`` afresh (repair after a dead lock holder)."""
        self._head_np[:] = NIL
        for i in members:
            self.insert(int(i))

"""Per-priority ready lists: who a worker gets next, stored in caller-provided arrays.

One doubly linked list per priority (0..7, 7 most urgent), threaded through the
descriptors and kept sorted by ``(deadline_ns, seq)``: earliest deadline first, then FIFO by
the enqueue sequence number. The scheduling order is therefore "highest non-empty priority,
its head", O(PRIORITIES) to find and O(1) to unlink::

    head[8], tail[8], count[8]   int32   per priority; NIL (-1) when empty
    nxt[n], prv[n]               int32   links through the descriptors
    priority[n]                  uint8   which list a descriptor belongs to
    deadline[n], seq[n]          int64/uint64  the sort key

Insertion walks back from the tail while the tail's deadline is later. Requests of one part
class carry the same deadline offset, so they arrive in deadline order and insertion is O(1)
in the common case; the worst case walks past the later-deadline entries of that priority
(bounded by the number of slots). A requeued claim keeps its original ``seq`` and so goes
back to exactly where it was.

Not thread-safe by itself: only called with the segment mutex held; :meth:`rebuild`
restores it from the descriptor table after a dead lock holder.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

NIL = -1


class ReadyLists:
    """Sorted intrusive lists, one per priority (see the module docstring)."""

    def __init__(
        self,
        head: np.ndarray,
        tail: np.ndarray,
        count: np.ndarray,
        nxt: np.ndarray,
        prv: np.ndarray,
        priority: np.ndarray,
        deadline: np.ndarray,
        seq: np.ndarray,
    ) -> None:
        # memoryviews for scalar access (~5x faster than numpy scalars); numpy for vectors
        self._np = (head, tail, count, deadline)
        self.head, self.tail, self.count = head.data, tail.data, count.data
        self.nxt, self.prv = nxt.data, prv.data
        self.priority, self.deadline = priority.data, deadline.data
        self.seq = seq.data
        self.levels = len(head)

    def push(self, i: int) -> None:
        """Insert descriptor ``i`` at its place in the list of its priority."""
        p = self.priority[i]
        d, s = self.deadline[i], self.seq[i]
        j = self.tail[p]
        while j != NIL and (self.deadline[j] > d or (self.deadline[j] == d and self.seq[j] > s)):
            j = self.prv[j]
        after = self.head[p] if j == NIL else self.nxt[j]
        self.prv[i] = j
        self.nxt[i] = after
        if after == NIL:
            self.tail[p] = i
        else:
            self.prv[after] = i
        if j == NIL:
            self.head[p] = i
        else:
            self.nxt[j] = i
        self.count[p] += 1

    def remove(self, i: int) -> None:
        """Unlink descriptor ``i`` from the list of its priority."""
        p = self.priority[i]
        n, q = self.nxt[i], self.prv[i]
        if q == NIL:
            self.head[p] = n
        else:
            self.nxt[q] = n
        if n == NIL:
            self.tail[p] = q
        else:
            self.prv[n] = q
        self.nxt[i] = self.prv[i] = NIL
        self.count[p] -= 1

    def best(self) -> int:
        """The descriptor a worker should get next, or NIL when nothing is ready."""
        counts = self.count.tolist()  # one conversion beats eight numpy scalar reads
        for p in range(self.levels - 1, -1, -1):
            if counts[p]:
                return int(self.head[p])
        return NIL

    def total(self) -> int:
        return sum(self.count.tolist())

    def earliest_deadline(self) -> int | None:
        """The smallest deadline among all ready descriptors (each list's head is its min)."""
        head, _, count, deadline = self._np
        heads = head[count > 0]
        if len(heads) == 0:
            return None
        return int(deadline[heads].min())

    def rebuild(self, members: Iterable[int]) -> None:
        """Forget all links and push ``members`` afresh (repair after a dead lock holder)."""
        head, tail, count, _ = self._np
        head[:] = NIL
        tail[:] = NIL
        count[:] = 0
        for i in sorted(members, key=lambda k: (self.deadline[k], self.seq[k])):
            self.push(int(i))

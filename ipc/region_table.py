"""The region table, main-process side: which client regions workers may read, and how long.

A request whose grey pixels lie in a registered client region (``ipc/regions.py``) is queued
naming them, not carrying them: its descriptor holds ``(region, region_gen, region_offset)``
(``ipc/layout.py``), and the worker that claims it maps the region itself
(``ipc/region_maps.py``). This table, one row per published region in the segment
(``REGION_DTYPE``), is what lets it: the descriptor number the main process keeps the memfd
open under, the memfd's inode, the size a worker may read, and a generation. Only the main
process writes it, without the lock (``ipc/layout.py``).

Lifecycle of a row::

    free ──publish──▶ live (generation + 1) ──retire, no pins──▶ free
                        │  pin per submitted request naming it ▲
                        └──retire with pins──▶ retiring ──last unpin──┘

- **publish** (registration): fields, then ``generation`` + 1, then ``live`` = 1. A worker
  caches its mapping under ``(row, generation)``, so a row published again for another
  region is never mistaken for the old one.
- **pin** at ``submit`` of a request naming the row; **unpin** when its descriptor is freed
  (collected, expired, or dropped because its client left: ``ipc/main_side.py``). A request a
  dead worker held is re-queued still pinned, so whichever worker claims it next can map
  the region: the main process keeps the descriptor open until the last pin goes.
- **retire** (the client's connection closed): at once when nothing is pinned, else when the
  last pin goes. Then ``live`` = 0, the descriptor is closed and the main process's mapping
  released; workers drop their mappings of rows no longer live under the generation they
  cached (``RegionMaps.forget_released``).

Workers reach the descriptor through ``/proc/<main pid>/fd/<n>``, which the kernel allows a
process of the same user while the main process is dumpable (a process that changed its
credentials, or set ``PR_SET_DUMPABLE`` 0, is not): :func:`workers_can_open` checks this, and
without it nothing is published, so grey region pixels are copied into the queue's slots as
RGB ones are converted there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Final

import numpy as np

from scratchd.ipc.layout import MAX_REGIONS, Columns
from scratchd.ipc.regions import Region

PR_GET_DUMPABLE: Final = 3


def workers_can_open() -> bool:
    """Whether processes of our user may open our descriptors through ``/proc`` (we are
    dumpable)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1)


class RegionTable:
    """The main process's view of the region table: publish, pin, unpin, retire."""

    def __init__(self, rows: np.ndarray, shareable: bool) -> None:
        self._rows: Columns | None = Columns(rows)  # None once closed
        self.shareable = shareable  # False: nothing is published (module docstring)
        self._free = list(range(MAX_REGIONS - 1, -1, -1))  # pop() takes row 0 first
        self._regions: dict[int, Region] = {}
        self._pins = [0] * MAX_REGIONS
        self._pinned: dict[int, int] = {}  # descriptor index -> row it names
        self._retiring: set[int] = set()

    def __len__(self) -> int:
        """Rows in use (live or retiring)."""
        return len(self._regions)

    def publish(self, region: Region) -> bool:
        """Give ``region`` a row (sets its ``row`` and ``generation``); False when the table
        is full or workers could not open it (then its pixels are copied instead)."""
        r = self._rows
        if r is None or not self.shareable or not self._free or region.fd < 0:
            return False
        row = self._free.pop()
        r.fd[row], r.size[row] = region.fd, region.size
        r.dev[row], r.ino[row] = region.dev, region.ino
        generation = (r.generation[row] + 1) & 0xFFFFFFFF
        r.generation[row] = generation
        r.live[row] = 1
        region.row, region.generation = row, generation
        self._regions[row] = region
        return True

    def pin(self, index: int, row: int) -> None:
        """Descriptor ``index`` now names ``row`` (a request submitted)."""
        self._pinned[index] = row
        self._pins[row] += 1

    def unpin(self, indices: Iterable[int]) -> None:
        """Descriptors ``indices`` are free: the rows they named lose a pin each."""
        pinned = self._pinned
        if not pinned:
            return
        for index in indices:
            row = pinned.pop(index, None)
            if row is not None:
                self._pins[row] -= 1
                if not self._pins[row] and row in self._retiring:
                    self._release(row)

    def pins(self, row: int) -> int:
        """Requests queued, claimed or finished-not-collected that name ``row``."""
        return self._pins[row]

    def retiring_bytes(self) -> int:
        """Bytes of retired regions still mapped because requests name them."""
        return sum(self._regions[row].size for row in self._retiring)

    def retire(self, region: Region) -> None:
        """``region``'s client is gone: release its row now, or after its last request."""
        row = region.row
        if row is None or self._regions.get(row) is not region:
            region.close()
            return
        if self._pins[row]:
            self._retiring.add(row)
        else:
            self._release(row)

    def close(self) -> None:
        """Release every row and drop the views of the segment (the queue is unmapping)."""
        for row in list(self._regions):
            self._release(row)
        self._pinned.clear()
        self._rows = None

    def _release(self, row: int) -> None:
        if self._rows is not None:
            self._rows.live[row] = 0  # first: a worker looking now drops its mapping
        self._retiring.discard(row)
        self._pins[row] = 0
        self._regions.pop(row).close()
        self._free.append(row)

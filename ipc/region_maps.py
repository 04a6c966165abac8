"""The region table, worker side: a worker's read-only mappings of the client regions its
claims name (the table and its rules: ``ipc/region_table.py``).

A claim whose descriptor names ``(row, generation, offset)`` is read in place:
:meth:`RegionMaps.image` returns a ``(height, width)`` uint8 view of the worker's own mapping
of that region, made on first use (``ipc/regions.py`` ``open_published``: through the main
process's descriptor, checked to be the published inode, sealed against shrinking, mapped
``PROT_READ``). Mappings are cached by row and generation: a row published again under a new
generation is a new region, mapped afresh, the old mapping dropped. Every read is bounds
checked here again against the size published, in Python's unbounded integers (the main
process checked it at admission too), so a worker never reads outside the region.

Mappings are dropped when their row is no longer live under the cached generation
(:meth:`RegionMaps.forget_released`, which the worker loop calls every turn, so at least once a
heartbeat): the main process releases a row only once no request names it, so no claim this
worker holds, nor a batch it has in flight, reads a mapping being dropped. ``on_map`` /
``on_unmap`` let a GPU backend page-lock each mapping once and unlock it before it goes
(``workers/cuda.py``).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from scratchd.ipc.layout import Columns
from scratchd.ipc.regions import RegionError, open_published

MapHook = Callable[[np.ndarray], None]


@dataclass(eq=False)
class _Mapped:
    generation: int
    mapping: mmap.mmap
    pixels: np.ndarray  # [size] uint8 over the mapping, read-only


class RegionMaps:
    """One worker's mappings of published regions, by table row."""

    def __init__(self, rows: np.ndarray, owner_pid: int) -> None:
        self._rows: Columns | None = Columns(rows)  # None once closed
        self._owner_pid = owner_pid
        self._maps: dict[int, _Mapped] = {}
        self.on_map: MapHook | None = None
        self.on_unmap: MapHook | None = None

    def __len__(self) -> int:
        return len(self._maps)

    def set_hooks(self, on_map: MapHook | None, on_unmap: MapHook | None) -> None:
        """Call ``on_map`` with each new mapping's pixels, ``on_unmap`` before it goes."""
        self.on_map, self.on_unmap = on_map, on_unmap
        if on_map is not None:
            for mapped in self._maps.values():
                on_map(mapped.pixels)

    def image(self, row: int, generation: int, offset: int, height: int, width: int) -> np.ndarray:
        """The ``(height, width)`` grey image at ``offset`` of region ``(row, generation)``;
        :class:`RegionError` if that region is not published or the bytes lie outside it."""
        mapped = self._maps.get(row)
        if mapped is None or mapped.generation != generation:
            mapped = self._map(row, generation)
        size, n = len(mapped.pixels), height * width
        if offset < 0 or height <= 0 or width <= 0 or offset > size or n > size - offset:
            raise RegionError(
                f"{height}x{width} pixels at offset {offset} lie outside region row {row} "
                f"of {size} bytes"
            )
        return mapped.pixels[offset : offset + n].reshape(height, width)

    def forget_released(self) -> None:
        """Drop the mappings of rows the main process released or published anew."""
        if not self._maps:
            return
        rows = self._rows
        assert rows is not None
        for row, mapped in list(self._maps.items()):
            if not rows.live[row] or rows.generation[row] != mapped.generation:
                self._drop(row)

    def close(self) -> None:
        """Drop every mapping and the views of the segment (the queue is unmapping)."""
        for row in list(self._maps):
            self._drop(row)
        self._rows = None

    def _map(self, row: int, generation: int) -> _Mapped:
        if row in self._maps:
            self._drop(row)
        rows = self._rows
        if rows is None:
            raise RegionError("the queue is closed")
        if not 0 <= row < len(rows.live):
            raise RegionError(f"region row {row} outside the table")
        if not rows.live[row] or rows.generation[row] != generation:
            raise RegionError(f"region row {row} generation {generation} is not published")
        fd, size, dev, ino = rows.fd[row], rows.size[row], rows.dev[row], rows.ino[row]
        mapping = open_published(self._owner_pid, fd, size, dev, ino)
        pixels = np.frombuffer(mapping, np.uint8)  # read-only: the mapping is PROT_READ
        mapped = _Mapped(generation, mapping, pixels)
        self._maps[row] = mapped
        if self.on_map is not None:
            self.on_map(pixels)
        return mapped

    def _drop(self, row: int) -> None:
        mapped = self._maps.pop(row)
        if self.on_unmap is not None:
            self.on_unmap(mapped.pixels)
        # A view still alive (an image a caller kept) keeps the mapping until it is dropped.
        with contextlib.suppress(BufferError):
            mapped.mapping.close()

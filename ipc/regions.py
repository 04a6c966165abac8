"""A client's shared-memory region, mapped read-only by the daemon: what a descriptor must be,
and the bounds every read of it is checked against.

A gateway on the same machine need not send pixels through the socket: it registers a memfd
once (``protocol/wire.py`` ``RegisterRegion``; the descriptor travels with ``SCM_RIGHTS``, so
the kernel, not a name, decides who shares what) and then names ``(region, offset, height,
width, channels)`` per request. Whatever the client does to its descriptor afterwards, reading
the mapping must never fault and never leave the region:

- **What is accepted** (:func:`map_region`): a regular file (a pipe, socket, directory or
  device such as ``/dev/zero`` is refused) that carries the memfd seal ``F_SEAL_SHRINK``
  (:data:`~scratchd.protocol.wire.REGION_SEALS`), at least the announced size long, readable.
  Files that cannot be sealed (a POSIX ``shm_open`` object, a file on disk) are refused: any
  process holding such a file could ``ftruncate`` it below the daemon's mapping, and the next
  read of a page past the new end would kill the daemon with ``SIGBUS``. A shrink seal cannot
  be removed, so one check at registration holds for the region's life (growing is harmless:
  only the announced size is mapped).
- **The mapping**: ``PROT_READ``, ``MAP_SHARED``, exactly the announced size. The descriptor
  is closed once mapped (the mapping keeps the memory); nothing is ever written through it.
- **Every read** (:meth:`Region.view`): ``0 ≤ offset`` and ``offset + nbytes ≤ size``, checked
  in Python's unbounded integers before any view exists, so no sum can wrap.

A :class:`Region` is unmapped by :meth:`Region.close`; while a view of it is still alive (an
image conversion still reading it), the mapping stays until that view is dropped: the memory is
never unmapped under a reader.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from dataclasses import dataclass, field

from scratchd.protocol.wire import REGION_SEALS


class RegionError(ValueError):
    """A descriptor or a read that the daemon refuses; the message goes back to the client."""


def map_region(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of the memfd ``fd`` read-only, after checking it is one the daemon can
    read safely (module docstring). Does not close ``fd``."""
    if size <= 0:
        raise RegionError(f"region size must be positive, got {size}")
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise RegionError(f"descriptor cannot be inspected: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RegionError(f"descriptor is not a memfd (a {_kind(st.st_mode)})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise RegionError("descriptor is not a memfd (a file that cannot be sealed)") from None
    if seals & REGION_SEALS != REGION_SEALS:
        raise RegionError(
            "memfd is not sealed against shrinking: create it with MFD_ALLOW_SEALING and add "
            "F_SEAL_SHRINK (fcntl F_ADD_SEALS) before registering it"
        )
    if st.st_size < size:
        raise RegionError(f"memfd holds {st.st_size} bytes, fewer than the {size} announced")
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError, OverflowError) as exc:
        raise RegionError(f"memfd cannot be mapped for reading: {exc}") from None


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "pipe"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


@dataclass(eq=False)
class Region:
    """One registered region: its id (per connection), size and read-only mapping."""

    id: int
    size: int
    mapping: mmap.mmap
    _view: memoryview = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._view = memoryview(self.mapping)

    @classmethod
    def from_descriptor(cls, region_id: int, fd: int, size: int) -> Region:
        """Map ``fd`` (checked by :func:`map_region`); the caller still closes ``fd``."""
        return cls(region_id, size, map_region(fd, size))

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``offset``, read-only; :class:`RegionError` if any lies outside."""
        if offset < 0 or nbytes <= 0 or offset > self.size or nbytes > self.size - offset:
            raise RegionError(
                f"{nbytes} bytes at offset {offset} lie outside region {self.id} "
                f"of {self.size} bytes"
            )
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap now, or, while a view handed out is still alive, once the last one is dropped."""
        with contextlib.suppress(BufferError):  # a view still reads: the mmap's dealloc unmaps
            self._view.release()
            self.mapping.close()

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
- **The mapping**: ``PROT_READ``, ``MAP_SHARED``, exactly the announced size; nothing is ever
  written through it. The daemon keeps its own duplicate of the descriptor (close-on-exec)
  while the region is registered: workers open the same memfd through
  ``/proc/<daemon pid>/fd/<n>`` (:func:`open_published`) and map it read-only in turn,
  after the same checks and one more: that what they opened is the inode the daemon
  published (``st_dev``, ``st_ino``), so a descriptor number reused meanwhile is refused.
- **Every read** (:meth:`Region.view`): ``0 ≤ offset`` and ``offset + nbytes ≤ size``, checked
  in Python's unbounded integers before any view exists, so no sum can wrap.

A :class:`Region` is unmapped (and its descriptor closed) by :meth:`Region.close`; while a
view of it is still alive (an image conversion still reading it), the mapping stays until that
view is dropped: the memory is never unmapped under a reader.
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


def open_published(owner_pid: int, fd: int, size: int, dev: int, ino: int) -> mmap.mmap:
    """A worker's read-only mapping of the region the main process ``owner_pid`` holds as
    descriptor ``fd``: reopened through ``/proc``, refused unless it is the inode ``(dev,
    ino)`` published, then checked and mapped as :func:`map_region` does."""
    path = f"/proc/{owner_pid}/fd/{fd}"
    try:
        own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise RegionError(f"region descriptor {path} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(own)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise RegionError(f"{path} is no longer the region published (descriptor reused)")
        return map_region(own, size)
    finally:
        os.close(own)


@dataclass(eq=False)
class Region:
    """One registered region: its id (per connection), size, read-only mapping and the
    daemon's descriptor of it (``fd``, ``dev``, ``ino``: what workers open,
    ``ipc/region_table.py``).

    ``row`` and ``generation`` name it in the region table once published there (None: not
    published, its grey pixels are copied into the queue's slots instead)."""

    id: int
    size: int
    mapping: mmap.mmap
    fd: int = -1
    dev: int = 0
    ino: int = 0
    row: int | None = None
    generation: int = 0
    _view: memoryview = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._view = memoryview(self.mapping)

    @classmethod
    def from_descriptor(cls, region_id: int, fd: int, size: int) -> Region:
        """Map ``fd`` (checked by :func:`map_region`) and keep a close-on-exec duplicate of it;
        the caller still closes ``fd``."""
        mapping = map_region(fd, size)
        st = os.fstat(fd)
        return cls(region_id, size, mapping, os.dup(fd), st.st_dev, st.st_ino)

    def check(self, offset: int, nbytes: int) -> None:
        """:class:`RegionError` unless all ``nbytes`` at ``offset`` lie inside the region."""
        if offset < 0 or nbytes <= 0 or offset > self.size or nbytes > self.size - offset:
            raise RegionError(
                f"{nbytes} bytes at offset {offset} lie outside region {self.id} "
                f"of {self.size} bytes"
            )

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``offset``, read-only; :class:`RegionError` if any lies outside."""
        self.check(offset, nbytes)
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        """Close the descriptor; unmap now, or, while a view handed out is still alive, once
        the last one is dropped."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(BufferError):  # a view still reads: the mmap's dealloc unmaps
            self._view.release()
            self.mapping.close()

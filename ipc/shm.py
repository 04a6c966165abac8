"""The shared-memory segment behind the request queue: create, attach, replace, remove.

The layout (an ASCII drawing of every region, the record dtypes and who writes which field
under which lock) is in ``ipc/layout.py``; this module maps it.

Room is checked when the segment is created: a ``/dev/shm`` too small for the geometry is a
clear :class:`SegmentError` at start-up rather than a SIGBUS while serving. Pages are not
reserved up front (a dead daemon's leftover segment would pin that RAM until replaced).

Lifecycle: :meth:`Segment.create` replaces an existing segment that nobody owns any more (a
dead daemon's, whatever its layout version, or a foreign one) and refuses one whose owner is
alive, naming its pid. Liveness is an exclusive
``flock`` the owner holds on the segment's file for its whole life: the kernel drops it when
the owner dies, so no pid-reuse guesswork is involved. :meth:`Segment.attach` maps an
existing segment after checking magic, version and size.

The daemon does not use a name anyone can predict: :meth:`Segment.create_unique` appends 64
random bits to a prefix and creates that name with ``O_EXCL`` (never opening what is there),
so no other user can create it first, flock it or hand the daemon a segment of theirs; the
workers are given the name. Dead segments under the prefix are removed first
(:func:`remove_dead`): only those owned by this user, whose flock is free and whose header is
whole (a segment being created has no magic yet), so another user's files and a live daemon's
segment are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
import time

import numpy as np
import posix_ipc

from scratchd.ipc.layout import (
    DESC_DTYPE,
    HEADER_BYTES,
    HEADER_DTYPE,
    LAYOUT_VERSION,
    MAGIC,
    MAX_REGIONS,
    PRIORITIES,
    REGION_DTYPE,
    RESULT_DTYPE,
    RESULT_FIELDS,
    WORKER_DTYPE,
    Block,
    Columns,
    Geometry,
    layout,
    mask_bytes,
)

__all__ = ["Geometry", "Segment", "SegmentError"]


class SegmentError(RuntimeError):
    """The segment is missing, foreign, of another layout version, or owned by a live daemon."""


class Segment:
    """A mapped segment: the mmap, typed numpy views of each region, and the owner's flock."""

    def __init__(self, name: str, mm: mmap.mmap, lock_fd: int | None) -> None:
        self.name = name
        self.mm = mm
        self.owner = lock_fd is not None
        self._lock_fd = lock_fd
        self.header = np.ndarray((), HEADER_DTYPE, buffer=mm, offset=0)
        h = self.header
        self.geometry = Geometry(
            slots=int(h["slots"]),
            slot_bytes=int(h["slot_bytes"]),
            tick_ms=int(h["tick_ms"]),
            max_workers=int(h["max_workers"]),
            wheel_ticks=int(h["wheel_ticks"]),
        )
        g = self.geometry
        self.descs = np.ndarray((g.slots,), DESC_DTYPE, buffer=mm, offset=int(h["desc_off"]))
        self.results = np.ndarray((g.slots,), RESULT_DTYPE, buffer=mm, offset=int(h["result_off"]))
        self.d = Columns(self.descs)
        self.r = Columns(self.results)
        self.result_block = Block(mm, int(h["result_off"]), RESULT_DTYPE, RESULT_FIELDS)
        self.workers = np.ndarray(
            (g.max_workers,), WORKER_DTYPE, buffer=mm, offset=int(h["worker_off"])
        )
        self.regions = np.ndarray(
            (MAX_REGIONS,), REGION_DTYPE, buffer=mm, offset=int(h["region_off"])
        )
        index = np.ndarray(
            (3 * PRIORITIES + g.wheel_ticks,), np.int32, buffer=mm, offset=int(h["index_off"])
        )
        self.ready_head = index[0:PRIORITIES]
        self.ready_tail = index[PRIORITIES : 2 * PRIORITIES]
        self.ready_count = index[2 * PRIORITIES : 3 * PRIORITIES]
        self.wheel_head = index[3 * PRIORITIES :]
        self.inputs = np.ndarray(
            (g.slots, g.slot_bytes), np.uint8, buffer=mm, offset=int(h["input_off"])
        )
        self.masks = np.ndarray(
            (g.slots, mask_bytes(g.slot_bytes)), np.uint8, buffer=mm, offset=int(h["mask_off"])
        )

    @classmethod
    def create(cls, name: str, geometry: Geometry) -> Segment:
        """Create ``name`` (mode 0600), replacing a stale one; refuse a live owner's."""
        geometry.validate()
        for _ in range(3):
            segment = cls._create_new(name, geometry)
            if segment is not None:
                return segment
            _remove_if_stale(name)
        raise SegmentError(f"shared memory {name}: could not create it (raced with another owner)")

    @classmethod
    def create_unique(cls, prefix: str, geometry: Geometry) -> Segment:
        """Create ``prefix`` + 16 random hex digits (mode 0600, ``O_EXCL``), after removing
        this user's dead segments under ``prefix``; whatever else exists is left alone."""
        geometry.validate()
        remove_dead(prefix)
        for _ in range(8):
            segment = cls._create_new(prefix + secrets.token_hex(8), geometry)
            if segment is not None:
                return segment
        raise SegmentError(f"shared memory {prefix}*: every random name drawn already exists")

    @classmethod
    def _create_new(cls, name: str, geometry: Geometry) -> Segment | None:
        """Create ``name`` with ``O_EXCL`` and own it; None if it exists."""
        offsets = layout(geometry)
        try:
            shm = posix_ipc.SharedMemory(
                name, posix_ipc.O_CREX, mode=0o600, size=offsets["total_bytes"]
            )
        except posix_ipc.ExistentialError:
            return None
        fd = os.dup(shm.fd)  # ours to keep open (and flocked) for the owner's lifetime
        shm.close_fd()
        # Liveness first: hold the flock before the header says it is a segment. Blocking:
        # remove_dead may hold it for an instant (and leaves a segment without magic alone).
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o600)  # independent of the umask
        _check_room(name, fd, offsets["total_bytes"])
        mm = mmap.mmap(fd, offsets["total_bytes"])
        _write_header(mm, geometry, offsets)
        return cls(name, mm, lock_fd=fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment after checking its magic, layout version and size."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise SegmentError(f"shared memory {name} does not exist (is the daemon up?)") from exc
        try:
            size = os.fstat(shm.fd).st_size
            problem = _header_problem(shm.fd, size)
            if problem:
                raise SegmentError(f"shared memory {name}: {problem}")
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, mm, lock_fd=None)

    def header_cell(self, field: str) -> memoryview:
        """A one-element view of a header field: ``cell[0]`` reads or writes it quickly."""
        fields = HEADER_DTYPE.fields
        assert fields is not None
        dtype, offset = fields[field][:2]
        return np.ndarray((1,), dtype, buffer=self.mm, offset=offset).data

    def close(self) -> None:
        """Unmap (views must be dropped first; the caller owns that) and drop the flock."""
        for attr in ("header", "descs", "results", "workers", "regions", "inputs", "masks"):
            setattr(self, attr, None)
        for attr in ("d", "r", "ready_head", "ready_tail", "ready_count", "wheel_head"):
            setattr(self, attr, None)
        # A caller may still hold a payload view: then the mapping goes with the last view.
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def unlink(self) -> None:
        """Remove the name (mapped copies stay valid until unmapped). Idempotent."""
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self.name)


def _check_room(name: str, fd: int, size: int) -> None:
    """Refuse a segment that ``/dev/shm`` cannot hold. Pages stay lazily allocated (a queue
    sized for 4 MiB frames mostly carries smaller ones, and a dead daemon's leftover should
    not pin RAM), so this is a start-up check, not a reservation: touching a page that tmpfs
    cannot supply is a SIGBUS, and the common cause — a container's 64 MiB ``/dev/shm`` under
    a default 1.2 GB queue — is caught here with a clear message."""
    fs = os.fstatvfs(fd)
    free = fs.f_bavail * fs.f_frsize
    if size > free:
        os.close(fd)
        posix_ipc.unlink_shared_memory(name)
        raise SegmentError(
            f"shared memory {name}: needs {size} bytes but /dev/shm has {free} free — lower "
            "[queue] slots or slot_bytes, or enlarge /dev/shm"
        )


def _write_header(mm: mmap.mmap, g: Geometry, offsets: dict[str, int]) -> None:
    # Everything but the magic first: an attacher that sees the magic sees a whole header.
    h = np.ndarray((), HEADER_DTYPE, buffer=mm, offset=0)
    h["version"] = LAYOUT_VERSION
    h["header_bytes"] = HEADER_BYTES
    for field in ("slots", "slot_bytes", "tick_ms", "max_workers", "wheel_ticks"):
        h[field] = getattr(g, field)
    for field, value in offsets.items():
        h[field] = value
    h["owner_pid"] = os.getpid()
    h["clock_base_ns"] = time.monotonic_ns()
    h["magic"] = MAGIC
    del h


def _header_problem(fd: int, size: int) -> str | None:
    if size < HEADER_BYTES:
        return f"only {size} bytes, smaller than a header"
    raw = os.pread(fd, HEADER_DTYPE.itemsize, 0)
    h = np.frombuffer(raw, HEADER_DTYPE)[0]
    if bytes(h["magic"]) != MAGIC:
        return "not a scratchd queue (bad magic)"
    if int(h["version"]) != LAYOUT_VERSION:
        return f"layout version {int(h['version'])}, this build reads {LAYOUT_VERSION}"
    if int(h["total_bytes"]) > size:
        return f"truncated: {size} bytes of {int(h['total_bytes'])}"
    return None


def _remove_if_stale(name: str) -> None:
    """Unlink ``name`` unless a live owner holds its flock (then raise SegmentError)."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return  # vanished meanwhile: just retry the create
    try:
        try:
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.pread(shm.fd, HEADER_DTYPE.itemsize, 0)
            pid = "?"
            if len(raw) == HEADER_DTYPE.itemsize:
                pid = str(int(np.frombuffer(raw, HEADER_DTYPE)[0]["owner_pid"]))
            raise SegmentError(
                f"shared memory {name} is in use by a running daemon (pid {pid})"
            ) from None
        # We hold the dead owner's lock now: nobody live uses it. Unlink by name; the inode
        # goes away when the last stale mapping does.
        posix_ipc.unlink_shared_memory(name)
    finally:
        shm.close_fd()


SHM_DIR = "/dev/shm"


def remove_dead(prefix: str) -> list[str]:
    """Unlink this user's segments whose names start with ``prefix`` and whose owner is gone
    (flock free, header whole); returns their names. Others' files, live segments and
    segments still being created are left alone."""
    removed = []
    stem = prefix.lstrip("/")
    with contextlib.suppress(OSError):
        entries = [e for e in os.listdir(SHM_DIR) if e.startswith(stem)]
        for entry in entries:
            if _is_dead_segment(os.path.join(SHM_DIR, entry)):
                with contextlib.suppress(posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                    posix_ipc.unlink_shared_memory("/" + entry)
                    removed.append("/" + entry)
    return removed


def _is_dead_segment(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # not ours to open, or gone
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live owner holds it
        return _header_problem(fd, st.st_size) is None
    finally:
        os.close(fd)  # drops the flock too

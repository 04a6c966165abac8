"""The client's side of zero-copy requests: a memfd ring of image slots the daemon reads in place.

On a connection made with ``zero_copy=True`` (the default) the client creates one memfd of
``slots × slot_bytes``, seals it against shrinking and growing, and registers it with the
daemon (:func:`register_ring`: the handshake of ``protocol/wire.py`` ``RegisterRegion``, the
descriptor passed with ``SCM_RIGHTS``). A uint8 array then goes into a free slot (one copy, the
one it would otherwise take into the socket frame) and the request names
``(region, offset, height, width, channels)``: no pixel crosses the socket, and the daemon's
main process reads them from the shared memory.

Ownership, which the clients in ``client/api.py`` keep and any other gateway must keep too:

- a slot is written only while free; it is taken for one request and becomes free again when
  that request's reply has been read, never before (a call that timed out keeps its slot until
  its late reply arrives and is dropped), since until then the daemon may read it;
- the region lives as long as the connection: when it closes, the daemon unmaps it;
- when no slot is free, the image is bigger than a slot, or registration was refused (an older
  daemon, a limit of the daemon's, a remote socket that cannot pass descriptors), the request
  goes over the socket as before: the fast path is an optimisation, never a new way to fail.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import mmap
import os
import socket
from dataclasses import dataclass
from typing import Final, TypeVar

import numpy as np

from scratchd.protocol import wire

DEFAULT_SLOTS: Final = 32
DEFAULT_SLOT_BYTES: Final = 4 << 20
"""A slot holds a 1024x1024 RGB frame or a 2048x2048 grey one; larger images use the socket."""
_Image = TypeVar("_Image")
_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass(frozen=True, slots=True)
class RegionImage:
    """An image placed in a registered region: what a request names instead of its pixels."""

    region: int
    offset: int
    height: int
    width: int
    channels: int


def create_memfd(size: int, name: str = "scratchd-region") -> int:
    """A close-on-exec memfd of ``size`` bytes, sealed so it can never shrink or grow (the
    daemon refuses one that could shrink: ``ipc/regions.py``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SlotRing:
    """A memfd of ``slots`` image slots of ``slot_bytes`` each, mapped read-write here; each
    slot holds one request's pixels from :meth:`place` until :meth:`release` of its reply."""

    def __init__(self, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"a ring needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}"
            )
        self.slot_bytes = -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = slots * self.slot_bytes
        self.fd = create_memfd(self.size)
        try:
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self.region = 0  # the daemon's id for it, once registered
        self._free = list(range(slots - 1, -1, -1))
        self._busy: dict[int, int] = {}  # request id -> slot

    def place(self, request_id: int, image: np.ndarray) -> RegionImage | None:
        """Copy ``image`` into a free slot for request ``request_id``; None (nothing taken) if
        the ring is not registered, none is free, or it is no uint8 image that fits a slot."""
        if not self.region or not self._free or image.dtype != np.uint8 or image.size == 0:
            return None
        if image.ndim == 3 and image.shape[2] == 3:
            channels = 3
        elif image.ndim == 2:
            channels = 1
        else:
            return None
        if image.nbytes > self.slot_bytes or request_id in self._busy:
            return None
        slot = self._free.pop()
        offset = slot * self.slot_bytes
        np.copyto(np.ndarray(image.shape, np.uint8, buffer=self._map, offset=offset), image)
        self._busy[request_id] = slot
        return RegionImage(self.region, offset, image.shape[0], image.shape[1], channels)

    def release(self, request_id: int) -> None:
        """Request ``request_id`` is answered: its slot (if it had one) may be written again."""
        slot = self._busy.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def in_use(self) -> int:
        return len(self._busy)

    def close_descriptor(self) -> None:
        """The daemon has the descriptor (or refused it): the mapping is all this side needs."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        self.close_descriptor()
        with contextlib.suppress(BufferError):  # an array still views a slot: unmapped with it
            self._map.close()


def place(ring: SlotRing | None, request_id: int, image: _Image) -> _Image | RegionImage:
    """``image`` placed in a slot of ``ring`` when it is an array that can be, else as it is."""
    if ring is None or not isinstance(image, np.ndarray):
        return image
    placed = ring.place(request_id, image)
    return image if placed is None else placed


def send_descriptor(sock: socket.socket, fd: int) -> None:
    """The handshake's byte, carrying ``fd`` (after the daemon's ``SendDescriptor``)."""
    fds = array.array("i", [fd])
    sock.sendmsg([wire.DESCRIPTOR_BYTE], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])


def accept_registration(ring: SlotRing, answer: wire.DaemonMessage) -> tuple[SlotRing | None, str]:
    """The ring, registered, if ``answer`` (the last to its ``RegisterRegion``) says so, else
    ``(None, why not)`` with the ring closed. The descriptor is closed either way."""
    ring.close_descriptor()
    if isinstance(answer, wire.RegionReply) and answer.status == "ok" and answer.region:
        ring.region = answer.region
        return ring, ""
    ring.close()
    if isinstance(answer, wire.RegionReply | wire.Reply):  # a Reply: a daemon without regions
        return None, f"{answer.status}: {answer.error}"
    return None, f"unexpected answer {type(answer).__name__}"

"""Host memory a CUDA worker uploads from: ranges page-locked with CUDA, and a pinned staging
buffer for frames that lie outside them.

Two kinds of range are page-locked (``cudaHostRegister``), each once:

- the queue's input slots (read-write shared memory), at boot;
- each client region a claim names (``ipc/region_maps.py``), when the worker first maps it.
  That mapping is ``PROT_READ``, so it is registered with ``cudaHostRegisterReadOnly``: the
  device only reads it, which is all an upload does. It is unregistered before the worker
  unmaps it. A device that cannot register read-only memory (the flag needs the device
  attribute ``cudaDevAttrHostRegisterReadOnlySupported``) leaves it unregistered: its frames
  go through the staging buffer, correct but with one more host copy.

``source`` is what an upload reads: the frame itself when it lies, contiguous, inside a
registered range (the DMA reads the slot or the client's region directly), else a copy in the
staging buffer, reused only once the copy stream has drained it.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import numpy as np

from scratchd.protocol.log import log_event

HOST_REGISTER_READ_ONLY: Final = 8  # cudaHostRegisterReadOnly
"""CUDA's flag for page-locking memory the device will only read (a read-only mapping)."""


class PinnedHost:
    """The page-locked ranges of one worker and its staging buffer. ``cp`` is CuPy (or a
    stand-in with its ``cuda.runtime`` calls, for tests); ``copy_stream`` the uploads'."""

    def __init__(self, cp: Any, copy_stream: Any) -> None:
        self.cp = cp
        self.copy_stream = copy_stream
        self.ranges: dict[int, int] = {}  # ptr -> nbytes, registered with CUDA
        self._staging: Any = None
        self._read_only_refused = False

    def register(self, array: np.ndarray, *, read_only: bool = False) -> bool:
        """Page-lock ``array``'s memory; True when registered. A read-only range the device
        cannot register is left to the staging buffer (False, logged once)."""
        ptr, nbytes = int(array.ctypes.data), int(array.nbytes)
        if ptr in self.ranges or nbytes == 0:
            return ptr in self.ranges
        if not read_only:
            self.cp.cuda.runtime.hostRegister(ptr, nbytes, 0)
        else:
            try:
                self.cp.cuda.runtime.hostRegister(ptr, nbytes, HOST_REGISTER_READ_ONLY)
            except self.cp.cuda.runtime.CUDARuntimeError as exc:
                if not self._read_only_refused:
                    self._read_only_refused = True
                    log_event("region_not_page_locked", logging.WARNING, reason=str(exc))
                return False
        self.ranges[ptr] = nbytes
        return True

    def unregister(self, array: np.ndarray) -> None:
        """Undo :meth:`register` for ``array`` (before its memory is unmapped)."""
        ptr = int(array.ctypes.data)
        if self.ranges.pop(ptr, None) is not None:
            self.cp.cuda.runtime.hostUnregister(ptr)

    def unregister_all(self) -> None:
        for ptr in list(self.ranges):
            del self.ranges[ptr]
            self.cp.cuda.runtime.hostUnregister(ptr)

    def registered(self, ptr: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``ptr`` lie inside one registered range."""
        return any(lo <= ptr and ptr + nbytes <= lo + size for lo, size in self.ranges.items())

    def source(self, img: np.ndarray, j: int, nbytes: int) -> int:
        """A page-locked address holding ``img`` (frame ``j`` of a chunk): the frame itself if
        it lies in registered memory (and is contiguous), else a copy in the staging buffer."""
        ptr = int(img.ctypes.data)
        if img.flags.c_contiguous and self.registered(ptr, nbytes):
            return ptr
        # The staging buffer is reused only after the copy stream has drained it.
        self.copy_stream.synchronize()
        need = (j + 1) * nbytes
        if self._staging is None or self._staging.nbytes < need:
            import cupyx

            self._staging = cupyx.empty_pinned((max(need, 16 * nbytes),), np.uint8)
        self._staging[j * nbytes : need] = np.ascontiguousarray(img).reshape(-1)
        return int(self._staging.ctypes.data) + j * nbytes

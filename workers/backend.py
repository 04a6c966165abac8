"""What a worker's backend is, and what some backends can do besides.

Every backend is a :class:`Backend`: it names its device and model version, warms up, and
answers a batch with ``infer``. Two capabilities are separate Protocols, because only some
backends have them and a backend without one must not carry no-op stand-ins for it:

- :class:`DeviceMemory`: the backend computes in memory of its own (a GPU's arena). It
  page-locks the queue's input slots and the client regions it maps for zero-copy uploads,
  limits a claim to what that memory holds now, and reports the memory's fragmentation into
  its worker row.
- :class:`AsyncBackend`: the backend computes asynchronously, in the steps the pipelined
  worker loop overlaps (``submit``, ``start``, ``collect``, ``finish_each``), and says how
  long a started batch has left on the device.

Both are ``runtime_checkable`` and are checked once, when the worker is built (``boot``
and ``serve`` in workers/main.py); the loop then calls the capability it was given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from scratchd.ipc.queue import Result

BatchT = TypeVar("BatchT")
"""An asynchronous backend's own record of one batch on its way through the device."""


class Backend(Protocol):
    device: str
    max_batch: int
    version: str

    @property
    def boot_ms(self) -> Mapping[str, float]:
        """The boot's parts the backend timed itself, for the worker's READY log line."""
        ...

    def warm_up(self) -> None: ...

    def infer(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> list[Result]: ...


@runtime_checkable
class DeviceMemory(Protocol):
    """A backend that computes in device memory of its own (the CUDA backend's arena)."""

    def register_host(self, region: np.ndarray) -> None:
        """Page-lock ``region`` (the queue's input slots) so uploads read it directly."""
        ...

    def register_region(self, pixels: np.ndarray) -> None:
        """A client region's read-only mapping the worker mapped: to be page-locked, a piece
        at a time, by :meth:`pin_pending`."""
        ...

    def unregister_region(self, pixels: np.ndarray) -> None:
        """The worker unmaps the region: no upload reads it from now on."""
        ...

    def pin_pending(self) -> bool:
        """One piece of page-locking (or unlocking) work; True while some is left. The worker
        loop calls it only when it has nothing to claim."""
        ...

    def pin_within(self, budget_ns: int) -> bool:
        """Page-lock a staged frame's pages if that fits in ``budget_ns`` by its measured
        cost; True if it did. The worker loop calls it instead of sleeping while a batch
        computes, with the time left before it must claim again."""
        ...

    def batch_limit(self) -> int:
        """How many frames the next claim may take (it follows the free device memory)."""
        ...

    def fragmentation_ratio(self) -> float:
        """The device memory's ``(free − largest free block) / total``."""
        ...


@runtime_checkable
class AsyncBackend(Backend, Protocol[BatchT]):
    """A backend that computes asynchronously (the CUDA backend; see PipelinedLoop)."""

    def submit(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> BatchT: ...

    def start(self, batch: BatchT) -> None: ...

    def collect(self, batch: BatchT) -> None: ...

    def finish_each(self, batch: BatchT) -> Iterator[tuple[int, Result]]:
        """(batch position, Result) of each frame as soon as the host has finished it,
        every position exactly once (the loop completes each at once)."""
        ...

    def expected_ms(self, batch: BatchT) -> float:
        """The device time a started batch has left; 0 when it has not been measured."""
        ...

"""Threads and memory of the CPU schedule (:mod:`scratchd.cpu.schedule`).

A layer is cut into bands (runs of output rows of one image); :func:`run_bands` hands them
to the calling thread and the pool's threads, which take the next band until none is left.
The band kernels (``cpu/_cpu.c``) and BLAS release the GIL, so the bands of one layer
really run on all cores.

Memory, per thread (``threading.local``; a forward on another thread never shares it):

```
Workspace   layer outputs  [N, Ho, Wo, Cout]   taken by a layer, handed back by the
                                               forward once no later layer reads them;
                                               the next forward takes them again
scratch     band buffers   "y" [R, Wo, Cin]    one flat buffer per tag, grown when too
                                               small, viewed at the band's shape
```

Both exist because a fresh large ``np.empty`` is a fresh ``mmap`` that page-faults on first
write, and at small frames those faults are a large share of the CPU time.

Placement: a pool thread woken by the caller is often put on the caller's own CPU (the
kernel's wake-affine placement), and both bands of a layer then share one core until the
load balancer separates them (after an idle pause the first few forwards run at one thread's
speed; docs/benchmarks.md, CPU forward). So a pool thread that
finds itself on the caller's CPU moves off it at once (``_cpu.leave_cpu``; its affinity
mask is left as it was, nothing stays pinned).

OpenBLAS would start its own threads for every band's matmul and fight the pool for the
cores, so a forward runs under :func:`single_threaded_blas` (threadpoolctl; it caps BLAS
threads process-wide for its duration). Without threadpoolctl :func:`available` is False
and the network runs op by op.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from scratchd.cpu import _cpu

try:
    from threadpoolctl import ThreadpoolController
except ImportError:  # pragma: no cover - optional: the GPU image need not have it
    ThreadpoolController = None

THREADS = len(os.sched_getaffinity(0)) or 1  # the CPUs this process may run on
_POOL = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="scratchd-cpu")
_CONTROLLER: Any = None
_LOCAL = threading.local()

Task = tuple[int, int, int]  # (image, first output row, end row)


class Workspace:
    """Layer outputs recycled from one forward to the next (per thread; see :func:`workspace`).

    A fresh large ``np.empty`` page-faults every 4 KB page on first write. The forward hands
    each activation back once no later layer reads it, and the next layer (or the next
    forward) of that shape takes it again. At most ``limit`` bytes are kept."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit = limit
        self.kept = 0
        self.free: dict[tuple[int, ...], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...]) -> np.ndarray:  # float32, contents undefined
        stack = self.free.get(shape)
        if stack:
            arr = stack.pop()
            self.kept -= arr.nbytes
            return arr
        return np.empty(shape, dtype=np.float32)

    def give(self, arr: np.ndarray) -> None:
        if self.kept + arr.nbytes <= self.limit:
            self.free.setdefault(arr.shape, []).append(arr)
            self.kept += arr.nbytes


def workspace() -> Workspace:
    """The calling thread's :class:`Workspace`."""
    ws: Workspace | None = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    return ws


def scratch(tag: str, shape: tuple[int, ...]) -> np.ndarray:  # float32, contents undefined
    """A band temporary: a view of the calling thread's buffer ``tag``, grown when too small
    and reused by every later band."""
    bufs: dict[str, np.ndarray] | None = getattr(_LOCAL, "scratch", None)
    if bufs is None:
        bufs = _LOCAL.scratch = {}
    size = math.prod(shape)
    buf = bufs.get(tag)
    if buf is None or buf.size < size:
        buf = bufs[tag] = np.empty(size, dtype=np.float32)
    return buf[:size].reshape(shape)


def available() -> bool:
    """Whether BLAS threads can be capped (so the banded schedule pays off)."""
    return ThreadpoolController is not None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Cap BLAS at one thread while the band threads run (process-wide, restored after)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    with _CONTROLLER.limit(limits=1, user_api="blas"):
        yield


def run_bands(fn: Callable[[Task], None], tasks: list[Task]) -> None:
    """Run ``fn`` on every ``(image, r0, r1)`` task: the calling thread and up to
    ``THREADS - 1`` pool threads take the next task until none is left."""
    todo = iter(tasks)
    caller_cpu = _cpu.current_cpu()

    def drain() -> None:
        for task in todo:  # a list iterator hands each task to exactly one thread
            fn(task)

    def helper() -> None:
        _cpu.leave_cpu(caller_cpu)  # placed beside the caller by its wake-up: move now
        drain()

    helpers = [_POOL.submit(helper) for _ in range(min(THREADS, len(tasks)) - 1)]
    try:
        drain()
    finally:
        for f in helpers:
            f.result()

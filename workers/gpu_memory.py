"""How big a GPU batch may be, and which CPUs a GPU worker runs on (NVML).

Batch size is the smallest of: what is ready, ``max_batch``, and what the
card's free memory allows. The device memory a batch needs is held by its captured serving
graph (``gpu/serve_graph.py``): every buffer is allocated when the graph is captured and
reused by every replay, so serving itself never allocates. Memory is therefore decided when a
graph is captured, and :class:`BatchSizer` decides it from a ``free`` function::

    footprint(bucket b, size s) = measured at warm-up (bytes the first graph of s holds / b)
    a bucket may be used   ⇔  its graph is held already
                              or  b · per_frame(s) + reserve  ≤  free()
    limit = the largest usable bucket ≤ max_batch  (buckets are 1, 2, 4, 8, 16)

The CUDA worker (``workers/cuda.py``) sizes its one device arena at boot from NVML's free
memory (v2: v1's ``used`` counts the driver's reservation, hundreds of MiB on an idle card) less
``workers.gpu_reserve_mb``, and then gives the sizer the arena's largest free block as
``free`` with no further reserve: the card's memory is decided once, at boot, and memory
another process takes later cannot shrink what this worker holds.

A capture that fails with out-of-memory anyway marks its bucket unusable for
``RETRY_AFTER_S`` and the batch runs in smaller buckets; it is counted (``oom_refusals``),
never hidden.

CPU affinity: NVML's ``nvmlDeviceGetCpuAffinity`` bitmask of the card's NUMA-near
cores, intersected with the CPUs this process may use (a cgroup or ``taskset`` narrows them);
an empty intersection leaves the affinity as it is and says so.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

MIB: Final = 1024 * 1024
RESERVE_MB: Final = 1024
"""Device memory (MiB) a CUDA worker leaves free on its card beside its arena."""
ARENA_MB: Final = 16384
"""The most device memory (MiB) one CUDA worker's arena takes."""
WARM_SIZES: Final = ((1024, 1024),)
"""Frame sizes ``(height, width)`` whose graphs a CUDA worker captures before READY."""
RETRY_AFTER_S: Final = 5.0
"""How long a bucket whose capture ran out of memory stays unusable."""


@functools.cache
def nvml() -> Any:
    """The ``pynvml`` module (nvidia-ml-py), initialised once per process."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def handle_for_pci_bus(bus_id: str) -> Any:
    """NVML's handle of the card CUDA calls ``bus_id`` (CUDA's and NVML's numbering may differ:
    the PCI bus id is what both agree on)."""
    return nvml().nvmlDeviceGetHandleByPciBusId(bus_id)


def free_bytes(handle: Any) -> int:
    """Free device memory from NVML's memory info v2 (driver reservation not counted free)."""
    lib = nvml()
    info = lib.nvmlDeviceGetMemoryInfo(handle, version=lib.nvmlMemory_v2)
    return int(info.free)


def cpus_from_mask(words: Iterable[int], bits_per_word: int = 64) -> set[int]:
    """The CPU numbers set in NVML's affinity bitmask (an array of unsigned longs)."""
    return {
        i * bits_per_word + bit
        for i, word in enumerate(words)
        for bit in range(bits_per_word)
        if (int(word) >> bit) & 1
    }


def pin_near(handle: Any) -> tuple[set[int], str]:
    """Pin this process to the card's NUMA-near CPUs; ``(cpus now, what was done)``."""
    allowed = os.sched_getaffinity(0)
    words = (os.cpu_count() or 64) // 64 + 1
    near = cpus_from_mask(nvml().nvmlDeviceGetCpuAffinity(handle, words))
    chosen = near & allowed
    if not chosen:
        return set(allowed), f"NVML's near CPUs {sorted(near)} are not allowed here; unchanged"
    os.sched_setaffinity(0, chosen)
    return chosen, f"pinned to {len(chosen)} CPUs near the card"


@dataclass
class BatchSizer:
    """The batch limit of one GPU worker; see the module docstring for the rule.

    ``free`` reads the card's free bytes (NVML in the worker, a function in tests);
    ``held`` maps each frame size to the buckets whose graphs exist; ``per_frame`` maps each
    size to its measured bytes per frame; ``fixed`` is the bytes a graph holds whatever its
    bucket (measured as the first graph's bytes minus its bucket times the per-frame bytes:
    0 when only one graph was measured).
    """

    buckets: Sequence[int]
    max_batch: int
    reserve_bytes: int
    free: Callable[[], int]
    per_frame: dict[tuple[int, int], int] = field(default_factory=dict)
    fixed: dict[tuple[int, int], int] = field(default_factory=dict)
    held: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    refused_until: dict[tuple[tuple[int, int], int], float] = field(default_factory=dict)
    oom_refusals: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        if list(self.buckets) != sorted(set(self.buckets)) or not self.buckets:
            raise ValueError(f"buckets must be increasing and non-empty, got {self.buckets}")

    def measured(self, size: tuple[int, int], footprints: dict[int, int]) -> None:
        """Record the bytes held by graphs of ``size`` per bucket (at least one bucket)."""
        if not footprints:
            raise ValueError("measured: no footprint given")
        items = sorted(footprints.items())
        if len(items) >= 2:
            (b0, m0), (b1, m1) = items[0], items[-1]
            per = max(1, (m1 - m0) // (b1 - b0))
        else:
            b0, m0 = items[0]
            per = max(1, m0 // b0)
        self.per_frame[size] = per
        self.fixed[size] = max(0, m0 - b0 * per)
        self.held.setdefault(size, set()).update(footprints)

    def need_bytes(self, size: tuple[int, int], bucket: int) -> int:
        """Device bytes a graph of ``bucket`` frames of ``size`` needs (estimated)."""
        per = self.per_frame.get(size) or max(self.per_frame.values(), default=0)
        return self.fixed.get(size, 0) + bucket * per

    def usable(self, size: tuple[int, int], bucket: int, now: float | None = None) -> bool:
        if bucket in self.held.get(size, ()):
            return True
        until = self.refused_until.get((size, bucket), 0.0)
        if (time.monotonic() if now is None else now) < until:
            return False
        return self.need_bytes(size, bucket) + self.reserve_bytes <= self.free()

    def limit(self, size: tuple[int, int] | None = None) -> int:
        """The most frames one batch may hold now (≥ 1 while any graph of the size is held).

        ``size`` None: the claim-time limit, before the claimed frames' sizes are known — the
        largest measured size decides (the most demanding frames the worker has seen)."""
        if size is None:
            if not self.per_frame:
                return 1
            size = max(self.per_frame, key=lambda s: self.per_frame[s])
        best = 0
        for b in self.buckets:
            if b > self.max_batch or not self.usable(size, b):
                break
            best = b
        if best == 0:  # nothing fits: the smallest held bucket still serves (its memory is ours)
            held = sorted(self.held.get(size, ()))
            best = held[0] if held else 1
        return min(best, self.max_batch)

    def refuse(self, size: tuple[int, int], bucket: int) -> None:
        """A capture of ``bucket`` ran out of memory: do not try it again for a while."""
        self.oom_refusals += 1
        self.refused_until[(size, bucket)] = time.monotonic() + RETRY_AFTER_S

    def hold(self, size: tuple[int, int], bucket: int) -> None:
        self.held.setdefault(size, set()).add(bucket)


CHUNK_COST_MS: Final = 0.05
"""What one more chunk costs beyond its graph's device time (a launch and a collect on the
host), in the split's cost units: it breaks ties towards fewer chunks."""


def split_batch(
    n: int, limit: int, buckets: Sequence[int], cost: Callable[[int], float] | None = None
) -> list[int]:
    """Chunk sizes for ``n`` frames, each ≤ the largest bucket within ``limit``, largest
    first. A chunk of m frames runs in the smallest bucket ≥ m (padded up to it), so the
    split minimises the summed ``cost(bucket)`` of the graphs run plus ``CHUNK_COST_MS`` a
    chunk. ``cost``: a bucket's device time (the worker's measured milliseconds);
    default: the bucket's size, i.e. no padded frame where a split avoids it (13 frames →
    8 + 4 + 1 rather than one padded 16)."""
    if n < 0 or limit < 1:
        raise ValueError(f"split_batch: n={n}, limit={limit}")
    usable = [b for b in buckets if b <= limit] or [1]  # increasing
    price = {b: (cost(b) if cost is not None else float(b)) + CHUNK_COST_MS for b in usable}
    # best[r] = (cost, chunks) of the cheapest split of r frames, last[r] its last chunk: a
    # full bucket b <= r, or the whole rest r padded into the smallest bucket above it.
    best: list[tuple[float, int]] = [(0.0, 0)] + [(float("inf"), 0)] * n
    last = [0] * (n + 1)
    for r in range(1, n + 1):
        for b in usable:
            m = min(b, r)
            option = (best[r - m][0] + price[b], best[r - m][1] + 1)
            if option < best[r]:
                best[r], last[r] = option, m
            if b >= r:
                break  # larger buckets would pad the same rest more
    chunks = []
    while n > 0:
        chunks.append(last[n])
        n -= last[n]
    return sorted(chunks, reverse=True)

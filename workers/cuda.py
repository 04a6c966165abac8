"""The CUDA backend: ScratchNet's captured serving graphs on one GPU, fed from shared memory.

A CUDA worker is started with ``CUDA_VISIBLE_DEVICES`` naming its one card (the supervisor
does that), so in here the card is device 0. Boot (``CudaBackend.__init__`` + ``warm_up``)::

    import cupy ─▶ CUDA context ─▶ NVML handle by PCI bus id ─▶ pin to the card's near CPUs
    ─▶ one device arena (NVML free less the reserve; CuPy's allocator from here on)
    ─▶ weights ─▶ a ServeGraph per (bucket, warm size) that the arena holds ─▶ READY
    (each part timed in ``boot_ms``; the worker logs them at READY)

The data path of one batch (``submit`` → ``start`` → ``collect`` → ``finish``), all
ordering by events::

    shm payload slot ──cudaMemcpyAsync (copy stream)──▶ graph.inputs[k]   ┐ upload event
        (the input region is cudaHostRegister'ed: the DMA reads the      │
         slot itself, no host staging copy)                              ▼
    graph stream: wait(upload) ─ graph.launch(k) (start/end events inside ServeGraph)
    collect: only small results come back (score, entropy, histogram, runs)
    finish (host, overlapping the next batch's launch): runs → boxes, the mask where the
            request wants it

``k`` alternates between the graph's two input buffers, so the worker loop can upload batch
k+1 while batch k computes (workers/main.py's pipelined loop); before an input buffer is
written again, the copy stream waits for the event recorded after the launch that read it.
Frames in a client's region (``ipc/region_maps.py``) are uploaded straight from the worker's
read-only mapping of it, page-locked piece by piece while the worker has nothing to claim
(``register_region``, ``pin_pending``). Frames that are not in registered memory (a region
not locked yet, tests, a device that cannot page-lock read-only memory) go through pinned
staging areas instead — same streams, one extra host copy
(``workers/host_memory.py``).

GPU compute time per batch is the start → end event interval, carried in every reply's
``compute_ns``. The same time, per graph (an EWMA in ``graph_ms`` of the batches that ran
alone on the device, since a batch's chunks overlap there; the warm sizes' graphs are timed
at warm-up by the fastest of ``TIME_REPLAYS`` replays, a graph captured later from its first
lone batch), decides how ``submit`` splits a batch over the buckets: a chunk of m frames runs
padded in the smallest bucket ≥ m, so 5 frames go as 4 + 1 rather than a padded 8 when that
costs less device time (``gpu_memory.split_batch``; a bucket the split avoids is run and
re-timed once its time is ``REMEASURE_S`` old, ``_plan``), and tells the pipelined loop when
a batch should end (``expected_ms``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from scratchd.gpu.arena import DeviceArena
from scratchd.gpu.buckets import BUCKETS, bucket_for
from scratchd.gpu.cuda_scratchnet import CudaScratchNet
from scratchd.gpu.serve_graph import ServeGraph
from scratchd.ipc.queue import Result, Status
from scratchd.kernels import _cuda as cu
from scratchd.model.scratchnet import finish_upscaled, load_model, upscale2x, upscales
from scratchd.protocol.log import log_event
from scratchd.workers.batching import ewma
from scratchd.workers.gpu_memory import (
    ARENA_MB,
    MIB,
    RESERVE_MB,
    WARM_SIZES,
    BatchSizer,
    free_bytes,
    handle_for_pci_bus,
    pin_near,
    split_batch,
)
from scratchd.workers.host_memory import PinnedHost
from scratchd.workers.results import error_result, ok_result

H2D: Final = 1  # cudaMemcpyHostToDevice
MIN_ARENA: Final = 256 * MIB
GRAPH_MS_WEIGHT: Final = 0.1
"""Weight of the newest batch in a graph's device-time estimate."""
TIME_REPLAYS: Final = 5  # replays timed per new graph at boot (after one untimed)
REMEASURE_S: Final = 1.0
"""A held bucket that the split avoids (its time made smaller chunks look cheaper) runs once
as one chunk when its time is older than this, and that run's time replaces it (``_plan``)."""
REMEASURE_NOTE: Final = 0.25
"""A re-measured time this far (relative) from the one it replaces is logged to stderr."""


@dataclass
class Chunk:
    """Frames of one size run through one graph launch."""

    graph: Any  # kernels.serve_graph.ServeGraph
    positions: list[int]  # indices into the batch
    frames: list[np.ndarray]
    want_mask: list[bool]
    want_prob: bool = False  # frames that ran at 2x: their maps are finished on the host
    k: int = -1  # which input buffer; -1 until uploaded
    uploaded: Any = None  # cupy Event on the copy stream
    collected: Any = None  # serve_graph.Collected: the small outputs, on the host


@dataclass
class Batch:
    """A submitted batch: its chunks, in order."""

    size: int
    chunks: list[Chunk] = field(default_factory=list)
    # position → (status, reason): INVALID for a frame no model can take, ERROR when this
    # worker cannot (no device memory left for a new size's graph)
    errors: dict[int, tuple[Status, str]] = field(default_factory=dict)
    small: dict[int, np.ndarray] = field(default_factory=dict)  # position → frame run at 2x
    started: bool = False
    collected: bool = False


class CudaBackend:
    """One GPU's worth of serving graphs; see the module docstring."""

    device: str = "cuda"

    def __init__(
        self,
        model_path: str | None,
        max_batch: int,
        reserve_mb: int = RESERVE_MB,
        warm_sizes: Sequence[tuple[int, int]] = WARM_SIZES,
        arena_mb: int = ARENA_MB,
        views: Sequence[str] | None = None,  # config model.views; None: the model file's
    ) -> None:
        self.boot_ms: dict[str, float] = {}
        t0 = time.perf_counter()
        self.cp = cp = cu.cupy()
        self.boot_ms["import_cupy"] = _ms(t0)
        t0 = time.perf_counter()
        cp.cuda.Device(0).use()
        cp.cuda.runtime.free(0)  # creates the primary context now, not at the first kernel
        bus_id = cp.cuda.runtime.deviceGetPCIBusId(0)
        self.boot_ms["cuda_context"] = _ms(t0)

        self.nvml = handle_for_pci_bus(bus_id)
        self.cpus, self.affinity_note = pin_near(self.nvml)
        t0 = time.perf_counter()
        self.arena = self._open_arena(arena_mb * MIB, reserve_mb * MIB)
        self.boot_ms["arena"] = _ms(t0)
        t0 = time.perf_counter()
        model = load_model(model_path or None, views=views or None)
        self.net = CudaScratchNet(model)
        self.boot_ms["weights"] = _ms(t0)
        self.version: str = model.version
        self.device = f"cuda:{bus_id.lower()}"
        self.max_batch = max_batch
        self.warm_sizes = [(int(h), int(w)) for h, w in warm_sizes]
        # The reserve is outside the arena already: inside it, the largest free block is
        # what a new graph can get.
        self.sizer = BatchSizer(BUCKETS, max_batch, 0, lambda: self.arena.stats().largest_free)
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.host = PinnedHost(cp, self.copy_stream)  # what uploads read (host_memory.py)
        self._next_k: dict[tuple[int, int, int], int] = {}
        # (bucket, height, width) → the graph's device ms (CUDA events; EWMA of batches):
        # what submit's split weighs (gpu_memory.split_batch)
        self.graph_ms: dict[tuple[int, int, int], float] = {}
        self.graph_at: dict[tuple[int, int, int], float] = {}  # when each was last measured
        self.remeasure: set[tuple[int, int, int]] = set()  # run to replace a stale time

    # ---- boot -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Capture the warm sizes' graphs for every bucket free memory allows (``graphs``:
        modules from CuPy's disk cache, buffers, capture, one real pass)."""
        t0 = time.perf_counter()
        for size in self.warm_sizes:
            footprints: dict[int, int] = {}
            for b in BUCKETS:
                if b > self.max_batch:
                    break
                if footprints and not self.sizer.usable(size, b):
                    break
                g = self._capture(b, size)
                if g is None:
                    break
                self._time(g)
                footprints[b] = int(g.footprint_bytes)
                if len(footprints) == 1:
                    self.sizer.measured(size, footprints)
            self.sizer.measured(size, footprints)
        # One real pass through the whole data path (upload, graph, fetch).
        h, w = self.warm_sizes[0]
        self.infer([np.zeros((h, w), np.uint8)], [True])
        self.boot_ms["graphs"] = _ms(t0)

    def _open_arena(self, want: int, reserve: int) -> Any:
        """One arena for all of this worker's device memory, sized by NVML's free memory
        now (v2) less the reserve, at most ``want`` bytes; CuPy allocates from it."""
        free = free_bytes(self.nvml)
        size = min(want, free - reserve)
        if size < MIN_ARENA:
            raise RuntimeError(
                f"{free / MIB:.0f} MiB free on the card, {reserve / MIB:.0f} MiB reserved: "
                f"less than the {MIN_ARENA / MIB:.0f} MiB a CUDA worker needs"
            )
        arena = DeviceArena(size)
        self._previous_allocator = self.cp.cuda.get_allocator()
        arena.install()
        return arena

    def fragmentation_ratio(self) -> float:
        """The arena's ``(free − largest free block) / total`` (gpu/arena.py)."""
        return float(self.arena.fragmentation_ratio())

    def register_host(self, region: np.ndarray) -> None:
        """Page-lock ``region`` (the queue's input slots) so uploads DMA straight from it."""
        t0 = time.perf_counter()
        self.host.register(region)
        self.boot_ms["host_register"] = _ms(t0)

    # Client regions (DeviceMemory's methods): page-locked and unlocked a range at a time off
    # the claim path, their mapping alive until then (``workers/host_memory.py`` says why).
    def register_region(self, pixels: np.ndarray) -> None:
        self.host.adopt(pixels)

    def unregister_region(self, pixels: np.ndarray) -> None:
        self.host.retire(pixels)

    def pin_pending(self) -> bool:
        return self.host.pin_pending()

    def pin_within(self, budget_ns: int) -> bool:
        return self.host.pin_within(budget_ns)

    def unregister_host(self) -> None:
        """Undo every page-locking (before the memory is unmapped)."""
        self.host.unregister_all()

    def close(self) -> None:
        """Unregister host memory and give CuPy its previous allocator back (the arena's
        blocks stay with the graphs that hold them until they are dropped)."""
        self.unregister_host()
        self.cp.cuda.set_allocator(self._previous_allocator)

    # ---- batch limit ------------------------------------------------------------------

    def batch_limit(self) -> int:
        """How many frames the next claim may take (BatchSizer.limit, claim time)."""
        return self.sizer.limit()

    # ---- the data path ----------------------------------------------------------------

    def infer(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> list[Result]:
        batch = self.submit(images, want_mask)
        self.start(batch)
        self.collect(batch)
        return self.finish(batch)

    def submit(self, images: Sequence[np.ndarray], want_mask: Sequence[bool]) -> Batch:
        """Plan the chunks and upload the first one of each graph (copy stream, asynchronous;
        nothing computes yet). A graph's further chunks in this batch are uploaded by
        ``start``, once the launch before them is enqueued (see ``_upload``)."""
        batch = Batch(len(images))
        by_size: dict[tuple[int, int], list[int]] = {}
        images = list(images)
        for i, img in enumerate(images):
            if img.dtype != np.uint8 or img.ndim != 2 or img.size == 0:
                reason = f"expected a non-empty uint8 (H, W) frame, got {img.shape}"
                batch.errors[i] = (Status.INVALID, reason)
                continue
            if upscales(self.net.model.meta, *img.shape):  # small frames run at 2x (on the host)
                batch.small[i] = img.copy()
                images[i] = img = upscale2x(img[None])[0]
            by_size.setdefault((int(img.shape[0]), int(img.shape[1])), []).append(i)
        seen: set[int] = set()
        for size, positions in by_size.items():
            lo = 0
            limit = self.sizer.limit(size)
            for n in self._plan(len(positions), limit, size):
                part = positions[lo : lo + n]
                lo += n
                g = self._graph_for(n, size)
                if g is None:
                    for i in part:
                        batch.errors[i] = (Status.ERROR, f"no device memory left for a "
                                           f"{size[0]}x{size[1]} graph on this worker")  # fmt: skip
                    continue
                chunk = Chunk(
                    g, part, [images[i] for i in part], [bool(want_mask[i]) for i in part],
                    # a small frame at 2x may share its size with frames of that size
                    want_prob=any(i in batch.small for i in part),
                )  # fmt: skip
                if id(g) not in seen:
                    seen.add(id(g))
                    self._upload(chunk)
                batch.chunks.append(chunk)
        return batch

    def start(self, batch: Batch) -> None:
        """Launch every chunk's graph after its upload (asynchronous). A graph used by two
        chunks of the batch has the first collected before the second launches."""
        launched: dict[int, Chunk] = {}
        for c in batch.chunks:
            earlier = launched.get(id(c.graph))
            if earlier is not None:
                self._collect(earlier)
            if c.uploaded is None:
                self._upload(c)
            c.graph.launch(c.k, after=c.uploaded)
            launched[id(c.graph)] = c
        batch.started = True

    def collect(self, batch: Batch) -> None:
        """Wait (on events) for the batch's device work and copy its small outputs to the
        host. Afterwards its graphs may run the next batch while :meth:`finish` works."""
        if not batch.started:
            raise RuntimeError("CudaBackend.collect before start")
        for c in batch.chunks:
            if c.collected is None:
                self._collect(c)
        batch.collected = True

    def finish(self, batch: Batch) -> list[Result]:
        """Finish the collected frames on the host: queue Results in batch order."""
        results: list[Result | None] = [None] * batch.size
        for pos, result in self.finish_each(batch):
            results[pos] = result
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"CudaBackend.finish: no result for batch positions {missing}")
        return [r for r in results if r is not None]

    def finish_each(self, batch: Batch) -> Iterator[tuple[int, Result]]:
        """(batch position, queue Result) of each frame as soon as the host has finished it:
        the planning errors first, then the chunks' frames in order. The finish is host work
        only (the device is done with the batch), so a frame whose finish raises is answered
        ``error`` with the exception named, and the batch's other frames are still served."""
        if not batch.collected:
            raise RuntimeError("CudaBackend.finish before collect")
        for pos, (status, reason) in batch.errors.items():
            yield pos, error_result(reason, batch.size, status)
        alone = len(batch.chunks) == 1  # chunks of one batch overlap on the device (each
        for c in batch.chunks:  # graph has its own stream): only a lone one is timed
            if alone:
                self._observe(c.graph, c.collected.compute_ms)
            compute_ns = int(c.collected.compute_ms * 1e6)
            n = len(c.positions)
            for j, (pos, want) in enumerate(zip(c.positions, c.want_mask, strict=True)):
                try:
                    small = batch.small.get(pos)
                    frame = (
                        c.graph.finish_frame(c.collected, j, bool(want)) if small is None
                        else finish_upscaled(self.net.model, small, c.collected.prob[j])
                    )  # fmt: skip
                except Exception as exc:  # answered and logged, never hidden
                    reason = f"host finish: {type(exc).__name__}: {exc}"
                    log_event("frame_failed", logging.ERROR, device=self.device, reason=reason)
                    yield pos, error_result(reason, n)
                    continue
                yield pos, ok_result(frame, want, compute_ns, n)

    def expected_ms(self, batch: Batch) -> float:
        """The device time a started batch has left: its chunks' graphs' measured ms, less
        the chunks ``start`` already collected (0 for a graph not timed yet). The pipelined
        loop claims the next batch this close to its end."""
        return sum(
            self.graph_ms.get(_key(c.graph), 0.0) for c in batch.chunks if c.collected is None
        )

    def _collect(self, c: Chunk) -> None:
        c.collected = c.graph.collect(len(c.positions), want_prob=c.want_prob)
        c.frames = []  # the shared-memory views are no longer needed

    # ---- helpers ----------------------------------------------------------------------

    def _graph_for(self, n: int, size: tuple[int, int]) -> Any:
        """The held graph of the smallest bucket ≥ n, capturing it if memory allows; else a
        held smaller one is not enough (the caller split by ``limit``), so None."""
        bucket = bucket_for(n)  # split_batch's chunks all fit a bucket
        g = self.graphs.get((bucket, *size))
        if g is not None:
            return g
        if not self.sizer.usable(size, bucket):
            return None
        g = self._capture(bucket, size)
        if g is not None and size not in self.sizer.per_frame:
            self.sizer.measured(size, {bucket: int(g.footprint_bytes)})
        return g

    def _time(self, g: Any) -> None:
        """A new graph's device time (boot only; the device synchronise orders the inputs'
        zeroing before the replays): the fastest of ``TIME_REPLAYS`` replays after an
        untimed one. A graph's first replay can run slow (cold caches, clocks still rising),
        and another process's work on the card only ever adds time: a standby times its
        graphs while the worker it may replace computes on the same card. A bucket timed
        too slow is avoided by the split; ``_plan`` re-measures it."""
        self.cp.cuda.Device().synchronize()
        g.launch(0)
        g.collect(1)  # untimed
        replays = []
        for _ in range(TIME_REPLAYS):
            g.launch(0)
            replays.append(g.collect(1).compute_ms)
        self._set_time(_key(g), min(replays))

    def _observe(self, g: Any, ms: float) -> None:
        """A lone batch's device time: blended into its graph's (EWMA), or replacing it when
        ``_plan`` ran the graph to re-measure a stale time."""
        key = _key(g)
        if key in self.remeasure:
            self.remeasure.discard(key)
            before = self.graph_ms.get(key, 0.0)
            if before and abs(ms - before) > REMEASURE_NOTE * before:  # the split changes
                name = f"{key[0]} x {key[1]}x{key[2]}"
                log_event("graph_retimed", graph=name, before_ms=before, ms=ms)
        else:
            ms = ewma(self.graph_ms.get(key, 0.0), ms, GRAPH_MS_WEIGHT)
        self._set_time(key, ms)

    def _set_time(self, key: tuple[int, int, int], ms: float) -> None:
        self.graph_ms[key] = ms
        self.graph_at[key] = time.monotonic()

    def _plan(self, n: int, limit: int, size: tuple[int, int]) -> list[int]:
        """The chunks for ``n`` frames of ``size``: split_batch's cheapest split by the
        measured times, except that when it splits frames that one held bucket within
        ``limit`` could take, and that bucket's time is older than ``REMEASURE_S``, they run
        as one chunk in it, to measure it again.

        Only a batch that runs alone is timed (``_observe``), so a bucket whose time came
        out too high would never run, never be timed again, and stay avoided for good. A
        standby times its graphs while the serving worker uses the card, so its times can
        be twice the real ones; after a take-over it would then split every batch and drain
        the kill's backlog slowly (docs/benchmarks.md, reading the serving numbers)."""
        plan = split_batch(n, limit, BUCKETS, self._bucket_cost(size))
        if len(plan) == 1:
            return plan
        if n > BUCKETS[-1]:
            return plan
        bucket = bucket_for(n)
        if bucket > limit or (bucket, *size) not in self.graphs:
            return plan
        key = (bucket, *size)
        now = time.monotonic()
        if now - self.graph_at.get(key, 0.0) < REMEASURE_S:
            return plan
        self.graph_at[key] = now  # one re-measurement at a time
        self.remeasure.add(key)
        return [n]

    def _bucket_cost(self, size: tuple[int, int]) -> Any:
        """``bucket → device ms`` of this size's graphs for split_batch: measured, else the
        nearest measured bucket's ms a frame times the bucket, else the bucket itself."""
        known = {b: ms for (b, h, w), ms in self.graph_ms.items() if (h, w) == size}

        def cost(bucket: int) -> float:
            if bucket in known:
                return known[bucket]
            if not known:
                return float(bucket)
            near = min(known, key=lambda b: abs(b - bucket))
            return known[near] / near * bucket

        return cost

    def _capture(self, bucket: int, size: tuple[int, int]) -> Any:
        try:
            g = ServeGraph(self.net, bucket, size[0], size[1], n_inputs=2)
        except MemoryError:  # ArenaExhausted (and CuPy's OutOfMemoryError) are MemoryErrors
            self.sizer.refuse(size, bucket)
            return None
        self.graphs[(bucket, *size)] = g
        self.sizer.hold(size, bucket)
        return g

    def _upload(self, c: Chunk) -> None:
        """Copy the chunk's frames into the graph's next input buffer. The copy stream first
        waits for ``released[k]``: recorded after the last enqueued launch that read
        ``inputs[k]`` (a wait on an event never recorded is a no-op)."""
        cp = self.cp
        g = c.graph
        key = _key(g)
        c.k = k = self._next_k.get(key, 0)
        self._next_k[key] = (k + 1) % len(g.inputs)
        self.copy_stream.wait_event(g.released[k])
        dst = g.inputs[k]
        base = int(dst.data.ptr)
        frame_bytes = int(dst[0].nbytes)
        with self.host.chunk():
            for j, img in enumerate(c.frames):
                at = base + j * frame_bytes
                for src, n in self.host.sources(img, j, frame_bytes):
                    cp.cuda.runtime.memcpyAsync(at, src, n, H2D, self.copy_stream.ptr)
                    at += n
        c.uploaded = cp.cuda.Event(disable_timing=True)
        c.uploaded.record(self.copy_stream)


def _key(g: Any) -> tuple[int, int, int]:
    return (int(g.bucket), int(g.height), int(g.width))


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 1)

"""The serving graph: frames in device memory → verdict, score, boxes, entropy, histogram
and (when asked) the mask, with everything but the components' union-find on the device.

One :class:`ServeGraph` per (bucket, height, width). Every device buffer is allocated once
in the constructor; one CUDA graph is captured per input buffer ``k``::

    inputs[k] uint8 [B, H, W]          written by the worker (its copy stream), read here
      view_stack                        → A [VA*B, H, W] (+ B [B, W, H] for a non-square
                                          frame's transpose; views.py)
      forward (cuda_net) of A (and B)   → view probabilities, histograms of the view frames
      view_mean + window_score          → mean map [B, H, W], score [B], entropy [B]
      row_runs                          → runs [B, cap, 4], count [B]   (row_runs.py)

All buffers but the inputs are shared by the ``k`` graphs: compute is serialised on
``stream``, so the worker uploads batch k+1 into the other input while batch k computes.

Lifecycle (``ServeState``), one batch on the device at a time::

    READY ──launch(k)──▶ LAUNCHED ──collect(n)──▶ READY        fetch = collect + finish

``collect`` leaves the results on the host (:class:`Collected`), so a worker can launch the
next batch before it ``finish`` es this one: the host finish overlaps the next graph.

``launch`` is asynchronous (it only enqueues: an optional wait on the worker's upload event,
the graph, two timing events and ``released[k]``, after which ``inputs[k]`` may be
overwritten). ``collect`` copies the small outputs device → host into pinned staging
buffers on ``stream``, in two steps that each end waiting on an event: first score, entropy
and run count of the bucket and the histograms of the first ``n`` frames (256 B a frame);
then, in one strided copy, as many run records of each of the ``n`` frames as the fullest
one has (16 B a run), and returns owned copies. ``finish`` (:class:`HostFinish`) joins each
frame's runs into components on the host (``_runs.finish_records``: the CPU path's own
finish and reference, ``postprocess.finish_runs``, in C and equal to it, since at one view a
frame's numpy finish costs about as much as its GPU time; a frame without runs skips it). A
frame whose runs overflowed the capacity is finished from its mean map (copied in
``collect``, 4 B a pixel, then ``threshold_runs``); it is counted in
``host_fallbacks`` and flagged in its result, never silently truncated. The histogram of
each frame is the one of its first view frame (views only permute pixels).

Device time, ``collect``, host finish and footprint per bucket: ``scripts/bench_serve_graph.py``
(docs/benchmarks.md, serving graph).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np

from scratchd.cpu import _runs
from scratchd.gpu.cuda_graph import capture
from scratchd.gpu.cuda_net import Buffers, CudaForward
from scratchd.ipc.layout import HISTOGRAM_BINS
from scratchd.kernels import _cuda as cu
from scratchd.kernels.postprocess import Box, Verdict, finish_runs, threshold_runs
from scratchd.kernels.row_runs import RECORD, RowRuns, row_runs_cuda
from scratchd.kernels.views import ViewMean, view_layout, view_mean_cuda, view_stack_cuda
from scratchd.model.scratchnet import ScratchNet, decide

RUN_CAPACITY = 32768  # runs stored per frame (a frame with more is finished on the host)


class GraphOwner(Protocol):
    """What a serving graph takes from the model it serves (``CudaScratchNet``): the loaded
    model (views, threshold, minimum area, score window) and its device forward."""

    @property
    def model(self) -> ScratchNet: ...

    @property
    def fwd(self) -> CudaForward: ...


class ServeState(enum.Enum):
    READY = "ready"
    LAUNCHED = "launched"


@dataclass(frozen=True)
class FrameResult:
    """``kernels.model.Prediction`` minus ``prob``, plus how the frame was finished."""

    mask: np.ndarray | None  # [H, W] uint8 0/255, kept components; None unless wanted
    score: float
    verdict: Verdict
    boxes: list[Box]
    entropy: float  # mean binary entropy of the mean map, bits
    histogram: np.ndarray  # [64] uint32 input intensity counts
    runs: int  # foreground runs of the frame's thresholded mean map
    host_path: bool  # runs overflowed the capacity: finished from the map on the host


@dataclass(frozen=True)
class Collected:
    """One batch's small outputs on the host (owned copies): what :meth:`ServeGraph.finish`
    needs, with no reference to the device or the staging buffers."""

    score: np.ndarray  # [n] float32
    entropy: np.ndarray  # [n] float32
    count: np.ndarray  # [n] int32 runs per frame (> capacity: overflowed)
    hist: np.ndarray  # [n, 64] uint32
    runs: np.ndarray  # [n, widest, 4] int32 records (widest = the fullest frame's, capped)
    maps: dict[int, np.ndarray]  # frame → its mean map [H, W] float32, overflowed frames only
    compute_ms: float  # device time of the batch (CUDA events)
    prob: np.ndarray | None = None  # [n, H, W] float32 mean maps, when collected with them


@dataclass(frozen=True)
class HostFinish:
    """The host half of the GPU path: one collected frame → its :class:`FrameResult`
    (no device needed, so the CPU tests check it against ``postprocess``)."""

    height: int
    width: int
    threshold: float
    min_area: int
    score_window: int
    score_threshold: float | None = None  # ModelMeta.score_threshold (see model.decide)

    def frame(self, batch: Collected, j: int, want_mask: bool) -> FrameResult:
        count = int(batch.count[j])
        overflow = j in batch.maps
        if overflow:
            # Not every run was stored: take them from the map. Only the components: the
            # score came from the device (no peak_local_mean), the mask only when wanted.
            runs = threshold_runs(batch.maps[j], self.threshold)
            comp = finish_runs(*runs, self.height, self.width, self.min_area, paint=want_mask)
            mask, boxes = comp.mask, comp.boxes
        else:  # finish_runs on unpack_runs(...), in C (cpu/_runs.c: equal, faster)
            mask = np.empty((self.height, self.width), np.uint8) if want_mask else None
            h, w, area = self.height, self.width, self.min_area
            boxes = _runs.finish_records(batch.runs[j], count, h, w, area, mask)
        score, entropy = float(batch.score[j]), float(batch.entropy[j])
        verdict: Verdict = decide(score, bool(boxes), self.score_threshold)
        return FrameResult(mask, score, verdict, boxes, entropy, batch.hist[j], count, overflow)


class _Staging:
    """Pinned host buffers the small outputs are copied into (reused every fetch)."""

    def __init__(self, bucket: int, capacity: int) -> None:
        import cupyx

        self.head = cupyx.empty_pinned((3, bucket), np.uint32)
        self.hist = cupyx.empty_pinned((bucket, HISTOGRAM_BINS), np.uint32)
        self.runs = cupyx.empty_pinned((bucket, capacity, RECORD), np.int32)


class ServeGraph:
    """Captured serving graphs of ``bucket`` frames of ``height x width`` for one model."""

    def __init__(
        self, net: GraphOwner, bucket: int, height: int, width: int, n_inputs: int = 2,
        run_capacity: int = RUN_CAPACITY,
    ) -> None:  # fmt: skip
        if bucket < 1 or n_inputs < 1 or height < 1 or width < 1:
            raise ValueError(f"ServeGraph: bad geometry {bucket}x{height}x{width}, {n_inputs}")
        cp = cu.cupy()
        m = net.model.meta
        self.net, self.bucket, self.height, self.width = net, bucket, height, width
        self.host = HostFinish(
            height, width, m.threshold, m.min_area, m.score_window, m.score_threshold
        )
        self.capacity = run_capacity
        self.layout = view_layout(net.model.views, height, width)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.inputs = [cp.zeros((bucket, height, width), np.uint8) for _ in range(n_inputs)]
        lay = self.layout
        self.fwd_a = net.fwd.buffers(len(lay.in_a) * bucket, height, width) if lay.in_a else None
        self.fwd_b = net.fwd.buffers(bucket, width, height) if lay.in_b else None
        # A is empty when the only view is the transpose of a non-square frame.
        self._no_a = (
            cp.empty((0, height, width), np.uint8),
            cp.empty((0, height, width), np.float32),
        )
        # head = [score | entropy | run count] of the bucket: one copy brings all three back.
        self.head = cp.zeros((3, bucket), np.uint32)
        self.mean = ViewMean(
            cp.empty((bucket, height, width), np.float32),
            self.head[0].view(np.float32),
            self.head[1].view(np.float32),
        )
        self.scratch = cp.empty((3 * bucket,), np.uint32)
        self.runs = RowRuns(
            cp.empty((bucket, run_capacity, RECORD), np.int32), self.head[2].view(np.int32)
        )
        self.row_count = cp.empty((bucket * height,), np.int32)
        self._staging = _Staging(bucket, run_capacity)
        self._start, self._end = cp.cuda.Event(), cp.cuda.Event()
        self._copied = cp.cuda.Event(disable_timing=True)
        self.released = [cp.cuda.Event(disable_timing=True) for _ in range(n_inputs)]
        self.graphs = [capture(self.stream, partial(self._enqueue, k)) for k in range(n_inputs)]
        self.state = ServeState.READY
        self.host_fallbacks = 0  # frames finished from their map (run overflow), ever
        self.last_compute_ms = 0.0  # device time of the last fetched batch (CUDA events)

    def _first(self) -> Buffers:
        buf = self.fwd_a if self.fwd_a is not None else self.fwd_b
        assert buf is not None  # view_layout guarantees one view
        return buf

    def _enqueue(self, k: int) -> None:
        """The launches of one batch from ``inputs[k]`` (recorded, then captured)."""
        views = self.layout.views
        a, b = self.fwd_a, self.fwd_b
        out_a = a.images if a is not None else self._no_a[0]
        view_stack_cuda(self.inputs[k], views, out_a=out_a, out_b=None if b is None else b.images)
        for buf in (a, b):
            if buf is not None:
                self.net.fwd.run(buf)
        prob_a = a.out.prob if a is not None else self._no_a[1]
        prob_b = b.out.prob if b is not None else None
        view_mean_cuda(
            prob_a, prob_b, views, self.host.score_window, out=self.mean, scratch=self.scratch
        )
        thr = self.host.threshold
        row_runs_cuda(self.mean.prob, thr, self.capacity, out=self.runs, scratch=self.row_count)

    @property
    def footprint_bytes(self) -> int:
        """Device bytes held by this graph's buffers (inputs, forward, views, runs)."""
        arrays: list[Any] = [*self.inputs, self.head, self.mean.prob, self.scratch, self.row_count]
        arrays.append(self.runs.runs)
        for buf in (self.fwd_a, self.fwd_b):
            if buf is not None:
                arrays += buf.arrays()
        return sum(int(a.nbytes) for a in arrays)

    def launch(self, k: int, after: Any | None = None) -> None:
        """Replay graph ``k`` (reads ``inputs[k]``) on ``stream``, after the event ``after``
        (the worker's upload) when given. Asynchronous."""
        if self.state is not ServeState.READY:
            raise RuntimeError("ServeGraph.launch: the previous batch was not fetched")
        if not 0 <= k < len(self.graphs):
            raise ValueError(f"ServeGraph.launch: no input buffer {k}")
        if after is not None:
            self.stream.wait_event(after)
        self._start.record(self.stream)
        self.graphs[k].launch(self.stream)
        self._end.record(self.stream)
        self.released[k].record(self.stream)
        self.state = ServeState.LAUNCHED

    def fetch(self, n: int, want_mask: Sequence[bool]) -> list[FrameResult]:
        """Results of the first ``n`` frames of the launched batch: :meth:`collect`, then
        :meth:`finish`."""
        if len(want_mask) != n:
            raise ValueError(f"ServeGraph.fetch: {len(want_mask)} mask flags for {n} frames")
        return self.finish(self.collect(n), want_mask)

    def collect(self, n: int, want_prob: bool = False) -> Collected:
        """Copy the launched batch's small outputs of its first ``n`` frames to the host
        (waits on events, never on the stream or device). Afterwards the device buffers
        are free: the next ``launch`` may run while the host :meth:`finish` es these.
        ``want_prob`` also copies the mean maps (4 B a pixel; ``CudaScratchNet.predict``)."""
        if self.state is not ServeState.LAUNCHED:
            raise RuntimeError("ServeGraph.collect: no batch launched")
        if not 1 <= n <= self.bucket:
            raise ValueError(f"ServeGraph.collect: n={n} outside 1..{self.bucket}")
        import cupyx

        st = self._staging
        self._to_host(st.head, self.head)
        self._to_host(st.hist[:n], self._first().out.hist[:n])
        self._wait_copies()  # the graph is done: the run counts are known
        count = st.head[2, :n].view(np.int32).copy()
        widest = min(int(count.max()), self.capacity)  # the fullest frame's stored runs
        self._fetch_runs(n, widest)
        maps = {j: self._mean_map(j) for j in np.flatnonzero(count > self.capacity).tolist()}
        prob = cupyx.empty_pinned((n, self.height, self.width), np.float32) if want_prob else None
        if prob is not None:
            self._to_host(prob, self.mean.prob[:n])
        self._wait_copies()
        self.state = ServeState.READY
        self.host_fallbacks += len(maps)
        self.last_compute_ms = float(self._end_elapsed())
        return Collected(
            score=st.head[0, :n].view(np.float32).copy(),
            entropy=st.head[1, :n].view(np.float32).copy(),
            count=count,
            hist=st.hist[:n].copy(),
            runs=st.runs[:n, :widest].copy(),
            maps=maps,
            compute_ms=self.last_compute_ms,
            prob=prob,
        )

    def finish(self, batch: Collected, want_mask: Sequence[bool]) -> list[FrameResult]:
        """Finish each collected frame on the host (no device work); masks where wanted.
        (A worker answers each frame as soon as it is done: :meth:`finish_frame`.)"""
        if len(want_mask) != len(batch.count):
            raise ValueError(
                f"ServeGraph.finish: {len(want_mask)} flags, {len(batch.count)} frames"
            )
        return [self.finish_frame(batch, j, bool(w)) for j, w in enumerate(want_mask)]

    def finish_frame(self, batch: Collected, j: int, want_mask: bool) -> FrameResult:
        """Finish collected frame ``j`` on the host (no device work); its mask if wanted."""
        return self.host.frame(batch, j, want_mask)

    def _end_elapsed(self) -> float:
        return float(cu.cupy().cuda.get_elapsed_time(self._start, self._end))

    def _to_host(self, dst: np.ndarray, src: Any) -> None:
        rt = cu.cupy().cuda.runtime
        if dst.nbytes != src.nbytes or not src.flags.c_contiguous:
            raise ValueError(f"ServeGraph: staging {dst.shape} does not match {src.shape}")
        rt.memcpyAsync(
            dst.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost, self.stream.ptr
        )

    def _wait_copies(self) -> None:
        self._copied.record(self.stream)
        self._copied.synchronize()

    def _fetch_runs(self, n: int, widest: int) -> None:
        """Records ``[:widest]`` of each of the first ``n`` frames: one strided copy."""
        if widest <= 0:
            return
        rt = cu.cupy().cuda.runtime
        pitch = self.capacity * RECORD * 4
        rt.memcpy2DAsync(
            self._staging.runs.ctypes.data, pitch, self.runs.runs.data.ptr, pitch,
            widest * RECORD * 4, n, rt.memcpyDeviceToHost, self.stream.ptr,
        )  # fmt: skip

    def _mean_map(self, j: int) -> np.ndarray:
        """Enqueue the copy of frame ``j``'s mean map (the overflow path) into a fresh
        pinned array; valid after the next :meth:`_wait_copies`."""
        import cupyx

        host = cupyx.empty_pinned((self.height, self.width), np.float32)
        self._to_host(host, self.mean.prob[j])
        return host

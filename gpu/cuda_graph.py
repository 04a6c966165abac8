"""CUDA graphs of the ScratchNet forward, one per (batch bucket, frame size), and the
GPU model API the CUDA worker calls (:class:`CudaScratchNet`, the twin of ``ScratchNet``).

Lifecycle of one :class:`ForwardGraph` (``GraphState``)::

    NEW ──warm_up()──▶ CAPTURED ──replay()* ──▶ (lives as long as its CudaScratchNet)
         1. allocate every buffer (cuda_net.Buffers), held by the graph for its lifetime
         2. run the forward once eagerly while recording its launches: every module is
            compiled (or loaded from CuPy's disk cache) and every kernel has run once
         3. capture the recorded launches on a private stream: no allocation, no
            compilation and no Python-side checks happen inside the capture

Batches are served from the smallest bucket (1, 2, 4, 8, 16) that holds them; the unused
slots of a bucket compute on stale frames and their results are ignored. Copies in and out
run on the graph's stream, ordered around the replay.

``predict`` (the model API, with ``prob``) goes through the serving graphs (``serve_graph.py``,
cached per (bucket, size) in ``serve_graphs``): the test-time views, their mean, score,
entropy, histogram and the runs of the thresholded mean are computed on the device; only the
components are joined on the host. The CUDA worker uses the same ``ServeGraph`` but captures
and caches its own (``workers/cuda.py``: the buckets its arena has room for). ``run`` replays
the plain forward graph of one view (``ForwardGraph``) and returns every per-pixel output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scratchd.gpu.buckets import BUCKETS, bucket_for
from scratchd.gpu.cuda_net import Buffers, CudaForward
from scratchd.model.scratchnet import Prediction, ScratchNet

if TYPE_CHECKING:
    from scratchd.gpu.serve_graph import ServeGraph


class GraphState(enum.Enum):
    NEW = "new"
    CAPTURED = "captured"


def capture(stream: Any, enqueue: Callable[[], object]) -> Any:
    """A CUDA graph of what ``enqueue`` launches: run it once eagerly on ``stream`` while
    recording its launches (compiles and loads every module, runs the Python-side checks),
    then capture the recorded launches alone and upload the graph."""
    from scratchd.kernels import _cuda as cu

    with stream, cu.recording() as steps:
        enqueue()
    stream.synchronize()
    with stream:
        stream.begin_capture()
        try:
            for step in steps:
                step()
        finally:
            graph = stream.end_capture()
    graph.upload(stream)
    stream.synchronize()
    return graph


class ForwardGraph:
    """One captured forward of ``batch`` frames of ``height x width`` and its buffers."""

    def __init__(self, fwd: CudaForward, batch: int, height: int, width: int) -> None:
        from scratchd.kernels import _cuda as cu

        cp = cu.cupy()
        self.fwd = fwd
        self.state = GraphState.NEW
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.buf: Buffers = fwd.buffers(batch, height, width)
        self.graph: Any = None

    def warm_up(self) -> None:
        """Run once eagerly (recording), then capture the recorded launches into a graph."""
        if self.state is GraphState.CAPTURED:
            return
        self.graph = capture(self.stream, lambda: self.fwd.run(self.buf))
        self.state = GraphState.CAPTURED

    def replay(self) -> None:
        """Launch the captured forward on the graph's stream (asynchronous)."""
        if self.state is not GraphState.CAPTURED:
            raise RuntimeError("ForwardGraph.replay before warm_up")
        self.graph.launch(self.stream)


class CudaScratchNet:
    """A loaded model on one GPU: graphs per (bucket, size), the ``predict`` API."""

    def __init__(self, model: ScratchNet) -> None:
        m = model.meta
        self.model = model
        self.fwd = CudaForward(
            model.weights, model.config, m.mean, m.std, m.threshold, m.score_window
        )
        self.graphs: dict[tuple[int, int, int], ForwardGraph] = {}
        self.serve_graphs: dict[tuple[int, int, int], ServeGraph] = {}

    def graph(self, batch: int, height: int, width: int) -> ForwardGraph:
        """The warmed-up graph of ``(bucket_for(batch), height, width)``, built on first use."""
        key = (bucket_for(batch), height, width)
        g = self.graphs.get(key)
        if g is None:
            g = ForwardGraph(self.fwd, *key)
            g.warm_up()
            self.graphs[key] = g
        return g

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        """uint8 ``[n, H, W]`` (n ≤ 16) → host arrays ``prob, mask, score, entropy, hist``."""
        if images.dtype != np.uint8 or images.ndim != 3 or images.size == 0:
            raise ValueError(
                f"images must be a non-empty uint8 [n, H, W], got {images.dtype} {images.shape}"
            )
        n, height, width = images.shape
        g = self.graph(n, height, width)
        g.buf.images[:n].set(np.ascontiguousarray(images), stream=g.stream)
        g.replay()
        out = {name: arr[:n].get(stream=g.stream) for name, arr in g.buf.out._asdict().items()}
        g.stream.synchronize()
        return out

    def serve_graph(self, batch: int, height: int, width: int) -> ServeGraph:
        """The serving graph of ``(bucket_for(batch), height, width)`` (two input buffers),
        built and captured on first use (``serve_graph.py``)."""
        from scratchd.gpu.serve_graph import ServeGraph

        key = (bucket_for(batch), height, width)
        g = self.serve_graphs.get(key)
        if g is None:
            g = ServeGraph(self, *key)
            self.serve_graphs[key] = g
        return g

    def predict(self, images: Sequence[np.ndarray]) -> list[Prediction]:
        """One :class:`Prediction` per uint8 ``(H, W)`` image, in order (``ScratchNet.predict``),
        through the serving graphs: views, their mean, score, entropy, histogram and runs on
        the device; components on the host; the mean map copied back for ``prob``."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, img in enumerate(images):
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 2:
                raise ValueError(f"image {i}: expected a uint8 (H, W) array")
            if img.size == 0:
                raise ValueError(f"image {i}: empty image {img.shape}")
            by_size.setdefault(img.shape, []).append(i)
        results: list[Prediction | None] = [None] * len(images)
        for (height, width), idx in by_size.items():
            for lo in range(0, len(idx), BUCKETS[-1]):
                part = idx[lo : lo + BUCKETS[-1]]
                g = self.serve_graph(len(part), height, width)
                g.inputs[0][: len(part)].set(np.stack([images[i] for i in part]), g.stream)
                g.launch(0)
                batch = g.collect(len(part), want_prob=True)
                assert batch.prob is not None
                for j, (i, r) in enumerate(
                    zip(part, g.finish(batch, [True] * len(part)), strict=True)
                ):
                    assert r.mask is not None
                    results[i] = Prediction(
                        batch.prob[j], r.mask, r.score, r.verdict, r.boxes, r.entropy, r.histogram
                    )
        return [r for r in results if r is not None]

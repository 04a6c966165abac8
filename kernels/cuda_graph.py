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

Test-time views (``ScratchNet.views``, e.g. identity + flips + transpose): the views of a
batch that share a shape run as one batch through the graph (so 4 frames x 4 views fill the
16-bucket); their probability maps are mapped back and averaged on the host, which then
computes score and entropy from the average (``postprocess.py``), exactly as the numpy
model does. With the single ``identity`` view everything but connected components comes
from the device (``output_path``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from scratchd.kernels.cuda_net import Buffers, CudaForward
from scratchd.kernels.model import Prediction, ScratchNet, apply_view
from scratchd.kernels.postprocess import (
    binary_entropy_bits,
    intensity_histogram,
    peak_local_mean,
    postprocess,
)

BUCKETS = (1, 2, 4, 8, 16)


class GraphState(enum.Enum):
    NEW = "new"
    CAPTURED = "captured"


def bucket_for(n: int) -> int:
    """The smallest batch bucket holding ``n`` frames."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"batch of {n} exceeds the largest bucket {BUCKETS[-1]}")


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

    def graph(self, batch: int, height: int, width: int) -> ForwardGraph:
        """The warmed-up graph of ``(bucket_for(batch), height, width)``, built on first use."""
        key = (bucket_for(batch), height, width)
        g = self.graphs.get(key)
        if g is None:
            g = ForwardGraph(self.fwd, *key)
            g.warm_up()
            self.graphs[key] = g
        return g

    def warm_up(self, sizes: Sequence[tuple[int, int]], buckets: Sequence[int] = BUCKETS) -> None:
        """Capture every (bucket, size) graph ahead of serving (the worker does this first)."""
        for height, width in sizes:
            for b in buckets:
                self.graph(b, height, width)

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

    def predict(self, images: Sequence[np.ndarray]) -> list[Prediction]:
        """One :class:`Prediction` per uint8 ``(H, W)`` image, in order (``ScratchNet.predict``)."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, img in enumerate(images):
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 2:
                raise ValueError(f"image {i}: expected a uint8 (H, W) array")
            if img.size == 0:
                raise ValueError(f"image {i}: empty image {img.shape}")
            by_size.setdefault(img.shape, []).append(i)
        views = self.model.views
        chunk = BUCKETS[-1] // len(views)
        results: list[Prediction | None] = [None] * len(images)
        for idx in by_size.values():
            for lo in range(0, len(idx), chunk):
                part = idx[lo : lo + chunk]
                frames = np.stack([images[i] for i in part])
                if views == ("identity",):
                    out = self.run(frames)
                    preds = [self._finish(out, j) for j in range(len(part))]
                else:
                    preds = self._predict_views(frames)
                for i, pred in zip(part, preds, strict=True):
                    results[i] = pred
        return [r for r in results if r is not None]

    def prob_views(self, frames: np.ndarray) -> np.ndarray:
        """uint8 ``[n, H, W]`` (``n * len(views) <= 16``) → the views' mean probability."""
        groups: dict[tuple[int, ...], list[str]] = {}
        for view in self.model.views:
            groups.setdefault(apply_view(frames[:1], view).shape, []).append(view)
        n = len(frames)
        total = np.zeros(frames.shape, dtype=np.float32)
        for views in groups.values():
            stacked = np.concatenate([apply_view(frames, v) for v in views])
            prob = self.run(stacked)["prob"]
            for j, view in enumerate(views):
                total += apply_view(prob[j * n : (j + 1) * n], view)
        total /= np.float32(len(self.model.views))
        return total

    def _predict_views(self, frames: np.ndarray) -> list[Prediction]:
        m = self.model.meta
        preds = []
        for image, prob in zip(frames, self.prob_views(frames), strict=True):
            post = postprocess(prob, m.threshold, m.min_area, m.score_window)
            preds.append(
                Prediction(
                    prob=prob,
                    mask=post.mask,
                    score=peak_local_mean(prob, m.score_window),
                    verdict=post.verdict,
                    boxes=post.boxes,
                    entropy=binary_entropy_bits(prob),
                    histogram=intensity_histogram(image),
                )
            )
        return preds

    def _finish(self, out: dict[str, np.ndarray], j: int) -> Prediction:
        m = self.model.meta
        prob = out["prob"][j]
        post = postprocess(prob, m.threshold, m.min_area, m.score_window)
        return Prediction(
            prob=prob,
            mask=post.mask,
            score=float(out["score"][j]),
            verdict=post.verdict,
            boxes=post.boxes,
            entropy=float(out["entropy"][j]),
            histogram=out["hist"][j],
        )

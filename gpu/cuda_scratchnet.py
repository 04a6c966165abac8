"""The GPU model API the CUDA worker calls: :class:`CudaScratchNet`, the twin of
``ScratchNet`` on one device.

``predict`` (the model API, with ``prob``) goes through the serving graphs (``serve_graph.py``,
cached per (bucket, size) in ``serve_graphs``): the test-time views, their mean, score,
entropy, histogram and the runs of the thresholded mean are computed on the device; only the
components are joined on the host. The CUDA worker uses the same ``ServeGraph`` but captures
and caches its own (``workers/cuda.py``: the buckets its arena has room for). ``run`` replays
the plain forward graph of one view (``ForwardGraph``, ``cuda_graph.py``) and returns every
per-pixel output.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scratchd.gpu.buckets import BUCKETS, bucket_for
from scratchd.gpu.cuda_graph import ForwardGraph
from scratchd.gpu.cuda_net import CudaForward
from scratchd.gpu.serve_graph import ServeGraph
from scratchd.model.scratchnet import (
    Prediction,
    ScratchNet,
    finish_upscaled,
    upscale2x,
    upscales,
)


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
            up = upscales(self.model.meta, height, width)  # small frames run at 2x
            for lo in range(0, len(idx), BUCKETS[-1]):
                part = idx[lo : lo + BUCKETS[-1]]
                frames = np.stack([images[i] for i in part])
                frames = upscale2x(frames) if up else frames
                g = self.serve_graph(len(part), frames.shape[1], frames.shape[2])
                g.inputs[0][: len(part)].set(frames, g.stream)
                g.launch(0)
                batch = g.collect(len(part), want_prob=True)
                assert batch.prob is not None
                if up:
                    for j, i in enumerate(part):
                        results[i] = finish_upscaled(self.model, images[i], batch.prob[j])
                    continue
                for j, (i, r) in enumerate(
                    zip(part, g.finish(batch, [True] * len(part)), strict=True)
                ):
                    assert r.mask is not None
                    results[i] = Prediction(
                        batch.prob[j], r.mask, r.score, r.verdict, r.boxes, r.entropy, r.histogram
                    )
        return [r for r in results if r is not None]

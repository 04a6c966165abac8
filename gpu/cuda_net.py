"""ScratchNet's forward on the GPU: fp16 weights and activations, fp32 accumulation, NHWC.

The numpy forward (``net.py``) runs ~3 ops per block; this one runs one launch per block,
every launch a ``<op>_cuda`` of this package, fused where it pays::

    images uint8 [N, H, W]
      stem                     uint8 → normalise, edge pad (clamped reads),   1 kernel
                               conv3x3 s2 1→c1 + bias + ReLU
      ds_block × blocks        dw3x3 + bias + ReLU → pw GEMM (tensor cores)   1 kernel each
                               + bias (+ residual) + ReLU; the decoder's
                               upsample+concat read inside the dw stage;
                               the last block also does the 1x1 head → logits fp32
      output_path              prob, raw mask, entropy, input histogram,      2 kernels
                               window score (+ 2 memsets of its accumulators)

That is one launch per block (two for a split one, below), the stem's one and the output
path's two: 21 launches and 2 memsets for the shipped 48..384-wide model (14 blocks, two per
decoder stage; 6 halo, 4 split, 4 fused: ``plan_paths``). Each block's path is
chosen once per model by ``ds_split.block_path`` (``CudaForward.path``): the stride-1 blocks
up to 288 channels in and 96 out (the shipped enc0.0, enc1.1, dec1.1, dec1.0, dec0.0 and
dec0.1) run as ``ds_halo`` (input tiles staged in shared memory, ``ds_halo.py``); the other
wide blocks (pointwise GEMM of ≥ 192x384 MACs a pixel) and wide decoder joins (the shipped
enc3.* and dec2.0) as two launches (``ds_split``: depthwise into ``Buffers.dw_scratch``,
then a tiled GEMM), except at sizes where the block's depthwise output would pass the
kernels' int32 indexing (``Buffers.split`` lists the blocks split at that size); the rest
fused (``ds_block``), or ``ds_tiled`` (one launch on the GEMM's tiling) when asked for.

Buffers (:class:`Buffers`) are allocated once per (batch, height, width) and every launch
writes into them (``out=``), so the same launch sequence can be recorded and captured into a
CUDA graph (``cuda_graph.py``). Each block's output has its own buffer: the skips must live
until the decoder reads them (≈ 60 MB per 1024² frame at the default widths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels.ds_block import ds_block_cuda, ds_block_ref
from scratchd.kernels.ds_halo import ds_halo_cuda
from scratchd.kernels.ds_split import BlockPath, block_path, ds_split_cuda, ds_tiled_cuda
from scratchd.kernels.normalize_pad import padded_size
from scratchd.kernels.output_path import OutputPath, output_path_buffers, output_path_cuda
from scratchd.kernels.stem import stem_cuda, stem_ref
from scratchd.model.net import BlockSpec, NetConfig, Weights, block_plan, check_weights

PAD_MULTIPLE = 16


def plan_paths(cfg: NetConfig) -> dict[str, BlockPath]:
    """``ds_split.block_path`` of every block of ``cfg``'s plan: the path each block of the
    forward takes (a join's CB is its skip's width)."""
    plan = block_plan(cfg)
    skip_width = {"skip0": cfg.widths[0]}
    paths: dict[str, BlockPath] = {}
    for b in plan:
        cb = 0 if b.join is None else skip_width[b.join]
        paths[b.name] = block_path(b.cin - cb, cb, b.cout, b is plan[-1], b.stride, b.dilation)
        if b.saves is not None:
            skip_width[b.saves] = b.cout
    return paths


@dataclass(frozen=True)
class Buffers:
    """Every device array one forward of ``batch`` frames of ``height x width`` touches."""

    batch: int
    height: int
    width: int
    images: Any  # [B, H, W] uint8: the caller copies frames in here
    acts: dict[str, Any]  # block (or "stem") name → its output, fp16 NHWC
    logits: Any  # [B, Hp/2, Wp/2, 1] float32
    out: OutputPath  # prob, mask, score, entropy, hist
    scratch: Any  # [3B] uint32 accumulators of output_path
    split: frozenset[str]  # blocks run as ds_split at this size (those of CudaForward.path
    # that fit: the others run fused)
    dw_scratch: Any  # flat fp16: the depthwise output of the split blocks, one at a time

    def arrays(self) -> list[Any]:
        """Every device array held here (what a footprint counts)."""
        return [
            self.images, self.logits, self.scratch, self.dw_scratch, *self.acts.values(),
            *self.out,
        ]  # fmt: skip


class CudaForward:
    """Device weights and the fused launch sequence of one ScratchNet model (one device)."""

    def __init__(
        self, weights: Weights, cfg: NetConfig, mean: float, std: float, threshold: float,
        score_window: int,
    ) -> None:  # fmt: skip
        check_weights(weights, cfg)
        cp = cu.cupy()
        self.cfg, self.plan = cfg, block_plan(cfg)
        self.mean, self.std = mean, std
        self.threshold, self.score_window = threshold, score_window
        self.device = cp.cuda.runtime.getDevice()
        self.w: dict[str, Any] = {}
        for name, arr in weights.items():
            # Weights fp16, biases fp32; the head (fused into the last block's epilogue) fp32.
            fp16 = name.endswith(".w") and not name.startswith("head.")
            self.w[name] = cp.asarray(arr.astype(np.float16 if fp16 else np.float32))
        self.head_block = self.plan[-1].name
        # Each block's path (ds_split.block_path): fused, split, tiled or halo; all but fused
        # take the pointwise weight transposed (<block>.pw.wt).
        self.path = plan_paths(cfg)
        for name, path in self.path.items():
            if path != "fused":
                self.w[f"{name}.pw.wt"] = cp.ascontiguousarray(self.w[f"{name}.pw.w"].T)

    def buffers(self, batch: int, height: int, width: int) -> Buffers:
        """Allocate the device arrays of one (batch, height, width) forward."""
        cp = cu.cupy()
        hp, wp = padded_size(height, PAD_MULTIPLE), padded_size(width, PAD_MULTIPLE)
        acts: dict[str, Any] = {}
        h, w = hp // 2, wp // 2
        acts["stem"] = cp.empty((batch, h, w, self.cfg.widths[0]), np.float16)
        mid = 8  # halves of dw_scratch: the largest split block's depthwise output
        split = set()
        for b in self.plan:
            if b.join is not None:
                h, w = 2 * h, 2 * w
            h, w = (h - 1) // b.stride + 1, (w - 1) // b.stride + 1
            if b.name != self.head_block:
                acts[b.name] = cp.empty((batch, h, w, b.cout), np.float16)
            # A split block whose depthwise output would pass the kernels' int32 indexing
            # stays fused. On the default paths none can (the 512² activations pass the limit
            # first, at 171 view frames of 1024², and the launches refuse them); forcing every
            # block split makes dec0.0 the first (a test lowers the limit).
            if self.path[b.name] == "split" and batch * h * w * b.cin <= cu.INT32_LIMIT:
                split.add(b.name)
                mid = max(mid, batch * h * w * b.cin)
        return Buffers(
            batch=batch,
            height=height,
            width=width,
            images=cp.zeros((batch, height, width), np.uint8),
            acts=acts,
            logits=cp.empty((batch, hp // 2, wp // 2, 1), np.float32),
            out=output_path_buffers(batch, height, width),
            scratch=cp.empty((3 * batch,), np.uint32),
            split=frozenset(split),
            dw_scratch=cp.empty((mid,), np.float16),
        )

    def run(self, buf: Buffers) -> None:
        """Launch the forward on the current stream: ``buf.images`` → ``buf.out``."""
        w = self.w
        h = stem_cuda(
            buf.images, self.mean, self.std, w["stem.w"], w["stem.b"], out=buf.acts["stem"]
        )
        skips = {"skip0": h}
        for b in self.plan:
            h = self._block(b, h, skips, buf)
            if b.saves is not None:
                skips[b.saves] = h
        output_path_cuda(
            buf.logits, buf.images, self.threshold, self.score_window, out=buf.out,
            scratch=buf.scratch,
        )  # fmt: skip

    def _block(self, b: BlockSpec, h: Any, skips: dict[str, Any], buf: Buffers) -> Any:
        w, p = self.w, b.name
        if p in buf.split:
            return ds_split_cuda(
                h, w[f"{p}.dw.w"], w[f"{p}.dw.b"], w[f"{p}.pw.wt"], w[f"{p}.pw.b"],
                stride=b.stride, dilation=b.dilation,
                skip=None if b.join is None else skips[b.join],
                residual=b.residual, scratch=buf.dw_scratch, out=buf.acts[p],
            )  # fmt: skip
        head = p == self.head_block
        path = self.path[p]
        launcher, pw = ONE_LAUNCH[path]
        return launcher(
            h, w[f"{p}.dw.w"], w[f"{p}.dw.b"], w[f"{p}.{pw}"], w[f"{p}.pw.b"],
            stride=b.stride, dilation=b.dilation,
            skip=None if b.join is None else skips[b.join],
            residual=b.residual,
            head_w=w["head.w"] if head else None,
            head_b=w["head.b"] if head else None,
            out=buf.logits if head else buf.acts[p],
        )  # fmt: skip


ONE_LAUNCH: Final[dict[str, tuple[Callable[..., Any], str]]] = {
    "fused": (ds_block_cuda, "pw.w"),
    "split": (ds_block_cuda, "pw.w"),  # a split block not in Buffers.split runs fused
    "tiled": (ds_tiled_cuda, "pw.wt"),  # the pointwise weight transposed
    "halo": (ds_halo_cuda, "pw.wt"),
}
"""A block path's one-launch kernel and the pointwise weight it takes."""


def fused_logits_ref(
    weights: Weights, cfg: NetConfig, images: np.ndarray, mean: float, std: float
) -> np.ndarray:
    """The launch sequence of :meth:`CudaForward.run` in numpy (its ``_ref`` twins), from the
    uint8 frames ``[N, H, W]`` to the logits: a CPU check of the fusion plan."""
    plan = block_plan(cfg)
    h = stem_ref(images, mean, std, weights["stem.w"], weights["stem.b"])
    skips = {"skip0": h}
    for b in plan:
        head = b is plan[-1]
        h = ds_block_ref(
            h, weights[f"{b.name}.dw.w"], weights[f"{b.name}.dw.b"],
            weights[f"{b.name}.pw.w"], weights[f"{b.name}.pw.b"], b.stride, b.dilation,
            None if b.join is None else skips[b.join], b.residual,
            weights["head.w"] if head else None, weights["head.b"] if head else None,
        )  # fmt: skip
        if b.saves is not None:
            skips[b.saves] = h
    return h

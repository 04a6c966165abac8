"""``output_path``: from the head's logits to everything a worker sends back, as one op.

``output_path_ref`` is defined by the pieces it fuses::

    prob    = prob_head(logits, height, width)                   # bilinear 2x, crop, sigmoid
    mask    = 255 * (prob >= threshold)                          # raw mask (before min_area)
    score   = peak_local_mean(prob, score_window)  per image     # postprocess.py
    entropy = binary_entropy_bits(prob)            per image
    hist    = intensity_histogram(image)           per image     # 64 bins of the input

On the GPU (``output_path.cu``) this is two kernels: ``output_stats`` makes one pass over the
output pixels (prob, mask, entropy sums through block reductions and atomics, the input
histogram through a shared-memory histogram per block) and ``window_score`` finds each
image's best ``k x k`` window mean; its last block per image (a ticket counter) writes the
final score and mean entropy, so nothing is left for the host but copying.
Connected components, ``min_area`` and boxes stay on the host (``postprocess.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from scratchd.ipc.layout import HISTOGRAM_BINS
from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array
from scratchd.kernels.postprocess import (
    binary_entropy_bits,
    intensity_histogram,
    peak_local_mean,
)
from scratchd.kernels.prob_head import prob_head_ref

MAX_SCORE_WINDOW = 32  # KMAX in output_path.cu


class OutputPath(NamedTuple):
    prob: Any  # [N, H, W] float32
    mask: Any  # [N, H, W] uint8, 0 / 255
    score: Any  # [N] float32 in [0, 1]
    entropy: Any  # [N] float32, mean binary entropy in bits
    hist: Any  # [N, 64] uint32


def output_path_ref(
    logits: np.ndarray,  # [N, h, w, 1] float32
    images: np.ndarray,  # [N, H, W] uint8, 2h >= H, 2w >= W
    threshold: float,
    score_window: int,
) -> OutputPath:
    """Probability, raw mask, score, entropy and input histogram of each image."""
    check_array("output_path", "images", images, ndim=3, dtype=np.uint8)
    _check_window(score_window)
    n, height, width = images.shape
    prob = prob_head_ref(logits, height, width)
    mask = (prob >= np.float32(threshold)).astype(np.uint8) * np.uint8(255)
    score = np.array([peak_local_mean(p, score_window) for p in prob], dtype=np.float32)
    entropy = np.array([binary_entropy_bits(p) for p in prob], dtype=np.float32)
    hist = np.stack([intensity_histogram(img) for img in images]).reshape(n, HISTOGRAM_BINS)
    return OutputPath(prob, mask, score, entropy, hist)


def _check_window(score_window: int) -> None:
    if not 1 <= score_window <= MAX_SCORE_WINDOW:
        raise ValueError(
            f"output_path: score_window must be in 1..{MAX_SCORE_WINDOW}, got {score_window}"
        )


def output_path_buffers(n: int, height: int, width: int) -> OutputPath:
    """Device buffers for :func:`output_path_cuda`'s ``out`` (allocated once, reused)."""
    cp = cu.cupy()
    return OutputPath(
        cp.empty((n, height, width), np.float32),
        cp.empty((n, height, width), np.uint8),
        cp.empty((n,), np.float32),
        cp.empty((n,), np.float32),
        cp.empty((n, HISTOGRAM_BINS), np.uint32),
    )


def output_path_cuda(
    logits: Any,  # [N, h, w, 1] float32 (CuPy)
    images: Any,  # [N, H, W] uint8
    threshold: float,
    score_window: int,
    *,
    out: OutputPath | None = None,  # from output_path_buffers(N, H, W)
    scratch: Any | None = None,  # [3 * N] uint32 zeroed here each run; kept with `out`
) -> OutputPath:
    """CUDA twin of :func:`output_path_ref` (``output_path.cu``): a memset and two kernels."""
    op = "output_path"
    cu.check_device_array(op, "logits", logits, ndim=4, dtype=np.float32)
    cu.check_device_array(op, "images", images, ndim=3, dtype=np.uint8)
    _check_window(score_window)
    n, h, w, c = logits.shape
    _, height, width = images.shape
    if c != 1 or images.shape[0] != n or not (0 < height <= 2 * h and 0 < width <= 2 * w):
        raise ValueError(f"{op}: logits {logits.shape} do not cover images {images.shape}")
    out = out if out is not None else output_path_buffers(n, height, width)
    for name, arr, shape, dtype in zip(
        OutputPath._fields, out, _shapes(n, height, width), _DTYPES, strict=True
    ):
        cu.check_device_array(op, f"out.{name}", arr, ndim=len(shape), dtype=dtype)
        cu.check_shape(op, f"out.{name}", arr, shape)
    scratch = cu.output(op, scratch, (3 * n,), np.uint32, "scratch")
    # scratch = [entropy sums (float bits) | score maxima (float bits) | tickets]; hist is
    # accumulated too: both zeroed on the stream first (memset nodes when captured).
    cu.zero(scratch)
    cu.zero(out.hist)
    ent_sum, score_bits, tickets = scratch[:n], scratch[n : 2 * n], scratch[2 * n :]
    stats = cu.kernel("output_path.cu", "output_stats", ("window_score",))
    blocks = max(1, min(-(-height * width // 256), cu.sm_count() * 8 // max(n, 1)))
    args = (logits, images, out.prob, out.mask, ent_sum, out.hist)
    sizes = (*map(cu.i32, (h, w, height, width)), cu.f32(threshold))
    cu.launch(stats, (blocks, n), (256,), (*args, *sizes))
    window_score_cuda(out.prob, ent_sum, score_bits, tickets, out.score, out.entropy, score_window)
    return out


def window_score_cuda(
    prob: Any,  # [N, H, W] float32
    ent_sum: Any,  # [N] uint32: float bits of the per-image entropy sums (bits)
    score_bits: Any,  # [N] uint32, zero before the launch: running max window sum
    tickets: Any,  # [N] uint32, zero before the launch: finished blocks per image
    score: Any,  # [N] float32 out: peak_local_mean(prob[n], score_window)
    entropy: Any,  # [N] float32 out: ent_sum[n] / (H * W)
    score_window: int,
) -> None:
    """Launch ``window_score`` (``output_path.cu``): each image's best window mean, and its
    mean entropy from the sums a previous kernel accumulated. Also used by ``views.py`` on
    the mean of the test-time views."""
    _check_window(score_window)
    n, height, width = prob.shape
    kh, kw = min(score_window, height), min(score_window, width)
    rows, segs = height - kh + 1, -(-(width - kw + 1) // 256)
    slots = cu.sm_count() * 8  # resident 256-thread blocks
    band = min(max(-(-rows * segs * n // slots), 4), 64)  # rows per job: fill, then slide
    jobs = -(-rows // band) * segs
    blocks = max(1, min(jobs, slots // max(n, 1)))
    func = cu.kernel("output_path.cu", "window_score", ("output_stats",))
    args = (prob, ent_sum, score_bits, tickets, score, entropy)
    dims = map(cu.i32, (height, width, kh, kw, band))
    cu.launch(func, (blocks, n), (256,), (*args, *dims))


_DTYPES = (np.float32, np.uint8, np.float32, np.float32, np.uint32)


def _shapes(n: int, height: int, width: int) -> tuple[tuple[int, ...], ...]:
    return ((n, height, width), (n, height, width), (n,), (n,), (n, HISTOGRAM_BINS))

"""``prob_head``: logits at half resolution → probabilities at the input's size.

The network's last three steps as one op (one GPU kernel): bilinear 2x upsampling of the
single-channel logits (``upsample_bilinear2x``), cropping the padding added by
``normalize_pad`` back off (top-left ``height x width``), and the ``sigmoid``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array
from scratchd.kernels.sigmoid import sigmoid_ref
from scratchd.kernels.upsample_bilinear2x import upsample_bilinear2x_ref


def prob_head_ref(
    logits: np.ndarray,  # [N, h, w, 1] float32, 2h >= height, 2w >= width
    height: int,
    width: int,
) -> np.ndarray:  # [N, height, width] float32 in [0, 1]
    """Upsample logits 2x (bilinear), crop to ``height x width``, apply the sigmoid."""
    check_array("prob_head", "logits", logits, ndim=4)
    _n, h, w, c = logits.shape
    if c != 1:
        raise ValueError(f"prob_head: logits must have 1 channel, got shape {logits.shape}")
    if not (0 < height <= 2 * h and 0 < width <= 2 * w):
        raise ValueError(
            f"prob_head: crop {height}x{width} does not fit the upsampled {2 * h}x{2 * w}"
        )
    up = upsample_bilinear2x_ref(logits)[:, :height, :width, 0]
    return sigmoid_ref(np.ascontiguousarray(up))


def prob_head_cuda(
    logits: Any,  # [N, h, w, 1] float32 (CuPy), 2h >= height, 2w >= width
    height: int,
    width: int,
    *,
    out: Any | None = None,  # [N, height, width] float32: written in place when given
) -> Any:  # [N, height, width] float32 in [0, 1]
    """CUDA twin of :func:`prob_head_ref` (``prob_head.cu``): one pass, no intermediate."""
    cu.check_device_array("prob_head", "logits", logits, ndim=4, dtype=np.float32)
    n, h, w, c = logits.shape
    if c != 1:
        raise ValueError(f"prob_head: logits must have 1 channel, got shape {logits.shape}")
    if not (0 < height <= 2 * h and 0 < width <= 2 * w):
        raise ValueError(
            f"prob_head: crop {height}x{width} does not fit the upsampled {2 * h}x{2 * w}"
        )
    out = cu.output("prob_head", out, (n, height, width), np.float32)
    func = cu.kernel("prob_head.cu", "prob_head")
    grid = cu.grid_size(n * height * width, 256)
    cu.launch(func, (grid,), (256,), (logits, out, *map(cu.i32, (n, h, w, height, width))))
    return out

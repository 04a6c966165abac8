"""``upsample_bilinear2x``: bilinear 2x upsampling, half-pixel centres, clamped edges.

Identical to PyTorch's ``interpolate(scale_factor=2, mode="bilinear", align_corners=False)``.
For an exact factor of 2 the weights are constant, per axis:

    out[2i]     = 0.75 * in[i] + 0.25 * in[max(i - 1, 0)]
    out[2i + 1] = 0.75 * in[i] + 0.25 * in[min(i + 1, n - 1)]

applied along H, then along W (separable; the order does not change the result beyond
float32 rounding).
"""

from __future__ import annotations

import numpy as np

from scratchd.kernels._checks import check_array


def _upsample_axis(x: np.ndarray, axis: int) -> np.ndarray:
    n = x.shape[axis]
    src = np.moveaxis(x, axis, 0)
    prev = np.concatenate([src[:1], src[:-1]], axis=0)  # in[max(i - 1, 0)]
    nxt = np.concatenate([src[1:], src[-1:]], axis=0)  # in[min(i + 1, n - 1)]
    out = np.empty((n, 2, *src.shape[1:]), dtype=np.float32)
    np.multiply(src, np.float32(0.75), out=out[:, 0])
    out[:, 0] += np.float32(0.25) * prev
    np.multiply(src, np.float32(0.75), out=out[:, 1])
    out[:, 1] += np.float32(0.25) * nxt
    return np.moveaxis(out.reshape(2 * n, *src.shape[1:]), 0, axis)


def upsample_bilinear2x_ref(
    x: np.ndarray,  # [N, h, w, C] float32
) -> np.ndarray:  # [N, 2h, 2w, C] float32
    """Bilinear 2x upsampling (align_corners=False) of an NHWC tensor."""
    check_array("upsample_bilinear2x", "x", x, ndim=4)
    if x.shape[1] == 0 or x.shape[2] == 0:
        raise ValueError(f"upsample_bilinear2x: empty spatial shape {x.shape}")
    return np.ascontiguousarray(_upsample_axis(_upsample_axis(x, 1), 2))

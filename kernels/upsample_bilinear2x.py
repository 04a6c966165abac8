"""``upsample_bilinear2x``: bilinear 2x upsampling, half-pixel centres, clamped edges.

Identical to PyTorch's ``interpolate(scale_factor=2, mode="bilinear", align_corners=False)``.
For an exact factor of 2 the weights are constant, per axis:

    out[2i]     = 0.75 * in[i] + 0.25 * in[max(i - 1, 0)]
    out[2i + 1] = 0.75 * in[i] + 0.25 * in[min(i + 1, n - 1)]

applied along H, then along W (separable; the order does not change the result beyond
float32 rounding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
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


def upsample_bilinear2x_cuda(
    x: Any,  # [N, h, w, C] float16 or float32 (CuPy)
    *,
    out: Any | None = None,  # [N, 2h, 2w, C], x's dtype: written in place when given
) -> Any:  # [N, 2h, 2w, C], x's dtype
    """CUDA twin of :func:`upsample_bilinear2x_ref` (``upsample_bilinear2x.cu``), fp32 weights."""
    dtype = np.float16 if getattr(x, "dtype", None) == np.float16 else np.float32
    cu.check_device_array("upsample_bilinear2x", "x", x, ndim=4, dtype=dtype)
    n, h, w, c = x.shape
    if h == 0 or w == 0:
        raise ValueError(f"upsample_bilinear2x: empty spatial shape {x.shape}")
    out = cu.output("upsample_bilinear2x", out, (n, 2 * h, 2 * w, c), dtype)
    ctype = "__half" if dtype == np.float16 else "float"
    func = cu.kernel("upsample_bilinear2x.cu", cu.template_name("upsample_bilinear2x", ctype))
    grid = cu.grid_size(out.size, 256)
    cu.launch(func, (grid,), (256,), (x, out, *map(cu.i32, (n, h, w, c))))
    return out

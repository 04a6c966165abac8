"""``upsample_concat``: nearest-neighbour 2x upsampling of ``x`` concatenated with a skip.

``out[n, y, x, :C1] = x[n, y // 2, x // 2, :]`` and ``out[n, y, x, C1:] = skip[n, y, x, :]``
(the decoder's join; PyTorch: ``cat([interpolate(x, scale_factor=2, mode="nearest"), skip],
dim=channels)``). One op so the GPU writes the joined tensor in one pass, never the
upsampled intermediate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array


def upsample_concat_ref(
    x: np.ndarray,  # [N, h, w, C1] float32
    skip: np.ndarray,  # [N, 2h, 2w, C2] float32
) -> np.ndarray:  # [N, 2h, 2w, C1 + C2] float32
    """Nearest 2x upsample ``x`` and append ``skip``'s channels."""
    check_array("upsample_concat", "x", x, ndim=4)
    check_array("upsample_concat", "skip", skip, ndim=4)
    n, h, w, c1 = x.shape
    if skip.shape[:3] != (n, 2 * h, 2 * w):
        raise ValueError(
            f"upsample_concat: skip must have shape ({n}, {2 * h}, {2 * w}, C2) "
            f"for x of shape {x.shape}, got {skip.shape}"
        )
    c2 = skip.shape[3]
    out = np.empty((n, 2 * h, 2 * w, c1 + c2), dtype=np.float32)
    # View out as [N, h, 2, w, 2, C1 + C2] (a view: out is contiguous): each source pixel
    # fills a 2x2 block of the first C1 channels.
    blocks = out.reshape(n, h, 2, w, 2, c1 + c2)
    blocks[..., :c1] = x[:, :, None, :, None, :]
    out[..., c1:] = skip
    return out


def upsample_concat_cuda(
    x: Any,  # [N, h, w, C1] float16 (CuPy)
    skip: Any,  # [N, 2h, 2w, C2] float16
    *,
    out: Any | None = None,  # [N, 2h, 2w, C1 + C2] float16: written in place when given
) -> Any:  # [N, 2h, 2w, C1 + C2] float16
    """CUDA twin of :func:`upsample_concat_ref` (``upsample_concat.cu``)."""
    cu.check_device_array("upsample_concat", "x", x, ndim=4, dtype=np.float16)
    cu.check_device_array("upsample_concat", "skip", skip, ndim=4, dtype=np.float16)
    n, h, w, c1 = x.shape
    if tuple(skip.shape[:3]) != (n, 2 * h, 2 * w):
        raise ValueError(
            f"upsample_concat: skip must have shape ({n}, {2 * h}, {2 * w}, C2) "
            f"for x of shape {x.shape}, got {skip.shape}"
        )
    c2 = skip.shape[3]
    out = cu.output("upsample_concat", out, (n, 2 * h, 2 * w, c1 + c2), np.float16)
    func = cu.kernel("upsample_concat.cu", cu.template_name("upsample_concat", c1, c2))
    groups = (c1 + c2) // 8 if c1 % 8 == 0 and c2 % 8 == 0 else c1 + c2
    grid = cu.grid_size(n * 4 * h * w * groups, 256)
    cu.launch(func, (grid,), (256,), (x, skip, out, *map(cu.i32, (n, 2 * h, 2 * w))))
    return out

"""``dwconv3x3``: depthwise 3x3 convolution, zero padding = dilation, stride, bias, act.

``out[n, y, x, c] = act(b[c] + sum_{ky, kx} xp[n, s*y + d*ky, s*x + d*kx, c] * w[ky, kx, c])``
where ``xp`` is ``x`` zero-padded by ``d`` pixels on every side (PyTorch's
``Conv2d(C, C, 3, stride=s, padding=d, dilation=d, groups=C)``, weight ``[C, 1, 3, 3]``
transposed to ``[3, 3, C]``). Output size: ``Ho = (H - 1) // stride + 1``.

The reference is nine shifted multiply-adds over whole arrays (channels last, so each tap is a
contiguous row-wise broadcast multiply); a GPU kernel computes one output pixel's channels
per thread group and reads the 3x3 neighbourhood from shared memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import Act, apply_act_, check_act, check_array, check_shape


def dwconv3x3_ref(
    x: np.ndarray,  # [N, H, W, C] float32
    w: np.ndarray,  # [3, 3, C] float32
    b: np.ndarray,  # [C] float32
    stride: int = 1,
    dilation: int = 1,
    act: Act = "relu",
) -> np.ndarray:  # [N, Ho, Wo, C] float32
    """Depthwise 3x3 convolution (stride 1 or 2, dilation >= 1), bias and activation."""
    check_array("dwconv3x3", "x", x, ndim=4)
    check_array("dwconv3x3", "w", w, ndim=3)
    check_array("dwconv3x3", "b", b, ndim=1)
    check_act("dwconv3x3", act)
    n, h, wd, c = x.shape
    check_shape("dwconv3x3", "w", w, (3, 3, c))
    check_shape("dwconv3x3", "b", b, (c,))
    if stride not in (1, 2):
        raise ValueError(f"dwconv3x3: stride must be 1 or 2, got {stride}")
    if dilation < 1:
        raise ValueError(f"dwconv3x3: dilation must be >= 1, got {dilation}")
    d = dilation
    ho, wo = (h - 1) // stride + 1, (wd - 1) // stride + 1
    xp = np.zeros((n, h + 2 * d, wd + 2 * d, c), dtype=np.float32)
    xp[:, d : d + h, d : d + wd, :] = x
    out = np.empty((n, ho, wo, c), dtype=np.float32)
    out[...] = b
    tmp = np.empty_like(out)
    for ky in range(3):
        for kx in range(3):
            tap = xp[
                :,
                d * ky : d * ky + stride * (ho - 1) + 1 : stride,
                d * kx : d * kx + stride * (wo - 1) + 1 : stride,
            ]
            np.multiply(tap, w[ky, kx], out=tmp)
            out += tmp
    return apply_act_(out, act)


def dwconv3x3_cuda(
    x: Any,  # [N, H, W, C] float16 (CuPy)
    w: Any,  # [3, 3, C] float16
    b: Any,  # [C] float32
    stride: int = 1,
    dilation: int = 1,
    act: Act = "relu",
    *,
    out: Any | None = None,  # [N, Ho, Wo, C] float16: written in place when given
) -> Any:  # [N, Ho, Wo, C] float16
    """CUDA twin of :func:`dwconv3x3_ref` (``dwconv3x3.cu``): fp32 arithmetic, fp16 out."""
    cu.check_device_array("dwconv3x3", "x", x, ndim=4, dtype=np.float16)
    cu.check_device_array("dwconv3x3", "w", w, ndim=3, dtype=np.float16)
    cu.check_device_array("dwconv3x3", "b", b, ndim=1, dtype=np.float32)
    check_act("dwconv3x3", act)
    n, h, wd, c = x.shape
    cu.check_shape("dwconv3x3", "w", w, (3, 3, c))
    cu.check_shape("dwconv3x3", "b", b, (c,))
    if stride not in (1, 2):
        raise ValueError(f"dwconv3x3: stride must be 1 or 2, got {stride}")
    if dilation < 1:
        raise ValueError(f"dwconv3x3: dilation must be >= 1, got {dilation}")
    ho, wo = (h - 1) // stride + 1, (wd - 1) // stride + 1
    out = cu.output("dwconv3x3", out, (n, ho, wo, c), np.float16)
    func = cu.kernel(
        "dwconv3x3.cu", cu.template_name("dwconv3x3", c, stride, dilation, act == "relu")
    )
    items = n * ho * wo * (c // 8 if c % 8 == 0 else c)
    grid = cu.grid_size(items, 256)
    args = (x, w, b, out, *map(cu.i32, (n, h, wd, ho, wo)))
    cu.launch(func, (grid,), (256,), args)
    return out

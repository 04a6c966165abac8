"""``conv3x3``: full 3x3 convolution (the stem), zero padding 1, optional stride, bias, act.

``out[n, y, x, co] = act(b[co] + sum_{ky,kx,ci} xp[n, s*y+ky, s*x+kx, ci] * w[ky, kx, ci, co])``
where ``xp`` is ``x`` zero-padded by one pixel on every side (cross-correlation, as in
PyTorch; the weight layout is PyTorch's ``[Cout, Cin, 3, 3]`` transposed to
``[3, 3, Cin, Cout]``). Output size: ``Ho = (H - 1) // stride + 1`` (same for W).

The reference gathers the nine taps into a ``[N*Ho*Wo, 9*Cin]`` matrix (im2col) and does one
BLAS matmul; with ``Cin = 1`` in the stem that is a ``[M, 9] @ [9, Cout]`` product.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import Act, apply_act_, check_act, check_array, check_shape


def conv3x3_ref(
    x: np.ndarray,  # [N, H, W, Cin] float32
    w: np.ndarray,  # [3, 3, Cin, Cout] float32
    b: np.ndarray,  # [Cout] float32
    stride: int = 1,
    act: Act = "relu",
) -> np.ndarray:  # [N, Ho, Wo, Cout] float32
    """3x3 convolution with zero padding 1, ``stride`` 1 or 2, bias and activation."""
    check_array("conv3x3", "x", x, ndim=4)
    check_array("conv3x3", "w", w, ndim=4)
    check_array("conv3x3", "b", b, ndim=1)
    check_act("conv3x3", act)
    n, h, wd, cin = x.shape
    cout = w.shape[3]
    check_shape("conv3x3", "w", w, (3, 3, cin, cout))
    check_shape("conv3x3", "b", b, (cout,))
    if stride not in (1, 2):
        raise ValueError(f"conv3x3: stride must be 1 or 2, got {stride}")
    ho, wo = (h - 1) // stride + 1, (wd - 1) // stride + 1
    xp = np.zeros((n, h + 2, wd + 2, cin), dtype=np.float32)
    xp[:, 1:-1, 1:-1, :] = x
    cols = np.empty((n, ho, wo, 9, cin), dtype=np.float32)  # im2col, tap-major like w
    for ky in range(3):
        for kx in range(3):
            cols[:, :, :, ky * 3 + kx, :] = xp[
                :,
                ky : ky + stride * (ho - 1) + 1 : stride,
                kx : kx + stride * (wo - 1) + 1 : stride,
            ]
    out = cols.reshape(n * ho * wo, 9 * cin) @ w.reshape(9 * cin, cout)
    out += b
    return apply_act_(out, act).reshape(n, ho, wo, cout)


def conv3x3_cuda(
    x: Any,  # [N, H, W, Cin] float16 (CuPy)
    w: Any,  # [3, 3, Cin, Cout] float16
    b: Any,  # [Cout] float32
    stride: int = 1,
    act: Act = "relu",
    *,
    out: Any | None = None,  # [N, Ho, Wo, Cout] float16: written in place when given
) -> Any:  # [N, Ho, Wo, Cout] float16
    """CUDA twin of :func:`conv3x3_ref` (``conv3x3.cu``): direct convolution, the weight in
    shared memory as fp32 (so ``9 * Cin * Cout <= 12288``), fp16 out."""
    cu.check_device_array("conv3x3", "x", x, ndim=4, dtype=np.float16)
    cu.check_device_array("conv3x3", "w", w, ndim=4, dtype=np.float16)
    cu.check_device_array("conv3x3", "b", b, ndim=1, dtype=np.float32)
    check_act("conv3x3", act)
    n, h, wd, cin = x.shape
    cout = w.shape[3]
    cu.check_shape("conv3x3", "w", w, (3, 3, cin, cout))
    cu.check_shape("conv3x3", "b", b, (cout,))
    if stride not in (1, 2):
        raise ValueError(f"conv3x3: stride must be 1 or 2, got {stride}")
    if 9 * cin * cout > 12288:
        raise ValueError(f"conv3x3: {cin}->{cout} channels do not fit the kernel's 48 KB weight")
    ho, wo = (h - 1) // stride + 1, (wd - 1) // stride + 1
    out = cu.output("conv3x3", out, (n, ho, wo, cout), np.float16)
    func = cu.kernel("conv3x3.cu", cu.template_name("conv3x3", cin, cout, stride, act == "relu"))
    items = n * ho * wo * (cout // 8 if cout % 8 == 0 else cout)
    grid = cu.grid_size(items, 256)
    args = (x, w, b, out, *map(cu.i32, (n, h, wd, ho, wo)))
    cu.launch(func, (grid,), (256,), args)
    return out

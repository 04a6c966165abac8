"""``pwconv``: pointwise (1x1) convolution with bias, optional residual add, then activation.

``out[n, y, x, co] = act(b[co] + sum_ci x[n, y, x, ci] * w[ci, co] (+ residual[n, y, x, co]))``

The residual is added *before* the activation (ResNet order), so a GPU kernel fuses matmul,
bias, residual and ReLU into one epilogue. Channels last makes this one BLAS matmul
``[N*H*W, Cin] @ [Cin, Cout]``; the weight is PyTorch's ``[Cout, Cin, 1, 1]`` as ``[Cin, Cout]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import Act, apply_act_, check_act, check_array, check_shape


def pwconv_ref(
    x: np.ndarray,  # [N, H, W, Cin] float32
    w: np.ndarray,  # [Cin, Cout] float32
    b: np.ndarray,  # [Cout] float32
    act: Act = "relu",
    residual: np.ndarray | None = None,  # [N, H, W, Cout] float32
) -> np.ndarray:  # [N, H, W, Cout] float32
    """1x1 convolution as a matmul over pixels, plus bias (and residual), then ``act``."""
    check_array("pwconv", "x", x, ndim=4)
    check_array("pwconv", "w", w, ndim=2)
    check_array("pwconv", "b", b, ndim=1)
    check_act("pwconv", act)
    n, h, wd, cin = x.shape
    cout = w.shape[1]
    check_shape("pwconv", "w", w, (cin, cout))
    check_shape("pwconv", "b", b, (cout,))
    out = np.matmul(x.reshape(n * h * wd, cin), w).reshape(n, h, wd, cout)
    out += b
    if residual is not None:
        check_array("pwconv", "residual", residual, ndim=4)
        check_shape("pwconv", "residual", residual, (n, h, wd, cout))
        out += residual
    return apply_act_(out, act)


def pwconv_cuda(
    x: Any,  # [N, H, W, Cin] float16 (CuPy)
    w: Any,  # [Cin, Cout] float16
    b: Any,  # [Cout] float32
    act: Act = "relu",
    residual: Any | None = None,  # [N, H, W, Cout] float16
    *,
    out: Any | None = None,  # [N, H, W, Cout] float16: written in place when given
) -> Any:  # [N, H, W, Cout] float16
    """CUDA twin of :func:`pwconv_ref` (``pwconv.cu``): a tensor-core GEMM over the pixels,
    fp32 accumulation, bias + residual + act in the epilogue, fp16 out."""
    cu.check_device_array("pwconv", "x", x, ndim=4, dtype=np.float16)
    cu.check_device_array("pwconv", "w", w, ndim=2, dtype=np.float16)
    cu.check_device_array("pwconv", "b", b, ndim=1, dtype=np.float32)
    check_act("pwconv", act)
    n, h, wd, cin = x.shape
    cout = w.shape[1]
    cu.check_shape("pwconv", "w", w, (cin, cout))
    cu.check_shape("pwconv", "b", b, (cout,))
    if residual is not None:
        cu.check_device_array("pwconv", "residual", residual, ndim=4, dtype=np.float16)
        cu.check_shape("pwconv", "residual", residual, (n, h, wd, cout))
    out = cu.output("pwconv", out, (n, h, wd, cout), np.float16)
    slices = cu.pw_slices(cin, cout)
    name = cu.template_name("pwconv", cin, cout, slices, residual is not None, act == "relu")
    func = cu.kernel("pwconv.cu", name)
    res = x if residual is None else residual
    args = (x, w, b, res, out, cu.i32(n * h * wd))
    cu.launch_pw(func, cin, cout, n * h * wd, args, slices=slices)
    return out

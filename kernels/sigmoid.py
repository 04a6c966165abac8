"""``sigmoid``: the logistic function, evaluated without overflow for any float32 input.

``sigmoid(x) = 1 / (1 + exp(-x))``; computed from ``e = exp(-|x|)`` (never overflows) as
``1 / (1 + e)`` for ``x >= 0`` and ``e / (1 + e)`` for ``x < 0``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu


def sigmoid_ref(x: np.ndarray) -> np.ndarray:  # any shape, float32 → same shape, float32
    """Elementwise logistic sigmoid in float32."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError("sigmoid: x must be a float32 numpy array")
    e = np.exp(-np.abs(x))
    out = np.where(x >= 0, np.float32(1.0), e)
    out /= np.float32(1.0) + e
    return out


def sigmoid_cuda(x: Any, *, out: Any | None = None) -> Any:  # any shape, float32 → float32
    """CUDA twin of :func:`sigmoid_ref` (``sigmoid.cu``)."""
    cu.check_device_array("sigmoid", "x", x, ndim=None, dtype=np.float32)
    out = cu.output("sigmoid", out, tuple(x.shape), np.float32)
    func = cu.kernel("sigmoid.cu", "sigmoid")
    grid = cu.grid_size(x.size, 256)
    cu.launch(func, (grid,), (256,), (x, out, cu.i32(x.size)))
    return out

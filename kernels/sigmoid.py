"""``sigmoid``: the logistic function, evaluated without overflow for any float32 input.

``sigmoid(x) = 1 / (1 + exp(-x))``; computed from ``e = exp(-|x|)`` (never overflows) as
``1 / (1 + e)`` for ``x >= 0`` and ``e / (1 + e)`` for ``x < 0``.
"""

from __future__ import annotations

import numpy as np


def sigmoid_ref(x: np.ndarray) -> np.ndarray:  # any shape, float32 → same shape, float32
    """Elementwise logistic sigmoid in float32."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError("sigmoid: x must be a float32 numpy array")
    e = np.exp(-np.abs(x))
    out = np.where(x >= 0, np.float32(1.0), e)
    out /= np.float32(1.0) + e
    return out

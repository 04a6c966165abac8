"""``fold_bn``: fold an inference-mode BatchNorm into the preceding convolution.

BatchNorm after a bias-free conv computes ``gamma * (conv(x) - mean) / sqrt(var + eps) + beta``;
with ``k = gamma / sqrt(var + eps)`` that is a conv with weight ``w * k`` (scaled per output
channel) and bias ``beta - mean * k`` (plus ``b * k`` when the conv had a bias ``b``).
Every weight layout in scratchd keeps the output channel on the last axis (``[3, 3, Cin, Cout]``,
``[3, 3, C]``, ``[Cin, Cout]``), so ``k`` broadcasts over it. Used at export, never at serve time.
"""

from __future__ import annotations

import numpy as np


def fold_bn_ref(
    w: np.ndarray,  # [..., Cout]
    b: np.ndarray | None,  # [Cout] or None (conv without bias)
    gamma: np.ndarray,  # [Cout]
    beta: np.ndarray,  # [Cout]
    mean: np.ndarray,  # [Cout] running mean
    var: np.ndarray,  # [Cout] running variance
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:  # (w [..., Cout] float32, b [Cout] float32)
    """The conv weight and bias that equal conv followed by BatchNorm in inference mode."""
    cout = w.shape[-1]
    for name, arr in (("gamma", gamma), ("beta", beta), ("mean", mean), ("var", var)):
        if arr.shape != (cout,):
            raise ValueError(f"fold_bn: {name} must have shape ({cout},), got {arr.shape}")
    if b is not None and b.shape != (cout,):
        raise ValueError(f"fold_bn: b must have shape ({cout},), got {b.shape}")
    k = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    bias = np.zeros(cout) if b is None else b.astype(np.float64)
    w_folded = (w.astype(np.float64) * k).astype(np.float32)
    b_folded = (beta.astype(np.float64) + (bias - mean.astype(np.float64)) * k).astype(np.float32)
    return w_folded, b_folded

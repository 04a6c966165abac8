"""Argument validation shared by the ``<op>_ref`` functions (their ``<op>_cuda`` twins share
``check_act`` and check device arrays with ``_cuda.check_device_array``).

Every op checks dtype, rank and the shapes that must agree *before* it computes, so a wrong
call fails with a message naming the op and the argument instead of broadcasting silently.
Activations are float32 NHWC (channels last) throughout the network.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import numpy as np

Act = Literal["relu", "none"]
ACTS: tuple[Act, ...] = ("relu", "none")


def env_choice(name: str, default: str, allowed: Sequence[str]) -> str:
    """The environment variable ``name`` (``default`` when unset), which must be one of
    ``allowed``: the kernels' schedule knobs, read at each call so a benchmark can compare
    them in one process."""
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check_array(
    op: str, name: str, arr: np.ndarray, *, ndim: int, dtype: type = np.float32
) -> None:
    """Raise ``ValueError`` unless ``arr`` is an ndarray of ``dtype`` with ``ndim`` axes."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{op}: {name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} axes, got shape {arr.shape}")


def check_shape(op: str, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``arr.shape == shape``."""
    if arr.shape != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {arr.shape}")


def check_act(op: str, act: str) -> None:
    if act not in ACTS:
        raise ValueError(f"{op}: act must be one of {ACTS}, got {act!r}")


def apply_act_(x: np.ndarray, act: Act) -> np.ndarray:
    """Apply ``act`` in place and return ``x`` (no copy: the caller owns ``x``)."""
    if act == "relu":
        np.maximum(x, 0.0, out=x)
    return x

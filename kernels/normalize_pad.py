"""``normalize_pad``: uint8 greyscale frames → normalised, padded float32 NHWC input.

``y = (x / 255 - mean) / std`` and the frame is edge-replicated at the bottom and right up
to a multiple of ``multiple`` (16: the network downsamples four times), so every stride-2
stage halves an even size exactly. The padding is cropped away again at the head.
A GPU kernel fuses the cast, the affine map and the clamp-to-edge read into one pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array


def padded_size(size: int, multiple: int = 16) -> int:
    """The smallest multiple of ``multiple`` that is ``>= size``."""
    return -(-size // multiple) * multiple


def normalize_pad_ref(
    images: np.ndarray,  # [N, H, W] uint8
    mean: float,
    std: float,
    multiple: int = 16,
) -> np.ndarray:  # [N, Hp, Wp, 1] float32, Hp = padded_size(H), Wp = padded_size(W)
    """Normalise ``images`` and pad them (edge replication) to a multiple of ``multiple``."""
    check_array("normalize_pad", "images", images, ndim=3, dtype=np.uint8)
    if not std > 0:
        raise ValueError(f"normalize_pad: std must be > 0, got {std}")
    if multiple < 1:
        raise ValueError(f"normalize_pad: multiple must be >= 1, got {multiple}")
    n, h, w = images.shape
    if h == 0 or w == 0:
        raise ValueError(f"normalize_pad: empty image shape {images.shape}")
    hp, wp = padded_size(h, multiple), padded_size(w, multiple)
    out = np.empty((n, hp, wp, 1), dtype=np.float32)
    body = out[:, :h, :w, 0]
    # (x/255 - mean)/std == x * scale + shift, computed in float32 like the kernel does.
    scale = np.float32(1.0 / (255.0 * std))
    shift = np.float32(-mean / std)
    np.multiply(images, scale, out=body, dtype=np.float32)
    body += shift
    if wp > w:
        out[:, :h, w:, 0] = body[:, :, w - 1 : w]
    if hp > h:
        out[:, h:, :, 0] = out[:, h - 1 : h, :, 0]
    return out


def normalize_pad_cuda(
    images: Any,  # [N, H, W] uint8 (CuPy)
    mean: float,
    std: float,
    multiple: int = 16,
    *,
    out: Any | None = None,  # [N, Hp, Wp, 1] float16: written in place when given
) -> Any:  # [N, Hp, Wp, 1] float16
    """CUDA twin of :func:`normalize_pad_ref` (``normalize_pad.cu``), fp16 out."""
    cu.check_device_array("normalize_pad", "images", images, ndim=3, dtype=np.uint8)
    if not std > 0:
        raise ValueError(f"normalize_pad: std must be > 0, got {std}")
    if multiple < 1:
        raise ValueError(f"normalize_pad: multiple must be >= 1, got {multiple}")
    n, h, w = images.shape
    if h == 0 or w == 0:
        raise ValueError(f"normalize_pad: empty image shape {images.shape}")
    hp, wp = padded_size(h, multiple), padded_size(w, multiple)
    out = cu.output("normalize_pad", out, (n, hp, wp, 1), np.float16)
    func = cu.kernel("normalize_pad.cu", "normalize_pad")
    scale, shift = cu.f32(1.0 / (255.0 * std)), cu.f32(-mean / std)
    args = (images, out, *map(cu.i32, (n, h, w, hp, wp)), scale, shift)
    cu.launch(func, (cu.grid_size(n * hp * wp, 256),), (256,), args)
    return out

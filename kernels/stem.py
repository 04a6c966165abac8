"""``stem``: the input path and the first convolution as one op (the CUDA forward's fusion).

``stem_ref(images, mean, std, w, b) = conv3x3_ref(normalize_pad_ref(images, mean, std, 16),
w, b, stride=2, act="relu")``: uint8 frames ``[N, H, W]`` → ``[N, Hp/2, Wp/2, Cout]``.
``stem.cu`` reads the uint8 pixels straight into the convolution (normalising, and clamping
reads to the frame for the edge padding), so neither the normalised frame nor its padding
is ever written: per 1024² frame that saves a 2 MB write and its read, and one launch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import env_choice
from scratchd.kernels.conv3x3 import conv3x3_ref
from scratchd.kernels.normalize_pad import normalize_pad_ref, padded_size

MULTIPLE = 16  # the network's padding multiple (four stride-2 stages)


def stem_ref(
    images: np.ndarray,  # [N, H, W] uint8
    mean: float,
    std: float,
    w: np.ndarray,  # [3, 3, 1, Cout] float32
    b: np.ndarray,  # [Cout] float32
) -> np.ndarray:  # [N, Hp/2, Wp/2, Cout] float32
    """Normalise and pad the frames, then the stride-2 3x3 stem convolution with ReLU."""
    return conv3x3_ref(normalize_pad_ref(images, mean, std, MULTIPLE), w, b, 2, "relu")


SWEEP_ENV = "SCRATCHD_STEM_SWEEP"  # output pixels a thread takes along a row: 1, 2 or 4
DEFAULT_SWEEP = "4"  # the fastest on the H200, bit-equal to the others (docs/benchmarks.md)


def stem_sweep() -> int:
    """P of ``stem.cu`` (``SWEEP_ENV``, read at each call). The padded width is a multiple
    of 16, so every output row (half of it) holds whole groups of 1, 2 or 4."""
    return int(env_choice(SWEEP_ENV, DEFAULT_SWEEP, ("1", "2", "4")))


def stem_cuda(
    images: Any,  # [N, H, W] uint8 (CuPy)
    mean: float,
    std: float,
    w: Any,  # [3, 3, 1, Cout] float16
    b: Any,  # [Cout] float32
    *,
    out: Any | None = None,  # [N, Hp/2, Wp/2, Cout] float16: written in place when given
) -> Any:  # [N, Hp/2, Wp/2, Cout] float16
    """CUDA twin of :func:`stem_ref` (``stem.cu``), one launch, fp32 arithmetic."""
    cu.check_device_array("stem", "images", images, ndim=3, dtype=np.uint8)
    cu.check_device_array("stem", "w", w, ndim=4, dtype=np.float16)
    cu.check_device_array("stem", "b", b, ndim=1, dtype=np.float32)
    n, h, wd = images.shape
    if h == 0 or wd == 0:
        raise ValueError(f"stem: empty image shape {images.shape}")
    if not std > 0:
        raise ValueError(f"stem: std must be > 0, got {std}")
    cout = w.shape[3]
    cu.check_shape("stem", "w", w, (3, 3, 1, cout))
    cu.check_shape("stem", "b", b, (cout,))
    if cout > 64:
        raise ValueError(f"stem: at most 64 output channels, got {cout}")
    hp, wp = padded_size(h, MULTIPLE), padded_size(wd, MULTIPLE)
    ho, wo = hp // 2, wp // 2
    out = cu.output("stem", out, (n, ho, wo, cout), np.float16)
    sweep = stem_sweep()
    func = cu.kernel("stem.cu", cu.template_name("stem", cout, sweep))
    sizes = map(cu.i32, (n, h, wd, hp, wp, ho, wo))
    scale, shift = cu.f32(1.0 / (255.0 * std)), cu.f32(-mean / std)
    args = (images, w, b, out, *sizes, scale, shift)
    groups = cout // (8 if cout % 8 == 0 else 1)  # stem.cu's channel groups (VecWidth)
    if n * ho * wo * groups >= 2**31:
        raise ValueError(f"stem: {n}x{ho}x{wo} outputs in {groups} groups pass int32 indexing")
    threads = groups * (256 // groups)  # whole pixels a block: a thread keeps its group
    items = n * ho * wo // sweep * groups
    cu.launch(func, (cu.grid_size(items, threads),), (threads,), args)
    return out

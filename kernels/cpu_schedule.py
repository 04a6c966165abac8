"""The CPU backend's schedule for a DS block: fused per band of rows, bands over threads.

Op by op (``dwconv3x3_ref`` then ``pwconv_ref``), every intermediate of a block at H/2 is
tens of MB: each of the nine depthwise taps and the pointwise epilogue stream it through
memory again. Here a block runs band by band instead — a band is a few output rows of one
image, sized so its depthwise result (``BAND_BYTES``) stays in the core's L2 cache:

```
for each band (i, rows r0..r1), in parallel over a thread pool:
    xp  = the zero-padded input rows the band reads        # decoder blocks: joined here
          (nearest-upsampled x rows, then skip rows)       #   (upsample_concat, per band)
    y   = bias;  y += tap * w[ky, kx] for the 9 taps      # [R, Wo, Cin], in cache
    y   = relu(y)
    out[i, r0:r1] = y @ pw_w                               # BLAS, written once
    out[i, r0:r1] += pw_b (+ residual rows); relu
```

It computes exactly the composition ``pwconv_ref(dwconv3x3_ref(x, ...), ...)`` (same taps in
the same order per pixel; only the matmul's blocking differs, well under 1e-5), which
``tests/kernels/test_net.py`` checks. numpy's ufuncs and BLAS release the GIL, so the bands
of one block run on all cores — but OpenBLAS would also start its own threads for every
band's small matmul and fight ours for the cores (2-6x slower, measured), so the network runs
under :func:`single_threaded_blas` (threadpoolctl; it caps BLAS threads process-wide for the
duration of a forward). Without threadpoolctl, :func:`available` is False and the network
runs op by op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

try:
    from threadpoolctl import ThreadpoolController
except ImportError:  # pragma: no cover - optional: the GPU image need not have it
    ThreadpoolController = None

BAND_BYTES = 256 * 1024
_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="scratchd-cpu")
_CONTROLLER: Any = None


def available() -> bool:
    """Whether BLAS threads can be capped (so the banded schedule pays off)."""
    return ThreadpoolController is not None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Cap BLAS at one thread while the band threads run (process-wide, restored after)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    with _CONTROLLER.limit(limits=1, user_api="blas"):
        yield


def dw_rows(
    xp: np.ndarray,  # [R', Wp, C] padded input rows of one image, first row = band's first tap row
    w: np.ndarray,  # [3, 3, C]
    b: np.ndarray,  # [C]
    stride: int,
    d: int,
    out: np.ndarray,  # [R, Wo, C], written: the band's depthwise output (no activation)
) -> None:
    """The depthwise conv of one band from its padded input rows (taps in ky, kx order)."""
    rows, wo = out.shape[0], out.shape[1]
    out[...] = b
    tmp = np.empty_like(out)
    s = stride
    for ky in range(3):
        for kx in range(3):
            tap = xp[
                d * ky : d * ky + s * (rows - 1) + 1 : s, d * kx : d * kx + s * (wo - 1) + 1 : s
            ]
            np.multiply(tap, w[ky, kx], out=tmp)
            out += tmp


def band_input(
    x: np.ndarray,  # [H, W, C1] one image (H/2, W/2 when joined)
    skip: np.ndarray | None,  # [H, W, C2] or None
    r0: int,
    r1: int,
    stride: int,
    d: int,
) -> np.ndarray:  # [(r1 - r0 - 1) * stride + 2d + 1, W + 2d, C1 (+ C2)]
    """The zero-padded input rows that output rows ``r0..r1`` read, joined with ``skip``
    (nearest 2x upsampling of ``x``, then ``skip``'s channels) when it is given."""
    joined = skip is not None
    h, w = (skip.shape[0], skip.shape[1]) if skip is not None else (x.shape[0], x.shape[1])
    c = x.shape[2] + (skip.shape[2] if skip is not None else 0)
    lo, hi = r0 * stride - d, (r1 - 1) * stride + d + 1  # input rows, may stick out
    buf = np.empty((hi - lo, w + 2 * d, c), dtype=np.float32)
    buf[:, :d] = 0.0
    buf[:, d + w :] = 0.0
    top, bottom = max(lo, 0), min(hi, h)
    buf[: top - lo] = 0.0
    buf[bottom - lo :] = 0.0
    body = buf[top - lo : bottom - lo, d : d + w]
    if not joined:
        body[...] = x[top:bottom]
        return buf
    assert skip is not None
    c1 = x.shape[2]
    # Row y of the joined tensor is row y // 2 of x, column j is column j // 2.
    src = x[top // 2 : (bottom + 1) // 2]
    up = np.repeat(np.repeat(src, 2, axis=0), 2, axis=1)
    body[..., :c1] = up[top % 2 : top % 2 + bottom - top]
    body[..., c1:] = skip[top:bottom]
    return buf


def bands(n: int, rows: int, row_bytes: int) -> list[tuple[int, int, int]]:
    """``(image, r0, r1)`` tasks covering ``n`` images of ``rows`` rows."""
    per = max(1, BAND_BYTES // max(row_bytes, 1))
    return [(i, r0, min(r0 + per, rows)) for i in range(n) for r0 in range(0, rows, per)]


def ds_block_cpu(
    x: np.ndarray,  # [N, H, W, Cin] float32 ([N, H/2, W/2, C1] when joined with skip)
    dw_w: np.ndarray,  # [3, 3, Cin]
    dw_b: np.ndarray,  # [Cin]
    pw_w: np.ndarray,  # [Cin, Cout]
    pw_b: np.ndarray,  # [Cout]
    stride: int,
    dilation: int,
    residual: bool,
    skip: np.ndarray | None = None,  # [N, H, W, C2]: the decoder join, Cin = C1 + C2
) -> np.ndarray:  # [N, Ho, Wo, Cout] float32
    """``relu(pwconv(relu(dwconv3x3(join(x, skip))), + x if residual))`` band by band."""
    src = skip if skip is not None else x
    n, h, w = src.shape[:3]
    cin, cout = pw_w.shape
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    out = np.empty((n, ho, wo, cout), dtype=np.float32)

    def run(task: tuple[int, int, int]) -> None:
        i, r0, r1 = task
        xp = band_input(x[i], None if skip is None else skip[i], r0, r1, stride, dilation)
        y = np.empty((r1 - r0, wo, cin), dtype=np.float32)
        dw_rows(xp, dw_w, dw_b, stride, dilation, y)
        np.maximum(y, 0.0, out=y)
        o = out[i, r0:r1].reshape(-1, cout)
        np.matmul(y.reshape(-1, cin), pw_w, out=o)
        o += pw_b
        if residual:
            o += x[i, r0:r1].reshape(-1, cout)
        np.maximum(o, 0.0, out=o)

    list(_POOL.map(run, bands(n, ho, wo * cin * 4)))
    return out

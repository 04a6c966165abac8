"""The CPU backend's schedule for a DS block: fused per band of rows, bands over threads.

Op by op (``dwconv3x3_ref`` then ``pwconv_ref``), every intermediate of a block at H/2 is
tens of MB: each of the nine depthwise taps and the pointwise epilogue stream it through
memory again. Here a block runs band by band instead — a band is a few output rows of one
image, sized so its depthwise result (``BAND_BYTES``) stays in the core's L2 cache:

```
for each band (i, rows r0..r1), in parallel over a thread pool:
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


def pad_input(x: np.ndarray, d: int) -> np.ndarray:
    """``x`` ``[N, H, W, C]`` zero-padded by ``d`` on every side."""
    n, h, w, c = x.shape
    xp = np.zeros((n, h + 2 * d, w + 2 * d, c), dtype=np.float32)
    xp[:, d : d + h, d : d + w, :] = x
    return xp


def dw_rows(
    xp: np.ndarray,  # [Hp, Wp, C] one padded image
    w: np.ndarray,  # [3, 3, C]
    b: np.ndarray,  # [C]
    stride: int,
    d: int,
    r0: int,
    r1: int,
    wo: int,
    out: np.ndarray,  # [r1 - r0, wo, C], written
) -> None:
    """Output rows ``r0..r1`` of the depthwise conv (no activation) into ``out``."""
    out[...] = b
    tmp = np.empty_like(out)
    s = stride
    for ky in range(3):
        for kx in range(3):
            tap = xp[
                d * ky + s * r0 : d * ky + s * (r1 - 1) + 1 : s,
                d * kx : d * kx + s * (wo - 1) + 1 : s,
            ]
            np.multiply(tap, w[ky, kx], out=tmp)
            out += tmp


def bands(n: int, rows: int, row_bytes: int) -> list[tuple[int, int, int]]:
    """``(image, r0, r1)`` tasks covering ``n`` images of ``rows`` rows."""
    per = max(1, BAND_BYTES // max(row_bytes, 1))
    return [(i, r0, min(r0 + per, rows)) for i in range(n) for r0 in range(0, rows, per)]


def ds_block_cpu(
    x: np.ndarray,  # [N, H, W, Cin] float32
    dw_w: np.ndarray,  # [3, 3, Cin]
    dw_b: np.ndarray,  # [Cin]
    pw_w: np.ndarray,  # [Cin, Cout]
    pw_b: np.ndarray,  # [Cout]
    stride: int,
    dilation: int,
    residual: bool,
) -> np.ndarray:  # [N, Ho, Wo, Cout] float32
    """``relu(pwconv(relu(dwconv3x3(x)), + x if residual))`` band by band."""
    n, h, w, cin = x.shape
    cout = pw_w.shape[1]
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    xp = pad_input(x, dilation)
    out = np.empty((n, ho, wo, cout), dtype=np.float32)

    def run(task: tuple[int, int, int]) -> None:
        i, r0, r1 = task
        y = np.empty((r1 - r0, wo, cin), dtype=np.float32)
        dw_rows(xp[i], dw_w, dw_b, stride, dilation, r0, r1, wo, y)
        np.maximum(y, 0.0, out=y)
        o = out[i, r0:r1].reshape(-1, cout)
        np.matmul(y.reshape(-1, cin), pw_w, out=o)
        o += pw_b
        if residual:
            o += x[i, r0:r1].reshape(-1, cout)
        np.maximum(o, 0.0, out=o)

    list(_POOL.map(run, bands(n, ho, wo * cin * 4)))
    return out

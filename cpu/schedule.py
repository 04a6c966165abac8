"""The CPU backend's schedule: each layer fused per band of rows, bands over threads.

Op by op (``dwconv3x3_ref`` then ``pwconv_ref``), every intermediate of a block at H/2 is
tens of MB and each of the nine depthwise taps streams it through memory again. Here a block
runs band by band instead — a band is a run of output rows of one image (``BAND_BYTES`` of
depthwise result, so it stays in cache; the bands of a layer are split evenly over the
cores, :mod:`scratchd.cpu.bands` runs them):

```
for each band (i, rows r0..r1), on the calling thread and the pool's threads:
    y = relu(dw_b + dwconv3x3(x[i]))[r0:r1]      # _cpu.dwconv3x3: one pass, [R, Wo, Cin]
    o = out[i, r0:r1] = y @ pw_w                 # BLAS (numpy matmul), written once
    o = relu(o + pw_b (+ x[i, r0:r1]))           # _cpu.bias_relu: one pass, in place
```

The band kernels are C (``cpu/_cpu.c``, ``_cpu_kernels.h``: zero padding never
materialised, channels vectorised, the GIL released); the pointwise convolutions stay BLAS.
The depthwise kernel adds the taps in the reference's order and rounding, so ``y`` equals
``dwconv3x3_ref``'s rows exactly; only BLAS's summation order differs from ``pwconv_ref``
(float32 rounding, well under 1e-5; ``tests/model/test_net.py`` checks the network).

Decoder blocks never build ``upsample_concat``'s tensor: ``_cpu.dwconv3x3_join`` reads the
low-resolution input and the skip directly. A 3x3 tap on a nearest-2x-upsampled image
reads, for output row ``2i + a``, low-res rows ``i - 1, i, i`` (``a = 0``) or
``i, i, i + 1`` (``a = 1``): each of the four output phases ``(a, b)`` of the upsampled
channels is a 2x2 convolution at low resolution with summed weights (4 taps instead of 9;
float32 rounding of the sums differs from the reference's order). The skip's channels are
a plain 3x3; both land in one ``[R, Wo, C1 + C2]`` band and one matmul with ``pw_w``.
(The pointwise conv itself cannot move to low resolution: the depthwise conv and ReLU sit
between the upsampling and it.)

The stem (one input channel, stride 2) is ``_cpu.stem3x3``, direct. The head upsamples with
``_cpu.bilinear2x`` (the reference's float32 operations, so bit for bit) and applies
``sigmoid_ref`` band by band.

Where the time goes (``scripts/bench_cpu.py --profile`` times each layer; docs/benchmarks.md,
CPU forward): mostly the pointwise matmuls, at OpenBLAS's peak, then the depthwise kernels;
stem, epilogues and head are small. What is not arithmetic: each layer hands bands to the
pool (a thread wake-up), and every Python call between the kernels holds the GIL, so bands
are large (2 MB, and
at least one per core: a 200x200 frame's layers are one band per core, but for the shipped
model's widest, ``dec0.0``'s 144 channels at H/2, two).
"""

from __future__ import annotations

import numpy as np

from scratchd.cpu import _cpu
from scratchd.cpu.bands import (
    THREADS,
    Task,
    Workspace,
    available,
    run_bands,
    scratch,
    single_threaded_blas,
    workspace,
)
from scratchd.kernels.sigmoid import sigmoid_ref

__all__ = [
    "BAND_BYTES",
    "MIN_BAND_BYTES",
    "available",
    "bands",
    "ds_block_cpu",
    "prob_head_cpu",
    "single_threaded_blas",
    "stem_cpu",
    "workspace",
]

BAND_BYTES = 2 * 1024 * 1024
MIN_BAND_BYTES = 64 * 1024  # smaller bands cost more in hand-over than their rows do


def bands(n: int, rows: int, row_bytes: int) -> list[Task]:
    """``(image, r0, r1)`` tasks covering ``n`` images of ``rows`` rows: per image about
    ``BAND_BYTES`` each and at least one per pool thread (so a lone frame keeps every core
    busy), but none under ``MIN_BAND_BYTES`` where the image has that many.

    An image's bands depend on the image alone, not on ``n``: BLAS rounds a band's matmul
    by the band's size, so a frame's result is the same bit for bit whether it came alone
    or in a batch (the daemon batches by timing)."""
    k = max(1, -(-rows * row_bytes // BAND_BYTES), THREADS)
    per = max(-(-rows // k), min(rows, -(-MIN_BAND_BYTES // max(1, row_bytes))))
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
    ws: Workspace | None = None,  # where the output comes from (default: a new array)
) -> np.ndarray:  # [N, Ho, Wo, Cout] float32
    """``relu(pwconv(relu(dwconv3x3(join(x, skip))), + x if residual))`` band by band."""
    x, dw_w, dw_b, pw_w, pw_b = map(np.ascontiguousarray, (x, dw_w, dw_b, pw_w, pw_b))
    n, h, w, cin = x.shape
    if skip is not None:
        skip = np.ascontiguousarray(skip)
        ho, wo, cin = skip.shape[1], skip.shape[2], cin + skip.shape[3]
    else:
        ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    cout = pw_w.shape[1]
    out = (ws or Workspace(limit=0)).take((n, ho, wo, cout))

    def run(task: Task) -> None:
        i, r0, r1 = task
        y = scratch("y", (r1 - r0, wo, cin))
        if skip is None:
            _cpu.dwconv3x3(x[i], dw_w, dw_b, y, r0, stride, dilation)
        else:
            _cpu.dwconv3x3_join(x[i], skip[i], dw_w, dw_b, y, r0)
        o = out[i, r0:r1].reshape(-1, cout)
        np.matmul(y.reshape(-1, cin), pw_w, out=o)
        _cpu.bias_relu(o, pw_b, x[i, r0:r1].reshape(-1, cout) if residual else None)

    run_bands(run, bands(n, ho, wo * cin * 4))
    return out


def stem_cpu(
    x: np.ndarray,  # [N, H, W, 1] float32
    w: np.ndarray,  # [3, 3, 1, Cout]
    b: np.ndarray,  # [Cout]
    ws: Workspace | None = None,
) -> np.ndarray:  # [N, Ho, Wo, Cout]: conv3x3_ref(x, w, b, stride=2, act="relu")
    """The stride-2 stem convolution (one input channel) band by band, direct."""
    x, b = np.ascontiguousarray(x), np.ascontiguousarray(b)
    n, h, wd, _ = x.shape
    cout = w.shape[3]
    ho, wo = (h - 1) // 2 + 1, (wd - 1) // 2 + 1
    wm = np.ascontiguousarray(w.reshape(9, cout))
    out = (ws or Workspace(limit=0)).take((n, ho, wo, cout))

    def run(task: Task) -> None:
        i, r0, r1 = task
        _cpu.stem3x3(x[i, :, :, 0], wm, b, out[i, r0:r1], r0)

    run_bands(run, bands(n, ho, wo * cout * 4))
    return out


def prob_head_cpu(
    logits: np.ndarray,  # [N, h, w, 1] float32
    height: int,
    width: int,
) -> np.ndarray:  # [N, height, width]: prob_head_ref(logits, height, width), bit for bit
    """Bilinear 2x upsampling and crop (``_cpu.bilinear2x``, the reference's exact float32
    operations) then ``sigmoid_ref``, band by band over the output rows."""
    logits = np.ascontiguousarray(logits)
    n = logits.shape[0]
    out = np.empty((n, height, width), dtype=np.float32)

    def run(task: Task) -> None:
        i, r0, r1 = task
        up = scratch("up", (r1 - r0, width))
        _cpu.bilinear2x(logits[i, :, :, 0], up, r0)
        out[i, r0:r1] = sigmoid_ref(up)

    run_bands(run, bands(n, height, width * 32))  # sigmoid_ref's temporaries: ~8 per pixel
    return out

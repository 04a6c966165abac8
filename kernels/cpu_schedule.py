"""The CPU backend's schedule: each layer fused per band of rows, bands over threads.

Op by op (``dwconv3x3_ref`` then ``pwconv_ref``), every intermediate of a block at H/2 is
tens of MB and each of the nine depthwise taps streams it through memory again. Here a block
runs band by band instead — a band is a run of output rows of one image (``BAND_BYTES`` of
depthwise result, so it stays in the shared L3 cache; the bands of a layer are split evenly
over the cores):

```
for each band (i, rows r0..r1), on the calling thread and the pool's threads:
    y   = x(centre tap) * w[1, 1]                          # [R, Wo, Cin], in cache
    y  += x(tap) * w[ky, kx] for the 8 other taps          # on the unpadded input: each tap
                                                           #   covers the rows/cols it reaches
    y   = max(y, -dw_b)                                    # = relu(y + dw_b) - dw_b
    out[i, r0:r1] = y @ pw_w                               # BLAS, written once
    out[i, r0:r1] = relu(out + (pw_b + dw_b @ pw_w) (+ residual rows))
```

Exact rewrites of ``pwconv_ref(dwconv3x3_ref(x, ...), ...)`` used here (only float32
rounding differs, well under 1e-5; ``tests/kernels/test_net.py`` checks the whole network):

- zero padding is never materialised: a tap only adds into the output pixels whose input
  pixel lies inside the image (the padded zeros would add nothing);
- the depthwise bias moves through the ReLU into the pointwise bias:
  ``relu(y + b) @ W = max(y, -b) @ W + b @ W`` (one pass over ``y`` instead of two);
- stride 2: the band's input rows are copied once as even and odd columns, so that every
  tap reads contiguous pixels (input column ``2c + o`` is column ``c + o // 2`` of phase
  ``o % 2``) — numpy's loops over one pixel's channels at a time were 3x slower;
- decoder blocks never build ``upsample_concat``'s tensor. Their depthwise weights split
  into the upsampled part and the skip part (and so does ``pw_w = [W_up; W_skip]``). A 3x3
  tap on a nearest-2x-upsampled image reads, for output row ``2i + a``, low-res rows
  ``i - 1, i, i`` (``a = 0``) or ``i, i, i + 1`` (``a = 1``): each of the four output phases
  ``(a, b)`` is a 2x2 convolution AT LOW RESOLUTION with summed weights (4 taps on a quarter
  of the pixels instead of 9 on all). The phases are kept phase-major
  ``[2, 2, R/2, W/2, C1]`` so every op is contiguous; BLAS writes each phase's matmul with
  ``W_up`` straight into a strided view of the output that interleaves the phases (its row
  stride is ``2 * Cout``: no phase-major temporary, no strided add), and the skip part's
  ``y_skip @ W_skip`` is added by the epilogue like a residual.
  (The pointwise conv itself cannot move to low resolution: the depthwise conv and ReLU
  sit between the upsampling and it, and the phases differ.)

Costs that are not arithmetic: every ufunc call costs about 1-2 us and holds the GIL that
long, so bands are large (2 MB; per-band tap slices are cached in ``_PLANS``, a layer's
tiled weights in ``_CACHE``; a band also streams its layer's tiled weights, another
reason for tall bands); a fresh large array page-faults on first write, so layer outputs
come from a per-thread :class:`Workspace` that the forward recycles, and band temporaries
from per-thread :func:`scratch` buffers (each thread keeps a few band-sized buffers).

numpy's ufuncs and BLAS release the GIL, so the bands of one layer run on all cores — but
OpenBLAS would also start its own threads for every band's matmul and fight ours for the
cores, so the network runs under :func:`single_threaded_blas` (threadpoolctl; it caps BLAS
threads process-wide for the duration of a forward). Without threadpoolctl, :func:`available`
is False and the network runs op by op. Per-channel vectors are tiled along the row
(``[Wo, C]``) so that every ufunc call runs one long contiguous inner loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from scratchd.kernels.sigmoid import sigmoid_ref

try:
    from threadpoolctl import ThreadpoolController
except ImportError:  # pragma: no cover - optional: the GPU image need not have it
    ThreadpoolController = None

BAND_BYTES = 2 * 1024 * 1024
_THREADS = os.cpu_count() or 1
_POOL = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="scratchd-cpu")
_CONTROLLER: Any = None
_CACHE: dict[tuple[int, ...], tuple[tuple[np.ndarray, ...], Any]] = {}
_PLANS: dict[tuple[int, ...], tuple[list[Any], list[Any]]] = {}

Tap = tuple[int, int, int, np.ndarray]  # (source, row offset, col offset, weight [Wo, C])


class Workspace:
    """Layer outputs recycled from one forward to the next (per thread; see :func:`workspace`).

    A fresh 50 MB ``np.empty`` is a fresh ``mmap``: its first write page-faults every 4 KB
    (about 4 ms per 50 MB here, a tenth of a 1024x1024 forward over all layers). The forward
    hands each activation back once no later layer reads it, and the next layer (or the next
    forward) of that shape takes it again. At most ``limit`` bytes are kept."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.limit = limit
        self.kept = 0
        self.free: dict[tuple[int, ...], list[np.ndarray]] = {}

    def take(self, shape: tuple[int, ...]) -> np.ndarray:  # float32, contents undefined
        stack = self.free.get(shape)
        if stack:
            arr = stack.pop()
            self.kept -= arr.nbytes
            return arr
        return np.empty(shape, dtype=np.float32)

    def give(self, arr: np.ndarray) -> None:
        if self.kept + arr.nbytes <= self.limit:
            self.free.setdefault(arr.shape, []).append(arr)
            self.kept += arr.nbytes


_LOCAL = threading.local()


def workspace() -> Workspace:
    """The calling thread's :class:`Workspace` (forwards on other threads never share it)."""
    ws: Workspace | None = getattr(_LOCAL, "ws", None)
    if ws is None:
        ws = _LOCAL.ws = Workspace()
    return ws


def scratch(tag: str, shape: tuple[int, ...]) -> np.ndarray:  # float32, contents undefined
    """A band temporary: a view of the calling thread's buffer ``tag``, grown when too small
    and reused by every later band (a fresh array per band page-faulted: at 200x200 a quarter
    of the CPU time went to the kernel)."""
    bufs: dict[str, np.ndarray] | None = getattr(_LOCAL, "scratch", None)
    if bufs is None:
        bufs = _LOCAL.scratch = {}
    size = math.prod(shape)
    buf = bufs.get(tag)
    if buf is None or buf.size < size:
        buf = bufs[tag] = np.empty(size, dtype=np.float32)
    return buf[:size].reshape(shape)


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


def run_bands(
    fn: Callable[[tuple[int, int, int]], None], tasks: list[tuple[int, int, int]]
) -> None:
    """Run ``fn`` on every ``(image, r0, r1)`` task: the calling thread and up to
    ``threads - 1`` pool threads take the next task until none is left."""
    todo = iter(tasks)

    def drain() -> None:
        for task in todo:  # a list iterator hands each task to exactly one thread
            fn(task)

    helpers = [_POOL.submit(drain) for _ in range(min(_THREADS, len(tasks)) - 1)]
    try:
        drain()
    finally:
        for f in helpers:
            f.result()


def bands(n: int, rows: int, row_bytes: int, step: int = 1) -> list[tuple[int, int, int]]:
    """``(image, r0, r1)`` tasks covering ``n`` images of ``rows`` rows: about
    ``BAND_BYTES`` each, their number a multiple of the pool's threads where rows allow (so
    every core gets an equal share); ``r0`` is a multiple of ``step``."""
    total = n * rows * row_bytes
    k = max(1, -(-total // BAND_BYTES), _THREADS)
    k = -(-k // _THREADS) * _THREADS
    per_image = -(-k // n)
    per = -(-rows // per_image)
    per = max(step, -(-per // step) * step)
    return [(i, r0, min(r0 + per, rows)) for i in range(n) for r0 in range(0, rows, per)]


def cached(arrays: tuple[np.ndarray, ...], key: tuple[int, ...], make: Callable[[], Any]) -> Any:
    """``make()``, memoised per layer (the weight arrays, by identity) and ``key`` (widths):
    the tiled weights of a layer are built once per frame width, not once per forward."""
    full = (*map(id, arrays), *key)
    hit = _CACHE.get(full)
    if hit is not None and all(a is b for a, b in zip(hit[0], arrays, strict=True)):
        return hit[1]
    if len(_CACHE) >= 64:
        _CACHE.clear()
    value = make()
    _CACHE[full] = (arrays, value)
    return value


def tiled(v: np.ndarray, width: int) -> np.ndarray:  # [..., C] → [..., width, C] contiguous
    """A per-channel vector repeated along a row of ``width`` pixels."""
    return np.ascontiguousarray(
        np.broadcast_to(v[..., None, :], (*v.shape[:-1], width, v.shape[-1]))
    )


def _reach(r0: int, r1: int, n_in: int, s: int, off: int) -> tuple[int, int]:
    """Output indices ``r0 <= y < r1`` whose input index ``s*y + off`` is inside ``[0, n_in)``."""
    lo = max(r0, -(off // s) if off < 0 else 0)
    hi = min(r1, (n_in - 1 - off) // s + 1 if n_in - 1 - off >= 0 else 0)
    return lo, hi


def conv_taps(
    srcs: list[np.ndarray],  # [rows, Wk, C] input rows row0.. of an image (its column phases)
    row0: int,
    h: int,  # the image's height (rows past it are zero padding)
    taps: list[Tap],  # taps[0] has offsets (0, 0): it covers every output pixel
    s: int,  # row stride
    r0: int,
    y: np.ndarray,  # [R, Wo, C], written: rows r0..r0+R of sum_t src_k[s*r + oy, c + ox] * w_t
    tmp: np.ndarray,  # [R, Wo, C] scratch
) -> None:
    """A depthwise convolution of one band as shifted multiply-adds; zeros outside the image."""
    rows, wo = y.shape[:2]
    key = (id(taps), row0, h, s, r0, rows, wo, *(x.shape[1] for x in srcs))
    plan = _PLANS.get(key)
    if plan is None or plan[0] is not taps:
        plan = (taps, tap_plan(taps, row0, h, s, r0, rows, wo, [x.shape[1] for x in srcs]))
        if len(_PLANS) >= 4096:
            _PLANS.clear()
        _PLANS[key] = plan
    (k0, src0, w0, _), *rest = plan[1]
    np.multiply(srcs[k0][src0], w0, out=y)
    for k, src, wt, dst in rest:
        t = tmp[dst]
        np.multiply(srcs[k][src], wt, out=t)
        np.add(y[dst], t, out=y[dst])


Slices = tuple[slice, slice]


def tap_plan(
    taps: list[Tap], row0: int, h: int, s: int, r0: int, rows: int, wo: int, widths: list[int]
) -> list[tuple[int, Slices, np.ndarray, Slices]]:
    """Per tap of one band: (source, its slice, the weight's columns, the output's slice);
    taps that reach no pixel of the band are left out."""
    plan = []
    for i, (k, oy, ox, wt) in enumerate(taps):
        a, b = _reach(r0, r0 + rows, h, s, oy)
        c, e = _reach(0, wo, widths[k], 1, ox)
        if i > 0 and (a >= b or c >= e):
            continue
        src = (slice(s * a + oy - row0, s * (b - 1) + oy - row0 + 1, s), slice(c + ox, e + ox))
        plan.append((k, src, wt[c:e], (slice(a - r0, b - r0), slice(c, e))))
    return plan


def dw_taps(w: np.ndarray, d: int, s: int, wo: int) -> list[Tap]:
    """The nine taps of a depthwise 3x3 (dilation ``d``), centre first. With stride 2 the
    input's columns come split into even and odd ones (source 0 and 1): input column
    ``2c + o`` is column ``c + o // 2`` of source ``o % 2``."""
    order = [(1, 1)] + [(ky, kx) for ky in range(3) for kx in range(3) if (ky, kx) != (1, 1)]
    wt = tiled(w, wo)  # [3, 3, Wo, C]
    taps: list[Tap] = []
    for ky, kx in order:
        ox = d * (kx - 1)
        src, ox = (0, ox) if s == 1 else (ox % 2, ox // 2)
        taps.append((src, d * (ky - 1), ox, wt[ky, kx]))
    return taps


# Nearest-2x-upsampled 3x3 taps for output parity a: (low-res offset, the ky that land there).
_PHASE = {0: ((0, (1, 2)), (-1, (0,))), 1: ((0, (0, 1)), (1, (2,)))}


def phase_taps(w: np.ndarray, a: int, b: int, wo: int) -> list[Tap]:
    """The 2x2 low-res taps giving output phase ``(a, b)`` of a 3x3 depthwise conv on the
    nearest-2x-upsampled input (offset-0 tap first)."""
    taps: list[Tap] = []
    for oy, kys in _PHASE[a]:
        for ox, kxs in _PHASE[b]:
            wsum = np.asarray(w[np.ix_(kys, kxs)].sum(axis=(0, 1)), dtype=np.float32)
            taps.append((0, oy, ox, tiled(wsum, wo)))
    return taps


def epilogue(o: np.ndarray, bias: np.ndarray, res: np.ndarray | None) -> None:
    """``o = relu(o + bias (+ res))`` in place; ``o`` is ``[R, Wo, Cout]``, bias tiled."""
    np.add(o, bias, out=o)
    if res is not None:
        np.add(o, res, out=o)
    np.maximum(o, 0.0, out=o)


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
    ws = ws or Workspace(limit=0)
    if skip is not None:
        return _join_block(x, skip, dw_w, dw_b, pw_w, pw_b, ws)
    n, h, w, cin = x.shape
    cout = pw_w.shape[1]
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    out = ws.take((n, ho, wo, cout))
    taps, neg_b, bias = cached(
        (dw_w, dw_b, pw_w, pw_b),
        (dilation, wo),
        lambda: (
            dw_taps(dw_w, dilation, stride, wo),
            tiled(-dw_b, wo),
            tiled(pw_b + dw_b @ pw_w, wo),
        ),
    )

    def run(task: tuple[int, int, int]) -> None:
        i, r0, r1 = task
        y = scratch("y", (r1 - r0, wo, cin))
        if stride == 1:
            srcs, row0 = [x[i]], 0
        else:  # even and odd columns apart, so that every tap reads contiguous pixels
            row0, hi = max(0, 2 * r0 - dilation), min(h, 2 * r1 - 2 + dilation + 1)
            srcs = []
            for p in (0, 1):
                src = x[i, row0:hi, p::2]
                srcs.append(scratch(f"src{p}", src.shape))
                np.copyto(srcs[p], src)
        conv_taps(srcs, row0, h, taps, stride, r0, y, scratch("tmp", y.shape))
        np.maximum(y, neg_b, out=y)
        o = out[i, r0:r1]
        np.matmul(y.reshape(-1, cin), pw_w, out=o.reshape(-1, cout))
        epilogue(o, bias, x[i, r0:r1] if residual else None)

    run_bands(run, bands(n, ho, wo * cin * 4))
    return out


def _join_block(
    x: np.ndarray,  # [N, h, w, C1] the decoder input (upsampled 2x by the join)
    skip: np.ndarray,  # [N, 2h, 2w, C2]
    dw_w: np.ndarray,  # [3, 3, C1 + C2]
    dw_b: np.ndarray,  # [C1 + C2]
    pw_w: np.ndarray,  # [C1 + C2, Cout]
    pw_b: np.ndarray,  # [Cout]
    ws: Workspace,
) -> np.ndarray:  # [N, 2h, 2w, Cout]
    """A decoder block on ``upsample_concat(x, skip)`` without building it (module doc)."""
    n, _h, w, c1 = x.shape
    c2, cout = skip.shape[3], pw_w.shape[1]
    ho, wo = skip.shape[1], skip.shape[2]
    out = ws.take((n, ho, wo, cout))
    phases, skip_taps, neg_up, neg_skip, w_up, w_skip, bias = cached(
        (dw_w, dw_b, pw_w, pw_b),
        (c1, w),
        lambda: (
            [phase_taps(dw_w[..., :c1], a, b, w) for a in (0, 1) for b in (0, 1)],
            dw_taps(dw_w[..., c1:], 1, 1, wo),
            tiled(-dw_b[:c1], w),
            tiled(-dw_b[c1:], wo),
            np.ascontiguousarray(pw_w[:c1]),
            np.ascontiguousarray(pw_w[c1:]),
            tiled(pw_b + dw_b @ pw_w, wo),
        ),
    )

    def run(task: tuple[int, int, int]) -> None:
        i, r0, r1 = task
        rows = r1 - r0  # even: bands start on even rows and ho = 2h
        y = scratch("y", (rows, wo, c2))
        conv_taps([skip[i]], 0, ho, skip_taps, 1, r0, y, scratch("tmp", y.shape))
        np.maximum(y, neg_skip, out=y)
        t = scratch("up", (rows, wo, cout))
        np.matmul(y.reshape(-1, c2), w_skip, out=t.reshape(-1, cout))
        p = scratch("phases", (4, rows // 2, w, c1))  # phase-major (a, b)
        tmp = scratch("tmp", p.shape[1:])
        for k, taps in enumerate(phases):
            conv_taps([x[i]], 0, x.shape[1], taps, 1, r0 // 2, p[k], tmp)
        np.maximum(p, neg_up, out=p)
        o = out[i, r0:r1]
        o5 = o.reshape(rows // 2, 2, w, 2, cout)  # [i, a, j, b] = output pixel (2i+a, 2j+b)
        for k in range(4):  # BLAS writes each phase's rows straight into the strided view
            np.matmul(p[k], w_up, out=o5[:, k // 2, :, k % 2])
        epilogue(o, bias, t)

    run_bands(run, bands(n, ho, wo * (c1 + c2) * 4, step=2))
    return out


def stem_cpu(
    x: np.ndarray,  # [N, H, W, 1] float32
    w: np.ndarray,  # [3, 3, 1, Cout]
    b: np.ndarray,  # [Cout]
    ws: Workspace | None = None,
) -> np.ndarray:  # [N, Ho, Wo, Cout]: conv3x3_ref(x, w, b, stride=2, act="relu")
    """The stride-2 stem convolution (one input channel) band by band: im2col + matmul."""
    n, h, wd, _ = x.shape
    cout = w.shape[3]
    ho, wo = (h - 1) // 2 + 1, (wd - 1) // 2 + 1
    xp = scratch("stem", (n, h + 2, wd + 2))  # zero-padded by one pixel
    xp[:, [0, -1]] = 0.0
    xp[:, :, [0, -1]] = 0.0
    xp[:, 1:-1, 1:-1] = x[..., 0]
    # Padded column 2c + kx is column c + kx // 2 of the even (kx even) or odd columns.
    phases = [scratch(f"stem{p}", xp[:, :, p::2].shape) for p in (0, 1)]
    for p in (0, 1):
        np.copyto(phases[p], xp[:, :, p::2])
    wm = w.reshape(9, cout)
    bias = tiled(b, wo)
    out = (ws or Workspace(limit=0)).take((n, ho, wo, cout))

    def run(task: tuple[int, int, int]) -> None:
        i, r0, r1 = task
        cols = scratch("cols", (9, r1 - r0, wo))  # tap-major: contiguous copies
        for ky in range(3):
            for kx in range(3):
                src = phases[kx % 2][i, 2 * r0 + ky : 2 * (r1 - 1) + ky + 1 : 2]
                cols[ky * 3 + kx] = src[:, kx // 2 : kx // 2 + wo]
        o = out[i, r0:r1]
        np.matmul(cols.reshape(9, -1).T, wm, out=o.reshape(-1, cout))
        epilogue(o, bias, None)

    run_bands(run, bands(n, ho, wo * cout * 4))
    return out


def prob_head_cpu(
    logits: np.ndarray,  # [N, h, w, 1] float32
    height: int,
    width: int,
) -> np.ndarray:  # [N, height, width]: prob_head_ref(logits, height, width)
    """Bilinear 2x upsampling, crop and sigmoid, band by band over the logit rows."""
    n, h, w, _ = logits.shape
    lg = logits[..., 0]
    out = np.empty((n, height, width), dtype=np.float32)
    q, three = np.float32(0.25), np.float32(0.75)

    def twice(src: np.ndarray, prev: np.ndarray, nxt: np.ndarray, axis: int) -> np.ndarray:
        up = np.empty((*src.shape[:axis], src.shape[axis], 2, *src.shape[axis + 1 :]), np.float32)
        even, odd = np.moveaxis(up, axis + 1, 0)  # out[2i] and out[2i + 1]
        np.multiply(src, three, out=even)
        even += q * prev
        np.multiply(src, three, out=odd)
        odd += q * nxt
        return up.reshape(*src.shape[:axis], 2 * src.shape[axis], *src.shape[axis + 1 :])

    def run(task: tuple[int, int, int]) -> None:
        i, a, b = task  # logit rows a..b give output rows 2a..2b
        idx = np.arange(a, b)
        rows = twice(
            lg[i, a:b], lg[i, np.maximum(idx - 1, 0)], lg[i, np.minimum(idx + 1, h - 1)], 0
        )
        cols = np.arange(w)
        up = twice(rows, rows[:, np.maximum(cols - 1, 0)], rows[:, np.minimum(cols + 1, w - 1)], 1)
        top, bottom = 2 * a, min(2 * b, height)
        out[i, top:bottom] = sigmoid_ref(np.ascontiguousarray(up[: bottom - top, :width]))

    run_bands(run, bands(n, (height + 1) // 2, w * 64))
    return out

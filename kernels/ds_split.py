"""``ds_split``: a depthwise-separable block as two launches, for the wide blocks.

The same op as :func:`scratchd.kernels.ds_block.ds_block_ref` (its reference) without the
head: ``ds_split.cu`` runs the depthwise stage (``dw_stage``: the decoder join read on the
fly, bias, ReLU; the fused kernel's own code and schedule, ``dw_group.cuh`` and
``ds_block.dw_schedule``) into a scratch tensor, then a tiled tensor-core GEMM (``pw_gemm``: bias,
residual, ReLU in the epilogue). The fused ``ds_block.cu`` keeps the whole pointwise weight in
shared memory; for 384 channels that is one 4-warp block per SM with its depthwise, GEMM and
epilogue phases in series, and those blocks run far below the copy rate (docs/benchmarks.md).
Here the GEMM streams k slices of both operands through a ring of shared buffers (111 KB a
block at the default 64-channel steps and 3 stages), so two blocks run per SM; the cost is
one write and one read of the depthwise output, small at the resolutions where the wide
blocks live. Measured per block in ``scripts/bench_ds_split.py`` (docs/bench/ds-split.json).

``ds_tiled`` (:func:`ds_tiled_cuda`) is the third path: one launch on the GEMM's tiling
whose A tiles are computed by the depthwise stage instead of loaded (no scratch; the head
can be fused too), at the price of recomputing the depthwise work per column tile.

All kernels round and sum exactly as the fused kernel does (fp16 depthwise output, fp32
products in ascending k, ``half(acc + bias)`` before the residual, the head's dot product in
its order), so these paths and the fourth, ``ds_halo`` (``ds_halo.py``), give the same bits.
:func:`block_path` is the plan's choice among the four (``SCRATCHD_DS_SPLIT`` overrides it
for benchmarks); :func:`split_shape_ok`, :func:`tiled_shape_ok` and ``halo_shape_ok`` say
whether a path has tiles for a block.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import env_choice
from scratchd.kernels._cuda import GEMM_BM, GEMM_THREADS
from scratchd.kernels.ds_block import check_block, dw_schedule, dw_smem_bytes
from scratchd.kernels.ds_halo import halo_shape_ok

# The path of each block: "auto" (block_path's rule), "none" (all fused), "all" (all split),
# "tiled" (all tiled) or "halo" (all ds_halo), wherever the path has tiles for the block.
SPLIT_ENV = "SCRATCHD_DS_SPLIT"
BlockPath = Literal["fused", "split", "tiled", "halo"]
GEMM_ENV = "SCRATCHD_DS_GEMM"  # "BK:STAGES" of pw_gemm, e.g. "32:3" (benchmarks compare them)
DEFAULT_GEMM = "64:3"  # the fastest on the H200 (scripts/bench_ds_split.py)
# The rule: split where the pointwise GEMM is at least this many MACs per pixel (the
# shipped model's enc3.* blocks and dec2.0; see docs/benchmarks.md for the measurements).
SPLIT_MIN_MACS = 192 * 384
JOIN_SPLIT_MIN_MACS = 288 * 96  # a decoder join this wide splits (dec2.0; dec1.0 runs halo)
HALO_MAX_CIN = 288  # stride-1 blocks up to dec1.0's 288 channels run on ds_halo, ...
TILED_MAX_CIN = 64  # ... and the other narrow stride-1 blocks tiled (see block_path)


def split_shape_ok(cin: int, cout: int) -> bool:
    """Whether ``pw_gemm`` has tiles for ``cin -> cout`` (both multiples of 16)."""
    return cin % 16 == 0 and cout % 16 == 0


def tiled_shape_ok(ca: int, cb: int, cout: int, head: bool) -> bool:
    """Whether ``ds_tiled`` has tiles for the block (8-channel groups, k16 steps; with the
    head, every output channel in one column tile)."""
    cin = ca + cb
    ok = ca % 8 == 0 and cb % 8 == 0 and cin % 16 == 0 and cout % 16 == 0
    return ok and (not head or tiled_bn(cout) == cout)


def tiled_bn(cout: int) -> int:
    """Column tile of ``ds_tiled``: at most 96 channels (its registers hold the depthwise
    group and the accumulators at once)."""
    return next(b for b in (96, 64, 48, 32, 16) if cout % b == 0)


def block_path(
    ca: int, cb: int, cout: int, head: bool = False, stride: int = 1, dilation: int = 1
) -> BlockPath:
    """How the forward runs a DS block: ``fused`` (ds_block.cu), ``split`` (dw_stage +
    pw_gemm), ``tiled`` (ds_tiled) or ``halo`` (ds_halo.cu).

    ``auto``, the fastest path per block of the shipped model on the H200
    (``scripts/bench_ds_split.py``; the per-block table is in docs/benchmarks.md, DS blocks):
    **halo** the stride-1, dilation-1 blocks of ≤ ``HALO_MAX_CIN`` channels that ``ds_halo``
    has tiles for (≤ 96 output channels: the shipped model's enc0.0, enc1.1, dec1.1, dec1.0,
    dec0.0 and dec0.1 with the head); **split** the other wide blocks (≥ ``SPLIT_MIN_MACS``
    pointwise MACs a pixel) and decoder joins (≥ ``JOIN_SPLIT_MIN_MACS``: dec2.0);
    **tiled** the other narrow stride-1 blocks of ≤ ``TILED_MAX_CIN`` channels (the shipped
    model has none left: halo took them); **fused** the rest (split, the scratch tensor's
    bytes cost more there than the shared GEMM saves)."""
    mode = env_choice(SPLIT_ENV, "auto", ("auto", "none", "all", "tiled", "halo"))
    cin = ca + cb
    can_split = not head and split_shape_ok(cin, cout)
    can_tile = tiled_shape_ok(ca, cb, cout, head)
    can_halo = halo_shape_ok(ca, cb, cout, stride, dilation)
    if mode == "none":
        return "fused"
    if mode == "halo":
        return "halo" if can_halo else "fused"
    if mode == "tiled":
        return "tiled" if can_tile else "fused"
    if mode == "all":
        return "split" if can_split else "fused"
    if can_halo and cin <= HALO_MAX_CIN:
        return "halo"
    if can_split and cin * cout >= (JOIN_SPLIT_MIN_MACS if cb > 0 else SPLIT_MIN_MACS):
        return "split"
    if can_tile and cb == 0 and stride == 1 and cin <= TILED_MAX_CIN:
        return "tiled"
    return "fused"


def gemm_tiles(k: int, cout: int) -> tuple[int, int, int]:
    """``(BN, BK, STAGES)`` of ``pw_gemm<K, COUT, BN, BK, STAGES, RES>``: the widest column
    tile dividing ``cout`` (more reuse of each A tile); the largest k step dividing ``k`` up
    to the configured one (``SCRATCHD_DS_GEMM``, default ``DEFAULT_GEMM``)."""
    want_bk, stages = gemm_config()
    bn = next(b for b in (128, 96, 64, 48, 32, 16) if cout % b == 0)
    return bn, k_step(k, want_bk), stages


def k_step(k: int, want_bk: int) -> int:
    """The largest k step (16-channel multiple) dividing ``k``, at most ``want_bk``."""
    return next(b for b in (64, 48, 32, 16) if b <= want_bk and k % b == 0)


def gemm_config() -> tuple[int, int]:
    """``(BK, STAGES)`` asked for by ``SCRATCHD_DS_GEMM`` (default ``DEFAULT_GEMM``)."""
    spec = os.environ.get(GEMM_ENV, DEFAULT_GEMM)
    try:
        want_bk, stages = (int(v) for v in spec.split(":"))
    except ValueError:
        raise ValueError(f"{GEMM_ENV} must be BK:STAGES, e.g. 32:3, got {spec!r}") from None
    if want_bk not in (16, 32, 48, 64) or not 2 <= stages <= 6:
        raise ValueError(f"{GEMM_ENV}: BK must be 16, 32, 48 or 64, STAGES 2..6, got {spec!r}")
    return want_bk, stages


def gemm_smem_bytes(bn: int, bk: int, stages: int) -> int:
    """Dynamic shared memory of one ``pw_gemm`` block: the ring of A and Wᵀ tiles."""
    return stages * (GEMM_BM + bn) * (bk + 8) * 2


def ds_split_cuda(
    x: Any,  # [N, H, W, CA] float16 (CuPy); with skip: [N, H/2, W/2, CA]
    dw_w: Any,  # [3, 3, CA + CB] float16
    dw_b: Any,  # [CA + CB] float32
    pw_wt: Any,  # [Cout, CA + CB] float16: the pointwise weight, TRANSPOSED
    pw_b: Any,  # [Cout] float32
    stride: int = 1,
    dilation: int = 1,
    skip: Any | None = None,  # [N, H, W, CB] float16
    residual: bool = False,
    *,
    scratch: Any,  # flat float16, at least N * Ho * Wo * (CA + CB) elements
    out: Any | None = None,  # [N, Ho, Wo, Cout] float16: written in place when given
) -> Any:  # [N, Ho, Wo, Cout] float16
    """CUDA twin of :func:`ds_block_ref` without the head, as two launches (``ds_split.cu``).
    ``scratch`` holds the depthwise output between them (a forward shares one buffer)."""
    op = "ds_split"
    c = check_block(
        op, x, skip, dw_w, dw_b, pw_wt, pw_b, stride=stride, dilation=dilation,
        residual=residual, head_w=None, head_b=None, out=out, transposed=True,
    )  # fmt: skip
    n, ca, cb, cout, out = c.n, c.ca, c.cb, c.cout, c.out
    height, width, ho, wo = c.height, c.width, c.ho, c.wo
    cin = c.cin
    if not split_shape_ok(cin, cout):
        raise ValueError(f"{op}: Cin and Cout must be multiples of 16, got {cin} -> {cout}")
    m = n * ho * wo
    cu.check_device_array(op, "scratch", scratch, ndim=1, dtype=np.float16)
    if scratch.size < m * cin:
        raise ValueError(f"{op}: scratch holds {scratch.size} halves, needs {m * cin}")
    mid = scratch[: m * cin]
    bn, bk, stages = gemm_tiles(cin, cout)
    smem = gemm_smem_bytes(bn, bk, stages)
    sweep, hoist = dw_schedule(cin, stride, wo)
    dw_smem = dw_smem_bytes(cin)
    dw_name = cu.template_name("dw_stage", ca, cb, stride, dilation, sweep, hoist)
    gemm_name = cu.template_name("pw_gemm", cin, cout, bn, bk, stages, residual)
    dw = cu.kernel("ds_split.cu", dw_name, [gemm_name])
    gemm = cu.kernel("ds_split.cu", gemm_name, [dw_name])
    cu.opt_in_smem(gemm, smem)
    groups = cin // 8 if ca % 8 == 0 and cb % 8 == 0 else cin
    items = m // sweep * groups
    cu.launch(
        dw, (cu.grid_size(items, 256),), (256,),
        (x, x if skip is None else skip, dw_w, dw_b, mid,
         *map(cu.i32, (n, height, width, ho, wo))), dw_smem,
    )  # fmt: skip
    cu.launch(
        gemm, (-(-m // GEMM_BM), cout // bn), (GEMM_THREADS,),
        (mid, pw_wt, pw_b, x if residual else mid, out, cu.i32(m)), smem,
    )  # fmt: skip
    return out


def tiled_sweep(stride: int, wo: int, bn: int) -> int:
    """P of ds_tiled's depthwise groups: 4 pixels of a row where the column tile is narrow,
    2 where the accumulators take more registers, 1 for stride 2 (like ``dw_schedule``)."""
    cap = 1 if stride != 1 else (4 if bn <= 48 else 2)
    return next(p for p in (4, 2, 1) if p <= cap and wo % p == 0)


def ds_tiled_cuda(
    x: Any,  # [N, H, W, CA] float16 (CuPy); with skip: [N, H/2, W/2, CA]
    dw_w: Any,  # [3, 3, CA + CB] float16
    dw_b: Any,  # [CA + CB] float32
    pw_wt: Any,  # [Cout, CA + CB] float16: the pointwise weight, TRANSPOSED
    pw_b: Any,  # [Cout] float32
    stride: int = 1,
    dilation: int = 1,
    skip: Any | None = None,  # [N, H, W, CB] float16
    residual: bool = False,
    head_w: Any | None = None,  # [Cout, 1] float32
    head_b: Any | None = None,  # [1] float32
    *,
    out: Any | None = None,  # the result's shape and dtype: written in place when given
) -> Any:  # [N, Ho, Wo, Cout] float16, or [N, Ho, Wo, 1] float32 with the head
    """CUDA twin of :func:`ds_block_ref` as one launch on ``pw_gemm``'s tiling
    (``ds_tiled`` in ``ds_split.cu``): the depthwise stage computed into the GEMM's A tiles."""
    op = "ds_tiled"
    c = check_block(
        op, x, skip, dw_w, dw_b, pw_wt, pw_b, stride=stride, dilation=dilation,
        residual=residual, head_w=head_w, head_b=head_b, out=out, transposed=True,
    )  # fmt: skip
    n, ca, cb, cout, out = c.n, c.ca, c.cb, c.cout, c.out
    height, width, ho, wo = c.height, c.width, c.ho, c.wo
    cin, head = c.cin, head_w is not None
    if not tiled_shape_ok(ca, cb, cout, head):
        raise ValueError(
            f"{op}: needs CA, CB multiples of 8, Cin and Cout of 16 (and Cout <= 96 with the"
            f" head), got {ca}+{cb} -> {cout}"
        )
    want_bk, stages = gemm_config()
    bn, bk = tiled_bn(cout), k_step(cin, want_bk)
    if GEMM_BM * (bn + 8) > (2 * GEMM_BM + stages * bn) * (bk + 8):
        raise ValueError(f"{op}: {GEMM_ENV}={bk}:{stages} leaves no room to stage {bn} columns")
    sweep = tiled_sweep(stride, wo, bn)
    hoist = dw_schedule(cin, stride, wo)[1]
    smem = dw_smem_bytes(cin) + 2 * GEMM_BM * (bk + 8) * 2 + stages * bn * (bk + 8) * 2
    name = cu.template_name(
        "ds_tiled", ca, cb, cout, bn, bk, stages, stride, dilation, sweep, hoist, residual, head
    )
    func = cu.kernel("ds_split.cu", name)
    cu.opt_in_smem(func, smem)
    m = n * ho * wo
    args = (*c.block_args(), *map(cu.i32, (n, height, width, ho, wo)))
    cu.launch(func, (-(-m // GEMM_BM), cout // bn), (GEMM_THREADS,), args, smem)
    return out

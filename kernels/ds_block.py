"""``ds_block``: one whole depthwise-separable block as one op (the CUDA forward's fusion).

``ds_block_ref`` is defined by the ops it fuses, in the numpy forward's order::

    h   = upsample_concat(x, skip)              if skip is given (the decoder join)
    y   = dwconv3x3(h, dw_w, dw_b, stride, dilation, "relu")
    out = pwconv(y, pw_w, pw_b, "relu", h if residual else None)
    out = pwconv(out, head_w, head_b, "none")   if head_w is given (ScratchNet's 1x1 head)

Fusing them means the joined tensor, the depthwise output and (with the head) the block's own
output never reach device memory: ``ds_block.cu`` computes the depthwise result for a tile of
64 pixels straight into shared memory, multiplies it by the pointwise weight on the tensor
cores and applies bias, residual and ReLU (and the head's dot product) in the epilogue.
Per ScratchNet block that removes one write and one read of the widest tensor in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import env_choice
from scratchd.kernels.dwconv3x3 import dwconv3x3_ref
from scratchd.kernels.pwconv import pwconv_ref
from scratchd.kernels.upsample_concat import upsample_concat_ref


def ds_block_ref(
    x: np.ndarray,  # [N, H, W, CA] float32; with skip: [N, H/2, W/2, CA]
    dw_w: np.ndarray,  # [3, 3, CA + CB] float32
    dw_b: np.ndarray,  # [CA + CB] float32
    pw_w: np.ndarray,  # [CA + CB, Cout] float32
    pw_b: np.ndarray,  # [Cout] float32
    stride: int = 1,
    dilation: int = 1,
    skip: np.ndarray | None = None,  # [N, H, W, CB] float32
    residual: bool = False,
    head_w: np.ndarray | None = None,  # [Cout, 1] float32
    head_b: np.ndarray | None = None,  # [1] float32
) -> np.ndarray:  # [N, Ho, Wo, Cout] float32, or [N, Ho, Wo, 1] with the head
    """A DS block (optionally opening with the decoder join, optionally ending in the head)."""
    h = x if skip is None else upsample_concat_ref(x, skip)
    check_fusable("ds_block", stride, skip is not None, residual, head_w, head_b)
    y = dwconv3x3_ref(h, dw_w, dw_b, stride, dilation, "relu")
    out = pwconv_ref(y, pw_w, pw_b, "relu", h if residual else None)
    if head_w is not None and head_b is not None:
        out = pwconv_ref(out, head_w, head_b, "none")
    return out


def check_fusable(
    op: str, stride: int, joined: bool, residual: bool, head_w: Any, head_b: Any
) -> None:
    if stride not in (1, 2):
        raise ValueError(f"{op}: stride must be 1 or 2, got {stride}")
    if joined and stride != 1:
        raise ValueError(f"{op}: the decoder join (skip) needs stride 1")
    if residual and (stride != 1 or joined):
        raise ValueError(f"{op}: a residual needs stride 1 and no skip")
    if (head_w is None) != (head_b is None):
        raise ValueError(f"{op}: head_w and head_b come together")


@dataclass(frozen=True)
class BlockCall:
    """A checked DS-block launch: the sizes a launcher needs, its arrays and its output."""

    n: int
    ca: int
    cb: int
    height: int  # the depthwise input's size (the joined size with a skip)
    width: int
    ho: int
    wo: int
    cout: int
    out: Any  # [N, Ho, Wo, Cout] float16, or [N, Ho, Wo, 1] float32 with the head
    arrays: tuple[Any, ...]  # x, skip, dw_w, dw_b, pw, pw_b, head_w, head_b (as passed)

    @property
    def cin(self) -> int:
        return self.ca + self.cb

    def block_args(self) -> tuple[Any, ...]:
        """The array parameters every one-launch DS kernel (ds_block, ds_tiled, ds_halo)
        declares first: ``x, skip, dw_w, dw_b, pw, pw_b, head_w, head_b, out``. Without a
        skip ``x`` stands in for it, without the head ``pw_b`` for both head arrays: pointers
        the kernel never reads."""
        x, skip, dw_w, dw_b, pw, pw_b, head_w, head_b = self.arrays
        head = head_w is not None
        return (
            x, x if skip is None else skip, dw_w, dw_b, pw, pw_b,
            head_w if head else pw_b, head_b if head else pw_b, self.out,
        )  # fmt: skip


def check_block(
    op: str, x: Any, skip: Any | None, dw_w: Any, dw_b: Any, pw: Any, pw_b: Any, *,
    stride: int, dilation: int, residual: bool, head_w: Any | None, head_b: Any | None,
    out: Any | None, transposed: bool,
) -> BlockCall:  # fmt: skip
    """Every argument check a DS-block launcher makes (``pw``: ``[Cin, Cout]``, or
    ``[Cout, Cin]`` when ``transposed``), and its output array (``out`` checked, or new)."""
    check_fusable(op, stride, skip is not None, residual, head_w, head_b)
    cu.check_device_array(op, "x", x, ndim=4, dtype=np.float16)
    n, hx, wx, ca = x.shape
    cb, height, width = 0, hx, wx
    if skip is not None:  # the decoder join: skip is twice x's size
        cu.check_device_array(op, "skip", skip, ndim=4, dtype=np.float16)
        cb, height, width = skip.shape[3], 2 * hx, 2 * wx
        cu.check_shape(op, "skip", skip, (n, height, width, cb))
    cin = ca + cb
    cu.check_device_array(op, "dw_w", dw_w, ndim=3, dtype=np.float16)
    cu.check_shape(op, "dw_w", dw_w, (3, 3, cin))
    cu.check_device_array(op, "dw_b", dw_b, ndim=1, dtype=np.float32)
    cu.check_shape(op, "dw_b", dw_b, (cin,))
    name = "pw_wt" if transposed else "pw_w"
    cu.check_device_array(op, name, pw, ndim=2, dtype=np.float16)
    cout = pw.shape[0 if transposed else 1]
    cu.check_shape(op, name, pw, (cout, cin) if transposed else (cin, cout))
    cu.check_device_array(op, "pw_b", pw_b, ndim=1, dtype=np.float32)
    cu.check_shape(op, "pw_b", pw_b, (cout,))
    if residual and cin != cout:
        raise ValueError(f"{op}: a residual needs Cin == Cout, got {cin} -> {cout}")
    if dilation < 1:
        raise ValueError(f"{op}: dilation must be >= 1, got {dilation}")
    ho, wo = (height - 1) // stride + 1, (width - 1) // stride + 1
    if head_w is not None:
        cu.check_device_array(op, "head_w", head_w, ndim=2, dtype=np.float32)
        cu.check_shape(op, "head_w", head_w, (cout, 1))
        cu.check_device_array(op, "head_b", head_b, ndim=1, dtype=np.float32)
        cu.check_shape(op, "head_b", head_b, (1,))
        out = cu.output(op, out, (n, ho, wo, 1), np.float32)
    else:
        out = cu.output(op, out, (n, ho, wo, cout), np.float16)
    arrays = (x, skip, dw_w, dw_b, pw, pw_b, head_w, head_b)
    return BlockCall(n, ca, cb, height, width, ho, wo, cout, out, arrays)


def dw_smem_bytes(cin: int) -> int:
    """Shared memory of the depthwise weight in fp32, ``sDw [9][KP]`` (KP: Cin rounded up to
    16), which every kernel with a dw_group.cuh stage stages first."""
    return 9 * (-(-cin // 16) * 16) * 4


# Schedule knobs of the depthwise stage (read at each call, so a benchmark can compare
# schedules in one process; the defaults are the measured best, see docs/benchmarks.md).
SWEEP_ENV = "SCRATCHD_DS_SWEEP"  # "auto", or the largest P to use: "1", "2", "4"
HOIST_ENV = "SCRATCHD_DS_HOIST"  # "1": load all 3 rows before computing (if few); "0": per row
DEFAULT_SWEEP, DEFAULT_HOIST = "auto", "1"


def dw_schedule(cin: int, stride: int, wo: int) -> tuple[int, bool]:
    """``(P, HOIST)`` of the depthwise stage: P output pixels a thread sweeps along a row.

    ``auto``: sharing input columns pays where a pixel has many channel groups to load
    (Cin >= 64, stride 1: the decoder blocks); with few channels or stride 2, one pixel per
    thread keeps more threads busy per tile (docs/benchmarks.md, DS blocks).
    """
    mode = env_choice(SWEEP_ENV, DEFAULT_SWEEP, ("auto", "1", "2", "4"))
    cap = (1 if stride != 1 or cin < 64 else 4) if mode == "auto" else int(mode)
    sweep = next(p for p in (4, 2, 1) if p <= cap and wo % p == 0)
    return sweep, os.environ.get(HOIST_ENV, DEFAULT_HOIST) != "0"


def ds_block_cuda(
    x: Any,  # [N, H, W, CA] float16 (CuPy); with skip: [N, H/2, W/2, CA]
    dw_w: Any,  # [3, 3, CA + CB] float16
    dw_b: Any,  # [CA + CB] float32
    pw_w: Any,  # [CA + CB, Cout] float16
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
    """CUDA twin of :func:`ds_block_ref` (``ds_block.cu``), one kernel launch."""
    op = "ds_block"
    c = check_block(
        op, x, skip, dw_w, dw_b, pw_w, pw_b, stride=stride, dilation=dilation,
        residual=residual, head_w=head_w, head_b=head_b, out=out, transposed=False,
    )  # fmt: skip
    n, ca, cb, cout, out = c.n, c.ca, c.cb, c.cout, c.out
    height, width, ho, wo = c.height, c.width, c.ho, c.wo
    cin, head = c.cin, head_w is not None
    sweep, hoist = dw_schedule(cin, stride, wo)
    dw_smem = dw_smem_bytes(cin)
    slices = 1 if head else cu.pw_slices(cin, cout, dw_smem)
    name = cu.template_name(
        op, ca, cb, cout, slices, stride, dilation, sweep, hoist, residual, head
    )
    func = cu.kernel("ds_block.cu", name)
    args = (*c.block_args(), *map(cu.i32, (n, height, width, ho, wo)))
    cu.launch_pw(func, cin, cout, n * ho * wo, args, dw_smem, slices)
    return out

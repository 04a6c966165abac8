"""``ds_halo``: a stride-1 depthwise-separable block whose input tiles go through shared memory.

The fourth path for :func:`scratchd.kernels.ds_block.ds_block_ref` (its reference), after the
fused ``ds_block.cu``, ``ds_split`` and ``ds_tiled`` (``ds_split.py``). Those compute the
depthwise stage from device memory, one thread loading the input vectors of its own output
pixels, so every input byte passes L1 several times; at the high-resolution blocks ncu had
them latency- and L1-bound. ``ds_halo.cu`` gives a block an output tile of ``TH x TW = 128``
pixels, copies the tile's halo of input pixels into shared memory with ``cp.async`` while the
previous tile computes (a persistent grid), computes the depthwise stage from there into the
GEMM's A tile and multiplies it by the pointwise weight (staged once per block) on the tensor
cores; the decoder join (the upsampled channels read once per source pixel) and the 1x1 head
fuse as on the other paths. Stride 1 and dilation 1 only; any frame size (edge tiles are
partial). Same rounding and summation order as the other paths, so the same bits.
"""

from __future__ import annotations

from typing import Any

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import env_choice
from scratchd.kernels._cuda import GEMM_BM, GEMM_THREADS, SMEM_LIMIT, smem_blocks
from scratchd.kernels.ds_block import check_block

TILE_PIXELS = GEMM_BM  # the output tile, TH x TW
TILE_W_ENV = "SCRATCHD_HALO_TILE_W"  # TW of the 128-pixel output tile: "8", "16" or "32"
DEFAULT_TILE_W = "16"  # TH = 8: the smallest halo of the three
MAX_COUT = 96  # more output channels take more accumulator registers than the block has


def halo_pitch(c: int) -> int:
    """Halves per halo pixel of a ``c``-channel plane: an odd number of 16-byte units."""
    return c if (c // 8) % 2 == 1 else c + 8


def halo_shape_ok(ca: int, cb: int, cout: int, stride: int = 1, dilation: int = 1) -> bool:
    """Whether ``ds_halo`` has tiles for the block: stride 1, dilation 1, 8-channel groups,
    ``Cin`` whole k16 steps, ``Cout`` whole warp columns of at most ``MAX_COUT`` and no more
    than ``Cin`` (the epilogue's tile is staged over the A tile), and a block's shared memory
    (at the configured tile width) within what one block may opt in to."""
    k = ca + cb
    return (
        stride == 1 and dilation == 1 and ca > 0 and ca % 8 == 0 and cb % 8 == 0
        and k % 16 == 0 and cout % 16 == 0 and 0 < cout <= min(k, MAX_COUT)
        and halo_smem_bytes(ca, cb, cout) <= SMEM_LIMIT
    )  # fmt: skip


BLOCKS_ENV = "SCRATCHD_HALO_BLOCKS"  # resident blocks an SM asks for: "2" or "3"
DEFAULT_BLOCKS = "2"  # 3 (80 registers each) runs no faster (docs/benchmarks.md, DS blocks)
SWEEP_ENV = "SCRATCHD_HALO_SWEEP"  # P of the depthwise stage: "2" or "4" (benchmarks)
DEFAULT_SWEEP = "4"


ROWS_ENV = "SCRATCHD_HALO_ROWS"  # R of the depthwise stage: "1", "2" or "4" (benchmarks)
DEFAULT_ROWS = "2"


def halo_rows() -> int:
    """R, output rows a depthwise thread's block spans (``ROWS_ENV``, read at each call):
    each input vector and tap weight it reads from shared memory serves R rows."""
    return int(env_choice(ROWS_ENV, DEFAULT_ROWS, ("1", "2", "4")))


def halo_sweep() -> int:
    """P, output columns a depthwise thread's block spans (``SWEEP_ENV``, read at each
    call). 4: each loaded input vector serves more outputs."""
    return int(env_choice(SWEEP_ENV, DEFAULT_SWEEP, ("2", "4")))


def tile_w() -> int:
    """TW of the output tile (``TILE_W_ENV``, read at each call; TH = 128 / TW)."""
    return int(env_choice(TILE_W_ENV, DEFAULT_TILE_W, ("8", "16", "32")))


def halo_blocks(smem: int) -> int:
    """Blocks per SM the kernel is compiled for (``__launch_bounds__``' minimum, which caps
    its registers: 128 for 2, 80 for 3), as ``BLOCKS_ENV`` asks where their shared memory
    fits, else 2."""
    mode = env_choice(BLOCKS_ENV, DEFAULT_BLOCKS, ("2", "3"))
    return 3 if mode == "3" and smem_blocks(smem) >= 3 else 2


def halo_smem_bytes(ca: int, cb: int, cout: int) -> int:
    """Dynamic shared memory of one block: sDw, sW, sA and the halo planes (all fp16)."""
    k, tw = ca + cb, tile_w()
    th = TILE_PIXELS // tw
    ks = k + 8
    if cb == 0:
        halo = (th + 2) * (tw + 2) * halo_pitch(ca)
    else:
        halo = (th // 2 + 2) * (tw // 2 + 2) * halo_pitch(ca)
        halo += (th + 2) * (tw + 2) * halo_pitch(cb)
    return (9 * k + cout * ks + TILE_PIXELS * ks + halo) * 2


def ds_halo_cuda(
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
) -> Any:  # [N, H, W, Cout] float16, or [N, H, W, 1] float32 with the head
    """CUDA twin of :func:`ds_block_ref` for stride-1, dilation-1 blocks, one persistent
    launch with shared-memory input tiles (``ds_halo.cu``)."""
    op = "ds_halo"
    c = check_block(
        op, x, skip, dw_w, dw_b, pw_wt, pw_b, stride=stride, dilation=dilation,
        residual=residual, head_w=head_w, head_b=head_b, out=out, transposed=True,
    )  # fmt: skip
    n, ca, cb, cout, out = c.n, c.ca, c.cb, c.cout, c.out
    head = head_w is not None
    if not halo_shape_ok(ca, cb, cout, stride, dilation):
        raise ValueError(
            f"{op}: needs stride 1, dilation 1, CA and CB multiples of 8, Cin of 16, Cout a"
            f" multiple of 16 up to min(Cin, {MAX_COUT}), and at most {SMEM_LIMIT} B of"
            f" shared memory a block ({halo_smem_bytes(ca, cb, cout)} B here); got"
            f" {ca}+{cb} -> {cout}, stride {stride}, dilation {dilation}"
        )
    sweep = halo_sweep()
    smem = halo_smem_bytes(ca, cb, cout)
    tw = tile_w()
    name = cu.template_name(
        op, ca, cb, cout, tw, sweep, halo_rows(), residual, head, halo_blocks(smem)
    )
    func = cu.kernel("ds_halo.cu", name)
    th = TILE_PIXELS // tw
    tiles = n * -(-c.ho // th) * -(-c.wo // tw)
    grid = cu.persistent_grid(func, GEMM_THREADS, smem, tiles)
    args = (*c.block_args(), *map(cu.i32, (n, c.ho, c.wo)))
    cu.launch(func, (grid,), (GEMM_THREADS,), args, smem)
    return out

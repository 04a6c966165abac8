"""ds_split_cuda (a DS block as depthwise + tiled GEMM) against ds_block_ref, bit for bit
against the fused ds_block_cuda, and the forward's choice between the two paths."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.ds_block import HOIST_ENV, SWEEP_ENV, ds_block_cuda, ds_block_ref
from scratchd.kernels.ds_split import (
    GEMM_ENV,
    SPLIT_ENV,
    block_path,
    ds_split_cuda,
    ds_tiled_cuda,
    gemm_tiles,
    split_shape_ok,
    tiled_shape_ok,
)
from scratchd.model.net import NetConfig, block_plan
from scratchd.model.scratchnet import random_model

from .cuda_helpers import assert_close, block_data, cupy, dev, fresh_rng, half, poisoned

# scratchnet-1.1's architecture: the widest net the kernels serve (its dec0.0 is the block
# that reaches the int32 indexing limit first).
SN1 = NetConfig(widths=(48, 96, 192, 384), depths=(1, 2, 2, 1), dilations=(2, 4), dec_depth=2)


def test_paths_need_their_tiles_and_a_known_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPLIT_ENV, "all")
    assert block_path(24, 0, 48) == "fused" and not split_shape_ok(24, 48)  # 24: not 16-aligned
    assert block_path(48, 0, 96) == "split" and split_shape_ok(48, 96)
    assert block_path(48, 0, 48, head=True) == "fused"  # the split path has no head
    monkeypatch.setenv(SPLIT_ENV, "tiled")
    assert block_path(48, 0, 48, head=True) == "tiled"
    assert block_path(384, 0, 192, head=True) == "fused"  # a head needs Cout in one tile
    assert not tiled_shape_ok(20, 4, 48, False) and block_path(20, 4, 48) == "fused"
    monkeypatch.setenv(SPLIT_ENV, "sometimes")
    with pytest.raises(ValueError, match=SPLIT_ENV):
        block_path(384, 0, 384)


@pytest.mark.parametrize(
    ("k", "cout", "spec", "tiles"),
    [(384, 384, "32:3", (128, 32, 3)), (576, 192, "32:3", (96, 32, 3)),
     (144, 48, "32:3", (48, 16, 3)), (144, 48, "64:3", (48, 48, 3)),
     (48, 96, "64:2", (96, 48, 2)), (288, 96, "64:4", (96, 48, 4)), (16, 16, "32:3", (16, 16, 3)),
     (192, 64, "64:3", (64, 64, 3)), (384, 384, "16:6", (128, 16, 6))],
)  # fmt: skip
def test_gemm_tiles_divide_the_shapes(
    k: int, cout: int, spec: str, tiles: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GEMM_ENV, spec)
    bn, bk, stages = gemm_tiles(k, cout)
    assert (bn, bk, stages) == tiles
    assert cout % bn == 0 and k % bk == 0 and bn % 16 == 0


@pytest.mark.parametrize("spec", ["32", "24:3", "32:1", "32:7", "a:b"])
def test_gemm_config_is_checked(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMM_ENV, spec)
    with pytest.raises(ValueError, match=GEMM_ENV):
        gemm_tiles(384, 384)


# (N, H, W, CA, CB, Cout, stride, dilation, residual): H, W are the block's input size (with
# CB > 0, the joined size: x is H/2 x W/2). M = N*Ho*Wo is never a multiple of 128 below but
# in the last case, so the GEMM's partial row tile is always exercised.
CASES = [
    (1, 1, 1, 16, 0, 16, 1, 1, True),
    (2, 9, 7, 48, 0, 96, 1, 1, False),
    (1, 17, 13, 192, 0, 384, 2, 1, False),
    (2, 11, 9, 384, 0, 384, 1, 2, True),
    (1, 12, 14, 384, 0, 384, 1, 4, True),
    (2, 16, 14, 384, 192, 192, 1, 1, False),
    (1, 30, 34, 96, 48, 48, 1, 1, False),  # K = 144: BK 16; Cout 48: an odd n8 tile count
    (3, 10, 6, 192, 96, 96, 1, 1, False),
    (1, 33, 35, 96, 0, 96, 1, 1, True),
    (2, 16, 16, 384, 0, 384, 1, 2, True),  # M = 512: whole tiles only
]


def _data(case: tuple[int, ...]) -> tuple[dict[str, np.ndarray], int]:
    n, h, w, ca, cb, cout, *_ = case
    return block_data(n, h, w, ca, cb, cout)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_ds_split_matches_ref_and_the_fused_kernel_bit_for_bit(case: tuple[int, ...]) -> None:
    _check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["32:2", "48:3", "16:5"])
@pytest.mark.parametrize(
    "case", [CASES[i] for i in (3, 5, 6)], ids=lambda s: "x".join(str(int(v)) for v in s)
)
def test_ds_split_is_exact_under_every_gemm_pipeline(
    case: tuple[int, ...], spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(GEMM_ENV, spec)
    _check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["1:1", "2:0", "4:1", "4:0"])
@pytest.mark.parametrize(
    "case", [CASES[i] for i in (5, 6, 9)], ids=lambda s: "x".join(str(int(v)) for v in s)
)
def test_ds_split_is_exact_under_every_depthwise_schedule(
    case: tuple[int, ...], schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep, hoist = schedule.split(":")
    monkeypatch.setenv(SWEEP_ENV, sweep)  # both paths read the same schedule
    monkeypatch.setenv(HOIST_ENV, hoist)
    _check_case(case)


def _check_case(case: tuple[int, ...]) -> None:
    cp = cupy()
    d, seed = _data(case)
    ca, cb, stride, dil, residual = case[3], case[4], case[6], case[7], bool(case[8])
    skip = d.get("skip")
    ref = ds_block_ref(
        d["x"], d["dw_w"], d["dw_b"], d["pw_w"], d["pw_b"], stride, dil, skip, residual
    )
    x, dw_w, dw_b = dev(d["x"]), dev(d["dw_w"]), dev(d["dw_b"], np.float32)
    pw_w, pw_b = dev(d["pw_w"]), dev(d["pw_b"], np.float32)
    skip_d = None if skip is None else dev(skip)
    m_cin = int(np.prod(ref.shape[:3])) * (ca + cb)
    scratch = poisoned((m_cin + 5,), np.float16)
    out = poisoned(ref.shape, np.float16)
    got = ds_split_cuda(
        x, dw_w, dw_b, cp.ascontiguousarray(pw_w.T), pw_b, stride, dil, skip_d, residual,
        scratch=scratch, out=out,
    )  # fmt: skip
    assert got is out
    assert_close(got, ref, seed, "ds_split")
    fused = ds_block_cuda(x, dw_w, dw_b, pw_w, pw_b, stride, dil, skip_d, residual)
    same = cp.asnumpy(got).view(np.uint16) == cp.asnumpy(fused).view(np.uint16)
    assert same.all(), f"seed={seed}: {np.count_nonzero(~same)} elements differ from ds_block"
    if tiled_shape_ok(ca, cb, case[5], False):
        tiled = ds_tiled_cuda(
            x, dw_w, dw_b, cp.ascontiguousarray(pw_w.T), pw_b, stride, dil, skip_d, residual,
            out=poisoned(ref.shape, np.float16),
        )  # fmt: skip
        same = cp.asnumpy(tiled).view(np.uint16) == cp.asnumpy(fused).view(np.uint16)
        assert same.all(), f"seed={seed}: {np.count_nonzero(~same)} tiled elements differ"
    assert np.isnan(cp.asnumpy(scratch[m_cin:]).astype(np.float32)).all()  # nothing past M*Cin


# (N, H, W, CA, CB, Cout, stride, dilation, residual) of blocks that end in the 1x1 head.
HEAD_CASES = [
    (1, 34, 30, 48, 0, 48, 1, 1, True),  # the shipped model's dec0.1
    (2, 17, 13, 32, 0, 48, 2, 1, False),
    (1, 30, 34, 96, 48, 96, 1, 1, False),
    (2, 9, 7, 16, 0, 16, 1, 3, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_ds_tiled_head_gives_the_fused_kernels_logits(case: tuple[int, ...]) -> None:
    cp = cupy()
    n, h, w, ca, cb, cout, *_ = case
    d, seed = block_data(n, h, w, ca, cb, cout, head=True)
    stride, dil, residual = case[6], case[7], case[8]
    head_w, head_b = d["head_w"], d["head_b"]
    skip = d.get("skip")
    ref = ds_block_ref(
        d["x"], d["dw_w"], d["dw_b"], d["pw_w"], d["pw_b"], stride, dil, skip, bool(residual),
        head_w, head_b,
    )  # fmt: skip
    x, dw_w, dw_b = dev(d["x"]), dev(d["dw_w"]), dev(d["dw_b"], np.float32)
    pw_w, pw_b = dev(d["pw_w"]), dev(d["pw_b"], np.float32)
    hw, hb = dev(head_w, np.float32), dev(head_b, np.float32)
    skip_d = None if skip is None else dev(skip)
    got = ds_tiled_cuda(
        x, dw_w, dw_b, cp.ascontiguousarray(pw_w.T), pw_b, stride, dil, skip_d, bool(residual),
        hw, hb, out=poisoned(ref.shape, np.float32),
    )  # fmt: skip
    assert_close(got, ref, seed, "ds_tiled head")
    fused = ds_block_cuda(x, dw_w, dw_b, pw_w, pw_b, stride, dil, skip_d, bool(residual), hw, hb)
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(fused), f"seed={seed}")


@pytest.mark.gpu
def test_ds_split_refuses_a_short_scratch_and_unaligned_widths() -> None:
    cp = cupy()
    d, _ = _data((1, 8, 8, 32, 0, 32, 1, 1, False))
    args = (dev(d["x"]), dev(d["dw_w"]), dev(d["dw_b"], np.float32),
            cp.ascontiguousarray(dev(d["pw_w"]).T), dev(d["pw_b"], np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="scratch holds"):
        ds_split_cuda(*args, scratch=cp.empty(8 * 8 * 32 - 1, np.float16))
    rng = np.random.default_rng(0)
    x = dev(half(rng, (1, 4, 4, 24)))
    with pytest.raises(ValueError, match="multiples of 16"):
        ds_split_cuda(
            x, dev(half(rng, (3, 3, 24))), dev(np.zeros(24), np.float32),
            dev(half(rng, (24, 24))), dev(np.zeros(24), np.float32),
            scratch=cp.empty(4 * 4 * 24, np.float16),
        )  # fmt: skip


@pytest.mark.gpu
def test_a_wide_forward_gives_the_same_bits_split_or_fused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole forward of scratchnet-1.1's architecture (random weights: the paths' bits
    do not depend on training; captured graphs) with every block fused, on the default
    paths, every block split, tiled or on ds_halo, and every block split but dec0.0, whose
    depthwise output would pass the int32 indexing limit there (it stays fused; the default
    paths split no block whose scratch is larger than the stem's output, which the limit
    refuses first): logits and probabilities agree bit for bit."""
    from scratchd.gpu.cuda_scratchnet import CudaScratchNet
    from scratchd.kernels import _cuda as cu

    rng, seed = fresh_rng()
    model = random_model(seed % 1000, cfg=SN1)
    images = rng.integers(0, 256, (3, 72, 104), dtype=np.uint8)
    outs, split, paths = {}, {}, {}
    for mode in ("none", "auto", "all", "tiled", "halo", "all-limited"):
        monkeypatch.setenv(SPLIT_ENV, mode.removesuffix("-limited"))
        if mode == "all-limited":  # bucket 4: dec0.0's scratch 4 x 40 x 56 x 144 = 1290240
            monkeypatch.setattr(cu, "INT32_LIMIT", 700_000)  # halves; the rest ≤ 645120
        net = CudaScratchNet(model)
        outs[mode] = net.run(images)
        buf = net.graph(3, 72, 104).buf
        outs[mode]["logits"] = cupy().asnumpy(buf.logits)[:3]
        split[mode] = len(buf.split)
        paths[mode] = set(net.fwd.path.values())
    blocks = len(block_plan(SN1))
    assert split == {
        "none": 0, "auto": 4, "all": blocks - 1, "tiled": 0, "halo": 0, "all-limited": blocks - 2
    }  # fmt: skip
    assert paths["auto"] == {"fused", "split", "halo"}
    for mode in ("auto", "all", "tiled", "halo", "all-limited"):
        for key in ("logits", "prob", "score"):
            np.testing.assert_array_equal(
                outs[mode][key], outs["none"][key], f"{mode} {key} {seed}"
            )

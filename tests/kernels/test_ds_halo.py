"""ds_halo_cuda (a stride-1 DS block with shared-memory input tiles) against ds_block_ref and,
bit for bit, against the fused ds_block_cuda; its shape rule and shared-memory sizing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from scratchd.kernels._cuda import SMEM_LIMIT
from scratchd.kernels.ds_block import ds_block_cuda, ds_block_ref
from scratchd.kernels.ds_halo import (
    BLOCKS_ENV,
    MAX_COUT,
    ROWS_ENV,
    SWEEP_ENV,
    TILE_W_ENV,
    ds_halo_cuda,
    halo_blocks,
    halo_pitch,
    halo_rows,
    halo_shape_ok,
    halo_smem_bytes,
    halo_sweep,
    tile_w,
)
from scratchd.kernels.ds_split import SPLIT_ENV, block_path

from .cuda_helpers import assert_close, block_data, cupy, dev, half, poisoned


def test_halo_shapes_are_stride_one_narrow_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert halo_shape_ok(48, 0, 48) and halo_shape_ok(96, 48, 48) and halo_shape_ok(96, 0, 64)
    assert not halo_shape_ok(48, 0, 48, stride=2)  # stride 2 and dilation are other paths'
    assert not halo_shape_ok(48, 0, 48, dilation=2)
    assert not halo_shape_ok(24, 0, 24)  # Cin not whole k16 steps
    assert not halo_shape_ok(20, 4, 48)  # channel groups of 8
    assert halo_shape_ok(192, 96, 96) and not halo_shape_ok(192, 0, 192)  # Cout past MAX_COUT
    assert halo_smem_bytes(288, 0, 96) > SMEM_LIMIT and not halo_shape_ok(288, 0, 96)
    assert not halo_shape_ok(16, 0, 32)  # Cout past Cin: the staged tile would not fit
    monkeypatch.setenv(SPLIT_ENV, "halo")
    assert block_path(48, 0, 48, head=True) == "halo"  # the head fuses on this path too
    assert block_path(96, 48, 48) == "halo"
    assert block_path(48, 0, 96, stride=2) == "fused"
    assert block_path(384, 0, 384, dilation=2) == "fused"
    assert block_path(288, 0, 96) == "fused"  # its tile would not fit in shared memory


def test_halo_pitch_is_an_odd_number_of_16_byte_units() -> None:
    for c in range(8, 400, 8):
        p = halo_pitch(c)
        assert p >= c and p % 8 == 0 and (p // 8) % 2 == 1 and p - c in (0, 8)


def test_the_shipped_high_resolution_blocks_fit_two_blocks_an_sm() -> None:
    """Shared memory per block for enc0.0/dec0.1 (48 -> 48) and dec0.0 (96 + 48 -> 48):
    sDw + sW + sA + halo(s), all fp16, at most half of the H200's 228 KB (minus 1 KB per block)."""
    assert halo_smem_bytes(48, 0, 48) == (9 * 48 + 48 * 56 + 128 * 56 + 10 * 18 * 56) * 2
    dec00 = (9 * 144 + 48 * 152 + 128 * 152 + 6 * 10 * 104 + 10 * 18 * 56) * 2
    assert halo_smem_bytes(96, 48, 48) == dec00
    assert 2 * (dec00 + 1024) <= 228 * 1024


def test_three_blocks_an_sm_where_their_shared_memory_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BLOCKS_ENV, raising=False)
    assert halo_blocks(halo_smem_bytes(48, 0, 48)) == 2  # the default
    monkeypatch.setenv(BLOCKS_ENV, "3")
    assert halo_blocks(halo_smem_bytes(48, 0, 48)) == 3  # enc0.0, dec0.1: ~40 KB
    assert halo_blocks(halo_smem_bytes(96, 48, 48)) == 2  # dec0.0: ~88 KB, never more than fit
    monkeypatch.setenv(BLOCKS_ENV, "4")
    with pytest.raises(ValueError, match=BLOCKS_ENV):
        halo_blocks(1024)


@pytest.mark.parametrize(
    ("env", "knob", "default", "other", "bad"),
    [(TILE_W_ENV, tile_w, 16, "32", "12"), (ROWS_ENV, halo_rows, 2, "4", "3"),
     (SWEEP_ENV, halo_sweep, 4, "2", "8")],
)  # fmt: skip
def test_the_schedule_knobs_take_their_default_a_listed_value_and_nothing_else(
    env: str, knob: Any, default: int, other: str, bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env, raising=False)
    assert knob() == default
    monkeypatch.setenv(env, other)
    assert knob() == int(other)
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=env):
        knob()


def test_a_32_wide_tile_has_a_6_x_34_halo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TILE_W_ENV, "32")
    assert halo_smem_bytes(48, 0, 48) == (9 * 48 + 48 * 56 + 128 * 56 + 6 * 34 * 56) * 2


# (N, H, W, CA, CB, Cout, residual, head): H, W the output size (with CB > 0, x is H/2 x W/2).
# Sizes that are not whole 8 x 16 tiles exercise the partial edge tiles.
CASES = [
    (1, 8, 16, 48, 0, 48, True, False),  # one whole tile
    (2, 19, 37, 48, 0, 48, True, False),  # partial tiles on both edges
    (1, 1, 1, 16, 0, 16, False, False),
    (3, 30, 34, 96, 48, 48, False, False),  # the shipped dec0.0's shape
    (1, 2, 2, 32, 16, 48, False, False),
    (2, 17, 23, 96, 0, 64, False, False),
    (1, 34, 30, 48, 0, 48, True, True),  # the shipped dec0.1 (with the head)
    (2, 12, 20, 64, 32, 32, False, True),
    (1, 20, 36, 96, 0, 96, True, False),  # the shipped enc1.1 and dec1.1
    (2, 12, 18, 192, 96, 96, False, False),  # the shipped dec1.0
]


def _data(case: tuple[int, ...]) -> tuple[dict[str, np.ndarray], int]:
    n, h, w, ca, cb, cout, _, head = case
    return block_data(n, h, w, ca, cb, cout, bool(head))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "schedule", ["4:2:2:16", "4:1:2:16", "2:4:2:16", "2:2:3:16", "4:2:2:32", "4:2:2:8"]
)
@pytest.mark.parametrize("case", CASES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_ds_halo_matches_ref_and_the_fused_kernel_bit_for_bit(
    case: tuple[int, ...], schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep, rows, blocks, tw = schedule.split(":")  # P:R:blocks an SM:TW
    monkeypatch.setenv(SWEEP_ENV, sweep)
    monkeypatch.setenv(ROWS_ENV, rows)
    monkeypatch.setenv(BLOCKS_ENV, blocks)
    monkeypatch.setenv(TILE_W_ENV, tw)
    cp = cupy()
    d, seed = _data(case)
    residual = bool(case[6])
    skip, head_w, head_b = d.get("skip"), d.get("head_w"), d.get("head_b")
    ref = ds_block_ref(
        d["x"], d["dw_w"], d["dw_b"], d["pw_w"], d["pw_b"], 1, 1, skip, residual, head_w, head_b
    )
    x, dw_w, dw_b = dev(d["x"]), dev(d["dw_w"]), dev(d["dw_b"], np.float32)
    pw_w, pw_b = dev(d["pw_w"]), dev(d["pw_b"], np.float32)
    skip_d = None if skip is None else dev(skip)
    hw = None if head_w is None else dev(head_w, np.float32)
    hb = None if head_b is None else dev(head_b, np.float32)
    out = poisoned(ref.shape, np.float32 if hw is not None else np.float16)
    got = ds_halo_cuda(
        x, dw_w, dw_b, cp.ascontiguousarray(pw_w.T), pw_b, 1, 1, skip_d, residual, hw, hb,
        out=out,
    )  # fmt: skip
    assert got is out
    assert_close(got, ref, seed, "ds_halo")
    fused = ds_block_cuda(x, dw_w, dw_b, pw_w, pw_b, 1, 1, skip_d, residual, hw, hb)
    a, b = cp.asnumpy(got), cp.asnumpy(fused)
    bits = np.uint32 if a.dtype == np.float32 else np.uint16
    same = a.view(bits) == b.view(bits)
    assert same.all(), f"seed={seed}: {np.count_nonzero(~same)} elements differ from ds_block"


@pytest.mark.gpu
def test_ds_halo_refuses_what_it_has_no_tiles_for() -> None:
    cp = cupy()
    rng = np.random.default_rng(0)
    x = dev(half(rng, (1, 8, 8, 48)))
    args = (x, dev(half(rng, (3, 3, 48))), dev(np.zeros(48), np.float32))
    with pytest.raises(ValueError, match="stride 1, dilation 1"):
        ds_halo_cuda(*args, dev(half(rng, (48, 48))), dev(np.zeros(48), np.float32), stride=2)
    # Cout past MAX_COUT but within Cin (128): refused for MAX_COUT alone
    x128 = dev(half(rng, (1, 8, 8, 128)))
    wide = cp.ascontiguousarray(dev(half(rng, (128, MAX_COUT + 16))).T)
    with pytest.raises(ValueError, match=f"up to min\\(Cin, {MAX_COUT}\\)"):
        ds_halo_cuda(
            x128, dev(half(rng, (3, 3, 128))), dev(np.zeros(128), np.float32), wide,
            dev(np.zeros(MAX_COUT + 16), np.float32),
        )  # fmt: skip

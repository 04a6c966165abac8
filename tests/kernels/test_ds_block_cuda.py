"""ds_block_cuda (the fused depthwise-separable block) against ds_block_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.ds_block import HOIST_ENV, SWEEP_ENV, ds_block_cuda, ds_block_ref

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu

# (N, H, W, CA, CB, Cout, stride, dilation, residual, head); H, W are the block's input size
# (with CB > 0, the joined size: x is H/2 x W/2).
CASES = [
    (1, 1, 1, 1, 0, 1, 1, 1, False, False),
    (2, 9, 7, 5, 0, 5, 1, 1, True, False),
    (1, 33, 35, 24, 0, 24, 1, 1, True, False),
    (3, 17, 13, 24, 0, 48, 2, 1, False, False),
    (2, 16, 16, 48, 0, 96, 2, 1, False, False),
    (1, 8, 10, 96, 0, 192, 2, 1, False, False),
    (2, 11, 9, 192, 0, 192, 1, 2, True, False),
    (1, 12, 12, 192, 0, 192, 1, 4, True, False),
    (2, 16, 14, 192, 96, 96, 1, 1, False, False),
    (1, 30, 34, 96, 48, 48, 1, 1, False, False),
    (2, 34, 30, 48, 24, 24, 1, 1, False, True),
    (1, 6, 10, 3, 5, 7, 1, 1, False, True),
    (1, 12, 16, 96, 0, 96, 1, 1, True, False),
    (2, 24, 24, 48, 24, 24, 1, 1, False, True),
    # The first shipped model's (1.0, 40..320) widest blocks: output channels split over
    # blockIdx.y, two slices each (as the shipped 1.1 model's 384-channel blocks are).
    (1, 16, 20, 320, 160, 160, 1, 1, False, False),
    (2, 9, 12, 320, 0, 320, 1, 4, True, False),
    (1, 18, 14, 160, 0, 320, 2, 1, False, False),
]
# The network's kinds of block, run again under every depthwise schedule the benchmark tries.
SCHEDULE_CASES = [CASES[i] for i in (2, 3, 8, 10, 12)]


@pytest.mark.parametrize("case", CASES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_ds_block_cuda_matches_ref(case: tuple[int, ...]) -> None:
    _check_case(case)


@pytest.mark.parametrize("schedule", ["auto:0", "4:1", "1:1", "2:0"])
@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=lambda s: "x".join(str(int(v)) for v in s))
def test_ds_block_cuda_matches_ref_under_every_schedule(
    case: tuple[int, ...], schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep, hoist = schedule.split(":")
    monkeypatch.setenv(SWEEP_ENV, sweep)
    monkeypatch.setenv(HOIST_ENV, hoist)
    _check_case(case)


def _check_case(case: tuple[int, ...]) -> None:
    rng, seed = fresh_rng()
    n, h, w, ca, cb, cout, stride, dil, residual, head = case
    cin = ca + cb
    x = half(rng, (n, h // 2, w // 2, ca) if cb else (n, h, w, ca))
    skip = half(rng, (n, h, w, cb)) if cb else None
    dw_w, dw_b = half(rng, (3, 3, cin), 0.4), rng.normal(0, 0.3, cin).astype(np.float32)
    pw_w = half(rng, (cin, cout), 1.0 / np.sqrt(cin))
    pw_b = rng.normal(0, 0.3, cout).astype(np.float32)
    head_w = rng.normal(0, 0.3, (cout, 1)).astype(np.float32) if head else None
    head_b = rng.normal(0, 0.3, 1).astype(np.float32) if head else None
    ref = ds_block_ref(x, dw_w, dw_b, pw_w, pw_b, stride, dil, skip, bool(residual), head_w, head_b)
    out = poisoned(ref.shape, np.float32 if head else np.float16)
    got = ds_block_cuda(
        dev(x), dev(dw_w), dev(dw_b, np.float32), dev(pw_w), dev(pw_b, np.float32),
        stride, dil, None if skip is None else dev(skip), bool(residual),
        None if head_w is None else dev(head_w, np.float32),
        None if head_b is None else dev(head_b, np.float32), out=out,
    )  # fmt: skip
    assert got is out
    assert_close(got, ref, seed, "ds_block")


def test_ds_block_cuda_rejects_a_residual_that_cannot_fit() -> None:
    x = dev(np.zeros((1, 4, 4, 8), np.float32))
    w = (dev(np.zeros((3, 3, 8))), dev(np.zeros(8), np.float32))
    pw = (dev(np.zeros((8, 16))), dev(np.zeros(16), np.float32))
    with pytest.raises(ValueError, match="residual"):
        ds_block_cuda(x, *w, *pw, residual=True)
    with pytest.raises(ValueError, match="residual"):
        ds_block_cuda(x, *w, *pw, stride=2, residual=True)

"""dwconv3x3_cuda against dwconv3x3_ref: strides, dilations, odd sizes and channel counts."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.dwconv3x3 import dwconv3x3_cuda, dwconv3x3_ref

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu

CASES = [  # (N, H, W, C, stride, dilation)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 3, 5, 2, 1),
    (2, 7, 9, 24, 1, 1),
    (3, 17, 15, 24, 2, 1),
    (1, 33, 31, 48, 1, 1),
    (2, 16, 16, 96, 2, 1),
    (1, 13, 11, 192, 1, 2),
    (1, 21, 19, 192, 1, 4),
    (2, 6, 7, 3, 1, 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ["relu", "none"])
def test_dwconv3x3_cuda_matches_ref(case: tuple[int, ...], act: str) -> None:
    rng, seed = fresh_rng()
    n, h, w, c, stride, dil = case
    x = half(rng, (n, h, w, c))
    wt = half(rng, (3, 3, c), 1.0 / 3.0)
    b = rng.standard_normal(c).astype(np.float32)
    ref = dwconv3x3_ref(x, wt, b, stride, dil, act)  # type: ignore[arg-type]
    out = poisoned(ref.shape, np.float16)
    got = dwconv3x3_cuda(dev(x), dev(wt), dev(b, np.float32), stride, dil, act, out=out)  # type: ignore[arg-type]
    assert_close(got, ref, seed, "dwconv3x3")


def test_dwconv3x3_cuda_rejects_bad_arguments() -> None:
    x = dev(np.zeros((1, 4, 4, 8), np.float32))
    w, b = dev(np.zeros((3, 3, 8))), dev(np.zeros(8), np.float32)
    with pytest.raises(ValueError, match="stride"):
        dwconv3x3_cuda(x, w, b, stride=3)
    with pytest.raises(ValueError, match="dilation"):
        dwconv3x3_cuda(x, w, b, dilation=0)
    with pytest.raises(ValueError, match="out must have shape"):
        dwconv3x3_cuda(x, w, b, out=poisoned((1, 4, 4, 4), np.float16))

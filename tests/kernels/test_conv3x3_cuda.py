"""conv3x3_cuda (the stem) against conv3x3_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.conv3x3 import conv3x3_cuda, conv3x3_ref

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu

CASES = [  # (N, H, W, Cin, Cout, stride)
    (1, 1, 1, 1, 1, 1),
    (1, 32, 32, 1, 24, 2),
    (2, 17, 31, 1, 24, 2),
    (3, 9, 7, 3, 5, 1),
    (1, 15, 16, 4, 16, 2),
    (2, 6, 5, 2, 8, 1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ["relu", "none"])
def test_conv3x3_cuda_matches_ref(case: tuple[int, ...], act: str) -> None:
    rng, seed = fresh_rng()
    n, h, w, cin, cout, stride = case
    x = half(rng, (n, h, w, cin))
    wt = half(rng, (3, 3, cin, cout), 1.0 / np.sqrt(9 * cin))
    b = rng.standard_normal(cout).astype(np.float32)
    ref = conv3x3_ref(x, wt, b, stride, act)  # type: ignore[arg-type]
    out = poisoned(ref.shape, np.float16)
    got = conv3x3_cuda(dev(x), dev(wt), dev(b, np.float32), stride, act, out=out)  # type: ignore[arg-type]
    assert_close(got, ref, seed, "conv3x3")


def test_conv3x3_cuda_refuses_weights_too_large_for_shared_memory() -> None:
    x = dev(np.zeros((1, 4, 4, 64), np.float32))
    w, b = dev(np.zeros((3, 3, 64, 64))), dev(np.zeros(64), np.float32)
    with pytest.raises(ValueError, match="48 KB"):
        conv3x3_cuda(x, w, b)

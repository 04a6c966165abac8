"""pwconv_cuda (tensor-core GEMM + bias/residual/act epilogue) against pwconv_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.pwconv import pwconv_cuda, pwconv_ref

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu

SHAPES = [  # (N, H, W, Cin, Cout)
    (1, 1, 1, 1, 1),
    (1, 7, 5, 3, 5),
    (2, 9, 13, 24, 24),
    (3, 17, 3, 24, 48),
    (1, 33, 31, 48, 48),
    (2, 16, 16, 96, 192),
    (1, 13, 11, 192, 192),
    (1, 31, 37, 288, 96),
    (1, 5, 9, 17, 1),
    (2, 65, 67, 72, 24),
    (1, 9, 11, 320, 320),  # wider than one block's shared memory: two output slices
    (2, 5, 13, 480, 160),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", ["relu", "none"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_pwconv_cuda_matches_ref(
    shape: tuple[int, int, int, int, int], act: str, with_residual: bool
) -> None:
    rng, seed = fresh_rng()
    n, h, w, cin, cout = shape
    x = half(rng, (n, h, w, cin))
    wt = half(rng, (cin, cout), 1.0 / np.sqrt(cin))
    b = rng.standard_normal(cout).astype(np.float32)
    res = half(rng, (n, h, w, cout)) if with_residual else None
    ref = pwconv_ref(x, wt, b, act, res)  # type: ignore[arg-type]
    out = poisoned((n, h, w, cout), np.float16)
    got = pwconv_cuda(
        dev(x), dev(wt), dev(b, np.float32), act,  # type: ignore[arg-type]
        None if res is None else dev(res), out=out,
    )  # fmt: skip
    assert got is out
    assert_close(got, ref, seed, "pwconv")


def test_pwconv_cuda_rejects_bad_arguments() -> None:
    x = dev(np.zeros((1, 4, 4, 8), np.float32))
    with pytest.raises(ValueError, match="w must have shape"):
        pwconv_cuda(x, dev(np.zeros((4, 8), np.float32)), dev(np.zeros(8), np.float32))
    with pytest.raises(ValueError, match="float16"):
        pwconv_cuda(x.astype(np.float32), dev(np.zeros((8, 8))), dev(np.zeros(8), np.float32))
    with pytest.raises(TypeError, match="cupy array"):
        pwconv_cuda(np.zeros((1, 4, 4, 8), np.float16), dev(np.zeros((8, 8))), None)

"""upsample_bilinear2x_cuda (fp16 and fp32) against upsample_bilinear2x_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.upsample_bilinear2x import (
    upsample_bilinear2x_cuda,
    upsample_bilinear2x_ref,
)

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "shape", [(1, 1, 1, 1), (2, 3, 5, 1), (1, 7, 9, 24), (3, 16, 15, 3)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_upsample_bilinear2x_cuda_matches_ref(shape: tuple[int, ...], dtype: type) -> None:
    rng, seed = fresh_rng()
    x = half(rng, shape)
    ref = upsample_bilinear2x_ref(x)
    out = poisoned(ref.shape, dtype)
    got = upsample_bilinear2x_cuda(dev(x, dtype), out=out)
    assert_close(got, ref, seed, "upsample_bilinear2x", rel=1e-2 if dtype == np.float16 else 1e-5)

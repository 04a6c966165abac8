"""sigmoid_cuda against sigmoid_ref, extreme inputs included (no overflow, no NaN)."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.sigmoid import sigmoid_cuda, sigmoid_ref

from .cuda_helpers import assert_close, cupy, fresh_rng, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1,), (7, 3), (2, 65, 33)], ids=str)
def test_sigmoid_cuda_matches_ref(shape: tuple[int, ...]) -> None:
    rng, seed = fresh_rng()
    x = (rng.standard_normal(shape) * 20).astype(np.float32)
    x.flat[0] = -1e30
    x.flat[-1] = 1e30
    ref = sigmoid_ref(x)
    out = poisoned(shape, np.float32)
    got = sigmoid_cuda(cupy().asarray(x), out=out)
    assert_close(got, ref, seed, "sigmoid", rel=1e-5)

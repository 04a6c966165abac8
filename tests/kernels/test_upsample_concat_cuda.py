"""upsample_concat_cuda against upsample_concat_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.upsample_concat import upsample_concat_cuda, upsample_concat_ref

from .cuda_helpers import assert_close, dev, fresh_rng, half, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "case",
    [(1, 1, 1, 1, 1), (2, 3, 5, 3, 5), (1, 8, 8, 192, 96), (3, 7, 9, 24, 8), (1, 16, 17, 48, 24)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_upsample_concat_cuda_matches_ref(case: tuple[int, ...]) -> None:
    rng, seed = fresh_rng()
    n, h, w, c1, c2 = case
    x, skip = half(rng, (n, h, w, c1)), half(rng, (n, 2 * h, 2 * w, c2))
    ref = upsample_concat_ref(x, skip)
    out = poisoned(ref.shape, np.float16)
    got = upsample_concat_cuda(dev(x), dev(skip), out=out)
    assert_close(got, ref, seed, "upsample_concat", rel=1e-6)  # a pure copy: exact


def test_upsample_concat_cuda_rejects_mismatched_skip() -> None:
    with pytest.raises(ValueError, match="skip must have shape"):
        upsample_concat_cuda(dev(np.zeros((1, 4, 4, 8))), dev(np.zeros((1, 8, 9, 8))))

"""prob_head_cuda (bilinear 2x + crop + sigmoid) against prob_head_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.prob_head import prob_head_cuda, prob_head_ref

from .cuda_helpers import assert_close, cupy, fresh_rng, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "case", [(1, 1, 1, 1, 1), (2, 8, 8, 16, 16), (1, 100, 104, 200, 207), (3, 13, 9, 25, 17)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
def test_prob_head_cuda_matches_ref(case: tuple[int, ...]) -> None:
    rng, seed = fresh_rng()
    n, h, w, height, width = case
    logits = (rng.standard_normal((n, h, w, 1)) * 4).astype(np.float32)
    ref = prob_head_ref(logits, height, width)
    out = poisoned(ref.shape, np.float32)
    got = prob_head_cuda(cupy().asarray(logits), height, width, out=out)
    assert_close(got, ref, seed, "prob_head", rel=1e-5)


def test_prob_head_cuda_rejects_a_crop_larger_than_the_upsampled_map() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        prob_head_cuda(cupy().zeros((1, 4, 4, 1), np.float32), 9, 8)

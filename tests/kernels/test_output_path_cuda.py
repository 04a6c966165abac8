"""output_path_cuda (prob, raw mask, score, entropy, histogram) against output_path_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.output_path import output_path_buffers, output_path_cuda, output_path_ref

from .cuda_helpers import assert_close, cupy, fresh_rng

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "case", [(1, 1, 1, 1, 1, 5), (2, 8, 8, 16, 16, 5), (1, 100, 100, 200, 200, 5),
             (3, 13, 9, 25, 17, 3), (2, 40, 300, 79, 600, 7), (1, 512, 512, 1024, 1024, 5)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
def test_output_path_cuda_matches_ref(case: tuple[int, ...]) -> None:
    rng, seed = fresh_rng()
    n, h, w, height, width, window = case
    logits = (rng.standard_normal((n, h, w, 1)) * 4).astype(np.float32)
    images = rng.integers(0, 256, (n, height, width), dtype=np.uint8)
    threshold = 0.5
    ref = output_path_ref(logits, images, threshold, window)
    cp = cupy()
    out = output_path_buffers(n, height, width)
    out.prob.fill(np.nan)
    out.mask.fill(7)
    out.score.fill(np.nan)
    out.entropy.fill(np.nan)
    out.hist.fill(12345)
    got = output_path_cuda(cp.asarray(logits), cp.asarray(images), threshold, window, out=out)
    assert_close(got.prob, ref.prob, seed, "prob", rel=1e-5)
    mask = cp.asnumpy(got.mask)
    assert set(np.unique(mask)) <= {0, 255}, f"seed={seed}: mask has unwritten bytes"
    near = np.abs(ref.prob - threshold) < 1e-5  # fp32 rounding may flip these
    assert np.array_equal(mask[~near], ref.mask[~near]), f"seed={seed}: mask differs"
    np.testing.assert_allclose(cp.asnumpy(got.score), ref.score, atol=1e-5, err_msg=str(seed))
    np.testing.assert_allclose(cp.asnumpy(got.entropy), ref.entropy, atol=1e-4, err_msg=str(seed))
    np.testing.assert_array_equal(cp.asnumpy(got.hist), ref.hist, err_msg=str(seed))


def test_output_path_cuda_twice_does_not_accumulate() -> None:
    """The accumulators are zeroed on every run (a replayed graph must not add up)."""
    rng, seed = fresh_rng()
    cp = cupy()
    logits = cp.asarray(rng.standard_normal((2, 20, 20, 1)).astype(np.float32))
    images = cp.asarray(rng.integers(0, 256, (2, 40, 40), dtype=np.uint8))
    out = output_path_buffers(2, 40, 40)
    scratch = cp.empty((6,), np.uint32)
    first = [a.copy() for a in output_path_cuda(logits, images, 0.5, 5, out=out, scratch=scratch)]
    second = output_path_cuda(logits, images, 0.5, 5, out=out, scratch=scratch)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_allclose(cp.asnumpy(a), cp.asnumpy(b), rtol=1e-6, err_msg=str(seed))

"""normalize_pad_cuda against normalize_pad_ref (padding by edge replication included)."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.normalize_pad import normalize_pad_cuda, normalize_pad_ref

from .cuda_helpers import assert_close, cupy, fresh_rng, poisoned

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1, 16, 16), (2, 17, 33), (3, 200, 200), (1, 5, 1024)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
@pytest.mark.parametrize("multiple", [1, 16])
def test_normalize_pad_cuda_matches_ref(shape: tuple[int, int, int], multiple: int) -> None:
    rng, seed = fresh_rng()
    images = rng.integers(0, 256, shape, dtype=np.uint8)
    mean, std = float(rng.uniform(0.2, 0.6)), float(rng.uniform(0.1, 0.3))
    ref = normalize_pad_ref(images, mean, std, multiple)
    out = poisoned(ref.shape, np.float16)
    got = normalize_pad_cuda(cupy().asarray(images), mean, std, multiple, out=out)
    assert_close(got, ref, seed, "normalize_pad")


def test_normalize_pad_cuda_rejects_bad_arguments() -> None:
    images = cupy().zeros((1, 4, 4), np.uint8)
    with pytest.raises(ValueError, match="std"):
        normalize_pad_cuda(images, 0.5, 0.0)
    with pytest.raises(ValueError, match="uint8"):
        normalize_pad_cuda(images.astype(np.float32), 0.5, 0.2)

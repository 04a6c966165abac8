"""stem_cuda (uint8 → normalise + pad + 3x3 stride-2 conv + ReLU) against stem_ref."""

from __future__ import annotations

import numpy as np
import pytest

from scratchd.kernels.stem import SWEEP_ENV, stem_cuda, stem_ref, stem_sweep

from .cuda_helpers import assert_close, cupy, dev, fresh_rng, half, poisoned


def test_the_sweep_is_1_2_or_4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWEEP_ENV, raising=False)
    assert stem_sweep() == 4
    for mode in ("1", "2", "4"):
        monkeypatch.setenv(SWEEP_ENV, mode)
        assert stem_sweep() == int(mode)
    monkeypatch.setenv(SWEEP_ENV, "3")
    with pytest.raises(ValueError, match=SWEEP_ENV):
        stem_sweep()


@pytest.mark.gpu
@pytest.mark.parametrize("sweep", ["1", "2", "4"])
@pytest.mark.parametrize(
    "case",
    [(1, 1, 1, 24), (2, 17, 33, 24), (1, 200, 200, 24), (3, 31, 16, 5), (1, 64, 48, 8),
     (2, 70, 90, 48), (1, 37, 53, 64)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
def test_stem_cuda_matches_ref(
    case: tuple[int, int, int, int], sweep: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SWEEP_ENV, sweep)
    rng, seed = fresh_rng()
    n, h, w, cout = case
    images = rng.integers(0, 256, (n, h, w), dtype=np.uint8)
    mean, std = float(rng.uniform(0.2, 0.6)), float(rng.uniform(0.1, 0.3))
    wt = half(rng, (3, 3, 1, cout), 1.0 / 3.0)
    b = rng.normal(0, 0.3, cout).astype(np.float32)
    ref = stem_ref(images, mean, std, wt, b)
    out = poisoned(ref.shape, np.float16)
    got = stem_cuda(cupy().asarray(images), mean, std, dev(wt), dev(b, np.float32), out=out)
    assert_close(got, ref, seed, "stem")
    if sweep == "1":
        return
    monkeypatch.setenv(SWEEP_ENV, "1")  # one pixel a thread: the same sums, so the same bits
    one = stem_cuda(cupy().asarray(images), mean, std, dev(wt), dev(b, np.float32))
    same = cupy().asnumpy(got).view(np.uint16) == cupy().asnumpy(one).view(np.uint16)
    assert same.all(), f"seed={seed}: {np.count_nonzero(~same)} elements differ from P=1"


@pytest.mark.gpu
def test_stem_cuda_rejects_bad_arguments() -> None:
    images = cupy().zeros((1, 8, 8), np.uint8)
    w, b = dev(np.zeros((3, 3, 1, 8))), dev(np.zeros(8), np.float32)
    with pytest.raises(ValueError, match="std"):
        stem_cuda(images, 0.5, 0.0, w, b)
    with pytest.raises(ValueError, match="w must have shape"):
        stem_cuda(images, 0.5, 0.2, dev(np.zeros((3, 3, 2, 8))), b)

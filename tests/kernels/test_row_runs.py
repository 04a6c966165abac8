"""row_runs: the reference (CPU) finishes to exactly what ``postprocess`` gives, and the kernels
(gpu-marked) store the reference's records in the reference's order (on overflow too: the
frame's first runs), same counts, run sums within float32 summation error."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from scratchd.kernels.postprocess import finish_runs, postprocess
from scratchd.kernels.row_runs import row_runs_ref, unpack_runs
from scratchd.protocol.image import decode_image

from .cuda_helpers import cupy, fresh_rng

THRESHOLD = 0.5


@given(
    arrays(
        np.float32,
        st.tuples(st.integers(1, 20), st.integers(1, 20)),
        elements=st.sampled_from([0.0, 0.3, 0.5, 0.7, 1.0]),
    ),
    st.integers(1, 6),
)
def test_ref_runs_finish_exactly_like_postprocess(prob: np.ndarray, min_area: int) -> None:
    h, w = prob.shape
    got = row_runs_ref(prob[None], THRESHOLD, h * w)
    row, start, end, sums = unpack_runs(got.runs[0], int(got.count[0]))
    # Stored row-major (unpack_runs does not sort; the kernels are checked against this order).
    assert np.all(np.diff(row * (w + 1) + start) > 0) and np.all(start < end)
    comp = finish_runs(row, start, end, sums, h, w, min_area)
    want = postprocess(prob, THRESHOLD, min_area, 1)
    assert comp.mask is not None and np.array_equal(comp.mask, want.mask)
    # The same boxes with the same scores up to the sums' float32 rounding; components whose
    # scores tie up to that rounding may come in either order (both are "highest first").
    got_boxes, want_boxes = sorted(comp.boxes), sorted(want.boxes)
    assert [b[:4] for b in got_boxes] == [b[:4] for b in want_boxes]
    np.testing.assert_allclose([b[4] for b in got_boxes], [b[4] for b in want_boxes], rtol=1e-6)
    scores = [b[4] for b in comp.boxes]
    assert all(a >= b for a, b in itertools.pairwise(scores))


def test_ref_overflow_keeps_the_true_count_and_the_first_runs() -> None:
    prob = np.zeros((1, 4, 9), np.float32)
    prob[0, :, ::2] = 0.9  # 5 runs per row, 20 in all
    got = row_runs_ref(prob, THRESHOLD, 7)
    assert got.count.tolist() == [20]
    assert got.runs[0, :, :3].tolist() == [[0, 0, 1], [0, 2, 3], [0, 4, 5], [0, 6, 7],
                                           [0, 8, 9], [1, 0, 1], [1, 2, 3]]  # fmt: skip
    assert np.allclose(got.runs[0, :, 3].view(np.float32), 0.9)
    with pytest.raises(ValueError, match="overflowed"):
        unpack_runs(got.runs[0], 20)
    assert finish_runs(*unpack_runs(got.runs[0], 7), 4, 9, 1, paint=False).mask is None


def _compare(prob: np.ndarray, capacity: int, seed: int) -> None:
    from scratchd.kernels.row_runs import row_runs_buffers, row_runs_cuda

    cp = cupy()
    n = prob.shape[0]
    want = row_runs_ref(prob, THRESHOLD, capacity)
    out = row_runs_buffers(n, capacity)
    out.runs.fill(-7)
    out.count.fill(12345)
    got = row_runs_cuda(cp.asarray(prob), THRESHOLD, capacity, out=out)
    runs, count = cp.asnumpy(got.runs), cp.asnumpy(got.count)
    ctx = f"seed={seed} shape={prob.shape} cap={capacity}"
    np.testing.assert_array_equal(count, want.count, err_msg=ctx)
    for i in range(n):
        k = min(int(count[i]), capacity)
        np.testing.assert_array_equal(runs[i, :k, :3], want.runs[i, :k, :3], err_msg=ctx)
        sums = runs[i, :k, 3].view(np.float32).astype(np.float64)
        ref = want.runs[i, :k, 3].view(np.float32).astype(np.float64)
        lengths = np.maximum(runs[i, :k, 2] - runs[i, :k, 1], 1)
        err = np.abs(sums - ref)  # fp32 warp sums vs float64 sums rounded once
        bound = 1e-6 + 2e-6 * np.sqrt(lengths) * np.abs(ref)
        assert np.all(err <= bound), f"{ctx}: frame {i} run-sum error {err.max(initial=0)}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (2, 1, 100), (2, 100, 1), (3, 37, 65), (2, 64, 64), (1, 200, 333),
              (2, 1024, 1024)], ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
def test_row_runs_cuda_matches_ref_on_random_maps(shape: tuple[int, int, int]) -> None:
    rng, seed = fresh_rng()
    prob = (rng.random(shape) ** rng.uniform(0.3, 3.0)).astype(np.float32)
    prob.flat[:: max(prob.size // 7, 1)] = THRESHOLD  # on the threshold: counts as foreground
    _compare(prob, 1 << 16, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", [0.0, 1.0, THRESHOLD], ids=["all-below", "all-above", "at"])
def test_row_runs_cuda_constant_maps(fill: float) -> None:
    prob = np.full((2, 33, 70), fill, np.float32)
    _compare(prob, 64, 0)


@pytest.mark.gpu
def test_row_runs_cuda_overflow_is_flagged() -> None:
    rng, seed = fresh_rng()
    prob = rng.random((3, 40, 50), dtype=np.float32)
    prob[1] = 0.0  # one frame without runs: not flagged
    _compare(prob, 16, seed)


@pytest.mark.gpu
def test_row_runs_cuda_on_real_masks(data_dir: Path) -> None:
    """Real defect shapes: SD-900 masks, softened, as probability maps."""
    rng, seed = fresh_rng()
    files = sorted((data_dir / "sd900" / "masks").glob("Sc_*.png"))[:6]
    masks = np.stack([decode_image(f.read_bytes()) for f in files]).astype(np.float32) / 255
    noise = rng.random(masks.shape, dtype=np.float32) * np.float32(0.3)
    _compare((masks * np.float32(0.8) + noise).astype(np.float32), 4096, seed)

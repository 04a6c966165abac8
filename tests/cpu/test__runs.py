"""cpu/_runs.c: finish_records equals postprocess.finish_runs (the reference and the CPU
path's finish) on the same run records, and refuses records that break their layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from scratchd.cpu import _runs
from scratchd.kernels.postprocess import find_runs, finish_runs
from scratchd.kernels.row_runs import unpack_runs


def records_of(mask: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """The device's records of a mask's runs: row, start, end, float32 bits of the sum."""
    row, start, end = find_runs(mask)
    rec = np.zeros((len(row) + 3, 4), np.int32)  # spare capacity, as a device buffer has
    rec[: len(row), 0], rec[: len(row), 1], rec[: len(row), 2] = row, start, end
    rec[: len(row), 3] = sums[: len(row)].astype(np.float32).view(np.int32)
    return rec


def reference(rec: np.ndarray, count: int, h: int, w: int, min_area: int):
    return finish_runs(*unpack_runs(rec, count), h, w, min_area, paint=True)


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(np.bool_, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40)),
    st.integers(1, 12),
    st.data(),
)
def test_equals_finish_runs_on_any_mask(mask: np.ndarray, min_area: int, data) -> None:
    h, w = mask.shape
    n = int(find_runs(mask)[0].size)
    # run sums with ties (equal scores must keep the reference's order) and spread values
    sums = np.array(data.draw(st.lists(st.sampled_from([0.5, 1.0, 2.25, 7.0, 0.1]), min_size=n,
                                       max_size=n)), np.float64)  # fmt: skip
    rec = records_of(mask, sums)
    want = reference(rec, n, h, w, min_area)
    got_mask = np.full((h, w), 7, np.uint8)  # every pixel is overwritten
    assert _runs.finish_records(rec, n, h, w, min_area, got_mask) == want.boxes
    assert np.array_equal(got_mask, want.mask)
    assert _runs.finish_records(rec, n, h, w, min_area) == want.boxes


def test_a_real_frame_of_scratches_equals_the_reference(data_dir) -> None:
    # masks of real SD-900 defects tiled into one frame: thousands of runs, many components
    from scratchd.protocol.image import decode_image

    paths = sorted((data_dir / "sd900" / "masks").glob("*.png"))[:16]
    tiles = [decode_image(p.read_bytes())[:200, :200] >= 128 for p in paths]
    frame = np.block([tiles[r * 4 : r * 4 + 4] for r in range(4)])
    rng = np.random.default_rng(0)
    n = int(find_runs(frame)[0].size)
    rec = records_of(frame, rng.random(n) * 50)
    h, w = frame.shape
    want = reference(rec, n, h, w, 16)
    got_mask = np.empty((h, w), np.uint8)
    assert n > 1000 and len(want.boxes) > 5
    assert _runs.finish_records(rec, n, h, w, 16, got_mask) == want.boxes
    assert np.array_equal(got_mask, want.mask)


def test_no_runs_no_boxes() -> None:
    mask = np.full((4, 5), 9, np.uint8)
    assert _runs.finish_records(np.zeros((2, 4), np.int32), 0, 4, 5, 1, mask) == []
    assert not mask.any()


@pytest.mark.parametrize(
    ("records", "why"),
    [
        ([[0, 3, 3, 0]], "outside the frame or is empty"),  # empty run
        ([[0, 4, 9, 0]], "outside the frame or is empty"),  # past the width
        ([[5, 0, 1, 0]], "outside the frame or is empty"),  # past the height
        ([[-1, 0, 1, 0]], "outside the frame or is empty"),
        ([[1, 0, 1, 0], [0, 0, 1, 0]], "row-major"),  # rows out of order
        ([[0, 0, 2, 0], [0, 2, 3, 0]], "row-major"),  # touching runs on a row: not maximal
        ([[0, 2, 4, 0], [0, 0, 1, 0]], "row-major"),
    ],
)
def test_records_that_break_the_layout_are_refused(records: list[list[int]], why: str) -> None:
    rec = np.array(records, np.int32)
    with pytest.raises(ValueError, match=why):
        _runs.finish_records(rec, len(rec), 4, 5, 1)


def test_bad_arguments_are_value_errors() -> None:
    rec = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="count"):
        _runs.finish_records(rec, 3, 4, 5, 1)
    with pytest.raises(ValueError, match="int32"):
        _runs.finish_records(rec.astype(np.int64), 0, 4, 5, 1)
    with pytest.raises(ValueError, match="mask"):
        _runs.finish_records(rec, 0, 4, 5, 1, np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="mask"):
        _runs.finish_records(rec, 0, 4, 5, 1, np.zeros((4, 5), np.uint8)[:, ::-1])
    with pytest.raises(ValueError, match="frame"):
        _runs.finish_records(rec, 0, 0, 5, 1)

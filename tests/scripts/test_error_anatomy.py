"""scripts/error_anatomy.py's measures on synthetic masks: the edge band is what its
definition says, and the per-image numbers tell edge errors from region errors."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tests.scripts.test_train import _mod


@settings(max_examples=60, deadline=None)
@given(
    mask=arrays(np.bool_, st.tuples(st.integers(1, 12), st.integers(1, 12))),
    r=st.integers(1, 3),
)
def test_the_edge_band_holds_exactly_the_pixels_within_r_of_both_sides(
    mask: np.ndarray, r: int
) -> None:
    """A pixel is in the band iff its (2r+1)-square, inside the image, holds a mask pixel
    and a background one (the image's border is no edge)."""
    ea = _mod("error_anatomy")
    band = ea.edge_band(mask, r)
    h, w = mask.shape
    for y in range(h):
        for x in range(w):
            window = mask[max(y - r, 0) : y + r + 1, max(x - r, 0) : x + r + 1]
            assert band[y, x] == (window.any() and not window.all())


def _row(pred: np.ndarray, gt: np.ndarray) -> dict:
    ea, data = _mod("error_anatomy"), _mod("train_data")
    e = data.Example("x.png", "sd900/Sc", np.zeros(gt.shape, np.uint8), gt.astype(np.uint8))
    return ea.image_row(pred.astype(np.float32), e, threshold=0.5, min_area=0, window=1)


def test_a_mask_one_pixel_too_wide_loses_iou_only_at_the_edge() -> None:
    ea = _mod("error_anatomy")
    gt = np.zeros((40, 40), bool)
    gt[10:30, 15:25] = True
    row = _row(ea.dilate(gt, 1), gt)
    assert row["iou"] == (20 * 10) / (22 * 12)
    assert row["iou_edge_1"] == 1.0 and row["fp_share"] == 1.0
    assert row["best_threshold_iou"] == row["iou"]  # a 0/1 map: every threshold alike
    perfect = _row(gt, gt)
    assert perfect["iou"] == perfect["iou_edge_1"] == 1.0 and perfect["fp_share"] == 0.0


def test_a_missed_region_is_lost_at_every_edge_tolerance() -> None:
    gt = np.zeros((40, 40), bool)
    gt[5:15, 5:15] = True
    gt[25:35, 25:35] = True
    pred = gt.copy()
    pred[25:35, 25:35] = False  # the second defect missed
    row = _row(pred, gt)
    assert row["iou"] == 0.5 and row["fp_share"] == 0.0
    for r in (1, 2, 3):
        assert row[f"iou_edge_{r}"] == 0.5  # the cores of both regions are kept, one missed

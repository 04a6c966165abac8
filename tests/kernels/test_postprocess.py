"""Post-processing on crafted masks: components, boxes, min_area, verdict, score, entropy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from scratchd.kernels.postprocess import (
    binary_entropy_bits,
    intensity_histogram,
    label_runs,
    peak_local_mean,
    postprocess,
)


def flood_fill_count(mask: np.ndarray) -> tuple[int, np.ndarray]:
    """Independent 8-connected labelling by breadth-first search (slow, obviously right)."""
    h, w = mask.shape
    labels = -np.ones((h, w), int)
    count = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if labels[y, x] >= 0:
            continue
        stack = [(y, x)]
        labels[y, x] = count
        while stack:
            a, b = stack.pop()
            for yy in range(max(a - 1, 0), min(a + 2, h)):
                for xx in range(max(b - 1, 0), min(b + 2, w)):
                    if mask[yy, xx] and labels[yy, xx] < 0:
                        labels[yy, xx] = count
                        stack.append((yy, xx))
        count += 1
    return count, labels


@settings(max_examples=150, deadline=None)
@given(arrays(np.bool_, st.tuples(st.integers(1, 24), st.integers(1, 24))))
def test_components_match_flood_fill(mask: np.ndarray) -> None:
    runs = label_runs(mask)
    count, labels = flood_fill_count(mask)
    assert runs.count == count
    # Same partition: every run's pixels carry one flood-fill label, and run labels map 1:1.
    pairs = {
        (int(lab), int(labels[r, s]))
        for lab, r, s in zip(runs.label, runs.row, runs.start, strict=True)
    }
    assert len(pairs) == count == len({a for a, _ in pairs}) == len({b for _, b in pairs})


def test_boxes_min_area_and_mask_on_crafted_map() -> None:
    prob = np.zeros((20, 30), np.float32)
    prob[2:5, 3:10] = 0.9  # 21 px component
    prob[10, 20] = 0.95  # single pixel: below min_area
    prob[15:19, 25:27] = 0.7  # 8 px component
    prob[14, 24] = 0.6  # diagonal neighbour joins the 8 px one → 9 px
    res = postprocess(prob, threshold=0.5, min_area=5, score_window=1)
    assert res.verdict == "defect"
    assert res.boxes[0] == (3.0, 2.0, 10.0, 5.0, np.float32(0.9).item())
    x0, y0, x1, y1, score = res.boxes[1]
    assert (x0, y0, x1, y1) == (24.0, 14.0, 27.0, 19.0)
    assert abs(score - (8 * 0.7 + 0.6) / 9) < 1e-6
    assert len(res.boxes) == 2
    assert res.mask[10, 20] == 0 and res.mask[3, 5] == 255 and res.mask[14, 24] == 255
    assert set(np.unique(res.mask)) == {0, 255}
    assert int((res.mask == 255).sum()) == 21 + 9
    assert abs(res.score - 0.95) < 1e-6  # peak pixel (window 1), even though it was dropped


def test_clean_map_gives_clean_verdict() -> None:
    prob = np.full((12, 9), 0.1, np.float32)
    prob[4, 4] = 0.8
    res = postprocess(prob, threshold=0.5, min_area=2, score_window=3)
    assert res.verdict == "clean" and res.boxes == [] and not res.mask.any()
    assert abs(res.score - (0.8 + 8 * 0.1) / 9) < 1e-6


def test_peak_local_mean_small_image_uses_whole_image() -> None:
    prob = np.array([[0.2, 0.4]], np.float32)
    assert abs(peak_local_mean(prob, 5) - 0.3) < 1e-7


def test_entropy_and_histogram() -> None:
    assert binary_entropy_bits(np.full((4, 4), 0.5, np.float32)) == 1.0
    assert binary_entropy_bits(np.array([[0.0, 1.0]], np.float32)) < 1e-9
    img = np.array([[0, 3, 4, 255]], np.uint8)
    hist = intensity_histogram(img)
    assert hist.dtype == np.uint32 and hist.shape == (64,)
    assert hist[0] == 2 and hist[1] == 1 and hist[63] == 1 and hist.sum() == 4

"""IoU and AUROC definitions used by ``scratchd eval`` and the trainer."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from scratchd.model.evaluate import Evaluation, auroc, mask_iou

scores = st.lists(st.integers(0, 5).map(float), min_size=1, max_size=12)


@given(scores, scores)
def test_auroc_equals_pairwise_count(pos: list[float], neg: list[float]) -> None:
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    assert abs(auroc(np.array(pos), np.array(neg)) - wins / (len(pos) * len(neg))) < 1e-12


def test_mask_iou_and_summary() -> None:
    gt = np.zeros((4, 4), np.uint8)
    gt[:2, :2] = 255
    pred = np.zeros((4, 4), np.uint8)
    pred[:2, :3] = 255
    assert mask_iou(pred, gt) == 4 / 6
    assert mask_iou(np.zeros((2, 2)), np.zeros((2, 2))) is None
    ev = Evaluation()
    ev.add("t/a", pred, gt, 0.9, "defect")
    ev.add("t/free", pred, np.zeros_like(gt), 0.2, "defect")  # empty gt: no IoU, a negative
    ev.add("t/free", np.zeros_like(gt), np.zeros_like(gt), 0.1, "clean")
    ev.add("u/x", pred, None, 0.5, "defect")  # no ground truth: counted, not scored
    s = ev.summary()
    assert s["images"] == 4
    assert s["iou"] == {"t": round(4 / 6, 4), "t/a": round(4 / 6, 4)}
    assert s["auroc"] == {"t": 1.0}
    assert s["defect_rate"]["t/free"] == 0.5

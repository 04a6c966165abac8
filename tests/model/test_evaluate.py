"""IoU and AUROC definitions used by ``scratchd eval`` and the trainer."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.model.evaluate import Evaluation, auroc, draw_roc, mask_iou

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


def test_decisions_per_group_and_roc(tmp_path: Path) -> None:
    ev = Evaluation()
    gt = np.zeros((4, 4), np.uint8)
    gt[1, 1] = 1
    empty = np.zeros((4, 4), np.uint8)
    # Two defective tiles (one passed), three clean tiles (one rejected), one SD-900 image.
    for score, verdict in ((0.9, "defect"), (0.2, "clean")):
        ev.add("mtile/crack", gt, gt, score, verdict)
    for score, verdict in ((0.8, "defect"), (0.1, "clean"), (0.05, "clean")):
        ev.add("mtile/free", empty, empty, score, verdict)
    ev.add("sd900/Sc", gt, gt, 0.99, "defect")
    s = ev.summary()
    assert s["defect_passed"] == {"mtile": 0.5, "mtile/crack": 0.5, "sd900": 0.0, "sd900/Sc": 0.0}
    assert s["clean_rejected"] == {
        "mtile": pytest.approx(0.3333),
        "mtile/free": pytest.approx(0.3333),
    }
    curves = ev.roc()
    assert set(curves) == {"mtile"}  # sd900 has no clean images
    fpr, tpr, _thr = curves["mtile"]
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    # Trapezoids under the curve give the Mann-Whitney AUROC (no ties here).
    assert np.trapezoid(tpr, fpr) == pytest.approx(s["auroc"]["mtile"], abs=1e-4)
    draw_roc(tmp_path / "roc.png", curves, {"mtile": (1 / 3, 0.5)}, "t")
    assert (tmp_path / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

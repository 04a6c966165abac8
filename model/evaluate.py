"""Segmentation and detection metrics, shared by ``scratchd eval`` and ``scripts/train.py``.

- **IoU** of one image: ``|pred ∩ gt| / |pred ∪ gt|`` of the binary masks. A group's IoU is
  the mean over its *defect images* (non-empty ground truth). Images with an empty ground
  truth (``mtile/free``) have no IoU (their union is empty whenever the prediction is clean,
  and 0 otherwise): they count in the AUROC and the false-positive rate instead.
- Groups are reported as stored (``sd900/Sc``, ``mtile/crack``, …) and pooled by their first
  path component (``sd900``, ``mtile``): the pooled mean is over all defect images of it.
- **AUROC** (image level): the probability that a defect image's score exceeds a clean
  image's (ties count one half), i.e. the Mann-Whitney statistic; computed per top-level
  group that has clean images (``mtile``: tile defects vs ``free``).
- **Decisions** at the model's operating point (its verdicts): per group and pooled per
  top-level group, ``clean_rejected`` is the share of clean images (empty ground truth) given
  a ``defect`` verdict and ``defect_passed`` the share of defective images given ``clean``.
- :meth:`Evaluation.roc` gives each top-level group's ROC curve of the image scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


def mask_iou(pred: np.ndarray, gt: np.ndarray) -> float | None:
    """IoU of two same-shape masks (non-zero = defect); None when the union is empty."""
    if pred.shape != gt.shape:
        raise ValueError(f"mask_iou: shapes differ {pred.shape} vs {gt.shape}")
    p, g = pred != 0, gt != 0
    union = int(np.count_nonzero(p | g))
    return None if union == 0 else int(np.count_nonzero(p & g)) / union


def auroc(positive: np.ndarray, negative: np.ndarray) -> float:
    """Area under the ROC curve of scores (positives should score higher)."""
    pos, neg = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError("auroc needs at least one positive and one negative score")
    scores = np.concatenate([pos, neg])
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    # Average the ranks of tied scores.
    _uniq, inverse = np.unique(scores, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    ranks = (sums / counts)[inverse]
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


@dataclass
class Evaluation:
    """Accumulates per-image results; :meth:`summary` gives the report."""

    ious: dict[str, list[float]] = field(default_factory=dict)
    scores: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)
    defect_verdicts: dict[str, list[bool]] = field(default_factory=dict)
    # group (and top-level group) → [(image is defective, verdict is defect)]
    decisions: dict[str, list[tuple[bool, bool]]] = field(default_factory=dict)
    seconds: float = 0.0
    images: int = 0

    def add(
        self, group: str, pred: np.ndarray, gt: np.ndarray | None, score: float, verdict: str
    ) -> None:
        """One image: predicted mask, ground-truth mask (None: unknown), score, verdict."""
        self.images += 1
        if gt is None:
            return
        top = group.split("/")[0]
        is_defect = bool(np.any(gt))
        self.scores.setdefault(top, []).append((score, is_defect))
        self.defect_verdicts.setdefault(group, []).append(verdict == "defect")
        for g in {group, top}:
            self.decisions.setdefault(g, []).append((is_defect, verdict == "defect"))
        if is_defect:
            iou = mask_iou(pred, gt)
            assert iou is not None  # gt is non-empty, so the union is
            self.ious.setdefault(group, []).append(iou)
            if top != group:
                self.ious.setdefault(top, []).append(iou)

    def summary(self) -> dict[str, Any]:
        iou = {g: round(float(np.mean(v)), 4) for g, v in sorted(self.ious.items())}
        n = {g: len(v) for g, v in sorted(self.ious.items())}
        aucs: dict[str, float] = {}
        for top, rows in sorted(self.scores.items()):
            pos = [s for s, d in rows if d]
            neg = [s for s, d in rows if not d]
            if pos and neg:
                aucs[top] = round(auroc(np.array(pos), np.array(neg)), 4)
        flagged = {g: round(float(np.mean(v)), 4) for g, v in sorted(self.defect_verdicts.items())}
        rejected, passed = {}, {}
        for g, calls in sorted(self.decisions.items()):
            clean = [v for d, v in calls if not d]
            defect = [v for d, v in calls if d]
            if clean:
                rejected[g] = round(float(np.mean(clean)), 4)
            if defect:
                passed[g] = round(1.0 - float(np.mean(defect)), 4)
        return {
            "images": self.images,
            "clean_rejected": rejected,
            "defect_passed": passed,
            "iou": iou,
            "iou_images": n,
            "auroc": aucs,
            "defect_rate": flagged,
            "seconds": round(self.seconds, 3),
            "ms_per_image": round(1000 * self.seconds / max(self.images, 1), 2),
        }

    def roc(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per top-level group with both kinds of images: ``(fpr, tpr, thresholds)``, one
        point per distinct score (an image is called defective when its score is at or
        above the threshold), from (0, 0) to (1, 1)."""
        out = {}
        for top, rows in sorted(self.scores.items()):
            s = np.array([r[0] for r in rows], np.float64)
            d = np.array([r[1] for r in rows], bool)
            if d.all() or not d.any():
                continue
            thr = np.unique(s)[::-1]
            tpr = np.array([np.mean(s[d] >= t) for t in thr])
            fpr = np.array([np.mean(s[~d] >= t) for t in thr])
            out[top] = (
                np.concatenate([[0.0], fpr, [1.0]]),
                np.concatenate([[0.0], tpr, [1.0]]),
                np.concatenate([[np.inf], thr, [-np.inf]]),
            )
        return out


def draw_roc(
    path: Path, curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    operating: dict[str, tuple[float, float]] | None = None, title: str = "",
) -> None:  # fmt: skip
    """The ROC curves (true-positive rate over false-positive rate) as a PNG, one colour per
    group, with each group's operating point (``operating[group] = (fpr, tpr)``) ringed."""
    from PIL import Image, ImageDraw

    size, pad = 520, 60
    img = Image.new("RGB", (size + 2 * pad, size + 2 * pad), "white")
    d = ImageDraw.Draw(img)

    def xy(fpr: float, tpr: float) -> tuple[float, float]:
        return pad + fpr * size, pad + (1 - tpr) * size

    d.rectangle([pad, pad, pad + size, pad + size], outline="black")
    d.line([xy(0, 0), xy(1, 1)], fill="lightgray")
    for v in (0.25, 0.5, 0.75):
        d.text((pad - 30, xy(0, v)[1] - 6), f"{v:.2f}", fill="black")
        d.text((xy(v, 0)[0] - 12, pad + size + 6), f"{v:.2f}", fill="black")
    d.text((pad, 15), title, fill="black")
    d.text((pad + size // 2 - 60, pad + size + 28), "clean parts rejected (FPR)", fill="black")
    d.text((5, pad - 20), "defective parts found (TPR)", fill="black")
    colours = ("crimson", "royalblue", "darkgreen", "darkorange")
    for k, (group, (fpr, tpr, _thr)) in enumerate(sorted(curves.items())):
        colour = colours[k % len(colours)]
        pts = [xy(float(a), float(b)) for a, b in zip(fpr, tpr, strict=True)]
        d.line(pts, fill=colour, width=2)
        d.text((pad + size - 150, pad + size - 20 - 16 * k), group, fill=colour)
        if operating and group in operating:
            x, y = xy(*operating[group])
            d.ellipse([x - 6, y - 6, x + 6, y + 6], outline=colour, width=2)
    img.save(path)

"""Where a model's mask IoU is lost, on the training side's fit and inner splits: at the
masks' edges or in whole regions, by over- or under-segmentation, by the threshold, by the
defect's size. Evidence for choosing the next recipe change (docs/scratchnet2/README.md).

    python scripts/error_anatomy.py --shards .devdata/shards-train \
        --json docs/scratchnet2/error-anatomy.json model/weights/scratchnet.npz

Per group (the SD-900 classes, the tiles) and split, over the defect images, means of:

- ``iou``: the served mask's IoU (the model's own threshold, ``min_area`` and post-processing,
  as ``scratchd eval`` measures it);
- ``iou_edge_r``: the same with every pixel within ``r`` px of the ground truth's edge left
  out of both masks (the band between the mask dilated and eroded by ``r``, square; images
  whose mask lies wholly in the band left out): how much of the loss is edge placement,
  which annotators draw no better than a pixel or two;
- ``fp_share``: false-positive pixels over all wrong pixels (above 0.5: over-segmentation);
- ``best_threshold_iou``: each image at the threshold best for it (an upper bound on what a
  better threshold could buy, not reachable by one threshold);
- ``iou_by_size``: the IoU in terciles of the ground truth's area (small, middle, large);
- ``iou_per_image`` (JSON only): each image's group and IoU, for paired comparisons of two
  models (``scripts/paired_iou.py``).

The fit split is what the model trained on: a fit IoU well above the inner one says
over-fitting, both low says the model or its training falls short.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import Example, inner_split, load_split
from train_report import serving_maps

from scratchd.kernels.postprocess import postprocess
from scratchd.model.evaluate import mask_iou

EDGES = (1, 2, 3)
SWEEP = tuple(np.round(np.arange(0.1, 0.91, 0.05), 2))


def dilate(mask: np.ndarray, r: int) -> np.ndarray:
    """``mask`` (bool) dilated by a (2r+1)-square."""
    p = np.pad(mask, r)
    out = np.zeros_like(mask)
    h, w = mask.shape
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            out |= p[dy : dy + h, dx : dx + w]
    return out


def edge_band(gt: np.ndarray, r: int) -> np.ndarray:
    """Pixels within ``r`` of ``gt``'s edge: dilated and not eroded (erosion = the
    complement's dilation, complemented). The image's border is no edge: a mask running off
    the image is not eroded there."""
    eroded = ~dilate(~gt, r)
    return dilate(gt, r) & ~eroded


def image_row(prob: np.ndarray, e: Example, threshold: float, min_area: int, window: int) -> dict:
    gt = e.mask != 0
    pred = postprocess(prob, threshold, min_area, window).mask != 0
    row: dict[str, float] = {"iou": float(mask_iou(pred, gt) or 0.0), "area": int(gt.sum())}
    for r in EDGES:
        keep = ~edge_band(gt, r)
        iou = mask_iou(pred & keep, gt & keep)  # None: the whole mask lies in the band
        row[f"iou_edge_{r}"] = float("nan") if iou is None else iou
    wrong_fp, wrong_fn = int((pred & ~gt).sum()), int((~pred & gt).sum())
    row["fp_share"] = wrong_fp / max(wrong_fp + wrong_fn, 1)
    row["best_threshold_iou"] = max(
        float(mask_iou(postprocess(prob, float(t), min_area, window).mask != 0, gt) or 0.0)
        for t in SWEEP
    )
    return row


def summarise(rows: list[dict]) -> dict:
    out: dict = {"images": len(rows)}
    for key in ["iou", *(f"iou_edge_{r}" for r in EDGES), "fp_share", "best_threshold_iou"]:
        out[key] = round(float(np.nanmean([r[key] for r in rows])), 4)
    areas = np.array([r["area"] for r in rows])
    cuts = np.quantile(areas, [1 / 3, 2 / 3])
    size = np.digitize(areas, cuts)
    out["iou_by_size"] = {
        name: round(
            float(np.mean([r["iou"] for r, s in zip(rows, size, strict=True) if s == k])), 4
        )
        for k, name in enumerate(("small", "middle", "large"))
        if np.any(size == k)
    }
    out["area_cuts_px"] = [int(c) for c in cuts]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    fit, inner = inner_split(load_split(args.shards, "train")[0])
    record: dict = {"model": str(args.model), "splits": {}}
    cols = ["images", "iou", *(f"iou_edge_{r}" for r in EDGES), "fp_share", "best_threshold_iou"]
    print(f"{'split':6} {'group':10} " + " ".join(f"{c:>18}" for c in cols) + "  iou by size")
    for split, examples in (("fit", fit), ("inner", inner)):
        defects = [e for e in examples if np.any(e.mask)]
        probs, m = serving_maps(args.model, defects)
        record["version"] = m.version
        rows: dict[str, list[dict]] = {}
        per_image = {}
        for prob, e in zip(probs, defects, strict=True):
            row = image_row(prob, e, m.threshold, m.min_area, m.score_window)
            per_image[e.rel] = {"group": e.group, "iou": round(row["iou"], 5)}
            for g in {e.group, e.group.split("/")[0]}:
                rows.setdefault(g, []).append(row)
        record["splits"][split] = {g: summarise(v) for g, v in sorted(rows.items())}
        record.setdefault("iou_per_image", {})[split] = per_image
        for g, s in record["splits"][split].items():
            if "/" in g and not g.startswith("sd900"):
                continue
            cells = " ".join(f"{s[c]:>18}" for c in cols)
            print(f"{split:6} {g:10} {cells}  {s['iou_by_size']}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

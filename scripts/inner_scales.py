"""A model on the training side's inner split at other input scales, and SD-900's per-image
IoU: where a model's steel-strip IoU is lost (docs/scratchnet2/README.md).

    python scripts/inner_scales.py --model FILE --shards .devdata/shards \
        --scales 1 1.25 1.5 1.75 2 --json OUT.json

Each frame is resized bilinearly by the scale, run through the model (its torch mirror,
fp32, CPU), and its logits resized back before the sigmoid; the model's own operating point
post-processes the maps (``train_report.measure``). Prints IoU per group for each scale, then
the distribution of SD-900's per-image IoU at scale 1 and its worst images.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import inner_split, load_split
from train_report import logits_of, measure

from scratchd.model.scratchnet import load_model
from scratchd.model.torchnet import TorchScratchNet, load_weights

BINS = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@torch.no_grad()
def scaled_prob(
    net: TorchScratchNet, image: np.ndarray, scale: float, mean: float, std: float
) -> np.ndarray:
    h, w = image.shape
    x = torch.from_numpy(image.copy()).float()[None, None]
    if scale != 1.0:
        size = (round(h * scale), round(w * scale))
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    logits = logits_of(net, x, mean, std)
    if scale != 1.0:
        logits = F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
    return torch.sigmoid(logits)[0, 0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = load_model(args.model)
    m = model.meta
    net = load_weights(model.weights, model.config)
    _, inner = inner_split(load_split(args.shards, "train")[0])
    record: dict[str, object] = {"model": m.version, "images": len(inner), "scales": {}}
    for scale in args.scales:
        probs = [scaled_prob(net, e.image, scale, m.mean, m.std) for e in inner]
        iou = measure(probs, inner, m.threshold, m.min_area, m.score_window, m.score_threshold)[
            "iou"
        ]
        record["scales"][str(scale)] = iou  # type: ignore[index]
        print(f"scale {scale:<5} " + " ".join(f"{k} {v:.3f}" for k, v in sorted(iou.items())))
    rows = []
    for e in inner:
        if e.group.startswith("sd900"):
            pred = model.predict([e.image])[0].mask > 0
            truth = e.mask > 0
            rows.append((float((pred & truth).sum() / max((pred | truth).sum(), 1)), e.rel,
                         float(truth.mean()), float(pred.mean())))  # fmt: skip
    ious = np.array([r[0] for r in rows])
    counts = np.histogram(ious, bins=BINS)[0].tolist()
    print(f"SD-900 per image: {len(rows)} images, median IoU {np.median(ious):.3f}, "
          f"histogram over {BINS}: {counts}; predicted area larger than true in "
          f"{sum(r[3] > r[2] for r in rows)}")  # fmt: skip
    for iou, rel, true_area, pred_area in sorted(rows)[:5]:
        print(
            f"  {rel}: IoU {iou:.3f}, defect {100 * true_area:.1f} %, "
            f"predicted {100 * pred_area:.1f} %"
        )
    record["sd900_per_image"] = {
        "median": float(np.median(ious)),
        "bins": list(BINS),
        "counts": counts,
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""How much mask IoU a head at 1/f of the frame's resolution can reach at all, on the
training side's inner split: the ground-truth mask itself, area-averaged to 1/f (the best
probability map such a head could output), upsampled bilinearly as serving does and
thresholded at 0.5, against the mask (docs/scratchnet2/README.md).

    python scripts/head_resolution_bound.py --shards .devdata/shards --factors 2 4 \
        --json OUT.json

Prints the mean IoU per group and factor over the inner split's defective images.
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

from scratchd.model.evaluate import mask_iou


def bound_iou(mask: np.ndarray, factor: int) -> float:
    """IoU against ``mask`` of its own area average at ``1/factor``, upsampled back."""
    m = torch.from_numpy(mask.astype(np.float32))[None, None]
    h, w = mask.shape
    hp, wp = -(-h // factor) * factor, -(-w // factor) * factor
    low = F.avg_pool2d(F.pad(m, (0, wp - w, 0, hp - h), mode="replicate"), factor)
    up = F.interpolate(low, size=(hp, wp), mode="bilinear", align_corners=False)
    iou = mask_iou(up[0, 0, :h, :w].numpy() >= 0.5, mask)
    if iou is None:
        raise ValueError("bound_iou: the mask has no defect pixel")
    return iou


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--factors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--inner-fraction", type=float, default=0.15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    train_set, _ = load_split(args.shards, "train")
    _, inner = inner_split(train_set, args.inner_fraction)
    ious: dict[str, dict[str, list[float]]] = {}
    for e in inner:
        if e.mask.any():
            for f in args.factors:
                ious.setdefault(str(f), {}).setdefault(e.group, []).append(bound_iou(e.mask, f))
    table = {
        f: {g: round(float(np.mean(v)), 4) for g, v in sorted(by.items())} for f, by in ious.items()
    }
    for f, by in table.items():
        print(f"1/{f}: " + ", ".join(f"{g} {v}" for g, v in by.items()))
    if args.json:
        args.json.write_text(
            json.dumps({"inner_fraction": args.inner_fraction, "iou": table}, indent=1)
        )


if __name__ == "__main__":
    main()

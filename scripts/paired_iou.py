"""Whether two models' mask IoU differs by more than the inner split's noise: a paired
bootstrap over the images both were scored on (``scripts/error_anatomy.py``'s JSON files).

    python scripts/paired_iou.py docs/scratchnet2/error-anatomy.json \\
        docs/scratchnet2/error-anatomy-D.json --split inner --group sd900 --json OUT.json

Prints, per group, the mean IoU of each, the mean of the per-image differences (B - A), its
bootstrap standard error and 95 % interval (images resampled with replacement, the same
draw for both models: the pairing removes what the images share), and how many images went
each way. An ablation whose interval holds 0 has not shown a difference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

RESAMPLES = 10_000


def paired(a: dict[str, float], b: dict[str, float], seed: int = 0) -> dict[str, Any]:
    """The paired comparison of per-image IoUs ``a`` and ``b`` over their common images."""
    common = sorted(set(a) & set(b))
    if len(common) < 2:
        raise ValueError("fewer than two images in common")
    x = np.array([a[k] for k in common])
    y = np.array([b[k] for k in common])
    d = y - x
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), (RESAMPLES, len(d)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {
        "images": len(common),
        "mean_a": round(float(x.mean()), 4),
        "mean_b": round(float(y.mean()), 4),
        "diff": round(float(d.mean()), 4),
        "se": round(float(means.std(ddof=1)), 4),
        "ci95": [round(float(lo), 4), round(float(hi), 4)],
        "b_better": int((d > 0).sum()),
        "a_better": int((d < 0).sum()),
    }


def of_group(images: dict[str, dict], group: str) -> dict[str, float]:
    """The IoUs of ``images`` (error_anatomy's ``iou_per_image`` of one split) in ``group``
    or below it (``sd900`` holds ``sd900/In``)."""
    return {k: v["iou"] for k, v in images.items()
            if v["group"] == group or v["group"].startswith(group + "/")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--split", default="inner", choices=["fit", "inner"])
    ap.add_argument("--groups", nargs="+", default=["sd900", "sd900/In", "sd900/Pa", "sd900/Sc",
                                                    "mtile"])  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ra, rb = (json.loads(p.read_text()) for p in (args.a, args.b))
    ia, ib = ra["iou_per_image"][args.split], rb["iou_per_image"][args.split]
    out = {"a": ra["version"], "b": rb["version"], "split": args.split, "groups": {}}
    print(f"A = {ra['version']}, B = {rb['version']}, {args.split} split")
    print(
        f"{'group':10} {'images':>6} {'A':>7} {'B':>7} {'B - A':>7} {'se':>7} {'95 % interval':>17}"
    )
    for g in args.groups:
        row = paired(of_group(ia, g), of_group(ib, g))
        out["groups"][g] = row
        lo, hi = row["ci95"]
        print(f"{g:10} {row['images']:>6} {row['mean_a']:7.4f} {row['mean_b']:7.4f} "
              f"{row['diff']:+7.4f} {row['se']:7.4f} [{lo:+.4f}, {hi:+.4f}]")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Several models' probability maps averaged on the training side's inner split: how much an
ensemble (and one of models serving at different scales) would buy, as a bound for what
distillation or a multi-scale network could reach (docs/scratchnet2/README.md).

    python scripts/inner_fusion.py --shards .devdata/shards --json OUT.json \
        model/weights/scratchnet.npz docs/scratchnet2/ablations/G8U.npz

Each model's map is its serving map (``train_report.serving_maps``: its torch mirror, fp32,
CPU, small frames at twice their size where its ``upscale_below`` says so); the mean of the
maps is post-processed at the first model's operating point (``train_report.measure``).
Prints IoU per group, tile AUROC and clean tiles rejected, for each model alone and for
the mean of all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import inner_split, load_split
from train_report import measure, serving_maps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    _, inner = inner_split(load_split(args.shards, "train")[0])
    maps: list[list[np.ndarray]] = []
    metas = []
    for path in args.models:
        probs, m = serving_maps(path, inner)
        maps.append(probs)
        metas.append(m)
    rows = [(m.version, probs, m) for m, probs in zip(metas, maps, strict=True)]
    mean = [np.mean(per_image, axis=0) for per_image in zip(*maps, strict=True)]
    rows.append(("mean of " + " + ".join(m.version for m in metas), mean, metas[0]))
    record = []
    for name, probs, m in rows:
        summary = measure(probs, inner, m.threshold, m.min_area, m.score_window, m.score_threshold)
        iou = {k: v for k, v in sorted(summary["iou"].items()) if "/" not in k or "sd900" in k}
        record.append({"maps": name, "iou": iou, "auroc": summary["auroc"],
                       "clean_rejected": summary["clean_rejected"]})  # fmt: skip
        auc = summary["auroc"].get("mtile", float("nan"))
        rejected = summary["clean_rejected"].get("mtile", float("nan"))
        ious = " ".join(f"{k} {v:.3f}" for k, v in iou.items())
        print(f"{name}: {ious} | AUROC {auc:.3f} | clean rejected {rejected:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"images": len(inner), "rows": record}, indent=1))


if __name__ == "__main__":
    main()

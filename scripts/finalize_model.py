"""Set a trained model's post-processing and test-time views, re-measure it, write it out.

    python scripts/finalize_model.py IN.npz OUT.npz [--shards .devdata/shards]
        [--threshold 0.5] [--min-area 16] [--score-window 1]
        [--views identity flip_h flip_v transpose]

The weights are unchanged. The ``val`` split of the shards is evaluated with the numpy
forward and the new settings, and ``val_metrics`` in the metadata is replaced by the result
(the settings were chosen on that split: a few scalars, no weights; the held-back data is
the real test). Used to produce ``model/weights/scratchnet.npz`` from a training run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import evaluate, load_split

from scratchd.kernels.views import VIEWS
from scratchd.model.scratchnet import ScratchNet, load_model, save_model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--min-area", type=int, default=16)
    ap.add_argument("--score-window", type=int, default=1)
    ap.add_argument("--views", nargs="+", choices=VIEWS, default=list(VIEWS))
    ap.add_argument("--version", default=None, help="new version string (default: keep)")
    args = ap.parse_args()

    model = load_model(args.src)
    meta = dataclasses.replace(
        model.meta,
        threshold=args.threshold,
        min_area=args.min_area,
        score_window=args.score_window,
        views=list(args.views),
        version=args.version or model.meta.version,
    )
    val, _ = load_split(args.shards, "val")
    metrics = evaluate(ScratchNet(model.weights, meta), val)
    metrics["views"] = list(args.views)
    meta = dataclasses.replace(meta, val_metrics=metrics)
    save_model(args.dst, model.weights, meta)
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()

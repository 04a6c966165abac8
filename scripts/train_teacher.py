"""Teacher maps for distillation (``train.py --teacher FILE --distill W``): the mean of
several trained models' serving maps over every image of the fit split, stored as uint8.

    python scripts/train_teacher.py --shards .devdata/shards --out .devdata/teacher.npz \
        model/weights/scratchnet.npz docs/scratchnet2/ablations/G8U.npz

Why: on the inner split the mean of scratchnet-2.0's map (1x) and G8U's (strips at 2x)
reaches SD-900 IoU 0.793 against 0.773 for either alone (``scripts/inner_fusion.py``); a
student trained towards that mean keeps one forward pass.

Each model's map is its serving map (``train_report.serving_maps``, fp32 on the CPU, small
frames at twice their size where its ``upscale_below`` says so). The file is an npz of plain
arrays (no pickle): ``rels`` (one per image, in the fit split's order), ``shapes`` ``[N, 2]``,
``offsets`` ``[N + 1]`` into ``maps`` (every map flattened, uint8 with 255 = 1, quantised to
:data:`LEVELS` levels), and ``meta`` (JSON: the teachers' versions and sha256, the shards'
data hash, ``fit_iou``: the mean map's IoU at 0.5 with the fit split's own masks, the command).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_data import Example, inner_split, load_split

# Steps of 1/15: a soft target within 1/30 of the mean, and the fit split's maps in 1.9 MB
# instead of 8.8 MB at 1/255 (zlib), so they travel to a lent GPU beside the shards.
LEVELS = 16


def encode_maps(rels: list[str], maps: list[np.ndarray], meta: dict[str, object]) -> dict:
    """The npz's arrays for ``maps`` (float probabilities in [0, 1], one per ``rels``)."""
    if len(rels) != len(maps) or len(set(rels)) != len(rels):
        raise ValueError("one map per image, and every image once")
    step = 255 // (LEVELS - 1)
    flat = [
        (np.round(np.clip(np.asarray(m, np.float64), 0, 1) * (LEVELS - 1)) * step)
        .astype(np.uint8)
        .ravel()
        for m in maps
    ]
    offsets = np.zeros(len(maps) + 1, np.int64)
    offsets[1:] = np.cumsum([f.size for f in flat])
    return {
        "rels": np.array(rels, dtype=str),
        "shapes": np.array([m.shape for m in maps], np.int64).reshape(len(maps), 2),
        "offsets": offsets,
        "maps": np.concatenate(flat) if flat else np.zeros(0, np.uint8),
        "meta": np.array(json.dumps(meta)),
    }


def teacher_maps(path: Path, examples: list[Example]) -> tuple[list[np.ndarray], dict]:
    """The uint8 teacher map of each of ``examples`` (matched by ``rel``) and the file's
    metadata; a clear error for an image the file lacks or a map of another shape."""
    with np.load(path, allow_pickle=False) as z:
        rels, shapes, offsets = z["rels"].tolist(), z["shapes"], z["offsets"]
        flat, meta = z["maps"], json.loads(str(z["meta"]))
    if len(offsets) != len(rels) + 1 or shapes.shape != (len(rels), 2):
        raise ValueError(f"{path}: rels, shapes and offsets disagree")
    if offsets[0] != 0 or np.any(np.diff(offsets) != shapes.prod(axis=1)):
        raise ValueError(f"{path}: offsets do not match the shapes")
    if offsets[-1] != flat.size:
        raise ValueError(f"{path}: {flat.size} map bytes, offsets say {offsets[-1]}")
    where = {rel: i for i, rel in enumerate(rels)}
    out = []
    for e in examples:
        i = where.get(e.rel)
        if i is None:
            raise ValueError(f"{path}: no teacher map for {e.rel}")
        if tuple(shapes[i]) != e.image.shape:
            raise ValueError(f"{path}: {e.rel}'s map is {tuple(shapes[i])}, image {e.image.shape}")
        out.append(flat[offsets[i] : offsets[i + 1]].reshape(e.image.shape))
    return out, meta


def main() -> None:
    from train_report import serving_maps

    from scratchd.model.evaluate import mask_iou

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inner-fraction", type=float, default=0.15)
    args = ap.parse_args()
    train_set, data_hash = load_split(args.shards, "train")
    fit, _ = inner_split(train_set, args.inner_fraction)
    total = [np.zeros(e.image.shape, np.float64) for e in fit]
    teachers = []
    for path in args.models:
        probs, m = serving_maps(path, fit)
        for acc, p in zip(total, probs, strict=True):
            acc += p
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        teachers.append({"path": str(path), "version": m.version, "sha256": sha})
        print(f"{m.version}: {len(fit)} maps", flush=True)
    maps = [acc / len(args.models) for acc in total]
    # How far the mean map (at 0.5) is from the fit split's own masks: what the teacher adds
    # beyond the labels (1.0 would be the labels again).
    ious: dict[str, list[float]] = {}
    for e, p in zip(fit, maps, strict=True):
        iou = mask_iou(p >= 0.5, e.mask)
        if e.mask.any() and iou is not None:  # images with a defect
            ious.setdefault(e.group.split("/")[0], []).append(iou)
    fit_iou = {g: round(float(np.mean(v)), 4) for g, v in sorted(ious.items())}
    print(f"the mean map's IoU with the fit split's masks: {fit_iou}")
    meta = {
        "teachers": teachers, "train_data_sha256": data_hash,
        "inner_fraction": args.inner_fraction, "fit_iou": fit_iou,
        "command": shlex.join([sys.executable, *sys.argv]),
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **encode_maps([e.rel for e in fit], maps, meta))
    print(f"{args.out}: {len(fit)} images, {args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

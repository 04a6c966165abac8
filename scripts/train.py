"""Train ScratchNet on shards, calibrate it on an inner split, export the npz model.

    python scripts/train.py --shards .devdata/shards --out OUT [--minutes 14]
        [--stop-minutes 7] [--resume OUT/checkpoint.npz] [--device cuda]

The ``scratchnet-2`` recipe: one forward pass has to carry what four test-time views added.

1. Data: the ``train`` split of the shards only. A deterministic, group-stratified 15 %
   of it (``--inner-fraction``; :func:`train_data.inner_split`) is the *inner split*: never
   fitted, used to compare recipes and to choose the operating point. The project's ``val``
   split is not read here; it is measured once per shipped model with
   ``scratchd eval DATA --split val``.
2. Batches are drawn on the device from images held there (:class:`train_data.GpuImages`):
   crops of 224/256/288 px, half of the defect images' crops near a defect, random scale
   (x0.75..1.33) and rotation (±45°), flips and 90° turns, gamma, contrast, brightness,
   blur, noise, uint8 quantisation. ``--upscale-below N``: images whose longer side is at
   most N pixels are seen at twice their size, and the exported model serves such frames
   the same way (``ModelMeta.upscale_below``).
3. Loss (:mod:`train_losses`): BCE + Lovász hinge per crop on the upsampled logits, deep
   supervision of ``dec2``/``dec1`` (auxiliary heads, not exported), an image-level BCE on
   each crop's top-k logit mean; with ``--ssim W``, W times one minus the SSIM of the main
   head's map and the mask; with ``--teacher MAPS --distill W``, W times a BCE of the
   main head against a teacher's probability map (``train_teacher.py``: the mean of
   several trained models' serving maps over the fit split), cropped as the masks; AdamW,
   warm-up then cosine over ``--minutes`` of *training time* (``--minutes 0``: over
   ``--steps``, reproducible step for step), bf16 autocast on CUDA, EMA of the weights.
4. ``--init CHECKPOINT`` fine-tunes: a new schedule (this command's recipe, fresh optimiser,
   step 0) from that checkpoint's EMA weights; the parent's sha256, steps, seconds and
   commands go into the metadata (``fine_tuned_from``). The architecture may add residual
   blocks to the checkpoint's (one more ``--dilations`` entry: a wider receptive field at
   H/16); they start as the identity (:func:`train_loop.grown_blocks`, ``init_from``).
5. Checkpoint and resume: ``--stop-minutes`` ends this process early (the schedule goes on
   from ``OUT/checkpoint.npz`` with ``--resume``), so one schedule spans several device
   commands. Every process records its command line; steps and training seconds add up.
6. At the end of each process: the EMA model is evaluated on the inner split, the operating
   point is chosen there (pixel threshold, score window, and the image-score threshold
   keeping ``--recall`` of each group's defective images), and ``OUT/scratchnet.npz``
   (views ``identity``), ``OUT/curve.png`` and ``OUT/train_log.json`` are written.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_checkpoint import load_checkpoint, save_checkpoint
from train_data import Augment, Example, GpuImages, inner_split, load_split, sample_weights
from train_loop import (
    CROPS,
    MEMORY_FORMATS,
    OUTSIDE,
    PRECISIONS,
    Recipe,
    Trainer,
)
from train_report import calibrate, draw_curve, measure, predict_probs
from train_teacher import teacher_maps

from scratchd.kernels.postprocess import intensity_histogram
from scratchd.model.net import NetConfig, count_params
from scratchd.model.scratchnet import ModelMeta, ScratchNet, save_model
from scratchd.model.torchnet import TorchScratchNet, export_weights


def evaluate(model: ScratchNet, examples: list[Example]) -> dict[str, Any]:
    """Numpy forward + post-processing over examples (scripts/finalize_model.py)."""
    from scratchd.model.evaluate import Evaluation

    ev = Evaluation()
    for e in examples:
        t = time.perf_counter()
        pred = model.predict([e.image])[0]
        ev.seconds += time.perf_counter() - t
        ev.add(e.group, pred.mask, e.mask, pred.score, pred.verdict)
    return ev.summary()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=14.0, help="the schedule's training time")
    ap.add_argument("--stop-minutes", type=float, default=0.0, help="this process (0: all)")
    ap.add_argument(
        "--steps", type=int, default=1_000_000,
        help="the schedule's length in steps when --minutes is 0 (unused otherwise)",
    )  # fmt: skip
    ap.add_argument("--resume", type=Path, help="checkpoint to go on from")
    ap.add_argument(
        "--init", type=Path,
        help="fine-tune: a new schedule from this checkpoint's weights (its architecture, or "
        "it grown by residual blocks, e.g. one more --dilations entry)",
    )  # fmt: skip
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--widths", type=int, nargs=4, default=[32, 80, 160, 320])
    ap.add_argument("--dec-depth", type=int, default=2)
    ap.add_argument("--depths", type=int, nargs=4, default=[1, 2, 2, 1])
    ap.add_argument("--dilations", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--loss", choices=["bce+lovasz", "bce+dice"], default="bce+lovasz")
    ap.add_argument("--aux", type=float, default=0.4, help="deep supervision weight (0: off)")
    ap.add_argument("--image-loss", type=float, default=0.2, help="top-k image BCE weight")
    ap.add_argument("--geometric", type=float, default=1.0, help="scale/rotation share factor")
    ap.add_argument(
        "--outside", choices=OUTSIDE, default="border",
        help="what a crop larger than its image shows past the edge (train_loop's docstring)",
    )  # fmt: skip
    ap.add_argument("--teacher", type=Path, help="teacher maps (train_teacher.py) to distil")
    ap.add_argument("--distill", type=float, default=0.0, help="weight of the teacher's BCE")
    ap.add_argument("--ssim", type=float, default=0.0, help="weight of the 1 - SSIM term")
    ap.add_argument("--free-weight", type=float, default=0.5, help="sampling weight, clean")
    ap.add_argument("--min-area", type=int, default=16)
    ap.add_argument(
        "--upscale-below", type=int, default=0,
        help="images whose longer side is at most this run at 2x (training and serving)",
    )  # fmt: skip
    ap.add_argument("--recall", type=float, default=0.97, help="defect recall of the decision")
    ap.add_argument("--inner-fraction", type=float, default=0.15)
    ap.add_argument("--eval-device", default="cpu", help="device of the inner-split pass")
    ap.add_argument("--inner-limit", type=int, default=0, help="evaluate only this many (smoke)")
    ap.add_argument("--version", default="scratchnet-2.0")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many first")
    ap.add_argument(
        "--memory-format", choices=sorted(MEMORY_FORMATS), default="channels_last",
        help="activation layout (same arithmetic; scripts/bench_train_step.py times both)",
    )  # fmt: skip
    ap.add_argument(
        "--precision", choices=PRECISIONS, default="bf16",
        help="CUDA arithmetic: bf16 autocast or TF32 (scripts/bench_train_step.py times both)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action="store_true",
        help="the network through torch.compile (scripts/bench_train_step.py times it)",
    )  # fmt: skip
    return ap.parse_args(argv)


def config_of(args: argparse.Namespace) -> NetConfig:
    """The architecture the command line asks for."""
    return NetConfig(
        widths=tuple(args.widths), depths=tuple(args.depths),
        dilations=tuple(args.dilations), dec_depth=args.dec_depth,
    )  # fmt: skip


def recipe_of(args: argparse.Namespace) -> Recipe:
    base = Augment()
    aug = dataclasses.replace(
        base, scale=base.scale * args.geometric, rotate=base.rotate * args.geometric
    )
    return Recipe(
        loss=args.loss, aux=args.aux, image_loss=args.image_loss, min_area=args.min_area,
        batch=args.batch, lr=args.lr, wd=args.wd, warmup=args.warmup, ema=args.ema,
        minutes=args.minutes, steps=args.steps, free_weight=args.free_weight, augment=aug,
        upscale_below=args.upscale_below, outside=args.outside, distill=args.distill,
        ssim=args.ssim,
        teacher=hashlib.sha256(args.teacher.read_bytes()).hexdigest() if args.teacher else "",
    )  # fmt: skip


def gpu_images(
    args: argparse.Namespace, fit: list[Example], data_hash: str, dev: torch.device
) -> tuple[GpuImages, dict[str, Any] | None]:
    """The fit split on the device, with the teacher's maps when distilling, and the
    teacher file's metadata; exits with the reason for a teacher that does not fit."""
    if (args.teacher is None) != (args.distill == 0):
        raise SystemExit("--teacher and --distill (> 0) go together")
    if args.teacher is None:
        return GpuImages(fit, dev, args.upscale_below), None
    try:
        maps, meta = teacher_maps(args.teacher, fit)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{args.teacher}: cannot use as teacher maps: {exc}") from exc
    if meta.get("train_data_sha256") != data_hash:
        raise SystemExit(f"{args.teacher}: made from other training data than --shards")
    return GpuImages(fit, dev, args.upscale_below, maps), meta


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    torch.backends.cudnn.benchmark = True

    train_set, data_hash = load_split(args.shards, "train")
    fit, inner = inner_split(train_set, args.inner_fraction)
    inner_hash = hashlib.sha256("\n".join(sorted(e.rel for e in inner)).encode()).hexdigest()
    pixels = np.concatenate([e.image.ravel() for e in fit])
    mean, std = float(pixels.mean() / 255), float(pixels.std() / 255)
    hist = intensity_histogram(pixels) / len(pixels)
    print(f"train {len(train_set)} = fit {len(fit)} + inner {len(inner)}; "
          f"mean {mean:.4f} std {std:.4f}", flush=True)  # fmt: skip

    cfg = config_of(args)
    recipe = recipe_of(args)
    torch.manual_seed(args.seed)  # the initial weights
    trainer = Trainer(
        TorchScratchNet(cfg), recipe, dev, args.seed, MEMORY_FORMATS[args.memory_format],
        args.precision, args.compile,
    )  # fmt: skip
    if args.resume is not None and args.init is not None:
        raise SystemExit("--resume goes on with a schedule, --init starts one: give one")
    if args.init is not None:
        state = load_checkpoint(args.init, dev)
        parent_cfg = NetConfig.from_json(state["extra"]["architecture"])
        try:
            sha = hashlib.sha256(args.init.read_bytes()).hexdigest()
            trainer.init_from(state, sha, parent_cfg)
        except ValueError as exc:
            raise SystemExit(f"{args.init}: cannot start this architecture from it: {exc}") from exc
    if args.resume is not None:
        state = load_checkpoint(args.resume, dev)
        saved = state["extra"]
        # The schedule's length (--minutes, --steps) may change on resume; nothing else.
        fixed = {k: v for k, v in _recipe_json(recipe).items() if k not in ("minutes", "steps")}
        # Keys a checkpoint predates take their defaults (the recipe it ran).
        was = _recipe_json(Recipe()) | saved["recipe"]
        before = {k: v for k, v in was.items() if k not in ("minutes", "steps")}
        if saved["architecture"] != cfg.to_json() or before != fixed:
            raise SystemExit(f"{args.resume}: architecture or recipe differ from this command")
        trainer.load_state(state)
    trainer.commands.append(shlex.join([sys.executable, *sys.argv]))
    # SIGTERM (scripts/device_sweep.sh's budget, or a user) ends training after the step in
    # progress; the checkpoint, the inner-split pass and the export follow as after
    # --stop-minutes, so a lent machine's time limit does not lose the run.
    signal.signal(signal.SIGTERM, lambda *_: setattr(trainer, "stop_requested", True))
    data, teacher = gpu_images(args, fit, data_hash, dev)
    probs = torch.tensor(sample_weights(fit, args.free_weight), device=dev, dtype=torch.float32)
    stop = 60 * args.stop_minutes if args.stop_minutes > 0 else float("inf")
    if args.profile_steps > 0:
        trainer.profile(data, probs, mean, std, args.profile_steps, args.out / "profile.txt")
    trainer.run(data, probs, mean, std, stop)
    print(f"trained: step {trainer.step}, {trainer.seconds:.0f} s", flush=True)
    extra = {"architecture": cfg.to_json(), "recipe": _recipe_json(recipe)}
    save_checkpoint(args.out / "checkpoint.npz", trainer, extra)

    # Whole images come in ~170 sizes. On the H200 the evaluation on the GPU outlasted
    # 90 s twice (cause not found; per-shape cuDNN autotuning or kernel builds are suspects),
    # while on the CPU it takes 32 s on 2 cores: it runs on the CPU unless told otherwise.
    torch.backends.cudnn.benchmark = False
    ema = trainer.ema.float()
    subset = inner[: args.inner_limit] if args.inner_limit else inner
    maps = predict_probs(ema, subset, mean, std, torch.device(args.eval_device), args.upscale_below)
    cal = calibrate(maps, subset, args.min_area, args.recall)
    inner_metrics = measure(
        maps, subset, cal["threshold"], args.min_area, cal["score_window"], cal["score_threshold"]
    )
    iou = inner_metrics["iou"]
    trainer.evals.append({
        "step": trainer.step, "seconds": trainer.seconds,
        "mean_iou": (iou.get("sd900", 0.0) + iou.get("mtile", 0.0)) / 2,
        "tile_auroc": inner_metrics["auroc"].get("mtile", 0.0),
    })  # fmt: skip
    save_checkpoint(args.out / "checkpoint.npz", trainer, extra)
    print(json.dumps({"calibration": cal, "inner": inner_metrics}), flush=True)

    done = trainer.progress() >= 1.0
    training = {
        "recipe": _recipe_json(recipe),
        "crops": list(CROPS),
        "seed": args.seed,
        "steps": trainer.step,
        "seconds": round(trainer.seconds, 1),
        "warmup_seconds": round(trainer.warmup_seconds, 1),
        "schedule_done": done,
        "commands": trainer.commands,
        "fine_tuned_from": trainer.parent,
        "teacher": teacher,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "train_images": len(train_set),
        "fit_images": len(fit),
        "inner_images": len(inner),
        "inner_sha256": inner_hash,
        "calibration": cal,
        "inner_metrics": inner_metrics,
    }
    meta = ModelMeta(
        version=args.version if done else f"{args.version}-partial",
        architecture=cfg.to_json(),
        mean=mean,
        std=std,
        threshold=cal["threshold"],
        min_area=args.min_area,
        score_window=cal["score_window"],
        histogram=[round(float(v), 6) for v in hist],
        val_metrics={},
        train_data_sha256=data_hash,
        params=count_params(cfg),
        training=training,
        views=["identity"],
        score_threshold=cal["score_threshold"],
        upscale_below=args.upscale_below,
    )
    save_model(args.out / "scratchnet.npz", export_weights(ema.cpu()), meta)
    title = f"{meta.version} {cfg.widths} d{cfg.dec_depth}: {trainer.step} steps"
    draw_curve(args.out / "curve.png", trainer.log, trainer.evals, title)
    log = {"training": training, "log": trainer.log, "evals": trainer.evals}
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))


def _recipe_json(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


if __name__ == "__main__":
    main()

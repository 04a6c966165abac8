"""Train ScratchNet on shards, export the npz model and evaluate it with the numpy forward.

    python scripts/train.py --shards .devdata/shards --out OUT [--minutes 5] [--device cuda]

Reads the ``train`` split only (``val`` is held out and reported). Steps:

1. decode every record once (``decode_image``) into memory; compute the training intensity
   histogram, mean/std and a SHA-256 over the training records' bytes (the data's identity);
2. sample batches (fixed seed): a random square crop (192, 224 or 256 px per step; smaller
   images are edge-padded), half of the crops of defect images centred near a defect pixel;
   on the device: flips, rot90, gamma/contrast/brightness jitter, Gaussian noise;
3. BCE + soft Dice on the logits upsampled to the crop (the deployed head), AdamW with a
   cosine schedule after a warm-up, bf16 autocast on CUDA, an EMA of the weights;
4. ``--minutes`` bounds training time: the cosine schedule runs on elapsed time, not steps,
   so it ends on time whatever the device's speed (``--steps`` caps the count; with
   ``--minutes 0`` the schedule runs on steps and the run is reproducible step for step);
5. the EMA model is folded (``fold_bn``) into numpy weights, evaluated on ``val`` with the
   numpy forward and post-processing (IoU per group, AUROC tile defects vs free), and saved
   as ``OUT/scratchnet.npz`` with its metadata; ``OUT/train_log.json`` has the loss curve.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from scratchd.dataset.shard import open_shards
from scratchd.kernels.postprocess import intensity_histogram
from scratchd.model.evaluate import Evaluation
from scratchd.model.net import NetConfig, count_params
from scratchd.model.scratchnet import ModelMeta, ScratchNet, save_model
from scratchd.model.torchnet import TorchScratchNet, export_weights, full_logits
from scratchd.protocol.image import decode_image

CROPS = (192, 224, 256)
VERSION_PREFIX = "scratchnet-1"


@dataclass
class Example:
    rel: str
    group: str
    image: np.ndarray  # [H, W] uint8
    mask: np.ndarray  # [H, W] uint8 0/1
    defect_yx: np.ndarray  # [K, 2] defect pixel coordinates (K may be 0)


def load_split(shards: Path, split: str) -> tuple[list[Example], str]:
    """Decoded examples of one split and the SHA-256 of their stored bytes."""
    digest = hashlib.sha256()
    out: list[Example] = []
    with open_shards(shards) as ss:
        for i in ss.indices(split=split):
            rec = ss[i]
            digest.update(rec.meta.rel.encode())
            digest.update(rec.image)
            image = decode_image(rec.image)
            if rec.mask is None:
                raise ValueError(f"{rec.meta.rel}: training needs a mask")
            digest.update(rec.mask)
            mask = (decode_image(rec.mask) > 127).astype(np.uint8)
            yx = np.argwhere(mask)[:: max(1, int(mask.sum()) // 512)]
            out.append(Example(rec.meta.rel, rec.meta.group, image, mask, yx))
    return out, digest.hexdigest()


def sample_weights(examples: list[Example]) -> np.ndarray:
    """Sampling probability per example: tile defects are rarer and harder, so drawn more."""
    w = np.array(
        [
            0.5 if e.group == "mtile/free" else 2.0 if e.group.startswith("mtile/") else 1.0
            for e in examples
        ]
    )
    return w / w.sum()


def crop_batch(
    examples: list[Example], idx: np.ndarray, size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``[B, size, size]`` uint8 images and masks: random crops, edge-padded when small."""
    imgs = np.empty((len(idx), size, size), np.uint8)
    masks = np.empty((len(idx), size, size), np.uint8)
    for j, i in enumerate(idx):
        e = examples[i]
        img, mask = e.image, e.mask
        h, w = img.shape
        ph, pw = max(size - h, 0), max(size - w, 0)
        if ph or pw:
            top, left = rng.integers(0, ph + 1), rng.integers(0, pw + 1)
            pad = ((top, ph - top), (left, pw - left))
            img, mask = np.pad(img, pad, mode="edge"), np.pad(mask, pad, mode="edge")
            yx = e.defect_yx + np.array([top, left])
        else:
            yx = e.defect_yx
        h, w = img.shape
        if len(yx) and rng.random() < 0.5:
            cy, cx = yx[rng.integers(len(yx))]
            y0 = int(np.clip(cy - rng.integers(size // 8, size - size // 8), 0, h - size))
            x0 = int(np.clip(cx - rng.integers(size // 8, size - size // 8), 0, w - size))
        else:
            y0, x0 = int(rng.integers(0, h - size + 1)), int(rng.integers(0, w - size + 1))
        imgs[j] = img[y0 : y0 + size, x0 : x0 + size]
        masks[j] = mask[y0 : y0 + size, x0 : x0 + size]
    return imgs, masks


def augment(
    x: torch.Tensor, y: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Geometric and photometric augmentation of ``x`` in [0, 1] and mask ``y`` ``[B, 1, S, S]``."""
    b, dev = x.shape[0], x.device

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=dev)

    for dims, p in (((3,), 0.5), ((2,), 0.5)):
        flip = (rand(b) < p).view(b, 1, 1, 1)
        x, y = torch.where(flip, x.flip(dims), x), torch.where(flip, y.flip(dims), y)
    rot = (rand(b) < 0.5).view(b, 1, 1, 1)
    x = torch.where(rot, x.transpose(2, 3), x)
    y = torch.where(rot, y.transpose(2, 3), y)
    gamma = torch.exp((rand(b, 1, 1, 1) - 0.5) * 0.8)  # 0.67 .. 1.49
    x = x.clamp(0, 1) ** gamma
    contrast = 0.7 + 0.6 * rand(b, 1, 1, 1)
    brightness = (rand(b, 1, 1, 1) - 0.5) * 0.3
    mean = x.mean(dim=(2, 3), keepdim=True)
    x = (x - mean) * contrast + mean + brightness
    sigma = 0.03 * rand(b, 1, 1, 1) * (rand(b, 1, 1, 1) < 0.5)
    x = x + sigma * torch.randn(x.shape, generator=gen, device=dev)
    # Quantise like a camera would: the deployed model only ever sees uint8 frames.
    return (x.clamp(0, 1) * 255).round() / 255, y


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BCE plus soft Dice over the whole batch (empty-mask crops contribute through BCE)."""
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    inter = (p * target).sum()
    dice = 1 - (2 * inter + 1) / (p.sum() + target.sum() + 1)
    return bce + dice


def ema_pairs(
    ema: torch.nn.Module, model: torch.nn.Module
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Matching state tensors of the EMA and the model: floating (averaged), others (copied)."""
    pairs = list(zip(ema.state_dict().values(), model.state_dict().values(), strict=True))
    floats = [(e, m) for e, m in pairs if e.dtype.is_floating_point]
    ints = [(e, m) for e, m in pairs if not e.dtype.is_floating_point]
    return (
        [e for e, _ in floats],
        [m for _, m in floats],
        [e for e, _ in ints],
        [m for _, m in ints],
    )


def train(
    args: argparse.Namespace, train_set: list[Example], mean: float, std: float
) -> tuple[TorchScratchNet, dict[str, Any]]:
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True
    rng = np.random.default_rng(args.seed)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    w0, w1, w2, w3 = args.widths
    cfg = NetConfig(widths=(w0, w1, w2, w3), dec_depth=args.dec_depth)
    model = TorchScratchNet(cfg).to(dev)
    for p in model.parameters():
        if p.ndim == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)
    ema = copy.deepcopy(model).eval()
    decay_params = [p for n, p in model.named_parameters() if p.ndim > 1]
    other = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": args.wd}, {"params": other, "weight_decay": 0}],
        lr=args.lr,
    )
    probs = sample_weights(train_set)
    amp = dev.type == "cuda"
    budget = args.minutes * 60

    def next_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = rng.choice(len(train_set), size=args.batch, p=probs)
        imgs, masks = crop_batch(train_set, idx, CROPS[step % len(CROPS)], rng)
        x, y = torch.from_numpy(imgs), torch.from_numpy(masks)
        return (x.pin_memory(), y.pin_memory()) if amp else (x, y)

    ema_float, model_float, ema_int, model_int = ema_pairs(ema, model)
    log: list[dict[str, float]] = []
    step, progress = 0, 0.0
    t0 = time.perf_counter()
    # One worker thread crops the next batch while the device runs this one (sequential
    # submission keeps the rng draws in a fixed order).
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(next_batch, 0)
        while progress < 1.0 and step < args.steps:
            elapsed = time.perf_counter() - t0
            progress = elapsed / budget if budget > 0 else step / args.steps
            cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
            lr_scale = min(1.0, (step + 1) / args.warmup) * cosine
            for g in opt.param_groups:
                g["lr"] = args.lr * lr_scale
            imgs, masks = pending.result()
            pending = pool.submit(next_batch, step + 1)
            x = imgs.to(dev, non_blocking=True)[:, None].float() / 255
            y = masks.to(dev, non_blocking=True)[:, None].float()
            x, y = augment(x, y, gen)
            x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                logits = full_logits(model, x)
            loss = loss_fn(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            decay = min(args.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(ema_float, model_float, 1 - decay)
                for e, m in zip(ema_int, model_int, strict=True):
                    e.copy_(m)
            step += 1
            if step % 200 == 0:
                entry = {"step": step, "loss": float(loss.detach()), "lr": args.lr * lr_scale,
                         "seconds": time.perf_counter() - t0}  # fmt: skip
                log.append(entry)
                if step % 2000 == 0:
                    print(json.dumps(entry), flush=True)
    total = step
    info = {"steps": total, "seconds": round(time.perf_counter() - t0, 1), "log": log}
    return ema.cpu().float(), info


def evaluate(model: ScratchNet, examples: list[Example]) -> dict[str, Any]:
    """Numpy forward + post-processing over held-out examples."""
    ev = Evaluation()
    for e in examples:
        t = time.perf_counter()
        pred = model.predict([e.image])[0]
        ev.seconds += time.perf_counter() - t
        ev.add(e.group, pred.mask, e.mask, pred.score, pred.verdict)
    return ev.summary()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=Path, default=Path(".devdata/shards"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--minutes", type=float, default=5.0, help="time budget; the cosine follows it (0: --steps)"
    )
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=300, help="linear LR warm-up steps (timed)")
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--widths", type=int, nargs=4, default=[48, 96, 192, 384])
    ap.add_argument("--dec-depth", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--min-area", type=int, default=16)
    ap.add_argument("--score-window", type=int, default=5)
    ap.add_argument("--val-limit", type=int, default=0, help="evaluate only this many (smoke)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    train_set, data_hash = load_split(args.shards, "train")
    val_set, _ = load_split(args.shards, "val")
    pixels = np.concatenate([e.image.ravel() for e in train_set])
    mean, std = float(pixels.mean() / 255), float(pixels.std() / 255)
    hist = intensity_histogram(pixels) / len(pixels)  # the bins the workers count
    print(f"train {len(train_set)} val {len(val_set)} mean {mean:.4f} std {std:.4f}", flush=True)

    torch_model, info = train(args, train_set, mean, std)
    weights = export_weights(torch_model)
    cfg = torch_model.cfg
    meta = ModelMeta(
        version=f"{VERSION_PREFIX}+{data_hash[:12]}.s{args.seed}",
        architecture=cfg.to_json(),
        mean=mean,
        std=std,
        threshold=args.threshold,
        min_area=args.min_area,
        score_window=args.score_window,
        histogram=[round(float(v), 6) for v in hist],
        val_metrics={},
        train_data_sha256=data_hash,
        params=count_params(cfg),
        training={k: v for k, v in info.items() if k != "log"}
        | {
            "seed": args.seed,
            "batch": args.batch,
            "lr": args.lr,
            "crops": list(CROPS),
            "train_images": len(train_set),
            "device": args.device,
        },
    )
    val = val_set[: args.val_limit] if args.val_limit else val_set
    metrics = evaluate(ScratchNet(weights, meta), val)
    print(json.dumps(metrics), flush=True)
    meta = dataclasses.replace(meta, val_metrics=metrics)
    save_model(args.out / "scratchnet.npz", weights, meta)
    (args.out / "train_log.json").write_text(json.dumps({"info": info, "val": metrics}, indent=1))


if __name__ == "__main__":
    main()

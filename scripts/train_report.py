"""Measuring and calibrating a training run (scripts/train.py): inner-split metrics, the
operating point, and the loss/metric curve as a PNG.

- :func:`predict_probs` runs the torch model (fp32, eval mode) over whole images on the
  training device, exactly as the deployed head does (replicate-pad to 16, bilinear 2x,
  crop, sigmoid);
- :func:`measure` post-processes those maps with the numpy code the daemon uses and returns
  :meth:`scratchd.model.evaluate.Evaluation.summary` (IoU, AUROC, clean parts rejected and
  defective parts passed per group);
- :func:`calibrate` picks, on the inner split only, the pixel threshold (best mean of the
  SD-900 and tile IoU), the score window (best tile AUROC) and the image-score threshold:
  the highest one at which every top-level group keeps at least ``recall`` of its defective
  images (``score >= score_threshold`` means "defect");
- :func:`draw_curve` writes the training loss, learning rate and inner-split metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from train_data import Example

from scratchd.kernels.normalize_pad import padded_size
from scratchd.kernels.postprocess import peak_local_mean, postprocess
from scratchd.model.evaluate import Evaluation, auroc
from scratchd.model.scratchnet import ModelMeta, decide, load_model
from scratchd.model.torchnet import TorchScratchNet, full_logits, load_weights

THRESHOLDS = (0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65)
WINDOWS = (1, 3, 5, 9, 15)


@torch.no_grad()
def logits_of(model: TorchScratchNet, x: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """The deployed head's logits ``[1, 1, h, w]`` (fp32) of grey values ``x`` ``[1, 1, h, w]``
    (0..255 floats): normalised, replicate-padded to 16, the net, bilinear 2x, cropped."""
    h, w = x.shape[-2:]
    x = x * (1.0 / (255.0 * std)) + (-mean / std)
    x = F.pad(x, (0, padded_size(w) - w, 0, padded_size(h) - h), mode="replicate")
    return full_logits(model, x.contiguous(memory_format=torch.channels_last))[:, :, :h, :w].float()


@torch.no_grad()
def predict_probs(
    model: TorchScratchNet, examples: list[Example], mean: float, std: float,
    device: torch.device, upscale_below: int = 0,
) -> list[np.ndarray]:  # fmt: skip
    """Each example's probability map; images whose longer side is at most
    ``upscale_below`` run at twice their size and are averaged back per 2x2 block, as
    ``ScratchNet.forward`` does."""
    model = model.to(device).eval()
    out = []
    for e in examples:
        x = torch.from_numpy(e.image.copy()).to(device).float()[None, None]
        up = 0 < max(e.image.shape) <= upscale_below
        if up:
            x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
            x = x.round().clamp(0, 255)
        prob = torch.sigmoid(logits_of(model, x, mean, std))
        if up:
            prob = F.avg_pool2d(prob, 2)
        out.append(prob[0, 0].cpu().numpy())
    return out


def serving_maps(path: Path, examples: list[Example]) -> tuple[list[np.ndarray], ModelMeta]:
    """The probability maps a saved model serves for ``examples`` (its torch mirror, fp32 on
    the CPU, small frames at twice their size where its ``upscale_below`` says so) and its
    metadata."""
    model = load_model(path)
    m = model.meta
    net = load_weights(model.weights, model.config)
    return predict_probs(net, examples, m.mean, m.std, torch.device("cpu"), m.upscale_below), m


def measure(
    probs: list[np.ndarray], examples: list[Example], threshold: float, min_area: int,
    score_window: int, score_threshold: float | None,
) -> dict[str, Any]:  # fmt: skip
    ev = Evaluation()
    for prob, e in zip(probs, examples, strict=True):
        post = postprocess(prob, threshold, min_area, score_window)
        verdict = decide(post.score, bool(post.boxes), score_threshold)
        ev.add(e.group, post.mask, e.mask, post.score, verdict)
    return ev.summary()


def score_threshold_for(scores: dict[str, list[float]], recall: float) -> float:
    """The highest threshold at which each group (defective images' scores) keeps at least
    ``recall`` of its images at or above it."""
    best = 1.0
    for values in scores.values():
        s = np.sort(np.asarray(values, np.float64))
        misses = math.floor((1.0 - recall) * len(s) + 1e-9)
        best = min(best, float(s[misses]))
    return best


def calibrate(
    probs: list[np.ndarray], examples: list[Example], min_area: int, recall: float
) -> dict[str, Any]:
    """The operating point chosen on these (inner-split) examples."""
    ious = {}
    for t in THRESHOLDS:
        s = measure(probs, examples, t, min_area, 1, None)["iou"]
        ious[t] = (s.get("sd900", 0.0) + s.get("mtile", 0.0)) / 2
    threshold = max(THRESHOLDS, key=lambda t: (ious[t], -abs(t - 0.5)))
    defect = [bool(e.mask.any()) for e in examples]
    tops = [e.group.split("/")[0] for e in examples]
    aucs: dict[int, float] = {}
    scores_by_window: dict[int, list[float]] = {}
    for wnd in WINDOWS:
        sc = [peak_local_mean(p, wnd) for p in probs]
        scores_by_window[wnd] = sc
        per_top = []
        for top in sorted(set(tops)):
            pos = [s for s, d, t in zip(sc, defect, tops, strict=True) if t == top and d]
            neg = [s for s, d, t in zip(sc, defect, tops, strict=True) if t == top and not d]
            if pos and neg:
                per_top.append(auroc(np.array(pos), np.array(neg)))
        aucs[wnd] = float(np.mean(per_top)) if per_top else 0.0
    window = max(WINDOWS, key=lambda w: (round(aucs[w], 4), -w))
    by_top: dict[str, list[float]] = {}
    for s, d, t in zip(scores_by_window[window], defect, tops, strict=True):
        if d:
            by_top.setdefault(t, []).append(s)
    score_threshold = score_threshold_for(by_top, recall)
    return {
        "threshold": threshold,
        "score_window": window,
        # Rounded down: rounding up could pass a defect the threshold was chosen to catch.
        "score_threshold": math.floor(score_threshold * 1e6) / 1e6,
        "recall_target": recall,
        "iou_by_threshold": {str(t): round(v, 4) for t, v in ious.items()},
        "auroc_by_window": {str(w): round(v, 4) for w, v in aucs.items()},
    }


W, H, PAD = 900, 420, 60


def draw_curve(path: Path, log: list[dict[str, float]], evals: list[dict[str, Any]], title: str):
    """Loss (log scale, left axis) and LR (dashed, scaled) over training seconds, with the
    inner-split mean IoU and tile AUROC at each evaluation (dots, right axis 0..1)."""
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    x0, x1, y0, y1 = PAD, W - PAD, H - PAD, PAD
    d.rectangle([x0, y1, x1, y0], outline="black")
    d.text((x0, 10), title, fill="black")
    if not log:
        img.save(path)
        return
    tmax = max(e["seconds"] for e in log) or 1.0
    losses = np.log10(np.maximum([e["loss"] for e in log], 1e-6))
    lo, hi = float(losses.min()), float(losses.max()) + 1e-6
    lrmax = max(e["lr"] for e in log) or 1.0

    def px(t: float) -> float:
        return x0 + (x1 - x0) * t / tmax

    def py(v: float, vlo: float, vhi: float) -> float:
        return y0 - (y0 - y1) * (v - vlo) / (vhi - vlo)

    pts = [(px(e["seconds"]), py(v, lo, hi)) for e, v in zip(log, losses, strict=True)]
    d.line(pts, fill="royalblue", width=2)
    lr_pts = [(px(e["seconds"]), py(e["lr"] / lrmax, 0, 1)) for e in log]
    for a, b in zip(lr_pts[::2], lr_pts[1::2], strict=False):
        d.line([a, b], fill="gray", width=1)
    for ev in evals:
        x = px(min(ev["seconds"], tmax))
        for key, colour in (("mean_iou", "darkgreen"), ("tile_auroc", "crimson")):
            y = py(ev[key], 0, 1)
            d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
            d.text((x + 6, y - 6), f"{ev[key]:.3f}", fill=colour)
    d.text((x0, y0 + 8), "0 s", fill="black")
    d.text((x1 - 60, y0 + 8), f"{tmax:.0f} s", fill="black")
    d.text((5, y1), f"{10**hi:.3g}", fill="royalblue")
    d.text((5, y0 - 10), f"{10**lo:.3g}", fill="royalblue")
    legend = "loss (log, blue)  lr (grey)  inner mean IoU (green)  inner tile AUROC (red)"
    d.text((x0 + 150, y0 + 8), legend, fill="black")
    img.save(path)

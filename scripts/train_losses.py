"""The losses of scripts/train.py's training loop (train_loop.py), each over the pixels of a
0/1 ``weight`` (None: every pixel; ``--outside serve`` scores an image's own pixels only).

- **Loss** (``--loss``): ``bce+lovasz`` (default) is BCE plus the Lovász hinge per crop
  (Berman et al. 2018: a convex surrogate of each image's IoU, the metric we report; on a
  crop without defect it penalises the highest logit, i.e. a false alarm); ``bce+dice`` is
  the scratchnet-1 loss (BCE plus soft Dice over the batch).
- **Image loss** (``--image-loss W``): BCE of each crop's top-k mean logit against "the crop
  holds at least ``min_area`` defect pixels" (crops with fewer, but some, are ignored), so
  the peak of the map — what the image score reads — separates clean from defective parts.
- **SSIM** (``--ssim W``): W times one minus the structural similarity of the main head's
  probability map and the mask (11-px Gaussian windows, as BASNet's hybrid loss; Qin et al.
  2019), which weighs a window's structure, so a defect's edge, rather than its pixel count:
  on the strips the inner split loses about 0.08 IoU within one pixel of the masks' edges
  (``scripts/error_anatomy.py``).
- **Distillation** (``--distill W``): :func:`weighted_bce` towards a teacher's soft map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_C1, SSIM_C2 = 0.01**2, 0.03**2  # for values in [0, 1]


def lovasz_hinge(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over images of the Lovász hinge; ``logits``, ``target`` ``[B, P]``. Pixels of
    ``weight`` 0 count as absent: sorted last with no error and no defect, they change
    neither the sum nor any prefix's Jaccard index."""
    signs = 2 * target - 1
    errors = 1 - logits * signs
    if weight is not None:
        errors = torch.where(weight > 0, errors, -1.0)
        target = target * (weight > 0)
    errors_sorted, perm = torch.sort(errors, dim=1, descending=True)
    gt = torch.gather(target, 1, perm)
    gts = gt.sum(dim=1, keepdim=True)
    inter = gts - gt.cumsum(dim=1)
    union = gts + (1 - gt).cumsum(dim=1)
    jaccard = 1 - inter / union
    grad = torch.cat([jaccard[:, :1], jaccard[:, 1:] - jaccard[:, :-1]], dim=1)
    return (F.relu(errors_sorted) * grad).sum(dim=1).mean()


def seg_loss(
    logits: torch.Tensor, target: torch.Tensor, kind: str, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits``, ``target`` and the 0/1 ``weight`` (None: every pixel) ``[B, 1, S, S]``."""
    bce = weighted_bce(logits, target, weight)
    if weight is not None:
        target = target * weight
    if kind == "bce+dice":
        p = torch.sigmoid(logits) if weight is None else torch.sigmoid(logits) * weight
        inter = (p * target).sum()
        return bce + 1 - (2 * inter + 1) / (p.sum() + target.sum() + 1)
    if kind == "bce+lovasz":
        w = None if weight is None else weight.flatten(1)
        return bce + lovasz_hinge(logits.flatten(1), target.flatten(1), w)
    raise ValueError(f"unknown loss {kind!r}")


def weighted_bce(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean BCE of ``logits`` against ``target`` probabilities (0/1 labels, or a teacher's
    soft map for distillation: its gradient ``sigmoid(logits) - target`` pulls each pixel
    towards the teacher's answer) over the pixels of ``weight`` 1 (None: every pixel, with
    no weights built); all ``[B, 1, S, S]``."""
    if weight is None:
        return F.binary_cross_entropy_with_logits(logits, target)
    bce = F.binary_cross_entropy_with_logits(logits, target, weight, reduction="sum")
    return bce / weight.sum().clamp(min=1)


def image_loss(
    logits: torch.Tensor, target: torch.Tensor, k: int, min_area: int,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """BCE of the top-``k`` mean logit per crop against 'has >= min_area defect pixels',
    both over the pixels of ``weight`` 1 (None: every pixel)."""
    if weight is not None:
        logits = torch.where(weight > 0, logits, torch.finfo(logits.dtype).min)
        target = target * weight
    top = logits.flatten(1).topk(k, dim=1).values.mean(dim=1)
    area = target.flatten(1).sum(dim=1)
    label = (area >= min_area).float()
    weight = ((area == 0) | (area >= min_area)).float()
    return F.binary_cross_entropy_with_logits(top, label, weight=weight)


def ssim_loss(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``1 - SSIM(sigmoid(logits), target)``, the SSIM map averaged over the pixels of
    ``weight`` 1; all ``[B, 1, S, S]``. Both maps are zeroed outside ``weight`` first, so what
    the logits say there changes nothing."""
    p = torch.sigmoid(logits.float())
    t = target.float()
    if weight is not None:
        p, t = p * weight, t * weight
    x = torch.arange(SSIM_WINDOW, dtype=p.dtype, device=p.device) - SSIM_WINDOW // 2
    g = torch.exp(-(x**2) / (2 * SSIM_SIGMA**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :])[None, None]

    def blur(v: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(v, [SSIM_WINDOW // 2] * 4, mode="replicate"), kernel)

    # fp32 even under a caller's autocast: the variances are differences of close moments.
    with torch.autocast(p.device.type, enabled=False):
        mp, mt = blur(p), blur(t)
        vp, vt, cov = blur(p * p) - mp * mp, blur(t * t) - mt * mt, blur(p * t) - mp * mt
        num = (2 * mp * mt + SSIM_C1) * (2 * cov + SSIM_C2)
        den = (mp * mp + mt * mt + SSIM_C1) * (vp + vt + SSIM_C2)
        sim = num / den
    if weight is None:
        return 1 - sim.mean()
    return 1 - (sim * weight).sum() / weight.sum().clamp(min=1)

"""Training data for scripts/train.py: shards → examples, the inner split, GPU batches.

- :func:`load_split` decodes one split of the shards (and hashes the stored bytes);
- :func:`inner_split` carves a deterministic, group-stratified share of the *training* side
  out for choosing recipes and thresholds (the project's ``val`` split stays untouched, and
  is measured once per shipped model);
- :class:`GpuImages` holds every training image on the device, edge-padded to one canvas,
  and draws whole batches there: crop centres (half of the defect images' crops near a
  defect pixel), scale and rotation through one ``grid_sample``, exact flips and transposes,
  then photometric changes (gamma, contrast, brightness, blur, noise, uint8 quantisation).
  Each batch also says which crop pixels are the image's own (:attr:`Batch.scored`) and
  which the serving model's input would hold at all (:attr:`Batch.seen`: the image and its
  edge padding to a multiple of 16; past that, serving's convolutions see zeros), so a
  crop larger than its image can be trained as serving runs it. Given teacher maps
  (:mod:`train_teacher`), each batch carries them cropped and augmented as the masks are
  (:attr:`Batch.teacher`), for distillation.
  Nothing of a batch touches the CPU, so the CPUs are no bottleneck and several training
  processes can share one GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from scratchd.dataset.shard import open_shards
from scratchd.kernels.normalize_pad import padded_size
from scratchd.protocol.image import decode_image

Rand = Callable[..., torch.Tensor]
MAX_DEFECT_POINTS = 512  # defect pixels kept per image for defect-centred crops


@dataclass
class Example:
    rel: str
    group: str
    image: np.ndarray  # [H, W] uint8
    mask: np.ndarray  # [H, W] uint8 0/1


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
            out.append(Example(rec.meta.rel, rec.meta.group, image, mask))
    return out, digest.hexdigest()


def inner_split(
    examples: list[Example], fraction: float = 0.15
) -> tuple[list[Example], list[Example]]:
    """``(fit, inner)``: per group, the ``round(fraction * n)`` examples whose BLAKE2b of
    ``"inner:" + rel`` is smallest go to ``inner`` — deterministic, independent of order and
    machine, and stratified by group."""
    by_group: dict[str, list[Example]] = {}
    for e in examples:
        by_group.setdefault(e.group, []).append(e)
    inner_rels: set[str] = set()
    for group in sorted(by_group):
        members = sorted(by_group[group], key=lambda e: _key(e.rel))
        inner_rels.update(e.rel for e in members[: round(fraction * len(members))])
    fit = [e for e in examples if e.rel not in inner_rels]
    inner = [e for e in examples if e.rel in inner_rels]
    return fit, inner


def _key(rel: str) -> bytes:
    return hashlib.blake2b(f"inner:{rel}".encode(), digest_size=8).digest()


def sample_weights(examples: list[Example], free_weight: float = 0.5) -> np.ndarray:
    """Sampling probability per example: tile defects are rarer and harder, so drawn more."""
    w = np.array(
        [
            free_weight if e.group == "mtile/free" else 2.0 if e.group.startswith("mtile/") else 1.0
            for e in examples
        ]
    )
    return w / w.sum()


@dataclass(frozen=True)
class Batch:
    """One training batch, every tensor ``[B, 1, S, S]`` float32."""

    x: torch.Tensor  # images in [0, 1]
    y: torch.Tensor  # 0/1 masks
    scored: torch.Tensor  # 1 where the crop shows the image itself
    seen: torch.Tensor  # 1 where serving's padded input has pixels (image + edge padding)
    teacher: torch.Tensor | None = None  # the teacher's probability in [0, 1], if given


@dataclass(frozen=True)
class Augment:
    """Probabilities and ranges of the batch augmentation (all on the device)."""

    scale: float = 0.5  # share of crops rescaled, log-uniform in [1/max_scale, max_scale]
    max_scale: float = 1.33
    rotate: float = 0.3  # share of crops rotated by a uniform angle in ±max_angle degrees
    max_angle: float = 45.0
    blur: float = 0.3  # share blurred with a Gaussian of sigma U(0.3, 1.2) px
    noise: float = 0.5  # share with Gaussian noise of sigma U(0, 0.04)
    defect_centre: float = 0.5  # share of defect images' crops centred near a defect pixel


class GpuImages:
    """All training images on the device, edge-padded to one ``[N, Hc, Wc]`` uint8 canvas."""

    def __init__(
        self, examples: list[Example], device: torch.device, upscale_below: int = 0,
        teacher: list[np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        """``upscale_below``: images whose longer side is at most this many pixels are seen
        at twice their size (the model's ``upscale_below``: serving does the same).
        ``teacher``: a uint8 probability map (255 = 1) per example, of its image's shape."""
        if teacher is not None and [t.shape for t in teacher] != [e.image.shape for e in examples]:
            raise ValueError("one teacher map per example, of its image's shape")
        hc = max(e.image.shape[0] for e in examples)
        wc = max(e.image.shape[1] for e in examples)
        n = len(examples)
        imgs = np.empty((n, hc, wc), np.uint8)
        masks = np.empty((n, hc, wc), np.uint8)
        points = np.zeros((n, MAX_DEFECT_POINTS, 2), np.float32)
        counts = np.zeros(n, np.int64)
        for i, e in enumerate(examples):
            h, w = e.image.shape
            pad = ((0, hc - h), (0, wc - w))
            imgs[i] = np.pad(e.image, pad, mode="edge")
            masks[i] = np.pad(e.mask, pad, mode="edge")
            yx = np.argwhere(e.mask)
            if len(yx):
                pick = np.linspace(0, len(yx) - 1, min(len(yx), MAX_DEFECT_POINTS)).astype(int)
                points[i, : len(pick)] = yx[pick]
                counts[i] = len(pick)
        self.device = device
        self.images = torch.from_numpy(imgs).to(device)
        self.masks = torch.from_numpy(masks).to(device)
        self.teacher = None
        if teacher is not None:
            soft = np.stack([np.pad(t, ((0, hc - t.shape[0]), (0, wc - t.shape[1])), mode="edge")
                             for t in teacher])  # fmt: skip
            self.teacher = torch.from_numpy(soft).to(device)
        self.points = torch.from_numpy(points).to(device)
        self.counts = torch.from_numpy(counts).to(device)
        sizes = np.array([e.image.shape for e in examples], np.float32)
        self.sizes = torch.from_numpy(sizes).to(device)  # [N, 2] (h, w)
        # Image pixels per crop pixel before augmentation: 0.5 for upscaled images.
        small = sizes.max(axis=1) <= upscale_below
        base = np.where(small, 0.5, 1.0).astype(np.float32)
        self.base_scale = torch.from_numpy(base).to(device)
        # What serving's normalize_pad makes of each image (of its 2x where upscaled), in
        # image pixels: edge-replicated up to a multiple of 16.
        served = [
            [padded_size(round(v / f)) * f for v in hw] for hw, f in zip(sizes, base, strict=True)
        ]
        self.served = torch.tensor(served, dtype=torch.float32, device=device)  # [N, 2]
        self.canvas = (hc, wc)

    def batch(self, idx: torch.Tensor, size: int, aug: Augment, gen: torch.Generator) -> Batch:
        """``idx``'s images cropped to ``size`` x ``size``, augmented."""
        b, dev = idx.shape[0], self.device

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=gen, device=dev)

        hw = self.sizes[idx]  # [B, 2]
        scale = self.base_scale[idx] * torch.where(
            rand(b) < aug.scale, torch.exp((2 * rand(b) - 1) * math.log(aug.max_scale)), 1.0
        )
        angle = torch.where(
            rand(b) < aug.rotate, (2 * rand(b) - 1) * math.radians(aug.max_angle), 0.0
        )
        half = size * scale[:, None] / 2  # [B, 1], the crop's half extent in image pixels
        lo = torch.minimum(half, hw - half)
        hi = torch.maximum(half, hw - half)
        centre = lo + rand(b, 2) * (hi - lo)
        # Defect-centred crops: a random defect pixel, offset by up to 3/8 of the crop.
        count = self.counts[idx]
        pick = (rand(b) * count.clamp(min=1)).long().clamp(max=MAX_DEFECT_POINTS - 1)
        point = self.points[idx, pick]  # [B, 2]
        near = (point + (2 * rand(b, 2) - 1) * half * 0.75).clamp(lo, hi)
        use = ((rand(b) < aug.defect_centre) & (count > 0))[:, None]
        # Integer centres; an upscaled image's sample points then fall where serving's
        # bilinear 2x puts them (a quarter pixel off the image's own grid).
        centre = torch.where(use, near, centre).round() - 0.25 * (self.base_scale[idx] < 1)[:, None]
        grid = _grid(centre, scale, angle, size, self.canvas)
        x = F.grid_sample(
            self.images[idx, None].float(), grid, mode="bilinear", padding_mode="border",
            align_corners=False,
        )  # fmt: skip
        y = F.grid_sample(
            self.masks[idx, None].float(), grid, mode="bilinear", padding_mode="border",
            align_corners=False,
        )  # fmt: skip
        # Where each crop pixel falls in its image (pixel centres at integers).
        hc, wc = self.canvas
        px = ((grid[..., 0] + 1) * wc - 1) / 2
        py = ((grid[..., 1] + 1) * hc - 1) / 2

        def inside(extent: torch.Tensor) -> torch.Tensor:  # extent [B, 2] (h, w)
            h, w = extent[:, 0, None, None], extent[:, 1, None, None]
            ok = (px > -0.5) & (px < w - 0.5) & (py > -0.5) & (py < h - 0.5)
            return ok[:, None].float()

        ts = [x / 255.0, (y >= 0.5).float(), inside(hw), inside(self.served[idx])]
        if self.teacher is not None:
            t = F.grid_sample(
                self.teacher[idx, None].float(), grid, mode="bilinear", padding_mode="border",
                align_corners=False,
            )  # fmt: skip
            ts.append(t / 255.0)
        x, y, scored, seen, *teacher = _flips(ts, rand)
        return Batch(_photometric(x, aug, rand, gen), y, scored, seen, *teacher)


def _grid(
    centre: torch.Tensor, scale: torch.Tensor, angle: torch.Tensor, size: int,
    canvas: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """``grid_sample`` grid ``[B, S, S, 2]``: output pixel (i, j) reads image point
    ``centre + scale * R(angle) (j - S/2, i - S/2)`` (integer points at scale 1, angle 0)."""
    dev = centre.device
    r = torch.arange(size, device=dev, dtype=torch.float32) - size / 2
    v, u = torch.meshgrid(r, r, indexing="ij")  # [S, S]
    cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
    s = scale[:, None, None]
    px = centre[:, 1, None, None] + s * (cos * u - sin * v)
    py = centre[:, 0, None, None] + s * (sin * u + cos * v)
    hc, wc = canvas
    return torch.stack([(2 * px + 1) / wc - 1, (2 * py + 1) / hc - 1], dim=-1)


def _flips(ts: list[torch.Tensor], rand: Rand) -> list[torch.Tensor]:
    """The same random flips and transpose of each crop applied to every tensor of ``ts``."""
    b = ts[0].shape[0]
    for dims in ((3,), (2,)):
        flip = (rand(b) < 0.5).view(b, 1, 1, 1)
        ts = [torch.where(flip, t.flip(dims), t) for t in ts]
    rot = (rand(b) < 0.5).view(b, 1, 1, 1)
    return [torch.where(rot, t.transpose(2, 3), t) for t in ts]


def _photometric(x: torch.Tensor, aug: Augment, u: Rand, gen: torch.Generator) -> torch.Tensor:
    b, _, s, _ = x.shape
    gamma = torch.exp((u(b, 1, 1, 1) - 0.5) * 0.8)  # 0.67 .. 1.49
    x = x.clamp(0, 1) ** gamma
    contrast = 0.7 + 0.6 * u(b, 1, 1, 1)
    brightness = (u(b, 1, 1, 1) - 0.5) * 0.3
    mean = x.mean(dim=(2, 3), keepdim=True)
    x = (x - mean) * contrast + mean + brightness
    # Blur: a separable Gaussian per image (grouped conv, images as channels); sigma 0 for
    # the images left sharp makes their kernel a delta.
    sigma = (0.3 + 0.9 * u(b)) * (u(b) < aug.blur)
    taps = torch.arange(-3, 4, device=x.device, dtype=torch.float32)
    k = torch.exp(-(taps[None] ** 2) / (2 * sigma[:, None].clamp(min=1e-3) ** 2))
    k = k / k.sum(dim=1, keepdim=True)  # [B, 7]
    flat = F.pad(x.view(1, b, s, s), (3, 3, 3, 3), mode="replicate")
    flat = F.conv2d(flat, k.view(b, 1, 7, 1), groups=b)
    flat = F.conv2d(flat, k.view(b, 1, 1, 7), groups=b)
    x = flat.view(b, 1, s, s)
    noise = 0.04 * u(b, 1, 1, 1) * (u(b, 1, 1, 1) < aug.noise)
    x = x + noise * torch.randn(x.shape, generator=gen, device=x.device)
    # Quantise like a camera would: the deployed model only ever sees uint8 frames.
    return (x.clamp(0, 1) * 255).round() / 255

"""The cascade's geometry (pure numpy, no network): settings, halo, stage-1 scaling, the crop
plan, and composing a frame's probability map from the two stages.

The dynamic-resolution cascade (:mod:`scratchd.model.cascade` runs it) answers a frame in up
to two stages of the same network:

```
frame [H, W] uint8 ── downscale(factor) ──▶ stage 1: the network at [H/f, W/f]
                                              │ nearest upsample to [H, W]
suspicious = dilate(prob1 >= threshold, margin)
tiles      = the core grid (core x core px) cells holding a suspicious pixel
crops      = each tile's core plus `halo` px on every side, clamped into the padded frame
stage 2    = the network on the crops of the normalised, padded frame (one fixed shape)
prob       = stage 2's inside the tiles' cores, stage 1's elsewhere ── postprocess as ever
```

**Why crops equal the full frame inside their cores.** A crop is a window of the normalised,
edge-padded frame (``normalize_pad``'s ``Hp x Wp`` canvas) whose origin is a multiple of
16, so every stride-2 layer samples the same grid as the full frame's. A layer's output can
only differ from the full frame's within its receptive radius of a crop edge that is not
also a canvas edge (there the crop's zero padding replaces real neighbours);
:func:`receptive_halo` bounds that radius from the architecture, and every core lies at
least that far from such an edge. Where the canvas is no larger than a crop in a dimension
the crop spans the whole canvas in it, so a frame smaller than a crop is run whole.

**Why stage 1 cannot add a defect.** Calibration keeps ``threshold`` at or below both the
pixel threshold and the score threshold, so a pixel answered by stage 1 (below
``threshold``) can neither enter the mask nor make the image score reach the defect
decision: a frame with no suspicious pixel is clean with an empty mask, and the cascade can
only miss what the full-resolution model finds, never invent it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scratchd.kernels.normalize_pad import padded_size
from scratchd.model.net import NetConfig, block_plan

ALIGN = 16  # the network's total stride: crop origins and sizes are multiples of it


@dataclass(frozen=True)
class CascadeSettings:
    """A calibrated cascade, stored in the model's metadata (``ModelMeta.cascade``)."""

    factor: int  # stage 1 runs the network on the frame downscaled by this integer factor
    threshold: float  # stage-1 probability at or above which a pixel is suspicious
    margin: int  # suspicious pixels are dilated by this many pixels (square, full resolution)
    core: int  # side of a crop's core (px, multiple of 16): the grid the frame is tiled in
    halo: int  # context around a core (px, multiple of 16, >= receptive_halo of the net)
    # Whether the cascade runs unless the configuration says otherwise (``[model] cascade``):
    # set by calibration only when the validation split met the quality bars.
    enabled: bool = False
    calibration: dict[str, Any] | None = None  # how the values were chosen (data, budget)

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, int) and self.factor >= 2):
            raise ValueError(f"cascade.factor must be an integer >= 2, got {self.factor!r}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"cascade.threshold must be in (0, 1], got {self.threshold!r}")
        if not (isinstance(self.margin, int) and self.margin >= 0):
            raise ValueError(f"cascade.margin must be an integer >= 0, got {self.margin!r}")
        for name in ("core", "halo"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0 and v % ALIGN == 0):
                raise ValueError(f"cascade.{name} must be a positive multiple of 16, got {v!r}")

    @property
    def crop(self) -> int:
        """Side of a stage-2 crop: core plus halo on both sides."""
        return self.core + 2 * self.halo

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CascadeSettings:
        if not isinstance(data, dict):
            raise ValueError(f"cascade must be a JSON object, got {type(data).__name__}")
        return cls(**data)

    def check(self, cfg: NetConfig, threshold: float, score_threshold: float | None) -> None:
        """Refuse settings that would break the cascade's guarantees for this model: a halo
        below the network's receptive radius, or a stage-1 threshold above the pixel or
        score threshold (stage 1 could then decide a defect on its own)."""
        need = receptive_halo(cfg)
        if self.halo < need:
            raise ValueError(f"cascade.halo {self.halo} < the network's receptive halo {need}")
        limit = min(threshold, 1.0 if score_threshold is None else score_threshold)
        if self.threshold > limit:
            raise ValueError(
                f"cascade.threshold {self.threshold} above the model's pixel/score threshold "
                f"{limit}"
            )


def receptive_radius(cfg: NetConfig) -> int:
    """An upper bound, in input pixels, on how far an output pixel's value reaches: walked
    layer by layer through :func:`block_plan`, distances measured between grid points (a
    3x3 tap reaches ``dilation`` steps of its input grid, a nearest 2x upsample one step of
    the finer grid, the bilinear head one logit step)."""
    step = 2  # grid spacing after the stride-2 stem, input pixels
    radius = 1  # the stem's taps
    skips: dict[str, int] = {}
    for b in block_plan(cfg):
        if b.join is not None:  # nearest upsample to the skip's grid, then concat
            step //= 2
            radius = max(radius + step, skips[b.join])
        radius += b.dilation * step
        step *= b.stride
        if b.saves is not None:
            skips[b.saves] = radius
    return radius + step  # bilinear 2x head: the logits either side


def receptive_halo(cfg: NetConfig) -> int:
    """The smallest halo (a multiple of 16) that keeps every core pixel out of reach of a
    crop edge."""
    return padded_size(receptive_radius(cfg) + 1, ALIGN)


def downscale(image: np.ndarray, factor: int) -> np.ndarray:
    """uint8 ``[H, W]`` → uint8 ``[ceil(H/f), ceil(W/f)]``: the mean of each ``f x f`` block
    (the frame edge-replicated to a multiple of ``f``), rounded half up."""
    h, w = image.shape
    hs, ws = -(-h // factor), -(-w // factor)
    padded = np.pad(image, ((0, hs * factor - h), (0, ws * factor - w)), mode="edge")
    sums = padded.reshape(hs, factor, ws, factor).sum(axis=(1, 3), dtype=np.uint32)
    area = factor * factor
    return ((sums + area // 2) // area).astype(np.uint8)


def upsample(prob: np.ndarray, factor: int, height: int, width: int) -> np.ndarray:
    """Stage 1's map back at the frame's size: each pixel repeated ``f x f`` (nearest), then
    cropped to ``height x width``."""
    up = np.repeat(np.repeat(prob, factor, axis=0), factor, axis=1)
    return np.ascontiguousarray(up[:height, :width])


def suspicious(prob1: np.ndarray, threshold: float, margin: int) -> np.ndarray:
    """Pixels within ``margin`` (Chebyshev distance) of a pixel with ``prob1 >= threshold``."""
    hit = prob1 >= np.float32(threshold)
    if margin == 0 or not hit.any():
        return hit
    h, w = hit.shape
    integral = np.zeros((h + 1, w + 1), dtype=np.int32)
    np.cumsum(np.cumsum(hit, axis=0, dtype=np.int32), axis=1, out=integral[1:, 1:])
    y0 = np.clip(np.arange(h) - margin, 0, h)
    y1 = np.clip(np.arange(h) + margin + 1, 0, h)
    x0 = np.clip(np.arange(w) - margin, 0, w)
    x1 = np.clip(np.arange(w) + margin + 1, 0, w)
    count = integral[y1][:, x1] - integral[y0][:, x1] - integral[y1][:, x0] + integral[y0][:, x0]
    return count > 0


@dataclass(frozen=True)
class Tile:
    """One stage-2 crop: its origin in the padded frame and its core in frame pixels."""

    oy: int  # crop origin (rows, columns) in the padded frame, multiples of 16
    ox: int
    y0: int  # core, frame pixels, end exclusive
    y1: int
    x0: int
    x1: int

    @property
    def box(self) -> tuple[int, int, int, int]:
        """The core as ``(x0, y0, x1, y1)`` (x1/y1 exclusive), as boxes are given."""
        return (self.x0, self.y0, self.x1, self.y1)


@dataclass(frozen=True)
class Plan:
    """Which parts of one frame run at full resolution."""

    height: int
    width: int
    crop_h: int  # the crops' shape (all crops of a frame share it)
    crop_w: int
    tiles: tuple[Tile, ...]  # empty: answered by stage 1 alone
    whole: bool  # the whole frame runs at full resolution (cheaper than its crops, or small)

    @property
    def full_res_pixels(self) -> int:
        """Input pixels the network sees at full resolution for this frame."""
        if self.whole:
            return padded_size(self.height) * padded_size(self.width)
        return len(self.tiles) * self.crop_h * self.crop_w

    @property
    def regions(self) -> list[tuple[int, int, int, int]]:
        """The frame's parts answered at full resolution, ``(x0, y0, x1, y1)``."""
        if self.whole:
            return [(0, 0, self.width, self.height)]
        return [t.box for t in self.tiles]


def _axis(size: int, core: int, halo: int) -> tuple[int, list[tuple[int, int, int]]]:
    """One dimension of the grid: the crop's extent and ``(origin, core start, core end)``
    per cell. A canvas no larger than a crop is one cell spanning it."""
    canvas = padded_size(size)
    crop = core + 2 * halo
    if canvas <= crop:
        return canvas, [(0, 0, size)]
    cells = []
    for start in range(0, size, core):
        origin = min(max(start - halo, 0), canvas - crop)
        cells.append((origin, start, min(start + core, size)))
    return crop, cells


def plan(sus: np.ndarray, core: int, halo: int) -> Plan:
    """The crops covering every suspicious pixel of a frame (``sus``: bool ``[H, W]``)."""
    h, w = sus.shape
    crop_h, rows = _axis(h, core, halo)
    crop_w, cols = _axis(w, core, halo)
    if not sus.any():
        return Plan(h, w, crop_h, crop_w, (), False)
    tiles = tuple(
        Tile(oy, ox, y0, y1, x0, x1)
        for oy, y0, y1 in rows
        if sus[y0:y1].any()
        for ox, x0, x1 in cols
        if sus[y0:y1, x0:x1].any()
    )
    whole = len(tiles) * crop_h * crop_w >= padded_size(h) * padded_size(w)
    return Plan(h, w, crop_h, crop_w, tiles, whole)


def compose(prob1: np.ndarray, cores: list[np.ndarray], p: Plan) -> np.ndarray:
    """The frame's map: ``prob1`` (stage 1, at the frame's size) with each tile's core
    replaced by ``cores[i]`` (stage 2's values there, ``[y1 - y0, x1 - x0]``)."""
    out = prob1.copy()
    for t, values in zip(p.tiles, cores, strict=True):
        out[t.y0 : t.y1, t.x0 : t.x1] = values
    return out


def macs(cfg: NetConfig, height: int, width: int) -> int:
    """Multiply-accumulates of one forward over a ``height x width`` frame (padded to 16)."""
    hp, wp = padded_size(height), padded_size(width)
    total = 9 * cfg.widths[0] * (hp // 2) * (wp // 2)  # stem
    scale = 2
    for b in block_plan(cfg):
        if b.join is not None:
            scale //= 2
        area_in = (hp // scale) * (wp // scale)
        scale *= b.stride
        area = (hp // scale) * (wp // scale)
        total += 9 * b.cin * area_in // (b.stride * b.stride) + b.cin * b.cout * area
    return total + cfg.widths[0] * (hp // 2) * (wp // 2)  # head


def stage1_shape(height: int, width: int, factor: int) -> tuple[int, int]:
    """The downscaled frame's shape."""
    return math.ceil(height / factor), math.ceil(width / factor)

"""The dynamic-resolution cascade on numpy: the reference the GPU backend must match.

:class:`Cascade` wraps a loaded :class:`~scratchd.model.scratchnet.ScratchNet` whose
metadata holds calibrated :class:`~scratchd.model.cascade_plan.CascadeSettings` (or is given
some) and answers frames as ``ScratchNet.predict`` does, in two stages (the geometry and
its guarantees: :mod:`scratchd.model.cascade_plan`):

1. the network on the frame downscaled ``factor`` times; its map, upsampled, marks the
   suspicious pixels (``>= threshold``, dilated by ``margin``);
2. the network at full resolution on fixed-size crops of the frame's normalised canvas
   covering them (the whole frame when that is cheaper or the frame is no larger than a
   crop); a frame with nothing suspicious is answered from stage 1 alone.

The assembled map goes through the model's own post-processing (``ScratchNet.finish``:
mask, boxes, score, ``decide``), and the :class:`Prediction` says which regions ran at full
resolution and how many pixels that took. The cascade runs one identity view: a flipped
view's crops would sit on another grid than the frame's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model import cascade_plan as cp
from scratchd.model.net import forward_canvas
from scratchd.model.scratchnet import (
    MAX_BATCH_PIXELS,
    ModelError,
    Prediction,
    ScratchNet,
    check_image,
)


class CascadeError(ModelError):
    """A model or settings the cascade cannot run with; the message says why."""


def resolve(net: ScratchNet, on: bool | None) -> Cascade | None:
    """The predictor a switch asks for (``[model] cascade``, ``scratchd eval --cascade``):
    True: the model's calibrated cascade (:class:`CascadeError` if it has none or cannot run
    it); False: none; None: the model's own default (``cascade.enabled``), where it can run
    (not with views beyond identity)."""
    s = net.meta.cascade
    if on is None:
        on = s is not None and s.enabled and net.views == ("identity",)
    return Cascade(net) if on else None


class Cascade:
    """The two-stage predictor over ``net`` with ``settings`` (default: the model's own)."""

    def __init__(self, net: ScratchNet, settings: cp.CascadeSettings | None = None) -> None:
        settings = settings or net.meta.cascade
        if settings is None:
            raise CascadeError(f"model {net.version} has no cascade settings (not calibrated)")
        if net.views != ("identity",):
            raise CascadeError(f"the cascade runs the identity view alone, not {net.views}")
        try:
            settings.check(net.config, net.meta.threshold, net.meta.score_threshold)
        except ValueError as exc:
            raise CascadeError(str(exc)) from None
        self.net = net
        self.settings = settings
        self.version = net.version

    def stage1(self, image: np.ndarray) -> np.ndarray:
        """Stage 1's probability map of one frame, at the frame's size."""
        return stage1_map(self.net, image, self.settings.factor)

    def plan(self, prob1: np.ndarray) -> cp.Plan:
        """Which parts of the frame stage 2 must run, from stage 1's map."""
        s = self.settings
        return cp.plan(cp.suspicious(prob1, s.threshold, s.margin), s.core, s.halo)

    def stage2(self, image: np.ndarray, p: cp.Plan) -> list[np.ndarray]:
        """Stage 2's values inside each tile's core (the full-resolution network on crops of
        the frame's normalised canvas, in batches of at most ``MAX_BATCH_PIXELS``)."""
        m = self.net.meta
        canvas = normalize_pad_ref(image[None], m.mean, m.std)[0]
        ch, cw = p.crop_h, p.crop_w
        cores: list[np.ndarray] = []
        chunk = max(1, MAX_BATCH_PIXELS // (ch * cw))
        for lo in range(0, len(p.tiles), chunk):
            part = p.tiles[lo : lo + chunk]
            crops = np.stack([canvas[t.oy : t.oy + ch, t.ox : t.ox + cw] for t in part])
            probs = forward_canvas(self.net.weights, self.net.config, crops, ch, cw)
            for t, prob in zip(part, probs, strict=True):
                cores.append(prob[t.y0 - t.oy : t.y1 - t.oy, t.x0 - t.ox : t.x1 - t.ox])
        return cores

    def predict_one(self, image: np.ndarray) -> Prediction:
        """One uint8 ``(H, W)`` frame through both stages."""
        prob1 = self.stage1(image)
        p = self.plan(prob1)
        if p.whole:
            prob = self.net.forward(image[None])[0]
        else:
            prob = cp.compose(prob1, self.stage2(image, p), p)
        pred = self.net.finish(image, prob)
        return replace(pred, regions=p.regions, full_res_pixels=p.full_res_pixels)

    def predict(self, images: Sequence[np.ndarray]) -> list[Prediction]:
        """One :class:`Prediction` per uint8 ``(H, W)`` image, in input order."""
        for i, img in enumerate(images):
            check_image(img, i)
        return [self.predict_one(img) for img in images]


def stage1_map(net: ScratchNet, image: np.ndarray, factor: int) -> np.ndarray:
    """The network's map of ``image`` downscaled ``factor`` times, back at the frame's size."""
    prob = net.forward(cp.downscale(image, factor)[None])[0]
    return cp.upsample(prob, factor, *image.shape)


def stage1_macs(net: ScratchNet, settings: cp.CascadeSettings, height: int, width: int) -> int:
    """Multiply-accumulates of stage 1 on a ``height x width`` frame."""
    return cp.macs(net.config, *cp.stage1_shape(height, width, settings.factor))


def plan_macs(net: ScratchNet, p: cp.Plan) -> int:
    """Multiply-accumulates of stage 2 under plan ``p``."""
    if p.whole:
        return cp.macs(net.config, p.height, p.width)
    return len(p.tiles) * cp.macs(net.config, p.crop_h, p.crop_w)

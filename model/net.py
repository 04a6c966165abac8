"""ScratchNet assembled from the ``<op>_ref`` functions: the numpy forward (the CPU backend).

A depthwise-separable encoder-decoder (U-Net-like). Shapes for an ``H x W`` frame, padded to
``Hp x Wp`` (multiples of 16), with the default widths ``(24, 48, 96, 192)``:

```
uint8 [N, H, W] ── normalize_pad ──▶ [N, Hp, Wp, 1]
stem      conv3x3 s2 1→24 + ReLU                          [N, Hp/2,  Wp/2,  24] ── skip0
enc0.*    DS blocks 24→24 (residual)                      [N, Hp/2,  Wp/2,  24] ┘
enc1.*    DS s2 24→48, then 48→48 (residual)              [N, Hp/4,  Wp/4,  48] ── skip1
enc2.*    DS s2 48→96, then 96→96 (residual)              [N, Hp/8,  Wp/8,  96] ── skip2
enc3.*    DS s2 96→192, then 192→192 dilation 2, 4, ...   [N, Hp/16, Wp/16, 192]
dec2      upsample_concat(·, skip2) → DS 288→96           [N, Hp/8,  Wp/8,  96]
dec1      upsample_concat(·, skip1) → DS 144→48           [N, Hp/4,  Wp/4,  48]
dec0      upsample_concat(·, skip0) → DS  72→24           [N, Hp/2,  Wp/2,  24]
head      pwconv 24→1 (no activation): logits             [N, Hp/2,  Wp/2,  1]
prob_head bilinear 2x, crop to H x W, sigmoid             [N, H, W] float32
```

The shipped model (``scratchd model info``) uses widths ``(48, 96, 192, 384)`` and two DS
blocks per decoder stage (``dec_depth=2``); the sketch above is the default config.

A DS (depthwise-separable) block is ``dwconv3x3`` (stride, dilation; + bias, ReLU) then
``pwconv`` (+ bias, + the block's input when stride is 1 and widths match, then ReLU).
BatchNorm exists only in training; it is folded into these weights and biases at export.

Weights are a flat ``dict[str, np.ndarray]`` of float32 arrays, named ``<layer>.w`` /
``<layer>.b`` with layers ``stem``, ``<block>.dw``, ``<block>.pw`` and ``head``; the layouts
are the ops' (output channel last). :func:`block_plan` is the single description of the
architecture: the numpy forward here and the torch mirror (``model/torchnet.py``) are both
built from it, so they cannot drift apart.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from scratchd.cpu import schedule as cpu_schedule
from scratchd.kernels.conv3x3 import conv3x3_ref
from scratchd.kernels.dwconv3x3 import dwconv3x3_ref
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.kernels.prob_head import prob_head_ref
from scratchd.kernels.pwconv import pwconv_ref
from scratchd.kernels.upsample_concat import upsample_concat_ref

Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class NetConfig:
    """The architecture's free parameters (stored in the model's metadata)."""

    widths: tuple[int, int, int, int] = (24, 48, 96, 192)
    # DS blocks per encoder stage; the first block of stages 1..3 has stride 2.
    depths: tuple[int, int, int, int] = (1, 2, 2, 1)
    # Extra stride-1 blocks at H/16, one per dilation (receptive field for long scratches).
    dilations: tuple[int, ...] = (2, 4)
    # DS blocks per decoder stage (dec2, dec1, dec0); the first one takes the concat.
    dec_depth: int = 1

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), so it round-trips through the model file."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NetConfig:
        return cls(
            widths=tuple(data["widths"]),
            depths=tuple(data["depths"]),
            dilations=tuple(data["dilations"]),
            dec_depth=int(data["dec_depth"]),
        )


@dataclass(frozen=True)
class BlockSpec:
    """One depthwise-separable block: ``dwconv3x3`` then ``pwconv``."""

    name: str
    cin: int
    cout: int
    stride: int = 1
    dilation: int = 1
    # Decoder blocks that open a stage first join the upsampled input with this skip.
    join: str | None = None
    saves: str | None = None  # name under which the block's output is kept as a skip

    @property
    def residual(self) -> bool:
        return self.stride == 1 and self.cin == self.cout and self.join is None


@functools.cache  # a pure function of the (frozen) config, asked for by every forward
def block_plan(cfg: NetConfig) -> tuple[BlockSpec, ...]:
    """The DS blocks in execution order (stem and head are fixed around them)."""
    w = cfg.widths
    blocks: list[BlockSpec] = []
    for stage in range(4):
        cin = w[0] if stage == 0 else w[stage - 1]
        for i in range(cfg.depths[stage]):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks.append(BlockSpec(f"enc{stage}.{i}", cin, w[stage], stride))
            cin = w[stage]
    for i, dil in enumerate(cfg.dilations):
        blocks.append(BlockSpec(f"enc3.d{i}", w[3], w[3], 1, dil))
    # Mark the last block of stages 0..2 (or the stem when a stage is empty) as a skip.
    for stage in range(3):
        last = [b for b in blocks if b.name.startswith(f"enc{stage}.")]
        if last:
            idx = blocks.index(last[-1])
            blocks[idx] = replace(blocks[idx], saves=f"skip{stage}")
    cin = w[3]
    for stage in (2, 1, 0):
        for i in range(cfg.dec_depth):
            join = f"skip{stage}" if i == 0 else None
            c_in = cin + w[stage] if i == 0 else w[stage]
            blocks.append(BlockSpec(f"dec{stage}.{i}", c_in, w[stage], join=join))
        cin = w[stage]
    return tuple(blocks)


def weight_shapes(cfg: NetConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape, in a stable order."""
    shapes: dict[str, tuple[int, ...]] = {
        "stem.w": (3, 3, 1, cfg.widths[0]),
        "stem.b": (cfg.widths[0],),
    }
    for b in block_plan(cfg):
        shapes[f"{b.name}.dw.w"] = (3, 3, b.cin)
        shapes[f"{b.name}.dw.b"] = (b.cin,)
        shapes[f"{b.name}.pw.w"] = (b.cin, b.cout)
        shapes[f"{b.name}.pw.b"] = (b.cout,)
    shapes["head.w"] = (cfg.widths[0], 1)
    shapes["head.b"] = (1,)
    return shapes


def count_params(cfg: NetConfig) -> int:
    """Parameters of the deployed (BatchNorm-folded) network."""
    return sum(int(np.prod(s)) for s in weight_shapes(cfg).values())


def check_weights(weights: Weights, cfg: NetConfig) -> None:
    """Raise ``ValueError`` naming the first missing, extra or misshapen weight."""
    shapes = weight_shapes(cfg)
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the architecture: missing {missing}, extra {extra}")
    for name, shape in shapes.items():
        arr = weights[name]
        if arr.shape != shape or arr.dtype != np.float32:
            raise ValueError(f"weight {name} must be float32 {shape}, got {arr.dtype} {arr.shape}")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"weight {name} holds non-finite values")


def random_weights(cfg: NetConfig, seed: int = 0) -> Weights:
    """He-initialised weights with small random biases (tests; not a trained model)."""
    rng = np.random.default_rng(seed)
    out: Weights = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith(".b"):
            out[name] = rng.normal(0.0, 0.1, shape).astype(np.float32)
        else:
            fan_in = int(np.prod(shape[:-1])) if not name.endswith("dw.w") else 9
            out[name] = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(np.float32)
    return out


def forward_logits_ref(
    weights: Weights,
    cfg: NetConfig,
    x: np.ndarray,
    taps: dict[str, np.ndarray] | None = None,
) -> np.ndarray:
    """Op by op: normalised, padded input ``[N, Hp, Wp, 1]`` → logits ``[N, Hp/2, Wp/2, 1]``.

    The definition of the network (every step one ``<op>_ref``). ``taps``, when given, receives
    the intermediate features: ``skip0``..``skip2``, ``deep`` (the encoder's output, at H/16)
    and ``dec`` (the last decoder block's, at H/2, what the head reads)."""
    h = conv3x3_ref(x, weights["stem.w"], weights["stem.b"], stride=2, act="relu")
    skips: dict[str, np.ndarray] = {"skip0": h}
    for b in block_plan(cfg):
        if b.join is not None:
            if taps is not None and "deep" not in taps:
                taps["deep"] = h
            h = upsample_concat_ref(h, skips[b.join])
        y = dwconv3x3_ref(
            h, weights[f"{b.name}.dw.w"], weights[f"{b.name}.dw.b"], b.stride, b.dilation, "relu"
        )
        res = h if b.residual else None
        h = pwconv_ref(y, weights[f"{b.name}.pw.w"], weights[f"{b.name}.pw.b"], "relu", res)
        if b.saves is not None:
            skips[b.saves] = h
    if taps is not None:
        taps.update(skips, dec=h)
    return pwconv_ref(h, weights["head.w"], weights["head.b"], act="none")


def forward_logits(weights: Weights, cfg: NetConfig, x: np.ndarray) -> np.ndarray:
    """The same function as :func:`forward_logits_ref`, scheduled for CPUs: each DS block
    runs fused band by band on all cores (:mod:`scratchd.cpu.schedule`), its output
    taken from the calling thread's workspace and handed back there once no later layer reads
    it (the returned logits are a fresh array). Falls back to the op-by-op path where BLAS
    threads cannot be limited (no threadpoolctl)."""
    if not cpu_schedule.available():
        return forward_logits_ref(weights, cfg, x)
    ws = cpu_schedule.workspace()
    with cpu_schedule.single_threaded_blas():
        h = cpu_schedule.stem_cpu(x, weights["stem.w"], weights["stem.b"], ws)
        skips: dict[str, np.ndarray] = {"skip0": h}
        for b in block_plan(cfg):
            skip = None if b.join is None else skips.pop(b.join)
            out = cpu_schedule.ds_block_cpu(
                h, weights[f"{b.name}.dw.w"], weights[f"{b.name}.dw.b"],
                weights[f"{b.name}.pw.w"], weights[f"{b.name}.pw.b"],
                b.stride, b.dilation, b.residual, skip, ws,
            )  # fmt: skip
            prev, h = h, out
            if b.saves is not None:
                skips[b.saves] = h
            # Hand back what no later layer reads (skips are read by their join).
            for dead in (prev, skip):
                if dead is not None and all(dead is not s for s in skips.values()):
                    ws.give(dead)
        logits = pwconv_ref(h, weights["head.w"], weights["head.b"], act="none")
        ws.give(h)
        return logits


def forward(
    weights: Weights,
    cfg: NetConfig,
    images: np.ndarray,  # [N, H, W] uint8
    mean: float,
    std: float,
) -> np.ndarray:  # [N, H, W] float32 defect probability
    """The whole network on a batch of same-size uint8 frames."""
    _n, height, width = images.shape
    return forward_canvas(
        weights, cfg, normalize_pad_ref(images, mean, std, multiple=16), height, width
    )


def forward_canvas(
    weights: Weights,
    cfg: NetConfig,
    x: np.ndarray,  # [N, Hp, Wp, 1] float32: normalised, padded (or windows of such a canvas)
    height: int,
    width: int,
) -> np.ndarray:  # [N, height, width] float32 defect probability
    """The network from the normalised canvas on: logits, then the head cropped to
    ``height x width`` (the cascade runs its crops of a frame's canvas through here)."""
    logits = forward_logits(weights, cfg, x)
    if not cpu_schedule.available():
        return prob_head_ref(logits, height, width)
    return cpu_schedule.prob_head_cpu(logits, height, width)

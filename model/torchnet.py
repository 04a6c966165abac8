"""The PyTorch mirror of ScratchNet, for training and for checking the numpy forward.

Importing this module imports torch (the ``[train]``/``[test]`` extras); nothing on the
serving path imports it. The module is built from :func:`scratchd.model.net.block_plan`,
the same description the numpy forward uses, in one of two forms:

- ``fused=False`` (training): bias-free convs followed by BatchNorm;
- ``fused=True`` (deployed): convs with biases, no BatchNorm — exactly the numpy network.

:func:`export_weights` folds a training model's BatchNorms (``fold_bn_ref``) into the
numpy weight dict; :func:`load_weights` loads such a dict into a fused model, so tests can
run the same weights through both implementations.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scratchd.kernels.normalize_pad import padded_size
from scratchd.model.fold_bn import fold_bn_ref
from scratchd.model.net import BlockSpec, NetConfig, Weights, block_plan, check_weights


class ConvUnit(nn.Module):
    """A conv, then BatchNorm (training form) or a conv with bias (fused form)."""

    def __init__(self, conv: nn.Conv2d, fused: bool) -> None:
        super().__init__()
        self.conv = conv
        self.bn: nn.BatchNorm2d | None = None if fused else nn.BatchNorm2d(conv.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y if self.bn is None else self.bn(y)


def _conv(
    cin: int, cout: int, k: int, fused: bool, stride: int = 1, padding: int = 0,
    dilation: int = 1, groups: int = 1,
) -> ConvUnit:  # fmt: skip
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias=fused)
    return ConvUnit(conv, fused)


class DSBlock(nn.Module):
    """dwconv3x3 (+ BN, ReLU) → pwconv (+ BN) (+ residual) → ReLU."""

    def __init__(self, spec: BlockSpec, fused: bool) -> None:
        super().__init__()
        self.spec = spec
        d = spec.dilation
        self.dw = _conv(
            spec.cin, spec.cin, 3, fused, stride=spec.stride, padding=d, dilation=d,
            groups=spec.cin,
        )  # fmt: skip
        self.pw = _conv(spec.cin, spec.cout, 1, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pw(F.relu(self.dw(x)))
        if self.spec.residual:
            y = y + x
        return F.relu(y)


class TorchScratchNet(nn.Module):
    """ScratchNet in PyTorch (NCHW); :meth:`forward` maps normalised input to logits at H/2."""

    def __init__(self, cfg: NetConfig, fused: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.plan = block_plan(cfg)
        self.stem = _conv(1, cfg.widths[0], 3, fused, stride=2, padding=1)
        self.blocks = nn.ModuleDict(
            {b.name.replace(".", "_"): DSBlock(b, fused) for b in self.plan}
        )
        self.head = nn.Conv2d(cfg.widths[0], 1, 1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``[N, 1, Hp, Wp]`` (multiples of 16) → logits ``[N, 1, Hp/2, Wp/2]``."""
        return self.head(self.decode(x)["dec0"])

    def decode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each decoder stage's output: ``dec2`` at Hp/8, ``dec1`` at Hp/4, ``dec0`` at Hp/2
        (``dec0`` is what the head reads; training attaches auxiliary heads to the others)."""
        h = F.relu(self.stem(x))
        skips = {"skip0": h}
        stages: dict[str, torch.Tensor] = {}
        for spec in self.plan:
            if spec.join is not None:
                h = torch.cat(
                    [F.interpolate(h, scale_factor=2.0, mode="nearest"), skips[spec.join]], 1
                )
            h = self.blocks[spec.name.replace(".", "_")](h)
            if spec.saves is not None:
                skips[spec.saves] = h
            if spec.name.startswith("dec"):
                stages[spec.name.split(".")[0]] = h  # the stage's last block wins
        return stages


def full_logits(model: TorchScratchNet, x: torch.Tensor) -> torch.Tensor:
    """Logits at the input's resolution (bilinear 2x of the head); ``x`` ``[N, 1, Hp, Wp]``."""
    return F.interpolate(model(x), scale_factor=2.0, mode="bilinear", align_corners=False)


def predict_prob(model: TorchScratchNet, images: np.ndarray, mean: float, std: float) -> np.ndarray:
    """uint8 ``[N, H, W]`` → probabilities ``[N, H, W]`` (the numpy ``forward``'s twin)."""
    _n, h, w = images.shape
    hp, wp = padded_size(h), padded_size(w)
    x = torch.from_numpy(images).float()[:, None] * (1.0 / (255.0 * std)) + (-mean / std)
    x = F.pad(x, (0, wp - w, 0, hp - h), mode="replicate")
    with torch.no_grad():
        return torch.sigmoid(full_logits(model, x)[:, 0, :h, :w]).numpy()


def _unit_weights(unit: ConvUnit, layout: str) -> tuple[np.ndarray, np.ndarray]:
    w = unit.conv.weight.detach().double().cpu().numpy()
    w = _to_layout(w, layout)
    b = None if unit.conv.bias is None else unit.conv.bias.detach().double().cpu().numpy()
    if unit.bn is None:
        assert b is not None
        return w.astype(np.float32), b.astype(np.float32)
    bn = unit.bn
    assert bn.running_mean is not None and bn.running_var is not None
    return fold_bn_ref(
        w, b, bn.weight.detach().double().cpu().numpy(), bn.bias.detach().double().cpu().numpy(),
        bn.running_mean.double().cpu().numpy(), bn.running_var.double().cpu().numpy(), bn.eps,
    )  # fmt: skip


def _to_layout(w: np.ndarray, layout: str) -> np.ndarray:
    """PyTorch ``[Cout, Cin/groups, kh, kw]`` → the ops' output-channel-last layouts."""
    if layout == "conv":
        return np.ascontiguousarray(w.transpose(2, 3, 1, 0))  # [3, 3, Cin, Cout]
    if layout == "dw":
        return np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))  # [3, 3, C]
    return np.ascontiguousarray(w[:, :, 0, 0].T)  # pw: [Cin, Cout]


def _from_layout(w: np.ndarray, layout: str) -> np.ndarray:
    if layout == "conv":
        return w.transpose(3, 2, 0, 1)
    if layout == "dw":
        return w.transpose(2, 0, 1)[:, None]
    return w.T[:, :, None, None]


def _units(model: TorchScratchNet) -> list[tuple[str, ConvUnit, str]]:
    units = [("stem", model.stem, "conv")]
    for spec in model.plan:
        block = model.blocks[spec.name.replace(".", "_")]
        assert isinstance(block, DSBlock)
        units += [(f"{spec.name}.dw", block.dw, "dw"), (f"{spec.name}.pw", block.pw, "pw")]
    return units


def export_weights(model: TorchScratchNet) -> Weights:
    """The numpy weight dict of ``model`` (BatchNorms folded; eval-mode statistics)."""
    out: Weights = {}
    for name, unit, layout in _units(model):
        out[f"{name}.w"], out[f"{name}.b"] = _unit_weights(unit, layout)
    out["head.w"] = _to_layout(model.head.weight.detach().double().cpu().numpy(), "pw").astype(
        np.float32
    )
    assert model.head.bias is not None
    out["head.b"] = model.head.bias.detach().cpu().numpy().astype(np.float32)
    check_weights(out, model.cfg)
    return out


def load_weights(weights: Weights, cfg: NetConfig) -> TorchScratchNet:
    """A fused (BatchNorm-free) eval-mode model holding the numpy ``weights``."""
    check_weights(weights, cfg)
    model = TorchScratchNet(cfg, fused=True).eval()
    with torch.no_grad():
        for name, unit, layout in _units(model):
            unit.conv.weight.copy_(torch.from_numpy(_from_layout(weights[f"{name}.w"], layout)))
            assert unit.conv.bias is not None
            unit.conv.bias.copy_(torch.from_numpy(weights[f"{name}.b"]))
        model.head.weight.copy_(torch.from_numpy(_from_layout(weights["head.w"], "pw")))
        assert model.head.bias is not None
        model.head.bias.copy_(torch.from_numpy(weights["head.b"]))
    return model

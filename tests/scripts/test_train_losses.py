"""scripts/train_losses.py's SSIM term (``train.py --ssim W``): zero for a map equal to the
mask, blind to pixels outside the weight, and worse the further a mask's edge is off."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scripts.test_train import TINY, _mod, examples


def _box(size: int, lo: int, hi: int) -> torch.Tensor:
    t = torch.zeros(1, 1, size, size)
    t[..., lo:hi, lo:hi] = 1
    return t


def _confident(mask: torch.Tensor) -> torch.Tensor:
    return (2 * mask - 1) * 40  # sigmoid: the mask to within 1e-17


def test_ssim_is_zero_for_the_mask_itself_and_grows_with_the_edge_error() -> None:
    losses = _mod("train_losses")
    target = _box(32, 10, 20)
    assert float(losses.ssim_loss(_confident(target), target)) == pytest.approx(0.0, abs=1e-5)
    off = [float(losses.ssim_loss(_confident(_box(32, 10 - d, 20 + d)), target)) for d in (1, 2, 3)]
    assert 0 < off[0] < off[1] < off[2]
    blurred = float(losses.ssim_loss(torch.zeros(1, 1, 32, 32), target))  # p = 0.5 everywhere
    assert blurred > off[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the term keeps to fp32 inside
        under = float(losses.ssim_loss(_confident(_box(32, 9, 21)), target))
    assert under == off[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(12, 24))
def test_ssim_ignores_what_the_logits_say_outside_the_weight(seed: int, size: int) -> None:
    losses = _mod("train_losses")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 1, size, size, generator=g) * 3
    target = (torch.rand(2, 1, size, size, generator=g) < 0.3).float()
    weight = torch.zeros_like(target)
    weight[..., 2 : size - 3, 1 : size - 2] = 1  # an image inside a larger crop
    other = torch.where(weight > 0, logits, torch.randn(logits.shape, generator=g) * 9)
    a, b = losses.ssim_loss(logits, target, weight), losses.ssim_loss(other, target, weight)
    torch.testing.assert_close(a, b)
    everywhere = losses.ssim_loss(logits, target, torch.ones_like(target))
    torch.testing.assert_close(everywhere, losses.ssim_loss(logits, target))


def test_the_ssim_term_trains_towards_the_mask() -> None:
    """A gradient step on the term alone brings a blurred map's edge closer to the mask."""
    losses = _mod("train_losses")
    target = _box(24, 6, 14)
    logits = torch.nn.functional.avg_pool2d(_confident(target) / 8, 5, 1, 2).requires_grad_()
    loss = losses.ssim_loss(logits, target)
    before = loss.item()
    loss.backward()
    assert logits.grad is not None
    with torch.no_grad():
        stepped = logits - 50 * logits.grad
    assert float(losses.ssim_loss(stepped, target)) < before


def test_a_trainer_with_the_ssim_term_adds_it_and_the_command_records_it() -> None:
    loop, data, losses, train = (_mod(m) for m in ("train_loop", "train_data", "train_losses",
                                                   "train"))  # fmt: skip
    from scratchd.model.torchnet import TorchScratchNet

    images = data.GpuImages(examples(6), torch.device("cpu"))
    recipe = loop.Recipe(batch=2, minutes=0.0, steps=4, warmup=1, ssim=0.7, outside="serve")
    torch.manual_seed(0)
    trainer = loop.Trainer(TorchScratchNet(TINY), recipe, torch.device("cpu"), 0)
    gen = torch.Generator().manual_seed(1)
    x, y, w, _ = trainer._inputs(images.batch(torch.arange(2), 64, recipe.augment, gen), 0.4, 0.2)
    with torch.no_grad():
        both = trainer._losses(x, y, w)
        trainer.recipe = dataclasses.replace(recipe, ssim=0.0)
        plain = trainer._losses(x, y, w)
        main, _ = trainer._net(x)
        up = F.interpolate(main.float(), size=x.shape[-2:], mode="bilinear")
    want = plain + 0.7 * losses.ssim_loss(up, y, w)
    assert float(both) == pytest.approx(float(want), rel=1e-5)
    trainer.recipe = recipe
    trainer.train_step(images, torch.full((6,), 1 / 6), 0.4, 0.2)  # a real step runs
    assert trainer.step == 1
    args = train.parse_args(["--out", "x", "--ssim", "0.7"])
    assert train.recipe_of(args).ssim == 0.7
    assert train.recipe_of(train.parse_args(["--out", "x"])).ssim == 0.0

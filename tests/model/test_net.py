"""The numpy forward equals the PyTorch forward on the same weights (shipped and random)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scratchd.cpu import schedule as cpu_schedule
from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model.net import (
    NetConfig,
    block_plan,
    count_params,
    forward,
    forward_logits,
    forward_logits_ref,
    random_weights,
)
from scratchd.model.scratchnet import load_model
from scratchd.model.torchnet import TorchScratchNet, export_weights, load_weights, predict_prob

SIZES = [(1, 16, 16), (2, 37, 53), (1, 200, 200), (1, 97, 130)]


def frames(shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """Textured frames with a bright line, so activations are not trivially zero."""
    rng = np.random.default_rng(seed)
    img = rng.normal(110, 25, shape)
    img[:, shape[1] // 2, :] += 90
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("shape", SIZES)
@pytest.mark.parametrize("cfg", [NetConfig(), NetConfig((8, 16, 24, 32), (0, 1, 1, 2), (3,), 2)])
def test_numpy_forward_equals_torch_random_weights(
    shape: tuple[int, int, int], cfg: NetConfig
) -> None:
    weights = random_weights(cfg, seed=shape[1])
    images = frames(shape, seed=shape[2])
    got = forward(weights, cfg, images, 0.43, 0.19)
    ref = predict_prob(load_weights(weights, cfg), images, 0.43, 0.19)
    assert got.shape == shape and got.dtype == np.float32
    assert np.abs(got - ref).max() <= 1e-4
    assert got.std() > 1e-3  # the comparison saw a non-constant output


@pytest.mark.parametrize("shape", SIZES[1:])
def test_numpy_forward_equals_torch_shipped_weights(shape: tuple[int, int, int]) -> None:
    model = load_model()
    images = frames(shape, seed=7)
    got = model.forward(images)
    ref = predict_prob(
        load_weights(model.weights, model.config), images, model.meta.mean, model.meta.std
    )
    assert np.abs(got - ref).max() <= 1e-4


def test_export_folds_batchnorm_exactly() -> None:
    """The training form (conv + BatchNorm, eval mode) equals its exported numpy weights."""
    cfg = NetConfig((8, 16, 24, 32))
    torch.manual_seed(0)
    net = TorchScratchNet(cfg)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.3, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    net.eval()
    images = frames((2, 45, 61), seed=3)
    ref = predict_prob(net, images, 0.5, 0.2)
    got = forward(export_weights(net), cfg, images, 0.5, 0.2)
    assert np.abs(got - ref).max() <= 1e-4


def test_param_count_matches_torch_and_budget() -> None:
    model = load_model()
    fused = load_weights(model.weights, model.config)
    assert count_params(model.config) == sum(p.numel() for p in fused.parameters())
    assert model.meta.params == count_params(model.config) <= 1_000_000


def test_block_plan_downsamples_four_times_and_joins_skips() -> None:
    plan = block_plan(NetConfig())
    assert sum(b.stride == 2 for b in plan) == 3  # plus the stride-2 stem
    assert [b.join for b in plan if b.join] == ["skip2", "skip1", "skip0"]
    assert {b.saves for b in plan if b.saves} == {"skip0", "skip1", "skip2"}


@pytest.mark.parametrize("shape", [(2, 37, 53), (1, 160, 96)])
def test_cpu_schedule_equals_op_by_op_reference(shape: tuple[int, int, int]) -> None:
    """The banded, threaded CPU schedule computes the reference network's function."""
    assert cpu_schedule.available()
    cfg = NetConfig((8, 16, 24, 32), (1, 2, 1, 1), (2,), 2)
    weights = random_weights(cfg, seed=5)
    x = normalize_pad_ref(frames(shape, seed=1), 0.45, 0.2)
    old = cpu_schedule.BAND_BYTES
    try:
        cpu_schedule.BAND_BYTES = 4096  # many bands, so band edges are exercised
        got = forward_logits(weights, cfg, x)
    finally:
        cpu_schedule.BAND_BYTES = old
    ref = forward_logits_ref(weights, cfg, x)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_cpu_schedule_workspace_recycles_between_forwards() -> None:
    """Activations handed back to the workspace are reused, and never leak into results."""
    cfg = NetConfig((8, 16, 24, 32), (1, 2, 1, 1), (2,), 2)
    weights = random_weights(cfg, seed=3)
    x = normalize_pad_ref(frames((1, 64, 48), seed=2), 0.45, 0.2)
    first = forward_logits(weights, cfg, x)
    assert cpu_schedule.workspace().kept > 0
    other = forward_logits(weights, cfg, normalize_pad_ref(frames((1, 64, 48), 9), 0.45, 0.2))
    again = forward_logits(weights, cfg, x)
    assert not np.array_equal(first, other)
    np.testing.assert_array_equal(first, again)


def test_taps_see_the_features_without_changing_the_logits() -> None:
    cfg = NetConfig(widths=(8, 16, 24, 32), depths=(1, 1, 1, 1), dilations=(2,), dec_depth=1)
    weights = random_weights(cfg, seed=4)
    x = np.random.default_rng(1).normal(size=(1, 64, 96, 1)).astype(np.float32)
    taps: dict[str, np.ndarray] = {}
    logits = forward_logits_ref(weights, cfg, x, taps)
    np.testing.assert_array_equal(logits, forward_logits_ref(weights, cfg, x))
    assert {k: v.shape for k, v in taps.items()} == {
        "skip0": (1, 32, 48, 8), "skip1": (1, 16, 24, 16), "skip2": (1, 8, 12, 24),
        "deep": (1, 4, 6, 32), "dec": (1, 32, 48, 8),
    }  # fmt: skip
    head = taps["dec"] @ weights["head.w"] + weights["head.b"]
    np.testing.assert_allclose(logits, head, rtol=1e-5, atol=1e-5)

"""scripts/train*.py on synthetic images, CPU only: the inner split, GPU-style batches,
losses, calibration, checkpoint/resume and the curve."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from scratchd.model.net import NetConfig

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TINY = NetConfig(widths=(8, 16, 16, 16), depths=(1, 1, 1, 1), dilations=(2,), dec_depth=1)


def _mod(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def examples(n: int = 12, seed: int = 0) -> list:
    """Images whose pixels are 255 exactly on the mask (a bright scratch), else dark."""
    data = _mod("train_data")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = (200, 200) if i % 2 else (int(rng.integers(100, 300)), int(rng.integers(220, 400)))
        mask = np.zeros((h, w), np.uint8)
        if i % 3:
            y = int(rng.integers(10, h - 10))
            mask[y : y + 2, 5 : w - 5] = 1
        image = (mask * 255).astype(np.uint8)
        group = ("mtile/free", "sd900/Sc", "mtile/crack")[i % 3]  # free: no scratch
        out.append(data.Example(f"{group}/img_{i}.png", group, image, mask))
    return out


def test_inner_split_is_deterministic_disjoint_and_stratified() -> None:
    data = _mod("train_data")
    ex = examples(60)
    fit, inner = data.inner_split(ex, 0.2)
    fit2, inner2 = data.inner_split(list(reversed(ex)), 0.2)
    assert {e.rel for e in inner} == {e.rel for e in inner2}
    assert {e.rel for e in fit} == {e.rel for e in fit2}
    assert not {e.rel for e in fit} & {e.rel for e in inner}
    assert len(fit) + len(inner) == len(ex)
    for group in ("sd900/Sc", "mtile/crack", "mtile/free"):
        assert sum(e.group == group for e in inner) == 4  # round(0.2 * 20)


def test_batches_keep_image_and_mask_aligned() -> None:
    data = _mod("train_data")
    ex = examples(9)
    images = data.GpuImages(ex, torch.device("cpu"))
    aug = dataclasses.replace(data.Augment(), blur=0.0, noise=0.0, rotate=1.0, scale=1.0)
    gen = torch.Generator().manual_seed(0)
    b = images.batch(torch.arange(9), 64, aug, gen)
    x, y = b.x, b.y
    assert x.shape == y.shape == (9, 1, 64, 64)
    assert set(torch.unique(y).tolist()) <= {0.0, 1.0}
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    for xi, yi in zip(x, y, strict=True):
        if yi.any() and not yi.all():
            # Monotone photometric changes keep the scratch at least as bright as the rest.
            assert float(xi[yi == 1].min()) >= float(xi[yi == 0].max())


def test_small_images_are_cropped_at_twice_their_size() -> None:
    """``upscale_below``: a 200 px image's 2 px scratch is 4 px high in its crops (what the
    serving model's bilinear 2x shows), a larger image's stays 2 px."""
    data = _mod("train_data")
    ex = [e for e in examples(12) if e.mask.any()]
    images = data.GpuImages(ex, torch.device("cpu"), upscale_below=200)
    aug = data.Augment(scale=0.0, rotate=0.0, blur=0.0, noise=0.0, defect_centre=1.0)
    gen = torch.Generator().manual_seed(0)
    y = images.batch(torch.arange(len(ex)), 96, aug, gen).y
    for e, yi in zip(ex, y, strict=True):
        # The scratch is 2 image rows high; flips and transposes may turn it upright.
        thick = min(int(yi[0].any(dim=1).sum()), int(yi[0].any(dim=0).sum()))
        assert thick == (4 if max(e.image.shape) <= 200 else 2), e.rel


def test_the_torch_pass_on_small_images_is_the_numpy_forward(tmp_path: Path) -> None:
    """``predict_probs`` (training's inner-split pass) and ``ScratchNet.forward`` agree with
    and without the 2x rule, so the operating point is chosen on what serving computes."""
    report = _mod("train_report")
    from scratchd.model.net import count_params
    from scratchd.model.scratchnet import ModelMeta, ScratchNet
    from scratchd.model.torchnet import TorchScratchNet, export_weights

    cfg = TINY
    torch.manual_seed(0)
    net = TorchScratchNet(cfg).eval()
    meta = ModelMeta(
        version="t", architecture=cfg.to_json(), mean=0.3, std=0.2, threshold=0.5,
        min_area=4, score_window=1, histogram=[1 / 64] * 64, val_metrics={},
        train_data_sha256="", params=count_params(cfg), upscale_below=48,
    )  # fmt: skip
    model = ScratchNet(export_weights(net), meta)
    data = _mod("train_data")
    rng = np.random.default_rng(2)
    ex = [
        data.Example(f"x{i}", "sd900/Sc", rng.integers(0, 256, s, dtype=np.uint8), np.zeros(s))
        for i, s in enumerate([(40, 48), (30, 26), (52, 40)])
    ]
    maps = report.predict_probs(net, ex, 0.3, 0.2, torch.device("cpu"), upscale_below=48)
    for e, got in zip(ex, maps, strict=True):
        want = model.forward(e.image[None])[0]
        assert got.shape == want.shape == e.image.shape
        np.testing.assert_allclose(got, want, atol=2e-4)


def test_crops_say_which_pixels_are_the_image_and_which_serving_would_see() -> None:
    """A crop larger than its image: ``scored`` covers exactly the image's pixels, ``seen``
    those and at most the rest of the image edge-padded to a multiple of 16 (what serving's
    normalize_pad makes; the crop always holds the image, not always all of its padding)."""
    data = _mod("train_data")
    rng = np.random.default_rng(3)
    shapes = [(40, 48), (33, 20), (64, 64)]
    ex = []
    for i, (h, w) in enumerate(shapes):
        mask = np.zeros((h, w), np.uint8)
        mask[h // 2 : h // 2 + 2, 2 : w - 2] = 1
        image = rng.integers(1, 255, (h, w), dtype=np.uint8)
        ex.append(data.Example(f"sd900/Sc/{i}.png", "sd900/Sc", image, mask))
    images = data.GpuImages(ex, torch.device("cpu"))
    aug = data.Augment(scale=0.0, rotate=0.0, blur=0.0, noise=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        b = images.batch(torch.arange(len(ex)), 80, aug, gen)
        for e, scored, seen in zip(ex, b.scored, b.seen, strict=True):
            h, w = e.image.shape
            assert int(scored.sum()) == h * w
            padded = (-(-h // 16) * 16) * (-(-w // 16) * 16)
            assert h * w <= int(seen.sum()) <= padded
            assert bool((seen >= scored).all())
            if padded == h * w:
                assert torch.equal(seen, scored)
            assert set(torch.unique(scored).tolist()) == {0.0, 1.0}


def test_an_upscaled_image_is_seen_as_serving_pads_its_double() -> None:
    """With ``upscale_below`` a 20 x 30 image is served as 40 x 60, padded to 48 x 64: in
    a crop of its double that is 48 * 64 pixels seen and 40 * 60 scored."""
    data = _mod("train_data")
    image = np.full((20, 30), 128, np.uint8)
    ex = [data.Example("sd900/In/0.png", "sd900/In", image, np.zeros((20, 30), np.uint8))]
    images = data.GpuImages(ex, torch.device("cpu"), upscale_below=64)
    aug = data.Augment(scale=0.0, rotate=0.0, blur=0.0, noise=0.0)
    b = images.batch(torch.arange(1), 96, aug, torch.Generator().manual_seed(0))
    assert int(b.scored.sum()) == 40 * 60
    assert int(b.seen.sum()) == 48 * 64


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(2, 40),
    st.integers(0, 2**32 - 1),
)
def test_lovasz_hinge_ignores_pixels_of_weight_zero(rows: int, pixels: int, seed: int) -> None:
    """The weighted Lovász hinge is the hinge over the kept pixels alone, row by row."""
    loop = _mod("train_losses")
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, pixels, generator=g) * 3
    target = (torch.rand(rows, pixels, generator=g) < 0.3).float()
    weight = (torch.rand(rows, pixels, generator=g) < 0.6).float()
    weight[:, 0] = 1  # at least one kept pixel a row
    got = loop.lovasz_hinge(logits, target, weight)
    rows_alone = [
        loop.lovasz_hinge(lo[w > 0][None], t[w > 0][None])
        for lo, t, w in zip(logits, target, weight, strict=True)
    ]
    want = torch.stack(rows_alone).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)


def test_serve_rule_zeroes_the_input_past_the_padding_and_scores_the_image_only() -> None:
    """``outside="serve"``: the normalised input is 0 (serving's convolution padding) where
    serving has no pixel, and the loss's weights are the image's own pixels."""
    loop, data = _mod("train_loop"), _mod("train_data")
    from scratchd.model.torchnet import TorchScratchNet

    recipe = loop.Recipe(batch=2, minutes=0.0, steps=1, warmup=1, outside="serve")
    trainer = loop.Trainer(TorchScratchNet(TINY), recipe, torch.device("cpu"), 0)
    x = torch.full((1, 1, 4, 4), 0.9)
    seen = torch.zeros(1, 1, 4, 4)
    seen[..., :3, :3] = 1
    scored = torch.zeros(1, 1, 4, 4)
    scored[..., :2, :2] = 1
    inp, _, w, _ = trainer._inputs(data.Batch(x, torch.zeros_like(x), scored, seen), 0.5, 0.25)
    assert torch.equal(inp[0, 0] != 0, seen[0, 0] > 0)
    assert w is not None and torch.equal(w, scored)
    with pytest.raises(ValueError, match="outside"):
        loop.Trainer(
            TorchScratchNet(TINY), dataclasses.replace(recipe, outside="wrap"),
            torch.device("cpu"), 0,
        )  # fmt: skip


def test_a_compiled_trainer_steps_as_the_eager_one() -> None:
    """``compiled=True`` runs the network as graphs torch.compile captured (handed here to a
    backend that records them and runs them as captured: inductor's code generation takes
    minutes on a CPU) and trains the same weights as the eager trainer."""
    loop, data = _mod("train_loop"), _mod("train_data")
    from scratchd.model.torchnet import TorchScratchNet

    captured: list[object] = []

    def backend(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> object:
        captured.append(gm)
        return gm.forward

    images = data.GpuImages(examples(8), torch.device("cpu"))
    probs = torch.full((8,), 1 / 8)
    recipe = loop.Recipe(batch=2, minutes=0.0, steps=4, warmup=1, outside="serve")
    weights = []
    for compiled in (False, True):
        torch.manual_seed(0)
        t = loop.Trainer(
            TorchScratchNet(TINY), recipe, torch.device("cpu"), 0,
            compiled=compiled, compile_backend=backend,
        )  # fmt: skip
        for _ in range(2):
            t.train_step(images, probs, 0.4, 0.2)
        weights.append([p.detach().clone() for p in t.model.parameters()])
        assert bool(captured) == compiled  # the eager trainer captures nothing
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_pixel_weights_of_one_change_no_loss() -> None:
    """The weighted losses (``--outside serve``) with every pixel kept are the plain ones."""
    loop = _mod("train_losses")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 1, 12, 12, generator=g) * 2
    target = (torch.rand(3, 1, 12, 12, generator=g) < 0.2).float()
    ones = torch.ones_like(target)
    for kind in ("bce+lovasz", "bce+dice"):
        plain, weighted = (
            loop.seg_loss(logits, target, kind),
            loop.seg_loss(logits, target, kind, ones),
        )
        assert float(weighted) == pytest.approx(float(plain), rel=1e-5)
    plain = loop.image_loss(logits, target, 4, 16)
    assert float(loop.image_loss(logits, target, 4, 16, ones)) == pytest.approx(float(plain))


def test_lovasz_hinge_is_zero_for_confident_right_answers() -> None:
    loop = _mod("train_losses")
    target = torch.zeros(2, 100)
    target[0, :10] = 1
    right = (2 * target - 1) * 5
    assert float(loop.lovasz_hinge(right, target)) == 0.0
    assert float(loop.lovasz_hinge(-right, target)) > 1.0


def test_image_loss_ignores_crops_with_a_few_defect_pixels() -> None:
    loop = _mod("train_loop")
    logits = torch.zeros(3, 1, 8, 8)
    target = torch.zeros(3, 1, 8, 8)
    target[1, 0, :4] = 1  # 32 pixels: a defect crop
    target[2, 0, 0, :3] = 1  # 3 pixels: ignored
    loss = loop.image_loss(logits, target, k=4, min_area=16)
    assert float(loss) == pytest.approx(float(np.log(2.0)) * 2 / 3, rel=1e-5)


def test_score_threshold_keeps_the_recall_in_every_group() -> None:
    report = _mod("train_report")
    rng = np.random.default_rng(1)
    scores = {"a": list(rng.random(40)), "b": list(rng.random(7))}
    thr = report.score_threshold_for(scores, 0.9)
    for values in scores.values():
        v = np.array(values)
        assert np.mean(v >= thr) >= 0.9
    assert report.score_threshold_for({"a": [0.2, 0.9]}, 0.97) == 0.2


def test_calibrate_and_measure_on_perfect_maps() -> None:
    report = _mod("train_report")
    ex = examples(9)
    probs = [e.mask.astype(np.float32) * 0.98 + 0.01 for e in ex]
    cal = report.calibrate(probs, ex, min_area=16, recall=0.97)
    assert 0.01 < cal["score_threshold"] <= 0.99
    m = report.measure(probs, ex, cal["threshold"], 16, cal["score_window"], cal["score_threshold"])
    assert m["iou"]["mtile"] == 1.0 and m["auroc"]["mtile"] == 1.0
    assert m["clean_rejected"]["mtile/free"] == 0.0 and m["defect_passed"]["mtile"] == 0.0


def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    ck = _mod("train_checkpoint")
    straight, images, probs = _tiny_trainer(4)  # the same initial weights each time
    straight.run(images, probs, 0.2, 0.3, float("inf"))
    assert straight.step == 4
    first = _tiny_trainer(4)[0]
    for _ in range(2):
        first.train_step(images, probs, 0.2, 0.3)
    ck.save_checkpoint(tmp_path / "c.npz", first, {})
    second = _tiny_trainer(4)[0]
    second.load_state(ck.load_checkpoint(tmp_path / "c.npz", torch.device("cpu")))
    second.run(images, probs, 0.2, 0.3, float("inf"))
    assert second.step == 4
    for a, b in zip(
        straight.ema.state_dict().values(), second.ema.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_a_fine_tune_starts_a_new_schedule_from_the_parents_ema(tmp_path: Path) -> None:
    ck = _mod("train_checkpoint")
    parent, images, probs = _tiny_trainer(3, ema=0.5)
    parent.commands.append("train.py --minutes 3")
    parent.run(images, probs, 0.2, 0.3, float("inf"))
    ck.save_checkpoint(tmp_path / "p.npz", parent, {})
    child = _tiny_trainer(5)[0]
    child.init_from(
        ck.load_checkpoint(tmp_path / "p.npz", torch.device("cpu")),
        "ab12",
        TINY,
    )
    assert child.step == 0 and child.seconds == 0.0 and not child.opt.state
    for want, model, ema in zip(
        parent.ema.state_dict().values(),
        child.model.state_dict().values(),
        child.ema.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(model, want) and torch.equal(ema, want)
    assert child.parent == {
        "sha256": "ab12", "steps": 3, "seconds": round(parent.seconds, 1),
        "commands": ["train.py --minutes 3"], "parent": None, "grown_by": [],
    }  # fmt: skip
    child.run(images, probs, 0.2, 0.3, float("inf"))
    assert child.step == 5
    # The record survives the child's own checkpoint, which resumes like any other.
    ck.save_checkpoint(tmp_path / "c.npz", child, {})
    again = _tiny_trainer(5)[0]
    again.load_state(ck.load_checkpoint(tmp_path / "c.npz", torch.device("cpu")))
    assert again.parent == child.parent and again.step == 5


def test_a_net_grown_by_a_dilated_block_starts_computing_what_its_parent_did(
    tmp_path: Path,
) -> None:
    loop, ck = _mod("train_loop"), _mod("train_checkpoint")
    from scratchd.model.torchnet import TorchScratchNet

    parent, images, probs = _tiny_trainer(3, ema=0.5)
    parent.run(images, probs, 0.2, 0.3, float("inf"))
    ck.save_checkpoint(tmp_path / "p.npz", parent, {})
    wider = dataclasses.replace(TINY, dilations=(2, 4))
    child = loop.Trainer(TorchScratchNet(wider), parent.recipe, torch.device("cpu"), seed=3)
    child.init_from(
        ck.load_checkpoint(tmp_path / "p.npz", torch.device("cpu")),
        "ab",
        TINY,
    )
    assert child.parent["grown_by"] == ["enc3_d1"]
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 1, 64, 96))).float()
    with torch.no_grad():
        torch.testing.assert_close(child.ema.eval()(x), parent.ema.eval()(x))
        torch.testing.assert_close(child.model.eval()(x), parent.ema.eval()(x))
    child.model.train()
    child.train_step(images, probs, 0.2, 0.3)  # and it trains: the new block moves
    assert child.model.blocks["enc3_d1"].pw.bn.weight.abs().sum() > 0


@pytest.mark.parametrize(
    ("parent", "child", "why"),
    [
        (TINY, dataclasses.replace(TINY, widths=(8, 16, 16, 32)), "differs"),
        (TINY, dataclasses.replace(TINY, dilations=()), "not in this architecture"),
        (dataclasses.replace(TINY, dec_depth=2), TINY, "not in this architecture"),
    ],
)
def test_growth_is_refused_where_it_cannot_start_as_the_parent(
    parent: Any, child: Any, why: str
) -> None:
    loop = _mod("train_loop")
    with pytest.raises(ValueError, match=why):
        loop.grown_blocks(parent, child)


def test_a_stop_request_ends_training_after_the_step_in_progress(tmp_path: Path) -> None:
    # What SIGTERM sets in train.py: the run ends after the current step, and the trainer
    # is left whole (its checkpoint resumes like any other).
    ck = _mod("train_checkpoint")
    trainer, images, probs = _tiny_trainer(50)
    step = trainer.train_step

    def step_then_stop(*args: Any) -> float:
        lr = step(*args)
        if trainer.step == 3:
            trainer.stop_requested = True  # as the SIGTERM handler does, mid-run
        return float(lr)

    trainer.train_step = step_then_stop
    trainer.run(images, probs, 0.2, 0.3, float("inf"))
    assert trainer.step == 3
    ck.save_checkpoint(tmp_path / "c.npz", trainer, {})
    again = _tiny_trainer(50)[0]
    again.load_state(ck.load_checkpoint(tmp_path / "c.npz", torch.device("cpu")))
    again.run(images, probs, 0.2, 0.3, float("inf"))
    assert again.step == 50


def _tiny_trainer(steps: int, ema: float = 0.999) -> tuple[Any, Any, Any]:
    """A tiny net's trainer (the same initial weights each call), its images and sampling
    probabilities, on the CPU."""
    data, loop = _mod("train_data"), _mod("train_loop")
    from scratchd.model.torchnet import TorchScratchNet

    recipe = loop.Recipe(batch=2, minutes=0.0, steps=steps, warmup=1, ema=ema)
    dev = torch.device("cpu")
    torch.manual_seed(3)
    trainer = loop.Trainer(TorchScratchNet(TINY), recipe, dev, seed=3)
    return trainer, data.GpuImages(examples(6), dev), torch.full((6,), 1 / 6)


def test_ema_follows_the_weights_by_its_decay() -> None:
    trainer, images, probs = _tiny_trainer(10, ema=0.9)
    for _ in range(3):
        trainer.train_step(images, probs, 0.2, 0.3)
    before = {k: v.clone() for k, v in trainer.ema.state_dict().items()}
    trainer.train_step(images, probs, 0.2, 0.3)  # step 3 -> 4, decay min(0.9, 4/13)
    decay = min(0.9, 4 / 13)
    model = trainer.model.state_dict()
    for name, value in trainer.ema.state_dict().items():
        if value.dtype.is_floating_point:
            want = before[name] * decay + model[name] * (1 - decay)
            torch.testing.assert_close(value, want)
        else:  # BatchNorm's batch counter is copied
            assert torch.equal(value, model[name])


def test_profile_writes_where_a_step_goes_and_counts_its_steps(tmp_path: Path) -> None:
    trainer, images, probs = _tiny_trainer(50)
    trainer.profile(images, probs, 0.2, 0.3, 2, tmp_path / "profile.txt")
    text = (tmp_path / "profile.txt").read_text()
    assert text.startswith("2 steps, ") and "aten::" in text
    assert trainer.step == 2 * 3 + 2  # the warm-up shapes, then the profiled steps
    assert trainer.seconds == 0.0  # kept out of the schedule's clock


def test_draw_curve_writes_a_png(tmp_path: Path) -> None:
    report = _mod("train_report")
    log = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "seconds": float(s)} for s in (1, 2, 3)]
    evals = [{"seconds": 3.0, "mean_iou": 0.7, "tile_auroc": 0.9}]
    report.draw_curve(tmp_path / "c.png", log, evals, "t")
    assert Image.open(tmp_path / "c.png").size == (report.W, report.H)


def test_precision_is_checked_and_a_tf32_trainer_steps() -> None:
    loop = _mod("train_loop")
    trainer, images, probs = _tiny_trainer(5)
    with pytest.raises(ValueError, match="precision"):
        loop.Trainer(trainer.model, trainer.recipe, trainer.device, 3, precision="fp16")
    tf32 = loop.Trainer(trainer.model, trainer.recipe, trainer.device, 3, precision="tf32")
    tf32.train_step(images, probs, 0.2, 0.3)
    assert tf32.step == 1 and all(torch.isfinite(p).all() for p in tf32.model.parameters())


def test_head_resolution_bound_is_exact_for_aligned_blocks_and_not_for_thin_lines() -> None:
    bound = _mod("head_resolution_bound").bound_iou
    mask = np.zeros((40, 40), np.uint8)
    mask[8:24, 16:32] = 1  # blocks on the 2 px grid: a 1/2 map holds them exactly
    assert bound(mask, 2) == 1.0
    assert 0.95 < bound(mask, 4) < 1.0  # bilinear rounds the corners off
    line = np.zeros((40, 40), np.uint8)
    line[21, 4:36] = 1  # one pixel high: averaged to 0.5 at 1/2, lost at the threshold
    assert bound(line, 2) < 0.5

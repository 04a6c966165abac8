"""Distillation (scripts/train_teacher.py, ``train.py --teacher --distill``) on synthetic
images, CPU only: the teacher maps' file, their crops, the loss and the command's checks."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scripts.test_train import TINY, _mod, examples


def _save(path: Path, rels: list[str], maps: list[np.ndarray], meta: dict | None = None) -> None:
    teacher = _mod("train_teacher")
    np.savez_compressed(path, **teacher.encode_maps(rels, maps, meta or {}))


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    order_seed=st.integers(0, 2**16),
)
def test_teacher_maps_round_trip_in_any_order(
    tmp_path_factory: pytest.TempPathFactory,
    shapes: list[tuple[int, int]],
    seed: int,
    order_seed: int,
) -> None:
    """Each image gets its own map back, quantised to the file's levels (255 = 1), whatever
    the file's order."""
    teacher, data = _mod("train_teacher"), _mod("train_data")
    rng = np.random.default_rng(seed)
    probs = [rng.random(s) for s in shapes]
    rels = [f"g/img_{i}.png" for i in range(len(shapes))]
    path = tmp_path_factory.mktemp("t") / "teacher.npz"
    _save(path, rels, probs, {"teachers": ["a"]})
    ex = [data.Example(r, "g", np.zeros(s, np.uint8), np.zeros(s, np.uint8))
          for r, s in zip(rels, shapes, strict=True)]  # fmt: skip
    order = np.random.default_rng(order_seed).permutation(len(ex))
    maps, meta = teacher.teacher_maps(path, [ex[i] for i in order])
    assert meta == {"teachers": ["a"]}
    for m, i in zip(maps, order, strict=True):
        assert m.dtype == np.uint8 and m.shape == shapes[i]
        assert np.abs(m / 255.0 - probs[i]).max() <= 0.5 / (teacher.LEVELS - 1) + 1e-12
        assert set(np.unique(m).tolist()) <= set(range(0, 256, 255 // (teacher.LEVELS - 1)))


def test_teacher_maps_refuse_a_missing_image_a_wrong_shape_and_bad_offsets(
    tmp_path: Path,
) -> None:
    teacher, data = _mod("train_teacher"), _mod("train_data")
    path = tmp_path / "t.npz"
    _save(path, ["a", "b"], [np.zeros((4, 5)), np.ones((2, 3))])

    def ex(rel: str, shape: tuple[int, int]) -> object:
        return data.Example(rel, "g", np.zeros(shape, np.uint8), np.zeros(shape, np.uint8))

    assert [m.shape for m in teacher.teacher_maps(path, [ex("b", (2, 3))])[0]] == [(2, 3)]
    with pytest.raises(ValueError, match="no teacher map for c"):
        teacher.teacher_maps(path, [ex("c", (2, 3))])
    with pytest.raises(ValueError, match="map is"):
        teacher.teacher_maps(path, [ex("a", (5, 4))])
    arrays = dict(np.load(path, allow_pickle=False))
    arrays["offsets"] = arrays["offsets"] + np.array([0, 1, 0])
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="offsets"):
        teacher.teacher_maps(path, [ex("a", (4, 5))])
    with pytest.raises(ValueError, match="one map per image"):
        teacher.encode_maps(["a", "a"], [np.zeros((1, 1))] * 2, {})


def test_batches_crop_the_teacher_as_the_mask_and_draw_the_same_crops() -> None:
    """A teacher map equal to the mask comes out of every crop as the target does (scale,
    rotation, flips, upscaled images), and giving a teacher changes no other tensor of the
    batch: the random draws are the same."""
    data = _mod("train_data")
    ex = examples(9)
    aug = dataclasses.replace(data.Augment(), rotate=1.0, scale=1.0)
    cpu = torch.device("cpu")
    plain = data.GpuImages(ex, cpu, upscale_below=224)
    taught = data.GpuImages(ex, cpu, upscale_below=224, teacher=[e.mask * 255 for e in ex])
    a = plain.batch(torch.arange(9), 64, aug, torch.Generator().manual_seed(5))
    b = taught.batch(torch.arange(9), 64, aug, torch.Generator().manual_seed(5))
    assert a.teacher is None and b.teacher is not None
    for name in ("x", "y", "scored", "seen"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    assert b.y.any()
    assert torch.equal((b.teacher >= 0.5).float(), b.y)
    with pytest.raises(ValueError, match="teacher map"):
        data.GpuImages(ex, cpu, teacher=[e.mask.T for e in ex])


def test_the_distillation_term_is_the_bce_towards_the_teacher_over_kept_pixels() -> None:
    loop = _mod("train_loop")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 1, 6, 6, generator=g, requires_grad=True)
    teacher = torch.rand(2, 1, 6, 6, generator=g)
    keep = (torch.rand(2, 1, 6, 6, generator=g) < 0.6).float()
    loss = loop.weighted_bce(logits, teacher, keep)
    kept = keep > 0
    expected = F.binary_cross_entropy_with_logits(logits[kept], teacher[kept])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert logits.grad is not None
    assert torch.all(logits.grad[~kept] == 0)
    # Its minimum is the teacher's own answer: zero gradient at logit(teacher).
    at_teacher = torch.logit(teacher).requires_grad_(True)
    loop.weighted_bce(at_teacher, teacher).backward()
    assert at_teacher.grad is not None
    assert float(at_teacher.grad.abs().max()) < 1e-6


def test_a_distilling_trainer_adds_the_teachers_term_and_needs_its_maps() -> None:
    loop, data = _mod("train_loop"), _mod("train_data")
    from scratchd.model.torchnet import TorchScratchNet

    ex = examples(6)
    rng = np.random.default_rng(0)
    soft = [rng.integers(0, 256, e.image.shape, dtype=np.uint8) for e in ex]
    images = data.GpuImages(ex, torch.device("cpu"), teacher=soft)
    recipe = loop.Recipe(batch=2, minutes=0.0, steps=4, warmup=1, distill=0.5)
    torch.manual_seed(0)
    trainer = loop.Trainer(TorchScratchNet(TINY), recipe, torch.device("cpu"), 0)
    gen = torch.Generator().manual_seed(1)
    x, y, w, t = trainer._inputs(images.batch(torch.arange(2), 64, recipe.augment, gen), 0.4, 0.2)
    assert t is not None
    with torch.no_grad():
        both = trainer._losses(x, y, w, t)
        trainer.recipe = dataclasses.replace(recipe, distill=0.0)
        plain = trainer._losses(x, y, w, t)
        main, _ = trainer._net(x)
        up = F.interpolate(main.float(), size=x.shape[-2:], mode="bilinear")
    assert float(both) == pytest.approx(float(plain + 0.5 * loop.weighted_bce(up, t)), rel=1e-5)
    trainer.recipe = recipe
    with pytest.raises(ValueError, match="no teacher maps"):
        trainer._losses(x, y, w, None)
    trainer.train_step(images, torch.full((6,), 1 / 6), 0.4, 0.2)  # a real step runs
    assert trainer.step == 1


def test_the_command_checks_its_teacher(tmp_path: Path) -> None:
    """``--teacher`` and ``--distill`` go together, and a teacher file made from other data
    or lacking an image is refused with the reason."""
    train = _mod("train")
    ex = examples(4)
    path = tmp_path / "t.npz"
    _save(path, [e.rel for e in ex], [e.mask.astype(float) for e in ex],
          {"train_data_sha256": "abc"})  # fmt: skip
    cpu = torch.device("cpu")

    def args(teacher: Path | None, distill: float) -> argparse.Namespace:
        return argparse.Namespace(teacher=teacher, distill=distill, upscale_below=0)

    data, meta = train.gpu_images(args(path, 0.5), ex, "abc", cpu)
    assert meta == {"train_data_sha256": "abc"} and data.teacher is not None
    assert train.gpu_images(args(None, 0.0), ex, "abc", cpu)[1] is None
    for bad, why in (
        (args(path, 0.0), "go together"),
        (args(None, 0.5), "go together"),
    ):
        with pytest.raises(SystemExit, match=why):
            train.gpu_images(bad, ex, "abc", cpu)
    with pytest.raises(SystemExit, match="other training data"):
        train.gpu_images(args(path, 0.5), ex, "xyz", cpu)
    other = examples(4, seed=1)
    other[0] = dataclasses.replace(other[0], rel="elsewhere.png")
    with pytest.raises(SystemExit, match=r"no teacher map for elsewhere\.png"):
        train.gpu_images(args(path, 0.5), other, "abc", cpu)
    recipe = train.recipe_of(train.parse_args(
        ["--out", str(tmp_path), "--teacher", str(path), "--distill", "0.5"]))  # fmt: skip
    assert recipe.distill == 0.5 and len(recipe.teacher) == 64

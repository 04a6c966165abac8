"""The shipped model file and the predict API the workers call."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.kernels.views import apply_view
from scratchd.model.net import NetConfig, count_params, random_weights
from scratchd.model.scratchnet import (
    ModelError,
    ModelMeta,
    ScratchNet,
    decide,
    finish_upscaled,
    load_model,
    pool2x,
    random_model,
    save_model,
    upscale2x,
)


def test_shipped_model_metadata_is_complete() -> None:
    model = load_model()
    meta = model.meta
    assert model.version == meta.version and meta.version
    assert NetConfig.from_json(meta.architecture) == model.config
    assert meta.std > 0 and 0 < meta.mean < 1 and 0 < meta.threshold < 1 and meta.min_area >= 1
    assert len(meta.histogram) == 64 and abs(sum(meta.histogram) - 1) < 1e-3
    assert len(meta.train_data_sha256) == 64
    assert meta.params == count_params(model.config) <= 1_000_000
    for key in ("sd900", "sd900/Sc", "mtile"):
        assert 0 <= meta.val_metrics["iou"][key] <= 1
    assert (
        Path(__file__).resolve().parents[2].joinpath("model/weights/scratchnet.npz").stat().st_size
        < 5e6
    )


def test_predict_mixed_sizes_keeps_order_and_shapes() -> None:
    model = load_model(views=("identity",))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, s, dtype=np.uint8) for s in [(40, 50), (17, 9), (40, 50)]]
    preds = model.predict(images)
    assert [p.prob.shape for p in preds] == [(40, 50), (17, 9), (40, 50)]
    single = model.predict([images[2]])[0]
    np.testing.assert_allclose(preds[2].prob, single.prob, atol=1e-6)
    for p in preds:
        assert p.prob.dtype == np.float32 and p.mask.dtype == np.uint8
        assert set(np.unique(p.mask)) <= {0, 255}
        assert 0 <= p.score <= 1 and 0 <= p.entropy <= 1
        assert p.verdict == ("defect" if p.boxes else "clean")
        assert p.histogram.dtype == np.uint32 and p.histogram.sum() == p.prob.size


def test_views_average_back_to_the_input_frame() -> None:
    images = np.arange(2 * 5 * 7, dtype=np.uint8).reshape(2, 5, 7)
    for view in ("identity", "flip_h", "flip_v", "transpose"):
        np.testing.assert_array_equal(apply_view(apply_view(images, view), view), images)
    model = load_model(views=("identity", "flip_h", "flip_v", "transpose"))
    rng = np.random.default_rng(3)
    frame = rng.integers(60, 200, (1, 40, 56), dtype=np.uint8)
    frame[0, 18:21, 4:50] = 250  # a bright scratch, so the views disagree somewhere
    single = load_model(views=("identity",))
    expect = np.mean([apply_view(single.prob(apply_view(frame, v)), v) for v in model.views], 0)
    assert len(model.views) == 4
    assert np.abs(expect - single.prob(frame)).max() > 0.01  # the views do disagree
    np.testing.assert_allclose(model.prob(frame), expect, atol=1e-6)


def test_rejects_bad_images_naming_the_index() -> None:
    model = load_model(views=("identity",))
    with pytest.raises(ValueError, match="image 1: expected a uint8"):
        model.predict([np.zeros((8, 8), np.uint8), np.zeros((8, 8), np.float32)])
    with pytest.raises(ValueError, match="image 0: empty"):
        model.predict([np.zeros((0, 8), np.uint8)])


def test_save_load_round_trip_and_bad_files(tmp_path: Path) -> None:
    shipped = load_model()
    cfg = NetConfig((8, 16, 24, 32))
    meta = dataclasses.replace(
        shipped.meta, architecture=cfg.to_json(), params=count_params(cfg), version="test"
    )
    weights = random_weights(cfg, seed=1)
    save_model(tmp_path / "m.npz", weights, meta)
    again = load_model(tmp_path / "m.npz")
    assert again.meta == meta
    for name, arr in weights.items():
        np.testing.assert_array_equal(again.weights[name], arr)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match=r"junk\.npz"):
        load_model(tmp_path / "junk.npz")
    arrays: dict[str, Any] = dict(weights)
    np.savez(tmp_path / "nometa.npz", **arrays)
    with pytest.raises(ModelError, match="no __meta__"):
        load_model(tmp_path / "nometa.npz")
    bad = dict(weights)
    del bad["head.b"]
    with pytest.raises(ValueError, match="missing"):
        save_model(tmp_path / "bad.npz", bad, meta)


def test_decide_by_score_threshold_or_by_components() -> None:
    assert decide(0.9, False, None) == "clean" and decide(0.1, True, None) == "defect"
    assert decide(0.5, False, 0.5) == "defect" and decide(0.49, True, 0.5) == "clean"


def test_score_threshold_drives_the_verdict_and_old_metadata_loads(tmp_path: Path) -> None:
    model = load_model()
    old = model.meta.to_json()
    old.pop("score_threshold")
    assert ModelMeta.from_json(old).score_threshold is None  # scratchnet-1 files still load
    cfg = NetConfig()
    weights = random_weights(cfg, seed=3)
    image = np.random.default_rng(0).integers(0, 256, (64, 80), dtype=np.uint8)
    for score_threshold in (0.0, 1.01):
        meta = dataclasses.replace(
            model.meta, architecture=cfg.to_json(), params=count_params(cfg),
            score_threshold=score_threshold,
        )  # fmt: skip
        save_model(tmp_path / "m.npz", weights, meta)
        pred = load_model(tmp_path / "m.npz", views=("identity",)).predict([image])[0]
        assert pred.verdict == ("defect" if score_threshold == 0.0 else "clean")


@settings(max_examples=40, deadline=None)
@given(
    h=st.integers(1, 12), w=st.integers(1, 12), seed=st.integers(0, 2**31 - 1)
)  # fmt: skip
def test_upscale_then_pool_keeps_sizes_and_values(h: int, w: int, seed: int) -> None:
    images = np.random.default_rng(seed).integers(0, 256, (2, h, w), dtype=np.uint8)
    up = upscale2x(images)
    assert up.shape == (2, 2 * h, 2 * w) and up.dtype == np.uint8
    # Bilinear 2x stays within each neighbourhood's range, and a flat frame stays flat.
    assert up.min() >= images.min() and up.max() <= images.max()
    flat = np.full((1, h, w), images[0, 0, 0], np.uint8)
    np.testing.assert_array_equal(upscale2x(flat), np.full((1, 2 * h, 2 * w), flat[0, 0, 0]))
    # Pooling a map that is constant on each 2x2 block gives the map back.
    prob = np.random.default_rng(seed).random((2, h, w), dtype=np.float32)
    np.testing.assert_array_equal(pool2x(prob.repeat(2, axis=1).repeat(2, axis=2)), prob)


def test_small_frames_run_at_twice_their_size_only_below_the_limit() -> None:
    cfg = NetConfig()
    weights = random_weights(cfg, seed=5)
    base = random_model(5).meta
    meta = dataclasses.replace(base, upscale_below=40)
    model, plain = ScratchNet(weights, meta), ScratchNet(weights, base)
    rng = np.random.default_rng(1)
    small = rng.integers(0, 256, (1, 24, 40), dtype=np.uint8)
    large = rng.integers(0, 256, (1, 24, 41), dtype=np.uint8)
    want = pool2x(plain.forward(upscale2x(small)))
    np.testing.assert_array_equal(model.forward(small), want)
    assert np.abs(want - plain.forward(small)).max() > 1e-3  # else the test could not fail
    np.testing.assert_array_equal(model.forward(large), plain.forward(large))
    assert model.predict([small[0]])[0].mask.shape == (24, 40)


def test_upscale_below_is_validated_and_old_files_load_without_it() -> None:
    meta = dataclasses.replace(random_model(0).meta, upscale_below=256)
    old = meta.to_json()
    old.pop("upscale_below")
    assert ModelMeta.from_json(old).upscale_below == 0  # files before it still load
    with pytest.raises(ValueError, match="upscale_below"):
        ScratchNet(random_model(0).weights, dataclasses.replace(meta, upscale_below=-1))


def test_finish_upscaled_is_the_forward_at_twice_the_size() -> None:
    base = random_model(4)
    model = ScratchNet(base.weights, dataclasses.replace(base.meta, upscale_below=64))
    image = np.random.default_rng(3).integers(0, 256, (32, 48), dtype=np.uint8)
    prob2x = ScratchNet(base.weights, base.meta).forward(upscale2x(image[None]))[0]
    got = finish_upscaled(model, image, prob2x)
    want = model.predict([image])[0]
    np.testing.assert_array_equal(got.prob, want.prob)
    assert (got.score, got.verdict, got.boxes) == (want.score, want.verdict, want.boxes)
    np.testing.assert_array_equal(got.histogram, want.histogram)


def test_a_model_with_a_cascade_cannot_also_upscale() -> None:
    from scratchd.model.cascade_plan import CascadeSettings, receptive_halo

    base = random_model(0)
    halo = receptive_halo(base.config)  # a multiple of 16 already
    cascade = CascadeSettings(factor=2, threshold=0.2, margin=0, core=128, halo=halo)
    ScratchNet(base.weights, dataclasses.replace(base.meta, cascade=cascade))  # fine alone
    both = dataclasses.replace(base.meta, cascade=cascade, upscale_below=224)
    with pytest.raises(ValueError, match="both a cascade and upscale_below"):
        ScratchNet(base.weights, both)

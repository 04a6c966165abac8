"""The shipped model file and the predict API the workers call."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scratchd.kernels.views import apply_view
from scratchd.model.net import NetConfig, count_params, random_weights
from scratchd.model.scratchnet import ModelError, ModelMeta, decide, load_model, save_model


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

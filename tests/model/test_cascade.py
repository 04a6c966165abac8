"""The dynamic-resolution cascade: crop geometry, stage-2 equality, assembly, metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.kernels.normalize_pad import padded_size
from scratchd.model import cascade_plan as cp
from scratchd.model.cascade import Cascade, CascadeError
from scratchd.model.net import NetConfig
from scratchd.model.scratchnet import (
    ModelError,
    ScratchNet,
    load_model,
    random_model,
    read_meta,
    save_model,
)

SMALL = NetConfig(widths=(8, 16, 16, 24), depths=(1, 1, 1, 1), dilations=(2,), dec_depth=1)


@st.composite
def frames(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    """A suspicious mask of any size (also smaller than a crop), a core and a halo."""
    h = draw(st.integers(1, 300))
    w = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.0005, 0.01, 0.2]))
    sus = np.random.default_rng(seed).random((h, w)) < density
    return sus, draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([16, 32, 48]))


@settings(max_examples=150, deadline=None)
@given(frames())
def test_plan_covers_every_suspicious_pixel_with_disjoint_cores_inside_valid_crops(
    case: tuple[np.ndarray, int, int],
) -> None:
    sus, core, halo = case
    h, w = sus.shape
    hp, wp = padded_size(h), padded_size(w)
    p = cp.plan(sus, core, halo)
    assert (p.height, p.width) == (h, w)
    assert p.crop_h == min(core + 2 * halo, hp) and p.crop_w == min(core + 2 * halo, wp)
    covered = np.zeros((h, w), np.int32)
    for t in p.tiles:
        covered[t.y0 : t.y1, t.x0 : t.x1] += 1
        assert t.oy % 16 == 0 and t.ox % 16 == 0
        assert t.oy >= 0 and t.oy + p.crop_h <= hp and t.ox >= 0 and t.ox + p.crop_w <= wp
        # the core is a halo away from every crop edge that is not the canvas's edge
        assert t.y0 - t.oy >= halo or t.oy == 0
        assert t.x0 - t.ox >= halo or t.ox == 0
        assert t.oy + p.crop_h - t.y1 >= halo or t.oy + p.crop_h == hp
        assert t.ox + p.crop_w - t.x1 >= halo or t.ox + p.crop_w == wp
        assert sus[t.y0 : t.y1, t.x0 : t.x1].any()  # no crop runs for nothing
    assert covered.max(initial=0) <= 1  # cores never overlap
    assert (covered[sus] == 1).all()  # every suspicious pixel lies in a core
    assert (p.tiles == ()) == (not sus.any())
    assert p.whole == (len(p.tiles) * p.crop_h * p.crop_w >= hp * wp and bool(p.tiles))
    # assembly: the frame's size, each core's values inside it, stage 1's elsewhere
    prob1 = np.full((h, w), 0.25, np.float32)
    cores = [np.full((t.y1 - t.y0, t.x1 - t.x0), 0.75, np.float32) for t in p.tiles]
    out = cp.compose(prob1, cores, p)
    assert out.shape == (h, w) and out.dtype == np.float32
    np.testing.assert_array_equal(out, np.where(covered == 1, 0.75, 0.25).astype(np.float32))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 60), st.integers(1, 60), st.integers(0, 6), st.integers(0, 2**32 - 1))
def test_suspicious_is_the_square_dilation(h: int, w: int, margin: int, seed: int) -> None:
    prob = np.random.default_rng(seed).random((h, w)).astype(np.float32) ** 8
    got = cp.suspicious(prob, 0.5, margin)
    hit = prob >= 0.5
    expect = np.zeros_like(hit)
    for y, x in zip(*np.nonzero(hit), strict=True):
        expect[max(0, y - margin) : y + margin + 1, max(0, x - margin) : x + margin + 1] = True
    np.testing.assert_array_equal(got, expect)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([2, 3, 4]), st.integers(0, 99))
def test_downscale_is_the_rounded_block_mean(h: int, w: int, f: int, seed: int) -> None:
    img = np.random.default_rng(seed).integers(0, 256, (h, w), dtype=np.uint8)
    small = cp.downscale(img, f)
    assert small.shape == cp.stage1_shape(h, w, f) and small.dtype == np.uint8
    padded = np.pad(img, ((0, -h % f), (0, -w % f)), mode="edge").astype(np.float64)
    for y in range(small.shape[0]):
        for x in range(small.shape[1]):
            mean = padded[y * f : (y + 1) * f, x * f : (x + 1) * f].mean()
            assert small[y, x] == int(np.floor(mean + 0.5))
    up = cp.upsample(small.astype(np.float32), f, h, w)
    assert up.shape == (h, w) and up[h - 1, w - 1] == small[-1, -1]


def _all_tiles(net: ScratchNet, shape: tuple[int, int], core: int, halo: int) -> cp.Plan:
    p = cp.plan(np.ones(shape, bool), core, halo)
    return dataclasses.replace(p, whole=False)  # run the crops even where the whole is cheaper


@pytest.mark.parametrize(
    "cfg", [SMALL, NetConfig(widths=(8, 16, 16, 16), dilations=(2, 4, 8), dec_depth=2)]
)
@pytest.mark.parametrize("shape", [(300, 410), (97, 333), (40, 30)])
def test_stage2_equals_the_full_forward_inside_the_cores(
    cfg: NetConfig, shape: tuple[int, int]
) -> None:
    net = random_model(seed=3, cfg=cfg)
    halo = cp.receptive_halo(cfg)
    s = cp.CascadeSettings(factor=2, threshold=0.5, margin=0, core=32, halo=halo)
    cascade = Cascade(net, s)
    img = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    full = net.forward(img[None])[0]
    p = _all_tiles(net, shape, s.core, halo)
    assembled = cp.compose(np.full(shape, -1, np.float32), cascade.stage2(img, p), p)
    # equal up to float32 rounding: BLAS may sum a crop's and a frame's rows in other orders
    np.testing.assert_allclose(assembled, full, rtol=0, atol=1e-6)


def test_shipped_model_crops_equal_its_full_forward() -> None:
    net = load_model()
    halo = cp.receptive_halo(net.config)
    s = cp.CascadeSettings(factor=4, threshold=0.3, margin=0, core=128, halo=halo)
    img = np.random.default_rng(2).integers(0, 256, (500, 620), dtype=np.uint8)
    p = _all_tiles(net, img.shape, s.core, halo)
    assert p.crop_h == p.crop_w == 128 + 2 * halo and len(p.tiles) == 20
    got = cp.compose(np.zeros(img.shape, np.float32), Cascade(net, s).stage2(img, p), p)
    np.testing.assert_allclose(got, net.forward(img[None])[0], rtol=0, atol=1e-6)


def test_a_halo_short_of_the_receptive_field_changes_the_cores() -> None:
    """The bound matters: halving it lets the crops' borders reach into the cores."""
    net = load_model()
    img = np.random.default_rng(2).integers(0, 256, (500, 620), dtype=np.uint8)
    short = cp.receptive_halo(net.config) // 2 // 16 * 16
    p = _all_tiles(net, img.shape, 128, short)
    s = cp.CascadeSettings(factor=4, threshold=0.3, margin=0, core=128, halo=short)
    cascade = Cascade.__new__(Cascade)  # bypass the settings check on purpose
    cascade.net, cascade.settings = net, s
    got = cp.compose(np.zeros(img.shape, np.float32), cascade.stage2(img, p), p)
    assert np.abs(got - net.forward(img[None])[0]).max() > 1e-4


def _settings(net: ScratchNet, threshold: float, margin: int = 8) -> cp.CascadeSettings:
    return cp.CascadeSettings(
        factor=2, threshold=threshold, margin=margin, core=32, halo=cp.receptive_halo(net.config)
    )


def _calibrated(threshold: float, score_threshold: float | None = 0.6) -> ScratchNet:
    net = random_model(seed=5, cfg=SMALL)
    meta = dataclasses.replace(net.meta, threshold=threshold, score_threshold=score_threshold)
    return ScratchNet(net.weights, meta)


def test_everything_suspicious_answers_exactly_as_the_full_model() -> None:
    net = _calibrated(0.5)
    img = np.random.default_rng(4).integers(0, 256, (150, 230), dtype=np.uint8)
    got = Cascade(net, _settings(net, 1e-9)).predict([img])[0]
    ref = net.predict([img])[0]
    np.testing.assert_array_equal(got.prob, ref.prob)
    np.testing.assert_array_equal(got.mask, ref.mask)
    assert (got.score, got.verdict, got.boxes) == (ref.score, ref.verdict, ref.boxes)
    assert got.regions and got.full_res_pixels and ref.regions is None


def test_a_frame_with_nothing_suspicious_is_answered_by_stage_1_alone() -> None:
    net = _calibrated(0.99, 0.99)
    img = np.random.default_rng(4).integers(0, 256, (150, 230), dtype=np.uint8)
    cascade = Cascade(net, _settings(net, 0.5))
    prob1 = cascade.stage1(img)
    s = dataclasses.replace(cascade.settings, threshold=float(prob1.max()) + 1e-3)
    got = Cascade(net, s).predict([img])[0]
    assert got.regions == [] and got.full_res_pixels == 0
    np.testing.assert_array_equal(got.prob, prob1)
    assert got.verdict == "clean" and got.boxes == [] and not got.mask.any()


def test_crops_run_only_where_stage_1_is_unsure() -> None:
    net = _calibrated(0.5)
    img = np.random.default_rng(6).integers(0, 256, (400, 400), dtype=np.uint8)
    cascade = Cascade(net, _settings(net, 0.5, margin=0))
    prob1 = cascade.stage1(img)
    thr = float(np.quantile(prob1, 0.999))  # a few suspicious pixels
    got = Cascade(net, _settings(net, thr, margin=0)).predict([img])[0]
    sus = prob1 >= np.float32(thr)
    assert got.regions and 0 < (got.full_res_pixels or 0) < 416 * 416
    inside = np.zeros(img.shape, bool)
    for x0, y0, x1, y1 in got.regions:
        inside[y0:y1, x0:x1] = True
    assert inside[sus].all()
    full = net.forward(img[None])[0]
    np.testing.assert_allclose(got.prob[inside], full[inside], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got.prob[~inside], prob1[~inside])


def test_cascade_refuses_unsafe_settings_and_extra_views() -> None:
    net = _calibrated(0.5)
    with pytest.raises(CascadeError, match="no cascade settings"):
        Cascade(net)
    with pytest.raises(CascadeError, match="receptive halo"):
        Cascade(net, dataclasses.replace(_settings(net, 0.3), halo=16))
    with pytest.raises(CascadeError, match="pixel/score threshold"):
        Cascade(net, _settings(net, 0.7))  # above the score threshold 0.6
    two = ScratchNet(net.weights, net.meta, views=("identity", "flip_h"))
    with pytest.raises(CascadeError, match="identity view"):
        Cascade(two, _settings(net, 0.3))
    for bad in ({"factor": 1}, {"core": 40}, {"threshold": 0.0}, {"margin": -1}):
        with pytest.raises(ValueError, match="cascade\\."):
            dataclasses.replace(_settings(net, 0.3), **bad)


def test_cascade_settings_round_trip_through_the_model_file(tmp_path: Path) -> None:
    net = _calibrated(0.5)
    s = dataclasses.replace(_settings(net, 0.3), calibration={"budget": {"iou_drop": 0.01}})
    meta = dataclasses.replace(net.meta, cascade=s)
    path = tmp_path / "m.npz"
    save_model(path, net.weights, meta)
    loaded = load_model(path)
    assert loaded.meta.cascade == s and read_meta(path).cascade == s
    with np.load(path, allow_pickle=False) as data:  # plain arrays, no pickled objects
        assert all(data[k].dtype != object for k in data.files)
    Cascade(loaded).predict([np.zeros((20, 20), np.uint8)])
    # a file without the field (every model before the cascade) loads with None
    old = tmp_path / "old.npz"
    save_model(old, net.weights, net.meta)
    assert load_model(old).meta.cascade is None
    # a stored halo below the network's reach is refused when the model loads
    bad = dataclasses.replace(meta, cascade=dataclasses.replace(s, halo=16))
    save_model(tmp_path / "bad.npz", net.weights, bad)
    with pytest.raises(ModelError, match="receptive halo"):
        load_model(tmp_path / "bad.npz")


def test_macs_match_the_architecture_and_scale_with_pixels() -> None:
    cfg = NetConfig()
    assert cp.macs(cfg, 1024, 1024) == 4 * cp.macs(cfg, 512, 512)
    assert cp.macs(cfg, 1000, 1000) == cp.macs(cfg, 1008, 1008)  # padded to 16
    # the stem alone: 9 taps x 24 channels per H/2 pixel
    assert cp.macs(cfg, 16, 16) > 9 * 24 * 64

"""gate_probe: the gate's input is the network's own stage-1 pass, cells are labelled by the
mask exactly, and an operating point never passes a defective image it claims to keep. (Its
AUROC is the project's own, tested in tests/model/test_evaluate.py.)"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from scratchd.kernels.normalize_pad import normalize_pad_ref
from scratchd.model import cascade_plan as cp
from scratchd.model.net import NetConfig, forward_logits_ref
from scratchd.model.scratchnet import random_model

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script() -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module("gate_probe")


@pytest.mark.parametrize("factor", [2, 4])
def test_features_carry_the_networks_own_stage1_logits(factor: int) -> None:
    gp = _script()
    cfg = NetConfig(widths=(8, 16, 24, 32), depths=(1, 1, 1, 1), dilations=(2,), dec_depth=1)
    net = random_model(seed=3, cfg=cfg)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (150, 203), dtype=np.uint8)
    f = gp.features(net, image, factor)
    small = cp.downscale(image, factor)
    x = normalize_pad_ref(small[None], net.meta.mean, net.meta.std, multiple=16)
    logits = forward_logits_ref(net.weights, cfg, x)[0]
    hh, ww = -(-small.shape[0] // 2), -(-small.shape[1] // 2)
    assert f.shape == (hh, ww, cfg.widths[0] + cfg.widths[3] + 1)
    np.testing.assert_allclose(f[..., -1], logits[:hh, :ww, 0], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 40),
    w=st.integers(1, 40),
    factor=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_a_cell_is_positive_exactly_when_it_holds_a_defect_pixel(
    h: int, w: int, factor: int, seed: int
) -> None:
    gp = _script()
    rng = np.random.default_rng(seed)
    mask = (rng.random((h, w)) < 0.02).astype(np.uint8)
    c = 2 * factor
    hh, ww = -(-h // c), -(-w // c)
    labels = gp.cell_labels(mask, factor, hh, ww)
    for i in range(hh):
        for j in range(ww):
            assert labels[i, j] == float(mask[i * c : (i + 1) * c, j * c : (j + 1) * c].any())


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.floats(0, 1, allow_nan=False), min_size=4, max_size=40),
    seed=st.integers(0, 2**16),
)
def test_an_operating_point_flags_all_but_its_missed_images(scores: list[float], seed: int) -> None:
    gp = _script()
    gate = np.array(scores)
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 3, len(gate))  # 0 clean, 1 defective found by the full model, 2 other
    clean, found = kind == 0, kind == 1
    found[0], clean[0] = True, False
    clean[-1], found[-1] = True, False
    points = gp.operating_points(gate, clean, found)
    assert [p["missed"] for p in points] == list(range(min(3, int(found.sum()))))
    for p in points:
        passed = int((gate[found] < p["threshold"]).sum())
        assert passed <= p["missed"]
        assert p["clean_at_stage1"] == pytest.approx((gate[clean] < p["threshold"]).mean())

"""Drift and entropy monitors: the estimator's invariants, and its verdict on real images."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.daemon.ops.drift import (
    BINS,
    LAMBDA,
    DriftMonitor,
    EntropyMonitor,
    kl_divergence,
    smooth,
)
from scratchd.daemon.ops.observability import read_model_reference
from scratchd.dataset.folders import scan_dataset, split_of
from scratchd.kernels.postprocess import intensity_histogram
from scratchd.protocol.image import decode_image


def _direct_kl(histograms: list[np.ndarray], reference: np.ndarray) -> float:
    """The estimator written out from the docstring, independently of the ring buffer."""
    rows = [h / h.sum() for h in np.asarray(histograms, dtype=np.float64)]
    p = (1 - LAMBDA) * np.mean(rows, axis=0) + LAMBDA / BINS
    q = (1 - LAMBDA) * reference / reference.sum() + LAMBDA / BINS
    return float(np.sum(p * np.log(p / q)))


histogram = st.lists(st.integers(0, 10_000), min_size=BINS, max_size=BINS).filter(
    lambda h: sum(h) > 0
)


@settings(max_examples=60, deadline=None)
@given(
    reference=histogram,
    stream=st.lists(histogram, min_size=1, max_size=40),
    window=st.integers(1, 12),
)
def test_score_is_kl_of_exactly_the_last_window_requests(
    reference: list[int], stream: list[list[int]], window: int
) -> None:
    ref = np.array(reference, dtype=np.uint32)
    monitor = DriftMonitor(ref, window=window)
    for h in stream:
        monitor.observe(np.array(h, dtype=np.uint32))
    recent = [np.array(h) for h in stream[-window:]]
    assert monitor.samples == len(recent)
    assert monitor.score() == pytest.approx(_direct_kl(recent, ref), rel=1e-9, abs=1e-12)
    assert monitor.score() >= 0.0


def test_identical_input_scores_zero_and_bound_holds() -> None:
    ref = np.arange(1, BINS + 1, dtype=np.float64)
    monitor = DriftMonitor(ref, window=4)
    assert monitor.score() == 0.0  # nothing seen yet
    monitor.observe(ref * 7)
    assert monitor.score() == pytest.approx(0.0, abs=1e-12)
    # All mass in one bin the training set never had: large, finite, below ln(64 / LAMBDA).
    spike = np.zeros(BINS)
    spike[0] = 1.0
    only_high = np.zeros(BINS)
    only_high[-1] = 1.0
    assert 5.0 < kl_divergence(spike, only_high) < np.log(BINS / LAMBDA)
    assert smooth(spike).min() > 0


def test_bad_histograms_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="training histogram"):
        DriftMonitor(np.zeros(BINS))
    monitor = DriftMonitor(np.ones(BINS))
    with pytest.raises(ValueError, match="64 bins"):
        monitor.observe(np.ones(32))
    with pytest.raises(ValueError, match="non-negative"):
        monitor.observe(-np.ones(BINS))
    assert monitor.samples == 0
    monitor.observe(np.zeros(BINS, np.uint32))  # no pixels: kept in the ring, ignored
    assert monitor.score() == 0.0
    monitor.observe(np.arange(BINS, dtype=np.uint32))
    assert monitor.score() == pytest.approx(_direct_kl([np.arange(BINS)], np.ones(BINS)))


def test_entropy_monitor_is_a_rolling_mean() -> None:
    monitor = EntropyMonitor(window=3)
    assert monitor.mean() == 0.0
    for value in (0.1, 0.2, 0.3, 0.9):
        monitor.observe(value)
    assert monitor.mean() == pytest.approx((0.2 + 0.3 + 0.9) / 3)
    assert monitor.snapshot()["samples"] == 3
    with pytest.raises(ValueError):
        monitor.observe(float("nan"))


def test_no_alarm_while_warming_up() -> None:
    """A few pictures are no product mix: a high score from them is reported as warming up,
    never over the threshold, until ``min_samples`` (at most the window) are in."""
    ref = np.ones(BINS)
    spike = np.zeros(BINS, np.uint32)
    spike[0] = 1000
    monitor = DriftMonitor(ref, window=10, threshold=0.15, min_samples=4)
    entropy = EntropyMonitor(window=10, min_samples=4)
    for _ in range(3):
        monitor.observe(spike)
        entropy.observe(0.5)
    snap = monitor.snapshot()
    assert snap["score"] > 0.15 and snap["warming_up"] and not snap["over_threshold"]
    assert entropy.snapshot()["warming_up"]
    monitor.observe(spike)
    entropy.observe(0.5)
    snap = monitor.snapshot()
    assert not snap["warming_up"] and snap["over_threshold"]
    assert not entropy.snapshot()["warming_up"]
    assert DriftMonitor(ref, window=3, min_samples=100).min_samples == 3  # a full window


# --- real images: held-out `val` like the training data vs shifted frames -----------------


@pytest.fixture(scope="module")
def split_images(full_data_dir: Path) -> dict[str, list[np.ndarray]]:
    """The held-out `val` images (the training split is only seen through its histogram)."""
    val = [
        decode_image(sample.image.read_bytes())
        for sample in scan_dataset(full_data_dir)
        if split_of(sample.rel) == "val"
    ]
    assert len(val) > 200
    return {"val": val}


@pytest.fixture(scope="module")
def training_histogram() -> np.ndarray:
    """The reference the daemon uses: the training histogram in the model's metadata."""
    reference = read_model_reference(os.environ.get("SCRATCHD_TEST_MODEL", ""))
    assert reference.histogram is not None, reference.problem
    return reference.histogram


def _score(reference: np.ndarray, images: list[np.ndarray], window: int) -> list[float]:
    """The score after each request, as the daemon would export it."""
    monitor = DriftMonitor(reference, window=window, threshold=0.15)
    scores = []
    for img in images:
        monitor.observe(intensity_histogram(img))
        scores.append(monitor.score())
    return scores


def test_drift_stays_low_on_held_out_images(
    split_images: dict[str, list[np.ndarray]], training_histogram: np.ndarray
) -> None:
    val = split_images["val"]
    whole = _score(training_histogram, val, window=len(val))[-1]
    assert whole < 0.03, whole
    # Parts arrive mixed like the training set: every full 150-request window of a shuffled
    # stream stays under the threshold. (A window of one product type alone need not: the
    # reference is the training *mix*; see the module docstring.)
    order = np.random.default_rng(6).permutation(len(val))
    stream = [val[i] for i in order]
    rolling = _score(training_histogram, stream, window=150)[150:]
    assert max(rolling) < 0.15 / 2, max(rolling)


@pytest.mark.parametrize(
    "shift",
    [
        pytest.param(lambda img: 255 - img, id="inverted"),
        pytest.param(
            lambda img: np.clip(img.astype(np.int32) * 1.8 + 60, 0, 255).astype(np.uint8),
            id="brightened",
        ),
    ],
)
def test_drift_rises_above_threshold_on_shifted_frames(
    split_images: dict[str, list[np.ndarray]], training_histogram: np.ndarray, shift: object
) -> None:
    assert callable(shift)
    pick = np.random.default_rng(6).permutation(len(split_images["val"]))[:150]
    val = [split_images["val"][i] for i in pick]
    shifted = [shift(img) for img in split_images["val"][-150:]]
    scores = _score(training_histogram, val + shifted, window=150)
    assert scores[len(val) - 1] < 0.15  # the window full of like data: under
    assert scores[-1] > 0.15, scores[-1]  # the window full of shifted frames: over

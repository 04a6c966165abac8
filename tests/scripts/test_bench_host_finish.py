"""bench_host_finish: the records it times are the device's layout of the map's runs, and a
frame is only timed after the two finishes agree on it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from scratchd.kernels.postprocess import threshold_runs
from scratchd.kernels.row_runs import unpack_runs

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script() -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module("bench_host_finish")


def blobs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prob = np.zeros((96, 128), np.float32)
    for _ in range(12):
        y, x, r = rng.integers(0, 96), rng.integers(0, 128), rng.integers(1, 9)
        yy, xx = np.ogrid[:96, :128]
        prob[(yy - y) ** 2 + (xx - x) ** 2 <= r * r] = rng.uniform(0.5, 1.0)
    return prob


def test_records_are_the_maps_runs_with_float32_sums() -> None:
    bench = _script()
    prob = blobs(1)
    rec, count = bench.records_of(prob, 0.5)
    row, start, end, sums = threshold_runs(prob, 0.5)
    got = unpack_runs(rec, count)
    assert count == len(row) > 0
    for a, b in zip(got[:3], (row, start, end), strict=True):
        assert np.array_equal(a, b)
    assert np.array_equal(got[3], sums.astype(np.float32).astype(np.float64))


def test_a_frame_is_timed_once_both_finishes_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _script()
    row = bench.bench_frame(blobs(2), 0.5, 16, reps=2)
    assert row["runs"] > 0 and row["boxes"] > 0
    assert all(row[k] > 0 for k in ("numpy_ms", "c_ms", "numpy_mask_ms", "c_mask_ms"))
    monkeypatch.setattr(bench._runs, "finish_records", lambda *args: [])
    with pytest.raises(SystemExit, match="disagree"):
        bench.bench_frame(blobs(2), 0.5, 16, reps=2)

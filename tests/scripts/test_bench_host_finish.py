"""bench_host_finish: a frame is only timed after the two finishes agree on it (the records
are ``row_runs_ref``'s, tested in tests/kernels/test_row_runs.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

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


def test_a_frame_is_timed_once_both_finishes_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _script()
    row = bench.bench_frame(blobs(2), 0.5, 16, reps=2)
    assert row["runs"] > 0 and row["boxes"] > 0
    assert all(row[k] > 0 for k in ("numpy_ms", "c_ms", "numpy_mask_ms", "c_mask_ms"))
    monkeypatch.setattr(bench._runs, "finish_records", lambda *args: [])
    with pytest.raises(SystemExit, match="disagree"):
        bench.bench_frame(blobs(2), 0.5, 16, reps=2)

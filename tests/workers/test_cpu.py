"""The CPU backend returns what the model predicts, and isolates a bad image from its batch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from scratchd.ipc.queue import Status
from scratchd.model.scratchnet import load_model
from scratchd.protocol.image import decode_image
from scratchd.workers.cpu import CpuBackend

MODEL = os.environ.get("SCRATCHD_TEST_MODEL") or None


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    cpu = CpuBackend(MODEL, max_batch=4)
    cpu.warm_up()
    return cpu


def _images(data_dir: Path) -> list[np.ndarray]:
    paths = [
        data_dir / "sd900" / "images" / "Sc_1.png",
        data_dir / "sd900" / "images" / "Pa_2.png",
        sorted((data_dir / "mtile" / "crack").glob("*.jpg"))[0],
    ]
    return [decode_image(p.read_bytes()) for p in paths]


def test_results_are_the_models_predictions(backend: CpuBackend, data_dir: Path) -> None:
    images = _images(data_dir)
    results = backend.infer(images, [True, False, True])
    expected = load_model(MODEL).predict(images)
    assert len(results) == 3
    for result, pred, image, want in zip(
        results, expected, images, [True, False, True], strict=True
    ):
        assert result.status is Status.OK and result.batch_size == 3
        assert result.verdict_defect == (pred.verdict == "defect")
        assert result.score == pytest.approx(pred.score, abs=1e-6)
        assert len(result.boxes) == min(len(pred.boxes), 64)
        for got, ref in zip(result.boxes, pred.boxes, strict=False):
            assert got == pytest.approx(ref, abs=1e-4)
        assert result.entropy == pytest.approx(pred.entropy, abs=1e-6)
        np.testing.assert_array_equal(result.histogram, pred.histogram)
        assert result.compute_ns > 0
        if want:
            assert result.mask is not None and result.mask.shape == image.shape
            np.testing.assert_array_equal(result.mask, pred.mask)
        else:
            assert result.mask is None


def test_a_bad_image_fails_alone(backend: CpuBackend, data_dir: Path) -> None:
    good = _images(data_dir)[0]
    bad = np.zeros((0, 7), np.uint8)
    results = backend.infer([good, bad, good], [False, False, False])
    assert [r.status for r in results] == [Status.OK, Status.ERROR, Status.OK]
    assert "model failed" in results[1].error
    assert results[0].score == pytest.approx(results[2].score)


def test_the_backend_names_its_model(backend: CpuBackend) -> None:
    assert backend.device == "cpu" and backend.max_batch == 4
    assert backend.version == load_model(MODEL).version

"""scripts/get_data.py: the two public sets, as their repositories lay them out, become the
layout training, ``eval`` and ``shard build`` read."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image

from scratchd.dataset.folders import scan_dataset
from scratchd.protocol.image import decode_image

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def _save(path: Path, pixels: np.ndarray, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, fmt)


def test_upstream_layouts_become_the_training_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sd, mt, out = tmp_path / "SD-saliency-900", tmp_path / "Magnetic-tile", tmp_path / "data"
    pixels = {}
    for name in ("Sc_1", "In_2", "Pa_3"):
        pixels[name] = rng.integers(0, 256, (20, 20), np.uint8)
        _save(sd / "Source Images" / f"{name}.bmp", pixels[name], "BMP")
        _save(sd / "Ground truth" / f"{name}.png", np.full((20, 20), 255, np.uint8), "PNG")
    _save(sd / "Source Images" / "Sc_9.bmp", pixels["Sc_1"], "BMP")  # no mask: left out
    for cls in ("Crack", "Free"):
        _save(mt / f"MT_{cls}" / "Imgs" / "exp1_num_4.jpg", pixels["Sc_1"], "JPEG")
        _save(mt / f"MT_{cls}" / "Imgs" / "exp1_num_4.png", np.zeros((20, 20), np.uint8), "PNG")
    get_data = _script("get_data")
    assert get_data.main([str(out), "--sd900", str(sd), "--mtile", str(mt)]) == 0
    samples = {s.rel: s for s in scan_dataset(out)}
    assert set(samples) == {
        "sd900/images/Sc_1.png", "sd900/images/In_2.png", "sd900/images/Pa_3.png",
        "mtile/crack/exp1_num_4.jpg", "mtile/free/exp1_num_4.jpg",
    }  # fmt: skip
    assert all(s.mask is not None for s in samples.values())
    sc = samples["sd900/images/Sc_1.png"]
    assert np.array_equal(decode_image(sc.image.read_bytes()), pixels["Sc_1"])  # lossless
    assert {s.group for s in samples.values()} >= {"sd900/Sc", "mtile/crack", "mtile/free"}


def test_a_folder_without_either_set_exits_2(tmp_path: Path) -> None:
    get_data = _script("get_data")
    (tmp_path / "empty").mkdir()
    assert get_data.main([str(tmp_path / "out"), "--sd900", str(tmp_path / "empty")]) == 2
    assert get_data.main([str(tmp_path / "out"), "--mtile", str(tmp_path / "nowhere")]) == 2

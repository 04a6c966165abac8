"""The committed fixture of real images: laid out as the full sets are, and exactly the
selection ``scripts/make_test_fixture.py`` makes of them (checked when they are present)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from scratchd.dataset.folders import scan_dataset
from scratchd.protocol.image import decode_image

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CLASSES = ("blowhole", "break", "crack", "fray", "free", "uneven")


def _script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def test_the_fixture_has_every_class_with_its_masks(data_dir: Path) -> None:
    samples = scan_dataset(data_dir)
    groups = {s.group for s in samples}
    assert groups == {"sd900/Sc", "sd900/In", "sd900/Pa", *(f"mtile/{c}" for c in CLASSES)}
    for sample in samples:
        assert sample.mask is not None, sample.rel
        image, mask = (
            decode_image(sample.image.read_bytes()),
            decode_image(sample.mask.read_bytes()),
        )
        assert mask.shape == image.shape, sample.rel
    assert sum(f.stat().st_size for f in data_dir.rglob("*") if f.is_file()) < 3_000_000


def test_the_fixture_is_the_selection_of_the_full_sets(full_data_dir: Path) -> None:
    make = _script("make_test_fixture")
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "data"
    assert make.differences(full_data_dir, fixture) == []


def test_the_selection_is_a_function_of_the_names(tmp_path: Path) -> None:
    make = _script("make_test_fixture")
    for n in range(1, 70):
        (tmp_path / "sd900" / "images").mkdir(parents=True, exist_ok=True)
        (tmp_path / "sd900" / "images" / f"Sc_{n}.png").write_bytes(b"")
    (tmp_path / "mtile" / "crack").mkdir(parents=True)
    for n in range(40):
        (tmp_path / "mtile" / "crack" / f"exp_{n:02d}.jpg").write_bytes(b"")
    chosen = make.select(tmp_path)
    sd = [r for r in chosen if r.startswith("sd900/images/")]
    assert sd == [f"sd900/images/Sc_{n}.png" for n in (1, 2, 33, 34, 65, 66)]
    assert "sd900/masks/Sc_1.png" in chosen
    tiles = [r for r in chosen if r.endswith(".jpg")]
    assert tiles == [f"mtile/crack/exp_{n:02d}.jpg" for n in (0, 16, 32)]
    assert "mtile/crack/exp_16.png" in chosen

"""``scratchd eval`` on a few real images and ``scratchd model info``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from scratchd.daemon.cli import main
from scratchd.dataset.folders import split_of
from scratchd.model.scratchnet import decide, load_model
from scratchd.protocol.image import decode_image


def small_dataset(data_dir: Path, root: Path) -> Path:
    """Two SD-900 images (images/ + masks/ layout) and tiles beside their masks."""
    for name in ("Sc_1.png", "Pa_2.png"):
        for sub in ("images", "masks"):
            (root / "sd900" / sub).mkdir(parents=True, exist_ok=True)
            shutil.copy(data_dir / "sd900" / sub / name, root / "sd900" / sub / name)
    for cls in ("crack", "free"):
        src = sorted((data_dir / "mtile" / cls).glob("*.jpg"))[0]
        (root / "mtile" / cls).mkdir(parents=True)
        shutil.copy(src, root / "mtile" / cls / src.name)
        shutil.copy(src.with_suffix(".png"), root / "mtile" / cls / src.with_suffix(".png").name)
    return root


def test_eval_json_rows_masks_and_summary(data_dir: Path, tmp_path: Path) -> None:
    root = small_dataset(data_dir, tmp_path / "data")
    out = tmp_path / "masks"
    result = CliRunner().invoke(main, ["eval", str(root), "--json", "--mask-out", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    rows, summary = lines[:-1], lines[-1]["summary"]
    assert [r["image"] for r in rows] == sorted(r["image"] for r in rows)
    assert {r["image"] for r in rows} == {
        "sd900/images/Sc_1.png", "sd900/images/Pa_2.png",
        *(str(p.relative_to(root)) for p in root.glob("mtile/*/*.jpg")),
    }  # fmt: skip
    for row in rows:
        assert row["verdict"] in ("defect", "clean") and 0 <= row["score"] <= 1
        threshold = load_model().meta.score_threshold
        assert row["verdict"] == decide(row["score"], bool(row["boxes"]), threshold)
        image = decode_image((root / row["image"]).read_bytes())
        mask = decode_image((out / row["image"]).with_suffix(".png").read_bytes())
        assert mask.shape == image.shape and set(np.unique(mask)) <= {0, 255}
        for x0, y0, x1, y1, s in row["boxes"]:
            assert 0 <= x0 < x1 <= image.shape[1] and 0 <= y0 < y1 <= image.shape[0] and 0 < s <= 1
    sd_rows = [r for r in rows if r["image"].startswith("sd900")]
    assert all(r["verdict"] == "defect" for r in sd_rows)  # both are obvious defects
    assert set(summary["iou"]) >= {"sd900", "sd900/Sc", "sd900/Pa", "mtile", "mtile/crack"}
    assert summary["iou"]["sd900"] > 0.5
    assert summary["images"] == 4 and summary["errors"] == 0 and "mtile" in summary["auroc"]


def test_eval_views_and_split(data_dir: Path, tmp_path: Path) -> None:
    """``--views identity --views transpose --split val``: only the images split_of puts in
    val, scored by that two-view model (as the daemon's ``model.views`` serves them), not by
    the model file's own views."""
    root = small_dataset(data_dir, tmp_path / "data")
    rels = sorted(str(p.relative_to(root)) for p in root.rglob("*.*") if "masks" not in p.parts)
    rels = [r for r in rels if not (r.endswith(".png") and r.startswith("mtile"))]  # masks
    val = [r for r in rels if split_of(r, 0.2) == "val"]
    assert val and len(val) < len(rels)  # both sides non-empty, or the filter is untested
    views = ("identity", "transpose")
    args = ["eval", str(root), "--json", "--views", views[0], "--views", views[1], "--split", "val"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    *rows, last = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["image"] for r in rows] == val and last["summary"]["views"] == list(views)
    chosen, shipped = load_model(views=views), load_model()
    assert tuple(shipped.views) != views
    differ = 0
    for row in rows:
        image = decode_image((root / row["image"]).read_bytes())
        assert row["score"] == pytest.approx(chosen.predict([image])[0].score, abs=1e-6)
        differ += abs(row["score"] - shipped.predict([image])[0].score) > 1e-6
    assert differ  # the model file's own views score them otherwise
    train = CliRunner().invoke(main, ["eval", str(root), "--json", "--split", "train"])
    *rows, last = [json.loads(line) for line in train.stdout.splitlines()]
    assert sorted(r["image"] for r in rows) == sorted(set(rels) - set(val))
    assert last["summary"]["views"] == list(shipped.views)  # no --views: the model's own
    twice = CliRunner().invoke(main, ["eval", str(root), "--views", "flip_h", "--views", "flip_h"])
    assert twice.exit_code == 2 and "--views" in twice.output


def test_eval_reports_unreadable_image_and_goes_on(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    Image.fromarray(np.full((30, 40), 120, np.uint8)).save(tmp_path / "ok.bmp")
    result = CliRunner().invoke(main, ["eval", str(tmp_path), "--json"])
    assert result.exit_code == 1
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert "error" in rows[0] and rows[0]["image"] == "bad.png"
    assert rows[1]["image"] == "ok.bmp" and rows[1]["verdict"] == "clean"
    assert rows[2]["summary"]["errors"] == 1


def test_model_info_json() -> None:
    result = CliRunner().invoke(main, ["model", "info", "--json"])
    assert result.exit_code == 0, result.output
    meta = json.loads(result.stdout)
    assert meta["params"] > 0 and meta["version"] and len(meta["histogram"]) == 64
    assert {"architecture", "mean", "std", "threshold", "min_area", "val_metrics"} <= set(meta)


def synthetic_dataset(root: Path) -> Path:
    """Two SD-900-style images with a bright scratch and two clean tiles beside their masks."""
    rng = np.random.default_rng(0)
    for i in (1, 2):
        img = rng.integers(90, 110, (64, 64), dtype=np.uint8)
        mask = np.zeros((64, 64), np.uint8)
        img[30:33, 5:60] = 250
        mask[30:33, 5:60] = 255
        for sub, arr in (("images", img), ("masks", mask)):
            (root / "sd900" / sub).mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr).save(root / "sd900" / sub / f"Sc_{i}.png")
        tile = root / "mtile" / "free"
        tile.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(90, 110, (48, 80), dtype=np.uint8)).save(tile / f"t{i}.jpg")
        Image.fromarray(np.zeros((48, 80), np.uint8)).save(tile / f"t{i}.png")
    crack = root / "mtile" / "crack"
    crack.mkdir(parents=True, exist_ok=True)
    img = rng.integers(90, 110, (48, 80), dtype=np.uint8)
    mask = np.zeros((48, 80), np.uint8)
    img[20:23, 10:70], mask[20:23, 10:70] = 20, 255
    Image.fromarray(img).save(crack / "c1.jpg")
    Image.fromarray(mask).save(crack / "c1.png")
    return root


def test_eval_reports_decisions_roc_and_table(tmp_path: Path) -> None:
    root = synthetic_dataset(tmp_path / "data")
    roc = tmp_path / "roc.png"
    args = ["eval", str(root), "--json", "--views", "identity", "--roc", str(roc)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.splitlines()[-1])["summary"]
    assert set(summary["clean_rejected"]) == {"mtile", "mtile/free"}
    assert set(summary["defect_passed"]) >= {"sd900", "sd900/Sc", "mtile", "mtile/crack"}
    assert summary["operating_point"]["threshold"] == load_model().meta.threshold
    assert Image.open(roc).format == "PNG"
    text = CliRunner().invoke(main, ["eval", str(root), "--views", "identity"])
    assert text.exit_code == 0, text.output
    for word in ("clean rejected", "defect passed", "mtile/free", "sd900/Sc"):
        assert word in text.stderr

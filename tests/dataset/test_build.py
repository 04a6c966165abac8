"""``build_shards`` over fixture trees in both layouts and over the full data sets
(``SCRATCHD_DATA``, skipped without them)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from scratchd.dataset.shard import BuildReport, build_shards, check_shards, open_shards
from scratchd.protocol.image import decode_image


def save(path: Path, array: np.ndarray, fmt: str) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def picture(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width), dtype=np.uint8)


def blob(height: int, width: int) -> np.ndarray:
    mask = np.zeros((height, width), np.uint8)
    mask[height // 4 : height // 2, width // 4 : width // 2] = 255
    return mask


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Both layouts, every input format, and one of each kind of bad file."""
    src = tmp_path / "src"
    save(src / "sd/images/Sc_1.png", picture(20, 20, 1), "PNG")
    save(src / "sd/masks/Sc_1.png", blob(20, 20), "PNG")
    save(src / "sd/images/In_2.bmp", picture(20, 20, 2), "BMP")
    save(src / "sd/masks/In_2.png", blob(20, 20)[:, :19], "PNG")  # wrong size
    soft = blob(30, 40)
    soft[7, 10:20] = 200  # soft edge above the threshold
    soft[15, 10:20] = 60  # and below it
    save(src / "mt/crack/exp1_num_5.jpg", picture(30, 40, 3), "JPEG")
    save(src / "mt/crack/exp1_num_5.png", soft, "PNG")
    save(src / "mt/free/exp1_num_6.jpg", picture(30, 40, 4), "JPEG")
    save(src / "mt/free/exp1_num_6.png", np.zeros((30, 40), np.uint8), "PNG")
    save(src / "mt/free/exp1_num_7.jpg", picture(30, 40, 5), "JPEG")
    save(src / "mt/free/exp1_num_7.png", np.full((30, 40), 120, np.uint8), "PNG")  # grey
    save(src / "mt/free/exp1_num_8.bmp", picture(8, 8, 6), "BMP")
    (src / "mt/free/exp1_num_8.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")  # unreadable
    (src / "mt/free/broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    save(src / "mt/free/unlabelled.png", picture(9, 11, 7), "PNG")
    return src


def test_build_packs_inputs_repairs_masks_and_names_rejects(tree: Path, tmp_path: Path) -> None:
    report = build_shards(tree, tmp_path / "out", val_fraction=0.5)
    assert (report.images, report.records, report.with_mask) == (8, 4, 3)
    assert (report.masks_repaired, report.mask_pixels_repaired) == (1, 20)
    assert report.train + report.val == 4 and report.shards == 1
    reasons = {r.name: r.reason for r in report.rejected}
    assert set(reasons) == {
        "sd/masks/In_2.png",
        "mt/free/exp1_num_7.png",
        "mt/free/exp1_num_8.png",
        "mt/free/broken.jpg",
    }
    assert "19x20" in reasons["sd/masks/In_2.png"]
    assert "mid-grey" in reasons["mt/free/exp1_num_7.png"]
    assert "unreadable mask" in reasons["mt/free/exp1_num_8.png"]
    assert "JPEG" in reasons["mt/free/broken.jpg"]
    assert check_shards(tmp_path / "out").ok


def test_records_hold_the_original_bytes_and_binary_masks(tree: Path, tmp_path: Path) -> None:
    build_shards(tree, tmp_path / "out")
    with open_shards(tmp_path / "out") as shards:
        records = {r.meta.rel: r for r in shards}
        assert list(records) == sorted(records)
        crack = records["mt/crack/exp1_num_5.jpg"]
        assert bytes(crack.image) == (tree / crack.meta.rel).read_bytes()
        assert crack.meta.image_format == "JPEG" and (crack.meta.width, crack.meta.height) == (
            40,
            30,
        )
        assert crack.meta.group == "mt/crack" and crack.meta.mask_repaired_pixels == 20
        assert crack.mask is not None
        mask = decode_image(crack.mask)
        expected = blob(30, 40)
        expected[7, 10:20] = 255
        np.testing.assert_array_equal(mask, expected)
        assert crack.meta.defect_pixels == int(np.count_nonzero(expected))
        assert records["sd/images/Sc_1.png"].meta.group == "sd/Sc"
        free = records["mt/free/exp1_num_6.jpg"]
        assert free.mask is not None and not decode_image(free.mask).any()
        assert records["mt/free/unlabelled.png"].mask is None


def test_real_data_builds_with_the_expected_counts(full_data_dir: Path, tmp_path: Path) -> None:
    report: BuildReport = build_shards(full_data_dir, tmp_path / "real")
    assert report.rejected == []
    assert report.images == report.records == report.with_mask == 1416
    assert report.masks_repaired > 0  # the mtile masks have soft edges
    with open_shards(tmp_path / "real") as shards:
        sd900 = shards.indices(group_prefix="sd900")
        assert len(sd900) == 720
        assert all(shards.meta(i).defect_pixels > 0 for i in sd900)
        free = shards.indices(group_prefix="mtile/free")
        assert len(free) == 381
        for i in free:
            mask = shards[i].mask
            assert mask is not None and not decode_image(mask).any()
        groups = {shards.meta(i).group for i in shards.indices(group_prefix="mtile")}
        assert groups == {
            f"mtile/{c}" for c in ("blowhole", "break", "crack", "fray", "free", "uneven")
        }
        val = shards.indices(split="val")
        assert 0.15 < len(val) / len(shards) < 0.25
        assert shards.indices(split="val", group_prefix="mtile/crack")  # every class is validated

"""Both dataset layouts are read: which file is an input, which its mask, and its group."""

from __future__ import annotations

from pathlib import Path

import pytest

from scratchd.dataset.folders import scan_dataset, split_of


def touch(root: Path, *rels: str) -> None:
    for rel in rels:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def table(root: Path) -> list[tuple[str, str | None, str]]:
    return [
        (s.rel, None if s.mask is None else s.mask.relative_to(root).as_posix(), s.group)
        for s in scan_dataset(root)
    ]


def test_images_and_masks_folders(tmp_path: Path) -> None:
    touch(
        tmp_path,
        "sd/images/Sc_1.png",
        "sd/masks/Sc_1.png",
        "sd/images/In_20.bmp",
        "sd/masks/In_20.png",
        "sd/images/Pa_3.jpg",  # no mask: still an input
        "sd/masks/Pa_9.png",  # an orphan mask is not an input
    )
    assert table(tmp_path) == [
        ("sd/images/In_20.bmp", "sd/masks/In_20.png", "sd/In"),
        ("sd/images/Pa_3.jpg", None, "sd/Pa"),
        ("sd/images/Sc_1.png", "sd/masks/Sc_1.png", "sd/Sc"),
    ]


def test_masks_beside_jpeg_and_bmp_inputs(tmp_path: Path) -> None:
    touch(
        tmp_path,
        "mt/crack/exp1_num_4.jpg",
        "mt/crack/exp1_num_4.png",
        "mt/free/exp2_num_9.JPG",
        "mt/free/exp2_num_9.png",
        "mt/free/exp3_num_1.bmp",
        "mt/free/exp3_num_1.png",
        "mt/free/lonely.png",  # a PNG with no JPEG/BMP twin is an input
        "mt/free/.hidden.jpg",
        "mt/free/notes.txt",
    )
    assert table(tmp_path) == [
        ("mt/crack/exp1_num_4.jpg", "mt/crack/exp1_num_4.png", "mt/crack"),
        ("mt/free/exp2_num_9.JPG", "mt/free/exp2_num_9.png", "mt/free"),
        ("mt/free/exp3_num_1.bmp", "mt/free/exp3_num_1.png", "mt/free"),
        ("mt/free/lonely.png", None, "mt/free"),
    ]


def test_layouts_mix_under_one_root_and_at_its_top(tmp_path: Path) -> None:
    touch(tmp_path, "images/Sc_2.png", "masks/Sc_2.png", "top.jpg", "top.png", "x/y/img.bmp")
    assert table(tmp_path) == [
        ("images/Sc_2.png", "masks/Sc_2.png", "Sc"),
        ("top.jpg", "top.png", "."),
        ("x/y/img.bmp", None, "x/y"),
    ]


def test_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError):
        scan_dataset(tmp_path / "absent")


def test_split_is_stable_and_close_to_the_fraction() -> None:
    rels = [f"sd900/images/Sc_{i}.png" for i in range(4000)]
    val = [r for r in rels if split_of(r, 0.2) == "val"]
    assert 0.17 < len(val) / len(rels) < 0.23
    # Pinned answers: a change of hash would move images between train and validation.
    assert [split_of(f"sd900/images/Sc_{i}.png") for i in range(1, 9)] == PINNED
    assert {split_of(r, 0.0) for r in rels} == {"train"}
    assert {split_of(r, 1.0) for r in rels} == {"val"}
    with pytest.raises(ValueError):
        split_of("a", 1.5)


PINNED = ["val", "val", "train", "train", "val", "train", "train", "train"]


def test_real_data_layouts(full_data_dir: Path) -> None:
    samples = scan_dataset(full_data_dir)
    by_group: dict[str, int] = {}
    for sample in samples:
        assert sample.mask is not None, sample.rel
        by_group[sample.group] = by_group.get(sample.group, 0) + 1
    assert {g: n for g, n in by_group.items() if g.startswith("sd900/")} == {
        "sd900/Sc": 240,
        "sd900/In": 240,
        "sd900/Pa": 240,
    }
    mtile = {g for g in by_group if g.startswith("mtile/")}
    assert mtile == {f"mtile/{c}" for c in ("blowhole", "break", "crack", "fray", "free", "uneven")}
    assert by_group["mtile/free"] == 381
    assert not any(s.rel.endswith(".png") and s.rel.startswith("mtile/") for s in samples)

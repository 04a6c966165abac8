"""``scratchd shard build`` and ``scratchd shard check`` through the real command group."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from PIL import Image

from scratchd.daemon.cli import main


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())


def test_build_then_check_then_corruption_exits_1_naming_the_record(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    rng = np.random.default_rng(1)
    for i in range(3):
        write_png(src / f"images/Sc_{i}.png", rng.integers(0, 256, (16, 16), dtype=np.uint8))
        mask = np.zeros((16, 16), np.uint8)
        mask[4:8, 4:8] = 255 if i else 254  # the first one needs a repair
        write_png(src / f"masks/Sc_{i}.png", mask)
    write_png(src / "masks/Sc_2.png", np.zeros((9, 9), np.uint8))  # wrong size: rejected
    runner = CliRunner()
    built = runner.invoke(main, ["shard", "build", str(src), str(out), "--val-fraction", "0.3"])
    assert built.exit_code == 0, built.output
    assert "images found      3" in built.output
    assert "masks repaired    1 files, 16 pixels" in built.output
    assert "rejected          1" in built.output and "masks/Sc_2.png" in built.output

    checked = runner.invoke(main, ["shard", "check", str(out)])
    assert checked.exit_code == 0, checked.output
    assert "2 records intact" in checked.output

    shard = out / "shard-00000.scs"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # inside the last record's mask
    shard.write_bytes(bytes(data))
    damaged = runner.invoke(main, ["shard", "check", str(out)])
    assert damaged.exit_code == 1
    assert "shard-00000.scs record 1" in damaged.output


def test_check_without_a_manifest_fails_cleanly(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["shard", "check", str(tmp_path)])
    assert result.exit_code == 1
    assert "manifest.json" in result.output


def test_build_only_one_split_holds_exactly_that_splits_records(tmp_path: Path) -> None:
    """``--only train`` packs the records a full build puts in the train split, byte for
    byte, and none of the other split (nothing of it is read)."""
    from scratchd.dataset.shard import open_shards

    src = tmp_path / "src"
    rng = np.random.default_rng(2)
    for i in range(12):
        write_png(src / f"images/Sc_{i}.png", rng.integers(0, 256, (12, 12), dtype=np.uint8))
        write_png(src / f"masks/Sc_{i}.png", (rng.random((12, 12)) < 0.2).astype(np.uint8) * 255)
    runner = CliRunner()
    args = ["shard", "build", str(src), "--val-fraction", "0.5"]
    full = runner.invoke(main, [*args[:3], str(tmp_path / "full"), *args[3:]])
    only = runner.invoke(main, [*args[:3], str(tmp_path / "train"), *args[3:], "--only", "train"])
    assert full.exit_code == 0 and only.exit_code == 0, full.output + only.output

    def records(out: Path, split: str) -> list[tuple[str, bytes, bytes | None]]:
        with open_shards(out) as ss:
            return [
                (r.meta.rel, bytes(r.image), None if r.mask is None else bytes(r.mask))
                for r in (ss[i] for i in ss.indices(split=split))
            ]

    train, val = records(tmp_path / "full", "train"), records(tmp_path / "full", "val")
    assert train and val  # the source has both splits
    assert records(tmp_path / "train", "train") == train
    assert records(tmp_path / "train", "val") == []
    assert f"left out          {len(val)} of the other split" in only.output

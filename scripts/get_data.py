"""Lay out local copies of the two public data sets the way training and ``eval`` read them.

    python scripts/get_data.py --sd900 SD-saliency-900/ --mtile Magnetic-tile-defect-datasets/ data/

Neither set can be fetched by this script (both are for research use; get them from their
authors' pages, README "The data sets"). Given the folders as their repositories lay them
out, it writes::

    OUT/sd900/images/Sc_1.png      OUT/sd900/masks/Sc_1.png     (SD-saliency-900)
    OUT/mtile/crack/exp1_num_4.jpg OUT/mtile/crack/exp1_num_4.png (magnetic tiles)

- SD-saliency-900: every image named ``{Sc,In,Pa}_<n>`` (BMP, PNG or JPEG) outside a
  ground-truth folder is an input; its mask is the same-named file in a folder whose name
  says ground truth (``Ground truth``, ``GT``, ``masks``). Both are written as 8-bit grey
  PNG, the same pixels (the originals are BMP).
- Magnetic tiles: each ``MT_<Class>`` folder (``MT_Crack/Imgs/*.jpg`` with the ``.png`` mask
  beside each) becomes ``mtile/<class>/``, files copied as they are.

An input without its mask is left out and named. Exit status 2 when a source folder holds
nothing recognisable (wrong folder given), 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from PIL import Image

SD900_NAME = re.compile(r"^(Sc|In|Pa)_\d+$")
SD900_SUFFIXES = frozenset({".bmp", ".png", ".jpg", ".jpeg"})
MASK_FOLDER = re.compile(r"ground|^gt$|mask", re.I)
MTILE_FOLDER = re.compile(r"^MT_([A-Za-z]+)$")


def _is_mask_path(path: Path, root: Path) -> bool:
    return any(MASK_FOLDER.search(part) for part in path.relative_to(root).parent.parts)


def _grey_png(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(src) as image:
        image.convert("L").save(dst, "PNG")


def lay_out_sd900(src: Path, out: Path) -> tuple[int, list[str]]:
    """Inputs written and the inputs left out for want of a mask."""
    files = [p for p in sorted(src.rglob("*")) if p.suffix.lower() in SD900_SUFFIXES]
    named = [p for p in files if SD900_NAME.match(p.stem)]
    masks = {p.stem: p for p in named if _is_mask_path(p, src)}
    written, missing = 0, []
    for image in (p for p in named if not _is_mask_path(p, src)):
        mask = masks.get(image.stem)
        if mask is None:
            missing.append(str(image))
            continue
        _grey_png(image, out / "sd900" / "images" / f"{image.stem}.png")
        _grey_png(mask, out / "sd900" / "masks" / f"{image.stem}.png")
        written += 1
    return written, missing


def lay_out_mtile(src: Path, out: Path) -> tuple[int, list[str]]:
    """Inputs copied (with their masks) and the inputs left out for want of a mask."""
    written, missing = 0, []
    for folder in sorted(p for p in src.rglob("MT_*") if p.is_dir()):
        match = MTILE_FOLDER.match(folder.name)
        if match is None:
            continue
        dst = out / "mtile" / match.group(1).lower()
        for image in sorted(folder.rglob("*.jpg")):
            mask = image.with_suffix(".png")
            if not mask.is_file():
                missing.append(str(image))
                continue
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(image, dst / image.name)
            shutil.copyfile(mask, dst / mask.name)
            written += 1
    return written, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path, help="the folder to write (sd900/, mtile/)")
    ap.add_argument("--sd900", type=Path, help="a copy of the SD-saliency-900 set")
    ap.add_argument("--mtile", type=Path, help="a copy of the magnetic-tile defect set")
    args = ap.parse_args(argv)
    if args.sd900 is None and args.mtile is None:
        ap.error("give --sd900, --mtile or both")
    status = 0
    for name, src, lay_out in (
        ("sd900", args.sd900, lay_out_sd900),
        ("mtile", args.mtile, lay_out_mtile),
    ):
        if src is None:
            continue
        if not src.is_dir():
            print(f"error: {src}: not a folder", file=sys.stderr)
            status = 2
            continue
        written, missing = lay_out(src, args.out)
        for path in missing:
            print(f"{name}: no mask for {path}: left out", file=sys.stderr)
        if written == 0:
            print(f"error: {src}: no {name} images with masks found", file=sys.stderr)
            status = 2
        print(f"{name}: {written} images with masks in {args.out / name}")
    return status


if __name__ == "__main__":
    sys.exit(main())

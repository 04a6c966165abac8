"""Copy the test suite's small fixture of real images out of the full data sets.

    python scripts/make_test_fixture.py SRC [--out tests/fixtures/data] [--check]

SRC is laid out as ``scratchd shard build`` reads it (``sd900/images``, ``sd900/masks``,
``mtile/<class>/``). The subset is a pure function of the file names, so anyone with the
full sets gets the same files:

- SD-900: of each class (``Sc``, ``In``, ``Pa``), the images numbered 1 and 2 of every 32
  (1, 2, 33, 34, ..., 225, 226), with their masks;
- magnetic tiles: of each class folder, every 16th ``.jpg`` in name order starting with the
  first, with its ``.png`` mask.

Both sets are thinned about equally, so the fixture keeps the full sets' mix of products
(the drift reference is the training mix). ``--check`` copies nothing and exits 1 when the
committed fixture differs from the selection (a file missing, extra or changed).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

SD900_EVERY = 32
SD900_FIRST = (1, 2)  # of every SD900_EVERY numbers
MTILE_EVERY = 16
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "data"
_SD900_NAME = re.compile(r"^[A-Za-z]+_(\d+)$")


def select(src: Path) -> list[str]:
    """The fixture's files (images and their masks) as paths relative to ``src``, sorted."""
    chosen: list[str] = []
    for image in sorted((src / "sd900" / "images").glob("*.png")):
        match = _SD900_NAME.match(image.stem)
        if match and (int(match.group(1)) - 1) % SD900_EVERY + 1 in SD900_FIRST:
            chosen += [f"sd900/images/{image.name}", f"sd900/masks/{image.name}"]
    for folder in sorted(p for p in (src / "mtile").iterdir() if p.is_dir()):
        for image in sorted(folder.glob("*.jpg"))[::MTILE_EVERY]:
            chosen += [f"mtile/{folder.name}/{image.name}", f"mtile/{folder.name}/{image.stem}.png"]
    return sorted(chosen)


def differences(src: Path, out: Path) -> list[str]:
    """What stops ``out`` from being exactly the selection of ``src`` (empty when it is)."""
    wanted = set(select(src))
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    problems = [f"missing: {rel}" for rel in sorted(wanted - present)]
    problems += [f"not in the selection: {rel}" for rel in sorted(present - wanted)]
    problems += [
        f"differs from the source: {rel}"
        for rel in sorted(wanted & present)
        if (src / rel).read_bytes() != (out / rel).read_bytes()
    ]
    return problems


def copy(src: Path, out: Path) -> int:
    """Replace ``out`` with the selection of ``src``; the number of files copied."""
    if out.exists():
        shutil.rmtree(out)
    files = select(src)
    for rel in files:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out / rel)
    return len(files)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("src", type=Path, help="the full data sets (sd900/, mtile/)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the fixture folder")
    ap.add_argument("--check", action="store_true", help="compare instead of copying")
    args = ap.parse_args()
    if args.check:
        problems = differences(args.src, args.out)
        print("\n".join(problems) or f"{args.out} is the selection of {args.src}")
        sys.exit(1 if problems else 0)
    print(f"copied {copy(args.src, args.out)} files to {args.out}")


if __name__ == "__main__":
    main()

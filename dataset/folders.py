"""Finding input images and their masks in a dataset folder.

Two layouts occur (both in ``../shared/data``) and may be mixed under one root::

    sd900/images/Sc_1.png            input          mtile/crack/exp1_num_4.jpg   input
    sd900/masks/Sc_1.png             its mask       mtile/crack/exp1_num_4.png   its mask

Which file is what is decided by these rules, in this order:

1. a file whose folder is called ``masks`` is a mask;
2. a ``.png`` with a same-named ``.jpg``/``.jpeg``/``.bmp`` beside it is that image's mask;
3. every other PNG, BMP or JPEG is an input (line cameras deliver all three).

An input's mask is the first that exists of ``<dir>/masks/NAME.png``,
``<dir>/../masks/NAME.png`` (when ``<dir>`` is called ``images``) and ``<dir>/NAME.png``
(when the input is not itself that PNG). An input without a mask has ``mask=None``;
it is still an input (unlabelled, or a negative when the dataset says so).

Each sample belongs to a *group*, used for per-class metrics and filtering: the input's
folder relative to the root without a trailing ``images`` component, plus ``/<Prefix>`` when
the file stem reads ``<Letters>_<digits>`` (``sd900/images/Sc_12.png`` → ``sd900/Sc``,
``mtile/crack/exp1_num_4.jpg`` → ``mtile/crack``). The train/validation split is a pure
function of the relative path (:func:`split_of`), so every machine and every rebuild puts
an image on the same side.

Hidden files and folders (``.name``) are skipped. Extensions are matched case-insensitively.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

INPUT_SUFFIXES = frozenset({".png", ".bmp", ".jpg", ".jpeg"})
_MASK_PARTNERS = frozenset({".jpg", ".jpeg", ".bmp"})
_PREFIXED_STEM = re.compile(r"^([A-Za-z]+)_\d+$")

Split = Literal["train", "val"]


@dataclass(frozen=True)
class Sample:
    """One input image of a dataset folder and the mask that belongs to it."""

    image: Path
    mask: Path | None
    rel: str  # image path relative to the dataset root, posix separators
    group: str


def scan_dataset(root: Path) -> list[Sample]:
    """Every input image under ``root`` with its mask (or None), sorted by ``rel``."""
    root = Path(root)
    if not root.is_dir():
        raise NotADirectoryError(f"dataset folder {root} does not exist")
    files = _index_files(root)
    samples = [
        Sample(
            image=root / rel,
            mask=_find_mask(rel, files, root),
            rel=rel.as_posix(),
            group=group_of(rel),
        )
        for rel in files.values()
        if not _is_mask(rel, files)
    ]
    return sorted(samples, key=lambda s: s.rel)


def group_of(rel: Path) -> str:
    """The group of an input at ``rel`` (relative to the root): see the module docstring."""
    parts = list(rel.parent.parts)
    if parts and parts[-1] == "images":
        parts.pop()
    match = _PREFIXED_STEM.match(rel.stem)
    if match:
        parts.append(match.group(1))
    return "/".join(parts) or "."


def split_of(rel: str, val_fraction: float = 0.2) -> Split:
    """``"val"`` for about ``val_fraction`` of all paths, decided by BLAKE2b of ``rel``.

    BLAKE2b, not Python's ``hash``: the answer must not change with the interpreter,
    ``PYTHONHASHSEED`` or the machine, or a rebuilt shard set would leak validation
    images into training.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must be within [0, 1], got {val_fraction}")
    digest = hashlib.blake2b(rel.encode("utf-8"), digest_size=8).digest()
    position = int.from_bytes(digest, "little") / 2.0**64
    return "val" if position < val_fraction else "train"


_Key = tuple[Path, str, str]  # (folder, stem, lower-case suffix), all relative to the root


def _index_files(root: Path) -> dict[_Key, Path]:
    """Candidate image files by (folder, stem, suffix), so ``.PNG`` finds ``.png``."""
    files: dict[_Key, Path] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if rel.suffix.lower() in INPUT_SUFFIXES and path.is_file():
            files[_key(rel)] = rel
    return files


def _key(rel: Path, suffix: str | None = None) -> _Key:
    return (rel.parent, rel.stem, (suffix or rel.suffix).lower())


def _is_mask(rel: Path, files: dict[_Key, Path]) -> bool:
    if rel.parent.name == "masks":
        return True
    if rel.suffix.lower() != ".png":
        return False
    return any(_key(rel, partner) in files for partner in _MASK_PARTNERS)


def _find_mask(rel: Path, files: dict[_Key, Path], root: Path) -> Path | None:
    folder, stem = rel.parent, rel.stem
    candidates = [(folder / "masks", stem, ".png")]
    if folder.name == "images":
        candidates.append((folder.parent / "masks", stem, ".png"))
    if rel.suffix.lower() != ".png":
        candidates.append((folder, stem, ".png"))
    for candidate in candidates:
        if candidate in files:
            return root / files[candidate]
    return None

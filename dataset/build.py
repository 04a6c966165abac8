"""Packing a dataset folder into shards (``scratchd shard build``).

For every input :func:`scratchd.dataset.folders.scan_dataset` finds, in ``rel`` order:
decode the image (to learn its size and prove it decodes), decode and validate its mask
(:mod:`scratchd.dataset.masks`), then store the image's bytes exactly as delivered and the
binarised mask re-encoded as PNG. An image that does not decode, or whose mask is
unreadable or impossible, is left out and reported with the file at fault and the reason:
a sample with a wrong mask would teach the model wrong labels, and one stored without its
mask would pass as unlabelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from scratchd.dataset.folders import Sample, scan_dataset, split_of
from scratchd.dataset.layout import RecordMeta, Rejection
from scratchd.dataset.masks import MaskRejected, validate_mask
from scratchd.dataset.writer import ShardWriter
from scratchd.protocol.image import ImageError, decode_image, encode_png, sniff_format


@dataclass
class BuildReport:
    """Counts of one ``build_shards`` run."""

    images: int = 0  # inputs found
    records: int = 0  # records written (images - rejected)
    with_mask: int = 0  # records that carry a mask
    masks_repaired: int = 0  # mask files the binarisation changed
    mask_pixels_repaired: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    shards: int = 0
    bytes: int = 0
    train: int = 0
    val: int = 0
    other_split: int = 0  # inputs of the split that ``only`` leaves out (not read)


@dataclass(frozen=True)
class _Packed:
    meta: RecordMeta
    image: bytes
    mask: bytes | None


def build_shards(
    src: Path, out: Path, *, shard_size_mb: int = 256, val_fraction: float = 0.2,
    only: str | None = None,
) -> BuildReport:  # fmt: skip
    """Pack the dataset folder ``src`` into shards of at most ``shard_size_mb`` MiB in ``out``;
    with ``only`` (``"train"`` or ``"val"``), the records of that split alone, the same
    records a full build holds for it (a training machine needs no validation images)."""
    if shard_size_mb < 1:
        raise ValueError(f"shard size must be at least 1 MiB, got {shard_size_mb}")
    if only not in (None, "train", "val"):
        raise ValueError(f"only must be 'train', 'val' or None, got {only!r}")
    samples = scan_dataset(Path(src))
    writer = ShardWriter(Path(out), shard_size_mb * 2**20)
    report = BuildReport(images=len(samples))
    for sample in samples:
        if only is not None and split_of(sample.rel, val_fraction) != only:
            report.other_split += 1
            continue
        try:
            packed = pack_sample(sample, Path(src), val_fraction)
        except _Rejected as exc:
            report.rejected.append(exc.rejection)
            continue
        writer.add(packed.meta, packed.image, packed.mask)
        _count(report, packed.meta)
    manifest = writer.finish(
        source=str(src),
        val_fraction=val_fraction,
        images_seen=report.images,
        masks_repaired=report.masks_repaired,
        mask_pixels_repaired=report.mask_pixels_repaired,
        rejected=report.rejected,
    )
    report.shards = len(manifest.shards)
    report.bytes = sum(s.bytes for s in manifest.shards)
    return report


def _count(report: BuildReport, meta: RecordMeta) -> None:
    report.records += 1
    report.with_mask += meta.mask_rel is not None
    report.masks_repaired += meta.mask_repaired_pixels > 0
    report.mask_pixels_repaired += meta.mask_repaired_pixels
    if meta.split == "val":
        report.val += 1
    else:
        report.train += 1


class _Rejected(Exception):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.rejection = Rejection(name=name, reason=reason)


def pack_sample(sample: Sample, root: Path, val_fraction: float) -> _Packed:
    """Read, decode and validate one sample; raises ``_Rejected`` naming the file at fault."""
    image_bytes = _read(sample.image, sample.rel)
    try:
        image = decode_image(image_bytes)
    except ImageError as exc:
        raise _Rejected(sample.rel, str(exc)) from None
    meta = RecordMeta(
        rel=sample.rel,
        group=sample.group,
        split=split_of(sample.rel, val_fraction),
        width=image.shape[1],
        height=image.shape[0],
        image_format=sniff_format(image_bytes) or "",
    )
    if sample.mask is None:
        return _Packed(meta, image_bytes, None)
    mask_rel = sample.mask.relative_to(root).as_posix()
    try:
        mask = decode_image(_read(sample.mask, mask_rel))
        checked = validate_mask(mask, (image.shape[0], image.shape[1]), mask_rel)
    except ImageError as exc:
        raise _Rejected(mask_rel, f"unreadable mask: {exc}") from None
    except MaskRejected as exc:
        raise _Rejected(mask_rel, exc.reason) from None
    meta = msgspec.structs.replace(
        meta,
        mask_rel=mask_rel,
        mask_repaired_pixels=checked.repaired_pixels,
        defect_pixels=int(np.count_nonzero(checked.mask)),
    )
    return _Packed(meta, image_bytes, encode_png(checked.mask))


def _read(path: Path, rel: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise _Rejected(rel, f"cannot be read: {exc.strerror}") from None

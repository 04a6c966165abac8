"""Writing records into size-bounded shard files (layout: :mod:`scratchd.dataset.shard`).

A shard is assembled in memory (at most ``shard_size`` bytes, plus one record when a single
record is larger than that), then written to ``shard-NNNNN.scs.tmp`` and renamed, so a
crash never leaves a half-written file under a shard's name. The manifest is written last,
the same way: a folder with a manifest holds a complete build. Shard files of an older,
larger build that the new manifest does not list are removed after it is in place.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from scratchd.dataset.layout import (
    FLAG_HAS_MASK,
    HEADER_SIZE,
    INDEX_DTYPE,
    INDEX_RECORD_SIZE,
    MANIFEST_NAME,
    MAX_PART_LEN,
    META_ENCODER,
    SHARD_SUFFIX,
    Header,
    Manifest,
    RecordMeta,
    Rejection,
    ShardInfo,
    crc32,
    shard_name,
)


@dataclass
class _Pending:
    """The records of the shard being assembled."""

    index: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    payload: list[bytes] = field(default_factory=list)
    payload_bytes: int = 0

    def size_with(self, extra: int) -> int:
        count = len(self.index) + 1
        return HEADER_SIZE + count * INDEX_RECORD_SIZE + self.payload_bytes + extra


class ShardWriter:
    """Appends records to shards of at most ``shard_size`` bytes in ``out``.

    Use :meth:`add` for each record in order, then :meth:`finish` with the manifest fields.
    """

    def __init__(self, out: Path, shard_size: int) -> None:
        if shard_size < HEADER_SIZE + INDEX_RECORD_SIZE:
            raise ValueError(f"shard size {shard_size} is smaller than one header and record")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.shards: list[ShardInfo] = []
        self.records = 0
        self._pending = _Pending()

    def add(self, meta: RecordMeta, image: bytes, mask: bytes | None) -> None:
        """Append one record; starts a new shard when this one would outgrow the limit."""
        meta_bytes = META_ENCODER.encode(meta)
        mask_bytes = mask if mask is not None else b""
        for part, what in ((meta_bytes, "metadata"), (image, "image"), (mask_bytes, "mask")):
            if len(part) > MAX_PART_LEN:
                raise ValueError(f"{meta.rel}: {what} of {len(part)} bytes is too large")
        record_bytes = len(meta_bytes) + len(image) + len(mask_bytes)
        pending = self._pending
        if pending.index and pending.size_with(record_bytes) > self.shard_size:
            self._flush()
            pending = self._pending
        flags = FLAG_HAS_MASK if mask is not None else 0
        pending.index.append(
            (
                pending.payload_bytes,  # relative to the data region until the flush
                len(meta_bytes),
                len(image),
                len(mask_bytes),
                crc32(meta_bytes),
                crc32(image, mask_bytes),
                flags,
            )
        )
        pending.payload.extend((meta_bytes, bytes(image), mask_bytes))
        pending.payload_bytes += record_bytes
        self.records += 1

    def finish(
        self,
        *,
        source: str,
        val_fraction: float,
        images_seen: int = 0,
        masks_repaired: int = 0,
        mask_pixels_repaired: int = 0,
        rejected: list[Rejection] | None = None,
    ) -> Manifest:
        """Flush the last shard, write ``manifest.json`` and drop stale shard files."""
        if self._pending.index:
            self._flush()
        content = hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()
        manifest = Manifest(
            source=source,
            val_fraction=val_fraction,
            records=self.records,
            shards=list(self.shards),
            content_sha256=content,
            images_seen=images_seen,
            masks_repaired=masks_repaired,
            mask_pixels_repaired=mask_pixels_repaired,
            rejected=list(rejected or []),
        )
        encoded = msgspec.json.format(msgspec.json.encode(manifest))
        _write_atomically(self.out / MANIFEST_NAME, encoded)
        self._remove_stale_shards()
        return manifest

    def _flush(self) -> None:
        pending, number = self._pending, len(self.shards)
        index = np.array(pending.index, dtype=INDEX_DTYPE)
        data_offset = HEADER_SIZE + index.nbytes
        index["offset"] += data_offset
        index_bytes = index.tobytes()
        header = Header(
            record_count=len(index),
            index_offset=HEADER_SIZE,
            index_size=len(index_bytes),
            data_offset=data_offset,
            file_size=data_offset + pending.payload_bytes,
            index_crc=crc32(index_bytes),
            shard_number=number,
        )
        chunks = [header.pack(), index_bytes, *pending.payload]
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        name = shard_name(number)
        _write_atomically(self.out / name, *chunks)
        self.shards.append(
            ShardInfo(
                file=name, records=len(index), bytes=header.file_size, sha256=digest.hexdigest()
            )
        )
        self._pending = _Pending()

    def _remove_stale_shards(self) -> None:
        listed = {s.file for s in self.shards}
        for path in self.out.glob(f"shard-*{SHARD_SUFFIX}"):
            if path.name not in listed:
                path.unlink()


def _write_atomically(path: Path, *chunks: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        for chunk in chunks:
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)

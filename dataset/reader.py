"""Reading shards through mmap (layout: :mod:`scratchd.dataset.shard`).

:class:`ShardFile` maps one file read-only and checks, **at open**: the header's magic,
version and CRC; that the file is exactly as long as the header says (a shorter file is
truncated and the first record cut off is named); the index CRC; that the records tile the
data region exactly, back to back, with no gap, overlap or byte outside one; and each
record's metadata CRC (the metadata of every record is decoded at open, so filtering by
split or group never touches image bytes). **On access** it checks the CRC of that
record's image and mask bytes before handing them out. So every byte of a shard is covered
by a CRC that is checked before anything derived from it is returned: a damaged shard
raises :class:`ShardError`, naming the file and the record, and never yields garbage.

A :class:`Record` holds memoryviews into the mapping (zero-copy, no decoding); they stay
valid as long as they are referenced, even past :meth:`ShardSet.close` (the mapping is
unmapped when the last view is released).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, SupportsIndex

import msgspec
import numpy as np

from scratchd.dataset.layout import (
    FLAG_HAS_MASK,
    HEADER_SIZE,
    INDEX_DTYPE,
    INDEX_RECORD_SIZE,
    MANIFEST_NAME,
    META_DECODER,
    Header,
    Manifest,
    RecordMeta,
    ShardError,
    ShardInfo,
    crc32,
)


@dataclass(frozen=True)
class Record:
    """One record: the image's encoded bytes as delivered, its mask as PNG bytes, metadata."""

    image: memoryview
    mask: memoryview | None
    meta: RecordMeta


class ShardFile:
    """One shard file, mapped read-only and checked at open (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.name = self.path.name
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                head = fh.read(HEADER_SIZE)
                self.header = Header.unpack(head, self.name)
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ShardError(self.name, None, f"cannot be read: {exc.strerror}") from None
        self._check_size(size)
        self.index = self._read_index()
        self._check_tiling()
        self.metas = [self._read_meta(i) for i in range(len(self.index))]

    def __len__(self) -> int:
        return len(self.index)

    def record(self, i: int) -> Record:
        """Record ``i`` of this shard after checking its image and mask CRC."""
        if not self._data_crc_ok(i):
            raise ShardError(self.name, i, f"image/mask CRC mismatch ({self.metas[i].rel})")
        start, image_end, end = self._data_span(i)
        view = memoryview(self._mm)
        image, mask = view[start:image_end], view[image_end:end]
        has_mask = bool(int(self.index[i]["flags"]) & FLAG_HAS_MASK)
        return Record(image=image, mask=mask if has_mask else None, meta=self.metas[i])

    def _data_span(self, i: int) -> tuple[int, int, int]:
        """File offsets of record ``i``'s image start, image end (= mask start) and mask end."""
        entry = self.index[i]
        start = int(entry["offset"]) + int(entry["meta_len"])
        image_end = start + int(entry["image_len"])
        return start, image_end, image_end + int(entry["mask_len"])

    def _data_crc_ok(self, i: int) -> bool:
        start, _, end = self._data_span(i)
        with memoryview(self._mm) as view, view[start:end] as data:
            return crc32(data) == int(self.index[i]["data_crc"])

    def sha256(self) -> str:
        return hashlib.sha256(self._mm).hexdigest()

    def close(self) -> None:
        # Records still referencing the mapping keep it alive; it is unmapped when they go.
        with contextlib.suppress(BufferError):
            self._mm.close()

    def _check_size(self, size: int) -> None:
        expected = self.header.file_size
        if size > expected:
            raise ShardError(self.name, None, f"{size - expected} bytes after the last record")
        if size == expected:
            return
        reason = f"truncated: {size} of {expected} bytes"
        if size < self.header.data_offset:
            cut = max(0, (size - HEADER_SIZE) // INDEX_RECORD_SIZE)
            raise ShardError(self.name, cut, f"{reason}; the index is cut off at this record")
        index = self._read_index()
        ends = _record_ends(index)
        raise ShardError(self.name, int(np.argmax(ends > size)), f"{reason}; record cut off")

    def _read_index(self) -> np.ndarray:
        data = self._mm[HEADER_SIZE : self.header.data_offset]
        index = np.frombuffer(data, dtype=INDEX_DTYPE).copy()
        if crc32(data) != self.header.index_crc:
            raise self._diagnose_index(index)
        return index

    def _diagnose_index(self, index: np.ndarray) -> ShardError:
        """Name the first index entry that disagrees with the data, for an index whose CRC
        failed: the CRC says *that* the index is damaged, the data can say *where*."""
        self.index = index
        try:
            self._check_tiling()
            for i in range(len(index)):
                self._read_meta(i)
                if not self._data_crc_ok(i):
                    raise ShardError(self.name, i, "image/mask CRC mismatch")
        except ShardError as exc:
            return ShardError(self.name, exc.record, f"index CRC mismatch ({exc.reason})")
        return ShardError(self.name, None, "index CRC mismatch: the index is corrupt")

    def _check_tiling(self) -> None:
        """Records must lie back to back from the data offset to the end of the file."""
        index, header = self.index, self.header
        if len(index) == 0:
            if header.file_size != header.data_offset:
                raise ShardError(self.name, None, "bytes after an empty index")
            return
        bad_flags = np.flatnonzero(
            (index["flags"] & ~np.uint32(FLAG_HAS_MASK) != 0)
            | ((index["flags"] & FLAG_HAS_MASK == 0) & (index["mask_len"] != 0))
        )
        if len(bad_flags):
            raise ShardError(self.name, int(bad_flags[0]), "index record has invalid flags")
        ends = _record_ends(index)
        starts = np.concatenate([[header.data_offset], ends[:-1]])
        misplaced = np.flatnonzero(index["offset"] != starts)
        if len(misplaced):
            raise ShardError(self.name, int(misplaced[0]), "record is not where the index ends")
        if int(ends[-1]) != header.file_size:
            raise ShardError(self.name, len(index) - 1, "records do not end at the file's end")

    def _read_meta(self, i: int) -> RecordMeta:
        entry = self.index[i]
        start = int(entry["offset"])
        data = self._mm[start : start + int(entry["meta_len"])]
        if crc32(data) != int(entry["meta_crc"]):
            raise ShardError(self.name, i, "metadata CRC mismatch")
        try:
            return META_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise ShardError(self.name, i, f"metadata does not decode: {exc}") from None


def _record_ends(index: np.ndarray) -> np.ndarray:
    lengths = (
        index["meta_len"].astype(np.uint64)
        + index["image_len"].astype(np.uint64)
        + index["mask_len"].astype(np.uint64)
    )
    return np.asarray(index["offset"] + lengths, dtype=np.uint64)


def read_manifest(out: Path) -> Manifest:
    path = Path(out) / MANIFEST_NAME
    try:
        return msgspec.json.decode(path.read_bytes(), type=Manifest)
    except OSError as exc:
        raise ShardError(MANIFEST_NAME, None, f"cannot be read in {out}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise ShardError(MANIFEST_NAME, None, f"is not a valid manifest: {exc}") from None


def open_shard_file(out: Path, info: ShardInfo, number: int) -> ShardFile:
    """Open one shard listed in the manifest and check it against its listing."""
    shard = ShardFile(Path(out) / info.file)
    problem = None
    if shard.header.shard_number != number:
        problem = f"is shard {shard.header.shard_number}, the manifest lists it as {number}"
    elif len(shard) != info.records or shard.header.file_size != info.bytes:
        problem = (
            f"holds {len(shard)} records in {shard.header.file_size} bytes, "
            f"the manifest says {info.records} in {info.bytes}"
        )
    if problem:
        shard.close()
        raise ShardError(info.file, None, problem)
    return shard


@dataclass
class ShardSet:
    """All records of a shard folder, in manifest order, by one global index."""

    out: Path
    manifest: Manifest
    shards: list[ShardFile]
    _shard_of: np.ndarray = field(repr=False)
    _local_of: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return len(self._shard_of)

    def __getitem__(self, i: SupportsIndex) -> Record:
        shard, local = self._locate(i)
        return shard.record(local)

    def __iter__(self) -> Iterator[Record]:
        return (self[i] for i in range(len(self)))

    def meta(self, i: SupportsIndex) -> RecordMeta:
        """Record ``i``'s metadata (checked at open), without touching its image bytes."""
        shard, local = self._locate(i)
        return shard.metas[local]

    def _locate(self, i: SupportsIndex) -> tuple[ShardFile, int]:
        """The shard and in-shard index of global record ``i`` (negative counts from the end)."""
        position = operator.index(i)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"record {operator.index(i)} out of range for {len(self)} records")
        return self.shards[int(self._shard_of[position])], int(self._local_of[position])

    def indices(self, split: str | None = None, group_prefix: str | None = None) -> list[int]:
        """Global indices whose split is ``split`` and whose group is ``group_prefix`` or
        lies under it by whole path components (``"sd900"`` matches ``"sd900/Sc"``, not
        ``"sd900x"``); None matches everything."""
        prefix = group_prefix.rstrip("/") if group_prefix else None
        found = []
        for i in range(len(self)):
            meta = self.meta(i)
            if split is not None and meta.split != split:
                continue
            if prefix and meta.group != prefix and not meta.group.startswith(prefix + "/"):
                continue
            found.append(i)
        return found

    def close(self) -> None:
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        # DataLoader workers started by spawn reopen the folder instead of copying the maps.
        return (open_shards, (self.out,))


def open_shards(out: Path) -> ShardSet:
    """Open the shard folder ``out`` (its manifest and every shard it lists)."""
    manifest = read_manifest(out)
    shards: list[ShardFile] = []
    try:
        for number, info in enumerate(manifest.shards):
            shards.append(open_shard_file(out, info, number))
    except ShardError:
        for shard in shards:
            shard.close()
        raise
    counts = np.array([len(s) for s in shards], dtype=np.int64)
    shard_of = np.repeat(np.arange(len(shards), dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    local_of = np.arange(len(shard_of), dtype=np.int64) - starts
    return ShardSet(Path(out), manifest, shards, shard_of, local_of)

"""Shard files: training and evaluation data packed for mmap and O(1) random access.

A shard folder (``scratchd shard build SRC OUT``) holds ``shard-00000.scs``,
``shard-00001.scs``, … of at most ``--shard-size-mb`` each (a single larger record gets a
shard of its own) and ``manifest.json``. Records are in ``rel`` order across the shards.

Shard file, format version 1. All integers little-endian; CRCs are CRC-32 (zlib / IEEE)::

    offset          size  field
    ──────────────  ────  ─────────────────────────────────────────────────────────────
    0                  8  magic            b"SCRDSHRD"
    8                  2  version   u16    1
    10                 2  header_size u16  64
    12                 4  record_count u32 N
    16                 8  index_offset u64 64
    24                 8  index_size  u64  32 * N
    32                 8  data_offset u64  64 + 32 * N
    40                 8  file_size   u64  total length; a shorter file is truncated
    48                 4  index_crc32 u32  CRC of bytes [index_offset, data_offset)
    52                 4  shard_number u32 position of this shard in the manifest
    56                 4  reserved    u32  0
    60                 4  header_crc32 u32 CRC of bytes [0, 60)
    ──────────────  ────  ─────────────────────────────────────────────────────────────
    64 + 32*i         32  index record i:
                          +0  offset    u64  absolute offset of record i's payload
                          +8  meta_len  u32
                          +12 image_len u32
                          +16 mask_len  u32  0 without a mask
                          +20 meta_crc  u32  CRC of the metadata bytes
                          +24 data_crc  u32  CRC of image bytes then mask bytes
                          +28 flags     u32  bit 0: the record has a mask; others 0
    ──────────────  ────  ─────────────────────────────────────────────────────────────
    data_offset           payload of record 0, record 1, … back to back, no padding:
                          ┌──────────────┬─────────────────────┬────────────────────┐
                          │ metadata     │ image bytes         │ mask bytes         │
                          │ msgpack map  │ the file as         │ binarised mask     │
                          │ (RecordMeta) │ delivered: PNG/BMP/ │ (0/255) as 8-bit   │
                          │              │ JPEG, not decoded   │ greyscale PNG      │
                          └──────────────┴─────────────────────┴────────────────────┘
    file_size             end of file (= end of the last record)

Invariants the reader enforces: ``offset[0] = data_offset``, ``offset[i+1] = offset[i] +
meta_len[i] + image_len[i] + mask_len[i]``, and the last record ends at ``file_size``. So
every byte of a file lies under exactly one CRC (header, index, a record's metadata, a
record's data), and a record is located in O(1): ``64 + 32*i`` gives its index entry.

The metadata is a msgpack map of :class:`RecordMeta` (``rel``, ``group``, ``split``,
``width``, ``height``, ``image_format``, ``mask_rel``, ``mask_repaired_pixels``,
``defect_pixels``); fields are only appended, with defaults. ``manifest.json`` (a
:class:`Manifest`) lists each shard's file name, record count, byte size and SHA-256, the
build's source, ``val_fraction`` and repair/reject counts, and ``content_sha256`` (a hash
of the shard digests: the identity of the data, for model metadata). It is written last.

Checks: the header, index, tiling and every metadata CRC are checked **at open**; a
record's image+mask CRC **on access** (:meth:`ShardSet.__getitem__`). :func:`check_shards`
does both for every record. Any failure is a :class:`ShardError` naming the shard file and
the record index within it. Nothing is decoded by the reader: decode ``Record.image`` and
``Record.mask`` with :func:`scratchd.protocol.image.decode_image`.

Writers: only ``shard build`` (one process); files appear under their final names by
rename, the manifest last. Readers map files read-only and share nothing mutable, so any
number of processes (e.g. DataLoader workers) may read one folder at once.
"""

from __future__ import annotations

from scratchd.dataset.build import BuildReport, build_shards
from scratchd.dataset.check import CheckReport, check_shards
from scratchd.dataset.layout import Manifest, RecordMeta, Rejection, ShardError
from scratchd.dataset.reader import Record, ShardFile, ShardSet, open_shards
from scratchd.dataset.writer import ShardWriter

__all__ = [
    "BuildReport",
    "CheckReport",
    "Manifest",
    "Record",
    "RecordMeta",
    "Rejection",
    "ShardError",
    "ShardFile",
    "ShardSet",
    "ShardWriter",
    "build_shards",
    "check_shards",
    "open_shards",
]

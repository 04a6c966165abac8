"""Byte layout of a shard file: header, index record, metadata, manifest, errors.

The format is specified, with its drawing, in :mod:`scratchd.dataset.shard`; this module is
that specification in code. Writer and reader import from here and nowhere else, so the
two can never disagree on an offset.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import msgspec
import numpy as np

MAGIC = b"SCRDSHRD"
VERSION = 1
SHARD_SUFFIX = ".scs"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "scratchd-shards"

# magic, version, header_size, record_count, index_offset, index_size, data_offset,
# file_size, index_crc32, shard_number, reserved, header_crc32
HEADER = struct.Struct("<8sHHIQQQQIIII")
HEADER_SIZE = HEADER.size  # 64
HEADER_CRC_SPAN = HEADER_SIZE - 4  # the header CRC covers every byte before it

INDEX_DTYPE = np.dtype(
    [
        ("offset", "<u8"),  # absolute file offset of the record's payload (meta first)
        ("meta_len", "<u4"),
        ("image_len", "<u4"),
        ("mask_len", "<u4"),  # 0 when the record has no mask
        ("meta_crc", "<u4"),  # CRC-32 of the metadata bytes
        ("data_crc", "<u4"),  # CRC-32 of the image bytes followed by the mask bytes
        ("flags", "<u4"),  # FLAG_HAS_MASK; other bits must be zero
    ]
)
INDEX_RECORD_SIZE = INDEX_DTYPE.itemsize  # 32
FLAG_HAS_MASK = 1
MAX_PART_LEN = 2**32 - 1


def shard_name(number: int) -> str:
    return f"shard-{number:05d}{SHARD_SUFFIX}"


def crc32(*parts: bytes | memoryview) -> int:
    """CRC-32 (zlib, IEEE polynomial) of the concatenated parts, without concatenating."""
    value = 0
    for part in parts:
        value = zlib.crc32(part, value)
    return value


class ShardError(Exception):
    """A shard (or the manifest) is corrupt, truncated or inconsistent.

    ``shard`` is the file name, ``record`` the record's index inside that shard when one
    record is at fault (None for the header, index or the file as a whole).
    """

    def __init__(self, shard: str, record: int | None, reason: str) -> None:
        where = shard if record is None else f"{shard} record {record}"
        super().__init__(f"{where}: {reason}")
        self.shard = shard
        self.record = record
        self.reason = reason


@dataclass(frozen=True)
class Header:
    """The 64-byte header at offset 0 of every shard file."""

    record_count: int
    index_offset: int
    index_size: int
    data_offset: int
    file_size: int
    index_crc: int
    shard_number: int

    def pack(self) -> bytes:
        head = HEADER.pack(
            MAGIC,
            VERSION,
            HEADER_SIZE,
            self.record_count,
            self.index_offset,
            self.index_size,
            self.data_offset,
            self.file_size,
            self.index_crc,
            self.shard_number,
            0,
            0,
        )
        return head[:HEADER_CRC_SPAN] + struct.pack("<I", crc32(head[:HEADER_CRC_SPAN]))

    @classmethod
    def unpack(cls, data: bytes, shard: str) -> Header:
        """Parse and check a header; raises :class:`ShardError` naming ``shard``."""
        if len(data) < HEADER_SIZE:
            raise ShardError(shard, None, f"truncated: {len(data)} bytes, shorter than a header")
        fields = HEADER.unpack(data[:HEADER_SIZE])
        magic, version, header_size = fields[0], fields[1], fields[2]
        if magic != MAGIC:
            raise ShardError(shard, None, f"not a scratchd shard (magic {magic!r})")
        if crc32(data[:HEADER_CRC_SPAN]) != fields[11]:
            raise ShardError(shard, None, "header CRC mismatch: the header is corrupt")
        if version != VERSION or header_size != HEADER_SIZE:
            raise ShardError(shard, None, f"unsupported version {version}/{header_size}")
        header = cls(*fields[3:10])
        header.check_geometry(shard)
        return header

    def check_geometry(self, shard: str) -> None:
        if self.index_offset != HEADER_SIZE or self.data_offset != (
            self.index_offset + self.index_size
        ):
            raise ShardError(shard, None, "header places the index or data at the wrong offset")
        if self.index_size != self.record_count * INDEX_RECORD_SIZE:
            raise ShardError(shard, None, "index size does not match the record count")
        if self.file_size < self.data_offset:
            raise ShardError(shard, None, "file size is smaller than header + index")


class RecordMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a record says about itself; msgpack-encoded before its image bytes.

    Fields are only ever appended, with defaults, so old shards keep decoding.
    """

    rel: str  # image path relative to the dataset root, posix separators
    group: str  # e.g. "sd900/Sc", "mtile/free" (see scratchd.dataset.folders)
    split: str  # "train" or "val"
    width: int
    height: int
    image_format: str  # "PNG", "BMP" or "JPEG": the stored image bytes, as delivered
    mask_rel: str | None = None  # the mask's source path, None without a mask
    mask_repaired_pixels: int = 0  # pixels the binarisation changed
    defect_pixels: int = 0  # 255-pixels of the stored (binarised) mask


META_ENCODER = msgspec.msgpack.Encoder()
META_DECODER = msgspec.msgpack.Decoder(RecordMeta)


class ShardInfo(msgspec.Struct, frozen=True, kw_only=True):
    file: str
    records: int
    bytes: int
    sha256: str


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the file at fault (image or mask), relative to the source root
    reason: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """``manifest.json`` beside the shards: written last, so its presence means complete."""

    format: str = MANIFEST_FORMAT
    version: int = VERSION
    source: str
    val_fraction: float
    records: int
    shards: list[ShardInfo]
    content_sha256: str  # SHA-256 over the shards' SHA-256 digests, in order
    images_seen: int = 0
    masks_repaired: int = 0  # files
    mask_pixels_repaired: int = 0
    rejected: list[Rejection] = msgspec.field(default_factory=list)

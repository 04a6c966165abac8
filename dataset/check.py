"""Verifying a shard folder end to end (``scratchd shard check``).

For every shard the manifest lists: open it (header, index, tiling and metadata checks,
see :mod:`scratchd.dataset.reader`), compare it with its manifest entry, check the image
and mask CRC of every record, then compare the file's SHA-256 with the manifest (which
catches a well-formed shard from another build). Problems are collected, not raised, so one
run names every damaged shard and record; only an unreadable manifest raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scratchd.dataset.layout import ShardError
from scratchd.dataset.reader import ShardFile, open_shard_file, read_manifest


@dataclass
class CheckReport:
    """What ``check_shards`` verified and every problem it found."""

    shards: int = 0
    records: int = 0  # records whose bytes passed their CRC
    bytes: int = 0
    errors: list[ShardError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def check_shards(out: Path) -> CheckReport:
    """Verify every record's bounds and CRCs in the shard folder ``out``."""
    manifest = read_manifest(out)
    report = CheckReport()
    for number, info in enumerate(manifest.shards):
        report.shards += 1
        try:
            shard = open_shard_file(out, info, number)
        except ShardError as exc:
            report.errors.append(exc)
            continue
        try:
            damaged = _check_records(shard, report)
            # A damaged record already explains a digest mismatch; report only the record.
            if not damaged and shard.sha256() != info.sha256:
                report.errors.append(
                    ShardError(info.file, None, "content differs from the manifest's SHA-256")
                )
            report.bytes += shard.header.file_size
        finally:
            shard.close()
    return report


def _check_records(shard: ShardFile, report: CheckReport) -> bool:
    """Check every record's data CRC; True when any failed (each is appended to report)."""
    damaged = False
    for i in range(len(shard)):
        try:
            record = shard.record(i)
        except ShardError as exc:
            report.errors.append(exc)
            damaged = True
            continue
        record.image.release()
        if record.mask is not None:
            record.mask.release()
        report.records += 1
    return damaged

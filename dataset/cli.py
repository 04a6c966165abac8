"""``scratchd shard build`` and ``scratchd shard check``."""

from __future__ import annotations

import time
from pathlib import Path

import click

from scratchd.dataset.shard import ShardError, build_shards, check_shards


@click.group()
def shard() -> None:
    """Pack dataset folders into shard files and verify them."""


@shard.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--shard-size-mb",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Start a new shard file past this size.",
)
@click.option(
    "--val-fraction",
    default=0.2,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Share of the images held out as the validation split.",
)
@click.option(
    "--only",
    type=click.Choice(["train", "val"]),
    default=None,
    help="Pack the records of this split alone (default: both).",
)
def build(src: Path, out: Path, shard_size_mb: int, val_fraction: float, only: str | None) -> None:
    """Pack the images and masks under SRC into shards in OUT."""
    started = time.perf_counter()
    report = build_shards(
        src, out, shard_size_mb=shard_size_mb, val_fraction=val_fraction, only=only
    )
    elapsed = time.perf_counter() - started
    click.echo(f"images found      {report.images}")
    click.echo(f"records written   {report.records} (train {report.train}, val {report.val})")
    if only is not None:
        click.echo(f"left out          {report.other_split} of the other split (--only {only})")
    click.echo(f"with mask         {report.with_mask}")
    click.echo(
        f"masks repaired    {report.masks_repaired} files, "
        f"{report.mask_pixels_repaired} pixels binarised"
    )
    click.echo(f"rejected          {len(report.rejected)}")
    for rejection in report.rejected:
        click.echo(f"  {rejection.name}: {rejection.reason}")
    click.echo(f"shards written    {report.shards} ({report.bytes} bytes) in {out}")
    click.echo(f"time              {elapsed:.2f} s")


@shard.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False, path_type=Path))
def check(out: Path) -> None:
    """Verify every record of the shards in OUT; exit 1 naming any damaged shard/record."""
    try:
        report = check_shards(out)
    except ShardError as exc:
        raise click.ClickException(str(exc)) from None
    for error in report.errors:
        click.echo(f"CORRUPT {error}", err=True)
    click.echo(f"{report.shards} shards, {report.records} records intact, {report.bytes} bytes")
    if not report.ok:
        raise SystemExit(1)

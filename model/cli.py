"""``scratchd eval`` and ``scratchd model``: the model in-process, without a daemon.

``scratchd eval DIR [--json] [--mask-out OUT] [--model PATH] [--views V ...] [--split S]``
runs the model over every input image under DIR (found by
:func:`scratchd.dataset.folders.scan_dataset`):

- ``--views V`` (repeatable) replaces the test-time views of the model's metadata, as the
  daemon's ``model.views`` does; the summary's ``views`` says which ones ran;
- ``--cascade on|off`` runs the model's dynamic-resolution cascade or every frame whole at
  full resolution (default: the model file's own, as the daemon's unset ``model.cascade``);
  the summary's ``cascade`` says which ran and, when on, the share of frames stage 1
  answered alone and the full-resolution input pixels per frame;
- ``--split val`` (or ``train``) keeps only the images :func:`scratchd.dataset.folders.split_of`
  puts on that side with ``--val-fraction`` (default 0.2, as ``scratchd shard build``): run on
  the folder the training shards were built from, ``--split val`` is the split the model's
  ``val_metrics`` were measured on (scripts/finalize_model.py);
- one row per image on stdout: text ``<rel> <verdict> <score> <boxes>``, or with ``--json``
  ``{"image": rel, "score": float, "verdict": "defect"|"clean", "boxes": [[x0, y0, x1, y1,
  score], ...]}``; an unreadable image gives ``{"image": rel, "error": reason}`` and the run
  goes on (exit status 1 at the end);
- with ``--mask-out OUT``, the predicted 0/255 mask at ``OUT/<rel with suffix .png>``;
- then the summary (IoU per group over defect images, AUROC defects vs clean per top-level
  group, and at the model's operating point the share of clean parts rejected and of
  defective parts passed per group, timing; see :mod:`scratchd.model.evaluate`): with
  ``--json`` a last stdout line ``{"summary": {...}}``, otherwise a table on stderr. Images
  whose mask is rejected by :func:`scratchd.dataset.masks.validate_mask` are predicted but
  left out of the metrics;
- ``--roc FILE`` writes the ROC curve of the image scores per top-level group as a PNG,
  the model's operating point ringed;
- on a terminal, stderr shows a progress bar with the time left.

``scratchd model info [--json] [--model PATH]`` prints the model's metadata (with ``params``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from scratchd.dataset.folders import Sample, scan_dataset, split_of
from scratchd.dataset.masks import MaskRejected, validate_mask
from scratchd.kernels.views import VIEWS
from scratchd.model.cascade import Cascade, CascadeError, resolve
from scratchd.model.evaluate import Evaluation, draw_roc
from scratchd.model.scratchnet import ModelError, ScratchNet, load_model
from scratchd.protocol.image import ImageError, decode_image, encode_png


def _load(path: Path | None, views: tuple[str, ...] = ()) -> ScratchNet:
    try:
        return load_model(path, views=views or None)
    except ModelError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("eval")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--mask-out", type=click.Path(file_okay=False, path_type=Path), help="Write masks here."
)
@click.option("--model", "model_path", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--views", multiple=True, type=click.Choice(VIEWS), help="Test-time views (repeatable)."
)
@click.option(
    "--cascade", type=click.Choice(["on", "off"]), default=None,
    help="The model's dynamic-resolution cascade (default: the model file's).",
)  # fmt: skip
@click.option("--split", type=click.Choice(["train", "val"]), help="Only this split's images.")
@click.option("--val-fraction", default=0.2, show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option(
    "--roc", "roc_path", type=click.Path(dir_okay=False, path_type=Path), help="ROC curve PNG."
)
def eval_cmd(
    directory: Path,
    as_json: bool,
    mask_out: Path | None,
    model_path: Path | None,
    views: tuple[str, ...],
    cascade: str | None,
    split: str | None,
    val_fraction: float,
    roc_path: Path | None,
) -> None:
    """Run the model over every image under DIRECTORY and report accuracy."""
    if len(set(views)) != len(views):
        raise click.BadParameter(
            f"each view at most once, got {' '.join(views)}", param_hint="--views"
        )
    samples = scan_dataset(directory)
    if split is not None:
        samples = [s for s in samples if split_of(s.rel, val_fraction) == split]
    if not samples:
        where = f" in the {split} split" if split else ""
        raise click.ClickException(f"no PNG, BMP or JPEG images under {directory}{where}")
    model = _load(model_path, views)
    try:
        predictor = resolve(model, None if cascade is None else cascade == "on")
    except CascadeError as exc:
        raise click.ClickException(str(exc)) from None
    stages = _Stages()
    ev = Evaluation()
    errors = 0
    stderr = Console(stderr=True)
    if not stderr.is_terminal:
        stderr = Console(stderr=True, width=120)  # a log file: no wrapped table cells
    with Progress(
        TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("left"), TimeRemainingColumn(), console=stderr,
        disable=not stderr.is_terminal, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("eval", total=len(samples))
        for sample in samples:
            row = _eval_one(predictor or model, sample, ev, mask_out, stages)
            errors += "error" in row
            click.echo(json.dumps(row) if as_json else _text_row(row))
            bar.advance(task)
    m = model.meta
    summary = ev.summary() | {
        "errors": errors, "model": model.version, "views": model.views,
        "cascade": stages.summary(predictor),
        "operating_point": {"threshold": m.threshold, "min_area": m.min_area,
                            "score_window": m.score_window, "score_threshold": m.score_threshold},
    }  # fmt: skip
    if roc_path is not None:
        _write_roc(roc_path, ev, summary, model.version)
    if as_json:
        click.echo(json.dumps({"summary": summary}))
    else:
        stderr.print(summary_table(summary))
    if errors:
        sys.exit(1)


class _Stages:
    """What the cascade did over the run: frames stage 1 answered alone, full-resolution
    input pixels per frame."""

    def __init__(self) -> None:
        self.frames = self.stage1 = self.pixels = 0

    def add(self, regions: list[Any] | None, pixels: int | None) -> None:
        if regions is not None:
            self.frames += 1
            self.stage1 += not regions
            self.pixels += pixels or 0

    def summary(self, cascade: Cascade | None) -> dict[str, Any]:
        if cascade is None:
            return {"on": False}
        n = max(self.frames, 1)
        return {"on": True, "settings": {k: v for k, v in cascade.settings.to_json().items()
                                         if k != "calibration"},
                "stage1_share": round(self.stage1 / n, 4),
                "full_res_pixels_per_frame": round(self.pixels / n, 1)}  # fmt: skip


def _eval_one(
    model: ScratchNet | Cascade,
    sample: Sample,
    ev: Evaluation,
    mask_out: Path | None,
    stages: _Stages,
) -> dict[str, Any]:
    try:
        image = decode_image(sample.image.read_bytes())
    except (OSError, ImageError) as exc:
        return {"image": sample.rel, "error": str(exc)}
    start = time.perf_counter()
    pred = model.predict([image])[0]
    ev.seconds += time.perf_counter() - start
    stages.add(pred.regions, pred.full_res_pixels)
    ev.add(sample.group, pred.mask, _ground_truth(sample, image.shape), pred.score, pred.verdict)
    if mask_out is not None:
        target = (mask_out / sample.rel).with_suffix(".png")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(encode_png(pred.mask))
    boxes = [[round(v, 4) for v in box] for box in pred.boxes]
    return {
        "image": sample.rel,
        "score": round(pred.score, 6),
        "verdict": pred.verdict,
        "boxes": boxes,
    }


def _ground_truth(sample: Sample, shape: tuple[int, ...]) -> Any:
    if sample.mask is None:
        return None
    try:
        mask = decode_image(sample.mask.read_bytes())
        return validate_mask(mask, (shape[0], shape[1]), sample.mask.name).mask
    except (OSError, ImageError, MaskRejected) as exc:
        click.echo(f"warning: {sample.rel}: mask not used: {exc}", err=True)
        return None


def _write_roc(path: Path, ev: Evaluation, summary: dict[str, Any], version: str) -> None:
    curves = ev.roc()
    operating = {
        g: (summary["clean_rejected"].get(g, 0.0), 1.0 - summary["defect_passed"].get(g, 0.0))
        for g in curves
    }
    aucs = ", ".join(f"{g} AUROC {a:.4f}" for g, a in summary["auroc"].items())
    draw_roc(path, curves, operating, f"{version}: {aucs}")


def summary_table(summary: dict[str, Any]) -> Table:
    """The readable form of the summary: one row per group (pooled groups in bold)."""
    op = summary.get("operating_point", {})
    casc = summary.get("cascade", {"on": False})
    cascade = (
        f"cascade on (stage 1 alone {100 * casc['stage1_share']:.1f} % of frames, "
        f"{casc['full_res_pixels_per_frame']:.0f} full-res px/frame)"
        if casc["on"] else "cascade off"
    )  # fmt: skip
    title = (
        f"{summary.get('model', '')} views {'+'.join(summary.get('views', []))}, {cascade} — "
        f"{summary['images']} images, {summary['ms_per_image']} ms/image; pixel threshold "
        f"{op.get('threshold')}, score threshold {op.get('score_threshold')}"
    )
    table = Table(title=title)
    for col in ("group", "defect images", "mean IoU", "clean rejected", "defect passed", "AUROC"):
        table.add_column(col, justify="left" if col == "group" else "right")
    groups = sorted(
        set(summary["iou"]) | set(summary["clean_rejected"]) | set(summary["defect_passed"])
    )
    for g in groups:

        def pct(d: dict[str, float], g: str = g) -> str:
            return f"{100 * d[g]:.1f} %" if g in d else ""

        iou = summary["iou"].get(g)
        table.add_row(
            f"[bold]{g}[/bold]" if "/" not in g else g,
            str(summary["iou_images"].get(g, "")),
            "" if iou is None else f"{iou:.4f}",
            pct(summary["clean_rejected"]),
            pct(summary["defect_passed"]),
            f"{summary['auroc'][g]:.4f}" if g in summary["auroc"] else "",
        )
    return table


def _text_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['image']}  ERROR {row['error']}"
    return f"{row['image']}  {row['verdict']:6s}  {row['score']:.4f}  boxes={len(row['boxes'])}"


@click.group("model")
def model() -> None:
    """Inspect the model (the shipped one unless --model says otherwise)."""


@model.command("info")
@click.option("--json", "as_json", is_flag=True, help="The metadata as one JSON object.")
@click.option(
    "--model",
    "model_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Model file (default: the one shipped in the package).",
)
def info(as_json: bool, model_path: Path | None) -> None:
    """Print the model's metadata: version, architecture, params, metrics, ..."""
    meta = _load(model_path).meta.to_json()
    if as_json:
        click.echo(json.dumps(meta))
        return
    for key in ("version", "params", "architecture", "mean", "std", "threshold", "min_area",
                "score_window", "score_threshold", "views", "train_data_sha256",
                "val_metrics"):  # fmt: skip
        click.echo(f"{key:18s} {json.dumps(meta[key])}")

"""``scratchd eval`` and ``scratchd model``: the model in-process, without a daemon.

``scratchd eval DIR [--json] [--mask-out OUT] [--model PATH] [--views V ...]`` runs the model
over every input image under DIR (found by :func:`scratchd.dataset.folders.scan_dataset`):

- one row per image on stdout: text ``<rel> <verdict> <score> <boxes>``, or with ``--json``
  ``{"image": rel, "score": float, "verdict": "defect"|"clean", "boxes": [[x0, y0, x1, y1,
  score], ...]}``; an unreadable image gives ``{"image": rel, "error": reason}`` and the run
  goes on (exit status 1 at the end);
- with ``--mask-out OUT``, the predicted 0/255 mask at ``OUT/<rel with suffix .png>``;
- then the summary (IoU per group over defect images, AUROC defects vs clean per top-level
  group, timing; see :mod:`scratchd.kernels.evaluate`): with ``--json`` a last stdout line
  ``{"summary": {...}}``, otherwise on stderr. Images whose mask is rejected by
  :func:`scratchd.dataset.masks.validate_mask` are predicted but left out of the metrics.

``scratchd model info [--json] [--model PATH]`` prints the model's metadata (with ``params``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from scratchd.dataset.folders import Sample, scan_dataset
from scratchd.dataset.masks import MaskRejected, validate_mask
from scratchd.ipc.image import ImageError, decode_image, encode_png
from scratchd.kernels.evaluate import Evaluation
from scratchd.kernels.model import VIEWS, ModelError, ScratchNet, load_model


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
@click.option("--views", multiple=True, type=click.Choice(VIEWS), help="Override test views.")
def eval_cmd(
    directory: Path,
    as_json: bool,
    mask_out: Path | None,
    model_path: Path | None,
    views: tuple[str, ...],
) -> None:
    """Run the model over every image under DIRECTORY and report accuracy."""
    samples = scan_dataset(directory)
    if not samples:
        raise click.ClickException(f"no PNG, BMP or JPEG images under {directory}")
    model = _load(model_path, views)
    ev = Evaluation()
    errors = 0
    for sample in samples:
        row = _eval_one(model, sample, ev, mask_out)
        errors += "error" in row
        click.echo(json.dumps(row) if as_json else _text_row(row))
    summary = ev.summary() | {"errors": errors, "model": model.version}
    if as_json:
        click.echo(json.dumps({"summary": summary}))
    else:
        click.echo(json.dumps(summary, indent=1), err=True)
    if errors:
        sys.exit(1)


def _eval_one(
    model: ScratchNet, sample: Sample, ev: Evaluation, mask_out: Path | None
) -> dict[str, Any]:
    try:
        image = decode_image(sample.image.read_bytes())
    except (OSError, ImageError) as exc:
        return {"image": sample.rel, "error": str(exc)}
    start = time.perf_counter()
    pred = model.predict([image])[0]
    ev.seconds += time.perf_counter() - start
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


def _text_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['image']}  ERROR {row['error']}"
    return f"{row['image']}  {row['verdict']:6s}  {row['score']:.4f}  boxes={len(row['boxes'])}"


@click.group("model")
def model() -> None:
    """Inspect the model (the shipped one unless --model says otherwise)."""


@model.command("info")
@click.option("--json", "as_json", is_flag=True, help="The metadata as one JSON object.")
@click.option("--model", "model_path", type=click.Path(dir_okay=False, path_type=Path))
def info(as_json: bool, model_path: Path | None) -> None:
    """Print the model's metadata: version, architecture, params, metrics, ..."""
    meta = _load(model_path).meta.to_json()
    if as_json:
        click.echo(json.dumps(meta))
        return
    for key in ("version", "params", "architecture", "mean", "std", "threshold", "min_area",
                "score_window", "views", "train_data_sha256", "val_metrics"):  # fmt: skip
        click.echo(f"{key:18s} {json.dumps(meta[key])}")

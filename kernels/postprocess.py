"""Post-processing: probability map → binary mask, components, boxes, score, verdict.

For one image (all numpy, no Python loop over pixels):

1. ``prob >= threshold`` gives the raw binary mask.
2. Connected components (8-connectivity) are found on *runs*: each row of the mask is split
   into maximal horizontal runs of foreground pixels; two runs on adjacent rows touch when
   their column ranges overlap or meet diagonally. Runs are joined by vectorised union-find
   (hooking the roots of touching pairs, then full path compression, until no pair spans
   two roots), so the cost grows with the number of runs, not of pixels.
3. Components with fewer than ``min_area`` pixels are dropped; the returned mask holds only
   the kept ones (0/255), so mask and boxes always agree.
4. Each kept component gives a box ``(x0, y0, x1, y1, score)`` in pixel-edge coordinates
   (``x1``/``y1`` exclusive: a single pixel at (3, 5) is ``(3, 5, 4, 6)``), scored by the
   mean probability over its pixels; boxes are sorted by score, highest first.
5. The image score is the peak of the probability map averaged over ``score_window`` x
   ``score_window`` windows (a defect must be a few pixels wide to rank high, one hot pixel
   is not enough); it ranks images and lies in [0, 1]. The verdict is ``defect`` iff at
   least one box survived ``min_area``.

Steps 2-4 from the runs on are :func:`finish_runs`, the one host finish of both backends:
the CPU path feeds it the runs of its own map (run sums from float64 prefix sums), the GPU
path (``serve_graph.py``) the runs the device found (``row_runs.py``, fp32 run sums).

Also here: the output entropy (drift of model confidence) and the input intensity histogram.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from scratchd.ipc.layout import HISTOGRAM_BINS

Verdict = Literal["defect", "clean"]
Box = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class Runs:
    """Horizontal foreground runs of a mask and the component each belongs to."""

    row: np.ndarray  # [R] int64
    start: np.ndarray  # [R] int64, first column
    end: np.ndarray  # [R] int64, one past the last column
    label: np.ndarray  # [R] int64, component id in 0..count-1
    count: int


def find_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(row, start, end)`` of every horizontal run of True in a 2-D bool mask, row-major."""
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)  # [H, W + 1]: +1 where a run starts, -1 one past its end
    rows, starts = np.nonzero(edges == 1)
    _, ends = np.nonzero(edges == -1)
    return rows.astype(np.int64), starts.astype(np.int64), ends.astype(np.int64)


def _touching_pairs(row: np.ndarray, start: np.ndarray, end: np.ndarray, width: int) -> np.ndarray:
    """``[P, 2]`` indices of runs on adjacent rows that are 8-connected."""
    stride = width + 2
    start_key = row * stride + start  # sorted: runs are row-major and disjoint within a row
    end_key = row * stride + end
    # Run b on the next row touches run a when start_b <= end_a and end_b >= start_a.
    lo = np.searchsorted(end_key, (row + 1) * stride + start, side="left")
    hi = np.searchsorted(start_key, (row + 1) * stride + end, side="right")
    counts = np.maximum(hi - lo, 0)
    a = np.repeat(np.arange(len(row)), counts)
    b = np.repeat(lo, counts) + _ragged_arange(counts)
    return np.stack([a, b], axis=1)


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """``0..c-1`` for each ``c`` in ``counts``, concatenated (one piece's offsets after the
    other, without a Python loop)."""
    return np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def label_runs(mask: np.ndarray) -> Runs:
    """8-connected components of a 2-D bool mask, as labelled runs."""
    if mask.ndim != 2:
        raise ValueError(f"label_runs: mask must be 2-D, got shape {mask.shape}")
    row, start, end = find_runs(mask.astype(bool, copy=False))
    return link_runs(row, start, end, mask.shape[1])


def link_runs(row: np.ndarray, start: np.ndarray, end: np.ndarray, width: int) -> Runs:
    """Label row-major sorted runs (``find_runs`` order) by 8-connected component."""
    labels = np.arange(len(row))  # parent of each run; a parent index never exceeds its own
    pairs = _touching_pairs(row, start, end, width)
    if len(pairs):
        a, b = pairs[:, 0], pairs[:, 1]
        while True:
            # Hook: the larger root of each touching pair points to the smaller one; then
            # compress every path to its root. A root is the smallest run of its tree, so
            # at the end each run is labelled with its component's first run.
            ra, rb = labels[a], labels[b]
            split = ra != rb
            if not split.any():
                break
            ra, rb = ra[split], rb[split]
            np.minimum.at(labels, np.maximum(ra, rb), np.minimum(ra, rb))
            while True:
                up = labels[labels]
                if np.array_equal(up, labels):
                    break
                labels = up
    # Components numbered by their first run (np.unique's order, without its sort).
    is_root = labels == np.arange(len(labels))
    rank = np.cumsum(is_root) - 1
    return Runs(row, start, end, rank[labels].astype(np.int64), int(is_root.sum()))


def threshold_runs(
    prob: np.ndarray,  # [H, W] float32
    threshold: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(row, start, end, run_sum)`` of the runs of ``prob >= threshold`` (compared in
    float32, as on the device), row-major: ``finish_runs``' input. ``run_sum`` (float64) is
    prob summed over each run, from per-row float64 prefix sums."""
    h, w = prob.shape
    row, start, end = find_runs(prob >= np.float32(threshold))
    prefix = np.zeros((h, w + 1), dtype=np.float64)
    np.cumsum(prob, axis=1, out=prefix[:, 1:])
    return row, start, end, prefix[row, end] - prefix[row, start]


@dataclass(frozen=True)
class PostResult:
    mask: np.ndarray  # [H, W] uint8, 0/255, kept components only
    boxes: list[Box]
    score: float
    verdict: Verdict


def postprocess(
    prob: np.ndarray,  # [H, W] float32 in [0, 1]
    threshold: float,
    min_area: int,
    score_window: int = 5,
) -> PostResult:
    """Threshold, label, filter by ``min_area``, box and score one probability map."""
    if prob.ndim != 2 or prob.dtype != np.float32:
        raise ValueError(f"postprocess: prob must be 2-D float32, got {prob.dtype} {prob.shape}")
    h, w = prob.shape
    comp = finish_runs(*threshold_runs(prob, threshold), h, w, min_area)
    assert comp.mask is not None
    score = peak_local_mean(prob, score_window)
    return PostResult(comp.mask, comp.boxes, score, "defect" if comp.boxes else "clean")


@dataclass(frozen=True)
class Components:
    mask: np.ndarray | None  # [H, W] uint8, 0/255, kept components only (None: not painted)
    boxes: list[Box]


def finish_runs(
    row: np.ndarray,  # [R] int64, row-major sorted (find_runs order)
    start: np.ndarray,  # [R] int64
    end: np.ndarray,  # [R] int64, exclusive
    run_sum: np.ndarray,  # [R] float64: prob summed over each run
    height: int,
    width: int,
    min_area: int,
    paint: bool = True,
) -> Components:
    """The host finish shared by the CPU path (``postprocess``) and the GPU path
    (``serve_graph``, whose runs come from the device): components, ``min_area``, boxes and
    (when ``paint``) the mask of the kept components."""
    runs = link_runs(row, start, end, width)
    length = runs.end - runs.start
    area = np.bincount(runs.label, weights=length, minlength=runs.count)
    prob_sum = np.bincount(runs.label, weights=run_sum, minlength=runs.count)
    keep = area >= min_area
    kept_runs = keep[runs.label]
    mask = _paint(runs, kept_runs, height, width) if paint else None
    return Components(mask, _boxes(runs, kept_runs, area, prob_sum, keep))


def _paint(runs: Runs, kept: np.ndarray, h: int, w: int) -> np.ndarray:
    """The 0/255 mask of the kept runs: one scatter over their pixels (cost grows with the
    foreground, not the frame)."""
    mask = np.zeros(h * w, dtype=np.uint8)
    first = runs.row[kept] * w + runs.start[kept]
    length = runs.end[kept] - runs.start[kept]
    mask[np.repeat(first, length) + _ragged_arange(length)] = 255
    return mask.reshape(h, w)


def _boxes(
    runs: Runs, kept: np.ndarray, area: np.ndarray, prob_sum: np.ndarray, keep: np.ndarray
) -> list[Box]:
    n = runs.count
    big = np.iinfo(np.int64).max
    x0, y0 = np.full(n, big), np.full(n, big)
    x1, y1 = np.full(n, -1), np.full(n, -1)
    lab = runs.label[kept]
    np.minimum.at(x0, lab, runs.start[kept])
    np.minimum.at(y0, lab, runs.row[kept])
    np.maximum.at(x1, lab, runs.end[kept])
    np.maximum.at(y1, lab, runs.row[kept] + 1)
    ids = np.flatnonzero(keep)
    scores = prob_sum[ids] / area[ids]
    order = np.argsort(-scores, kind="stable")
    return [
        (float(x0[i]), float(y0[i]), float(x1[i]), float(y1[i]), float(s))
        for i, s in zip(ids[order], scores[order], strict=True)
    ]


def peak_local_mean(prob: np.ndarray, window: int) -> float:
    """The largest mean of ``prob`` over ``window x window`` squares (whole image if smaller)."""
    h, w = prob.shape
    k_h, k_w = min(window, h), min(window, w)
    integral = np.zeros((h + 1, w + 1), dtype=np.float64)
    np.cumsum(np.cumsum(prob, axis=0, dtype=np.float64), axis=1, out=integral[1:, 1:])
    sums = (
        integral[k_h:, k_w:]
        - integral[:-k_h, k_w:]
        - integral[k_h:, :-k_w]
        + integral[:-k_h, :-k_w]
    )
    return float(np.clip(sums.max() / (k_h * k_w), 0.0, 1.0))


def binary_entropy_bits(prob: np.ndarray) -> float:
    """Mean binary entropy of the per-pixel probabilities, in bits (0 = certain, 1 = p = 0.5)."""
    p = np.clip(prob.astype(np.float64), 1e-12, 1.0 - 1e-12)
    return float(np.mean(-(p * np.log2(p) + (1.0 - p) * np.log2(1.0 - p))))


def intensity_histogram(image: np.ndarray) -> np.ndarray:
    """``[64]`` uint32 counts of a uint8 image's intensities (bin ``i`` = values 4i..4i+3)."""
    if image.dtype != np.uint8:
        raise ValueError(f"intensity_histogram: image must be uint8, got {image.dtype}")
    return np.bincount((image >> 2).ravel(), minlength=HISTOGRAM_BINS).astype(np.uint32)

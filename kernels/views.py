"""Test-time views on the device: ``view_stack`` (frames → view frames) and ``view_mean``
(view probabilities → their mean, with its window score and mean entropy).

Layout of the view frames of a batch of ``N`` frames of ``H x W`` (:func:`view_layout`)::

    A  [VA * N, H, W]   the views that keep the frame's shape, in model order, view-major:
                        A[slot * N + i] = view(frame i)   (the transpose too when H == W)
    B  [N, W, H]        the transpose of a non-square frame (absent otherwise)

The forward runs A (and B, a second shape) as batches; ``view_mean`` maps each view's
probability map back (every view is its own inverse) and averages them exactly as
``ScratchNet.prob`` does: ``total = 0; total += view_j for j in model order; total /= V``
in float32, so the mean is the reference's bit for bit given the same view maps. On the
mean it then accumulates the binary entropy (bits) per frame and reuses ``output_path``'s
``window_score`` kernel for the score and the mean entropy.

With the single ``identity`` view, A is a copy of the frames and the mean is the map itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from scratchd.kernels import _cuda as cu
from scratchd.kernels._checks import check_array
from scratchd.kernels.output_path import window_score_cuda
from scratchd.kernels.postprocess import binary_entropy_bits, peak_local_mean

# The test-time views a model may average; each is its own inverse.
VIEWS = ("identity", "flip_h", "flip_v", "transpose")
CODES = {view: code for code, view in enumerate(VIEWS)}  # the order view_code() decodes
TILE, ROWS = 32, 8  # views.cu


def apply_view(images: np.ndarray, view: str) -> np.ndarray:
    """``[N, H, W]`` → the view (contiguous); applying it twice gives ``images`` back."""
    if view == "identity":
        return images
    if view == "flip_h":
        return np.ascontiguousarray(images[:, :, ::-1])
    if view == "flip_v":
        return np.ascontiguousarray(images[:, ::-1, :])
    if view == "transpose":
        return np.ascontiguousarray(images.transpose(0, 2, 1))
    raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")


class ViewLayout(NamedTuple):
    """Where each view of a frame lives (module docstring)."""

    views: tuple[str, ...]  # model order
    in_a: tuple[str, ...]  # views stored in A, in slot order
    in_b: tuple[str, ...]  # () or ("transpose",) for a non-square frame
    words: tuple[int, ...]  # per view in model order: code | buf << 2 | slot << 3


def view_layout(views: tuple[str, ...], height: int, width: int) -> ViewLayout:
    """The A/B placement of ``views`` for ``height x width`` frames."""
    bad = [v for v in views if v not in CODES]
    if bad or not views or len(set(views)) != len(views):
        raise ValueError(f"views must be distinct names from {VIEWS}, got {views}")
    swapped = height != width
    in_a = tuple(v for v in views if not (swapped and v == "transpose"))
    in_b = tuple(v for v in views if swapped and v == "transpose")
    words = tuple(
        CODES[v] | (4 | in_b.index(v) << 3 if v in in_b else in_a.index(v) << 3) for v in views
    )
    return ViewLayout(views, in_a, in_b, words)


def view_stack_ref(
    frames: np.ndarray,  # [N, H, W] uint8
    views: tuple[str, ...],
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(A, B)`` of the module docstring; ``B`` is None for square frames (A may be
    ``[0, H, W]`` when the only view is the transpose of a non-square frame)."""
    check_array("view_stack", "frames", frames, ndim=3, dtype=np.uint8)
    _, h, w = frames.shape
    lay = view_layout(views, h, w)
    a = np.concatenate([apply_view(frames, v) for v in lay.in_a] or [frames[:0]])
    b = apply_view(frames, "transpose") if lay.in_b else None
    return a, b


class ViewMean(NamedTuple):
    prob: Any  # [N, H, W] float32: the views' mean probability
    score: Any  # [N] float32: peak_local_mean(prob, score_window)
    entropy: Any  # [N] float32: mean binary entropy of prob, bits


def _frames(lay: ViewLayout, a_shape: tuple[int, ...], b: Any) -> int:
    if b is not None:
        return int(b.shape[0])
    return a_shape[0] // max(len(lay.in_a), 1)


def view_mean_ref(
    prob_a: np.ndarray,  # [VA * N, H, W] float32
    prob_b: np.ndarray | None,  # [N, W, H] float32, or None
    views: tuple[str, ...],
    score_window: int,
) -> ViewMean:
    """Mean of the views' maps (model order, float32), its score and entropy per frame."""
    check_array("view_mean", "prob_a", prob_a, ndim=3)
    _, h, w = prob_a.shape
    lay = view_layout(views, h, w)
    n = _frames(lay, prob_a.shape, prob_b)
    _check_views(lay, prob_a.shape, None if prob_b is None else prob_b.shape, n)
    total = np.zeros((n, h, w), dtype=np.float32)
    for v in views:
        if v in lay.in_b:
            assert prob_b is not None
            total += apply_view(prob_b, v)
        else:
            slot = lay.in_a.index(v)
            total += apply_view(prob_a[slot * n : (slot + 1) * n], v)
    total /= np.float32(len(views))
    score = np.array([peak_local_mean(p, score_window) for p in total], dtype=np.float32)
    entropy = np.array([binary_entropy_bits(p) for p in total], dtype=np.float32)
    return ViewMean(total, score, entropy)


def _check_views(
    lay: ViewLayout, a_shape: tuple[int, ...], b_shape: tuple[int, ...] | None, n: int
) -> None:
    _, h, w = a_shape
    if a_shape[0] != len(lay.in_a) * n:
        raise ValueError(f"views: A has {a_shape[0]} frames, expected {len(lay.in_a)} x {n}")
    if bool(lay.in_b) != (b_shape is not None):
        raise ValueError(f"views: B {'missing' if lay.in_b else 'given'} for {h}x{w} frames")
    if b_shape is not None and tuple(b_shape) != (n, w, h):
        raise ValueError(f"views: B must have shape {(n, w, h)}, got {tuple(b_shape)}")


def _grid(n: int, height: int, width: int) -> tuple[int, int, int]:
    return (-(-width // TILE), -(-height // TILE), n)


def _word_args(lay: ViewLayout) -> tuple[np.int32, ...]:
    words = (*lay.words, *(0,) * (4 - len(lay.words)))
    return (cu.i32(len(lay.words)), *map(cu.i32, words))


def view_stack_cuda(
    frames: Any,  # [N, H, W] uint8 (CuPy)
    views: tuple[str, ...],
    *,
    out_a: Any | None = None,  # [VA * N, H, W] uint8
    out_b: Any | None = None,  # [N, W, H] uint8 (non-square frames with the transpose)
) -> tuple[Any, Any | None]:
    """CUDA twin of :func:`view_stack_ref` (``views.cu``: one tiled kernel)."""
    op = "view_stack"
    cu.check_device_array(op, "frames", frames, ndim=3, dtype=np.uint8)
    n, h, w = frames.shape
    lay = view_layout(views, h, w)
    a = cu.output(op, out_a, (len(lay.in_a) * n, h, w), np.uint8)
    b = cu.output(op, out_b, (n, w, h), np.uint8) if lay.in_b else None
    func = cu.kernel("views.cu", "view_stack", ("view_mean",))
    dims = map(cu.i32, (n, h, w))
    args = (frames, a, b if b is not None else a, *dims, *_word_args(lay))
    cu.launch(func, _grid(n, h, w), (TILE, ROWS), args)
    return a, b


def view_mean_buffers(n: int, height: int, width: int) -> ViewMean:
    """Device buffers for :func:`view_mean_cuda`'s ``out`` (allocated once, reused)."""
    cp = cu.cupy()
    f32 = np.float32
    return ViewMean(cp.empty((n, height, width), f32), cp.empty((n,), f32), cp.empty((n,), f32))


def view_mean_cuda(
    prob_a: Any,  # [VA * N, H, W] float32 (CuPy)
    prob_b: Any | None,  # [N, W, H] float32, or None
    views: tuple[str, ...],
    score_window: int,
    *,
    out: ViewMean | None = None,  # from view_mean_buffers(N, H, W)
    scratch: Any | None = None,  # [3 * N] uint32, zeroed here each run
) -> ViewMean:
    """CUDA twin of :func:`view_mean_ref`: a memset, ``view_mean`` and ``window_score``."""
    op = "view_mean"
    cu.check_device_array(op, "prob_a", prob_a, ndim=3, dtype=np.float32)
    if prob_b is not None:
        cu.check_device_array(op, "prob_b", prob_b, ndim=3, dtype=np.float32)
    _, h, w = prob_a.shape
    lay = view_layout(views, h, w)
    n = _frames(lay, tuple(prob_a.shape), prob_b)
    _check_views(lay, tuple(prob_a.shape), None if prob_b is None else tuple(prob_b.shape), n)
    out = out if out is not None else view_mean_buffers(n, h, w)
    for name, arr, shape in zip(ViewMean._fields, out, ((n, h, w), (n,), (n,)), strict=True):
        cu.check_device_array(op, f"out.{name}", arr, ndim=len(shape), dtype=np.float32)
        cu.check_shape(op, f"out.{name}", arr, shape)
    scratch = cu.output(op, scratch, (3 * n,), np.uint32, "scratch")
    cu.zero(scratch)  # [entropy sums | score maxima | tickets], accumulated with atomics
    ent_sum, score_bits, tickets = scratch[:n], scratch[n : 2 * n], scratch[2 * n :]
    func = cu.kernel("views.cu", "view_mean", ("view_stack",))
    b = prob_b if prob_b is not None else prob_a
    args = (prob_a, b, out.prob, ent_sum, *map(cu.i32, (n, h, w)), *_word_args(lay))
    cu.launch(func, _grid(n, h, w), (TILE, ROWS), args)
    window_score_cuda(out.prob, ent_sum, score_bits, tickets, out.score, out.entropy, score_window)
    return out

"""Test-time views: the numpy references (CPU) and their CUDA twins (gpu-marked).

The references must reproduce ``ScratchNet.prob``'s averaging bit for bit; the kernels
must reproduce the references: view frames exactly, the mean map exactly (same additions
in the same order in float32), score and entropy within float32 summation error.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.kernels.views import VIEWS, view_layout, view_mean_ref, view_stack_ref
from scratchd.model.scratchnet import ScratchNet
from scratchd.protocol.image import decode_image

from .cuda_helpers import cupy, fresh_rng

VIEW_SETS = [VIEWS, ("identity",), ("flip_v", "transpose"), ("transpose",), ("flip_h", "identity")]
SHAPES = [(1, 1, 1), (2, 1, 7), (3, 7, 1), (2, 33, 65), (1, 64, 64), (4, 100, 37), (2, 48, 48)]


def _fake_net(x: np.ndarray) -> np.ndarray:
    """A position-dependent 'network' (probabilities in [0, 1]): a wrong mapping back of
    a view shows up as a wrong pixel."""
    _, h, w = x.shape
    ramp = np.arange(h * w, dtype=np.float32).reshape(h, w) / np.float32(h * w)
    return (x.astype(np.float32) / np.float32(255.0)) * np.float32(0.7) + ramp * np.float32(0.3)


@given(
    st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9)),
    st.lists(st.sampled_from(VIEWS), min_size=1, max_size=4, unique=True),
)
def test_refs_average_views_exactly_like_scratchnet(
    shape: tuple[int, int, int], views: list[str]
) -> None:
    rng = np.random.default_rng(sum(shape))
    frames = rng.integers(0, 256, shape, dtype=np.uint8)
    a, b = view_stack_ref(frames, tuple(views))
    got = view_mean_ref(_fake_net(a), None if b is None else _fake_net(b), tuple(views), 3)
    # ScratchNet.prob itself, its network replaced by the fake one (views and forward are
    # all it reads), so a change to its averaging shows up here.
    fake = cast(ScratchNet, SimpleNamespace(views=tuple(views), forward=_fake_net))
    want = ScratchNet.prob(fake, frames)
    assert want.dtype == np.float32 and np.array_equal(got.prob, want)
    assert got.prob.shape == shape and got.score.shape == got.entropy.shape == (shape[0],)


def test_layout_puts_only_a_non_square_transpose_in_b() -> None:
    square = view_layout(VIEWS, 8, 8)
    assert square.in_a == VIEWS and square.in_b == ()
    wide = view_layout(VIEWS, 8, 9)
    assert wide.in_a == ("identity", "flip_h", "flip_v") and wide.in_b == ("transpose",)
    assert wide.words == (0, 1 | 1 << 3, 2 | 2 << 3, 3 | 4)
    with pytest.raises(ValueError, match="views"):
        view_layout(("identity", "identity"), 4, 4)
    with pytest.raises(ValueError, match="views"):
        view_layout(("rotate",), 4, 4)


def test_view_mean_ref_rejects_a_missing_transpose_buffer() -> None:
    a = np.zeros((3, 4, 5), np.float32)
    with pytest.raises(ValueError, match="B missing"):
        view_mean_ref(a, None, VIEWS, 1)


def _real_frames(data_dir: Path, n: int, h: int, w: int) -> np.ndarray:
    files = sorted((data_dir / "mtile" / "crack").glob("*.jpg"))[:n]
    imgs = [decode_image(f.read_bytes()) for f in files]
    return np.stack([np.resize(img, (h, w)) for img in imgs])


@pytest.mark.gpu
@pytest.mark.parametrize("views", VIEW_SETS, ids=lambda v: "+".join(v))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_view_stack_cuda_matches_ref(views: tuple[str, ...], shape: tuple[int, int, int]) -> None:
    from scratchd.kernels.views import view_stack_cuda

    rng, seed = fresh_rng()
    cp = cupy()
    frames = rng.integers(0, 256, shape, dtype=np.uint8)
    want_a, want_b = view_stack_ref(frames, views)
    out_a = cp.full(want_a.shape, 7, np.uint8)
    out_b = None if want_b is None else cp.full(want_b.shape, 7, np.uint8)
    got_a, got_b = view_stack_cuda(cp.asarray(frames), views, out_a=out_a, out_b=out_b)
    np.testing.assert_array_equal(cp.asnumpy(got_a), want_a, err_msg=f"seed={seed}")
    assert (got_b is None) == (want_b is None)
    if want_b is not None:
        np.testing.assert_array_equal(cp.asnumpy(got_b), want_b, err_msg=f"seed={seed}")


def _check_view_mean(
    pa: np.ndarray, pb: np.ndarray | None, views: tuple[str, ...], seed: int
) -> None:
    from scratchd.kernels.views import view_mean_buffers, view_mean_cuda

    cp = cupy()
    window = 3
    want = view_mean_ref(pa, pb, views, window)
    n, h, w = want.prob.shape
    out = view_mean_buffers(n, h, w)
    for arr in out:
        arr.fill(np.nan)
    dev_b = None if pb is None else cp.asarray(pb)
    got = view_mean_cuda(cp.asarray(pa), dev_b, views, window, out=out)
    ctx = f"seed={seed} {views} {want.prob.shape}"
    np.testing.assert_array_equal(cp.asnumpy(got.prob), want.prob, err_msg=ctx)
    np.testing.assert_allclose(cp.asnumpy(got.score), want.score, atol=1e-5, err_msg=ctx)
    np.testing.assert_allclose(cp.asnumpy(got.entropy), want.entropy, atol=1e-4, err_msg=ctx)
    again = view_mean_cuda(cp.asarray(pa), dev_b, views, window, out=out)  # no accumulation
    np.testing.assert_allclose(cp.asnumpy(again.entropy), want.entropy, atol=1e-4, err_msg=ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("views", VIEW_SETS, ids=lambda v: "+".join(v))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_view_mean_cuda_matches_ref(views: tuple[str, ...], shape: tuple[int, int, int]) -> None:
    rng, seed = fresh_rng()
    frames = rng.integers(0, 256, shape, dtype=np.uint8)
    a, b = view_stack_ref(frames, views)
    probs = rng.random(a.shape, dtype=np.float32)
    probs[..., :1] = rng.choice(np.array([0.0, 1.0, 0.5], np.float32), probs[..., :1].shape)
    pb = None if b is None else rng.random(b.shape, dtype=np.float32)
    _check_view_mean(probs, pb, views, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("hw", [(64, 64), (123, 286)], ids=["square", "non-square"])
def test_view_ops_cuda_on_real_frames(data_dir: Path, hw: tuple[int, int]) -> None:
    """Real magnetic-tile frames through both ops (maps: a smooth function of the frame)."""
    from scratchd.kernels.views import view_stack_cuda

    cp = cupy()
    frames = _real_frames(data_dir, 3, *hw)
    want_a, want_b = view_stack_ref(frames, VIEWS)
    got_a, got_b = view_stack_cuda(cp.asarray(frames), VIEWS)
    np.testing.assert_array_equal(cp.asnumpy(got_a), want_a)
    if want_b is not None:
        np.testing.assert_array_equal(cp.asnumpy(got_b), want_b)
    _check_view_mean(_fake_net(want_a), None if want_b is None else _fake_net(want_b), VIEWS, 0)

"""The C band kernels (``cpu/_cpu.c``) compute the numpy references' functions.

Every kernel is checked on every instruction set this CPU runs (the baseline x86-64 build
included, which is what a machine without AVX2 would get), on random shapes, bands, strides
and dilations, 1-pixel images and channel counts that are not multiples of the vector width
included.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.cpu import _cpu
from scratchd.kernels.conv3x3 import conv3x3_ref
from scratchd.kernels.dwconv3x3 import dwconv3x3_ref
from scratchd.kernels.upsample_bilinear2x import upsample_bilinear2x_ref
from scratchd.kernels.upsample_concat import upsample_concat_ref


@pytest.fixture(params=_cpu.ISAS, scope="module")
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    prev = _cpu.use_isa(request.param)
    try:
        yield request.param
    finally:
        _cpu.use_isa(prev)


def randn(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(0, scale, shape)).astype(np.float32)


def band(data: st.DataObject, rows: int) -> tuple[int, int]:
    """A random run ``r0 .. r1`` (at least one row) of ``rows`` output rows."""
    r0 = data.draw(st.integers(0, rows - 1), label="r0")
    return r0, data.draw(st.integers(r0 + 1, rows), label="r1")


def poisoned(shape: tuple[int, ...]) -> np.ndarray:
    """An output buffer full of NaN: a pixel the kernel forgets to write shows."""
    return np.full(shape, np.nan, dtype=np.float32)


dims = st.integers(1, 19)


@settings(max_examples=60, deadline=None)
@given(
    h=dims, w=dims, c=st.integers(1, 40), stride=st.sampled_from([1, 2]),
    dilation=st.integers(1, 5), seed=st.integers(0, 2**32 - 1), data=st.data(),
)  # fmt: skip
def test_dwconv3x3_equals_reference(
    isa: str, h: int, w: int, c: int, stride: int, dilation: int, seed: int, data: st.DataObject
) -> None:
    x, wt, b = randn(seed, 1, h, w, c), randn(seed + 1, 3, 3, c), randn(seed + 2, c)
    ref = dwconv3x3_ref(x, wt, b, stride, dilation, "relu")[0]
    r0, r1 = band(data, ref.shape[0])
    y = poisoned((r1 - r0, *ref.shape[1:]))
    _cpu.dwconv3x3(x[0], wt, b, y, r0, stride, dilation)
    # Same taps in the same order, each product and sum rounded to float32: equal in practice.
    np.testing.assert_allclose(y, ref[r0:r1], rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 9), w=st.integers(1, 9), c1=st.integers(1, 40), c2=st.integers(1, 24),
    seed=st.integers(0, 2**32 - 1), data=st.data(),
)  # fmt: skip
def test_dwconv3x3_join_equals_reference(
    isa: str, h: int, w: int, c1: int, c2: int, seed: int, data: st.DataObject
) -> None:
    x, skip = randn(seed, 1, h, w, c1), randn(seed + 1, 1, 2 * h, 2 * w, c2)
    wt, b = randn(seed + 2, 3, 3, c1 + c2), randn(seed + 3, c1 + c2)
    ref = dwconv3x3_ref(upsample_concat_ref(x, skip), wt, b, 1, 1, "relu")[0]
    r0, r1 = band(data, ref.shape[0])
    y = poisoned((r1 - r0, *ref.shape[1:]))
    _cpu.dwconv3x3_join(x[0], skip[0], wt, b, y, r0)
    # The upsampled channels use summed weights (4 taps, not 9): float32 rounding differs.
    np.testing.assert_allclose(y, ref[r0:r1], rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(h=dims, w=dims, cout=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_stem3x3_equals_reference(
    isa: str, h: int, w: int, cout: int, seed: int, data: st.DataObject
) -> None:
    x, wt, b = randn(seed, 1, h, w, 1), randn(seed + 1, 3, 3, 1, cout), randn(seed + 2, cout)
    ref = conv3x3_ref(x, wt, b, stride=2, act="relu")[0]
    r0, r1 = band(data, ref.shape[0])
    y = poisoned((r1 - r0, *ref.shape[1:]))
    _cpu.stem3x3(x[0, :, :, 0], wt.reshape(9, cout), b, y, r0)
    np.testing.assert_allclose(y, ref[r0:r1], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 50), c=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_bias_relu_is_pwconv_epilogue(isa: str, p: int, c: int, seed: int) -> None:
    o, b, res = randn(seed, p, c), randn(seed + 1, c), randn(seed + 2, p, c)
    for r in (None, res):
        want = o + b
        if r is not None:
            want += r
        got = o.copy()
        _cpu.bias_relu(got, b, r)
        np.testing.assert_array_equal(got, np.maximum(want, 0.0))


@settings(max_examples=40, deadline=None)
@given(h=dims, w=dims, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_bilinear2x_is_the_reference_bit_for_bit(
    h: int, w: int, seed: int, data: st.DataObject
) -> None:
    x = randn(seed, 1, h, w, 1, scale=4.0)
    width = data.draw(st.integers(1, 2 * w), label="width")
    ref = upsample_bilinear2x_ref(x)[0, :, :width, 0]
    r0, r1 = band(data, 2 * h)
    y = poisoned((r1 - r0, width))
    _cpu.bilinear2x(x[0, :, :, 0], y, r0)
    np.testing.assert_array_equal(y, ref[r0:r1])


def test_edge_pixels_see_zero_padding_not_neighbours() -> None:
    """A 1x1 image: every tap but the centre falls outside; a constant image: the border
    pixels sum fewer taps than the interior ones."""
    w = np.ones((3, 3, 1), np.float32)
    y = np.empty((1, 1, 1), np.float32)
    _cpu.dwconv3x3(np.full((1, 1, 1), 2.0, np.float32), w, np.zeros(1, np.float32), y, 0, 1, 1)
    assert y[0, 0, 0] == 2.0
    x = np.ones((4, 5, 1), np.float32)
    y = np.empty((4, 5, 1), np.float32)
    _cpu.dwconv3x3(x, w, np.zeros(1, np.float32), y, 0, 1, 1)
    assert y[0, 0, 0] == 4.0 and y[0, 2, 0] == 6.0 and y[1, 2, 0] == 9.0


def test_leave_cpu_moves_the_thread_off_a_cpu_without_pinning_it() -> None:
    allowed = os.sched_getaffinity(0)
    assert _cpu.current_cpu() in allowed
    assert not _cpu.leave_cpu(-1) and not _cpu.leave_cpu(max(allowed) + 1)
    if len(allowed) > 1:  # the thread may migrate between the two calls: a few tries
        for _ in range(5):
            cpu = _cpu.current_cpu()
            if _cpu.leave_cpu(cpu):
                break
        else:
            pytest.fail("leave_cpu never moved the thread")
        assert _cpu.current_cpu() != cpu
    assert os.sched_getaffinity(0) == allowed


def good_args() -> list[np.ndarray]:
    return [np.zeros((5, 6, 3), np.float32), np.zeros((3, 3, 3), np.float32),
            np.zeros(3, np.float32), np.zeros((2, 6, 3), np.float32)]  # fmt: skip


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (0, np.zeros((5, 6, 3), np.float64), "x must be float32"),
        (0, np.zeros((5, 12, 3), np.float32)[:, ::2], "x must be a C-contiguous"),
        (1, np.zeros((3, 3, 4), np.float32), "w must have shape"),
        (2, np.zeros(2, np.float32), "b must have shape"),
        (3, np.zeros((2, 5, 3), np.float32), "y must have shape"),
        (3, np.zeros((2, 6, 3), np.float32).copy().view(np.int32), "y must be float32"),
    ],
)
def test_dwconv3x3_rejects_bad_arrays_naming_them(
    index: int, bad: np.ndarray, message: str
) -> None:
    args = good_args()
    args[index] = bad
    with pytest.raises(ValueError, match=f"dwconv3x3: {message}"):
        _cpu.dwconv3x3(args[0], args[1], args[2], args[3], 0, 1, 1)


def test_kernels_reject_bad_rows_strides_overlap_and_readonly_output() -> None:
    x, w, b, y = good_args()
    with pytest.raises(ValueError, match="not all output rows"):
        _cpu.dwconv3x3(x, w, b, y, 4, 1, 1)  # rows 4, 5 of 5
    with pytest.raises(ValueError, match="stride must be 1 or 2"):
        _cpu.dwconv3x3(x, w, b, y, 0, 3, 1)
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        _cpu.dwconv3x3(x, w, b, y, 0, 1, 0)
    with pytest.raises(ValueError, match="must not overlap"):
        _cpu.dwconv3x3(x, w, b, x[:2], 0, 1, 1)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="y must be a C-contiguous, writable"):
        _cpu.dwconv3x3(x, w, b, y, 0, 1, 1)
    skip = np.zeros((4, 6, 2), np.float32)  # must be [2h, 2w] = [10, 12]
    y = np.zeros((2, 12, 5), np.float32)
    with pytest.raises(ValueError, match="dwconv3x3_join: skip must have shape"):
        _cpu.dwconv3x3_join(x, skip, np.zeros((3, 3, 5), np.float32), b, y, 0)
    with pytest.raises(ValueError, match="bias_relu: res must have o's shape"):
        _cpu.bias_relu(np.zeros((4, 3), np.float32), b, np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="bilinear2x: y is wider"):
        _cpu.bilinear2x(np.zeros((2, 3), np.float32), np.zeros((4, 7), np.float32), 0)
    with pytest.raises(ValueError, match="use_isa"):
        _cpu.use_isa("sse9")

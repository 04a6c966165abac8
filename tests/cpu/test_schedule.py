"""The banded CPU schedule computes each layer exactly as the op-by-op numpy references.

``tests/model/test_net.py`` checks the whole network (and against PyTorch); here each kind
of layer is compared on its own, with bands small enough that band edges fall everywhere.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchd.cpu import bands as cpu_bands
from scratchd.cpu import schedule as cpu_schedule
from scratchd.kernels.conv3x3 import conv3x3_ref
from scratchd.kernels.dwconv3x3 import dwconv3x3_ref
from scratchd.kernels.prob_head import prob_head_ref
from scratchd.kernels.pwconv import pwconv_ref
from scratchd.kernels.upsample_concat import upsample_concat_ref


@pytest.fixture(params=[4096, 2 * 1024 * 1024], ids=["small-bands", "default-bands"])
def band_bytes(request: pytest.FixtureRequest) -> Iterator[int]:
    old = cpu_schedule.BAND_BYTES
    cpu_schedule.BAND_BYTES = request.param
    try:
        yield request.param
    finally:
        cpu_schedule.BAND_BYTES = old


def randn(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, scale, shape).astype(np.float32)


# (name, N, H, W, Cin, Cout, stride, dilation, residual)
BLOCKS = [
    ("residual", 2, 23, 17, 12, 12, 1, 1, True),
    ("stride2-odd", 1, 25, 19, 8, 16, 2, 1, False),
    ("dilated", 1, 13, 11, 24, 24, 1, 2, True),
    ("dilation4-tiny", 2, 3, 5, 16, 16, 1, 4, True),
    ("one-pixel", 1, 1, 1, 9, 5, 2, 1, False),
]


@pytest.mark.parametrize(("name", "n", "h", "w", "cin", "cout", "s", "d", "res"), BLOCKS)
def test_ds_block_equals_reference(
    band_bytes: int,
    name: str, n: int, h: int, w: int, cin: int, cout: int, s: int, d: int, res: bool,
) -> None:  # fmt: skip
    x = randn(1, n, h, w, cin)
    dw_w, dw_b = randn(2, 3, 3, cin), randn(3, cin, scale=0.3)
    pw_w, pw_b = randn(4, cin, cout, scale=0.3), randn(5, cout, scale=0.3)
    got = cpu_schedule.ds_block_cpu(x, dw_w, dw_b, pw_w, pw_b, s, d, res)
    y = dwconv3x3_ref(x, dw_w, dw_b, s, d, "relu")
    want = pwconv_ref(y, pw_w, pw_b, "relu", x if res else None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("n", "h", "w", "c1", "c2", "cout"), [(2, 7, 5, 24, 12, 12), (1, 1, 1, 8, 3, 4)]
)
def test_decoder_join_block_equals_reference(
    band_bytes: int, n: int, h: int, w: int, c1: int, c2: int, cout: int
) -> None:
    x, skip = randn(1, n, h, w, c1), randn(2, n, 2 * h, 2 * w, c2)
    cin = c1 + c2
    dw_w, dw_b = randn(3, 3, 3, cin), randn(4, cin, scale=0.3)
    pw_w, pw_b = randn(5, cin, cout, scale=0.3), randn(6, cout, scale=0.3)
    got = cpu_schedule.ds_block_cpu(x, dw_w, dw_b, pw_w, pw_b, 1, 1, False, skip)
    y = dwconv3x3_ref(upsample_concat_ref(x, skip), dw_w, dw_b, 1, 1, "relu")
    np.testing.assert_allclose(got, pwconv_ref(y, pw_w, pw_b, "relu"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 32, 48), (1, 7, 9), (1, 1, 1)])
def test_stem_equals_reference(band_bytes: int, shape: tuple[int, int, int]) -> None:
    x = randn(1, *shape, 1)
    w, b = randn(2, 3, 3, 1, 16), randn(3, 16, scale=0.1)
    got = cpu_schedule.stem_cpu(x, w, b)
    np.testing.assert_allclose(got, conv3x3_ref(x, w, b, 2, "relu"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "crop",
    [(1, 6, 7, 11, 13), (2, 52, 52, 104, 103), (1, 1, 1, 1, 2), (1, 104, 104, 200, 200),
     (2, 7, 9, 13, 17), (1, 3, 5, 6, 10)],
)  # fmt: skip
def test_prob_head_is_the_reference_bit_for_bit(
    band_bytes: int, crop: tuple[int, int, int, int, int]
) -> None:
    n, h, w, height, width = crop
    logits = randn(h, n, h, w, 1, scale=4.0)
    got = cpu_schedule.prob_head_cpu(logits, height, width)
    np.testing.assert_array_equal(got, prob_head_ref(logits, height, width))


def test_block_output_comes_from_the_workspace_and_is_fully_rewritten() -> None:
    """A recycled output buffer holds the previous forward's values: none may survive."""
    ws = cpu_bands.Workspace()
    x = randn(1, 1, 9, 9, 8)
    dw_w, dw_b, pw_w, pw_b = randn(2, 3, 3, 8), randn(3, 8), randn(4, 8, 8), randn(5, 8)
    ws.give(np.full((1, 9, 9, 8), np.nan, np.float32))
    got = cpu_schedule.ds_block_cpu(x, dw_w, dw_b, pw_w, pw_b, 1, 1, True, ws=ws)
    assert ws.kept == 0 and np.isfinite(got).all()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 4), rows=st.integers(1, 300), row_bytes=st.integers(1, 1 << 16))
def test_bands_cover_every_row_once_in_order(n: int, rows: int, row_bytes: int) -> None:
    tasks = cpu_schedule.bands(n, rows, row_bytes)
    for i in range(n):
        mine = [(r0, r1) for j, r0, r1 in tasks if j == i]
        assert mine[0][0] == 0 and mine[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
        assert all(r0 < r1 for r0, r1 in mine)
    # An image's bands are its own: the same whatever else shares the batch.
    alone = cpu_schedule.bands(1, rows, row_bytes)
    assert all(
        [(r0, r1) for j, r0, r1 in tasks if j == i] == [t[1:] for t in alone] for i in range(n)
    )
    threads = cpu_bands.THREADS
    if rows * row_bytes >= threads * cpu_schedule.MIN_BAND_BYTES:
        # Enough bytes: a lone frame's largest band is at most one core's share of its rows.
        assert max(r1 - r0 for _, r0, r1 in alone) <= -(-rows // threads)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 4), h=st.integers(1, 40), w=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_a_frame_gets_the_same_bits_alone_as_in_a_batch(n: int, h: int, w: int, seed: int) -> None:
    """The daemon batches by timing, so a block's output for one image must not depend on
    which images came with it: bit for bit (BLAS rounds by the matmul's size)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h, w, 24)).astype(np.float32)
    dw_w, dw_b = rng.standard_normal((3, 3, 24), np.float32), rng.standard_normal(24, np.float32)
    pw_w, pw_b = rng.standard_normal((24, 40), np.float32), rng.standard_normal(40, np.float32)
    batch = cpu_schedule.ds_block_cpu(x, dw_w, dw_b, pw_w, pw_b, 1, 1, False)
    for i in range(n):
        one = cpu_schedule.ds_block_cpu(x[i : i + 1], dw_w, dw_b, pw_w, pw_b, 1, 1, False)
        np.testing.assert_array_equal(batch[i], one[0])


def test_missing_extension_is_an_import_error_not_a_slow_fallback() -> None:
    code = (
        "import sys; sys.modules['scratchd.cpu._cpu'] = None\n"
        "try:\n    import scratchd.cpu.schedule\nexcept ImportError:\n    sys.exit(7)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 7

"""Helpers for the gpu-marked tests of the ``<op>_cuda`` launchers.

Inputs are drawn fresh for every run (the seed is in every failure message), rounded to fp16
once, and that same rounded data goes to the numpy reference in float32: the comparison then
measures the kernel's arithmetic and output rounding only. Outputs are poisoned (NaN, or an
impossible byte) before the launch, so an element the kernel never wrote fails the check.
CuPy is imported inside the helpers: collecting these tests never needs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

REL_TOL = 1e-2


def cupy() -> Any:
    import cupy

    return cupy


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % 2**32)  # type: ignore[operator]
    return np.random.default_rng(seed), seed


def half(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """Random float32 values exactly representable in fp16."""
    return (rng.standard_normal(shape) * scale).astype(np.float16).astype(np.float32)


def block_data(
    n: int, h: int, w: int, ca: int, cb: int, cout: int, head: bool = False
) -> tuple[dict[str, np.ndarray], int]:
    """Random fp16-exact inputs of a DS block (``ds_block_ref``'s arguments by name) and
    their seed: ``x`` [n, h, w, ca], or with ``cb`` the join's [n, h/2, w/2, ca] and ``skip``
    [n, h, w, cb]; ``head_w``/``head_b`` with ``head``."""
    rng, seed = fresh_rng()
    cin = ca + cb
    data = {
        "x": half(rng, (n, h // 2, w // 2, ca) if cb else (n, h, w, ca)),
        "dw_w": half(rng, (3, 3, cin), 0.4),
        "dw_b": rng.normal(0, 0.3, cin).astype(np.float32),
        "pw_w": half(rng, (cin, cout), 1.0 / np.sqrt(cin)),
        "pw_b": rng.normal(0, 0.3, cout).astype(np.float32),
    }
    if cb:
        data["skip"] = half(rng, (n, h, w, cb))
    if head:
        data["head_w"] = rng.normal(0, 0.3, (cout, 1)).astype(np.float32)
        data["head_b"] = rng.normal(0, 0.3, 1).astype(np.float32)
    return data, seed


def dev(a: np.ndarray, dtype: type = np.float16) -> Any:
    return cupy().asarray(a.astype(dtype))


def poisoned(shape: tuple[int, ...], dtype: type) -> Any:
    cp = cupy()
    if np.issubdtype(dtype, np.floating):
        return cp.full(shape, np.nan, dtype=dtype)
    return cp.full(shape, 7, dtype=dtype)


def assert_close(
    got: Any, ref: np.ndarray, seed: int, what: str = "", rel: float = REL_TOL
) -> None:
    """Every element written and finite; ‖got − ref‖ / ‖ref‖ ≤ rel; max error ≤ rel · max|ref|."""
    g = cupy().asnumpy(got).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    ctx = f"{what} seed={seed} shape={r.shape}"
    assert g.shape == r.shape, f"{ctx}: shape {g.shape}"
    assert np.all(np.isfinite(g)), f"{ctx}: {np.count_nonzero(~np.isfinite(g))} unwritten/NaN"
    scale = max(float(np.abs(r).max()), 1e-6)
    err = np.abs(g - r)
    assert err.max() <= rel * scale, f"{ctx}: max error {err.max():.3g} vs scale {scale:.3g}"
    norm = max(float(np.linalg.norm(r)), 1e-12)
    assert np.linalg.norm(g - r) / norm <= rel, f"{ctx}: relative error too large"
